"""Thread-local engine flags.

Backward may run on autograd's device threads, and a recompute happens inside
backward: so "are we recomputing?" must be answered per thread, and so must
"is a region call running right now?" (nested region hooks must then do nothing:
a region inside a region that is recomputed anyway is never copied twice).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator

import torch

_local = threading.local()

# Listeners told about every tensor a region keeps for backward (the held-bytes meters).
_held_listeners: list[Callable[[torch.Tensor], None]] = []


def recomputing() -> bool:
    return getattr(_local, "recompute_depth", 0) > 0


def in_region_call() -> bool:
    return getattr(_local, "region_calls", 0) > 0


@contextlib.contextmanager
def recompute_scope() -> Iterator[None]:
    _local.recompute_depth = getattr(_local, "recompute_depth", 0) + 1
    try:
        yield
    finally:
        _local.recompute_depth -= 1


# -- Interrupted calls -------------------------------------------------------------------------------------------
# A region call pushes saved-tensor hooks on the thread's autograd state and pops them when the call returns or
# raises. A ``KeyboardInterrupt`` skips the forward hooks that pop them (``always_call`` hooks run for
# ``Exception`` only), and the thread would go on packing every saved tensor into a dead region. So each open
# call registers how to undo itself, and whatever finds calls left open where none can be (the model's next
# forward, ``handle.remove()``) undoes them, innermost first. A streamed block's saving scope
# (``memfit.offload.weights``) registers the same way but is no region: regions still open inside it.


def enter_region_call(undo: Callable[[], None], *, region: bool = True) -> None:
    """A region call (or, ``region=False``, another call with saved-tensor hooks) starts on this thread; ``undo``
    pops what it pushed if it is never ended."""
    calls = getattr(_local, "open_calls", None)
    if calls is None:
        calls = _local.open_calls = []
    calls.append((undo, region))
    if region:
        _local.region_calls = getattr(_local, "region_calls", 0) + 1


def exit_region_call() -> None:
    _, region = _local.open_calls.pop()
    if region:
        _local.region_calls -= 1


def undo_open_calls() -> int:
    """Undo every call left open on this thread (interrupted), innermost first; returns how many."""
    calls = getattr(_local, "open_calls", None) or []
    undone = 0
    while calls:
        undo, _ = calls.pop()
        undo()
        undone += 1
    _local.region_calls = 0
    return undone


def regions_may_open() -> bool:
    """A new region may start: autograd records, we are not recomputing, not inside another region call."""
    return torch.is_grad_enabled() and not recomputing() and not in_region_call()


# Parameters whose data streams from host memory (``memfit.offload.weights``): a frame never keeps one (or a view
# of one) as saved, since that would hold the block's uploaded weights from its forward until its backward;
# they are recomputed like activations. By id: the streamer holds the parameters while they are listed.
_streamed_parameters: set[int] = set()


def mark_streamed(parameters: Iterable[torch.Tensor], *, streamed: bool) -> None:
    """List (or unlist) parameters whose data streams from host memory."""
    ids = {id(p) for p in parameters}
    if streamed:
        _streamed_parameters.update(ids)
    else:
        _streamed_parameters.difference_update(ids)


def is_streamed(parameter: torch.Tensor) -> bool:
    return id(parameter) in _streamed_parameters


def streamed_parameter_ids() -> set[int]:
    """The set :func:`mark_streamed` updates in place (for hooks that test membership per saved tensor)."""
    return _streamed_parameters


def add_held_listener(fn: Callable[[torch.Tensor], None]) -> None:
    _held_listeners.append(fn)


def remove_held_listener(fn: Callable[[torch.Tensor], None]) -> None:
    _held_listeners.remove(fn)


def note_held(tensor: torch.Tensor) -> None:
    for fn in tuple(_held_listeners):
        fn(tensor)
