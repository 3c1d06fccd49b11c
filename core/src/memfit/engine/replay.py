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
built): no module-tree walk per call.

Random numbers and threads. The recompute sets the process-wide generator to the state
captured before the call and restores the caller's afterwards, as ``torch.utils.checkpoint``
does. Another thread that draws random numbers from the same generator *while* a region
call runs (in forward or in its recompute) changes what that call draws, and the
recompute no longer matches: torch has one default generator per device, shared by all
threads, so neither memfit nor ``torch.utils.checkpoint`` can isolate a call from it.
Draws by other threads between the forward and the backward do not matter.
"""

from __future__ import annotations

import contextlib
import operator
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
VERSION = operator.attrgetter("_version")

# -- SDPA backend selection ---------------------------------------------------------------------------------------
# ``torch.nn.attention.sdpa_kernel`` flips these process-wide flags; the names differ across torch versions, so the
# getters and setters are looked up once.
_SDPA_NAMES = ("flash", "mem_efficient", "math", "cudnn", "overrideable", "fa3", "fa4")
_SDPA = tuple(
    (getattr(torch._C, f"_get_{n}_sdp_enabled"), getattr(torch._C, f"_set_sdp_use_{n}"))
    for n in _SDPA_NAMES
    if hasattr(torch._C, f"_get_{n}_sdp_enabled") and hasattr(torch._C, f"_set_sdp_use_{n}")
)
_SDPA_GET = tuple(get for get, _ in _SDPA)
_SDPA_SET = tuple(set_ for _, set_ in _SDPA)
_SDPA_PRIORITY = (
    (torch._C._get_sdp_priority_order, torch._C._set_sdp_priority_order)
    if hasattr(torch._C, "_get_sdp_priority_order") and hasattr(torch._C, "_set_sdp_priority_order")
    else None
)
_SDPA_REDUCTION = (
    (torch._C._get_math_sdp_allow_fp16_bf16_reduction, torch._C._set_math_sdp_allow_fp16_bf16_reduction)
    if hasattr(torch._C, "_get_math_sdp_allow_fp16_bf16_reduction")
    else None
)


def _sdpa_state() -> tuple:
    flags = tuple(get() for get in _SDPA_GET)
    priority = tuple(_SDPA_PRIORITY[0]()) if _SDPA_PRIORITY is not None else None
    reduction = _SDPA_REDUCTION[0]() if _SDPA_REDUCTION is not None else None
    return flags, priority, reduction


def _set_sdpa_state(sdpa: tuple) -> None:
    flags, priority, reduction = sdpa
    for set_, on in zip(_SDPA_SET, flags, strict=True):
        set_(on)
    if priority is not None and _SDPA_PRIORITY is not None:
        _SDPA_PRIORITY[1](list(priority))
    if reduction is not None and _SDPA_REDUCTION is not None:
        _SDPA_REDUCTION[1](reduction)


# -- what a module's call reads: parameters, buffers, tuner layers (cached) -------------------------------------------


class ModuleTree:
    """What one module's call reads, for the checks and the replay: built once per module, per generation."""

    __slots__ = ("generation", "tensors", "names", "tuners", "finalizer")

    def __init__(self, module: nn.Module, generation: int) -> None:
        self.generation = generation
        tensors: list[torch.Tensor] = []
        names: list[str] = []
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            if tensor is not None:
                tensors.append(tensor)
                names.append(name)
        self.tensors = tuple(tensors)
        self.names = tuple(names)
        base = _tuner_base()
        self.tuners: tuple[nn.Module, ...] = (
            tuple(m for m in module.modules() if isinstance(m, base)) if base is not None else ()
        )
        self.finalizer: Any = None

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
    """Per-module :class:`ModuleTree` cache, invalidated when any module, parameter or buffer is registered.

    The invalidation uses torch's global registration hooks (``register_module_*_registration_hook``), held only
    while at least one lease is (an installed engine holds one): no module-tree walk per call, and nothing left
    registered once memfit is gone. Without a lease every lookup rebuilds (correct, slow).
    """

    def __init__(self) -> None:
        self.generation = 0
        self._cache: dict[int, tuple[weakref.ref, ModuleTree]] = {}
        self._leases = 0
        self._handles: list[Any] = []

    def of(self, module: nn.Module) -> ModuleTree:
        hit = self._cache.get(id(module))
        if hit is not None and self._leases:
            ref, tree = hit
            if tree.generation == self.generation and ref() is module:
                return tree
        tree = ModuleTree(module, self.generation)
        if hit is not None and hit[0]() is module:
            tree.finalizer = hit[1].finalizer
        else:
            tree.finalizer = weakref.finalize(module, self._cache.pop, id(module), None)
        self._cache[id(module)] = (weakref.ref(module), tree)
        return tree

    def lease(self) -> Callable[[], None]:
        """Keep the registration hooks on until the returned function is called (idempotent)."""
        if not self._leases:
            self.generation += 1  # anything may have changed while nobody watched
            mod = torch.nn.modules.module
            self._handles = [
                mod.register_module_module_registration_hook(self._changed),
                mod.register_module_parameter_registration_hook(self._changed),
                mod.register_module_buffer_registration_hook(self._changed),
            ]
        self._leases += 1
        released = [False]

        def release() -> None:
            if released[0]:
                return
            released[0] = True
            self._leases -= 1
            if not self._leases:
                for handle in self._handles:
                    handle.remove()
                self._handles = []

        return release

    def _changed(self, module: nn.Module, name: str, value: Any) -> None:
        self.generation += 1


