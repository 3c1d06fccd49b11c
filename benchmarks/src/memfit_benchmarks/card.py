"""A card smaller than the one the benchmark runs on: the model on the host, the process limited to the card's size."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def card_of(model: torch.nn.Module, nbytes: int, device: torch.device) -> Iterator[None]:
    """The model on the host and this process limited to ``nbytes`` of ``device`` (what the inputs hold
    included), as on a card of that size that cannot load the model whole; afterwards the model back on
    ``device``, the limit lifted. A row measured inside gives ``memfit.apply`` the ``device`` to train on."""
    if device.index is None:  # the process limit is set per device index
        device = torch.device("cuda", torch.cuda.current_device())
    model.to("cpu")
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        model.to(device)
