"""Model sizes and dummy inputs for Z-Image (random weights; nothing is downloaded).

``ZImageTransformer2DModel.forward`` takes *lists* of per-sample tensors (variable-length packing):
``x`` holds one latent ``(C, F, H, W)`` per sample and ``cap_feats`` one caption embedding
``(L_i, cap_feat_dim)`` per sample; the model patchifies each, pads every sequence up to a multiple of
32 tokens, and pads the batch to its longest sample with an attention mask.  With ``siglip_feat_dim``
configured (the Omni variant), ``x``/``cap_feats`` become nested lists (several images per sample, the
last one being the noisy target), ``siglip_feats`` carries SigLIP features ``(h, w, siglip_feat_dim)``
for the condition images, and ``image_noise_mask`` marks clean (0) / noisy (1) images.

Token count -> shape: ``tokens`` is the number of image tokens of the (target) image.  It is rounded to
a near-square token grid ``h x w`` with ``h * w == tokens`` (see :func:`latent_grid`); with patch size
``p`` (2 for every published config) the latent is ``(in_channels, 1, p*h, p*w)``, i.e. an image of
``8*p*h x 8*p*w`` pixels through the 8x VAE.  ``tokens=4096`` is a 64 x 64 grid = 128 x 128 latent =
1024 x 1024 px.  The model then pads the sequence to a multiple of 32 tokens itself.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from memfit.adapters.building import near_square_grid, preset_builders
from memfit.adapters.spec import PixelGrid

if TYPE_CHECKING:  # diffusers is imported on first build: adapter discovery must stay cheap
    from diffusers import ZImageTransformer2DModel

# The model pads every per-sample sequence (image, caption, SigLIP) to a multiple of this many tokens.
SEQ_MULTI_OF = 32

# Tiny: every block list present and non-empty, SigLIP branch configured so that `siglip_refiner`
# exists and runs (the tiny inputs are Omni-mode inputs).  head_dim = dim / n_heads = 16 = sum(axes_dims).
TINY = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=32,
    n_layers=3,
    n_refiner_layers=2,
    n_heads=2,
    n_kv_heads=2,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=16,
    siglip_feat_dim=24,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=(8, 4, 4),
    axes_lens=(512, 256, 256),
)
# Z-Image-Turbo (6B) as published: Tongyi-MAI/Z-Image-Turbo transformer/config.json.  It sets no
# `siglip_feat_dim` (text-to-image only), so `siglip_refiner` is None on this model.
FULL = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=3840,
    n_layers=30,
    n_refiner_layers=2,
    n_heads=30,
    n_kv_heads=30,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=2560,
    siglip_feat_dim=None,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=(32, 48, 48),
    axes_lens=(1536, 512, 512),
)


def _give_pad_tokens_values(model: ZImageTransformer2DModel) -> None:
    # The pad tokens are zero-initialised in diffusers; give them values so that a wrong gradient
    # through the padded positions cannot hide behind zeros.
    with torch.no_grad():
        for name in ("x_pad_token", "cap_pad_token", "siglip_pad_token"):
            token = getattr(model, name, None)
            if token is not None:
                token.normal_()


_build_tiny, build_full = preset_builders("diffusers:ZImageTransformer2DModel", TINY, FULL)
# One token covers 16x16 px: the VAE downsamples 8x, the model patchifies 2x2 (1024x1024 px = 4096 tokens).
PIXELS = PixelGrid(16)


def build_tiny(**kwargs: Any) -> ZImageTransformer2DModel:
    model = _build_tiny(**kwargs)
    _give_pad_tokens_values(model)
    return model


def latent_grid(tokens: int) -> tuple[int, int]:
    """A near-square (h, w) token grid with h*w == tokens (at least one token)."""
    return near_square_grid(max(1, tokens))


def caption_lengths(text_tokens: int, batch: int) -> list[int]:
    """Per-sample caption lengths: the pipeline trims each prompt to its real length, so they differ.

    Sample ``i`` is ``i * 32`` tokens shorter (at least 1), so with ``batch > 1`` the padded batch
    carries an attention mask, as in real training batches.
    """
    return [max(1, text_tokens - SEQ_MULTI_OF * i) for i in range(batch)]


def make_inputs(
    model: ZImageTransformer2DModel,
    *,
    tokens: int | None = None,
    batch: int = 1,
    text_tokens: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """Forward kwargs for one training step: ``tokens`` image tokens per sample (see the module docstring).

    Text-to-image mode (Turbo / base config): ``x`` = [latent_i], ``cap_feats`` = [caption_i].
    Omni mode (``siglip_feat_dim`` configured): per sample one clean condition image (same token count,
    transposed aspect ratio) with SigLIP features, then the noisy target image; three caption segments
    (text before, between and after the images, as ZImageOmniPipeline builds them).

    ``t`` is a float tensor of shape (batch,) in [0, 1] (the pipeline's normalised time); it is the one
    plain-tensor input of the forward, so the conformance kit compares its gradient.
    """
    cfg = model.config
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    patch, f_patch = cfg.all_patch_size[0], cfg.all_f_patch_size[0]
    tokens = tokens or 256
    text_tokens = text_tokens or (512 if cfg.cap_feat_dim >= 1024 else 40)
    h, w = latent_grid(tokens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    def latent(gh: int, gw: int) -> torch.Tensor:
        return randn(cfg.in_channels, f_patch, patch * gh, patch * gw)

    inputs: dict[str, Any] = dict(
        t=torch.rand(batch, generator=generator).to(device=device),
        return_dict=True,  # the tuple form is `([sample, ...],)`; the kit reads `.sample`
    )
    lengths = caption_lengths(text_tokens, batch)
    if cfg.siglip_feat_dim is None:
        inputs["x"] = [latent(h, w) for _ in range(batch)]
        inputs["cap_feats"] = [randn(n, cfg.cap_feat_dim) for n in lengths]
        return inputs

    inputs["x"] = [[latent(w, h), latent(h, w)] for _ in range(batch)]
    inputs["cap_feats"] = [
        [randn(4, cfg.cap_feat_dim), randn(n, cfg.cap_feat_dim), randn(3, cfg.cap_feat_dim)] for n in lengths
    ]
    inputs["siglip_feats"] = [[randn(w, h, cfg.siglip_feat_dim), None] for _ in range(batch)]
    inputs["image_noise_mask"] = [[0, 1] for _ in range(batch)]
    return inputs


# The tiny preset packs two samples of different caption length, so the padded-batch path (attention
# masks, pad tokens) is what the kit checks.
make_tiny_inputs = partial(make_inputs, batch=2)
