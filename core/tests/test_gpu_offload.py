"""GPU tests of the offload backends (run by `nox -s gpu` on a CUDA machine; skip on CPU machines)."""

from __future__ import annotations

import gc

import pytest
import torch

import memfit
from memfit.auto import BlockPolicy
from memfit.offload.copy import CopyEngine, ReloadRelease
from memfit.offload.pool import PinnedBucketPool

from helpers import DelayedCopies, assert_same, auto_config, force_auto_plan, step
from toy import TOY, build

pytestmark = pytest.mark.gpu
ON = {"gradient_checkpointing": True}


OFFLOAD_CONFIGS = [
    {**ON, "gradient_checkpointing_backend": "unsloth"},
    {
        **ON,
        "gradient_checkpointing_backend": "unsloth",
        "gradient_checkpointing_interval": 2,
        "gradient_checkpointing_segment_stride": 3,
    },
    {**ON, "gradient_checkpointing_backend": "unsloth-ffn"},
    {"gradient_checkpointing_offload_attention": True},
    {**ON, "gradient_checkpointing_backend": "torch-ffn", "gradient_checkpointing_offload_attention": True},
    {**ON, "gradient_checkpointing_backend": "unsloth-ffn", "gradient_checkpointing_offload_attention": True},
    {
        **ON,
        "gradient_checkpointing_backend": "unsloth",
        "gradient_checkpointing_segment_stride": 2,
        "gradient_checkpointing_offload_attention": True,
    },
]
IDS = [
    "unsloth",
    "unsloth-i2-s3",
    "unsloth-ffn",
    "attn-alone",
    "torch-ffn+attn",
    "unsloth-ffn+attn",
    "unsloth-s2+attn",
]


def tiny_bf16_runner(package: str, *, tokens: int):
    """A family's tiny preset in bfloat16 on CUDA, and a step on it (skipped where the adapter ``package`` is not
    installed): the step returns the output, the input's gradient and every parameter's gradient."""
    adapter = pytest.importorskip(package).ADAPTER
    preset = adapter.presets["tiny"]
    model = preset.build(dtype=torch.bfloat16, device="cuda")
    inputs = preset.inputs(model, tokens=tokens, generator=torch.Generator().manual_seed(0))
    x = inputs.pop("hidden_states")

    def run():
        model.zero_grad(set_to_none=True)
        hs = x.detach().clone().requires_grad_(True)
        out = model(hidden_states=hs, **inputs)[0]
        out.float().pow(2).mean().backward()
        return out.detach(), hs.grad, {n: p.grad.clone() for n, p in model.named_parameters()}

    return model, run


@pytest.mark.parametrize("config", OFFLOAD_CONFIGS, ids=IDS)
def test_flux_offload_gradients_equal(config):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, run = tiny_bf16_runner("memfit_flux", tokens=1024)

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        ref, ref_again = run(), run()
        with memfit.apply(model, config, min_offload_bytes=0) as handle:
            got = run()
            stats = handle.stats()
    assert stats["bytes_offloaded"] > 0
    assert_within_run_to_run_noise(ref, ref_again, got)


def assert_within_run_to_run_noise(ref, ref_again, got):
    """``got`` (output, input gradient, parameter gradients) against two unmodified runs.

    Parking is an exact round trip (values and strides) and the recompute replays the same ops on the
    same values. Two sources of bf16 noise remain: flash attention's backward accumulates dQ with
    atomics (two unmodified runs already differ), and a reloaded tensor lives at another address, which
    can select another vectorised kernel path. So: within 4x the run-to-run noise where there is any,
    and within 1% of the tensor's magnitude (a few bf16 ulps) otherwise. A race or a wrong tensor gives
    differences of the order of the values themselves (or NaN), far outside both."""
    pairs = [("output", ref[0], ref_again[0], got[0]), ("input grad", ref[1], ref_again[1], got[1])]
    pairs += [(n, g, ref_again[2][n], got[2][n]) for n, g in ref[2].items()]
    for name, a, a_again, b in pairs:
        assert torch.isfinite(b).all(), f"{name}: memfit produced non-finite values"
        scale = a.float().abs().max().item()
        noise = (a.float() - a_again.float()).abs().max().item()
        diff = (a.float() - b.float()).abs().max().item()
        assert diff <= max(4 * noise, 1e-2 * scale) + 1e-6, (
            f"{name}: memfit differs by {diff:.3e} (run-to-run noise {noise:.3e}, magnitude {scale:.3e})"
        )


@pytest.mark.parametrize("park", [False, True], ids=["attention", "blocks-parked"])
def test_wans_float32_norms_are_parked_narrow_on_cuda(park, monkeypatch):
    """Wan's blocks save float32 up-casts of bfloat16 activations (their ``FP32LayerNorm``s): a block parked whole
    parks them as bfloat16, half the bytes, and backward widens them back to the same values. Its attention calls
    save none on CUDA (torch's ``RMSNorm`` on q and k is one fused kernel there, saving its bfloat16 input; off
    CUDA it casts up, ``test_narrow.py``): offloaded alone they park as they are, with the same gradients."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, run = tiny_bf16_runner("memfit_wan", tokens=4680)

    config = {"gradient_checkpointing_offload_attention": True}
    if park:
        force_auto_plan(monkeypatch, lambda names: [BlockPolicy.PARK] * len(names))
        config = auto_config("1GiB")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        ref, ref_again = run(), run()
        with memfit.apply(model, config, min_offload_bytes=0) as handle:
            got = run()
            stats = handle.stats()
    assert stats["bytes_offloaded"] > 0
    if park:
        assert stats["bytes_narrowed"] > 0
    assert_within_run_to_run_noise(ref, ref_again, got)


def _sleepy(model, cycles: int):
    """Delay the compute stream after each block's FFN: the parked tensor is produced late."""
    return [b.ff_out.register_forward_hook(lambda *_: torch.cuda._sleep(cycles)) for b in model.blocks]


