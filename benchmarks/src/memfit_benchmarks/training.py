"""The training configurations a sweep measures: which weights train, and what backward therefore saves.

``lora-all``: frozen base, PEFT LoRA r16 on every ``nn.Linear`` of the declared blocks. ``lora-attn``: frozen base,
LoRA on the ``nn.Linear`` s of the declared attention regions only (Flux: ``to_q, to_k, to_v, to_out.0`` and the
text stream's projections), the most common diffusion LoRA recipe. ``frozen``: nothing trains, the latent input
requires grad. ``full``: every weight trains, with a foreach AdamW step inside the timed step.

Example:
    >>> training = prepare(model, batch, TrainingConfig.LORA_ATTENTION, adapter, dtype=torch.bfloat16)  # doctest: +SKIP
    >>> ...  # measure
    >>> training.undo()  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from memfit import FamilyAdapter


class TrainingConfig(StrEnum):
    LORA_ALL = "lora-all"
    LORA_ATTENTION = "lora-attn"
    FROZEN = "frozen"
    FULL = "full"


_WHAT = {
    TrainingConfig.LORA_ALL: "frozen {dtype} base + PEFT LoRA r{rank} on every nn.Linear of the declared blocks",
    TrainingConfig.LORA_ATTENTION: "frozen {dtype} base + PEFT LoRA r{rank} on the nn.Linear layers of the declared "
    "attention regions only",
    TrainingConfig.FROZEN: "frozen {dtype} base, only the latent input requires grad",
    TrainingConfig.FULL: "every weight trainable ({dtype}), a foreach AdamW step (lr 1e-6) inside the timed step",
}
LATENT_KEYS = ("hidden_states", "inputs_embeds", "x")  # the input a frozen-base run differentiates


def describe(config: TrainingConfig, *, dtype: torch.dtype, rank: int = 16) -> str:
    """One line saying what a row of ``config`` trains (goes into the results)."""
    what = _WHAT[config].format(dtype=str(dtype).removeprefix("torch."), rank=rank)
    return f"{what}, batch 1, adapter loss, forward+backward"


def parse_configs(text: str) -> list[TrainingConfig]:
    """``"lora-all,lora-attn"`` (or ``all``) as configs.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if text == "all":
        return list(TrainingConfig)
    known = {c.value: c for c in TrainingConfig}
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(
            f"unknown training config(s) {unknown or [text]}: choose from {list(known)} or 'all'"
        )
    return [known[n] for n in names]


# The common attention-only LoRA recipe (diffusers' Flux/SD3 trainers): the image stream's projections.
ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")


def lora_targets(model: nn.Module, adapter: FamilyAdapter, *, attention_only: bool = False) -> list[str]:
    """Qualified names of every ``nn.Linear`` inside the declared blocks, or with ``attention_only`` the
    attention projections of :data:`ATTENTION_PROJECTIONS` inside the declared attention regions (every linear
    there when a region has none of those names).

    Raises:
        ValueError: nothing to put LoRA on (no linear there, or no attention region declared).
    """
    names = {id(m): n for n, m in model.named_modules()}
    targets = []
    for _path, _index, block in adapter.iter_blocks(model):
        scopes = adapter.attention_modules(block) if attention_only else [block]
        for scope in scopes:
            linears = [(name, m) for name, m in scope.named_modules() if isinstance(m, nn.Linear)]
            if attention_only and any(name.endswith(ATTENTION_PROJECTIONS) for name, _ in linears):
                linears = [(name, m) for name, m in linears if name.endswith(ATTENTION_PROJECTIONS)]
            targets += [f"{names[id(scope)]}.{name}" if name else names[id(scope)] for name, _ in linears]
    if not targets:
        where = "attention regions" if attention_only else "blocks"
        raise ValueError(f"family {adapter.name!r}: no nn.Linear inside the declared {where} to put LoRA on")
    return targets


def _add_lora(model: nn.Module, targets: list[str], rank: int, dtype: torch.dtype) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets), model)
    for name, p in model.named_parameters():
        is_lora = "lora_" in name
        p.requires_grad_(is_lora)
        if is_lora and p.dtype != dtype:
            p.data = p.data.to(dtype)


def _remove_lora(model: nn.Module) -> None:
    """Put each LoRA-wrapped layer's base layer back in its place."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, module.get_base_layer())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def latent_inputs(batch: dict[str, Any]) -> list[torch.Tensor]:
    """The floating-point tensors of the batch's latent input (the first of :data:`LATENT_KEYS` present).

    Raises:
        ValueError: the batch has none of those keys.
    """
    key = next((k for k in LATENT_KEYS if k in batch), None)
    tensors = [] if key is None else [t for t in _tensors(batch[key]) if t.is_floating_point()]
    if not tensors:
        raise ValueError(
            f"frozen config: no floating-point latent input under {LATENT_KEYS} in the batch (keys: {sorted(batch)})"
        )
    return tensors


def grad_leaves(batch: dict[str, Any]) -> list[torch.Tensor]:
    """Every input tensor (nested lists included) that requires grad."""
    return [t for value in batch.values() for t in _tensors(value) if t.requires_grad]


@dataclass
class Training:
    """A model and batch set up for one config; ``undo()`` puts them back as they were."""

    config: TrainingConfig
    description: str
    optimizer_factory: Callable[[], torch.optim.Optimizer] | None
    lora_targets: list[str]
    trainable_params: int
    total_params: int
    _undo: Callable[[], None] = field(repr=False)

    def info(self) -> dict[str, Any]:
        """What a results entry records about the config."""
        return {
            "config": self.config.value,
            "config_description": self.description,
            "lora_targets_count": len(self.lora_targets),
            "trainable_params": self.trainable_params,
            "total_params": self.total_params,
        }

    def undo(self) -> None:
        self._undo()


def prepare(
    model: nn.Module,
    batch: dict[str, Any],
    config: TrainingConfig,
    adapter: FamilyAdapter,
    *,
    dtype: torch.dtype,
    rank: int = 16,
) -> Training:
    """Set ``model`` and ``batch`` up for ``config`` (LoRA injected where it asks for it).

    Raises:
        ValueError: the config needs something the family or the batch lacks (see :func:`lora_targets`,
            :func:`latent_inputs`).
    """
    grads = {p: p.requires_grad for p in model.parameters()}
    had_peft_config = "peft_config" in model.__dict__
    model.requires_grad_(False)
    targets: list[str] = []
    inputs: list[torch.Tensor] = []
    optimizer_factory = None
    if config in (TrainingConfig.LORA_ALL, TrainingConfig.LORA_ATTENTION):
        targets = lora_targets(model, adapter, attention_only=config is TrainingConfig.LORA_ATTENTION)
        _add_lora(model, targets, rank, dtype)
    elif config is TrainingConfig.FROZEN:
        inputs = latent_inputs(batch)
        for tensor in inputs:
            tensor.requires_grad_(True)
    else:
        model.requires_grad_(True)
        optimizer_factory = lambda: torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)  # noqa: E731

    def undo() -> None:
        if targets:
            _remove_lora(model)
            if not had_peft_config:
                model.__dict__.pop("peft_config", None)
        for p, flag in grads.items():
            p.grad = None
            p.requires_grad_(flag)
        for tensor in inputs:
            tensor.grad = None
            tensor.requires_grad_(False)

    return Training(
        config=config,
        description=describe(config, dtype=dtype, rank=rank),
        optimizer_factory=optimizer_factory,
        lora_targets=targets,
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        total_params=sum(p.numel() for p in model.parameters()),
        _undo=undo,
    )
