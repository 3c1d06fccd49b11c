"""Peer baselines installed on a model for one benchmark row, and removed after it.

The checkpoint peers wrap module forwards through instance attributes (never the class): the block's (or FFN
region's) call runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, as a user who edited
the model's loop would write it. An FFN region that is a chain of calls (``proj_mlp`` then ``act_mlp``) is one
checkpoint around the whole chain: the first module's wrapper runs the chain, later modules hand back the chain's
output unchanged (the adapter declares that nothing else reads the values between them). ``remove()`` restores
every forward as it was.

Example:
    >>> installation = install(Peer.CHECKPOINT_BLOCK, model, adapter)  # doctest: +SKIP
    >>> with installation.step_context():  # doctest: +SKIP
    ...     loss = loss_fn(model(**batch))
    >>> installation.remove()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit import FamilyAdapter
from memfit.engine.install import ModelSnapshot
from memfit_benchmarks.modes import Peer

_MISSING = object()


def unsupported(peer: Peer, model: nn.Module, adapter: FamilyAdapter | None) -> str | None:
    """Why ``peer`` cannot run on ``model`` (None: it can)."""
    if peer in (Peer.CHECKPOINT_BLOCK, Peer.CHECKPOINT_FFN) and adapter is None:
        return "needs the family's declared blocks"
    if peer is Peer.CHECKPOINT_FFN and not adapter.has_ffn:
        return "no FFN boundary declared"
    if peer is Peer.DIFFUSERS:
        if not (
            getattr(model, "_supports_gradient_checkpointing", False)
            and callable(getattr(model, "enable_gradient_checkpointing", None))
        ):
            return "the model has no diffusers gradient checkpointing"
        if adapter is not None and adapter.block_entry == "hooks":
            # the adapter declares that the model's checkpointing branch calls blocks differently (e.g. drops an
            # argument): that peer would time another computation
            return "the family's checkpointing branch does not call its blocks as the normal forward does"
    return None


class CheckpointedChain:
    """One ``torch.utils.checkpoint`` around consecutive module calls (a block, or an FFN chain).

    Args:
        modules: the modules, in call order; the model feeds each one's output straight into the next.

    Raises:
        RuntimeError (during forward): a later module of the chain was called with anything but the chain's
            output, i.e. the model does not call the chain as the adapter declares.
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.calls = 0  # checkpointed forward calls (recomputes in backward not counted)
        self._inside = False  # running the chain (forward or recompute): every module runs as it is
        self._pending: torch.Tensor | None = None  # the chain's output, on its way through the later modules
        self._next = 0
        self._saved = [m.__dict__.get("forward", _MISSING) for m in modules]
        self._originals = [m.forward for m in modules]
        for index, module in enumerate(modules):
            module.forward = self._wrapper(index)

    def _wrapper(self, index: int) -> Callable[..., Any]:
        original = self._originals[index]

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                return original(*args, **kwargs)
            if index == 0:
                return self._run_checkpointed(*args, **kwargs)
            return self._hand_on(index, *args, **kwargs)

        return forward

    def _run_checkpointed(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        out = checkpoint(self._run_chain, *args, use_reentrant=False, **kwargs)
        if len(self.modules) > 1:
            self._pending, self._next = out, 1
        return out

    def _run_chain(self, *args: Any, **kwargs: Any) -> Any:
        self._inside = True
        try:
            out = self.modules[0](*args, **kwargs)
            for module in self.modules[1:]:
                out = module(out)
            return out
        finally:
            self._inside = False

    def _hand_on(self, index: int, *args: Any, **kwargs: Any) -> Any:
        if index != self._next or len(args) != 1 or kwargs or args[0] is not self._pending:
            raise RuntimeError(
                f"checkpoint peer: {type(self.modules[index]).__name__} (call {index + 1} of an FFN chain) was "
                "not called with the previous call's output alone; the model does not call this chain as its "
                "adapter declares, so the chain cannot be one checkpoint"
            )
        out = self._pending
        self._next += 1
        if self._next == len(self.modules):
            self._pending = None
        return out

    def remove(self) -> None:
        for module, saved in zip(self.modules, self._saved, strict=True):
            if saved is _MISSING:
                del module.forward
            else:
                module.forward = saved


class PeerInstallation:
    """A peer on a model: ``step_context()`` wraps each step's forward and loss; ``remove()`` undoes it."""

    def __init__(
        self,
        *,
        chains: list[CheckpointedChain] | None = None,
        context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        undo: Callable[[], None] = lambda: None,
        calls: Callable[[], int] | None = None,
    ) -> None:
        self.chains = chains or []
        self.step_context = context
        self._undo = undo
        self._calls = calls

    def checkpointed_calls(self) -> int | None:
        """Forward calls run under a checkpoint so far (None: not counted for this peer)."""
        if self.chains:
            return sum(c.calls for c in self.chains)
        return self._calls() if self._calls is not None else None

    def remove(self) -> None:
        for chain in self.chains:
            chain.remove()
        self.chains = []
        self._undo()


def _diffusers_checkpointing(model: nn.Module) -> PeerInstallation:
    # The model's enable method may set switches of its own besides diffusers' flags (Mage-Flow's `checkpoint`
    # attribute and config key): whatever it changes is put back, or every later row would run checkpointed too.
    snapshot = ModelSnapshot.take(model)
    model.enable_gradient_checkpointing()
    # Its own checkpoint function stays; each module's reference to it is wrapped to count the calls, so a row can
    # say how many regions the model itself checkpoints (a family may route only some of its blocks through it).
    calls = [0]

    def counted(function: Callable[..., Any]) -> Callable[..., Any]:
        def checkpointing(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return function(*args, **kwargs)

        return checkpointing

    wrapped = 0
    for module in model.modules():
        function = module.__dict__.get("_gradient_checkpointing_func")
        if getattr(module, "gradient_checkpointing", False) and callable(function):
            module._gradient_checkpointing_func = counted(function)
            wrapped += 1
    # a model that checkpoints through a branch of its own (Mage-Flow's) is not counted
    return PeerInstallation(undo=snapshot.changes().restore, calls=(lambda: calls[0]) if wrapped else None)


def install(peer: Peer, model: nn.Module, adapter: FamilyAdapter | None) -> PeerInstallation:
    """Put ``peer`` on ``model`` (its blocks and FFN regions as ``adapter`` declares them).

    Raises:
        ValueError: the peer cannot run on this model (:func:`unsupported` says why).
    """
    reason = unsupported(peer, model, adapter)
    if reason is not None:
        raise ValueError(f"peer {peer.value!r} cannot run on {type(model).__name__}: {reason}")
    if peer is Peer.CHECKPOINT_BLOCK:
        return PeerInstallation(
            chains=[CheckpointedChain([block]) for _, _, block in adapter.iter_blocks(model)]
        )
    if peer is Peer.CHECKPOINT_FFN:
        return PeerInstallation(
            chains=[
                CheckpointedChain(chain)
                for _, _, block in adapter.iter_blocks(model)
                for chain in adapter.ffn_chains(block)
            ]
        )
    if peer is Peer.DIFFUSERS:
        return _diffusers_checkpointing(model)
    return PeerInstallation(context=lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
