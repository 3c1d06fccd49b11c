"""`memfit fit` survives failing rungs: out of memory is a "does not fit" row, a crash a "crashed" row, and
the ladder goes on (in a fresh process after a crash)."""

from __future__ import annotations

import functools
import json

import pytest
import torch

pytest.importorskip("memfit_flux")

from fit_standins import CUDA_FAULT, crashing_workload, failing_build  # noqa: E402

from memfit.config import Backend  # noqa: E402
from memfit.fit import FitReport, InProcessRunner, Rung, RungResult, run_ladder  # noqa: E402
from memfit.isolation import ChildRunner, SetupError  # noqa: E402
from memfit.job import FitJob, build_workload  # noqa: E402
from memfit.measure import FailureKind, RungFailure, StepMeasurement, measure_step  # noqa: E402


@pytest.fixture(scope="module")
def workload():
    return build_workload(FitJob(family="flux", tokens=16))


def test_an_out_of_memory_rung_is_a_row_its_memory_is_released_and_the_ladder_goes_on(workload):
    model = workload.model
    seen_grads: list[bool] = []

    def oom_without_checkpointing(model, inputs, loss_fn, *, config, **kwargs):
        seen_grads.append(any(p.grad is not None for p in model.parameters()))
        if config is None:  # the unmodified step "runs out of memory" halfway through backward
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            kwargs["on_phase"]("backward")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return measure_step(model, inputs, loss_fn, config=config, **kwargs)

    runner = InProcessRunner(
        model,
        workload.inputs,
        workload.loss,
        adapter=workload.adapter,
        steps=1,
        measure=oom_without_checkpointing,
    )
    report = run_ladder(runner, adapter=workload.adapter, budget_bytes=2**30, device_type="cpu")
    none, following = report.results[0], report.results[1]
    assert none.failure is not None and none.failure.kind is FailureKind.OUT_OF_MEMORY
    assert none.status == "does not fit (out of memory)" and not none.fits
    assert none.failure.phase == "backward"
    assert not any(seen_grads), "gradients of the failed step were released before the next rung"
    assert following.measurement is not None and following.fits  # the ladder went on
    assert report.recommended is not None and report.recommended.fits
    row = report.to_json()["rows"][0]
    assert row["status"] == "does not fit (out of memory)" and row["failure"]["kind"] == "out of memory"
    assert row["held_bytes"] is None


def test_the_out_of_memory_row_names_the_peak_it_reached():
    failure = RungFailure(
        FailureKind.OUT_OF_MEMORY, "CUDA out of memory", "forward", peak_bytes=int(23.94 * 2**30)
    )
    assert failure.describe() == "does not fit (out of memory at 23.94 GiB)"


def test_a_cuda_fault_in_process_loses_the_context_and_later_rungs_are_not_run(workload):
    calls = []

    def faulting(model, inputs, loss_fn, *, config, **kwargs):
        calls.append(config)
        kwargs["on_phase"]("backward")
        raise RuntimeError(CUDA_FAULT)

    runner = InProcessRunner(
        workload.model, workload.inputs, workload.loss, adapter=workload.adapter, steps=1, measure=faulting
    )
    report = run_ladder(runner, adapter=workload.adapter, budget_bytes=None, device_type="cpu")
    assert len(calls) == 1, "nothing runs in a process whose CUDA context is lost"
    assert report.all_crashed
    assert report.results[0].status == (
        "crashed (in backward): CUDA error: an illegal memory access was encountered"
    )
    assert "not measured" in report.results[1].status


def test_a_dying_child_and_a_cuda_fault_are_crashed_rows_and_the_ladder_goes_on_in_a_fresh_child(tmp_path):
    """Child 1 dies of SIGABRT in its first backward; child 2 raises a CUDA fault (its context is lost, it
    exits); child 3 measures. Each crash ends one rung."""
    build = functools.partial(crashing_workload, str(tmp_path / "count"), ("abort", "cuda", None))
    with ChildRunner(build, steps=1) as runner:
        info = runner.start()
        assert info["device_type"] == "cpu" and info["tokens"] == 16
        report = run_ladder(runner, adapter=None, budget_bytes=None, device_type="cpu", extra=[Rung.of(None)])
        starts = runner.starts
    first, second, third = report.results
    assert first.crashed and first.failure.phase == "backward"
    assert first.status.startswith("crashed (in backward): the measuring process died (SIGABRT)")
    assert second.crashed
    assert second.status == "crashed (in backward): CUDA error: an illegal memory access was encountered"
    assert third.measurement is not None and third.fits
    assert starts == 3, "a fresh child after each crash, and only then"
    assert report.recommended is third
    assert "2 of 3 rungs crashed" in report.crash_advice()


