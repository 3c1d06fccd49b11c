"""The headline tables: generated from the results JSON, honest about what no run has measured yet."""

from __future__ import annotations

import json

import pytest

from memfit_benchmarks import headline
from memfit_benchmarks.modes import Peer
from memfit_benchmarks.rounds import merge_rounds
from memfit_benchmarks.runner import add_ratios


def test_the_readme_headline_is_what_the_committed_results_say():
    assert headline.main(["--check"]) == 0, "run: uv run --all-packages python -m memfit_benchmarks.headline"


PEERS = {p.value for p in Peer}


def _rows(rounds: dict[str, list[float]], peaks: dict[str, int]) -> list[dict]:
    rows = [
        merge_rounds(
            [
                {
                    "mode": m,
                    "step_s": s,
                    "peak_allocated": peaks.get(m),
                    "oom": False,
                    "peer": m if m in PEERS else None,
                }
                for s in steps
            ]
        )
        for m, steps in rounds.items()
    ]
    add_ratios(rows)
    return rows


def _synthetic_file(tmp_path, name, rows, *, label="3072w x15, 4096 tok", tokens=4096, skipped=None):
    payload = {
        "suite": "synthetic",
        "date": "2026-01-01T00:00:00+00:00",
        "device": "GPU",
        "torch": "2.x",
        "diffusers": "0.x",
        "sdpa_backend": "flash",
        "rounds": 3,
        "configs": ["lora-all"],
        "pinned_bandwidth": {"d2h_gbs": 50.0},
        "results": [
            {"config": "lora-all", "label": label, "tokens": tokens, "rows": rows, "skipped": skipped or {}}
        ],
    }
    (tmp_path / name).write_text(json.dumps(payload))


def _line(text: str, start: str) -> list[str]:
    row = next(line for line in text.splitlines() if line.startswith(start))
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_nothing_measured_yet_is_said_so(tmp_path):
    family = {
        "suite": "families",
        "family": "flux",
        "preset": "full",
        "regime": "lora",
        "tokens": 4096,
        "rows": [{"mode": "torch", "step_s": 1.0, "oom": False}],
    }  # an older run: memfit rows, no peer
    (tmp_path / "family-flux-full.json").write_text(json.dumps(family))
    text = headline.headline(tmp_path, tmp_path)
    for start in (
        "| flux | 4096 | all linears",
        "| flux | 4096 | attention only",
        "| 3072w x15, 1024 tok | all linears",
    ):
        cells = _line(text, start)
        assert cells[3:] and set(cells[3:]) == {headline.NOT_YET}
    assert "No results file measures a peer yet" in text


def test_cells_are_the_paired_ratios_to_the_peer(tmp_path):
    rows = _rows(
        {
            "none": [0.8, 0.8, 0.8],
            "torch-ffn": [1.00, 1.10, 1.05],
            "ckpt-ffn": [0.95, 1.00, 1.00],
            "torch": [0.95, 1.00, 1.10],
            "ckpt-block": [1.00, 1.00, 1.00],
            "unsloth": [1.00, 1.01, 1.02],
        },
        {"torch-ffn": 90, "ckpt-ffn": 100, "torch": 50, "ckpt-block": 50, "unsloth": 45},
    )
    rows.append({"mode": "unsloth-ffn", "config": None, "oom": True})
    _synthetic_file(tmp_path, "synthetic.json", rows, skipped={"offload_attention": "offload needs CUDA"})
    text = headline.headline(tmp_path, tmp_path)
    cells = _line(text, "| 3072w x15, 4096 tok | all linears")
    # torch ÷ ckpt-block per round 0.95, 1.00, 1.10: median 1.000, within 1.00; torch-ffn ÷ ckpt-ffn 1.053, 1.10,
    # 1.05: median 1.053, over its 1.00 in every round, so bold; unsloth ÷ ckpt-block 1.01 within its 1.01
    assert cells[2:] == [
        "1.000 / 1.00",
        "**1.053** / 0.90",
        "1.010 / 0.90",
        "OOM",
        "not run (offload needs CUDA)",
        headline.NOT_YET,
    ]
    assert _line(text, "| 3072w x15, 4096 tok | attention only")[2:] == [headline.NOT_YET] * 6
    assert (
        "`synthetic.json`: GPU, torch 2.x, diffusers 0.x, flash, 3 rounds, 2026-01-01, pinned D2H 50.0 GB/s"
        in text
    )


