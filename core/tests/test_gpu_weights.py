"""Weight streaming on a GPU (``nox -s gpu``; skips on CPU machines): gradients, the peak, pinned memory, races.

The toy stack runs in fp32 (cuBLAS without TF32 is deterministic for one shape, and every upload sits at a 512-byte
boundary like the allocator's own tensors): there the comparisons are bitwise. Flux in bf16 with flash attention
(cuDNN SDPA off) compares against the run-to-run noise of the unmodified model.
"""

from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch
from test_weights import streamer_of

import memfit
import memfit.controller
from memfit.offload.streamable import frozen_block_bytes
from memfit_conformance.plugin import require_cuda

from helpers import DelayedCopies, assert_same, frozen_toy, step, streamed_uploads
from toy import TOY

pytestmark = pytest.mark.gpu
ON = {"gradient_checkpointing": True}
KEY = "gradient_checkpointing_stream_blocks"


TOY_CONFIGS = {
    "torch": {**ON, KEY: 3},
    "torch-i2": {**ON, "gradient_checkpointing_interval": 2, KEY: 2},
    "unsloth": {**ON, "gradient_checkpointing_backend": "unsloth", KEY: 3},
    "torch-ffn": {**ON, "gradient_checkpointing_backend": "torch-ffn", KEY: 3},
    "unsloth-ffn+attn": {
        **ON,
        "gradient_checkpointing_backend": "unsloth-ffn",
        "gradient_checkpointing_offload_attention": True,
        KEY: 2,
    },
    "all": {**ON, "gradient_checkpointing_backend": "unsloth", KEY: 6},
}


@pytest.mark.parametrize("name", list(TOY_CONFIGS))
def test_toy_gradients_bitwise(name):
    model = frozen_toy(device="cuda", dim=1024, blocks=6)
    x = torch.randn(1, 2048, 1024, device="cuda")
    ref = step(model, x)
    with memfit.apply(model, TOY_CONFIGS[name], adapter=TOY, min_offload_bytes=0) as handle:
        for _ in range(3):
            assert_same(ref, step(model, x))
        stats = handle.stats()
        kept_first = handle._controller.installation.plan.uploads_kept_first
    streamed = stats["streamed_blocks"]
    uploads = streamed_uploads(3, streamed, kept_first=kept_first)
    assert stats["weight_uploads"] == uploads and stats["weight_uploads_on_demand"] == 0
    assert stats["weight_held_after_forward"] == 0 and stats["weight_uploads_alive_max"] <= 2
    assert stats["weight_pinned_bytes"] >= streamed * frozen_block_bytes(model.blocks[0])


def test_auto_streams_what_the_budget_needs_within_it_and_bitwise():
    """``auto`` at a budget below what activation policies alone reach streams weights; every step's peak is within
    the budget and the gradients are the unmodified model's."""
    model = frozen_toy(device="cuda", dim=1024, blocks=6)
    x = torch.randn(1, 2048, 1024, device="cuda")
    ref = step(model, x)
    auto = {**ON, "gradient_checkpointing_backend": "auto"}
    with (
        pytest.raises(memfit.BudgetError) as info,
        memfit.apply(model, {**auto, "gradient_checkpointing_memory_budget": 1, KEY: 0}, adapter=TOY),
    ):
        step(model, x)
    budget = info.value.smallest_peak_bytes - 2 * frozen_block_bytes(model.blocks[0])
    peaks = []
    with memfit.apply(model, {**auto, "gradient_checkpointing_memory_budget": budget}, adapter=TOY) as handle:
        for _ in range(6):
            torch.cuda.reset_peak_memory_stats()
            assert_same(ref, step(model, x))
            peaks.append(torch.cuda.max_memory_allocated())
        stats = handle.stats()
    assert stats["streamed_blocks"] >= 2 and stats["weight_held_after_forward"] == 0
    assert max(peaks) <= budget, (peaks, budget, stats["shapes"])
    assert_same(ref, step(model, x))


