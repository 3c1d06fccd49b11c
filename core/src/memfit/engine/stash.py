"""Where a frame keeps its entry tensors between the forward and the recompute.

``DeviceStash`` (``torch`` backends) keeps the tensor on its own device without its autograd history:
no copy, no extra memory (the storage is the one the forward already had). The
offload backends plug in a stash that parks entries in pinned host memory.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


def without_history(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as what memfit keeps for backward may hold: a detached alias (same storage, same version counter)
    when it has autograd history, else itself (a recompute then gets the object the forward got, with whatever
    the model cached on it). See "What autograd keeps" in docs/architecture.md."""
    return tensor.detach() if tensor.requires_grad else tensor


class Stash(Protocol):
    """Storage strategy for entry tensors."""

    def put(self, tensor: torch.Tensor) -> Any:
        """Keep ``tensor``'s value for a later :meth:`get`; return a handle (never keep its autograd graph)."""

    def get(self, handle: Any) -> torch.Tensor:
        """The kept tensor, on its original device."""

    def version(self, handle: Any) -> int:
        """The version counter of the kept tensor (to detect in-place edits after recording)."""

    def resident(self, handle: Any) -> torch.Tensor | None:
        """The tensor kept on its device for this handle, or None when it was parked elsewhere."""


class DeviceStash:
    """Keep entries where they are, without their autograd history (:func:`without_history`)."""

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        return without_history(tensor)

    def get(self, handle: torch.Tensor) -> torch.Tensor:
        return handle

    def version(self, handle: torch.Tensor) -> int:
        return handle._version

    def resident(self, handle: torch.Tensor) -> torch.Tensor:
        return handle