def test_a_ratio_over_its_limit_with_a_round_under_it_is_a_tie_not_bold(tmp_path):
    rows = _rows(
        {
            "torch": [
                1.02,
                0.99,
                1.01,
            ],  # ÷ ckpt-block 1.02, 0.99, 1.01: median 1.010 over 1.00, one round under
            "ckpt-block": [1.00, 1.00, 1.00],
            "unsloth": [1.02, 1.03, 1.015],  # 1.02, 1.03, 1.015: every round over its 1.01
        },
        {},
    )
    _synthetic_file(tmp_path, "synthetic.json", rows)
    text = headline.headline(tmp_path, tmp_path)
    cells = _line(text, "| 3072w x15, 4096 tok | all linears")
    assert cells[2] == "1.010 (tie: rounds 0.990–1.020)" and cells[4] == "**1.020**"
    assert "*tie: rounds a–b*: over its limit too (the check fails)" in text


def test_a_peer_that_cannot_run_is_named_in_its_columns(tmp_path):
    payload = {
        "suite": "families",
        "family": "chroma",
        "preset": "full",
        "tokens": 4096,
        "configs": ["lora-all"],
        "results": [
            {
                "config": "lora-all",
                "tokens": 4096,
                "rows": _rows({"torch-ffn": [1.0, 1.0, 1.0], "ckpt-ffn": [1.0, 1.0, 1.0]}, {}),
                "skipped": {"diffusers-ckpt": "its branch calls blocks differently"},
            }
        ],
    }
    (tmp_path / "family-chroma-full.json").write_text(json.dumps(payload))
    cells = _line(headline.headline(tmp_path, tmp_path), "| chroma | 4096 | all linears")
    # torch and unsloth were not run: their peer cannot run on this model, which the cell says
    assert cells[3:] == [
        "no diffusers-ckpt (its branch calls blocks differently)",
        "1.000",
        "no diffusers-ckpt (its branch calls blocks differently)",
        headline.NOT_YET,
    ]


def test_two_current_files_for_one_entry_are_an_error(tmp_path):
    rows = _rows({"torch": [1.0, 1.0], "ckpt-block": [1.0, 1.0]}, {})
    _synthetic_file(tmp_path, "a.json", rows)
    _synthetic_file(tmp_path, "b.json", rows)
    with pytest.raises(
        ValueError, match="two current results for .*a.json and .*b.json; delete the superseded one"
    ):
        headline.headline(tmp_path, tmp_path)


