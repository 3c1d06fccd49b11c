"""memfit adapter for Mage-Flow: declarations only — the core executes.

Mage-Flow is not in diffusers; :mod:`memfit_mageflow.model` holds a reference implementation of its
transformer whose module names are the upstream ones (github.com/microsoft/Mage, ``mage_flow/models``), as
upstream's base class ``MageFlow`` and the trainer's wrapper ``MageFlowTransformer2DModel``, each called the
way the real one is; these declarations serve the real classes of those names too.
"""

from typing import Any

from memfit import BlockSpec, CheckpointSwitch, FamilyAdapter, Preset
from memfit_mageflow.presets import PIXELS, build_full, build_tiny, make_inputs

# the model classes import diffusers: loaded on first use (adapter discovery stays cheap)
_MODEL_CLASSES = ("MageFlow", "MageFlowTransformer2DModel", "MageFlowTransformerBlock")


def __getattr__(name: str) -> Any:
    if name in _MODEL_CLASSES:
        from memfit_mageflow import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ADAPTER = FamilyAdapter(
    name="mageflow",
    # upstream's base class (microsoft/Mage `MageFlow`) and the diffusers wrapper trainers train (SimpleTuner's
    # `MageFlowTransformer2DModel`, a subclass of it); matched along the MRO, so the real classes match too
    model_classes=("MageFlowTransformer2DModel", "MageFlow"),
    block_lists=("transformer_blocks",),
    blocks={
        # Double-stream block. `img_mlp` / `txt_mlp` each take one modulated tensor and return one tensor
        # that is only gated and added to its stream's residual afterwards: clean FFN boundaries.
        # `attn` takes both modulated streams (+ rotary table and cu_seqlens) and returns the two
        # projected attention outputs, which are only gated and added afterwards.
        "MageFlowTransformerBlock": BlockSpec(ffn=(("img_mlp",), ("txt_mlp",)), attention=(("attn",),)),
    },
    # Every block has the same signature and returns (text, image), which the next block takes as its
    # (image, text) inputs unchanged; the rotary table, temb and cu_seqlens are shared by all blocks.
    supports_interval=True,
    verified_versions={"diffusers": ("0.42.1",)},
    # Both classes' own switch: upstream's `checkpoint` attribute (from MageFlowParams) wraps every block in
    # torch.utils.checkpoint; the wrapper's enable_gradient_checkpointing sets it and config.checkpoint.
    model_checkpoint_switch=CheckpointSwitch(attribute="checkpoint", config_key="checkpoint"),
    block_count_config={"transformer_blocks": "depth"},
    presets={
        "tiny": Preset(
            build=build_tiny,
            inputs=make_inputs,
            pixels=PIXELS,
            default_tokens=64,
            description="4 double-stream blocks, width 32; 2 packed samples (tests, CPU)",
        ),
        "full": Preset(
            build=build_full,
            inputs=make_inputs,
            pixels=PIXELS,
            default_tokens=4096,
            description="Mage-Flow 4B as released: 12 double-stream blocks, width 3072 "
            "(random weights); 2 packed samples",
        ),
    },
    notes=(
        "Not in diffusers: memfit_mageflow.model holds a reference implementation (upstream module names and "
        "state-dict keys) as upstream's MageFlow (own `checkpoint` switch, entered through block hooks) and the "
        "trainer's MageFlowTransformer2DModel (checkpointing function called with closures). Packed "
        "variable-length samples (cu_seqlens)."
    ),
)

__all__ = ["ADAPTER", "MageFlow", "MageFlowTransformer2DModel", "MageFlowTransformerBlock"]
