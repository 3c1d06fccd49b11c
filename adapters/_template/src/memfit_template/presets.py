"""Model sizes and dummy inputs for <Family> (random weights; nothing is downloaded).

Fill in ``TINY``, ``FULL``, the model class and ``make_inputs``. A worked example is
``adapters/flux/src/memfit_flux/presets.py`` in the memfit repository.
"""

from __future__ import annotations

from typing import Any

import torch
from memfit.adapters import near_square_grid, preset_builders
from memfit.adapters.spec import PixelGrid
from torch import nn

# Small widths, few blocks: the kit builds this model once per test class and runs ~150 steps with it.
TINY: dict[str, Any] = dict(
    # num_layers=3, num_attention_heads=4, attention_head_dim=8, ...
)
# The published configuration. Cite where the numbers come from, e.g.
# "<org>/<repo> transformer/config.json (revision / date)".
FULL: dict[str, Any] = dict(
    # num_layers=..., num_attention_heads=..., attention_head_dim=..., ...
)

# The model class as "module:Class", imported on the first build (adapter discovery stays cheap). The builders
# seed the random weights and cast the way from_pretrained(torch_dtype=...) does: the model's
# `_keep_in_fp32_modules` stay float32, which `model.to(dtype)` would get wrong. tiny: float32 on the CPU,
# full: bfloat16 on CUDA; both take `dtype=`, `device=`, `seed=`.
build_tiny, build_full = preset_builders("diffusers:<ModelClass>", TINY, FULL)

# How a training resolution becomes tokens (`memfit fit --resolution WxH [--frames N]`): the pixels one token
# covers along each axis (VAE downsampling x patch size) and, for video, the VAE's temporal compression.
PIXELS = PixelGrid(16)  # e.g. PixelGrid(16, frames_per_latent=4) for a video family


def make_inputs(
    model: nn.Module, *, tokens: int | None = None, batch: int = 1, generator: torch.Generator | None = None
) -> dict[str, Any]:
    """Forward kwargs for one training step: ``tokens`` image tokens (round to a valid latent shape).

    Build every random tensor from ``generator`` on the CPU, then move it to the model's device and
    dtype, so that the same seed gives the same inputs everywhere. Pass what trainers pass (masks, ids,
    ``return_dict=False``), not only what the forward minimally needs: the kit checks the model as it is
    really called. ``near_square_grid(tokens)`` gives an ``(h, w)`` latent grid of exactly ``tokens`` tokens.
    """
    h, w = near_square_grid(tokens or 64)
    raise NotImplementedError(
        f"return the model's forward kwargs for a {h}x{w} latent grid (see memfit_flux.presets.make_inputs)"
    )