def test_flux_bf16_lora_within_noise():
    require_cuda()
    peft = pytest.importorskip("peft")
    memfit_flux = pytest.importorskip("memfit_flux")
    from test_gpu_ecosystem import assert_within_noise
    from test_peft import TARGETS
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.enable_cudnn_sdp(False)
    preset = memfit_flux.ADAPTER.presets["tiny"]
    model = preset.build(dtype=torch.bfloat16, device="cuda")
    model.requires_grad_(False)
    torch.manual_seed(0)
    model.add_adapter(
        peft.LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS, init_lora_weights="gaussian")
    )
    inputs = preset.inputs(model, tokens=1024, generator=torch.Generator().manual_seed(0))

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = model(**inputs)[0]
        out.float().pow(2).mean().backward()
        return {"output": out.detach()} | {
            n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad
        }

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        reference, again = grads(), grads()
        for config in (
            {**ON, "gradient_checkpointing_backend": "unsloth", KEY: 4},
            {**ON, "gradient_checkpointing_backend": "torch-ffn", KEY: "100KiB"},
        ):
            with memfit.apply(model, config, min_offload_bytes=0) as handle:
                for _ in range(2):
                    assert_within_noise(reference, again, grads(), floor=1e-2)
                assert handle.stats()["weight_held_after_forward"] == 0


def test_peak_drops_by_the_streamed_weights_but_the_two_in_flight():
    """``unsloth`` against ``unsloth`` streaming 4 of 8 blocks (fp32, 151 MiB of frozen weights each).

    Both run the same regions (every block recomputed, its inputs parked), so their activations peak alike; the
    streaming run holds 4 blocks' weights fewer, except the uploads alive at its peak (the running block's and the
    one uploaded ahead of it: ``weight_uploads_alive_max`` says 2). So the peak drops by at least the streamed bytes
    less two blocks, and at most by the streamed bytes. 64 MiB of slack: the parked block inputs (16 MiB each) are
    freed when their asynchronous copy to the host completes, which can shift a few of them across the peak in one
    run and not in the other; still far below one block (151 MiB).
    """
    model = frozen_toy(device="cuda", dim=2048, blocks=8)
    x = torch.randn(1, 2048, 2048, device="cuda")
    per_block = frozen_block_bytes(model.blocks[0])
    peaks, stats = {}, {}
    for name, config in (
        ("unsloth", {**ON, "gradient_checkpointing_backend": "unsloth"}),
        ("streaming", {**ON, "gradient_checkpointing_backend": "unsloth", KEY: 4}),
    ):
        with memfit.apply(model, config, adapter=TOY) as handle:
            step(model, x)  # warm-up: the pools fill
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(2):
                step(model, x)
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated()
            stats[name] = handle.stats()
        model.zero_grad(set_to_none=True)
    streamed = 4 * per_block
    assert stats["streaming"]["weight_uploads_alive_max"] == 2
    saved = peaks["unsloth"] - peaks["streaming"]
    slack = 64 << 20
    assert streamed - 2 * per_block - slack <= saved <= streamed + slack, (
        f"peak saved {saved / 2**20:.0f} MiB; {streamed / 2**20:.0f} MiB streamed, {per_block / 2**20:.0f} MiB "
        f"per block"
    )


def test_no_new_pinned_memory_and_no_leak_after_the_first_step():
    model = frozen_toy(device="cuda", dim=1024, blocks=6)
    x = torch.randn(1, 2048, 1024, device="cuda")
    config = {**ON, "gradient_checkpointing_backend": "unsloth", KEY: 3}
    with memfit.apply(model, config, adapter=TOY, min_offload_bytes=0) as handle:
        streamer = streamer_of(handle)

        def counters(steps: int) -> tuple[int, int, int]:
            for _ in range(steps):
                step(model, x)
            torch.cuda.synchronize()
            gc.collect()
            return (
                streamer.host_allocations,
                handle.stats()["pinned_allocations"],
                torch.cuda.memory_allocated(),
            )

        before = counters(2)
        after = counters(10)
        assert streamer.alive() == []
    assert (
        before[0] == 3 and after[:2] == before[:2]
    )  # one host buffer per streamed block, made at installation
    assert after[2] - before[2] < 2 << 20  # one block's upload left behind per step would be 10 x 37 MiB


