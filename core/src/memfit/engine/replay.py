"""What a region call ran under, captured in forward and put back for the recompute.

Non-reentrant checkpoint semantics: the recompute must compute exactly what the forward
computed. So it replays, per call:

* the RNG state (dropout draws the same numbers) without disturbing the caller's stream;
* the autocast state (same dtypes);
* the scaled-dot-product-attention backend selection (``sdpa_kernel`` around the forward
  only: a different kernel saves different tensors);
* the state of PEFT tuner layers inside the call's module (LoRA ``scaling``, active and
  disabled adapters: diffusers' ``joint_attention_kwargs={"scale": s}`` sets the scale
  for the forward's duration only).

And it checks what it cannot replay: parameters and buffers the call's module reads are
compared by version counter (an optimizer step or an in-place edit between forward and
backward would make the recompute use the new values).

Cost. Everything above is read per call, so it is kept flat: the module's parameters,
buffers and tuner layers come from :data:`TREES`, a cache that is only rebuilt after a
module, parameter or buffer was registered somewhere (PEFT's ``add_adapter``, a model
built, a weight replaced): no module-tree walk per call. Importing memfit registers the
three global registration hooks this needs (each only bumps a counter).

Random numbers and threads. The recompute sets the process-wide generator to the state
captured before the call and restores the caller's afterwards, as ``torch.utils.checkpoint``
does. Another thread that draws random numbers from the same generator *while* a region
call runs (in forward or in its recompute) changes what that call draws, and the
recompute no longer matches: torch has one default generator per device, shared by all
threads, so neither memfit nor ``torch.utils.checkpoint`` can isolate a call from it.
Draws by other threads between the forward and the backward do not matter.
"""

from __future__ import annotations

import functools
import operator
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
VERSION = operator.attrgetter("_version")

# -- SDPA backend selection ---------------------------------------------------------------------------------------
# ``torch.nn.attention.sdpa_kernel`` flips these process-wide flags; the names differ across torch versions, so the
# getters and setters are looked up once.
_SDPA_ACCESSORS = (
    *(
        (f"_get_{n}_sdp_enabled", f"_set_sdp_use_{n}")
        for n in ("flash", "mem_efficient", "math", "cudnn", "overrideable", "fa3", "fa4")
    ),
    ("_get_sdp_priority_order", "_set_sdp_priority_order"),
    ("_get_math_sdp_allow_fp16_bf16_reduction", "_set_math_sdp_allow_fp16_bf16_reduction"),
)
_SDPA_STATE = tuple(
    (getattr(torch._C, get), getattr(torch._C, set_))
    for get, set_ in _SDPA_ACCESSORS
    if hasattr(torch._C, get) and hasattr(torch._C, set_)
)
_SDPA_STATE_GET = tuple(get for get, _ in _SDPA_STATE)


def _sdpa_state() -> tuple:
    """Every SDPA selection flag, the priority order and the math reduction flag (one C call each)."""
    return tuple(map(operator.call, _SDPA_STATE_GET))


def _set_sdpa_state(sdpa: tuple) -> None:
    for (_, set_), value in zip(_SDPA_STATE, sdpa, strict=True):
        set_(value)


# -- what a module's call reads: parameters, buffers, tuner layers (cached) -------------------------------------------


class ModuleTree:
    """What one module's call reads, for the checks and the replay: built once per module, per generation."""

    __slots__ = ("generation", "tensors", "names", "buffers", "tuners")

    def __init__(self, module: nn.Module, generation: int) -> None:
        self.generation = generation
        params = [(n, t) for n, t in module.named_parameters() if t is not None]
        buffers = [(n, t) for n, t in module.named_buffers() if t is not None]
        self.tensors = tuple(t for _, t in params + buffers)
        self.names = tuple(n for n, _ in params + buffers)
        self.buffers = len(buffers)  # a module may update its buffers itself (running statistics)
        base = _tuner_base()
        layers = tuple(m for m in module.modules() if isinstance(m, base)) if base is not None else ()
        scaled = tuple(m for m in layers if type(m.__dict__.get("scaling")) is dict)
        # PEFT tuner layers (all, and those with a LoRA-style ``scaling`` dict); empty without PEFT
        self.tuners: tuple[tuple[nn.Module, ...], tuple[nn.Module, ...]] | None = (
            (scaled, layers) if layers else None
        )

    def versions(self) -> tuple[int, ...]:
        return tuple(map(VERSION, self.tensors))

    def name_of(self, tensor: torch.Tensor) -> str | None:
        """The name of ``tensor`` (or of the parameter it is a view of) in this module, if it is one of its own."""
        target = tensor._base if tensor._base is not None else tensor
        for name, t in zip(self.names, self.tensors, strict=True):
            if t is target:
                return name
        return None


