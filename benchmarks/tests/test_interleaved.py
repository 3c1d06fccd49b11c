"""Interleaved step-time ratios: each A step against its neighbouring B steps, and a CPU smoke run."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("peft")


def test_each_step_is_compared_with_its_neighbours_so_a_drift_cancels():
    from memfit_benchmarks.interleaved import per_step_ratios

    # the machine slows down by 10% a step; A costs 2% more than B at every instant
    a = [1.02 * 1.1 ** (2 * i) for i in range(5)]
    b = [1.1 ** (2 * i + 1) for i in range(5)]
    ratios = per_step_ratios(a, b)
    assert ratios[0] == pytest.approx(1.02 / 1.1)  # only the later neighbour
    for r in ratios[1:]:  # between its neighbours: the drift cancels to within its curvature
        assert r == pytest.approx(1.02 / ((1.1**-1 + 1.1) / 2), rel=1e-9)
        assert abs(r - 1.02) < 0.01
    # a ratio of the two modes' means over the run would be off by the drift of one step (10%)


def test_interleaved_smoke_cpu(tmp_path):
    from memfit_benchmarks import interleaved

    (path,) = interleaved.main(
        ["--out", str(tmp_path), "--shape", "tiny", "--steps", "4", "--warmup", "1", "--device", "cpu"]
    )
    payload = json.loads(path.read_text())
    assert [(p["a"], p["b"]) for p in payload["pairs"]] == list(interleaved.PAIRS)
    for p in payload["pairs"]:
        assert len(p["a_step_times_s"]) == len(p["b_step_times_s"]) == 4
        assert p["ratio_q1"] <= p["ratio_median"] <= p["ratio_q3"]
    stats = {p["a"]: p["stats_per_step"][p["a"]] for p in payload["pairs"]}
    # the tiny shape has 2 blocks: both recomputed, neither parked (the step's last two regions never are)
    assert stats["unsloth"]["recomputes"] == 2 and stats["unsloth"]["bytes_offloaded"] == 0
    assert stats["offload_attention"]["attention_tensors_parked"] > 0
    assert stats["offload_attention"].get("recomputes", 0) == 0
    # a peer side runs without a memfit handle: nothing of memfit's to count on it, only its checkpointed regions
    (block_peer,) = (p for p in payload["pairs"] if (p["a"], p["b"]) == ("torch", "ckpt-block"))
    assert block_peer["stats_per_step"]["ckpt-block"] == {"checkpointed_calls": 2.0}
    md = path.with_suffix(".md").read_text()
    assert (
        "| unsloth / torch |" in md and "≤ 1.00×" in md and "2 recomputes" in md and "attention tensors" in md
    )
    assert (
        "| torch / ckpt-block |" in md and "÷ bound ≤ 1.10× (no bandwidth measured)" in md
    )  # CPU: no copies
    with pytest.raises(SystemExit):
        interleaved.main(["--out", str(tmp_path), "--steps", "1"])


def test_the_bound_is_the_baseline_step_unless_the_copies_take_longer():
    from memfit_benchmarks import interleaved

    row = {
        "a": "offload_attention",
        "ratio_median": 1.3,
        "b_step_s": 0.050,
        "stats_per_step": {"offload_attention": {"bytes_offloaded": 0.5e9}},
    }
    assert interleaved.bound_ratio(row, 50.0) == pytest.approx(1.3)  # 10 ms of copies: the step bounds
    assert interleaved.bound_ratio(row, 5.0) == pytest.approx(1.3 * 0.050 / 0.100)  # 100 ms of copies
    assert interleaved.bound_ratio(row, None) is None


def test_compiled_blocks_smoke_cpu(tmp_path):
    """``--compile`` compiles every block (``aot_eager`` here: Dynamo and AOTAutograd without Inductor's code
    generation) and writes a file of its own, so an eager run the same day is kept."""
    from torch._dynamo.utils import counters

    from memfit_benchmarks import interleaved

    counters.clear()
    (path,) = interleaved.main(
        [
            "--out",
            str(tmp_path),
            "--shape",
            "tiny",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--device",
            "cpu",
            "--compile",
            "aot_eager",
        ]
    )
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks did run compiled
    assert path.name == "interleaved-compiled.json"
    payload = json.loads(path.read_text())
    assert payload["compile"] == "aot_eager" and "compiled (aot_eager)" in payload["regime"]
    assert all(p["ratio_median"] > 0 for p in payload["pairs"])
    # memfit went on after the blocks were compiled: its attention hooks ran all the same (Dynamo was reset)
    (offload,) = (p for p in payload["pairs"] if p["a"] == "offload_attention")
    assert offload["stats_per_step"]["offload_attention"]["attention_tensors_parked"] > 0


def test_a_family_is_stepped_in_turn_against_the_peers_of_its_headline_columns(tmp_path, capsys):
    """A family's model: each memfit mode against its column's peer (diffusers' checkpointing for the whole-block
    modes, ``ckpt-ffn`` for the FFN ones), one file per LoRA config, each pair really checkpointing."""
    from memfit_benchmarks import interleaved

    common = f"--out {tmp_path} --family flux --preset tiny --steps 2 --warmup 1 --device cpu".split()
    paths = interleaved.main(common)
    assert [p.name for p in paths] == [
        "interleaved-flux-64-lora-all.json",
        "interleaved-flux-64-lora-attn.json",
    ]
    for path in paths:
        payload = json.loads(path.read_text())
        assert payload["suite"] == "interleaved-families" and payload["family"] == "flux"
        # (64 tokens: every mode's target is 1.00, as at 1024 tokens or fewer)
        assert [(p["a"], p["b"], p["target"]) for p in payload["pairs"]] == [
            ("torch", "diffusers-ckpt", 1.00),
            ("torch-ffn", "ckpt-ffn", 1.00),
            ("unsloth", "diffusers-ckpt", 1.00),
            ("unsloth-ffn", "ckpt-ffn", 1.00),
        ]
        recomputes = {p["a"]: p["stats_per_step"][p["a"]]["recomputes"] for p in payload["pairs"]}
        assert recomputes["torch"] > 0 and recomputes["torch-ffn"] > recomputes["torch"]
        # each peer side counts the regions it checkpointed, as memfit's side counts its frames
        for p in payload["pairs"]:
            assert (
                p["stats_per_step"][p["b"]]["checkpointed_calls"] == p["stats_per_step"][p["a"]]["frames"] > 0
            )
        assert "Model flux tiny, 64 tokens" in path.with_suffix(".md").read_text()
    # a family whose own checkpointing branch cannot be timed against memfit's falls back to ckpt-block
    (chroma,) = interleaved.main(
        f"--out {tmp_path} --family chroma --preset tiny --steps 2 --warmup 1 --device cpu "
        "--configs lora-attn".split()
    )
    pairs = json.loads(chroma.read_text())["pairs"]
    assert [(p["a"], p["b"]) for p in pairs][:1] == [("torch", "ckpt-block")]
    # a family whose own checkpointing covers fewer blocks than memfit's (Krea 2's text-fusion blocks are not routed
    # through it): the counts say so, and the headline does not check that pair
    (krea,) = interleaved.main(
        f"--out {tmp_path} --family krea2 --preset tiny --steps 2 --warmup 1 --device cpu --configs lora-attn "
        "--pairs torch/diffusers-ckpt".split()
    )
    (pair,) = json.loads(krea.read_text())["pairs"]
    assert (
        pair["stats_per_step"]["torch"]["frames"] == 8
        and pair["stats_per_step"]["diffusers-ckpt"]["checkpointed_calls"] == 4
    )
    from memfit_benchmarks import headline

    text = headline.headline(tmp_path, tmp_path, suite="families")
    row = next(line for line in text.splitlines() if line.startswith("| krea2 | 64 | attention only | torch"))
    assert row.rstrip(" |").endswith("other work: memfit 8 regions, peer 4")
    with pytest.raises(SystemExit):
        interleaved.main(common[:4] + ["--family", "flx"])
    assert "unknown family 'flx'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        interleaved.main([*common, "--compile", "aot_eager"])


def test_each_shape_config_and_family_has_a_file_of_its_own(tmp_path):
    """Runs of different shapes, configs or models never overwrite each other's results."""
    from memfit_benchmarks.interleaved import parse_args, stem
    from memfit_benchmarks.training import TrainingConfig

    def named(*argv: str, tokens: int, config: TrainingConfig = TrainingConfig.LORA_ALL) -> str:
        return stem(parse_args(["--out", str(tmp_path), *argv]), tokens=tokens, config=config)

    assert named(tokens=1024) == named("--shape", "tiny", tokens=64) == "interleaved"
    assert named("--shape", "1", tokens=4096) == "interleaved-4096"
    assert named("--shape", "3", tokens=3072) == "interleaved-3072"
    assert (
        named("--shape", "1", tokens=4096, config=TrainingConfig.LORA_ATTENTION)
        == "interleaved-4096-lora-attn"
    )
    assert named("--compile", "inductor", tokens=1024) == "interleaved-compiled"
    assert named("--family", "wan", tokens=4680) == "interleaved-wan-4680-lora-all"


