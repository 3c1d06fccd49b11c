"""Model sizes and packed dummy inputs for Mage-Flow (random weights; nothing is downloaded)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from memfit.adapters.building import near_square_grid, preset_builders
from memfit.adapters.spec import PixelGrid

if TYPE_CHECKING:  # the model module imports diffusers: loaded on first build, never by adapter discovery
    from memfit_mageflow.model import MageFlow

TINY = dict(
    in_channels=8,
    out_channels=8,
    context_in_dim=16,
    hidden_size=32,
    num_heads=2,
    depth=4,
    axes_dim=(4, 6, 6),
    patch_size=1,
    mlp_ratio=4.0,
    theta=10000,
)
# As released: microsoft/Mage-Flow transformer/config.json (in/out 128 = Mage-VAE latent channels,
# context 2560 = Qwen3-VL-4B hidden size, 12 double-stream blocks of width 3072, 24 heads of 128).
FULL = dict(
    in_channels=128,
    out_channels=128,
    context_in_dim=2560,
    hidden_size=3072,
    num_heads=24,
    depth=12,
    axes_dim=(16, 56, 56),
    patch_size=1,
    mlp_ratio=4.0,
    theta=10000,
)


def upstream(**config: Any) -> MageFlow:
    """Upstream's base class, built from the same keys (``MageFlow(MageFlowParams(**config))``)."""
    from memfit_mageflow.model import MageFlow, MageFlowParams

    return MageFlow(MageFlowParams(**config))


# the trainer's wrapper class (what trainers train), and upstream's base class
build_tiny, build_full = preset_builders("memfit_mageflow.model:MageFlowTransformer2DModel", TINY, FULL)
build_upstream_tiny, build_upstream_full = preset_builders(upstream, TINY, FULL)
# One token covers 16x16 px: Mage-VAE downsamples 16x and the model patchifies 1x1.
PIXELS = PixelGrid(16)
latent_grid = near_square_grid


def sample_grids(tokens: int, batch: int) -> list[tuple[int, int]]:
    """Latent grids of the packed samples: sample 0 holds ``tokens``, later ones are smaller and alternate
    portrait/landscape (native-resolution packing mixes resolutions and aspect ratios)."""
    h, w = latent_grid(max(1, tokens))
    grids = []
    for i in range(batch):
        hi = max(1, h - i * max(1, h // 4))
        grids.append((w, hi) if i % 2 else (hi, w))
    return grids


def text_lengths(text_tokens: int, batch: int) -> list[int]:
    """Prompt lengths of the packed samples (each sample has its own)."""
    step = max(1, text_tokens // 3)
    return [max(1, text_tokens - i * step) for i in range(batch)]


def make_inputs(
    model: MageFlow,
    *,
    tokens: int | None = None,
    batch: int = 2,
    text_tokens: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """Forward kwargs for one packed step: ``batch`` samples of different resolutions and prompt lengths.

    ``tokens`` is the image-token count of the first (largest) sample; the others are somewhat smaller,
    so the pack holds a little under ``batch * tokens`` image tokens.
    """
    from memfit_mageflow.model import lengths_to_cu_seqlens

    cfg = model.params  # both classes keep upstream's parameter struct
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    tokens = tokens or 64
    text_tokens = text_tokens or (512 if cfg.context_in_dim >= 1024 else 8)
    grids = sample_grids(tokens, batch)
    img_lens = [h * w for h, w in grids]
    txt_lens = text_lengths(text_tokens, batch)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    return dict(
        hidden_states=randn(1, sum(img_lens), cfg.in_channels),
        encoder_hidden_states=randn(1, sum(txt_lens), cfg.context_in_dim),
        timestep=torch.rand(batch, generator=generator).to(device=device, dtype=dtype),
        img_shapes=[(1, h, w) for h, w in grids],
        img_cu_seqlens=lengths_to_cu_seqlens(img_lens, device=device),
        txt_cu_seqlens=lengths_to_cu_seqlens(txt_lens, device=device),
    )
