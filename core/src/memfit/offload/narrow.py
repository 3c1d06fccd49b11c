"""Exact narrowing: a saved tensor that is an up-cast of a narrower one is parked in the narrower dtype.

Design notes (``docs/cost-model.md``, "Up-casts parked narrow", has the numbers)
--------------------------------------------------------------------------------
Why.  Models that normalise in float32 save float32 copies of bfloat16 activations: ``F.layer_norm(x.float())``
saves its float32 input, and torch's RMS norm off CUDA saves ``x.to(float32)`` for its ``pow`` (on CUDA it is one
fused kernel that saves its input as it is). On Wan 2.1 14B on a GPU, the block's three layer norms are 0.43 GB of
the 3.38 GB that parking a block copies. Every value of such a tensor is a bfloat16 value, so parking it
as bfloat16 and widening it again on the way back gives the same bits: half the link time and host memory.

Which.  Only what autograd's history proves: the saved tensor's ``grad_fn`` is the cast's own node
(``ToCopyBackward0``, so nothing has written into it since: an in-place op would have replaced its ``grad_fn``),
its source's dtype (the metadata autograd keeps for the gradient it hands back) widens exactly into the saved
dtype (:data:`WIDENS_EXACTLY`), and the tensor is contiguous. A tensor without history (its source needed no gradient)
stays as it is: nothing proves it.

Where.  Attention offload (which parks whole blocks too) narrows a proven tensor as autograd saves it: from then on
only the narrow copy is held, on the device until it is parked and in host memory after. The wide tensor is
freed as soon as the forward is done with it. A tensor saved twice is narrowed once per call
(:class:`Narrowed`). Backward widens what it unpacks (:func:`widened`). The profile prices the same rule
(:mod:`memfit.auto.profile`).
"""

from __future__ import annotations

import weakref

import torch

# (narrow, wide): every value of the narrow dtype is a value of the wide one, so wide -> narrow -> wide is exact
WIDENS_EXACTLY = frozenset(
    {
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float64),
        (torch.float16, torch.float64),
        (torch.float32, torch.float64),
    }
)
# the wide dtypes of WIDENS_EXACTLY: any other tensor is refused before its history is read (reading ``grad_fn``
# makes a Python object of the node, for every saved tensor a parking call sees)
_WIDE = frozenset(wide for _, wide in WIDENS_EXACTLY)
# the autograd node a dtype cast leaves (by name: its class is generated per build)
_TO_COPY = "ToCopyBackward0"


def exact_narrow_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype ``tensor`` was cast up from, where its history proves every value fits it exactly (see
    "Which"); None otherwise."""
    if tensor.dtype not in _WIDE:
        return None
    node = tensor.grad_fn
    if node is None or type(node).__name__ != _TO_COPY:
        return None
    source, index = node.next_functions[0]
    if source is None:
        return None
    try:
        narrow = source._input_metadata[index].dtype
    except (AttributeError, IndexError, RuntimeError):
        return None  # a torch (or a node) without the metadata: nothing proven
    if (narrow, tensor.dtype) not in WIDENS_EXACTLY or not tensor.is_contiguous():
        return None
    return narrow


class Narrowed:
    """The narrow copies made during one call, so that a tensor saved twice is narrowed (and parked) once. Held only
    while the call saves tensors: :meth:`clear` it once they are parked."""

    __slots__ = ("_copies",)

    def __init__(self) -> None:
        # storage address -> (the wide tensor, weakly: while it lives its address is not reused; the narrow copy)
        self._copies: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def of(self, tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """``tensor``'s copy in ``dtype`` (made now, or the one made earlier in this call), and the bytes a new one
        saves (0 for an earlier one)."""
        ptr = tensor.untyped_storage().data_ptr()
        earlier = self._copies.get(ptr)
        if earlier is not None and earlier[0]() is tensor:
            return earlier[1], 0
        with torch.no_grad():  # the saved tensor carries its history: the cast must not extend it
            narrow = tensor.to(dtype)
        self._copies[ptr] = (weakref.ref(tensor), narrow)
        return narrow, tensor.nbytes - narrow.nbytes

    def clear(self) -> None:
        self._copies.clear()


def narrowed_bytes(nbytes: int, wide: torch.dtype, narrow: torch.dtype) -> int:
    """Bytes a tensor of ``nbytes`` in ``wide`` takes in ``narrow``."""
    return nbytes * narrow.itemsize // wide.itemsize


def widened(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` back in ``dtype`` (its saved dtype) where it was parked narrow; as it is otherwise."""
    return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)
