"""Find installed adapters through the ``memfit.adapters`` entry-point group.

The core imports no adapter by name: a distribution such as ``memfit-flux``
advertises ``[project.entry-points."memfit.adapters"] flux = "memfit_flux:ADAPTER"``.
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points

from torch import nn

from memfit.adapters.spec import FamilyAdapter
from memfit.errors import MemfitError

ENTRY_POINT_GROUP = "memfit.adapters"


@functools.cache
def available_adapters() -> dict[str, FamilyAdapter]:
    """All installed adapters by family name (loaded once per process)."""
    found: dict[str, FamilyAdapter] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        adapter = ep.load()
        if not isinstance(adapter, FamilyAdapter):
            raise MemfitError(
                f"entry point {ep.name!r} ({ep.value}) in group {ENTRY_POINT_GROUP!r} must point to a "
                f"memfit.adapters.FamilyAdapter instance, got {type(adapter).__name__}"
            )
        if adapter.name in found:
            raise MemfitError(
                f"two installed distributions both register the memfit adapter {adapter.name!r}"
            )
        found[adapter.name] = adapter
    return found


def get_adapter(name: str) -> FamilyAdapter:
    """The installed adapter called ``name``; the error lists what is installed."""
    adapters = available_adapters()
    try:
        return adapters[name]
    except KeyError:
        installed = ", ".join(sorted(adapters)) or "none"
        raise MemfitError(
            f"no memfit adapter for family {name!r} is installed (installed: {installed}). "
            f"Install it, e.g. `pip install memfit-{name}`."
        ) from None


def find_adapter(model: nn.Module) -> FamilyAdapter | None:
    """The adapter serving ``model``'s class, or None (the generic diffusers path then applies)."""
    for adapter in available_adapters().values():
        if adapter.matches(model):
            return adapter
    return None
