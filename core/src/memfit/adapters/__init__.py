"""Model-family adapters: what they declare (:mod:`.spec`) and how they are found (:mod:`.discovery`)."""

from memfit.adapters.discovery import available_adapters, find_adapter, get_adapter
from memfit.adapters.spec import BlockSpec, FamilyAdapter, Preset, Region

__all__ = [
    "BlockSpec",
    "FamilyAdapter",
    "Preset",
    "Region",
    "available_adapters",
    "find_adapter",
    "get_adapter",
]
