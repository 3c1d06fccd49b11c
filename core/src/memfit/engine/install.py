"""The region engine: hooks that open, continue and close frames on a model, and take themselves off again.

Two entry points feed the same :class:`~memfit.engine.frame.Frame` machinery:

* **block calls** — diffusers models route each block through
  ``self._gradient_checkpointing_func(block, *args)``; we install our own function with
  ``enable_gradient_checkpointing(gradient_checkpointing_func=...)``. Models without that
  hook get removable forward hooks on the declared blocks instead.
* **sub-module regions** (FFN chains) — removable forward pre/post hooks on the region's
  modules.

``remove()`` restores every attribute it touched exactly (present/absent and value) and
removes every hook, so the model's state_dict and forward are as before.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from memfit.engine import state
from memfit.engine.frame import Frame, FrameStats
from memfit.engine.hooks import HookRuns, eager_hook
from memfit.engine.stash import DeviceStash, Stash
from memfit.errors import MemfitWarning
from memfit.plan import BlockEntry


@dataclass(frozen=True)
class RegionSite:
    """One module's place in a region: the region's key, its chain of modules, and where this one sits."""

    key: Any
    modules: tuple[nn.Module, ...]
    position: int
    scope: str
    stash_factory: Callable[[], Stash] | None = None  # None: the engine's (a per-block plan mixes them)


@dataclass
class _AttrSnapshot:
    module: nn.Module
    saved: dict[str, tuple[bool, Any]] = field(default_factory=dict)

    _NAMES = ("gradient_checkpointing", "_gradient_checkpointing_func")

    @classmethod
    def take(cls, module: nn.Module) -> _AttrSnapshot:
        snap = cls(module)
        for name in cls._NAMES:
            snap.saved[name] = (name in module.__dict__, module.__dict__.get(name))
        return snap

    def restore(self) -> None:
        for name, (present, value) in self.saved.items():
            if present:
                self.module.__dict__[name] = value
            else:
                self.module.__dict__.pop(name, None)


class StepListener(Protocol):
    """Told when a forward of the model starts, returns or raises (the offload session, the attention offloader)."""

    def new_step(self) -> None: ...

    def end_step(self) -> None: ...

    def abort_step(self) -> None: ...


class RegionEngine:
    """Runs frames for one model: decides, per call, whether it opens, continues or closes a frame.

    Built by :func:`memfit.install.install` from a plan; it installs no model hooks of its own: the
    installation's owner calls :meth:`begin_forward` / :meth:`end_forward` around each forward.

    Args:
        model: the top-level model.
        stats: the counters every frame updates (shared by the plans of one handle).
        block_sites: whole-block regions: each checkpointed block's site.
        known_blocks: every block the plan lists; a known block without a site runs normally (stride gap).
        block_entry: ``DIFFUSERS`` (the model's checkpointing function) or ``HOOKS`` (block forward hooks).
        checkpoint_routed: a block the model routes through its checkpointing function without a site of its
            own is a region of its own (the generic path); else it runs normally when known, or is counted as
            undeclared and checkpointed alone.
        hook_blocks: also put forward hooks on the blocks with sites (catches lists the model does not route);
            off on the generic path, which trusts diffusers' routing.
        locate: re-resolves the sub-block (FFN chain) sites from the declared paths; called at install and at
            every forward start, so the hooks follow modules PEFT replaces after installation.
        step_listeners: told when a forward starts, returns or raises.
        stash_factory: the default :class:`Stash` of a new frame (a site may name its own).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        stats: FrameStats,
        block_sites: Mapping[nn.Module, RegionSite] | None = None,
        known_blocks: Iterable[nn.Module] = (),
        block_entry: BlockEntry = BlockEntry.HOOKS,
        checkpoint_routed: bool = False,
        hook_blocks: bool = True,
        locate: Callable[[], dict[nn.Module, RegionSite]] | None = None,
        step_listeners: Sequence[StepListener] = (),
        stash_factory: Callable[[], Stash] = DeviceStash,
    ) -> None:
        if block_entry is BlockEntry.AUTO:
            raise ValueError("RegionEngine needs a resolved block entry (DIFFUSERS or HOOKS), got AUTO")
        self.model = model
        self.stats = stats
        self.block_sites: dict[nn.Module, RegionSite] = dict(block_sites or {})
        self.known_blocks: set[nn.Module] = set(known_blocks)
        self.block_entry = block_entry
        self.checkpoint_routed = checkpoint_routed
        self.hook_blocks = hook_blocks
        self._locate = locate
        self.hook_sites: dict[nn.Module, RegionSite] = locate() if locate is not None else {}
        self.step_listeners = tuple(step_listeners)
        self.stash_factory = stash_factory
        self._open: Frame | None = None
        self._region_handles: dict[nn.Module, list[torch.utils.hooks.RemovableHandle]] = {}
        self._eager_bodies: list[nn.Module] = []
        self.resyncs = 0  # times the sub-block sites were re-resolved (modules replaced after install)
        self._snapshots: list[_AttrSnapshot] = []
        self._local = threading.local()  # stack of (module, frame) begun by pre-hooks
        self.undeclared_block_calls = 0
        self.sub_block_hooks = HookRuns("sub-block region")  # runs of the FFN-chain region hooks

    # -- installation -------------------------------------------------------------------------------------------

    def install(self) -> None:
        """Install the block entry and the region hooks."""
        routes = self.block_entry is BlockEntry.DIFFUSERS and (self.block_sites or self.checkpoint_routed)
        if routes:
            self._snapshots = [_AttrSnapshot.take(m) for m in self.model.modules()]
            self.model.enable_gradient_checkpointing(gradient_checkpointing_func=self.checkpoint_block)
        else:
            self._switch_off_model_checkpointing()
        # Hooks on the declared blocks too: a block list the model does not route through its checkpointing
        # function is still caught. A block entered through `checkpoint_block` is already inside a region
        # call, so its hooks then do nothing.
        if self.hook_blocks:
            for module in self.block_sites:
                self._install_region_hooks(module)
        for module in self.hook_sites:
            self._install_region_hooks(module, eager_body=True)

    def _switch_off_model_checkpointing(self) -> None:
        """Blocks entered through hooks: the model's own checkpointing (diffusers' or transformers'
        ``gradient_checkpointing`` flags) would checkpoint every block a second time. Turn it off while
        memfit is applied (``remove()`` restores it) and say so once."""
        on = [m for m in self.model.modules() if m.__dict__.get("gradient_checkpointing") is True]
        if not on:
            return
        warnings.warn(
            f"{type(self.model).__name__} had its own gradient checkpointing switched on; memfit switched it off "
            f"while applied (it would checkpoint every block twice). handle.remove() switches it back on.",
            MemfitWarning,
            stacklevel=5,
        )
        for module in on:
            self._snapshots.append(_AttrSnapshot.take(module))
            module.__dict__["gradient_checkpointing"] = False

    def _install_region_hooks(self, module: nn.Module, *, eager_body: bool = False) -> None:
        handles = self._region_handles.setdefault(module, [])
        handles.append(module.register_forward_pre_hook(eager_hook(self._region_pre_hook), with_kwargs=True))
        handles.append(
            module.register_forward_hook(
                eager_hook(self._region_post_hook), with_kwargs=True, always_call=True
            )
        )
        if eager_body and "forward" not in module.__dict__:
            # Inside a compiled block (compile_repeated_blocks), a sub-block region's body would be compiled
            # in forward but run eagerly in the recompute, and the two save different tensors. Running the
            # region eagerly in both keeps them identical (the rest of the block stays compiled).
            module.forward = eager_hook(module.forward)
            self._eager_bodies.append(module)

    def _remove_region_hooks(self, module: nn.Module) -> None:
        for handle in self._region_handles.pop(module, []):
            handle.remove()
        if module in self._eager_bodies:
            self._eager_bodies.remove(module)
            module.__dict__.pop("forward", None)

    def remove(self) -> None:
        self._close_open()
        for module in list(self._region_handles):
            self._remove_region_hooks(module)
        for snap in self._snapshots:
            snap.restore()
        self._snapshots.clear()

    # -- modules replaced after install (PEFT add_adapter / unload_lora) ------------------------------------------

    def _sync_sites(self) -> None:
        if self._locate is None:
            return
        current = self._locate()
        if current.keys() == self.hook_sites.keys() and all(
            current[m].modules == self.hook_sites[m].modules for m in current
        ):
            return
        for module in list(self.hook_sites):
            self._remove_region_hooks(module)
        self.hook_sites = current
        for module in self.hook_sites:
            self._install_region_hooks(module, eager_body=True)
        self.resyncs += 1

    # -- block entry through diffusers' gradient checkpointing hook ------------------------------------------------

    def checkpoint_block(self, block: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The ``gradient_checkpointing_func`` diffusers calls for every block."""
        if not state.regions_may_open():
            return block(*args, **kwargs)
        site = self.block_sites.get(block)
        if site is None:
            if block in self.known_blocks:
                return block(*args, **kwargs)  # outside every segment: runs normally
            if self.block_sites:
                # A block the adapter did not declare, routed to us by the model: checkpoint it alone
                # (what diffusers would do) rather than silently running it unsaved.
                self.undeclared_block_calls += 1
            site = RegionSite(("block", "undeclared", id(block)), (block,), 0, "block")
        frame = self._frame_for(site, block)
        if frame is None:
            return block(*args, **kwargs)
        frame.begin_call(block, args, kwargs)
        try:
            out = block(*args, **kwargs)
        except BaseException:
            frame.abort_call()
            self._forget(frame)
            raise
        frame.end_call(out)
        self._forget_if_closed(frame)
        return out

    # -- hook entry -------------------------------------------------------------------------------------------------

    def _stack(self) -> list[tuple[nn.Module, Frame]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _region_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        site = self.hook_sites.get(module)
        if site is not None:
            self.sub_block_hooks.count += 1
        else:
            site = self.block_sites.get(module)
            if site is None:
                return
        if not state.regions_may_open():
            return
        frame = self._frame_for(site, module)
        if frame is None:
            return
        frame.begin_call(module, args, kwargs)
        self._stack().append((module, frame))

    def _region_post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        stack = self._stack()
        if not stack or stack[-1][0] is not module:
            return
        _, frame = stack.pop()
        if output is None and sys.exc_info()[0] is not None:  # forward raised; always_call hook
            frame.abort_call()
            self._forget(frame)
            return
        frame.end_call(output)
        self._forget_if_closed(frame)

    # -- frame bookkeeping ------------------------------------------------------------------------------------------

    def _frame_for(self, site: RegionSite, module: nn.Module) -> Frame | None:
        frame = self._open
        if frame is not None and frame.key == site.key and frame.expects(module):
            return frame
        self._close_open()
        stash = (site.stash_factory or self.stash_factory)()
        frame = Frame(site.key, list(site.modules[site.position :]), site.scope, stash, self.stats)
        self._open = frame
        return frame

    def _close_open(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None

    def _forget(self, frame: Frame) -> None:
        if self._open is frame:
            self._open = None

    def _forget_if_closed(self, frame: Frame) -> None:
        if frame.closed:
            self._forget(frame)

    def begin_forward(self) -> None:
        """The model's forward starts."""
        self._close_open()
        self.sub_block_hooks.cancel()
        if torch.is_grad_enabled():
            self._sync_sites()
            self.sub_block_hooks.begin()
            for listener in self.step_listeners:
                listener.new_step()

    def end_forward(self, *, failed: bool) -> None:
        """The model's forward returned (or raised: ``failed``).

        Raises:
            MemfitError: a forward with grad ran none of the sub-block region hooks (see :class:`HookRuns`).
        """
        self._close_open()
        for listener in self.step_listeners:
            listener.abort_step() if failed else listener.end_step()
        if failed:
            self.sub_block_hooks.cancel()
        else:
            self.sub_block_hooks.end(len(self.hook_sites))


def chain_sites(
    key_prefix: tuple,
    chain: Sequence[nn.Module],
    scope: str,
    *,
    stash_factory: Callable[[], Stash] | None = None,
) -> list[tuple[nn.Module, RegionSite]]:
    """Sites for a chain of modules that form one region."""
    modules = tuple(chain)
    return [(m, RegionSite(key_prefix, modules, i, scope, stash_factory)) for i, m in enumerate(modules)]
