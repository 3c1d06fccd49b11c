"""What a benchmark row measures: a memfit configuration, or a peer baseline users already have.

Pure Python (no torch): the rounds, the report and the headline import it too.

Example:
    >>> [m.name for m in select_modes("torch,ckpt-block")]
    ['torch', 'ckpt-block']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Peer(StrEnum):
    """A peer baseline: what a trainer runs today without memfit."""

    CHECKPOINT_BLOCK = "ckpt-block"
    CHECKPOINT_FFN = "ckpt-ffn"
    DIFFUSERS = "diffusers-ckpt"
    SAVE_ON_CPU = "save_on_cpu"


PEER_DESCRIPTIONS = {
    Peer.CHECKPOINT_BLOCK: "torch.utils.checkpoint (non-reentrant) around each declared block's forward",
    Peer.CHECKPOINT_FFN: "torch.utils.checkpoint (non-reentrant) around each declared FFN region",
    Peer.DIFFUSERS: "diffusers' own enable_gradient_checkpointing() (its default checkpoint function)",
    Peer.SAVE_ON_CPU: "torch.autograd.graph.save_on_cpu(pin_memory=True) around forward and loss",
}


@dataclass(frozen=True)
class Mode:
    """One row of a sweep.

    Args:
        name: the row's label in results and tables.
        config: the memfit configuration (``None``: memfit is not applied).
        peer: the peer baseline this row runs instead of memfit (``None`` for memfit rows).
        options: keyword arguments of ``memfit.apply`` besides the adapter (e.g. ``device``).
    """

    name: str
    config: dict[str, Any] | None = None
    peer: Peer | None = None
    options: dict[str, Any] = field(default_factory=dict)


def _cfg(backend: str | None = None, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    if backend is not None:
        cfg = {"gradient_checkpointing": True, "gradient_checkpointing_backend": backend}
    for key, value in extra.items():
        cfg[f"gradient_checkpointing_{key}"] = value
    return cfg


# memfit's own modes (the auto sweep's fixed modes)
MODES = [
    Mode("none", None),
    Mode("torch-ffn", _cfg("torch-ffn")),
    Mode("unsloth-ffn", _cfg("unsloth-ffn")),
    Mode("torch", _cfg("torch")),
    Mode("unsloth", _cfg("unsloth")),
    Mode("torch interval 2", _cfg("torch", interval=2)),
    Mode("torch interval 2 stride 4", _cfg("torch", interval=2, segment_stride=4)),
    Mode("offload_attention", _cfg(offload_attention=True)),
    Mode("torch-ffn + offload_attention", _cfg("torch-ffn", offload_attention=True)),
]
PEER_MODES = [Mode(peer.value, None, peer) for peer in Peer]

_BY_NAME = {m.name: m for m in MODES + PEER_MODES}
# Every row, each peer right after the memfit mode it is compared with: within a round the two are measured
# seconds apart.
ALL_MODES = [
    _BY_NAME[name]
    for name in (
        "none",
        "torch-ffn",
        "ckpt-ffn",
        "unsloth-ffn",
        "torch",
        "ckpt-block",
        "diffusers-ckpt",
        "unsloth",
        "torch interval 2",
        "torch interval 2 stride 4",
        "offload_attention",
        "save_on_cpu",
        "torch-ffn + offload_attention",
    )
]

_BLOCK_PEERS = (Peer.DIFFUSERS.value, Peer.CHECKPOINT_BLOCK.value)  # diffusers' first where the family has it
_FFN_PEERS = (Peer.CHECKPOINT_FFN.value,)
# memfit mode -> the peers it is compared with, the first measured one being its ``x_peer``
PEERS_OF: dict[str, tuple[str, ...]] = {
    "torch": _BLOCK_PEERS,
    "unsloth": _BLOCK_PEERS,
    "torch interval 2": _BLOCK_PEERS,
    "torch interval 2 stride 4": _BLOCK_PEERS,
    "torch-ffn": _FFN_PEERS,
    "unsloth-ffn": _FFN_PEERS,
    "torch-ffn + offload_attention": _FFN_PEERS,
    "offload_attention": (Peer.SAVE_ON_CPU.value, "none"),
}

_PEER_SWEEP = [  # every main memfit mode with every peer
    m.name
    for m in ALL_MODES
    if m.name not in ("torch interval 2", "torch interval 2 stride 4", "torch-ffn + offload_attention")
]
# Named sets for ``--modes``; ``checkpoint-peers``: the checkpointing modes and their checkpoint peers only (what the
# long sequences need, at a third of the time).
MODE_SETS = {
    "all": [m.name for m in ALL_MODES],
    "memfit": [m.name for m in MODES],
    "peers": _PEER_SWEEP,
    "checkpoint-peers": [n for n in _PEER_SWEEP if n not in ("none", "offload_attention", "save_on_cpu")],
}


def select_modes(spec: str | None) -> list[Mode]:
    """The modes of ``spec``: a set name of :data:`MODE_SETS` or comma-separated mode names (``None``: all),
    in :data:`ALL_MODES` order.

    Raises:
        ValueError: a name that is neither a mode nor a set, listing both.
    """
    names: set[str] = set()
    for item in (spec or "all").split(","):
        item = item.strip()
        if item in MODE_SETS:
            names.update(MODE_SETS[item])
        elif item in _BY_NAME:
            names.add(item)
        elif item:
            raise ValueError(
                f"unknown mode {item!r}: choose from the sets {sorted(MODE_SETS)} or the modes "
                f"{[m.name for m in ALL_MODES]}"
            )
    return [m for m in ALL_MODES if m.name in names]


def is_offload(mode: Mode) -> bool:
    """Whether a memfit mode parks tensors in pinned host memory through memfit's pool (needs CUDA)."""
    cfg = mode.config or {}
    return str(cfg.get("gradient_checkpointing_backend", "")).startswith("unsloth") or bool(
        cfg.get("gradient_checkpointing_offload_attention")
    )