@pytest.mark.parametrize("delayed", ["copies", "compute"])
def test_delayed_streams_still_give_identical_gradients(monkeypatch, delayed):
    """``copies``: every upload waits ~5 ms on its stream. ``compute``: compute sleeps after each block's FFN, so
    uploads issued ahead by the host overwrite memory compute freed only in its stream order (the ready event)."""
    model = frozen_toy(device="cuda", dim=1024, blocks=6)
    x = torch.randn(1, 2048, 1024, device="cuda")
    hooks = []
    if delayed == "copies":
        monkeypatch.setattr(memfit.controller, "stream_api_for", lambda device: DelayedCopies(10_000_000))
    else:
        hooks = [
            b.ff_out.register_forward_hook(lambda *_: torch.cuda._sleep(2_000_000)) for b in model.blocks
        ]
    ref = step(model, x)
    for config in (
        {**ON, KEY: 3},
        {**ON, "gradient_checkpointing_backend": "unsloth", KEY: 6},
        {**ON, "gradient_checkpointing_backend": "torch-ffn", KEY: 2},
    ):
        with memfit.apply(model, config, adapter=TOY, min_offload_bytes=0) as handle:
            for _ in range(2):
                assert_same(ref, step(model, x))
            stats = handle.stats()
        if delayed == "copies":
            # compute did wait for the late uploads, in forward and in backward
            assert stats["weight_upload_wait_ms"] > stats["weight_upload_wait_ms_backward"] > 0
    for h in hooks:
        h.remove()


