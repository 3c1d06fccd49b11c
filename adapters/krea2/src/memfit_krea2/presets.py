"""Model sizes and dummy inputs for Krea 2 (random weights; nothing is downloaded).

Token mapping used by :func:`make_inputs`: ``tokens`` is the number of *packed image tokens*
the transformer sees. Krea 2 encodes images with the Qwen-Image VAE (8x spatial compression,
16 channels) and the pipeline packs the latent into 2x2 patches (``in_channels = 16 * 2 * 2 = 64``),
so one token covers 16x16 pixels. ``tokens`` is factored into a near-square grid
``grid_h * grid_w == tokens`` (the largest divisor of ``tokens`` not above its square root is
``grid_h``); the latent is then ``2*grid_h x 2*grid_w`` and the image ``16*grid_h x 16*grid_w``
pixels. Examples: 4096 tokens = 64x64 grid = 128x128 latent = 1024x1024 px (the Krea2Pipeline
documentation's example size and the usual LoRA/fine-tuning resolution; the full preset's default);
1024 tokens = 512x512 px;
16384 tokens = 2048x2048 px. A prime token count gives a 1 x tokens strip (valid, but odd).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from memfit.adapters.building import near_square_grid, packed_image_ids, preset_builders
from memfit.adapters.spec import PixelGrid

if TYPE_CHECKING:  # diffusers is imported on first build: adapter discovery must stay cheap
    from diffusers import Krea2Transformer2DModel

# Pixels per packed token along each axis: VAE factor 8 x patch size 2 (diffusers Krea2Pipeline).
VAE_SCALE_FACTOR = 8
PATCH_SIZE = 2
# Krea2Pipeline's fixed text length: prompts are padded/truncated to max_sequence_length=512.
FULL_TEXT_TOKENS = 512
# Krea2Pipeline's prompt template ends with 5 suffix tokens that sit *after* the padding
# (`[prompt | PAD | suffix]`), so the text mask has a hole in the middle.
TEMPLATE_SUFFIX_TOKENS = 5

# Small enough that the whole kit runs in seconds on a 2-core CPU, but keeps every structural feature
# of the full model: grouped-query attention in the main blocks (4 query / 2 kv heads), MHA in the
# text-fusion blocks (as in the release, 20/20), 3 tapped text layers, 2 layerwise + 2 refiner
# text-fusion blocks, 4 main blocks (so interval 2/3 and stride leave partial chunks and gaps).
TINY = dict(
    in_channels=16,
    num_layers=4,
    attention_head_dim=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    timestep_embed_dim=16,
    text_hidden_dim=16,
    num_text_layers=3,
    text_num_attention_heads=2,
    text_num_key_value_heads=2,
    text_intermediate_size=24,
    num_layerwise_text_blocks=2,
    num_refiner_text_blocks=2,
    axes_dims_rope=(2, 2, 4),
)
TINY_TEXT_TOKENS = 8

# Krea 2 as released: these are the `Krea2Transformer2DModel.__init__` defaults of diffusers 0.42.1
# (src/diffusers/models/transformers/transformer_krea2.py; same numbers in the API docs,
# https://huggingface.co/docs/diffusers/main/api/models/krea2_transformer2d), which the diffusers
# conversion ships for the Krea 2 Base/Turbo checkpoints: 28 single-stream blocks at width 6144
# (48 heads x 128, 12 kv heads), SwiGLU 16384; text fusion over 12 tapped hidden states of
# Qwen3-VL-4B-Instruct (width 2560), 2 layerwise + 2 refiner blocks. diffusers builds 12.82B
# parameters from it (0.34B of them in the text fusion); the Krea 2 Base diffusers model card says
# "12.9B parameters, 28 blocks at width 6144". Spelled out here so a change of diffusers' defaults
# cannot silently change the preset.
FULL = dict(
    in_channels=64,
    num_layers=28,
    attention_head_dim=128,
    num_attention_heads=48,
    num_key_value_heads=12,
    intermediate_size=16384,
    timestep_embed_dim=256,
    text_hidden_dim=2560,
    num_text_layers=12,
    text_num_attention_heads=20,
    text_num_key_value_heads=20,
    text_intermediate_size=6912,
    num_layerwise_text_blocks=2,
    num_refiner_text_blocks=2,
    axes_dims_rope=(32, 48, 48),
    rope_theta=1000.0,
    norm_eps=1e-5,
)


build_tiny, build_full = preset_builders("diffusers:Krea2Transformer2DModel", TINY, FULL)
# One packed token covers 16x16 px (see the module docstring).
PIXELS = PixelGrid(VAE_SCALE_FACTOR * PATCH_SIZE)
latent_grid = near_square_grid


def image_size(tokens: int) -> tuple[int, int]:
    """Pixel ``(height, width)`` of the image whose packed latent has ``tokens`` tokens."""
    h, w = latent_grid(tokens)
    step = VAE_SCALE_FACTOR * PATCH_SIZE
    return h * step, w * step


def text_mask(batch: int, text_tokens: int, *, prompt_tokens: int | None = None) -> torch.Tensor:
    """Boolean text mask in Krea2Pipeline's layout: ``[prompt | PAD | suffix]`` (valid, padded, valid)."""
    suffix = min(TEMPLATE_SUFFIX_TOKENS, text_tokens // 4)
    if prompt_tokens is None:
        prompt_tokens = max(1, (text_tokens - suffix) // 2)
    prompt_tokens = min(prompt_tokens, text_tokens - suffix)
    mask = torch.zeros(batch, text_tokens, dtype=torch.bool)
    mask[:, :prompt_tokens] = True
    if suffix:
        mask[:, text_tokens - suffix :] = True
    return mask


def make_inputs(
    model: Krea2Transformer2DModel,
    *,
    tokens: int | None = None,
    batch: int = 1,
    text_tokens: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """Forward kwargs for one training step.

    Args:
        tokens: packed image tokens (see the module docstring for the mapping to latent/pixel size).
        batch: batch size.
        text_tokens: text sequence length; default 512 (the pipeline's fixed length) for the full
            model, 8 for small configurations.
        generator: CPU generator for reproducible random inputs.
    """
    cfg = model.config
    weight = model.img_in.weight
    device, dtype = weight.device, weight.dtype
    tokens = tokens or 64
    if text_tokens is None:
        text_tokens = FULL_TEXT_TOKENS if cfg.text_hidden_dim >= 1024 else TINY_TEXT_TOKENS
    h, w = latent_grid(tokens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    # Rotary coordinates as Krea2Pipeline.prepare_position_ids builds them: text rows all zero,
    # image rows (0, row, col) of the packed grid; one table for the whole [text, image] sequence.
    position_ids = torch.cat([torch.zeros(text_tokens, 3), packed_image_ids(h, w)]).to(device)
    return dict(
        hidden_states=randn(batch, h * w, cfg.in_channels),
        encoder_hidden_states=randn(batch, text_tokens, cfg.num_text_layers, cfg.text_hidden_dim),
        # flow time in [0, 1]
        timestep=torch.rand(batch, generator=generator).to(device=device, dtype=dtype),
        position_ids=position_ids,
        encoder_attention_mask=text_mask(batch, text_tokens).to(device),
        return_dict=False,
    )