def test_chosen_pairs_keep_a_default_pairs_target_and_refuse_a_typo(tmp_path, capsys):
    from memfit_benchmarks import interleaved

    common = ["--out", str(tmp_path), "--shape", "tiny", "--steps", "2", "--warmup", "1", "--device", "cpu"]
    (path,) = interleaved.main([*common, "--pairs", "unsloth-ffn/ckpt-ffn,torch/none"])
    pairs = json.loads(path.read_text())["pairs"]
    assert [(p["a"], p["b"], p["target"]) for p in pairs] == [
        ("unsloth-ffn", "ckpt-ffn", 1.00),
        ("torch", "none", None),
    ]
    with pytest.raises(SystemExit):
        interleaved.main([*common, "--pairs", "unslot/torch"])
    assert "pair 'unslot/torch'" in capsys.readouterr().err


def test_a_variant_splits_attention_offload_into_its_hooks_and_its_parking(tmp_path):
    from memfit_benchmarks import interleaved

    pairs = "offload_attention[hooks only]/none,offload_attention/offload_attention[hooks only]"
    (path,) = interleaved.main(
        f"--out {tmp_path} --shape tiny --steps 4 --warmup 1 --device cpu".split() + ["--pairs", pairs]
    )
    pairs = json.loads(path.read_text())["pairs"]
    hooks_only = pairs[0]["stats_per_step"]["offload_attention[hooks only]"]
    parked = pairs[1]["stats_per_step"]["offload_attention"]
    # the same attention calls hooked; the variant parks none of their tensors
    assert hooks_only.get("attention_tensors_parked", 0) == 0
    assert parked["attention_tensors_parked"] > 0
    assert hooks_only["attention_calls_offloaded"] == parked["attention_calls_offloaded"] > 0


