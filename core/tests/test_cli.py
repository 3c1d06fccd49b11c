"""`memfit fit` and `memfit list` on the embedded tiny Flux default (CPU)."""

import io
import json

import pytest
from rich.console import Console

pytest.importorskip("memfit_flux")

import memfit  # noqa: E402
import memfit.cli as cli  # noqa: E402
from memfit.cli import main  # noqa: E402
from memfit.units import parse_bytes  # noqa: E402


def run_json(tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "fit.json"
    code = main(["fit", *args, "--steps", "1", "--json", str(out)])
    return code, json.loads(out.read_text())


def test_fit_walks_the_ladder_and_recommends_a_fitting_config(tmp_path, capsys):
    code, report = run_json(tmp_path, "--tokens", "64", "--budget", "200KiB")
    assert code == 0
    names = [row["name"] for row in report["rows"]]
    assert names[:3] == ["none", "torch-ffn", "torch"]  # SPEC §1 order
    assert report["metric"] == "held activations" and report["device"] == "cpu"
    rows = {row["name"]: row for row in report["rows"]}
    assert rows["none"]["held_bytes"] > rows["torch-ffn"]["held_bytes"] > rows["torch"]["held_bytes"]
    chosen = rows[report["recommended"]]
    assert chosen["fits"] and chosen["held_bytes"] <= parse_bytes("200KiB")
    # the per-block planner competes at the same budget, measured like the fixed rungs
    assert rows["auto"]["config"]["gradient_checkpointing_backend"] == "auto"
    assert rows["auto"]["fits"] == (rows["auto"]["held_bytes"] <= parse_bytes("200KiB"))
    assert report["recommended_config"]["gradient_checkpointing"] is True
    assert report["sdpa"] == "torch default (CPU)"
    out = capsys.readouterr().out
    assert "paste into your trainer config" in out
    # one line per rung when output is not a terminal, numbered k/N
    assert "rung 1/4 none: held" in out and "rung 3/4 torch: held" in out


def test_on_cpu_the_rung_holding_the_most_within_budget_is_recommended_not_the_fastest(tmp_path):
    """CPU step times are not evidence of GPU speed: the ranking uses held bytes only (the most kept within
    the budget = the least recompute), so it does not change from run to run."""
    _, report = run_json(tmp_path, "--tokens", "64", "--budget", "200KiB")
    fitting = [row for row in report["rows"] if row["fits"]]
    assert report["ranking"] == "held activations"
    assert report["recommended"] == max(fitting, key=lambda row: row["held_bytes"])["name"]
    assert not any(" interval " in row["name"] for row in report["rows"])  # a speed lever: GPU only


def test_fit_without_pressure_leaves_checkpointing_off(tmp_path):
    code, report = run_json(tmp_path, "--tokens", "16", "--budget", "1GiB")
    assert code == 0
    assert [r["name"] for r in report["rows"]] == ["none"]
    assert report["recommended_config"] == {"gradient_checkpointing": False}


def test_fit_reports_an_unreachable_budget(capsys):
    assert main(["fit", "--tokens", "16", "--budget", "10B", "--steps", "1"]) == 1
    assert "Nothing fits" in capsys.readouterr().out


def test_family_names_are_case_insensitive(tmp_path):
    code, report = run_json(tmp_path, "--family", "FLUX", "--tokens", "16", "--budget", "1GiB")
    assert code == 0 and report["family"] == "flux"


# -- every flag is checked before anything is built ---------------------------------------------------------------


@pytest.fixture
def nothing_built(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the flags were checked")

    monkeypatch.setattr("memfit.job.build_workload", refuse)


BAD_FLAGS = [
    (["--tokens", "0"], "argument --tokens: must be at least 1, got 0"),
    (["--tokens", "-5"], "argument --tokens: must be at least 1, got -5"),
    (["--tokens", "many"], "argument --tokens: 'many' is not a whole number"),
    (["--batch", "0"], "argument --batch: must be at least 1, got 0"),
    (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["--budget", "-1"], "argument --budget: '-1': a size must be positive"),
    (["--budget", "24XB"], "argument --budget: '24XB' is not a size"),
    (["--device", "tpu"], "--device 'tpu': memfit fit measures on cuda, cuda:N or cpu"),
    (["--plot", "x.jpgg"], "--plot x.jpgg: .jpgg is not an image format"),
    (["--sdpa", "fastest"], "argument --sdpa: invalid choice: 'fastest'"),
    (["--sdpa", "cudnn", "--device", "cpu"], "--sdpa cudnn needs CUDA"),
    (["--gpu-memory", "24GiB", "--device", "cpu"], "--gpu-memory caps a CUDA card's memory"),
    (["--family", "nope"], "no memfit adapter for family 'nope' is installed"),
    (["--preset", "huge"], "family 'flux' has no preset 'huge'; available: tiny, full"),
    (["--resolution", "1000x1000"], "--resolution for flux: width 1000 px is not a multiple of 16"),
    (["--resolution", "big"], "argument --resolution: resolution 'big' is not WIDTHxHEIGHT"),
    (
        ["--resolution", "256x256", "--frames", "81"],
        "family 'flux' trains on images: --frames does not apply",
    ),
    (["--frames", "81"], "--frames needs --resolution"),
    (["--tokens", "64", "--resolution", "256x256"], "--tokens and --resolution both set the image size"),
    (["--lora-targets", "attn"], "--lora-targets needs --lora-rank"),
    (["--lora-rank", "0"], "argument --lora-rank: must be at least 1, got 0"),
    (["--lora-rank", "4", "--regime", "full"], "--regime full trains every weight: give one"),
    (["--config", "/nonexistent/trainer.json"], "--config /nonexistent/trainer.json: no such file"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no model config.json found"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_on_stderr_with_exit_code_2(flags, message, nothing_built, capsys):
    assert main(["fit", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert message in err
    assert "\n" not in err and "Traceback" not in err


def test_a_json_path_into_a_missing_folder_is_refused_before_measuring(tmp_path, nothing_built, capsys):
    target = tmp_path / "missing" / "out.json"
    assert main(["fit", "--json", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"the folder {tmp_path / 'missing'} does not exist; create it first" in err


def test_a_trainer_config_with_a_bad_memfit_key_is_refused_before_measuring(tmp_path, nothing_built, capsys):
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps({"gradient_checkpointing_backnd": "torch"}))
    assert main(["fit", "--config", str(path)]) == 2
    assert "Did you mean 'gradient_checkpointing_backend'?" in capsys.readouterr().err


def test_without_matplotlib_the_plot_extra_hint_prints_as_written(monkeypatch, nothing_built, capsys):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # `import matplotlib` raises
    assert main(["fit", "--plot", "out.png"]) == 2
    assert "pip install 'memfit[plot]'" in capsys.readouterr().err  # rich markup would eat "[plot]"


def test_version_and_help(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"memfit {memfit.__version__}"
    assert main(["fit", "--help"]) == 0
    assert "--lora-targets" in capsys.readouterr().out


def test_every_flag_has_help():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "fit" in a.choices)
    for sub in (parser, *subparsers.choices.values()):
        for action in sub._actions:
            assert action.help, f"{sub.prog} {action.option_strings or action.dest} has no help text"


# -- the job: LoRA, resolution, a trainer's config, a model config -------------------------------------------------


def test_lora_on_the_attention_projections(tmp_path):
    code, report = run_json(tmp_path, "--lora-rank", "4", "--lora-targets", "attn", "--tokens", "16")
    assert code == 0
    assert report["job"]["regime"] == "lora" and report["job"]["lora_rank"] == 4
    built = report["built"]
    # tiny Flux: 3 double blocks x 8 projections (to_q/k/v, to_out.0, add_q/k/v_proj, to_add_out) + 4 single x 3
    assert built["lora_modules"] == 3 * 8 + 4 * 3
    assert 0 < built["trainable_parameters"] < built["parameters"]


def test_lora_target_names_come_from_the_declared_regions():
    import memfit_flux
    from memfit.job import lora_target_names

    adapter = memfit_flux.ADAPTER
    model = adapter.presets["tiny"].build()
    attn = lora_target_names(model, adapter, "attn")
    assert all(".attn." in n for n in attn)
    assert {n.rsplit(".attn.", 1)[1] for n in attn} == {
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"
    }  # fmt: skip
    every = lora_target_names(model, adapter, "all")
    assert set(attn) < set(every) and "transformer_blocks.0.ff.net.0.proj" in every
    assert "single_transformer_blocks.3.proj_mlp" in every
    chosen = lora_target_names(model, adapter, ("to_q", "proj_mlp"))
    assert len(chosen) == 3 + 4 + 4  # to_q in every block, proj_mlp in the single blocks
    with pytest.raises(memfit.MemfitError, match="LoRA target 'to_qq' matches no module"):
        lora_target_names(model, adapter, ("to_qq",))


def test_resolution_becomes_tokens_through_the_family(tmp_path):
    code, report = run_json(tmp_path, "--resolution", "256x192", "--budget", "1GiB")
    assert code == 0
    assert report["job"]["resolution"] == [256, 192] and report["job"]["tokens"] == 16 * 12


def test_a_video_family_takes_frames(tmp_path):
    pytest.importorskip("memfit_wan")
    code, report = run_json(
        tmp_path, "--family", "wan", "--resolution", "64x48", "--frames", "5", "--budget", "1GiB"
    )
    assert code == 0
    assert report["job"]["tokens"] == 2 * 4 * 3  # 5 frames = 2 latent frames of 4x3 patches


SIMPLETUNER = {
    "model_type": "lora",
    "model_family": "flux",
    "pretrained_model_name_or_path": "black-forest-labs/FLUX.1-dev",
    "lora_rank": 4,
    "lora_alpha": 4,
    "lora_type": "standard",
    "flux_lora_target": "all",
    "train_batch_size": 2,
    "mixed_precision": "bf16",
    "base_model_precision": "int8-quanto",
    "resolution": 128,
    "resolution_type": "pixel_area",
    "learning_rate": 1e-4,
    "gradient_checkpointing": True,
    "gradient_checkpointing_backend": "torch-ffn",
}


def test_a_trainer_config_sets_the_job_and_its_memfit_keys_are_measured_too(tmp_path, capsys):
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps(SIMPLETUNER))
    code, report = run_json(tmp_path, "--config", str(path), "--dtype", "float32", "--budget", "1GiB")
    assert code == 0
    job = report["job"]
    assert job["regime"] == "lora" and job["lora_rank"] == 4 and job["lora_targets"] == "attn"
    assert job["batch"] == 2 and job["resolution"] == [128, 128] and job["tokens"] == 64
    assert job["dtype"] == "float32"  # the flag overrides mixed_precision
    notes = " ".join(report["notes"])
    assert "base_model_precision 'int8-quanto'" in notes and "nothing is downloaded" in notes
    yours = next(row for row in report["rows"] if row["name"] == "your config")
    assert yours["config"]["gradient_checkpointing_backend"] == "torch-ffn" and yours["held_bytes"] > 0
    assert "note: base_model_precision" in capsys.readouterr().out


def test_a_model_config_folder_is_built_with_random_weights(tmp_path):
    import memfit_flux

    config = {"_class_name": "FluxTransformer2DModel", **memfit_flux.presets.TINY}
    config["axes_dims_rope"] = list(config["axes_dims_rope"])
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(config))
    code, report = run_json(tmp_path, "--model", str(tmp_path), "--tokens", "16", "--budget", "1GiB")
    assert code == 0
    assert report["model"] == str(tmp_path) and report["preset"] is None
    assert report["built"]["parameters"] > 0


# -- plot and list -------------------------------------------------------------------------------------------------


def test_the_plot_marks_the_recommendation_has_a_legend_and_labels_do_not_overlap():
    pytest.importorskip("matplotlib")
    from memfit.fit import FitReport, Rung, RungResult
    from memfit.fit_output import draw_plot, label_box
    from memfit.measure import FailureKind, RungFailure, StepMeasurement

    def row(name: str, seconds: float, used: int, fits: bool) -> RungResult:
        return RungResult(Rung(name, {}), StepMeasurement(used, used, seconds, 1, 0.02), fits)

    # five labels crowd one spot, as intervals do on a real ladder
    rows = [row(f"torch interval {i}", 1.0 + i * 1e-4, 100 * 2**20 + i, True) for i in range(2, 7)]
    rows.append(row("none", 0.8, 300 * 2**20, False))
    oom = RungFailure(FailureKind.OUT_OF_MEMORY, "CUDA out of memory", "forward", 2**30)
    rows.append(RungResult(Rung("unsloth", {}), None, False, failure=oom))
    report = FitReport("cuda", 200 * 2**20, "peak allocated", results=rows, recommended=rows[0])
    fig, labels = draw_plot(report)
    renderer = fig.canvas.get_renderer()
    boxes = [label_box(t, renderer) for t in labels]
    assert len(labels) == 6
    assert not any(boxes[i].overlaps(boxes[j]) for i in range(len(boxes)) for j in range(i))
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["fits the budget", "does not fit", "recommended: torch interval 2", "budget"]
    assert any("unsloth: does not fit (out of memory at 1.00 GiB)" in t.get_text() for t in fig.texts)


def test_list_never_cuts_a_model_class_name(monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=buffer, width=80))
    assert main(["list"]) == 0
    out = buffer.getvalue()
    for adapter in memfit.available_adapters().values():
        for name in adapter.model_classes:
            assert name in out, f"{name} was cut"
    assert "…" not in out


@pytest.mark.parametrize(
    ("text", "value"), [("24GiB", 24 * 2**30), ("1.5MB", 1_500_000), ("512", 512), ("3 MiB", 3 * 2**20)]
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_ladder_order_follows_the_spec():
    import memfit_flux
    from memfit.fit import ladder

    names = [r.name for r in ladder(memfit_flux.ADAPTER, offload=True)]
    assert names == ["none", "torch-ffn", "torch", "unsloth-ffn", "unsloth"]
    assert [r.name for r in ladder(memfit_flux.ADAPTER)] == ["none", "torch-ffn", "torch"]
    assert [r.name for r in ladder(None, offload=True)] == ["none", "torch", "unsloth"]


def test_a_leaner_config_as_fast_within_the_measured_spread_is_recommended():
    """A measurement cannot tell configurations apart within its own spread: there the leaner one wins (more
    headroom, same speed); beyond it, the faster one."""
    from memfit.fit import MIN_TIE, Rung, RungResult, recommend
    from memfit.measure import StepMeasurement

    def result(name: str, seconds: float, held: int, spread: float = 0.0) -> RungResult:
        return RungResult(Rung(name, {}), StepMeasurement(held, None, seconds, 1, spread), True)

    fat = result("torch interval 4", 1.00, 300, spread=0.02)
    lean = result("torch", 1.015, 100, spread=0.01)
    assert recommend([fat, lean]) is lean  # 1.5% slower, within the fat one's 2% spread
    slower = result("torch", 1.05, 100, spread=0.01)
    assert recommend([fat, slower]) is fat  # 5% slower: speed wins
    # one timed step each (no spread): the margin is MIN_TIE
    assert recommend([result("a", 1.0, 300), result("b", 1.0 + MIN_TIE / 2, 100)]).rung.name == "b"
    assert recommend([result("a", 1.0, 300), result("b", 1.0 + 2 * MIN_TIE, 100)]).rung.name == "a"
    # equally lean: the faster
    assert recommend([result("a", 1.0, 100), result("b", 1.005, 100)]).rung.name == "a"


def test_the_step_spread_ignores_one_outlier_among_three():
    from memfit.measure import relative_spread

    assert relative_spread([1.0]) == 0.0
    assert relative_spread([1.0, 1.02, 1.5]) == pytest.approx(2 * 0.02 / 1.02)  # the slow step does not count
    assert relative_spread([0.9, 1.0, 1.1]) == pytest.approx(0.2)


def test_on_cuda_the_ladder_runs_in_a_measuring_child(tmp_path, monkeypatch, capsys):
    """The CUDA path's wiring, exercised on CPU: the child builds the job, reports it, measures every rung."""
    monkeypatch.setattr(cli, "measure_in_child", lambda job: True)
    code, report = run_json(tmp_path, "--tokens", "16", "--budget", "1GiB", "--lora-rank", "2")
    assert code == 0
    assert report["built"]["tokens"] == 16 and report["built"]["lora_modules"] > 0
    assert report["rows"][0]["name"] == "none" and report["rows"][0]["held_bytes"] > 0
    assert "building the model in a measuring process" in capsys.readouterr().out