def test_every_rung_crashing_ends_with_one_line_naming_the_cause(tmp_path):
    build = functools.partial(crashing_workload, str(tmp_path / "count"), ("abort",))
    with ChildRunner(build, steps=1) as runner:
        runner.start()
        report = run_ladder(runner, adapter=None, budget_bytes=None, device_type="cpu")
    assert report.all_crashed and report.recommended is None
    advice = report.crash_advice()
    assert advice.startswith("Every rung crashed (the measuring process died (SIGABRT)")
    assert "\n" not in advice
    rows = report.to_json()["rows"]
    assert [r["failure"]["kind"] for r in rows] == ["crashed"] * len(rows)


def test_a_child_that_cannot_build_is_a_setup_error():
    with ChildRunner(failing_build, steps=1) as runner, pytest.raises(SetupError) as info:
        runner.start()
    assert info.value.out_of_memory


def _crashed(name: str, phase: str | None) -> RungResult:
    return RungResult(
        Rung(name, None),
        None,
        False,
        failure=RungFailure(FailureKind.CRASHED, CUDA_FAULT.splitlines()[0], phase, context_lost=True),
    )


def test_crashes_in_backward_with_the_default_dispatch_suggest_pinning_flash():
    report = FitReport(
        "cuda", 24 * 2**30, "peak allocated", sdpa="torch default (cudnn, flash, efficient, math)"
    )
    report.results = [_crashed("none", "backward"), _crashed("torch-ffn", "backward")]
    advice = report.crash_advice()
    assert advice.startswith(
        "Every rung crashed (CUDA error: an illegal memory access was encountered) in backward"
    )
    assert "`--sdpa flash`" in advice and "torch.backends.cuda.enable_cudnn_sdp(False)" in advice
    pinned = FitReport("cuda", None, "peak allocated", sdpa="flash (pinned)", results=report.results)
    assert "--sdpa flash" not in pinned.crash_advice()  # flash is already pinned: the advice differs
    measured = RungResult(Rung("torch", {}), StepMeasurement(1, 2, 0.1, 1), True)
    partial = FitReport("cuda", None, "peak allocated", sdpa=report.sdpa, results=[*report.results, measured])
    assert partial.crash_advice().startswith("2 of 3 rungs crashed")
    assert json.dumps(partial.to_json())  # failed rows serialise


