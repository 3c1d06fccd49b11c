"""memfit adapter for Z-Image: declarations only — the core executes."""

from __future__ import annotations

from typing import Any

import torch

from memfit import BlockSpec, FamilyAdapter, Preset
from memfit_z_image.presets import PIXELS, build_full, build_tiny, make_inputs, make_tiny_inputs


def loss(output: Any) -> torch.Tensor:
    """Scalar loss over every sample: the model returns one tensor per sample (their shapes may differ).

    Per-sample mean of squares, averaged over the batch (``default_loss`` would only see sample 0).
    """
    if hasattr(output, "sample"):
        output = output.sample
    elif isinstance(output, tuple):
        output = output[0]
    if isinstance(output, torch.Tensor):
        return output.float().pow(2).mean()
    return torch.stack([sample.float().pow(2).mean() for sample in output]).mean()


ADAPTER = FamilyAdapter(
    name="z-image",
    model_classes=("ZImageTransformer2DModel",),
    # Call order in ZImageTransformer2DModel.forward: image tokens through `noise_refiner`, caption tokens
    # through `context_refiner`, SigLIP tokens through `siglip_refiner` (Omni mode only; None unless
    # `siglip_feat_dim` is configured), then the joint sequence through `layers`.  Every list is routed
    # through `self._gradient_checkpointing_func`.
    block_lists=("noise_refiner", "context_refiner", "siglip_refiner", "layers"),
    blocks={
        # One block class for all four lists (refiners are built with modulation on or off).  The FFN is
        # called as `feed_forward(ffn_norm1(x) [* scale_mlp])`, its output only normed, gated and added to
        # the residual afterwards: a clean one-module boundary.  Attention is
        # `attention(attention_norm1(x) [* scale_msa], attention_mask=..., freqs_cis=...)`.
        "ZImageTransformerBlock": BlockSpec(ffn=(("feed_forward",),), attention=(("attention",),)),
    },
    # Between two blocks of one list the model only feeds the output forward (plus, in `layers`, an
    # optional controlnet residual add, which becomes a chunk entry): interval chunks are safe.
    supports_interval=True,
    verified_versions={"diffusers": ("0.42.1",)},
    block_count_config={
        "noise_refiner": "n_refiner_layers",
        "context_refiner": "n_refiner_layers",
        "siglip_refiner": "n_refiner_layers",
        "layers": "n_layers",
    },
    presets={
        "tiny": Preset(
            build=build_tiny,
            inputs=make_tiny_inputs,
            pixels=PIXELS,
            default_tokens=24,
            description="Omni-shaped: 2+2+2 refiner + 3 main blocks, width 32, SigLIP branch (tests, CPU)",
        ),
        "full": Preset(
            build=build_full,
            inputs=make_inputs,
            pixels=PIXELS,
            default_tokens=4096,
            description="Z-Image-Turbo size (6B): 2+2 refiner + 30 main blocks, width 3840, "
            "1024x1024 px (random weights)",
        ),
    },
    loss=loss,
    notes="All four block lists (siglip_refiner: Omni configs only). Inputs are per-sample lists "
    "(variable-length packing); the loss averages over every sample.",
)

__all__ = ["ADAPTER", "loss"]