def test_a_variant_that_needs_cuda_is_refused_off_cuda():
    from memfit_benchmarks.host_overhead import installed, stack

    model, batch = stack(depth=2, width=16, tokens=8)
    with (
        pytest.raises(ValueError, match="needs CUDA"),
        installed(model, batch, "offload_attention[one-by-one]"),
    ):
        pass


@pytest.mark.parametrize("name", ["unsloth-ffn[reloads untied]", "offload_attention[reloads untied]"])
def test_the_untied_reload_variants_run_their_mode_with_reloads_tied_to_no_stream(name, monkeypatch):
    from memfit.offload.copy import ReloadRelease
    from memfit_benchmarks import variants
    from memfit_benchmarks.interleaved import parse_args
    from memfit_benchmarks.modes import MODES

    # (the engine makes CUDA streams: its keywords are what the variant decides)
    monkeypatch.setattr(variants, "CopyEngine", lambda pool, **keywords: keywords)
    mode = variants.VARIANTS[name][0]
    engine = variants.variant_keywords(name, {m.name: m.config for m in MODES}[mode])["copy_engine"]
    assert engine == {"reload_release": ReloadRelease.AFTER_COMPUTE_WAITS}
    assert name in parse_args(["--out", "x", "--pairs", f"{name}/{mode}"]).chosen[0]


CHECKS = Path(__file__).resolve().parents[1] / "tools" / "device_checks.sh"


def test_the_device_parts_default_runs_parse_and_a_given_run_writes_its_file(tmp_path):
    """``device_checks.sh``'s ``interleaved-runs`` part: every default run's arguments parse (a typo would cost a
    device call), and a run given in ``INTERLEAVED_RUNS`` runs with the part's ``--out``."""
    from memfit_benchmarks import interleaved

    text = CHECKS.read_text()
    default = re.search(r'DEFAULT_INTERLEAVED_RUNS="(.*?)"', text, re.DOTALL).group(1).replace("\\\n", "")
    runs = [shlex.split(run) for run in default.split(";")]
    assert len(runs) >= 4
    for run in runs:
        args = interleaved.parse_args([*run, "--out", str(tmp_path)])
        assert args.chosen  # each default run names its pairs
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "DRY_RUN": "1",
        "PARTS": "interleaved-runs",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "INTERLEAVED_RUNS": "--family flux --preset tiny --device cpu --steps 2 --warmup 1 --configs lora-attn "
        "--pairs 'torch/diffusers-ckpt,none + no-op hooks/none'",
    }
    done = subprocess.run(
        ["bash", str(CHECKS)], cwd=CHECKS.parents[2], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with tarfile.open(tmp_path / "interleaved-runs.tar.gz") as archive:
        member = archive.extractfile("interleaved-runs/interleaved-flux-64-lora-attn.json")
        payload = json.loads(member.read())
    # a quoted side with spaces in it stays one side
    assert [(p["a"], p["b"]) for p in payload["pairs"]] == [
        ("torch", "diffusers-ckpt"),
        ("none + no-op hooks", "none"),
    ]


def test_lora_weights_take_the_dtype_the_model_was_built_in_not_its_first_parameters(tmp_path, monkeypatch):
    """Wan keeps its norms and time embedding in float32 whatever it is built in; its LoRA weights (and the config
    the results describe) follow the build dtype, as on every other family."""
    import torch

    from memfit_benchmarks import interleaved

    monkeypatch.setattr(interleaved, "_dtype", lambda device: torch.bfloat16)
    (path,) = interleaved.main(
        f"--out {tmp_path} --family wan --preset tiny --steps 2 --warmup 1 --device cpu --configs lora-attn "
        "--pairs torch/diffusers-ckpt".split()
    )
    regime = json.loads(path.read_text())["regime"]
    assert regime.startswith("frozen bfloat16 base + PEFT LoRA r16"), regime
