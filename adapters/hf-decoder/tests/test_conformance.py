"""The HF decoder adapters pass the memfit conformance kit (Qwen3 and Llama, bare decoder and causal LM),
plus the HF-specific checks: HF's own checkpointing flags are never switched on, and remove() leaves them
exactly as they were (also when the user had switched them on)."""

from __future__ import annotations

from typing import Any, ClassVar

import memfit_hf_decoder
import pytest
import torch
from torch import nn

import memfit
from memfit_conformance import AdapterConformance
from memfit_conformance.harness import assert_same_step, run_step

WHOLE = {
    "gradient_checkpointing": True,
    "gradient_checkpointing_backend": "torch",
    "gradient_checkpointing_interval": 2,
}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}


def _flags(model: nn.Module) -> list[tuple[bool, Any, bool, Any]]:
    """Per module: HF's checkpointing attributes as set on the instance (present?, value)."""
    out = []
    for m in model.modules():
        d = m.__dict__
        out.append(
            (
                "gradient_checkpointing" in d,
                d.get("gradient_checkpointing"),
                "_gradient_checkpointing_func" in d,
                d.get("_gradient_checkpointing_func"),
            )
        )
    return out


class HFDecoderChecks:
    """HF-specific checks, run for every preset below."""

    adapter: ClassVar[memfit.FamilyAdapter]
    grad_inputs: ClassVar[tuple[str, ...]] = ("inputs_embeds",)

    def test_hf_checkpointing_never_switched_on(self, model: nn.Module) -> None:
        before = _flags(model)
        for config in (WHOLE, FFN):
            handle = memfit.apply(model, config, adapter=self.adapter)
            assert not model.is_gradient_checkpointing
            assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
            handle.remove()
            after = _flags(model)
            assert len(after) == len(before)
            for (p0, v0, fp0, f0), (p1, v1, fp1, f1) in zip(before, after, strict=True):
                assert (p0, fp0) == (p1, fp1) and v0 is v1 and f0 is f1

    def test_remove_restores_hf_checkpointing_the_user_enabled(self) -> None:
        model = self.build_model()
        # transformers 5 renamed gradient_checkpointing_enable (now a deprecated alias) to this.
        enable = (
            getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        )
        enable()
        assert model.is_gradient_checkpointing
        before = _flags(model)
        handle = memfit.apply(model, WHOLE, adapter=self.adapter)
        handle.remove()
        assert model.is_gradient_checkpointing
        for (p0, v0, fp0, f0), (p1, v1, fp1, f1) in zip(before, _flags(model), strict=True):
            assert (p0, fp0) == (p1, fp1) and v0 is v1 and f0 is f1

    def test_input_ids_and_hidden_states_output(self, model: nn.Module) -> None:
        """Z-Image's call: token ids, padding mask, ``output_hidden_states=True``, the loss on
        ``hidden_states[-2]`` (the second-to-last layer's output, what the DiT reads)."""
        preset = self.adapter.presets[self.preset]
        inputs = preset.inputs(
            model, tokens=16, batch=2, generator=torch.Generator().manual_seed(1), input_ids=True
        )
        inputs["output_hidden_states"] = True

        def loss(out: Any) -> torch.Tensor:
            return out.hidden_states[-2].float().pow(2).mean()

        expected = run_step(model, inputs, loss, grad_inputs=())
        for config in (WHOLE, FFN):
            with memfit.apply(model, config, adapter=self.adapter) as handle:
                actual = run_step(model, inputs, loss, grad_inputs=())
                assert handle.stats()["recomputes"] > 0
            assert_same_step(
                expected, actual, what=f"{self.adapter.name} {config['gradient_checkpointing_backend']}"
            )

    def test_loss_handles_return_dict_false(self, model: nn.Module, inputs: dict[str, Any]) -> None:
        with torch.no_grad():
            as_dict = self.adapter.loss(model(**inputs))
            as_tuple = self.adapter.loss(model(**inputs, return_dict=False))
        assert torch.equal(as_dict, as_tuple)

    def test_block_count_matches_hf_config(self, model: nn.Module) -> None:
        # The kit's test_block_counts_match_config indexes the config (config[key]), which HF configs do not
        # support; this is the same check through attribute access.
        for path, key in self.adapter.block_count_config.items():
            assert len(model.get_submodule(path)) == getattr(model.config, key)


class TestQwen3Conformance(HFDecoderChecks, AdapterConformance):
    adapter = memfit_hf_decoder.ADAPTER


class TestLlamaConformance(HFDecoderChecks, AdapterConformance):
    adapter = memfit_hf_decoder.ADAPTER
    preset = "tiny-llama"


class TestQwen3CausalLMConformance(HFDecoderChecks, AdapterConformance):
    adapter = memfit_hf_decoder.CAUSAL_LM_ADAPTER


class TestLlamaCausalLMConformance(HFDecoderChecks, AdapterConformance):
    adapter = memfit_hf_decoder.CAUSAL_LM_ADAPTER
    preset = "tiny-llama"


@pytest.mark.parametrize(
    "cls_name, adapter",
    [
        ("Qwen3Model", memfit_hf_decoder.ADAPTER),
        ("LlamaModel", memfit_hf_decoder.ADAPTER),
        ("Qwen3ForCausalLM", memfit_hf_decoder.CAUSAL_LM_ADAPTER),
        ("LlamaForCausalLM", memfit_hf_decoder.CAUSAL_LM_ADAPTER),
    ],
)
def test_discovery_picks_the_layout(cls_name: str, adapter: memfit.FamilyAdapter) -> None:
    import transformers

    family = "Qwen3" if cls_name.startswith("Qwen3") else "Llama"
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    model = getattr(transformers, cls_name)(cfg)
    assert memfit.find_adapter(model) is adapter
