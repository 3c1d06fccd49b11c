"""Model sizes and dummy inputs for Wan 2.1 / 2.2 (random weights; nothing is downloaded).

Token -> latent mapping (what ``make_inputs(tokens=...)`` builds)
------------------------------------------------------------------
Wan's VAE compresses video 4x in time and 8x in space (``F_lat = (F_video - 1) / 4 + 1``,
``H_lat = H / 8``), and the transformer patchifies latents with ``patch_size = (1, 2, 2)``. One
latent frame of the 480p training size 480x832 is therefore a 60x104 latent, 30x52 = 1560 tokens.

* latent frames ``F = max(min(3, tokens), ceil(tokens / 1560))``: at least 3 (so the clip is a clip and
  the temporal RoPE axis is exercised), more once 480p frames are full;
* each frame gets the largest grid of about ``tokens / F`` patches with the 480p aspect 30:52, capped at
  30x52 (480x832 pixels).

So a multiple of 1560 from 4680 up is an exact 480x832 clip: 14040 tokens = 9 latent frames = 33 video
frames (the ``full`` default), 32760 tokens = 21 latent frames = 81 video frames (Wan's native clip
length). Other counts give a slightly smaller frame and a few percent fewer tokens
(4096 -> 3x28x48 = 4032). The tiny default, 72 tokens, is 3 latent frames of 4x6 patches.

The returned latent is ``(batch, in_channels, F * p_t, h * p_h, w * p_w)``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from memfit.adapters.building import preset_builders
from memfit.adapters.spec import PixelGrid

if TYPE_CHECKING:  # diffusers is imported on first build: adapter discovery must stay cheap
    from diffusers import WanTransformer3DModel

TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=16,
    ffn_dim=48,
    num_layers=7,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
# Wan2.1-T2V-14B as published (Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json; the same numbers
# are dim 5120 / ffn_dim 13824 / 40 heads / 40 layers in the Wan2.1 README "Model" table). Wan2.2-T2V-A14B
# uses this very config for each of its two experts (transformer/ and transformer_2/ of
# Wan-AI/Wan2.2-T2V-A14B-Diffusers); a LoRA run trains one expert at a time, so one expert is what has to fit.
FULL = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)

# 480x832 pixels -> 60x104 latent (VAE /8) -> 30x52 patches (patch 2x2) per latent frame.
FRAME_GRID_480P = (30, 52)
TOKENS_PER_480P_FRAME = FRAME_GRID_480P[0] * FRAME_GRID_480P[1]  # 1560
MIN_FRAMES = 3
TEXT_TOKENS_FULL = 512  # umT5 prompts are padded to 512 tokens in the Wan pipelines


build_tiny, build_full = preset_builders("diffusers:WanTransformer3DModel", TINY, FULL)
# Wan's VAE: 8x spatial, 4x temporal (first frame alone); patches 1x2x2. 832x480 px, 81 frames = 32760 tokens.
PIXELS = PixelGrid(16, frames_per_latent=4)


def latent_grid(tokens: int) -> tuple[int, int, int]:
    """``(frames, h, w)`` in patch units with ``frames * h * w`` close to ``tokens`` (module docstring)."""
    tokens = max(1, int(tokens))
    max_h, max_w = FRAME_GRID_480P
    frames = max(min(MIN_FRAMES, tokens), math.ceil(tokens / TOKENS_PER_480P_FRAME))
    per_frame = max(1, tokens // frames)
    h = min(max_h, max(1, round(math.sqrt(per_frame * max_h / max_w))))
    w = min(max_w, max(1, per_frame // h))
    return frames, h, w


def video_frames(latent_frames: int) -> int:
    """Pixel-space frame count that Wan's VAE encodes into ``latent_frames`` latent frames."""
    return 4 * (latent_frames - 1) + 1


def make_inputs(
    model: WanTransformer3DModel,
    *,
    tokens: int | None = None,
    batch: int = 1,
    text_tokens: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """Forward kwargs: a 5-D video latent of about ``tokens`` patch tokens, text context, timestep."""
    cfg = model.config
    # the patch embedding's weight, not the first parameter: the model's own `scale_shift_table` comes
    # first and stays float32 (see `_cast`)
    p = model.patch_embedding.weight
    device, dtype = p.device, p.dtype
    tokens = tokens or 72
    text_tokens = text_tokens or (TEXT_TOKENS_FULL if cfg.text_dim >= 1024 else 8)
    frames, h, w = latent_grid(tokens)
    p_t, p_h, p_w = cfg.patch_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    return dict(
        hidden_states=randn(batch, cfg.in_channels, frames * p_t, h * p_h, w * p_w),
        encoder_hidden_states=randn(batch, text_tokens, cfg.text_dim),
        # flow-matching timesteps in [0, 1000), float32 as the Wan pipelines pass them
        timestep=(torch.rand(batch, generator=generator) * 1000).to(device=device),
        return_dict=False,
    )
