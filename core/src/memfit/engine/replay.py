"""Capture the state a call ran under (RNG, autocast) and restore it for the recompute.

Non-reentrant checkpoint semantics: the recompute must see the same random numbers
(dropout) and the same autocast dtype as the forward, and must not disturb the
caller's RNG stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class _AutocastState:
    device_type: str
    enabled: bool
    dtype: torch.dtype


@dataclass(frozen=True)
class CallContext:
    """RNG and autocast state captured just before a region call."""

    cpu_rng: torch.Tensor
    cuda_rng: tuple[tuple[int, torch.Tensor], ...]
    autocast: tuple[_AutocastState, ...]
    autocast_cache: bool

    @classmethod
    def capture(cls, tensors: Sequence[torch.Tensor]) -> CallContext:
        cuda_devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
        cuda_rng = tuple((d, torch.cuda.get_rng_state(d)) for d in cuda_devices)
        autocast = tuple(
            _AutocastState(dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
            for dt in _AUTOCAST_DEVICE_TYPES
            if dt != "cuda" or torch.cuda.is_available()
        )
        return cls(torch.get_rng_state(), cuda_rng, autocast, torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        devices = [d for d, _ in self.cuda_rng]
        with torch.random.fork_rng(devices=devices), contextlib.ExitStack() as stack:
            torch.set_rng_state(self.cpu_rng)
            for device, state in self.cuda_rng:
                torch.cuda.set_rng_state(state, device)
            for ac in self.autocast:
                stack.enter_context(
                    torch.autocast(
                        ac.device_type, dtype=ac.dtype, enabled=ac.enabled, cache_enabled=self.autocast_cache
                    )
                )
            yield
