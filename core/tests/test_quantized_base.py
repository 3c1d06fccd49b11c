"""Quantized frozen bases, as trainer configs set them up (torchao weight-only int8 / float8 base linears, PEFT
LoRA on top): every claimed backend, offload included, gives the gradients of the same quantized model without
memfit — the whole conformance kit, on a tiny Flux whose block linears are torchao tensors.

Regimes: ``frozen`` trains the LoRA weights only; ``full`` also every parameter that is not quantized (norms,
embedders, the projections outside the blocks). Quantized weights never train (they are not leaf tensors autograd
can update). On a GPU the kit's ``test_gpu_peak_memory_drops`` runs the same model in bf16 on CUDA.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

# dev dependencies, imported outright: a missing one fails collection instead of skipping the GPU variant
import peft
import torch
import torchao.quantization as torchao_quant
from torch import nn

import memfit_flux
from memfit_conformance import AdapterConformance, StepResult, run_step

from helpers import FLUX_LORA_TARGETS

# every linear of the blocks carries LoRA: the FFN and attention regions memfit hooks are LoRA-wrapped quantized
# linears (as in a trainer's "all linears" LoRA on a quantized base)
LORA_TARGETS = FLUX_LORA_TARGETS


def quantized(weight: torch.Tensor) -> bool:
    """A torchao quantized tensor (a tensor subclass), not a plain parameter."""
    return type(weight) not in (torch.Tensor, nn.Parameter)


class QuantizedFluxConformance(AdapterConformance):
    """The kit on tiny Flux with a quantized frozen base and LoRA; subclasses choose the torchao config."""

    adapter = memfit_flux.ADAPTER
    quantization: ClassVar[Any]

    @classmethod
    def build_model(cls, **kwargs: Any) -> nn.Module:
        model = memfit_flux.ADAPTER.presets["tiny"].build(**kwargs)
        model.requires_grad_(False)
        for blocks in (model.transformer_blocks, model.single_transformer_blocks):
            torchao_quant.quantize_(blocks, cls.quantization)
        with warnings.catch_warnings():  # PEFT: merge() needs the requantization config; nothing here merges
            warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated")
            model.add_adapter(
                peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian")
            )
        return model

    @classmethod
    def _step(cls, model: nn.Module, inputs: dict[str, Any], regime: str) -> StepResult:
        trainable = [
            p for n, p in model.named_parameters() if "lora_" in n or (regime == "full" and not quantized(p))
        ]
        for p in trainable:
            p.requires_grad_(True)
        try:
            return run_step(model, inputs, cls.adapter.loss, grad_inputs=cls.grad_inputs)
        finally:
            for n, p in model.named_parameters():
                p.requires_grad_("lora_" in n)

    def test_the_base_is_quantized_and_lora_trains(
        self, model: nn.Module, reference: dict[str, StepResult]
    ) -> None:
        in_blocks = [
            m for blocks in self.adapter.resolve_block_lists(model).values() for m in blocks.modules()
        ]
        bases = [m for m in in_blocks if isinstance(m, nn.Linear) and quantized(m.weight)]
        assert len(bases) >= len(LORA_TARGETS), "the block linears are not torchao tensors"
        for regime, result in reference.items():
            assert any("lora_" in n for n in result.param_grads), regime
            assert not any(quantized(p) for n, p in model.named_parameters() if n in result.param_grads)
        assert len(reference["full"].param_grads) > len(reference["frozen"].param_grads)


class TestInt8WeightOnlyBase(QuantizedFluxConformance):
    quantization = torchao_quant.Int8WeightOnlyConfig()


class TestFloat8WeightOnlyBase(QuantizedFluxConformance):
    quantization = torchao_quant.Float8WeightOnlyConfig()

    def test_auto_plans_on_a_quantized_base(self, model: nn.Module, inputs: dict[str, Any]) -> None:
        """``auto``'s profile tells parameters from activations by storage; a quantized weight has none of its own
        (it is counted by the tensors it wraps): the plan is made, and its gradients are the reference's."""
        import memfit

        reference = self._step(model, inputs, "frozen")
        cfg = {
            "gradient_checkpointing": True,
            "gradient_checkpointing_backend": "auto",
            "gradient_checkpointing_memory_budget": 1,  # below every plan: the error names the smallest peak
        }
        with memfit.apply(model, cfg) as handle:
            try:
                self._step(model, inputs, "frozen")
            except memfit.BudgetError as exc:
                smallest = exc.smallest_peak_bytes
        assert smallest > 0
        with memfit.apply(model, {**cfg, "gradient_checkpointing_memory_budget": smallest}) as handle:
            got = self._step(model, inputs, "frozen")
            assert handle.plan is not None and handle.plan.needed
        assert got.param_grads.keys() == reference.param_grads.keys()
        for name, grad in reference.param_grads.items():
            assert torch.equal(got.param_grads[name], grad), name
