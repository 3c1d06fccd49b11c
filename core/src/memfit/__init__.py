"""memfit: make diffusion-transformer training that almost fits in GPU memory fit.

Public API::

    import memfit
    handle = memfit.apply(model, {"gradient_checkpointing": True,
                                  "gradient_checkpointing_backend": "torch-ffn"})
    handle.remove()
"""

from memfit.accounting import SavedBytesMeter
from memfit.adapters import (
    BlockSpec,
    CheckpointSwitch,
    FamilyAdapter,
    Preset,
    available_adapters,
    find_adapter,
    get_adapter,
)
from memfit.apply import apply
from memfit.config import Backend, MemfitConfig
from memfit.errors import (
    BudgetError,
    ConfigError,
    DeviceMemoryError,
    HostMemoryError,
    MemfitError,
    MemfitWarning,
    NotAvailableError,
    UnsupportedBoundaryError,
)
from memfit.handle import MemfitHandle
from memfit.plan import BlockPolicy, RegionPlan

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BlockPolicy",
    "BudgetError",
    "BlockSpec",
    "CheckpointSwitch",
    "ConfigError",
    "DeviceMemoryError",
    "FamilyAdapter",
    "HostMemoryError",
    "MemfitConfig",
    "MemfitError",
    "MemfitHandle",
    "MemfitWarning",
    "NotAvailableError",
    "Preset",
    "RegionPlan",
    "SavedBytesMeter",
    "UnsupportedBoundaryError",
    "apply",
    "available_adapters",
    "find_adapter",
    "get_adapter",
]
