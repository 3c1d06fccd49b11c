"""memfit adapter for Wan 2.1 / 2.2: declarations only — the core executes."""

from memfit import BlockSpec, FamilyAdapter, Preset
from memfit_wan.presets import PIXELS, TOKENS_PER_480P_FRAME, build_full, build_tiny, make_inputs

ADAPTER = FamilyAdapter(
    name="wan",
    model_classes=("WanTransformer3DModel",),
    block_lists=("blocks",),
    blocks={
        # WanTransformerBlock.forward calls, in order: attn1(norm1(x)) (self-attention with 3-D RoPE),
        # attn2(norm2(x), context) (cross-attention to the text; for I2V checkpoints attn2 also attends to
        # the image tokens inside the same call), ffn(norm3(x)). Each is a single module call whose output
        # is only gated/added to the residual afterwards, so each is a clean boundary. The FFN is
        # `ffn` (diffusers FeedForward: Linear -> GELU(tanh) -> Linear), one call.
        "WanTransformerBlock": BlockSpec(ffn=(("ffn",),), attention=(("attn1",), ("attn2",))),
    },
    # The model's block loop is `hidden_states = self._gradient_checkpointing_func(block, hidden_states,
    # encoder_hidden_states, timestep_proj, rotary_emb)` with nothing in between: each block consumes the
    # previous block's output directly, and the other three arguments are shared by all blocks, so N
    # consecutive blocks form one chunk with one set of entry tensors.
    supports_interval=True,
    verified_versions={"diffusers": ("0.42.1",)},
    block_count_config={"blocks": "num_layers"},
    presets={
        "tiny": Preset(
            build=build_tiny,
            inputs=make_inputs,
            pixels=PIXELS,
            default_tokens=72,
            description="7 blocks, width 24, 3 latent frames of 4x6 patches (tests, CPU)",
        ),
        "full": Preset(
            build=build_full,
            inputs=make_inputs,
            pixels=PIXELS,
            default_tokens=9 * TOKENS_PER_480P_FRAME,
            description="Wan2.1-T2V-14B / one Wan2.2-T2V-A14B expert: 40 blocks, width 5120 "
            "(random weights); 480x832, 33 frames = 14040 tokens",
        ),
    },
    notes="One block list; FFN `ffn`, attention `attn1` (self) and `attn2` (cross). The Wan 2.2 TI2V-5B "
    "per-token timestep path (4-D temb) runs through the same block calls.",
)

__all__ = ["ADAPTER"]
