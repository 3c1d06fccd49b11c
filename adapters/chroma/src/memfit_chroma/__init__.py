"""memfit adapter for Chroma: declarations only — the core executes.

Boundaries are read off diffusers' ``transformer_chroma.py`` (verified at 0.42.1):

``ChromaTransformerBlock.forward`` (double stream) calls ``norm1`` / ``norm1_context`` (pruned adaLN:
norm + shift/scale from the precomputed ``temb`` slice), ``attn`` once for both streams, then per
stream ``norm2`` -> modulation (in-block arithmetic) -> ``ff`` / ``ff_context`` -> gate -> residual add.
Each FFN is one module call reading one tensor and returning one tensor that is only gated and added
afterwards, so ``ff`` and ``ff_context`` are clean single-module regions. ``norm2`` cannot join them:
the modulation between ``norm2`` and ``ff`` is block code that saves ``norm2``'s output.

``ChromaSingleTransformerBlock.forward`` computes ``act_mlp(proj_mlp(norm_hidden_states))`` in one
expression: ``proj_mlp``'s output is consumed only by ``act_mlp``, so the two form one chain. The chain
ends before the ``cat`` with the attention output and before ``proj_out``, which read the MLP output
and the attention output together (``proj_out`` is therefore in neither region).

Interval chunks: consecutive blocks of one list are called back to back by the model's loops; each
block returns the stream tensors the next block takes (double blocks return
``(encoder_hidden_states, hidden_states)`` and take them in the other order — chaining is by identity,
so that is fine). The per-block ``temb`` slice is computed between blocks and becomes a small chunk
entry; a ControlNet residual added between blocks makes the edited stream an entry too (correct, a
little less saving).
"""

from memfit import BlockSpec, FamilyAdapter, Preset
from memfit_chroma.presets import PIXELS, build_full, build_tiny, make_inputs

ADAPTER = FamilyAdapter(
    name="chroma",
    model_classes=("ChromaTransformer2DModel",),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    blocks={
        "ChromaTransformerBlock": BlockSpec(ffn=(("ff",), ("ff_context",)), attention=(("attn",),)),
        "ChromaSingleTransformerBlock": BlockSpec(ffn=(("proj_mlp", "act_mlp"),), attention=(("attn",),)),
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
            description="Chroma1-HD size, 8.9B: 19 double + 38 single blocks, width 3072 (random weights)",
        ),
    },
    # diffusers 0.42.1's checkpointing branch of ChromaTransformer2DModel.forward calls the single-stream
    # blocks without `attention_mask` (and no block with `joint_attention_kwargs`): entering blocks through
    # it would change the model's math whenever a mask is given. Forward hooks see the normal branch.
    block_entry="hooks",
    notes=(
        "Both block lists. Blocks are entered through forward hooks, not diffusers' checkpointing branch, "
        "which drops attention_mask for the single-stream blocks in diffusers 0.42.1."
    ),
)

__all__ = ["ADAPTER"]
