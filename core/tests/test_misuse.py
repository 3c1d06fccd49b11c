"""What users get wrong between a forward and its backward: the recompute replays or refuses, never a wrong gradient.

* the forward's LoRA scale (diffusers' ``joint_attention_kwargs={"scale": s}``) is replayed;
* parameters and buffers edited between forward and backward are refused by name;
* a different SDPA kernel around the forward or the backward only: the forward's selection is replayed;
* a recompute that saves tensors of other shapes/dtypes, or fewer, is refused (no crash, process still usable);
* other threads drawing random numbers: between forward and backward harmless; during a region call the same
  limitation as ``torch.utils.checkpoint`` (documented);
* forward pre-hooks that edit a block input through ``.data``: the same limitation as
  ``torch.utils.checkpoint`` (documented).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

import memfit
from memfit import BlockSpec, FamilyAdapter, MemfitError

from helpers import assert_same, step
from toy import TOY, ToyBlock, build, loss_of

ON = {"gradient_checkpointing": True}
HERE = Path(__file__).parent


# -- LoRA scale ------------------------------------------------------------------------------------------------------

peft = pytest.importorskip("peft")
memfit_flux = pytest.importorskip("memfit_flux")
FLUX = memfit_flux.ADAPTER.presets["tiny"]
from test_peft import apply as peft_apply  # noqa: E402
from test_peft import assert_bitwise, frozen  # noqa: E402


def flux_lora_grads(model, *, scale: float | None) -> dict[str, torch.Tensor]:
    inputs = FLUX.inputs(model, tokens=64, generator=torch.Generator().manual_seed(0))
    if scale is not None:
        inputs["joint_attention_kwargs"] = {"scale": scale}
    model.zero_grad(set_to_none=True)
    model(**inputs)[0].float().pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def lora_scalings(model) -> list[dict]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [dict(m.scaling) for m in model.modules() if isinstance(m, BaseTunerLayer)]


@pytest.mark.parametrize("backend", ["torch", "torch-ffn", "unsloth"])
def test_lora_scale_of_the_forward_is_replayed(backend):
    reference = flux_lora_grads(frozen(), scale=0.5)
    unscaled = flux_lora_grads(frozen(), scale=None)
    assert any(not torch.equal(reference[n], unscaled[n]) for n in reference), "the scale must matter here"
    model = frozen()
    before = lora_scalings(model)
    with peft_apply(model, {**ON, "gradient_checkpointing_backend": backend}) as handle:
        got = flux_lora_grads(model, scale=0.5)
        assert handle.stats()["recomputes"] > 0
    assert_bitwise(got, reference)
    assert lora_scalings(model) == before  # the recompute put the model's own scale back


def test_adapters_unloaded_between_forward_and_backward_are_refused():
    model = frozen()
    with peft_apply(model, ON):
        inputs = FLUX.inputs(model, tokens=64, generator=torch.Generator().manual_seed(0))
        loss = model(**inputs)[0].float().pow(2).mean()
        model.unload_lora()
        with pytest.raises(MemfitError, match="changed between the forward and the backward"):
            loss.backward()


# -- parameters and buffers edited between forward and backward ------------------------------------------------------


def forward_loss(model, x) -> torch.Tensor:
    """The loss of one forward (gradients zeroed), its backward left to the test; ``x`` gets a fresh leaf copy."""
    model.zero_grad(set_to_none=True)
    return loss_of(model(x.detach().clone().requires_grad_(True)))


@pytest.mark.parametrize("backend", ["torch", "torch-ffn"])
def test_parameter_edited_between_forward_and_backward_is_refused(model, x, backend):
    """An optimizer step taken before backward: plain PyTorch refuses it, so does memfit (it would recompute with
    the new weights)."""
    with memfit.apply(model, {**ON, "gradient_checkpointing_backend": backend}, adapter=TOY):
        loss = forward_loss(model, x)
        with torch.no_grad():
            model.blocks[5].ff_in.weight.mul_(1.1)
        with pytest.raises(
            MemfitError, match=r"'(ff_in\.)?weight' of .*modified in place.*optimizer\.step\(\)"
        ):
            loss.backward()


def test_kept_frozen_weight_edited_before_backward_is_refused(model, x):
    """ff_out frozen: torch-ffn never replays it (early stop) and keeps its weight as saved; the weight's version
    is still checked when backward uses it."""
    for block in model.blocks:
        block.ff_out.requires_grad_(False)
    with memfit.apply(model, {**ON, "gradient_checkpointing_backend": "torch-ffn"}, adapter=TOY):
        loss = forward_loss(model, x)
        with torch.no_grad():
            model.blocks[5].ff_out.weight.add_(1.0)
        with pytest.raises(MemfitError, match=r"'weight' of Linear \(call 2 of region .*modified in place"):
            loss.backward()


class StatefulBlock(ToyBlock):
    """A block that reads a buffer (an offset) and keeps a running statistic of its input (updated in forward)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.register_buffer("offset", torch.zeros(dim))
        self.register_buffer("running_mean", torch.zeros(dim))

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.running_mean.mul_(0.9).add_(x.mean(dim=(0, 1)), alpha=0.1)
        return super().forward(x + self.offset, scale)


