"""Planning again offline from a recorded profile: the plan ``auto`` ran comes back from its row, and the command
says what is wrong with its input."""

from __future__ import annotations

import json

import pytest
import torch

import memfit
from memfit_benchmarks import replan

pytest.importorskip("memfit_flux")


def _auto_row(budget: int | None = None) -> tuple[dict, memfit.MemfitHandle]:
    """An ``auto`` row as the benchmarks record it: tiny Flux on the CPU, one training forward and backward."""
    from memfit_flux import ADAPTER

    preset = ADAPTER.presets["tiny"]
    torch.manual_seed(0)
    model = preset.build()
    inputs = preset.inputs(model)
    handle = memfit.apply(
        model,
        {
            "gradient_checkpointing": True,
            "gradient_checkpointing_backend": "auto",
            "gradient_checkpointing_memory_budget": budget or (1 << 40),
        },
    )
    out = model(**inputs)
    (out[0] if isinstance(out, tuple) else out.sample).float().square().mean().backward()
    return {"mode": "auto", **replan.planned(handle)}, handle


@pytest.mark.filterwarnings("ignore:.*needs no checkpointing:UserWarning")
def test_a_recorded_profile_plans_again_what_the_run_chose(tmp_path, capsys):
    roomy, handle = _auto_row()
    plan = handle.plan
    handle.remove()
    # a budget between the leanest plan and no checkpointing: the planner has to choose
    budget = (plan.smallest_peak_bytes + plan.no_checkpoint_peak_bytes) // 2
    row, handle = _auto_row(budget)
    ran = handle.plan
    handle.remove()
    assert {p for _, p in ran.blocks} != {memfit.BlockPolicy.KEEP}
    results = tmp_path / "run.json"
    results.write_text(json.dumps({"rows": [roomy, {"nested": [row]}]}))

    profile = replan.ModelProfile.from_json(
        json.loads(results.read_text())["rows"][1]["nested"][0]["profile"]
    )
    again, options = replan.replan(profile, ran.budget_bytes)
    assert again.blocks == ran.blocks and again.predicted_peak_bytes == ran.predicted_peak_bytes
    assert len(options) == len(ran.blocks)

    assert replan.main([str(results), "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 2 and listed[1].startswith("1: auto (target ")
    # the row's own target by default; one block's table, its chosen policy marked
    assert replan.main([str(results), "--row", "1", "--blocks", "0"]) == 0
    text = capsys.readouterr().out
    first = f"**{ran.blocks[0][1].value}**"
    assert text.startswith(f"target {memfit.units.format_bytes(ran.budget_bytes)}: predicted peak")
    assert first in text and text.count("| transformer_blocks.0 |") == len(options[0])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--row", "3"], "--row 3: the file has 1 row(s) with a profile (0-0)"),
        (["--target", "lots"], "--target:"),
        (["--target", "1GiB", "--blocks", "a,b"], "--blocks 'a,b': block indices"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, capsys, args, message):
    row = {"mode": "auto", "plan": None, "profile": {"blocks": []}}
    results = tmp_path / "run.json"
    results.write_text(json.dumps([row]))
    with pytest.raises(SystemExit) as exc:
        replan.main([str(results), *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_file_without_profiles_says_so(tmp_path, capsys):
    results = tmp_path / "run.json"
    results.write_text(json.dumps({"rows": [{"mode": "torch", "profile": None}]}))
    with pytest.raises(SystemExit):
        replan.main([str(results)])
    assert "no row recorded a profile" in capsys.readouterr().err


def test_host_ram_bounds_what_a_plan_parks():
    """Wan 2.1 14B's profile at 14040 tokens (recorded on an H100): at 24 GiB the plan parks blocks whole and pins
    more host memory than 80 GiB; given that much it parks fewer, pins within it and costs more."""
    from pathlib import Path

    from memfit.auto.profile import ModelProfile

    results = Path(__file__).parents[1] / "results/streaming/streaming-wan-queue.json"
    profile = ModelProfile.from_json(next(replan.profiled_rows(json.loads(results.read_text())))["profile"])
    target = int(23.76 * (1 << 30))

    def parked(plan):
        return sum(policy.parks_block for _, policy in plan.blocks)

    free, _ = replan.replan(profile, target)
    pinned = free.copied_bytes + free.streamed_bytes
    host = 80 << 30
    assert parked(free) and pinned > host
    bound, _ = replan.replan(profile, target, host_bytes=host)
    assert 0 < parked(bound) < parked(free)
    assert bound.copied_bytes + bound.streamed_bytes <= host
    assert bound.predicted_extra_seconds > free.predicted_extra_seconds
