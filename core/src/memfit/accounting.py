"""Count the bytes autograd holds for backward — on any device, CPU included.

:class:`SavedBytesMeter` is a saved-tensor hook around a forward: every tensor autograd
saves is counted once per storage (views of one storage count once), parameters and
buffers excluded (they are resident anyway). Tensors that memfit's regions keep for
their recompute are reported to the meter by the engine, because inside a region the
region's own hooks replace the meter's. The result is what a checkpointing or offload
mode really leaves resident between forward and backward.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memfit.engine import state


def tensor_storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``tensor``'s data: its own, or — for a tensor subclass that wraps others (torchao's
    quantized weights, whose own storage has no data pointer) — those of the tensors it wraps."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, name) for name in names)
        return [s for t in inner if isinstance(t, torch.Tensor) for s in tensor_storages(t)]
    return [tensor.untyped_storage()]


class SavedBytesMeter:
    """Context manager counting distinct storages saved for backward.

    Args:
        exclude: tensors whose storages are not counted (pass ``model.parameters()`` and buffers).

    Example:
        >>> with SavedBytesMeter(exclude=model.parameters()) as meter:
        ...     loss = model(**inputs).sample.pow(2).mean()
        >>> meter.device_bytes   # bytes kept on the compute device for backward
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {s.data_ptr() for t in exclude for s in tensor_storages(t)}
        self._seen: dict[tuple[str, int], int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)

    def __enter__(self) -> SavedBytesMeter:
        self._hooks.__enter__()
        state.add_held_listener(self.note)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        state.remove_held_listener(self.note)
        self._hooks.__exit__(exc_type, exc, tb)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.note(tensor)
        return tensor

    def note(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage (once)."""
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return
        for storage in tensor_storages(tensor):
            ptr = storage.data_ptr()
            if ptr != 0 and ptr not in self._excluded:
                self._seen.setdefault((tensor.device.type, ptr), storage.nbytes())

    def bytes_on(self, device_type: str) -> int:
        return sum(n for (dev, _), n in self._seen.items() if dev == device_type)

    @property
    def total_bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def device_bytes(self) -> int:
        """Bytes on accelerators if any were seen, else on the CPU (CPU-only runs)."""
        accel = sum(n for (dev, _), n in self._seen.items() if dev != "cpu")
        return accel if accel else self.bytes_on("cpu")

    @property
    def storages(self) -> int:
        return len(self._seen)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x
