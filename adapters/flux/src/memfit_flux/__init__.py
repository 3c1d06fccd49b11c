"""memfit adapter for Flux: declarations only — the core executes."""

from memfit import BlockSpec, FamilyAdapter, Preset
from memfit_flux.presets import PIXELS, build_full, build_tiny, make_inputs

ADAPTER = FamilyAdapter(
    name="flux",
    model_classes=("FluxTransformer2DModel",),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    blocks={
        # Double-stream block: the image and text FFNs each read one normed tensor and return one
        # tensor that is only gated and added to the residual afterwards: clean boundaries.
        "FluxTransformerBlock": BlockSpec(ffn=(("ff",), ("ff_context",)), attention=(("attn",),)),
        # Single-stream block: the MLP branch is `act_mlp(proj_mlp(x))`, concatenated with the
        # attention output afterwards; the chain ends before the concat, so the boundary is safe.
        "FluxSingleTransformerBlock": BlockSpec(ffn=(("proj_mlp", "act_mlp"),), attention=(("attn",),)),
    },
    supports_interval=True,
    verified_versions={"diffusers": ("0.42.1",)},
    block_count_config={"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"},
    presets={
        "tiny": Preset(
            build=build_tiny,
            inputs=make_inputs,
            pixels=PIXELS,
            default_tokens=64,
            description="3 double + 4 single blocks, width 32 (tests, CPU)",
        ),
        "full": Preset(
            build=build_full,
            inputs=make_inputs,
            pixels=PIXELS,
            default_tokens=4096,
            description="FLUX.1-dev size: 19 double + 38 single blocks, width 3072 (random weights)",
        ),
    },
    notes="Both block lists; controlnet residuals between blocks are handled (they become chunk entries).",
)

__all__ = ["ADAPTER"]