TREES = ModuleTrees()


# -- the captured context -----------------------------------------------------------------------------------------


class CallContext:
    """RNG, autocast, SDPA backend and tuner-layer state captured just before a region call."""

    __slots__ = ("cpu_rng", "cuda_rng", "autocast", "autocast_cache", "sdpa", "tuners", "tuner_state")

    def __init__(self, tensors: Sequence[torch.Tensor], tree: ModuleTree) -> None:
        cuda_devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = tuple((d, torch.cuda.get_rng_state(d)) for d in cuda_devices)
        self.autocast = tuple(
            (dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
            for dt in _AUTOCAST_DEVICE_TYPES
            if dt != "cuda" or torch.cuda.is_available()
        )
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.sdpa = _sdpa_state()
        self.tuners = tree.tuners
        self.tuner_state = _tuner_state(tree.tuners) if tree.tuners else ()

    @contextlib.contextmanager
    def restored(self, region: str) -> Iterator[None]:
        """Run the recompute of this call under the captured state; ``region`` names it in errors."""
        devices = [d for d, _ in self.cuda_rng]
        with torch.random.fork_rng(devices=devices), contextlib.ExitStack() as stack:
            torch.set_rng_state(self.cpu_rng)
            for device, state in self.cuda_rng:
                torch.cuda.set_rng_state(state, device)
            for device_type, enabled, dtype in self.autocast:
                stack.enter_context(
                    torch.autocast(
                        device_type, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache
                    )
                )
            sdpa = _sdpa_state()
            if sdpa != self.sdpa:
                _set_sdpa_state(self.sdpa)
                stack.callback(_set_sdpa_state, sdpa)
            if self.tuners:
                now = _tuner_state(self.tuners)
                if now != self.tuner_state:
                    _check_same_adapters(self.tuner_state, now, region)
                    _set_tuner_state(self.tuners, self.tuner_state)
                    stack.callback(_set_tuner_state, self.tuners, now)
            yield


# PEFT tuner layers: ``scaling`` (a dict adapter -> float, LoRA and its relatives), ``_active_adapter``,
# ``_disable_adapters``. Read per call; written back only when they differ at the recompute.
_TUNER_ATTRS = operator.attrgetter("_disable_adapters", "_active_adapter")


def _tuner_state(tuners: tuple[nn.Module, ...]) -> tuple:
    return tuple(
        (
            dict(scaling) if isinstance(scaling := layer.__dict__.get("scaling"), dict) else None,
            *_TUNER_ATTRS(layer),
        )
        for layer in tuners
    )


def _set_tuner_state(tuners: tuple[nn.Module, ...], state: tuple) -> None:
    for layer, (scaling, disabled, active) in zip(tuners, state, strict=True):
        if scaling is not None:
            layer.__dict__["scaling"].update(scaling)
        layer._disable_adapters = disabled
        layer._active_adapter = active


def _check_same_adapters(then: tuple, now: tuple, region: str) -> None:
    """Adapters the forward used must still exist (one added since is inactive in the replay: harmless)."""
    for (scaling_then, *_), (scaling_now, *_) in zip(then, now, strict=True):
        gone = sorted(set(scaling_then or ()) - set(scaling_now or ()))
        if gone:
            raise MemfitError(
                f"the PEFT adapter(s) {gone} of {region} were deleted between the forward and the backward, so the "
                f"region cannot be recomputed as it ran. Delete adapters after backward()."
            )
