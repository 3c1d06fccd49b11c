"""memfit adapters for HF transformers decoder stacks (Qwen3, Llama): declarations only — the core executes.

These decoders are the text encoders of Z-Image (Qwen3-4B) and relatives. Two adapters, one per module
layout, because a :class:`~memfit.FamilyAdapter` has one ``block_lists`` tuple and the core errors on a
declared path that does not exist:

* ``hf-decoder``: the bare decoder (``Qwen3Model``, ``LlamaModel``), blocks in ``layers``;
* ``hf-decoder-lm``: the causal LM wrapping it (``Qwen3ForCausalLM``, ``LlamaForCausalLM``), blocks in
  ``model.layers``.

Why ``block_entry="hooks"``: transformers' own checkpointing does not call blocks the way memfit's
diffusers entry expects. ``GradientCheckpointingLayer`` wraps each decoder layer's ``forward`` and, when
the layer's ``gradient_checkpointing`` flag is on, calls
``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)``: the first argument is a
partial of the unbound forward, not the module (so memfit could not tell which block is running), and the
keyword arguments are frozen into it. HF models also have no ``enable_gradient_checkpointing``. memfit
therefore enters each decoder layer through removable forward hooks and never touches HF's
``gradient_checkpointing`` flags (``remove()`` leaves them exactly as they were).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from memfit import BlockSpec, FamilyAdapter, Preset
from memfit.adapters.spec import default_loss
from memfit_hf_decoder.presets import (
    build_full,
    build_full_lm,
    build_tiny,
    build_tiny_llama,
    build_tiny_llama_lm,
    build_tiny_lm,
    make_inputs,
)


def decoder_loss(output: Any) -> torch.Tensor:
    """Mean of squares of the logits (causal LM) or the last hidden state (bare decoder).

    transformers returns ``ModelOutput`` objects (``BaseModelOutputWithPast``, ``CausalLMOutputWithPast``),
    which are ordered dicts, not tuples; with ``return_dict=False`` a tuple whose first tensor is the same.
    """
    if isinstance(output, Mapping):
        for key in ("logits", "last_hidden_state"):
            value = output.get(key)
            if value is not None:
                return value.float().pow(2).mean()
        raise TypeError(f"decoder output {type(output).__name__} has neither logits nor last_hidden_state")
    return default_loss(output)


# Both decoder-layer classes have the same shape:
#   h = h + self_attn(input_layernorm(h), ...)[0]
#   h = h + mlp(post_attention_layernorm(h))
# `mlp` (SwiGLU: down_proj(act(gate_proj(x)) * up_proj(x))) reads one normed tensor and returns one tensor
# that is only added to the residual afterwards: a clean FFN boundary. `self_attn` (q/k-norm for Qwen3,
# RoPE, GQA, SDPA) returns (output, weights); only the output is added to the residual.
_BLOCKS = {
    "Qwen3DecoderLayer": BlockSpec(ffn=(("mlp",),), attention=(("self_attn",),)),
    "LlamaDecoderLayer": BlockSpec(ffn=(("mlp",),), attention=(("self_attn",),)),
}

ADAPTER = FamilyAdapter(
    name="hf-decoder",
    model_classes=("Qwen3Model", "LlamaModel"),
    block_lists=("layers",),
    blocks=_BLOCKS,
    # The model calls its layers back to back, each layer's output is the next one's hidden_states; the
    # causal mask, position ids and rotary (cos, sin) are computed once before the loop (chunk entries).
    supports_interval=True,
    verified_versions={"transformers": ("5.24.0",)},
    block_count_config={"layers": "num_hidden_layers"},
    presets={
        "tiny": Preset(
            build=build_tiny,
            inputs=make_inputs,
            default_tokens=16,
            description="Qwen3Model, 5 layers, width 32, GQA 4/2 heads (tests, CPU)",
        ),
        "tiny-llama": Preset(
            build=build_tiny_llama,
            inputs=make_inputs,
            default_tokens=16,
            description="LlamaModel, 5 layers, width 32, GQA 4/2 heads (tests, CPU)",
        ),
        "full": Preset(
            build=build_full,
            inputs=make_inputs,
            default_tokens=512,
            description="Qwen3-4B (Z-Image's text encoder): 36 layers, width 2560 (random weights)",
        ),
    },
    loss=decoder_loss,
    notes=(
        "HF transformers decoder; blocks entered through forward hooks (HF's gradient_checkpointing flags "
        "are never switched on). Verified with transformers 5.24.0."
    ),
    block_entry="hooks",
)

# The causal LM wraps the same decoder under `model`: the same declarations, one level down.
CAUSAL_LM_ADAPTER = dataclasses.replace(
    ADAPTER,
    name="hf-decoder-lm",
    model_classes=("Qwen3ForCausalLM", "LlamaForCausalLM"),
    block_lists=("model.layers",),
    block_count_config={"model.layers": "num_hidden_layers"},
    presets={
        "tiny": Preset(
            build=build_tiny_lm,
            inputs=make_inputs,
            default_tokens=16,
            description="Qwen3ForCausalLM, 5 layers, width 32, vocab 64 (tests, CPU)",
        ),
        "tiny-llama": Preset(
            build=build_tiny_llama_lm,
            inputs=make_inputs,
            default_tokens=16,
            description="LlamaForCausalLM, 5 layers, width 32, vocab 64 (tests, CPU)",
        ),
        "full": Preset(
            build=build_full_lm,
            inputs=make_inputs,
            default_tokens=512,
            description="Qwen3-4B causal LM: 36 layers, width 2560 (random weights)",
        ),
    },
)

__all__ = ["ADAPTER", "CAUSAL_LM_ADAPTER", "decoder_loss"]
