"""Model sizes and dummy inputs for HF decoder stacks (random weights; nothing is downloaded).

``tokens`` is the text sequence length here (the decoder has no image tokens).
"""

from __future__ import annotations

from typing import Any

import torch

# transformers is imported inside the builders: adapter discovery (entry points) must stay cheap.

# Tiny widths, GQA (4 query heads over 2 KV heads) so the attention's repeat_kv path runs too. 5 layers: these
# models have one block list, and the kit's `unsloth` interval-2 stride-4 case needs a second region in it
# (memfit never parks the last region's entries: backward needs them first), i.e. at least 5 blocks.
TINY_QWEN3 = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY_LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# Qwen3-4B as published (Qwen/Qwen3-4B config.json); Z-Image's text encoder is this model
# (Tongyi-MAI/Z-Image-Turbo text_encoder/config.json, read through `hidden_states[-2]` by diffusers'
# ZImagePipeline). Cross-checked with the Qwen3-VL-4B text tower's numbers in adapters/krea2 (width 2560).
FULL_QWEN3 = dict(
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    hidden_act="silu",
    attention_bias=False,
    tie_word_embeddings=True,
)


def _build(
    family: str,
    causal_lm: bool,
    config: dict[str, Any],
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
):
    import transformers

    config = dict(config)
    rope_theta = config.pop("rope_theta", None)
    cfg_cls = getattr(transformers, f"{family}Config")
    cfg = cfg_cls(**config)
    if rope_theta is not None:
        # transformers 5 keeps rope_theta inside `rope_parameters`; 4.x has it as a plain attribute.
        if isinstance(getattr(cfg, "rope_parameters", None), dict):
            cfg.rope_parameters["rope_theta"] = rope_theta
        else:
            cfg.rope_theta = rope_theta
    cfg.use_cache = False  # training: no KV cache
    # SDPA, the default on CPU and CUDA; pinned so the GPU kit's sdpa_kernel choice applies.
    cfg._attn_implementation = "sdpa"
    model_cls = getattr(transformers, f"{family}ForCausalLM" if causal_lm else f"{family}Model")
    torch.manual_seed(seed)
    # Build directly in the target dtype/device (no fp32 copy on the host, no cast afterwards).
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.train()


def _builder(
    family: str, causal_lm: bool, config: dict[str, Any], default_dtype: torch.dtype, default_device: str
):
    def build(
        *, dtype: torch.dtype = default_dtype, device: str | torch.device = default_device, seed: int = 0
    ):
        return _build(family, causal_lm, config, dtype, device, seed)

    build.__name__ = f"build_{family.lower()}{'_lm' if causal_lm else ''}"
    return build


build_tiny = _builder("Qwen3", False, TINY_QWEN3, torch.float32, "cpu")
build_tiny_llama = _builder("Llama", False, TINY_LLAMA, torch.float32, "cpu")
build_full = _builder("Qwen3", False, FULL_QWEN3, torch.bfloat16, "cuda")
build_tiny_lm = _builder("Qwen3", True, TINY_QWEN3, torch.float32, "cpu")
build_tiny_llama_lm = _builder("Llama", True, TINY_LLAMA, torch.float32, "cpu")
build_full_lm = _builder("Qwen3", True, FULL_QWEN3, torch.bfloat16, "cuda")


def make_inputs(
    model,
    *,
    tokens: int | None = None,
    batch: int = 1,
    generator: torch.Generator | None = None,
    input_ids: bool = False,
) -> dict[str, Any]:
    """Forward kwargs of a text-encoder training step: a right-padded prompt batch with its attention mask.

    The token embeddings come in as ``inputs_embeds`` (a float tensor, so the kit compares an input gradient);
    ``input_ids=True`` passes token ids instead, as diffusers' pipelines do. The last quarter of the last
    sample is padding (mask 0), so the padding mask really reaches the attention. ``use_cache=False``: a
    training forward builds no KV cache.
    """
    cfg = model.config
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    tokens = tokens or 16
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[-1, tokens - max(1, tokens // 4) :] = 0
    inputs: dict[str, Any] = dict(attention_mask=mask.to(device), use_cache=False)
    if input_ids:
        inputs["input_ids"] = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=generator).to(
            device
        )
    else:
        embeds = torch.randn(batch, tokens, cfg.hidden_size, generator=generator)
        inputs["inputs_embeds"] = embeds.to(device=device, dtype=dtype)
    return inputs
