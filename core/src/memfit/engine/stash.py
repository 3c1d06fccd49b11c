"""Where a frame keeps its entry tensors between the forward and the recompute.

``DeviceStash`` (``torch`` backends) keeps a detached alias on the tensor's own device:
no copy, no extra memory (the storage is the one the forward already had). The
offload backends plug in a stash that parks entries in pinned host memory.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


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
    """Keep entries where they are: a detached alias shares storage and version counter."""

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    def get(self, handle: torch.Tensor) -> torch.Tensor:
        return handle

    def version(self, handle: torch.Tensor) -> int:
        return handle._version

    def resident(self, handle: torch.Tensor) -> torch.Tensor:
        return handle
