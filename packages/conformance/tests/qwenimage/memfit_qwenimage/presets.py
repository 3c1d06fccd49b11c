"""Model sizes and dummy inputs for Qwen-Image (random weights; nothing is downloaded)."""

from __future__ import annotations

from typing import Any

import torch
from memfit.adapters import near_square_grid, preset_builders
from torch import nn

TINY: dict[str, Any] = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=3,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=16,
    axes_dims_rope=(2, 2, 4),
)
# Qwen-Image as published (Qwen/Qwen-Image transformer/config.json).
FULL: dict[str, Any] = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    axes_dims_rope=(16, 56, 56),
)

# The model class is named as "module:Class" and imported on first build: discovery stays cheap.
build_tiny, build_full = preset_builders("diffusers:QwenImageTransformer2DModel", TINY, FULL)


def make_inputs(
    model: nn.Module,
    *,
    tokens: int | None = None,
    batch: int = 1,
    text_tokens: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """Forward kwargs as the Qwen-Image pipeline passes them: packed latents of ``tokens`` tokens on an
    ``h x w`` grid, text embeddings with a padding mask (the last two padded), timestep in [0, 1]."""
    cfg = model.config
    p = next(model.parameters())
    tokens = tokens or 64
    text_tokens = text_tokens or (256 if cfg.joint_attention_dim >= 1024 else 8)
    h, w = near_square_grid(tokens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=p.device, dtype=p.dtype)

    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[:, -2:] = 0
    return dict(
        hidden_states=randn(batch, h * w, cfg.in_channels),
        encoder_hidden_states=randn(batch, text_tokens, cfg.joint_attention_dim),
        encoder_hidden_states_mask=mask.to(p.device),
        timestep=torch.rand(batch, generator=generator).to(device=p.device, dtype=p.dtype),
        img_shapes=[[(1, h, w)]] * batch,
        return_dict=False,
    )