def test_the_readme_block_is_replaced_between_its_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n{headline.BEGIN}\nstale block\n{headline.END}\nafter\n")
    results = tmp_path / "results"
    results.mkdir()
    assert headline.main(["--results", str(results), "--readme", str(readme), "--check"]) == 1
    assert headline.main(["--results", str(results), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(f"# title\n{headline.BEGIN}\n") and text.endswith(f"{headline.END}\nafter\n")
    assert "stale block" not in text and headline.NOT_YET in text
    assert headline.main(["--results", str(results), "--readme", str(readme), "--check"]) == 0
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="the README has no headline block"):
        headline.main(["--results", str(results), "--readme", str(readme)])


def test_a_summary_of_one_sweep_leaves_the_other_out(tmp_path):
    _synthetic_file(tmp_path, "synthetic.json", _rows({"torch": [1.0, 1.0], "ckpt-block": [1.0, 1.0]}, {}))
    both = headline.summary(tmp_path)
    assert (
        "### Synthetic DiT stack" in both
        and "### Model families" in both
        and "<!-- synthetic.json -->" in both
    )
    families_only = headline.summary(tmp_path, suite="families")
    assert families_only.startswith("# memfit against its peers: model families\n")
    assert "### Model families" in families_only and "Synthetic" not in families_only
    assert "synthetic.json" not in families_only  # neither its report nor its source line
    out = tmp_path / "families.md"
    assert headline.main(["--results", str(tmp_path), "--suite", "families", "--summary", str(out)]) == 0
    assert out.read_text() == families_only


def test_a_peer_that_checkpoints_fewer_regions_is_said_so(tmp_path):
    """Krea 2's case: memfit checkpoints the text-fusion blocks too, diffusers routes only its main blocks through
    its checkpoint function; the cell gives both counts. Equal counts add nothing."""
    rows = _rows(
        {"torch": [1.01] * 3, "ckpt-block": [1.0] * 3, "unsloth": [1.0] * 3},
        {"torch": 94, "ckpt-block": 100, "unsloth": 90},
    )
    by = {r["mode"]: r for r in rows}
    by["torch"]["frames_per_step"] = by["unsloth"]["frames_per_step"] = 32.0
    by["ckpt-block"]["checkpointed_calls_per_step"] = 28.0
    _synthetic_file(tmp_path, "synthetic.json", rows)
    cells = _line(headline.headline(tmp_path, tmp_path), "| 3072w x15, 4096 tok | all linears")
    assert cells[2] == "**1.010** / 0.94 (memfit 32 regions, peer 28)"
    assert cells[4] == "1.000 / 0.90 (memfit 32 regions, peer 28)"

    by["ckpt-block"]["checkpointed_calls_per_step"] = 32.0
    _synthetic_file(tmp_path, "synthetic.json", rows)
    cells = _line(headline.headline(tmp_path, tmp_path), "| 3072w x15, 4096 tok | all linears")
    assert cells[2] == "**1.010** / 0.94"


def test_where_diffusers_checkpoints_fewer_regions_the_like_for_like_peer_is_the_ratio(tmp_path):
    """Krea 2's case on a family: diffusers' checkpointing skips the text-fusion blocks that memfit and the
    per-block ``torch.utils.checkpoint`` peer both checkpoint. ``x_peer`` is the ratio to the peer doing the same
    work; the diffusers ratio stays in the cell beside it, with both counts."""
    rows = _rows(
        {"torch": [1.01] * 3, "diffusers-ckpt": [1.0] * 3, "ckpt-block": [1.02] * 3},
        {"torch": 94, "diffusers-ckpt": 100, "ckpt-block": 95},
    )
    by = {r["mode"]: r for r in rows}
    by["torch"]["frames_per_step"] = 32.0
    by["diffusers-ckpt"]["checkpointed_calls_per_step"] = 28.0
    by["ckpt-block"]["checkpointed_calls_per_step"] = 32.0
    add_ratios(rows)  # again, with the counts known
    assert by["torch"]["vs_peer"] == "ckpt-block" and by["torch"]["x_peer"] == pytest.approx(1.01 / 1.02)
    family = {
        "suite": "families",
        "family": "krea2",
        "preset": "full",
        "regime": "lora",
        "tokens": 4096,
        "rows": rows,
    }
    (tmp_path / "family-krea2-full.json").write_text(json.dumps(family))
    cells = _line(headline.headline(tmp_path, tmp_path), "| krea2 | 4096 | all linears")
    assert cells[3] == "0.990 / 0.99 vs ckpt-block (diffusers-ckpt 1.010: memfit 32 regions, peer 28)"

    by["ckpt-block"]["checkpointed_calls_per_step"] = 30.0  # neither matches: diffusers' stays the peer
    add_ratios(rows)
    assert by["torch"]["vs_peer"] == "diffusers-ckpt"


def _pair(a, b, median, **extra):
    return {
        "a": a,
        "b": b,
        "ratio_median": median,
        "ratio_q1": median - 0.01,
        "ratio_q3": median + 0.01,
        **extra,
    }


def test_the_stepped_pairs_are_checked_against_the_headline_targets(tmp_path):
    """A 1024-token run stepped in turn: memfit modes against their peers at 1.00, offload_attention on its
    bound at 1.10, other pairs without a target, whatever target the run itself stored."""
    payload = {
        "suite": "interleaved",
        "device": "NVIDIA H200",
        "torch": "2.11",
        "sdpa_backend": "flash",
        "steps": 200,
        "date": "2026-12-04T00:00:00",
        "shape": "3072w x15, 1024 tok",
        "pairs": [
            _pair("torch", "ckpt-block", 0.95, target=1.00),
            _pair("unsloth-ffn", "ckpt-ffn", 1.05, target=1.00),
            _pair("unsloth", "torch", 1.07, target=1.02),  # an older run's target: no longer the headline's
            _pair("offload_attention", "none", 1.30, target=1.10, bound_ratio=1.30),
        ],
    }
    (tmp_path / "interleaved.json").write_text(json.dumps(payload))
    text = headline.headline(tmp_path, tmp_path, suite="synthetic")
    assert "### Synthetic stack, stepped in turn" in text
    row = "| 3072w x15, 1024 tok | all linears | "
    assert _line(text, row + "torch ÷ ckpt-block")[3:] == ["0.950 (0.940–0.960)", "≤ 1.00", "meets it"]
    assert _line(text, row + "unsloth-ffn ÷ ckpt-ffn")[3:] == ["1.050 (1.040–1.060)", "≤ 1.00", "**over**"]
    assert _line(text, row + "unsloth ÷ torch")[3:] == ["1.070 (1.060–1.080)", "-", "-"]
    assert _line(text, row + "offload_attention ÷ bound")[3:] == ["1.300", "≤ 1.10", "**over**"]
    assert "- `interleaved.json`: NVIDIA H200" in text
    assert "stepped in turn" not in headline.headline(tmp_path, tmp_path, suite="families")


def test_a_familys_pairs_stepped_in_turn_get_the_families_limits(tmp_path):
    """A family's run stepped in turn, per config: its rows sit under the families' table, each pair checked
    against the limit of its mode at the family's tokens (``unsloth`` 1.01 above 1024 tokens)."""
    for config, ratio in (("lora-all", 1.004), ("lora-attn", 0.998)):
        payload = {
            "suite": "interleaved-families",
            "family": "krea2",
            "device": "NVIDIA H100",
            "torch": "2.11",
            "sdpa_backend": "default dispatch",
            "steps": 30,
            "date": "2026-12-06T00:00:00",
            "shape": "krea2 full, 4096 tokens",
            "tokens": 4096,
            "config": config,
            "pairs": [_pair("torch", "ckpt-block", ratio), _pair("unsloth", "ckpt-block", ratio)],
        }
        (tmp_path / f"interleaved-krea2-4096-{config}.json").write_text(json.dumps(payload))
    text = headline.headline(tmp_path, tmp_path, suite="families")
    assert "### Model families, stepped in turn" in text
    assert _line(text, "| krea2 | 4096 | all linears | torch ÷ ckpt-block")[4:] == [
        "1.004 (0.994–1.014)",
        "≤ 1.00",
        "**over**",
    ]
    assert _line(text, "| krea2 | 4096 | all linears | unsloth ÷ ckpt-block")[4:][1:] == [
        "≤ 1.01",
        "meets it",
    ]
    assert _line(text, "| krea2 | 4096 | attention only | torch ÷ ckpt-block")[4:][2] == "meets it"
    # a median a hair over its limit is not shown as the limit itself
    payload["pairs"] = [_pair("torch", "ckpt-block", 1.0002)]
    (tmp_path / "interleaved-krea2-4096-lora-attn.json").write_text(json.dumps(payload))
    text = headline.headline(tmp_path, tmp_path, suite="families")
    assert _line(text, "| krea2 | 4096 | attention only | torch ÷ ckpt-block")[4:] == [
        "1.0002 (0.990–1.010)",
        "≤ 1.00",
        "**over**",
    ]
    assert "stepped in turn" not in headline.headline(tmp_path, tmp_path, suite="synthetic")
