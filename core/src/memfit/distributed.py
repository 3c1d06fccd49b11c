"""Composition with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Supported order: **shard first, then apply memfit** (blocks, then the root, with ``fully_shard``;
then ``memfit.apply``). FSDP's forward pre-hook (all-gather the block's parameters) then runs before
memfit's region hooks and its post-hook (reshard) after them, so memfit records and replays each block
with the unsharded parameters and FSDP's cast inputs, and a recompute in backward runs while FSDP's
pre-backward hook holds the block unsharded (FSDP skips its forward hooks then). Blocks that
``fully_shard`` turned into ``FSDPModule`` subclasses still match the adapter's block specs (MRO lookup).

The other order — ``fully_shard`` called on a model memfit is already applied to — nests FSDP's hooks
inside memfit's regions; it is refused at the next forward with a :class:`~memfit.errors.MemfitError`
that says how to fix it, before any collective runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from torch import nn

from memfit.errors import MemfitError

# Where FSDP2's module class lives: the public package (torch >= 2.6), and the older composable layout.
_FSDP_PACKAGES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def _fsdp_module_class() -> type | None:
    """FSDP2's ``FSDPModule`` if FSDP has been imported, else None.

    Looked up in ``sys.modules`` instead of imported: importing ``torch.distributed.fsdp`` costs more than a
    second, and no module can have been passed to ``fully_shard`` before FSDP itself was imported.
    """
    for package in _FSDP_PACKAGES:
        cls = getattr(sys.modules.get(package), "FSDPModule", None)
        if cls is not None:
            return cls
    return None


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` has been applied to ``module`` (never imports FSDP)."""
    cls = _fsdp_module_class()
    return cls is not None and isinstance(module, cls)


class ShardOrderGuard:
    """A forward pre-hook on the model that refuses ``fully_shard`` applied after ``memfit.apply``.

    Args:
        model: the model memfit was applied to.
        watched: the modules ``fully_shard`` is usually applied to (the root and the blocks).
    """

    def __init__(self, model: nn.Module, watched: Iterable[nn.Module]) -> None:
        self.model = model
        self.watched = [m for m in dict.fromkeys([model, *watched]) if not is_fsdp_module(m)]

    def install(self) -> object:
        return self.model.register_forward_pre_hook(self, prepend=True)

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if not self.watched:
            return
        late = [m for m in self.watched if is_fsdp_module(m)]
        if late:
            raise MemfitError(
                f"fully_shard was applied to {type(late[0]).__name__} after memfit.apply; memfit must be applied "
                f"after sharding (its region hooks must run inside FSDP's unshard/reshard hooks). Fix: call "
                f"handle.remove(), then memfit.apply(model, config) again now that the model is sharded — or "
                f"shard the blocks and the root with fully_shard before the first memfit.apply."
            )