def test_the_fork_server_preload_never_touches_cuda():
    """Measuring children are forked from a server that imported the preload module; had that import
    initialised the CUDA driver (diffusers does, through torch.cuda.is_available), no child could use CUDA."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "calls = []\n"
        "for name in ('_cuda_getDeviceCount', '_cuda_init'):\n"
        "    original = getattr(torch._C, name)\n"
        "    setattr(torch._C, name, lambda *a, _o=original, _n=name: calls.append(_n) or _o(*a))\n"
        "import memfit._fit_child_preload\n"
        "print(calls)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "[]"


def test_when_nothing_fits_by_activations_the_ladder_streams_weights_the_least_first(workload):
    """On a card smaller than the frozen weights every activation rung runs out of memory: the ladder then tries
    unsloth with weights streamed from host memory, the fewest bytes first, and recommends the first that fits."""
    budget = 24 << 30
    tried: list[str] = []

    class Card:
        def measure(self, rung, on_phase):
            tried.append(rung.name)
            streamed = (rung.config or {}).get("gradient_checkpointing_stream_blocks")
            if streamed is None or streamed == f"{budget // 4 >> 20}MiB":
                return RungFailure(
                    FailureKind.OUT_OF_MEMORY, "CUDA out of memory", "forward", peak_bytes=budget
                )
            return StepMeasurement(held_bytes=1, peak_bytes=budget - (1 << 30), step_seconds=1.0, frames=57)

    report = run_ladder(Card(), adapter=workload.adapter, budget_bytes=budget, device_type="cuda")
    streaming = [name for name in tried if "stream" in name]
    assert streaming == ["unsloth + stream 6144MiB", "unsloth + stream 12288MiB"]  # stops at the first fit
    assert report.recommended is not None and report.recommended.rung.name == "unsloth + stream 12288MiB"
    assert report.recommended_config()["gradient_checkpointing_stream_blocks"] == "12288MiB"


def test_a_failed_step_frees_its_activations_before_memfit_is_removed(monkeypatch):
    """Putting streamed weights back on the device at remove() needs memory; after an out-of-memory step that
    memory is held by the traceback's frames until they are freed, so remove() comes after they are."""
    import weakref

    import memfit
    from memfit.measure import measure_step
    from memfit.offload import weights

    from toy import TOY, build

    model = build(dim=64, blocks=4)
    model.requires_grad_(False)
    alive: list[weakref.ref] = []

    class Failing(torch.nn.Module):
        def forward(self, hidden_states):
            big = torch.ones(1 << 20)  # an activation the failed step held
            alive.append(weakref.ref(big))
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    seen_at_remove = []
    real_remove = weights.WeightStreamer.remove

    def remove(self, **kw):
        seen_at_remove.append(alive[0]() is None)
        real_remove(self, **kw)

    monkeypatch.setattr(weights.WeightStreamer, "remove", remove)
    model.blocks[-1].register_forward_pre_hook(lambda m, a: Failing()(a[0]))
    cfg = {"gradient_checkpointing": True, "gradient_checkpointing_stream_blocks": 2}
    with pytest.raises(torch.OutOfMemoryError):
        measure_step(
            model,
            {"hidden_states": torch.randn(1, 8, 64)},
            lambda out: out.sum(),
            config=cfg,
            adapter=TOY,
            warmup=0,
            steps=1,
        )
    assert seen_at_remove and seen_at_remove[0]  # the activation was gone when the weights went back
    memfit.apply(model, cfg, adapter=TOY).remove()  # and memfit is off the model


def test_a_rung_whose_removal_fails_asks_for_a_fresh_process(workload, monkeypatch):
    """Out of memory inside memfit's own removal (putting streamed weights back on a full card) leaves memfit on
    the model: the failure says so, so that the next rung runs in a fresh process instead of failing with
    "already applied"."""
    import memfit
    from memfit.measure import measure_guarded

    handles = []

    def apply_then_fail(model, inputs, loss_fn, *, config, adapter, **kwargs):
        handles.append(memfit.apply(model, config, adapter=adapter))  # its removal "fails": never removed
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    def just_fail(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    config = {"gradient_checkpointing": True}
    common = {"config": config, "adapter": workload.adapter}
    failure = measure_guarded(
        workload.model, workload.inputs, workload.loss, **common, measure=apply_then_fail
    )
    assert isinstance(failure, RungFailure) and failure.kind is FailureKind.OUT_OF_MEMORY
    assert failure.left_behind and failure.needs_fresh_process and not failure.context_lost
    handles[0].remove()
    ok = measure_guarded(workload.model, workload.inputs, workload.loss, **common, measure=just_fail)
    assert not ok.left_behind  # a plain out-of-memory rung keeps the process


def test_a_child_whose_rung_left_memfit_behind_is_replaced(tmp_path):
    build = functools.partial(crashing_workload, str(tmp_path / "count"), ("left-behind", None))
    with ChildRunner(build, steps=1) as runner:
        runner.start()
        report = run_ladder(runner, adapter=None, budget_bytes=None, device_type="cpu", extra=[Rung.of(None)])
        starts = runner.starts
    first, second = report.results[:2]
    assert first.failure is not None and first.failure.left_behind
    assert second.measurement is not None, second.status  # not "already applied"
    assert starts == 2


def test_a_rung_says_how_many_blocks_stream_and_auto_how_long_it_planned():
    """auto may stream weights on its own: the measurement counts the streamed blocks and the row says so."""
    from memfit.fit import RungResult

    from toy import TOY, build

    model = build(dim=32, blocks=4)
    model.requires_grad_(False)
    model.blocks[0].norm1.requires_grad_(True)  # something trains
    cfg = {"gradient_checkpointing": True, "gradient_checkpointing_stream_blocks": 2}
    measured = measure_step(
        model,
        {"hidden_states": torch.randn(1, 8, 32)},
        lambda out: out.sum(),
        config=cfg,
        adapter=TOY,
        steps=1,
    )
    assert measured.streamed_blocks == 2
    row = RungResult(Rung("stream", cfg), measured, fits=True)
    assert row.status == "fits (streams 2 blocks' weights)"
    plain = RungResult(Rung("none", None), StepMeasurement(1, None, 1.0, 0), fits=False)
    assert plain.status == "does not fit"
    # auto's row says how long it planned (a fixed backend's above does not)
    auto = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "auto"}
    planned = measure_step(
        model,
        {"hidden_states": torch.randn(1, 8, 32)},
        lambda out: out.sum(),
        config={**auto, "gradient_checkpointing_memory_budget": 8 << 10},
        adapter=TOY,
        steps=1,
    )
    assert planned.planning_seconds is not None and planned.planning_seconds > 0
    status = RungResult(Rung("auto", auto), planned, fits=True).status
    assert status == f"fits (planned in {planned.planning_seconds:.2f} s)"