def _tuner_base() -> type | None:
    """PEFT's tuner-layer base class if PEFT is imported (a model without PEFT has no tuner layers)."""
    utils = sys.modules.get("peft.tuners.tuners_utils")
    return getattr(utils, "BaseTunerLayer", None) if utils is not None else None


class ModuleTrees:
    """Per-module :class:`ModuleTree` cache, dropped whenever a module, parameter or buffer is registered anywhere.

    The invalidation uses torch's global registration hooks (``register_module_*_registration_hook``), registered
    once, when memfit is imported: they only count (``generation``) and drop the cache, so a replaced parameter is
    never kept alive by it; the cache holds modules weakly. :meth:`close` takes them off.
    """

    def __init__(self) -> None:
        self.generation = 0
        self._cache: weakref.WeakKeyDictionary[nn.Module, ModuleTree] = weakref.WeakKeyDictionary()
        mod = torch.nn.modules.module
        self._handles = [
            mod.register_module_module_registration_hook(self._changed),
            mod.register_module_parameter_registration_hook(self._changed),
            mod.register_module_buffer_registration_hook(self._changed),
        ]

    def of(self, module: nn.Module) -> ModuleTree:
        tree = self._cache.get(module)
        if tree is None:
            tree = ModuleTree(module, self.generation)
            if self._handles:  # kept only while changes are watched
                self._cache[module] = tree
        return tree

    def watched_generation(self) -> int | None:
        """The generation while registrations are watched (unchanged: no module, parameter or buffer was
        registered anywhere since it was read); None once :meth:`close` stopped watching."""
        return self.generation if self._handles else None

    def close(self) -> None:
        """Remove the registration hooks: every later lookup walks its module again, and a module changed between
        a forward and its recompute is no longer noticed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._changed(None, "", None)

    def _changed(self, module: nn.Module | None, name: str, value: Any) -> None:
        self.generation += 1
        self._cache.clear()


TREES = ModuleTrees()


# -- the captured context -----------------------------------------------------------------------------------------


class CallContext:
    """RNG, autocast, SDPA backend and tuner-layer state captured just before a region call."""

    __slots__ = ("cpu_rng", "cuda_rng", "autocast", "autocast_cache", "sdpa", "tuners", "tuner_state")

    def __init__(self, tensors: Sequence[torch.Tensor], tree: ModuleTree) -> None:
        self.cpu_rng = torch.get_rng_state()
        cuda = [t for t in tensors if t.is_cuda]
        self.cuda_rng = (
            tuple((d, torch.cuda.get_rng_state(d)) for d in sorted({t.device.index or 0 for t in cuda}))
            if cuda
            else ()
        )
        self.autocast = _autocast_state()
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.sdpa = _sdpa_state()
        self.tuners = tree.tuners
        self.tuner_state = _tuner_state(tree.tuners) if tree.tuners is not None else ()

    def restored(self, where: Callable[[], str]) -> _Restored:
        """Context manager: run the recompute of this call under the captured state (and put back the caller's
        after it); ``where()`` names the call in errors."""
        return _Restored(self, where)


@functools.cache  # whether CUDA is there does not change within a process
def _autocast_device_types() -> tuple[str, ...]:
    return tuple(dt for dt in _AUTOCAST_DEVICE_TYPES if dt != "cuda" or torch.cuda.is_available())


def _autocast_state() -> tuple:
    """(device type, enabled, dtype) of every autocast device type there is."""
    return tuple(
        (dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in _autocast_device_types()
    )


class _Restored:
    """The captured state of a call while its recompute runs (as ``torch.random.fork_rng`` and ``torch.autocast``
    would set it, without their Python layers where nothing differs: the recompute of every region call enters it).

    RNG: the caller's generators are saved, the captured states set, and the caller's put back on exit. Autocast,
    SDPA flags, tuner layers: entered or written only where they differ from the caller's now (entering the same
    autocast state computes the same)."""

    __slots__ = ("context", "where", "cpu_rng", "cuda_rng", "undo")

    def __init__(self, context: CallContext, where: Callable[[], str]) -> None:
        self.context = context
        self.where = where

    def __enter__(self) -> None:
        ctx = self.context
        undo: list[Callable[[], Any]] = []
        self.undo = undo
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = tuple((device, torch.cuda.get_rng_state(device)) for device, _ in ctx.cuda_rng)
        try:
            torch.set_rng_state(ctx.cpu_rng)
            for device, state in ctx.cuda_rng:
                torch.cuda.set_rng_state(state, device)
            if ctx.autocast != _autocast_state() or ctx.autocast_cache != torch.is_autocast_cache_enabled():
                for device_type, enabled, dtype in ctx.autocast:
                    manager = torch.autocast(
                        device_type, dtype=dtype, enabled=enabled, cache_enabled=ctx.autocast_cache
                    )
                    manager.__enter__()
                    undo.append(functools.partial(manager.__exit__, None, None, None))
            sdpa = _sdpa_state()
            if sdpa != ctx.sdpa:
                _set_sdpa_state(ctx.sdpa)
                undo.append(functools.partial(_set_sdpa_state, sdpa))
            if ctx.tuners is not None:
                now = _tuner_state(ctx.tuners)
                if now != ctx.tuner_state:
                    _check_same_adapters(ctx.tuner_state, now, self.where)
                    _set_tuner_state(ctx.tuners, ctx.tuner_state)
                    undo.append(functools.partial(_set_tuner_state, ctx.tuners, now))
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            while self.undo:
                self.undo.pop()()
        finally:
            torch.set_rng_state(self.cpu_rng)
            for device, state in self.cuda_rng:
                torch.cuda.set_rng_state(state, device)


# PEFT tuner layers: ``scaling`` (a dict adapter -> float: LoRA and its relatives; other tuners have none),
# ``_disable_adapters``, ``_active_adapter``. Read per call; written back only when they differ at the recompute.
_TUNER_FLAGS = operator.attrgetter("_disable_adapters", "_active_adapter")
_SCALING = operator.attrgetter("scaling")


def _tuner_state(tuners: tuple[tuple[nn.Module, ...], tuple[nn.Module, ...]]) -> tuple:
    """(copies of the scaling dicts of the layers that have one, (disabled, active) of every tuner layer)."""
    scaled, layers = tuners
    return tuple(map(dict.copy, map(_SCALING, scaled))), tuple(map(_TUNER_FLAGS, layers))


def _set_tuner_state(tuners: tuple[tuple[nn.Module, ...], tuple[nn.Module, ...]], state: tuple) -> None:
    scaled, layers = tuners
    scalings, flags = state
    for layer, scaling in zip(scaled, scalings, strict=True):
        layer.scaling.update(scaling)
    for layer, (disabled, active) in zip(layers, flags, strict=True):
        layer._disable_adapters = disabled
        layer._active_adapter = active


def _check_same_adapters(then: tuple, now: tuple, where: Callable[[], str]) -> None:
    """Adapters the forward used must still exist (one added since is inactive in the replay: harmless)."""
    for scaling_then, scaling_now in zip(then[0], now[0], strict=True):
        gone = sorted(set(scaling_then) - set(scaling_now))
        if gone:
            raise MemfitError(
                f"the PEFT adapter(s) {gone} of {where()} were deleted between the forward and the backward, so the "
                f"region cannot be recomputed as it ran. Delete adapters after backward()."
            )