class Stack(nn.Module):
    """Blocks called one after the other with a fixed scale."""

    def __init__(self, blocks: list[nn.Module], scale: float = 1.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.scale = scale

    def forward(self, hidden_states: torch.Tensor, residuals=None) -> torch.Tensor:
        x = hidden_states
        for block in self.blocks:
            x = block(x, torch.tensor(self.scale))
        return x


def stateful_stack() -> Stack:
    torch.manual_seed(0)
    return Stack([StatefulBlock(16) for _ in range(3)])


STATEFUL = FamilyAdapter(
    name="stateful",
    model_classes=("Stack",),
    block_lists=("blocks",),
    blocks={"StatefulBlock": BlockSpec(ffn=(("ff_in", "act", "ff_out"),))},
    supports_interval=True,
)


def test_buffer_edited_between_forward_and_backward_is_refused(x):
    model = stateful_stack()
    with memfit.apply(model, {**ON, "gradient_checkpointing_interval": 3}, adapter=STATEFUL):
        loss = forward_loss(model, x)
        model.blocks[1].offset.fill_(0.5)
        with pytest.raises(MemfitError, match=r"'blocks\.1\.offset'|'offset' of StatefulBlock"):
            loss.backward()


def test_buffers_a_module_updates_itself_are_not_an_edit(x):
    """Running statistics change in the forward call (and again in its replay, as with torch.utils.checkpoint):
    not an edit between forward and backward, also over a retained graph."""
    model = stateful_stack()
    ref = step(model, x, retain=True, backwards=2)
    with memfit.apply(model, ON, adapter=STATEFUL) as handle:
        got = step(model, x, retain=True, backwards=2)
        assert handle.stats()["recomputes"] == 6
    assert_same(ref, got)


# -- attention kernel selected around the forward only or the backward only -----------------------------------------


def flux_step(model, inputs, *, around: str):
    model.zero_grad(set_to_none=True)
    with sdpa_kernel(SDPBackend.MATH) if around == "forward" else torch.enable_grad():
        loss = model(**inputs)[0].pow(2).mean()
    with sdpa_kernel(SDPBackend.MATH) if around == "backward" else torch.enable_grad():
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("around", ["forward", "backward"])
@pytest.mark.parametrize("backend", ["torch", "torch-ffn"])
def test_sdpa_kernel_of_the_forward_is_replayed(backend, around):
    model = FLUX.build()
    inputs = FLUX.inputs(model, tokens=64, generator=torch.Generator().manual_seed(0))
    reference = flux_step(model, inputs, around=around)
    with memfit.apply(model, {**ON, "gradient_checkpointing_backend": backend}) as handle:
        got = flux_step(model, inputs, around=around)
        assert handle.stats()["recomputes"] > 0
    assert_bitwise(got, reference)


# -- a recompute that saves something else than the forward did ------------------------------------------------------


class Moody(nn.Module):
    """Computes the same values whatever ``mode`` is, but saves tensors of another shape, dtype, or fewer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.mode = "plain"

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.mode == "shape":  # exp saves its output: (1, B, L, D) instead of (B, L, D)
            e = torch.exp(h.unsqueeze(0)).squeeze(0)
        elif self.mode == "dtype":  # float64 instead of float32
            e = torch.exp(h.double()).float()
        else:
            e = torch.exp(h)
        out = x + e * scale
        if self.mode == "more":  # one more saved tensor at the end (tanh saves its output), same values
            out = out + 0.0 * torch.tanh(h)
        return out


def moody_stack() -> Stack:
    torch.manual_seed(0)
    return Stack([Moody(16) for _ in range(2)], scale=0.1)


MOODY = FamilyAdapter(
    name="moody", model_classes=("Stack",), block_lists=("blocks",), blocks={"Moody": BlockSpec()}
)


@pytest.mark.parametrize(
    ("forward_mode", "backward_mode", "message"),
    [
        (
            "plain",
            "shape",
            r"saved tensor #\d+ is \(1, 2, 8, 16\) torch.float32 on cpu where the forward saved ",
        ),
        (
            "plain",
            "dtype",
            r"saved tensor #\d+ is \(2, 8, 16\) torch.float64 on cpu where the forward saved ",
        ),
        ("more", "plain", r"saved \d+\+ tensors for backward where the forward saved \d+"),
    ],
)
def test_recompute_saving_something_else_is_refused(x, forward_mode, backward_mode, message):
    model = moody_stack()
    with memfit.apply(model, ON, adapter=MOODY):
        for block in model.blocks:
            block.mode = forward_mode
        loss = forward_loss(model, x)
        for block in model.blocks:
            block.mode = backward_mode
        with pytest.raises(MemfitError, match=message) as info:
            loss.backward()
        assert "Moody (call 0 of region ('block', 'blocks', 1))" in str(info.value)
        assert "a different attention kernel" in str(info.value)
        # the process is still usable: the next step trains normally
        for block in model.blocks:
            block.mode = "plain"
        ref_model = moody_stack()
        ref_model.load_state_dict(model.state_dict())
        assert_same(step(ref_model, x), step(model, x))


def test_refused_recompute_exits_cleanly():
    """The issue this guards against crashed at interpreter exit after the error; run it in a fresh process."""
    script = textwrap.dedent(
        """
        import sys, torch, memfit
        sys.path.insert(0, sys.argv[1])
        from test_misuse import MOODY, moody_stack
        model = moody_stack()
        with memfit.apply(model, {"gradient_checkpointing": True}, adapter=MOODY):
            loss = model(torch.randn(2, 8, 16, requires_grad=True)).pow(2).mean()
            for block in model.blocks:
                block.mode = "shape"
            try:
                loss.backward()
            except memfit.MemfitError:
                print("refused")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(HERE)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "refused"


# -- random numbers and other threads ------------------------------------------------------------------------------


def draw_elsewhere(n: int = 1000) -> None:
    t = threading.Thread(target=lambda: torch.rand(n))
    t.start()
    t.join()


def test_other_threads_drawing_between_forward_and_backward_change_nothing(x):
    model = build(dropout=0.3)
    torch.manual_seed(7)
    ref = step(model, x)
    with memfit.apply(model, {**ON, "gradient_checkpointing_interval": 2}, adapter=TOY) as handle:
        torch.manual_seed(7)
        loss = forward_loss(model, x)
        draw_elsewhere()  # a data-loading thread, say
        loss.backward()
        assert handle.stats()["recomputes"] == 3
    assert all(torch.equal(ref[2][n], p.grad) for n, p in model.named_parameters())


def checkpointed_forward(model, hidden_states):
    """ToyModel's forward with every block under torch.utils.checkpoint (non-reentrant)."""
    scale = torch.sigmoid(model.proj_in.bias.sum())
    x = model.proj_in(hidden_states)
    for block in model.blocks:
        x = checkpoint(block, x, scale, use_reentrant=False)
    return model.proj_out(x)


def test_other_threads_drawing_during_a_region_call_as_torch_checkpoint(x):
    """Documented limitation, shared with torch.utils.checkpoint: torch has one default generator per device for
    all threads, so a draw by another thread between a region's RNG capture and its dropout changes the forward's
    mask but not the recompute's. memfit gives exactly torch.utils.checkpoint's gradients here."""
    model = build(dropout=0.3)
    interfere = [True]
    hook = [
        b.drop.register_forward_pre_hook(lambda m, a: draw_elsewhere() if interfere[0] else None)
        for b in model.blocks
    ]

    def run(forward) -> dict[str, torch.Tensor]:
        torch.manual_seed(7)
        model.zero_grad(set_to_none=True)
        interfere[0] = True
        loss = loss_of(forward(x.detach().clone().requires_grad_(True)))
        interfere[0] = False  # the recompute runs undisturbed
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = run(model)
    torch_checkpoint = run(lambda h: checkpointed_forward(model, h))
    with memfit.apply(model, ON, adapter=TOY):
        got = run(model)
    for h in hook:
        h.remove()
    assert any(not torch.equal(plain[n], torch_checkpoint[n]) for n in plain), "the interleaving must matter"
    assert all(torch.equal(torch_checkpoint[n], got[n]) for n in plain)


# -- forward pre-hooks that edit a block's input ---------------------------------------------------------------------


def test_pre_hook_editing_the_input_through_data_as_torch_checkpoint(x):
    """Documented limitation, shared with torch.utils.checkpoint: a pre-hook that edits its input in place through
    ``.data`` (no version bump) runs again in the recompute, on the already edited tensor. memfit cannot see it and
    gives exactly torch.utils.checkpoint's gradients; a hook must return new arguments instead (next test)."""
    model = build()

    def halve(module: nn.Module, args: tuple) -> None:
        args[0].data.mul_(0.5)

    handles = [b.register_forward_pre_hook(halve) for b in model.blocks]
    plain = step(model, x)
    model.zero_grad(set_to_none=True)
    xg = x.detach().clone().requires_grad_(True)
    loss_of(checkpointed_forward(model, xg)).backward()
    torch_checkpoint = {n: p.grad.clone() for n, p in model.named_parameters()}
    with memfit.apply(model, ON, adapter=TOY):
        got = step(model, x)
    for h in handles:
        h.remove()
    assert any(not torch.equal(plain[2][n], torch_checkpoint[n]) for n in plain[2]), "the edit must matter"
    assert all(torch.equal(torch_checkpoint[n], got[2][n]) for n in plain[2])


@pytest.mark.parametrize("backend", ["torch", "torch-ffn"])
def test_pre_hook_returning_new_arguments_registered_after_apply(x, backend):
    model = build()
    targets = [b if backend == "torch" else b.ff_in for b in model.blocks]
    hook = lambda m, args: (args[0] * 0.5, *args[1:])  # noqa: E731
    handles = [t.register_forward_pre_hook(hook) for t in targets]
    ref = step(model, x)
    for h in handles:
        h.remove()
    with memfit.apply(model, {**ON, "gradient_checkpointing_backend": backend}, adapter=TOY):
        handles = [t.register_forward_pre_hook(hook) for t in targets]
        got = step(model, x)
    for h in handles:
        h.remove()
    assert_same(ref, got)


@pytest.mark.parametrize("backend", ["torch", "torch-ffn"])
def test_pre_hook_returning_new_arguments_registered_before_apply(x, backend):
    model = build()
    targets = [b if backend == "torch" else b.ff_in for b in model.blocks]
    handles = [t.register_forward_pre_hook(lambda m, args: (args[0] * 0.5, *args[1:])) for t in targets]
    ref = step(model, x)
    with memfit.apply(model, {**ON, "gradient_checkpointing_backend": backend}, adapter=TOY):
        got = step(model, x)
    for h in handles:
        h.remove()
    assert_same(ref, got)