def test_a_full_fine_tune_is_measured_with_an_adamw_step_in_every_rung():
    """Full fine-tune: AdamW's state (twice the weights) is what the job adds on the card, and what auto plans
    for; every rung measures it (a fresh optimizer each, stepped after every backward), a LoRA job none."""
    from memfit.job import Regime

    full = build_workload(FitJob(family="flux", tokens=16, regime=Regime.FULL))
    assert build_workload(FitJob(family="flux", tokens=16)).optimizer is None
    made: list[torch.optim.Optimizer] = []
    make = full.optimizer

    def counting() -> torch.optim.Optimizer:
        made.append(make())
        return made[-1]

    full.optimizer = counting
    runner = InProcessRunner.of(full, steps=2)
    for rung in (Rung("none", None), Rung("torch", {"gradient_checkpointing": True})):
        assert isinstance(runner.measure(rung), StepMeasurement)
    assert len(made) == 2
    trainable = [p for p in full.model.parameters() if p.requires_grad]
    for optimizer in made:  # one warm-up and two timed steps each, on every trainable weight
        assert len(optimizer.state) == len(trainable)
        assert all(int(state["step"]) == 3 for state in optimizer.state.values())


def test_copying_rungs_out_of_memory_with_the_default_segments_suggest_expandable_segments(monkeypatch):
    """On CUDA a rung that parks activations or streams weights needs room for the allocator's reserve with the
    default segments; where one ran out of memory the report names the setting that removes it, once it is set
    (or off CUDA, or where only non-copying rungs ran out of memory) it says nothing."""
    for variable in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(variable, raising=False)

    def out_of_memory(rung: Rung) -> RungResult:
        return RungResult(
            rung, None, False, failure=RungFailure(FailureKind.OUT_OF_MEMORY, "CUDA out of memory")
        )

    report = FitReport("cuda", 24 * 2**30, "peak allocated")
    report.results = [out_of_memory(Rung.of(Backend.TORCH_FFN)), out_of_memory(Rung.of(Backend.UNSLOTH_FFN))]
    advice = report.allocator_advice()
    assert advice.startswith("unsloth-ffn ran out of memory") and "expandable_segments:True" in advice
    assert report.to_json()["allocator_advice"] == advice
    report.results = [out_of_memory(Rung.of(Backend.TORCH_FFN)), out_of_memory(Rung.auto(1 << 30))]
    assert report.allocator_advice().startswith("auto ran out")
    assert FitReport("cpu", None, "held activations", results=report.results).allocator_advice() is None
    report.results = [out_of_memory(Rung.of(Backend.TORCH))]
    assert report.allocator_advice() is None
    report.results = [out_of_memory(Rung.streaming(1 << 30))]
    assert report.allocator_advice().startswith("unsloth + stream 1024MiB ran out")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert report.allocator_advice() is None
