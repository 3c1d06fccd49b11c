"""Building presets: weights are created in the target dtype, so the build's peak is the weights' size."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("diffusers")
memfit_flux = pytest.importorskip("memfit_flux")

from memfit.adapters.building import build_model, cast_like_from_pretrained, read_model_config  # noqa: E402

# A Flux of a few hundred MiB in bfloat16 (2 double + 4 single blocks at width 1024): large enough that a
# float32 intermediate (twice the weights) stands far above the allocator's and the interpreter's noise.
MID_FLUX = {
    **memfit_flux.presets.FULL,
    "num_layers": 2,
    "num_single_layers": 4,
    "num_attention_heads": 8,
    "joint_attention_dim": 1024,
    "pooled_projection_dim": 256,
}

# Runs in a fresh interpreter: resets the kernel's peak-RSS mark (clear_refs 5), builds, reads the peak back.
_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    import diffusers  # imported before the baseline: its import is not the build
    from memfit.adapters.building import build_model

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    config = json.loads(sys.argv[1])
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = status("VmRSS")
    model = build_model("diffusers:FluxTransformer2DModel", config, dtype=torch.bfloat16, device="cpu")
    peak = status("VmHWM")
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    print(json.dumps({"peak_delta": peak - before, "weights": weights, "dtypes": dtypes}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_building_a_mid_size_model_peaks_at_its_weights_size():
    """Resident memory while building a bfloat16 model stays within its weights' bytes (+ small slack): the
    weights are allocated once, in bfloat16 — no float32 model on the way (that peaks at 2-3x)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, json.dumps(MID_FLUX)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    weights = result["weights"]
    assert weights > 250 * 2**20, "the model must be large enough for the check to mean something"
    assert result["dtypes"] == ["torch.bfloat16"]
    # ~55 MiB whatever the model's size (code pages of kernels run for the first time, module objects); a
    # float32 intermediate adds the weights' size again (613 MiB for these 278 MiB before the fix)
    slack = 80 * 2**20
    assert result["peak_delta"] <= weights * 1.05 + slack, (
        f"building peaked {result['peak_delta'] / 2**20:.0f} MiB above the start for "
        f"{weights / 2**20:.0f} MiB of weights"
    )


def test_float32_modules_stay_float32_and_the_rest_is_built_in_the_target_dtype():
    memfit_wan = pytest.importorskip("memfit_wan")
    from diffusers import WanTransformer3DModel

    model = build_model(WanTransformer3DModel, memfit_wan.presets.TINY, dtype=torch.bfloat16, device="cpu")
    keep = WanTransformer3DModel._keep_in_fp32_modules
    for name, p in model.named_parameters():
        expected = torch.float32 if any(k in name.split(".") for k in keep) else torch.bfloat16
        assert p.dtype == expected, name
    assert torch.get_default_dtype() == torch.float32  # the build restores the default dtype


def test_float32_builds_are_unchanged_by_the_target_dtype_construction():
    """fp32 builds (the tiny presets the kit checks bitwise) draw the same weights as plain construction."""
    from diffusers import FluxTransformer2DModel

    flux = memfit_flux.presets
    torch.manual_seed(0)
    plain = cast_like_from_pretrained(FluxTransformer2DModel(**flux.TINY), torch.float32)
    built = build_model(FluxTransformer2DModel, flux.TINY, dtype=torch.float32, device="cpu")
    for (name, a), (_, b) in zip(plain.state_dict().items(), built.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_diffusers_config_json_builds_through_from_config(tmp_path):
    flux = memfit_flux.presets

    config = {"_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.42.1", **flux.TINY}
    config["axes_dims_rope"] = list(config["axes_dims_rope"])
    folder = tmp_path / "pipeline" / "transformer"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    data, path = read_model_config(tmp_path / "pipeline")
    assert path == folder / "config.json"
    model = build_model("diffusers:FluxTransformer2DModel", data, dtype=torch.float32, device="cpu")
    assert len(model.transformer_blocks) == flux.TINY["num_layers"]
    with pytest.raises(FileNotFoundError, match="no model config.json"):
        read_model_config(tmp_path / "missing")
