"""Model sizes and dummy inputs for Flux (random weights; nothing is downloaded)."""

from __future__ import annotations

from typing import Any

import torch

from memfit.adapters.building import near_square_grid, packed_image_ids, preset_builders
from memfit.adapters.spec import PixelGrid

# diffusers is imported inside the builders: adapter discovery (entry points) must stay cheap.

TINY = dict(
    patch_size=1,
    in_channels=8,
    num_layers=3,
    num_single_layers=4,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=16,
    pooled_projection_dim=16,
    guidance_embeds=True,
    axes_dims_rope=(2, 2, 4),
)
# FLUX.1-dev as published (black-forest-labs/FLUX.1-dev transformer/config.json).
FULL = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)


build_tiny, build_full = preset_builders("diffusers:FluxTransformer2DModel", TINY, FULL)
# One packed token covers 16x16 px: the VAE downsamples 8x, the pipeline packs 2x2 latents (1024x1024 px = 4096 tokens).
PIXELS = PixelGrid(16)
latent_grid = near_square_grid


def make_inputs(
    model,
    *,
    tokens: int | None = None,
    batch: int = 1,
    text_tokens: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """Forward kwargs: packed image latents of ``tokens`` tokens, text context, timestep, guidance."""
    cfg = model.config
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    tokens = tokens or 64
    text_tokens = text_tokens or (512 if cfg.joint_attention_dim >= 1024 else 8)
    h, w = latent_grid(tokens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    inputs = dict(
        hidden_states=randn(batch, h * w, cfg.in_channels),
        encoder_hidden_states=randn(batch, text_tokens, cfg.joint_attention_dim),
        pooled_projections=randn(batch, cfg.pooled_projection_dim),
        timestep=torch.rand(batch, generator=generator).to(device=device, dtype=dtype),
        img_ids=packed_image_ids(h, w).to(device),
        txt_ids=torch.zeros(text_tokens, 3, device=device),
        return_dict=False,
    )
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 3.5, device=device, dtype=dtype)
    return inputs
