"""Run one training step on a model and capture what the kit compares: outputs, gradients, held bytes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit import Backend, CheckpointSwitch, FamilyAdapter, SavedBytesMeter
from memfit.engine.hooks import Attached


@dataclass(frozen=True)
class Combination:
    """One configuration the kit checks."""

    backend: Backend | None  # None: gradient_checkpointing off (attention offload alone)
    interval: int = 1
    stride: int | None = None
    offload_attention: bool = False

    @property
    def offloads(self) -> bool:
        return self.offload_attention or (self.backend is not None and self.backend.offloads_inputs)

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"gradient_checkpointing": self.backend is not None}
        if self.backend is not None:
            cfg["gradient_checkpointing_backend"] = self.backend.value
            cfg["gradient_checkpointing_interval"] = self.interval
        if self.stride is not None:
            cfg["gradient_checkpointing_segment_stride"] = self.stride
        if self.offload_attention:
            cfg["gradient_checkpointing_offload_attention"] = True
        return cfg

    def __str__(self) -> str:
        stride = f"-s{self.stride}" if self.stride is not None else ""
        attn = "+attn" if self.offload_attention else ""
        if self.backend is None:
            return "attn-offload-only"
        return f"{self.backend.value}-i{self.interval}{stride}{attn}"


def claimed_combinations(
    adapter: FamilyAdapter, *, intervals: tuple[int, ...] = (1, 2, 3), offload: bool = True
) -> list[Combination]:
    """What the adapter claims, to be checked.

    ``torch`` / ``torch-ffn``: every interval × stride {none, interval, 2×interval}. With ``offload``:
    ``unsloth`` / ``unsloth-ffn`` over the first two intervals × stride {none, 2×interval}, and — for
    families that declare attention regions — attention offload alone and combined with each backend
    (with a stride, so that some blocks run outside checkpointed segments and their attention is parked).
    """
    out = []
    backends = [Backend.TORCH, Backend.TORCH_FFN] + (
        [Backend.UNSLOTH, Backend.UNSLOTH_FFN] if offload else []
    )
    for backend in backends:
        if backend.ffn_only and not adapter.has_ffn:
            continue
        chosen = intervals if not backend.offloads_inputs else intervals[:2]
        for interval in chosen if adapter.supports_interval or backend.ffn_only else (1,):
            strides = (None, interval, 2 * interval) if not backend.offloads_inputs else (None, 2 * interval)
            for stride in strides:
                out.append(Combination(backend, interval, stride))
    if offload and adapter.has_attention:
        out.append(Combination(None, offload_attention=True))
        for backend in backends:
            if backend.ffn_only and not adapter.has_ffn:
                continue
            stride = None if backend.ffn_only else 2
            out.append(Combination(backend, 1, stride, offload_attention=True))
    return out


@dataclass
class StepResult:
    """What one forward+backward produced."""

    outputs: list[torch.Tensor]
    loss: torch.Tensor
    param_grads: dict[str, torch.Tensor]
    input_grads: dict[str, torch.Tensor]
    held_bytes: int
    peak_bytes: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)


def output_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor in a model output (diffusers output objects, tuples, lists, dicts)."""
    from torch.utils._pytree import tree_leaves

    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def _peak_memory(device: torch.device) -> Iterator[list[int]]:
    box: list[int] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    yield box
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        box.append(torch.cuda.max_memory_allocated(device))