def test_inductor_compiled_blocks_stream_without_recompiles():
    require_cuda()
    peft = pytest.importorskip("peft")
    memfit_flux = pytest.importorskip("memfit_flux")
    from test_gpu_ecosystem import assert_within_noise
    from test_peft import TARGETS
    from torch._dynamo.utils import counters

    preset = memfit_flux.ADAPTER.presets["tiny"]

    def build_lora():
        model = preset.build(dtype=torch.float32, device="cuda")
        model.requires_grad_(False)
        torch.manual_seed(0)
        model.add_adapter(
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights="gaussian")
        )
        return model

    def grads(model, inputs):
        model.zero_grad(set_to_none=True)
        memfit_flux.ADAPTER.loss(model(**inputs)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    model = build_lora()
    inputs = preset.inputs(model, tokens=256, generator=torch.Generator().manual_seed(0))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        reference, again = grads(model, inputs), grads(model, inputs)
        torch._dynamo.reset()
        counters.clear()
        config = {**ON, "gradient_checkpointing_backend": "unsloth", KEY: 4}
        with memfit.apply(model, config, min_offload_bytes=0) as handle:
            model.compile_repeated_blocks()
            graphs = []
            for _ in range(3):
                # Inductor's fusions reassociate fp32 sums (see test_gpu_ecosystem): 1e-5 of the magnitude
                assert_within_noise(reference, again, grads(model, inputs), floor=1e-5)
                graphs.append(counters["stats"]["unique_graphs"])
            stats = handle.stats()
            kept_first = handle._controller.installation.plan.uploads_kept_first
    assert graphs[0] > 0 and graphs[1] == graphs[2] == graphs[0], f"recompiled on later steps: {graphs}"
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert stats["weight_uploads"] == streamed_uploads(3, stats["streamed_blocks"], kept_first=kept_first)


# -- a model that starts on the host (apply's ``device``) -----------------------------------------------------


def _parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _cpu_model(*, blocks: int, tokens: int):
    """The toy stack on the CPU, an input on the GPU, and the reference step of a copy of the model on the GPU
    (dropped again, the allocator's cache emptied)."""
    require_cuda()
    model = frozen_toy(device="cpu", dim=1024, blocks=blocks)
    x = torch.randn(1, tokens, 1024, device="cuda")
    reference = copy.deepcopy(model).to("cuda")
    ref = step(reference, x)
    del reference
    gc.collect()
    torch.cuda.empty_cache()
    return model, x, ref


@contextlib.contextmanager
def _process_limited_to(nbytes: int):
    """This process may reserve ``nbytes`` more than it holds now on the current GPU (a card of that size)."""
    device = torch.device("cuda", torch.cuda.current_device())
    limit = torch.cuda.memory_reserved(device) + nbytes
    torch.cuda.set_per_process_memory_fraction(
        limit / torch.cuda.get_device_properties(device).total_memory, device
    )
    try:
        yield device, limit
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


@pytest.mark.parametrize("name", ["torch", "unsloth", "torch-ffn"])
def test_a_cpu_model_trains_on_the_card_bitwise_and_its_streamed_weights_never_visit_it(name):
    """``apply(..., device="cuda")`` on a model loaded on the CPU: the streamed blocks' frozen weights go straight
    to their host masters (the card holds the rest only), the steps are the CUDA model's bit for bit, and
    ``remove()`` puts every weight back on the CPU with its values."""
    model, x, ref = _cpu_model(blocks=6, tokens=2048)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    streamed = 3 * frozen_block_bytes(model.blocks[0])
    before = torch.cuda.memory_allocated()
    with memfit.apply(model, TOY_CONFIGS[name], adapter=TOY, min_offload_bytes=0, device="cuda") as handle:
        on_card = torch.cuda.memory_allocated() - before
        assert on_card <= _parameter_bytes(model) - streamed + (1 << 20), (on_card, streamed)
        assert all(p.is_cuda for p in model.parameters()) and all(b.is_cuda for b in model.buffers())
        model.to("cuda")  # a trainer's own move after apply (accelerate.prepare) changes nothing
        for _ in range(3):
            assert_same(ref, step(model, x))
        stats = handle.stats()
        # added on the card after apply, as LoRA can be
        late = torch.nn.Parameter(torch.zeros(4, device="cuda"))
        model.blocks[0].register_parameter("late", late)
    assert stats["streamed_blocks"] == 3 and stats["weight_uploads_on_demand"] == 0
    assert all(p.device.type == "cpu" for p in model.parameters()) and late.device.type == "cpu"
    del model.blocks[0].late
    assert all(torch.equal(p, values[n]) for n, p in model.named_parameters())


def test_a_model_larger_than_the_process_may_hold_trains_from_the_host():
    """A process limited below the model's weights cannot hold it (moving it whole runs out of memory); with
    ``device`` and enough blocks streamed it trains, each step within the limit."""
    require_cuda()
    model = frozen_toy(device="cpu", dim=1024, blocks=8)
    x = torch.randn(1, 256, 1024, device="cuda")
    total = _parameter_bytes(model)
    gc.collect()
    torch.cuda.empty_cache()
    with _process_limited_to(int(0.75 * total)) as (device, limit):
        with pytest.raises(torch.OutOfMemoryError):
            copy.deepcopy(model).to(device)
        gc.collect()
        torch.cuda.empty_cache()
        with pytest.raises(memfit.DeviceMemoryError, match="profiles the model with every weight"):
            memfit.apply(
                model, {**ON, "gradient_checkpointing_backend": "auto", KEY: 0}, adapter=TOY, device=device
            )
        assert all(p.device.type == "cpu" for p in model.parameters())  # left where it was
        config = {**ON, "gradient_checkpointing_backend": "unsloth", KEY: 6}
        torch.cuda.reset_peak_memory_stats(device)
        with memfit.apply(model, config, adapter=TOY, device=device) as handle:
            for _ in range(3):
                step(model, x)
            assert torch.cuda.max_memory_reserved(device) <= limit
            assert handle.stats()["streamed_blocks"] == 6
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_auto_on_a_card_smaller_than_the_weights_profiles_them_streaming_and_keeps_its_budget():
    """``auto`` with ``device`` on a CPU model whose weights the process cannot hold: it profiles with the
    planner's streaming set in host memory, plans, and every step stays within the budget with the unmodified
    model's gradients (fp32: bitwise)."""
    model, x, ref = _cpu_model(blocks=8, tokens=256)
    total = _parameter_bytes(model)
    budget = int(0.6 * total)
    peaks = []
    with _process_limited_to(int(0.75 * total)) as (device, _):
        config = {
            **ON,
            "gradient_checkpointing_backend": "auto",
            "gradient_checkpointing_memory_budget": budget,
        }
        handle = memfit.apply(model, config, adapter=TOY, device=device)
        assert handle._controller.profiles_streaming
        for _ in range(6):
            torch.cuda.reset_peak_memory_stats(device)
            assert_same(ref, step(model, x))
            peaks.append(torch.cuda.max_memory_allocated(device))
        stats = handle.stats()
        model.zero_grad(set_to_none=True)
        held = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        handle.remove()  # every weight straight back to the host: none comes through the card on its way
        assert torch.cuda.max_memory_allocated(device) <= held
    assert stats["streamed_blocks"] >= 1 and stats["weight_held_after_forward"] == 0
    assert max(peaks) <= budget, (peaks, budget, stats["shapes"])
    assert all(p.device.type == "cpu" for p in model.parameters())