def test_delayed_compute_stream_still_gives_identical_gradients():
    model = build(dim=1024, blocks=6, device="cuda")
    x = torch.randn(1, 4096, 1024, device="cuda")
    hooks = _sleepy(model, 2_000_000)
    ref = step(model, x)
    for config in (
        {**ON, "gradient_checkpointing_backend": "unsloth"},
        {"gradient_checkpointing_offload_attention": True},
        {
            **ON,
            "gradient_checkpointing_backend": "unsloth-ffn",
            "gradient_checkpointing_offload_attention": True,
        },
    ):
        with memfit.apply(model, config, adapter=TOY, min_offload_bytes=0):
            assert_same(ref, step(model, x))
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("release", list(ReloadRelease), ids=lambda r: r.value)
@pytest.mark.parametrize(
    "config",
    [
        {**ON, "gradient_checkpointing_backend": "unsloth-ffn"},
        {"gradient_checkpointing_offload_attention": True},
    ],
    ids=["unsloth-ffn", "offload_attention"],
)
def test_delayed_copies_give_identical_gradients_whether_reloads_are_tied_or_not(config, release):
    """Every batch of copies waits ~5 ms on its stream: reloads land long after they were issued ahead, so compute
    must wait for each before its first use, and memory freed after it must not be handed out under a copy still
    writing it (a reload tied to no stream relies on compute's wait alone)."""
    model = build(dim=1024, blocks=6, device="cuda")
    x = torch.randn(1, 2048, 1024, device="cuda")
    ref = step(model, x)
    engine = CopyEngine(
        PinnedBucketPool(available_host_bytes=lambda: 1 << 40, host_reserve_bytes=0),
        streams=DelayedCopies(10_000_000),
        reload_release=release,
    )
    with memfit.apply(model, config, adapter=TOY, copy_engine=engine, min_offload_bytes=0) as handle:
        for _ in range(2):
            assert_same(ref, step(model, x))
        assert handle.stats()["bytes_reloaded"] > 0


def test_200_steps_with_alternating_shapes_leak_nothing():
    model = build(dim=512, blocks=4, device="cuda")
    shapes = [(1, 1024, 512), (1, 1536, 512)]
    config = {
        **ON,
        "gradient_checkpointing_backend": "unsloth",
        "gradient_checkpointing_offload_attention": True,
    }
    with memfit.apply(model, config, adapter=TOY, min_offload_bytes=0) as handle:
        pool = handle.session.copy.pool
        for i in range(200):
            step(model, torch.randn(*shapes[i % 2], device="cuda"))
            if i == 49:  # past every one-time allocation (per-thread cuBLAS workspaces, pool warm-up)
                torch.cuda.synchronize()
                allocated, pinned = torch.cuda.memory_allocated(), pool.stats().pinned_bytes_held
                allocations = pool.stats().pinned_allocations
        torch.cuda.synchronize()
        gc.collect()
        stats = pool.stats()
    # One leaked activation per step would grow memory by 150 x 2-3 MiB over the last 150 steps.
    assert torch.cuda.memory_allocated() - allocated < 4 * 2**20
    assert stats.pinned_bytes_held == pinned and stats.pinned_allocations == allocations
    assert stats.buffers_in_use == 0


def test_unsloth_peak_is_below_torch_by_the_parked_inputs():
    model = build(dim=2048, blocks=24, device="cuda", dtype=torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(1, 8192, 2048, device="cuda", dtype=torch.bfloat16)

    def peak(config):
        with memfit.apply(model, config, adapter=TOY) as handle:
            step(model, x)  # warm-up: pool and allocator
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            handle.reset_stats()
            step(model, x)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated(), handle.stats()

    torch_peak, _ = peak(ON)
    unsloth_peak, stats = peak({**ON, "gradient_checkpointing_backend": "unsloth"})
    parked = stats["bytes_offloaded"]
    assert parked > 0
    assert unsloth_peak <= torch_peak - 0.9 * parked + 8 * 2**20, (torch_peak, unsloth_peak, parked)


def test_pinned_host_buffers_are_exact_and_copy_asynchronously():
    """The pool pins with cudaHostRegister: an odd-sized request pins exactly its bytes (PyTorch's
    pin_memory=True would pin the next power of two), copies both ways are asynchronous and exact."""
    from memfit.offload.hostmem import allocate_host

    nbytes = (137 << 20) + 5
    buf = allocate_host(nbytes, True)
    assert buf.is_pinned() and buf.numel() == nbytes and buf.untyped_storage().nbytes() == nbytes
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        buf.copy_(src, non_blocking=True)
        back = torch.empty_like(src).copy_(buf, non_blocking=True)
    stream.synchronize()
    assert torch.equal(back, src)
    del buf
    gc.collect()  # unregisters; pinning the same amount again must work
    assert allocate_host(nbytes, True).is_pinned()
