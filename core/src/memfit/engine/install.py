"""The region engine: hooks that open, continue and close frames on a model, and take themselves off again.

Two entry points feed the same :class:`~memfit.engine.frame.Frame` machinery:

* **block calls** — diffusers models route each block through
  ``self._gradient_checkpointing_func(block, *args)``; we install our own function with
  ``enable_gradient_checkpointing(gradient_checkpointing_func=...)``. Models without that
  hook get removable forward hooks on the declared blocks instead.
* **sub-module regions** (FFN chains) — removable forward pre/post hooks on the region's
  modules.

``remove()`` restores every attribute it touched exactly (present/absent and value), including whatever
the model's own ``enable_gradient_checkpointing`` changed, and removes every hook, so the model's
state_dict and forward are as before.

Block entry.  Trainer code does not always call the checkpointing function the way diffusers does: some
models pass a closure or a ``functools.partial`` over the block, and keywords of
``torch.utils.checkpoint.checkpoint`` (``use_reentrant=False``). Those keywords are taken off (a
``context_fn`` is refused: memfit cannot honour a selective-checkpoint policy). A closure is run as it is:
the declared block inside it carries memfit's region hooks too, and those open or continue its region, so
the interval and stride plan holds exactly as with a block passed directly. A closure in which no declared
block ran is counted as an undeclared block call and said once (never silently left unsaved).
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

from memfit.distributed import is_fsdp_module
from memfit.engine import state
from memfit.engine.frame import Frame, FrameStats
from memfit.engine.hooks import Attached, HookRuns, attached_hook, detached_forward, eager_hook
from memfit.engine.replay import TREES
from memfit.engine.stash import DeviceStash, Stash
from memfit.errors import MemfitError, MemfitWarning
from memfit.plan import BlockEntry


@dataclass(frozen=True)
class RegionSite:
    """One module's place in a region: the region's key, its chain of modules, and where this one sits."""

    key: Any
    modules: tuple[nn.Module, ...]
    position: int
    scope: str
    stash_factory: Callable[[], Stash] | None = None  # None: the engine's (a per-block plan mixes them)


class _Restorer(Protocol):
    def restore(self) -> None: ...


@dataclass
class _AttrSnapshot:
    """Named attributes of one module (present or not, and their values), to put back exactly."""

    module: nn.Module
    saved: dict[str, tuple[bool, Any]] = field(default_factory=dict)

    @classmethod
    def take(cls, module: nn.Module, names: Sequence[str]) -> _AttrSnapshot:
        snap = cls(module)
        for name in names:
            snap.saved[name] = (name in module.__dict__, module.__dict__.get(name))
        return snap

    def restore(self) -> None:
        for name, (present, value) in self.saved.items():
            if present:
                self.module.__dict__[name] = value
            else:
                self.module.__dict__.pop(name, None)


_MISSING = object()


@dataclass
class ModelSnapshot:
    """Every module's instance attributes and the model's config, before a call that may change them (the
    model's own ``enable_gradient_checkpointing``, which can set switches memfit does not know of)."""

    model: nn.Module
    attrs: dict[nn.Module, dict[str, Any]]
    config_attrs: dict[str, Any] | None
    config_items: dict[Any, Any] | None

    @classmethod
    def take(cls, model: nn.Module) -> ModelSnapshot:
        config = getattr(model, "config", None)
        return cls(
            model,
            {m: dict(m.__dict__) for m in model.modules()},
            dict(vars(config)) if config is not None and hasattr(config, "__dict__") else None,
            dict(config) if isinstance(config, Mapping) else None,
        )

    def changes(self) -> _Restorer:
        """What changed since :meth:`take`, as something that puts it back."""
        restorers: list[_Restorer] = []
        for module, before in self.attrs.items():
            after = module.__dict__
            changed = [
                k
                for k in before.keys() | after.keys()
                if before.get(k, _MISSING) is not after.get(k, _MISSING)
            ]
            if changed:
                restorers.append(
                    _DictRestorer(module.__dict__, {k: before.get(k, _MISSING) for k in changed})
                )
        config = getattr(self.model, "config", None)
        if self.config_attrs is not None and config is not None and hasattr(config, "__dict__"):
            restorers.append(_DictRestorer.diff(vars(config), self.config_attrs))
        if self.config_items is not None and isinstance(config, Mapping):
            restorers.append(_DictRestorer.diff(config, self.config_items))
        return _Restorers(restorers)


@dataclass
class _DictRestorer:
    """Puts keys of a dict back as they were (a module's ``__dict__``, a config's attributes or mapping: written
    through ``dict``'s own methods, since diffusers' ``FrozenDict`` refuses item assignment)."""

    target: Mapping[Any, Any]
    values: dict[Any, Any]  # key -> value before (_MISSING: absent)

    @classmethod
    def diff(cls, target: Mapping[Any, Any], before: dict[Any, Any]) -> _DictRestorer:
        keys = [
            k for k in before.keys() | target.keys() if before.get(k, _MISSING) is not target.get(k, _MISSING)
        ]
        return cls(target, {k: before.get(k, _MISSING) for k in keys})

    def restore(self) -> None:
        for key, value in self.values.items():
            if value is _MISSING:
                dict.pop(self.target, key, None)  # type: ignore[arg-type]
            else:
                dict.__setitem__(self.target, key, value)  # type: ignore[index]


@dataclass
class _Restorers:
    parts: list[_Restorer]

    def restore(self) -> None:
        for part in reversed(self.parts):
            part.restore()


def plain_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A deep copy's stand-in for memfit's checkpoint function: runs the block, recomputes nothing (the copy
    has no memfit installed; torch.utils.checkpoint keywords are dropped)."""
    for key in CHECKPOINT_KEYWORDS:
        kwargs.pop(key, None)
    return function(*args, **kwargs)


# keywords torch.utils.checkpoint.checkpoint accepts besides the function's own arguments
CHECKPOINT_KEYWORDS = ("use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug")


class ModelSwitch(Protocol):
    """A checkpointing switch of the model's own (:class:`memfit.adapters.spec.CheckpointSwitch`): the model
    attribute and/or config key holding it ("" : none)."""

    attribute: str
    config_key: str


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
        model_switch: the model's own checkpointing switch its adapter declares, besides diffusers' flags.
        switch_off_model_checkpointing: blocks not routed through the model's checkpointing function: switch the
            model's own checkpointing off while installed (False for a plan that installs nothing: the model
            then runs untouched).
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
        model_switch: ModelSwitch | None = None,
        switch_off_model_checkpointing: bool = True,
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
        self._sites_generation = TREES.watched_generation()  # see _sync_sites
        self.step_listeners = tuple(step_listeners)
        self.stash_factory = stash_factory
        self.model_switch = model_switch
        self.switch_off_model_checkpointing = switch_off_model_checkpointing
        self._open: Frame | None = None
        self._region_handles: dict[nn.Module, list[torch.utils.hooks.RemovableHandle]] = {}
        self._eager_bodies: list[nn.Module] = []
        self.resyncs = 0  # times the sub-block sites were re-resolved (modules replaced after install)
        self._snapshots: list[_Restorer] = []
        self._local = threading.local()  # stack of (module, frame) begun by pre-hooks
        self.undeclared_block_calls = 0
        self.block_hook_runs = 0  # runs of the region pre-hook on declared blocks (see _run_closure)
        self._warned_closure = False
        self.sub_block_hooks = HookRuns("sub-block region")  # runs of the FFN-chain region hooks

    # -- installation -------------------------------------------------------------------------------------------

    def install(self) -> None:
        """Install the block entry and the region hooks."""
        routes = self.block_entry is BlockEntry.DIFFUSERS and (self.block_sites or self.checkpoint_routed)
        if routes:
            # whatever the model's enable method changes (its flags, its config, extra switches of its own) is
            # put back exactly by remove()
            snapshot = ModelSnapshot.take(self.model)
            checkpoint = Attached(self.checkpoint_block, detached=lambda memo: plain_checkpoint)
            self.model.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint)
            self._snapshots.append(snapshot.changes())
        elif self.switch_off_model_checkpointing:
            self._switch_off_model_checkpointing()
        # Hooks on the declared blocks too: a block list the model does not route through its checkpointing
        # function is still caught. A block entered through `checkpoint_block` is already inside a region
        # call, so its hooks then do nothing.
        if self.hook_blocks:
            # routed: every known block, so a stride gap's block too tells a closure entry that it ran
            hooked = [*self.block_sites, *self.known_blocks] if routes else list(self.block_sites)
            for module in dict.fromkeys(hooked):
                self._install_region_hooks(module)
        for module in self.hook_sites:
            self._install_region_hooks(module, eager_body=True)

    def _switch_off_model_checkpointing(self) -> None:
        """Blocks entered through hooks: the model's own checkpointing (diffusers' or transformers'
        ``gradient_checkpointing`` flags, and the model's own switch its adapter declares) would run memfit's
        regions nested inside the model's own checkpoint calls, paying recompute for nothing. Turn it off while
        memfit is applied (``remove()`` restores it exactly) and say so once."""
        flags = [m for m in self.model.modules() if m.__dict__.get("gradient_checkpointing") is True]
        switch_was_on, switch_restorers = _switch_off_own(self.model, self.model_switch)
        self._snapshots.extend(switch_restorers)
        if not flags and not switch_was_on:
            return
        what = ([f"gradient_checkpointing on {len(flags)} module(s)"] if flags else []) + switch_was_on
        warnings.warn(
            f"{type(self.model).__name__} had its own gradient checkpointing switched on ({', '.join(what)}); "
            f"memfit switched it off while applied: memfit's regions would run nested inside the model's own "
            f"checkpoint calls and pay recompute for nothing. handle.remove() switches it back on.",
            MemfitWarning,
            stacklevel=5,
        )
        for module in flags:
            self._snapshots.append(_AttrSnapshot.take(module, ("gradient_checkpointing",)))
            module.__dict__["gradient_checkpointing"] = False

    def _install_region_hooks(self, module: nn.Module, *, eager_body: bool = False) -> None:
        # The region's boundary is outside the module's other forward pre-hooks, as torch.utils.checkpoint's is
        # around a module call: a hook that returns new arguments runs again in the recompute on the arguments
        # the forward got, not twice on the same ones. Except inside FSDP2's hooks (a sharded block): FSDP casts
        # and unshards around the region, and skips its forward hooks in the recompute.
        handles = self._region_handles.setdefault(module, [])
        handles.append(
            module.register_forward_pre_hook(
                attached_hook(self._region_pre_hook), with_kwargs=True, prepend=not is_fsdp_module(module)
            )
        )
        handles.append(
            module.register_forward_hook(
                attached_hook(self._region_post_hook), with_kwargs=True, always_call=True
            )
        )
        if eager_body and "forward" not in module.__dict__:
            # Inside a compiled block (compile_repeated_blocks), a sub-block region's body would be compiled
            # in forward but run eagerly in the recompute, and the two save different tensors. Running the
            # region eagerly in both keeps them identical (the rest of the block stays compiled).
            module.forward = Attached(eager_hook(module.forward), detached=detached_forward(module))
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
        for snap in reversed(self._snapshots):
            snap.restore()
        self._snapshots.clear()

    # -- modules replaced after install (PEFT add_adapter / unload_lora) ------------------------------------------

    def _sync_sites(self) -> None:
        # Sites change only when modules are registered (PEFT replacing a linear by its LoRA layer); while the
        # registrations are watched and none happened, locating them again (the adapter's FFN chains of every
        # block, ~0.5 ms on a slow host) is skipped: it runs at each forward's start, before any kernel is queued.
        if self._locate is None:
            return
        generation = TREES.watched_generation()
        if generation is not None and generation == self._sites_generation:
            return
        self._sites_generation = generation
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

    def checkpoint_block(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The ``gradient_checkpointing_func`` the model calls for every block (see "Block entry").

        Accepts what ``torch.utils.checkpoint.checkpoint`` accepts: the keywords of :data:`CHECKPOINT_KEYWORDS`
        are taken off (memfit's regions always replay RNG state and never re-enter; a ``context_fn`` is refused).
        """
        if kwargs:
            _take_checkpoint_keywords(kwargs)
        if not state.regions_may_open():
            return function(*args, **kwargs)
        if not isinstance(function, nn.Module) and not self.checkpoint_routed:
            return self._run_closure(function, args, kwargs)
        site = self.block_sites.get(function)
        if site is None:
            if function in self.known_blocks:
                return function(*args, **kwargs)  # outside every segment: runs normally
            if self.block_sites:
                # A block the adapter did not declare, routed to us by the model: checkpoint it alone
                # (what diffusers would do) rather than silently running it unsaved.
                self.undeclared_block_calls += 1
            site = RegionSite(("block", "undeclared", id(function)), (function,), 0, "block")
        frame = self._frame_for(site, function)
        frame.begin_call(function, args, kwargs)
        try:
            out = function(*args, **kwargs)
        except BaseException:
            frame.abort_call()
            self._forget(frame)
            raise
        frame.end_call(out)
        self._forget_if_closed(frame)
        return out

    def _run_closure(self, function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The model passed a closure (or a partial) over a block, not the block: run it, and let the declared
        block's own region hooks open or continue its region, so the interval/stride plan holds. A closure in
        which no declared block ran was not checkpointed: counted as undeclared, and said once."""
        before = self.block_hook_runs
        out = function(*args, **kwargs)
        if self.block_hook_runs == before:
            self.undeclared_block_calls += 1
            if not self._warned_closure:
                self._warned_closure = True
                warnings.warn(
                    f"{type(self.model).__name__} called its checkpointing function with "
                    f"{getattr(function, '__qualname__', type(function).__name__)}, in which no block memfit knows "
                    f"ran: that call was not checkpointed. Declare the block class it runs in the family's "
                    f"adapter.",
                    MemfitWarning,
                    stacklevel=3,
                )
        return out

    # -- hook entry -------------------------------------------------------------------------------------------------

    def forget_open_calls(self) -> None:
        """Drop this thread's calls begun by pre-hooks and the open frame (after an interrupted forward; their
        saved-tensor hooks were undone by :func:`memfit.engine.state.undo_open_calls`)."""
        self._stack().clear()
        self._close_open()

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
            self.block_hook_runs += 1
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
            self.stats.largest_entry = 0  # this forward's own (see memfit.engine.frame.CUT_TAIL_STATE)
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


def _switch_off_own(model: nn.Module, switch: ModelSwitch | None) -> tuple[list[str], list[_Restorer]]:
    """Turn the model's own checkpointing switch off where it is on: the model attribute, the config's attribute,
    the config's item (diffusers' FrozenDict holds both). Returns what was on (for the warning) and what puts it
    back exactly."""
    if switch is None:
        return [], []
    was_on: list[str] = []
    restorers: list[_Restorer] = []
    name, key = switch.attribute, switch.config_key
    if name and getattr(model, name, False):
        was_on.append(f"{name}={getattr(model, name)!r}")
        restorers.append(_AttrSnapshot.take(model, (name,)))
        model.__dict__[name] = False
    config = getattr(model, "config", None)
    if key and config is not None:
        before = len(restorers)
        if hasattr(config, "__dict__") and vars(config).get(key):
            restorers.append(_DictRestorer(vars(config), {key: vars(config)[key]}))
            vars(config)[key] = False
        if isinstance(config, dict) and config.get(key):
            restorers.append(_DictRestorer(config, {key: config[key]}))
            dict.__setitem__(config, key, False)  # dict's own: a FrozenDict refuses item assignment
        if len(restorers) > before:
            was_on.append(f"config.{key}")
    return was_on, restorers


def _take_checkpoint_keywords(kwargs: dict[str, Any]) -> None:
    """Remove ``torch.utils.checkpoint`` keywords from a block call's keywords (see :meth:`checkpoint_block`)."""
    context_fn = kwargs.pop("context_fn", None)
    if context_fn is not None and getattr(context_fn, "__name__", "") != "noop_context_fn":
        raise MemfitError(
            "the model called its checkpointing function with a context_fn (e.g. a selective-checkpoint "
            "policy); memfit's regions do not run one. Leave context_fn unset while memfit is applied, or use "
            "torch.utils.checkpoint without memfit."
        )
    for key in CHECKPOINT_KEYWORDS:
        kwargs.pop(key, None)


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
