"""memfit adapter for <Family>: declarations only — the core executes.

Rename ``memfit_template`` to ``memfit_<family>`` and fill in every ``<...>`` below (the presets module is
imported relatively, so the rename needs no edit here). Write down here, for the
next reader, *why* each boundary is safe: which lines of the model's forward you read, in which version.
A worked example is ``adapters/chroma/src/memfit_chroma/__init__.py``.
"""

from memfit import BlockSpec, FamilyAdapter, Preset

from .presets import PIXELS, build_full, build_tiny, make_inputs

ADAPTER = FamilyAdapter(
    # The family name users type (`memfit list`, `memfit.get_adapter("<family>")`); the same string as the
    # entry-point name in pyproject.toml (the kit fails when they differ).
    name="template",
    # Model class names this adapter serves; matched against the model's MRO, so subclasses match too.
    model_classes=("<ModelClass>",),
    # Attribute paths of the nn.ModuleLists holding the repeated blocks, in the order forward() calls them.
    # Every list the model checkpoints must be here: a block the model routes through
    # `_gradient_checkpointing_func` that no list declares is counted as `undeclared_block_calls` and the
    # kit fails.
    block_lists=("transformer_blocks",),
    # Block class name -> its boundaries. A region is a chain of sub-module attribute paths that the block
    # calls one right after the other, each consuming the previous one's output and nothing in between
    # needing their activations, e.g. ("proj_mlp", "act_mlp") for `act_mlp(proj_mlp(x))`. A module may belong
    # to one region only. `ffn=()` means "no safe FFN boundary": `*-ffn` backends then fail explicitly.
    # The kit runs one forward and checks each region: a chain's modules consume each other's outputs, an
    # attention region calls scaled_dot_product_attention (else say why: `attention_without_sdpa="..."`),
    # an FFN region frees more bytes than its recompute keeps.
    blocks={
        "<BlockClass>": BlockSpec(
            ffn=(("ff",),),  # e.g. `ff_output = self.ff(norm_hidden_states)`
            attention=(("attn",),),  # e.g. `attn_output = self.attn(norm_hidden_states, ...)`
        ),
    },
    # True when consecutive blocks of one list can be checkpointed as one chunk: the model calls them back
    # to back and each block's outputs are (by identity) the next block's stream inputs; whatever the model
    # computes between blocks just becomes a chunk entry. False: interval warns once and is ignored.
    supports_interval=True,
    # diffusers versions whose source you read and whose conformance run passed.
    verified_versions={"diffusers": ("<x.y.z>",)},
    # Block list -> model-config key holding its length (the kit checks them against each other).
    block_count_config={"transformer_blocks": "num_layers"},
    presets={
        # Required: tiny enough that the whole kit runs in well under a minute on a 2-core CPU. At least
        # 3 blocks per list (the kit checks intervals 1-3 and strides up to 6).
        "tiny": Preset(
            build=build_tiny,
            inputs=make_inputs,
            pixels=PIXELS,
            default_tokens=64,
            description="<n> blocks, width <w> (tests, CPU)",
        ),
        # The published size, random weights (nothing downloaded), at a token count users train at.
        "full": Preset(
            build=build_full,
            inputs=make_inputs,
            pixels=PIXELS,
            default_tokens=4096,
            description="<Published model name>, <size> (random weights)",
        ),
    },
    # Free text for `memfit list`: what was verified, what is missing and why.
    notes="",
)

__all__ = ["ADAPTER"]
