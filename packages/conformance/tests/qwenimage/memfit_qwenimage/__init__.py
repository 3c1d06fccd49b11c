"""memfit adapter for Qwen-Image (diffusers QwenImageTransformer2DModel): declarations only.

A family memfit does not ship, written from ``adapters/_template`` as a third party would: the kit's
outside-the-repository test builds a package from the template with this module and ``presets.py``, and the
kit's bad-declaration tests break this declaration one way at a time.

Read in diffusers 0.42.1 ``transformer_qwenimage.py``: ``QwenImageTransformerBlock.forward`` computes
``img_mlp(img_modulated2)`` and ``txt_mlp(txt_modulated2)``, each output only gated and added to its stream
afterwards, and ``attn(img_modulated, txt_modulated, ...)`` returns the two projected attention outputs,
likewise only gated and added. The model routes every block through ``_gradient_checkpointing_func`` with
the same arguments as its plain branch, and each block returns ``(text, image)``, the next block's inputs.
"""

from memfit import BlockSpec, FamilyAdapter, Preset

from .presets import build_full, build_tiny, make_inputs

ADAPTER = FamilyAdapter(
    name="qwenimage",
    model_classes=("QwenImageTransformer2DModel",),
    block_lists=("transformer_blocks",),
    blocks={
        "QwenImageTransformerBlock": BlockSpec(ffn=(("img_mlp",), ("txt_mlp",)), attention=(("attn",),)),
    },
    supports_interval=True,
    verified_versions={"diffusers": ("0.42.1",)},
    block_count_config={"transformer_blocks": "num_layers"},
    presets={
        "tiny": Preset(
            build=build_tiny,
            inputs=make_inputs,
            default_tokens=64,
            description="3 double-stream blocks, width 32 (tests, CPU)",
        ),
        "full": Preset(
            build=build_full,
            inputs=make_inputs,
            default_tokens=4096,
            description="Qwen-Image, 20B: 60 double-stream blocks, width 3072 (random weights)",
        ),
    },
)

__all__ = ["ADAPTER"]
