"""Model sizes and dummy inputs for LTX-2 (random weights; nothing is downloaded).

Token mapping
-------------
A preset's ``inputs(model, tokens=N)`` receives the number of *video* tokens. LTX-2 patchifies
with ``patch_size = patch_size_t = 1``, so one token is one latent voxel and
``N = latent_frames * latent_height * latent_width``. :func:`latent_video_grid` splits ``N``
exactly into such a grid:

* ``latent_frames`` is the divisor of ``N`` closest to ``cbrt(N)`` (ties go to fewer frames);
* ``latent_height x latent_width`` is the most nearly square factorisation of ``N / latent_frames``
  (height <= width).

So ``6144 -> 16 x 16 x 24`` (121 pixel frames at 512x768, the LTX-2 default clip),
``4096 -> 16 x 16 x 16`` and ``32 -> 4 x 2 x 4``. A prime ``N`` degenerates to ``1 x 1 x N``:
still valid input, just an odd video.

The audio stream is sized from the same clip: the video VAE turns ``latent_frames`` into
``(latent_frames - 1) * vae_scale_factors[0] + 1`` pixel frames, which last ``pixel_frames / fps``
seconds at ``fps = 24``; the audio latents run at
``audio_sampling_rate / audio_hop_length / audio_scale_factor`` (= 25 per second for LTX-2), so
``audio_tokens = round(seconds * 25)`` -- the rule the diffusers ``LTX2Pipeline`` uses.
``6144`` video tokens come with ``126`` audio tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from memfit.adapters.building import preset_builders
from memfit.adapters.spec import PixelGrid

if TYPE_CHECKING:  # diffusers is imported on first build: adapter discovery must stay cheap
    from diffusers import LTX2VideoTransformer3DModel

FPS = 24.0

# Tiny: every stream and every attention present, widths of a few units. Constraints the model
# imposes on a config (all hold for the published one too):
# * caption_projection maps text to `num_attention_heads * attention_head_dim`, and attn2 reads it
#   with `cross_attention_dim` -> the two must be equal; likewise for the audio stream.
# * the a2v/v2a rotary tables are built with width `audio_cross_attention_dim` and, for "split"
#   RoPE, reshaped by the *video* head count while applied inside audio-head attention -> equal
#   head counts for video and audio.
TINY = dict(
    in_channels=8,
    out_channels=8,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,
    audio_in_channels=8,
    audio_out_channels=8,
    audio_patch_size=1,
    audio_patch_size_t=1,
    audio_num_attention_heads=2,
    audio_attention_head_dim=4,
    audio_cross_attention_dim=8,
    num_layers=3,
    caption_channels=16,
    rope_type="split",
    rope_double_precision=True,
)

# LTX-2 (19B: 14B video stream + 5B audio stream) as published in Lightricks/LTX-2
# transformer/config.json. The numbers are the "2.0" config of diffusers'
# scripts/convert_ltx2_to_diffusers.py (`get_ltx2_transformer_config`), which produced that
# checkpoint; the remaining keys (vae_scale_factors (8, 32, 32), pos_embed_max_pos 20,
# base_height/width 2048, audio_scale_factor 4, 16 kHz / hop 160, norm_eps 1e-6, ...) equal the
# class defaults of diffusers 0.42.1 and are spelled out so a default change cannot alter the preset.
FULL = dict(
    in_channels=128,
    out_channels=128,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=32,
    attention_head_dim=128,
    cross_attention_dim=4096,
    vae_scale_factors=(8, 32, 32),
    pos_embed_max_pos=20,
    base_height=2048,
    base_width=2048,
    audio_in_channels=128,
    audio_out_channels=128,
    audio_patch_size=1,
    audio_patch_size_t=1,
    audio_num_attention_heads=32,
    audio_attention_head_dim=64,
    audio_cross_attention_dim=2048,
    audio_scale_factor=4,
    audio_pos_embed_max_pos=20,
    audio_sampling_rate=16000,
    audio_hop_length=160,
    num_layers=48,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=3840,
    attention_bias=True,
    attention_out_bias=True,
    rope_theta=10000.0,
    rope_double_precision=True,
    causal_offset=1,
    timestep_scale_multiplier=1000,
    cross_attn_timestep_scale_multiplier=1000,
    rope_type="split",
)

# Text length of the full preset: LTX2Pipeline's default `max_sequence_length` (1024); the text
# connectors keep that length (learnable registers replace padding).
FULL_TEXT_TOKENS = 1024
TINY_TEXT_TOKENS = 8


build_tiny, build_full = preset_builders("diffusers:LTX2VideoTransformer3DModel", TINY, FULL)
# LTX-2's VAE: 32x spatial, 8x temporal (first frame alone); patch 1. 768x512 px, 121 frames = 6144 tokens.
PIXELS = PixelGrid(32, frames_per_latent=8)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def latent_video_grid(tokens: int) -> tuple[int, int, int]:
    """``(frames, height, width)`` with ``frames * height * width == tokens`` (see the module docstring)."""
    if tokens < 1:
        raise ValueError(f"need at least one video token, got {tokens}")
    root = tokens ** (1 / 3)
    frames = min(_divisors(tokens), key=lambda d: (abs(d - root), d))
    spatial = tokens // frames
    height = max(d for d in _divisors(spatial) if d * d <= spatial)
    return frames, height, spatial // height


def audio_latent_frames(model: LTX2VideoTransformer3DModel, latent_frames: int, fps: float = FPS) -> int:
    """Audio latent length of the clip ``latent_frames`` video latents encode (the LTX2Pipeline rule)."""
    cfg = model.config
    pixel_frames = (latent_frames - 1) * cfg.vae_scale_factors[0] + 1
    per_second = cfg.audio_sampling_rate / cfg.audio_hop_length / cfg.audio_scale_factor
    return max(1, round(pixel_frames / fps * per_second))


def make_inputs(
    model: LTX2VideoTransformer3DModel,
    *,
    tokens: int | None = None,
    batch: int = 1,
    text_tokens: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """Forward kwargs: packed video latents of ``tokens`` tokens, the matching audio latents, text for
    both streams (before the model's caption projections), timestep, and the grid sizes RoPE needs."""
    cfg = model.config
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    tokens = tokens or 32
    text_tokens = text_tokens or (FULL_TEXT_TOKENS if cfg.caption_channels >= 1024 else TINY_TEXT_TOKENS)
    frames, height, width = latent_video_grid(tokens)
    audio_tokens = audio_latent_frames(model, frames)
    # patch_size == 1 in both published configs; a preset with larger patches needs this scaled.
    video_channels = cfg.in_channels * cfg.patch_size_t * cfg.patch_size**2
    audio_channels = cfg.audio_in_channels * cfg.audio_patch_size_t * cfg.audio_patch_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    # Flow-matching sigma in (0, 1); the model takes timestep = sigma * 1000 (timestep_scale_multiplier).
    sigma = torch.rand(batch, generator=generator).to(device=device, dtype=dtype)
    return dict(
        hidden_states=randn(batch, tokens, video_channels),
        audio_hidden_states=randn(batch, audio_tokens, audio_channels),
        encoder_hidden_states=randn(batch, text_tokens, cfg.caption_channels),
        audio_encoder_hidden_states=randn(batch, text_tokens, cfg.caption_channels),
        timestep=sigma * cfg.timestep_scale_multiplier,
        sigma=sigma,
        encoder_attention_mask=torch.ones(batch, text_tokens, device=device, dtype=dtype),
        audio_encoder_attention_mask=torch.ones(batch, text_tokens, device=device, dtype=dtype),
        num_frames=frames,
        height=height,
        width=width,
        fps=FPS,
        audio_num_frames=audio_tokens,
        return_dict=False,
    )
