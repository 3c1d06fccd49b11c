"""Model sizes and dummy inputs for <Family> (random weights; nothing is downloaded).

Fill in the configurations, the builders and ``make_inputs``. A worked example is ``adapters/chroma/src/memfit_chroma/presets.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memfit.adapters.spec import PixelGrid

# from diffusers import <ModelClass>

# Small widths, few blocks: the kit builds this model once per test class and runs ~150 steps with it.
TINY: dict[str, Any] = dict(
    # num_layers=3, num_attention_heads=4, attention_head_dim=8, ...
)
# The published configuration. Cite where the numbers come from, e.g.
# "<org>/<repo> transformer/config.json (revision / date)".
FULL: dict[str, Any] = dict(
    # num_layers=..., num_attention_heads=..., attention_head_dim=..., ...
)


def _not_filled_in(*args: Any, **kwargs: Any) -> nn.Module:
    raise NotImplementedError("build the model class with preset_builders (see memfit_chroma.presets)")


# Replace with `build_tiny, build_full = preset_builders(<ModelClass>, TINY, FULL)`: it creates the weights
# directly in the target dtype on the target device (a 12B model in bf16 builds within 24 GiB), keeps the
# model's `_keep_in_fp32_modules` in float32 as `from_pretrained` does, and seeds the random init.
build_tiny = build_full = _not_filled_in

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
    really called.
    """
    raise NotImplementedError("return the model's forward kwargs (see memfit_chroma.presets.make_inputs)")
