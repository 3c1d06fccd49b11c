"""memfit adapter for Krea 2: declarations only — the core executes."""

from memfit import BlockSpec, FamilyAdapter, Preset
from memfit_krea2.presets import PIXELS, build_full, build_tiny, make_inputs

# Both block classes have the same shape: `x + attn(norm1(x)...)`, then `x + ff(norm2(x)...)`.
# `ff` is a SwiGLU module (`down(silu(gate(h)) * up(h))`, all inside `Krea2SwiGLU.forward`) that reads one
# tensor built just before it and returns one tensor that is only gated/added to the residual afterwards:
# a clean single-module boundary. `attn` (`Krea2Attention`: q/k/v/gate projections, q/k RMSNorm, rotary,
# SDPA, sigmoid output gate, `to_out`) is likewise one module call with one tensor out.
_BLOCK = BlockSpec(ffn=(("ff",),), attention=(("attn",),))

ADAPTER = FamilyAdapter(
    name="krea2",
    model_classes=("Krea2Transformer2DModel",),
    # Call order of Krea2Transformer2DModel.forward: the text-fusion stage runs first (layerwise blocks over
    # the tapped-layer axis, the projector, then refiner blocks over the token sequence), then the
    # single-stream main blocks. Only `transformer_blocks` is routed through diffusers'
    # `_gradient_checkpointing_func`; the text-fusion lists are plain loops and are caught by the core's
    # forward hooks on declared blocks.
    block_lists=("text_fusion.layerwise_blocks", "text_fusion.refiner_blocks", "transformer_blocks"),
    blocks={
        # Main block: time-modulated pre-norm, GQA self-attention over [text, image] with rotary + mask.
        "Krea2TransformerBlock": _BLOCK,
        # Text-fusion block: plain pre-norm (no modulation, no rotary); layerwise blocks are called with the
        # previous block's output only, refiner blocks also get the text key-padding mask as a keyword.
        "Krea2TextFusionBlock": _BLOCK,
    },
    # Consecutive blocks of one list pass their output straight on (the layerwise loop's `.contiguous()`
    # returns the same tensor), and every other argument (temb, rotary cos/sin, masks) is shared by all
    # blocks, so a chunk keeps one set of entries.
    supports_interval=True,
    verified_versions={"diffusers": ("0.42.1",)},
    block_count_config={
        "text_fusion.layerwise_blocks": "num_layerwise_text_blocks",
        "text_fusion.refiner_blocks": "num_refiner_text_blocks",
        "transformer_blocks": "num_layers",
    },
    presets={
        "tiny": Preset(
            build=build_tiny,
            inputs=make_inputs,
            pixels=PIXELS,
            default_tokens=64,
            description="4 main + 2 layerwise + 2 refiner text blocks, width 32 (tests, CPU)",
        ),
        "full": Preset(
            build=build_full,
            inputs=make_inputs,
            pixels=PIXELS,
            default_tokens=4096,
            description="Krea 2 size: 28 blocks at width 6144 + text fusion, 12.8B (random weights); "
            "4096 tokens = 1024x1024 px, 512 text tokens",
        ),
    },
    notes=(
        "All three block lists: text_fusion.layerwise_blocks and text_fusion.refiner_blocks (not routed through "
        "diffusers' checkpointing function; covered by hooks) and transformer_blocks. Note the layerwise blocks "
        "run over batch*text_tokens sequences of num_text_layers (12) each."
    ),
)

__all__ = ["ADAPTER"]
