"""Model-family adapters: what they declare (:mod:`.spec`), how they are found (:mod:`.discovery`), and the
helpers their presets build models with (:mod:`.building`).

Preset helpers, public for adapters inside and outside this repository:

* :func:`preset_builders` — ``(build_tiny, build_full)`` for a model class and two configurations: random
  weights (nothing is downloaded), cast the way ``from_pretrained(torch_dtype=...)`` casts (the model's
  ``_keep_in_fp32_modules`` stay float32, which ``model.to(dtype)`` would get wrong);
* :func:`near_square_grid` — ``(h, w)`` with ``h * w == tokens``, as square as possible, for latent grids.

Example:
    >>> from memfit.adapters import near_square_grid, preset_builders
    >>> build_tiny, build_full = preset_builders("diffusers:FluxTransformer2DModel", TINY, FULL)
    >>> near_square_grid(64)
    (8, 8)
"""

from memfit.adapters.building import near_square_grid, preset_builders
from memfit.adapters.discovery import available_adapters, find_adapter, get_adapter
from memfit.adapters.spec import BlockSpec, CheckpointSwitch, FamilyAdapter, Preset, Region

__all__ = [
    "BlockSpec",
    "CheckpointSwitch",
    "FamilyAdapter",
    "Preset",
    "Region",
    "available_adapters",
    "find_adapter",
    "get_adapter",
    "near_square_grid",
    "preset_builders",
]
