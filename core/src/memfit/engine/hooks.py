"""Hooks memfit attaches to a model: eager bodies, a check that they ran, and how they copy (:class:`Attached`)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memfit.errors import MemfitError

# -- Hooks that never run ---------------------------------------------------------------------------------------
# Sub-block regions (FFN chains) and attention offload work through hooks on modules inside the blocks. Two
# things skip them silently, and then nothing is checkpointed or parked there: a block that already ran
# compiled before memfit was applied (Dynamo does not guard on the hooks of the submodules it inlines,
# ``torch._dynamo.config.skip_nnmodule_hook_guards``, so it keeps running the code traced without them; seen
# with attention modules), and model code that calls ``module.forward(...)`` instead of ``module(...)``. A
# forward with grad in which none of them ran is therefore an error.


class HookRuns:
    """Counts the runs of memfit's hooks on some modules (``what``: their kind, for the message) and, at the end
    of a forward with grad, requires that at least one ran."""

    __slots__ = ("what", "count", "_at_start")

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0  # the hooks add 1 per run
        self._at_start: int | None = None  # ``count`` when a forward with grad began, else None

    def begin(self) -> None:
        """A forward with grad begins."""
        self._at_start = self.count

    def cancel(self) -> None:
        """Nothing to check (no forward with grad running, or it raised)."""
        self._at_start = None

    def end(self, modules: int) -> None:
        """The forward returned; ``modules``: how many modules carry the hooks now.

        Raises:
            MemfitError: a forward with grad ran none of them (see "Hooks that never run").
        """
        start, self._at_start = self._at_start, None
        if start is None or not modules or self.count > start:
            return
        raise MemfitError(
            f"memfit's hooks on {modules} {self.what} modules did not run in this forward, so nothing was "
            f"checkpointed or offloaded there. Either the blocks ran compiled (torch.compile, "
            f"compile_repeated_blocks) before memfit was applied, and the compiled code does not see hooks added "
            f"later: apply memfit before the first compiled forward, or call torch._dynamo.reset() after "
            f"memfit.apply(). Or the model calls these modules as module.forward(...), which skips hooks: declare "
            f"boundaries it calls as module(...)."
        )


def eager_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly even inside a ``torch.compile``d module (a graph break, never traced)."""
    return torch.compiler.disable(fn, recursive=True)


# -- Copies of an applied model -----------------------------------------------------------------------------
# ``copy.deepcopy(model)`` after ``apply`` (an EMA copy) copies the model's hook dictionaries and instance
# attributes, and with them every callable memfit attached: deep-copying those would copy the engine (thread
# locals, streams: it fails) or leave the copy calling back into the original's engine (a copied block whose
# FFN still runs the original's bound forward). Every callable memfit attaches is an :class:`Attached`, which
# copies as a stand-in that does what the model does without memfit. The copy is an ordinary model, with no
# memfit installed; ``memfit.apply`` it again to use memfit on it. Pickling (``torch.save(model)``) an applied
# model is refused with a message that says to remove memfit first (or to save the state_dict).


class Attached:
    """A callable memfit attaches to a model: a forward hook, the checkpoint function, an eager forward body.

    Args:
        fn: what runs.
        detached: makes the stand-in a deep copy of the model gets, from the deep copy's memo (see "Copies of an
            applied model"); default: a hook that does nothing.
    """

    __slots__ = ("fn", "detached", "__weakref__")

    def __init__(self, fn: Callable[..., Any], detached: Callable[[dict], Any] | None = None) -> None:
        self.fn = fn
        self.detached = detached

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        return self.detached(memo) if self.detached is not None else _detached_hook

    def __reduce_ex__(self, protocol: object) -> Any:
        raise MemfitError(
            "this model has memfit applied; its hooks cannot be pickled (torch.save(model), pickle). Call "
            "handle.remove() first and apply memfit again after saving, or save model.state_dict() instead."
        )


def _detached_hook(*args: Any, **kwargs: Any) -> None:
    """A deep copy's stand-in for a memfit hook: does nothing."""
    return None


def detached_forward(module: nn.Module) -> Callable[[dict], Any]:
    """The stand-in for an eager forward body of ``module``: the copy's own (class) forward."""

    def make(memo: dict) -> Any:
        copy = memo.get(id(module), module)
        return types.MethodType(type(copy).forward, copy)

    return make


def attached_hook(fn: Callable[..., Any]) -> Attached:
    """A forward (pre-)hook: eager even inside a compiled module, a no-op in a deep copy of the model."""
    return Attached(eager_hook(fn))


def on_first_gradient(output: Any, callback: Callable[[], None], *, passed_through: Any = ()) -> None:
    """Run ``callback`` once, when the first gradient reaches one of ``output``'s tensors that require grad: a hook
    on each (nothing where none does; a tensor's hook goes with the tensor). A tensor also in ``passed_through``
    (a call's inputs) is not the call's output."""
    inputs = {id(t) for t in tree_flatten(passed_through)[0]}
    fired = False

    def reached(grad: torch.Tensor) -> None:
        nonlocal fired
        if not fired:
            fired = True
            callback()

    for tensor in tree_flatten(output)[0]:
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad and id(tensor) not in inputs:
            tensor.register_hook(reached)


def queue_at_backward_end(callback: Callable[[], None]) -> bool:
    """Queue ``callback`` for the end of the backward running now (the autograd engine's own hook, as
    DistributedDataParallel uses it); False where none runs or the engine cannot."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return False
    return True
