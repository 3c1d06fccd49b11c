"""Model sizes and dummy inputs for Chroma (random weights; nothing is downloaded)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from memfit.adapters.building import near_square_grid, packed_image_ids, preset_builders
from memfit.adapters.spec import PixelGrid

if TYPE_CHECKING:  # diffusers is imported on first build: adapter discovery must stay cheap
    from diffusers import ChromaTransformer2DModel

# Small enough that the whole conformance kit runs in seconds on a laptop CPU, big enough that every
# interval/stride combination of the kit (intervals 1-3, strides up to 6) has full and partial chunks
# in both block lists. attention_head_dim must equal sum(axes_dims_rope); approximator_num_channels
# must be a multiple of 4 (the model splits it into 4 quarter-width time/guidance embeddings).
TINY = dict(
    patch_size=1,
    in_channels=8,
    num_layers=3,
    num_single_layers=4,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=16,
    axes_dims_rope=(2, 2, 4),
    approximator_num_channels=16,
    approximator_hidden_dim=32,
    approximator_layers=2,
)
# Chroma1-HD as published: lodestones/Chroma1-HD, transformer/config.json (the same numbers as
# lodestones/Chroma1-Base and as diffusers' ChromaTransformer2DModel defaults). About 8.9B parameters:
# FLUX.1-schnell's 19 double + 38 single blocks at width 3072 (24 heads x 128) with the per-block
# modulation MLPs replaced by one shared 5-layer "distilled guidance" approximator of width 5120.
FULL = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    axes_dims_rope=(16, 56, 56),
    approximator_num_channels=64,
    approximator_hidden_dim=5120,
    approximator_layers=5,
)
# T5-XXL prompt length Chroma trains and samples with (ChromaPipeline / SimpleTuner max_sequence_length).
FULL_TEXT_TOKENS = 512


build_tiny, build_full = preset_builders("diffusers:ChromaTransformer2DModel", TINY, FULL)
# One packed token covers 16x16 px: the VAE downsamples 8x, the pipeline packs 2x2 latents (1024x1024 px = 4096 tokens).
PIXELS = PixelGrid(16)
latent_grid = near_square_grid


def make_inputs(
    model: ChromaTransformer2DModel,
    *,
    tokens: int | None = None,
    batch: int = 1,
    text_tokens: int | None = None,
    generator: torch.Generator | None = None,
    attention_mask: bool = True,
) -> dict[str, Any]:
    """Forward kwargs: packed image latents of ``tokens`` tokens, T5 text context, timestep.

    Chroma has no pooled text embedding and no guidance input (both are replaced by the
    approximator). ``attention_mask`` (default on) adds the boolean text+image mask Chroma is trained
    and sampled with (ChromaPipeline builds it; SimpleTuner refuses to train without it): padded
    prompt tokens are masked out except the first padding token.
    """
    cfg = model.config
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    tokens = tokens or 64
    text_tokens = text_tokens or (FULL_TEXT_TOKENS if cfg.joint_attention_dim >= 1024 else 8)
    h, w = latent_grid(tokens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    inputs: dict[str, Any] = dict(
        hidden_states=randn(batch, h * w, cfg.in_channels),
        encoder_hidden_states=randn(batch, text_tokens, cfg.joint_attention_dim),
        # the pipeline passes sigma in [0, 1]; the model multiplies by 1000 itself
        timestep=torch.rand(batch, generator=generator).to(device=device, dtype=dtype),
        img_ids=packed_image_ids(h, w).to(device),  # float32: exact positions on any grid
        txt_ids=torch.zeros(text_tokens, 3, device=device),
        return_dict=False,
    )
    if attention_mask:
        # a prompt of about half the maximum length; keep it plus one padding token, as Chroma does
        prompt_len = max(1, text_tokens // 2)
        text_mask = torch.arange(text_tokens)[None, :].expand(batch, -1) <= prompt_len
        image_mask = torch.ones(batch, h * w, dtype=torch.bool)
        inputs["attention_mask"] = torch.cat([text_mask, image_mask], dim=1).to(device)
    return inputs