def run_step(
    model: nn.Module,
    inputs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    grad_inputs: tuple[str, ...] = ("hidden_states",),
) -> StepResult:
    """One forward + backward. Named floating inputs get ``requires_grad``; parameter grads are collected."""
    model.zero_grad(set_to_none=True)
    inputs = dict(inputs)
    leaves = {}
    for name in grad_inputs:
        if name in inputs and isinstance(inputs[name], torch.Tensor):
            leaves[name] = inputs[name] = inputs[name].detach().clone().requires_grad_(True)
    device = next(model.parameters()).device
    exclude = [*model.parameters(), *model.buffers()]
    with _peak_memory(device) as peak:
        with SavedBytesMeter(exclude=exclude) as meter:
            output = model(**inputs)
            loss = loss_fn(output)
        loss.backward()
    return StepResult(
        outputs=[t.detach() for t in output_tensors(output)],
        loss=loss.detach(),
        param_grads={n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
        input_grads={n: t.grad.detach().clone() for n, t in leaves.items() if t.grad is not None},
        held_bytes=meter.device_bytes,
        peak_bytes=peak[0] if peak else None,
    )


def assert_same_step(
    expected: StepResult, actual: StepResult, *, what: str, rtol: float = 0.0, atol: float = 0.0
) -> None:
    """Outputs, loss and every gradient equal (bitwise when rtol == atol == 0)."""

    def check(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if rtol == 0 and atol == 0:
            if not torch.equal(a, b):
                diff = (a.float() - b.float()).abs().max().item()
                raise AssertionError(
                    f"{what}: {name} differs from the unmodified model (max abs diff {diff:.3e})"
                )
        else:
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {name}: {m}")

    if len(expected.outputs) != len(actual.outputs):
        raise AssertionError(
            f"{what}: the model returned {len(actual.outputs)} tensors, expected {len(expected.outputs)}"
        )
    for i, (a, b) in enumerate(zip(expected.outputs, actual.outputs, strict=True)):
        check(f"output {i}", a, b)
    check("loss", expected.loss, actual.loss)
    missing = set(expected.param_grads) ^ set(actual.param_grads)
    if missing:
        raise AssertionError(f"{what}: parameters with a gradient differ: {sorted(missing)[:5]}")
    for name, grad in expected.param_grads.items():
        check(f"grad of {name}", grad, actual.param_grads[name])
    if set(expected.input_grads) != set(actual.input_grads):
        raise AssertionError(f"{what}: inputs with a gradient differ")
    for name, grad in expected.input_grads.items():
        check(f"grad of input {name}", grad, actual.input_grads[name])


# -- how trainers call the checkpointing function, and a model-owned switch ------------------------------------------

CHECKPOINT_FUNC = "_gradient_checkpointing_func"


@contextlib.contextmanager
def closure_style_checkpointing(model: nn.Module) -> Iterator[list[Any] | None]:
    """While active, every call of the checkpointing function memfit installed on ``model`` arrives the way trainer
    code makes it: ``fn(lambda *a, **k: block(*a, **k), *args, use_reentrant=False)`` — a closure over what the
    model passed (memfit cannot see the block in it) and a ``torch.utils.checkpoint`` keyword.

    Yields the list of the functions the model passed (one per call), or None when memfit installed no
    checkpointing function on the model (it enters the blocks through forward hooks).
    """
    installed = {
        m: m.__dict__[CHECKPOINT_FUNC]
        for m in model.modules()
        if isinstance(m.__dict__.get(CHECKPOINT_FUNC), Attached)
    }
    if not installed:
        yield None
        return
    passed: list[Any] = []

    def closure_style(memfits: Callable[..., Any]) -> Callable[..., Any]:
        def trainer_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            passed.append(function)
            return memfits(lambda *a, **k: function(*a, **k), *args, **{**kwargs, "use_reentrant": False})

        return trainer_checkpoint

    try:
        for module, fn in installed.items():
            module.__dict__[CHECKPOINT_FUNC] = closure_style(fn)
        yield passed
    finally:
        for module, fn in installed.items():
            module.__dict__[CHECKPOINT_FUNC] = fn


def _switch_places(model: nn.Module, switch: CheckpointSwitch) -> dict[str, tuple[dict[str, Any], str]]:
    """Where a model-owned switch can be held: place -> (the dict holding it, its key). The model attribute, the
    config's attribute, the config's item (diffusers' FrozenDict holds both)."""
    places: dict[str, tuple[dict[str, Any], str]] = {}
    if switch.attribute:
        places["attribute"] = (model.__dict__, switch.attribute)
    config = getattr(model, "config", None)
    if switch.config_key and config is not None:
        if hasattr(config, "__dict__"):
            places["config attribute"] = (vars(config), switch.config_key)
        if isinstance(config, dict):
            places["config item"] = (config, switch.config_key)
    return places


def switch_values(model: nn.Module, switch: CheckpointSwitch) -> dict[str, Any]:
    """What each place holding the model-owned switch holds (places that do not hold it left out)."""
    return {name: d[key] for name, (d, key) in _switch_places(model, switch).items() if key in d}


@contextlib.contextmanager
def switched_on(model: nn.Module, switch: CheckpointSwitch) -> Iterator[dict[str, Any]]:
    """The model-owned switch on in every place (as a model built or loaded with it on has it), put back as it was
    afterwards. Yields :func:`switch_values` of the switched-on model."""
    before = switch_values(model, switch)
    places = _switch_places(model, switch)
    try:
        for d, key in places.values():
            dict.__setitem__(d, key, True)  # dict's own: a FrozenDict refuses item assignment
        yield switch_values(model, switch)
    finally:
        for name, (d, key) in places.items():
            if name in before:
                dict.__setitem__(d, key, before[name])
            else:
                dict.pop(d, key, None)
