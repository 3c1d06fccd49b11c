"""The lease driver: phase parsing, job commands, the deadline and the single archive."""

import sys
import tarfile

import pytest


def test_parse_phase_groups_jobs_into_gpu_lanes(lease):
    assert lease.parse_phase("0:gpu 1:families=flux,wan 0:bench-lora fsdp2") == {
        "0": ["gpu", "bench-lora"],
        "1": ["families=flux,wan"],
        None: ["fsdp2"],
    }


def test_job_commands(lease, tmp_path):
    assert lease.job_command("gpu-flux", tmp_path)[-1] == "gpu(adapter='flux')"
    assert lease.job_command("bench-lora-all,full", tmp_path)[-4:] == [
        "--configs",
        "lora-all,full",
        "--out",
        str(tmp_path / "synthetic"),
    ]
    assert "wan,flux" in lease.job_command("families=wan,flux", tmp_path)
    assert lease.job_command("bench-lora-all,rounds=3", tmp_path)[-6:] == [
        "--configs",
        "lora-all",
        "--out",
        str(tmp_path / "synthetic"),
        "--rounds",
        "3",
    ]
    assert lease.job_command("bench-lora-attn,frozen,rounds=2", tmp_path)[-6:-4] == [
        "--configs",
        "lora-attn,frozen",
    ]
    assert lease.job_command("bench-lora-all,shapes=0+2,rounds=4", tmp_path)[-4:] == [
        "--rounds",
        "4",
        "--shapes",
        "0,2",
    ]
    assert lease.job_command("families=flux,rounds=3", tmp_path)[-5:] == [
        "flux",
        "--out",
        str(tmp_path / "families"),
        "--rounds",
        "3",
    ]
    assert lease.job_command("auto=flux,wan", tmp_path)[-4:-2] == ["--targets", "flux,wan"]
    assert lease.job_command("auto=wan,4", tmp_path)[-6:-2] == ["--targets", "wan", "--budgets", "4"]
    assert lease.job_command("auto=flux,3,pairs=2", tmp_path)[-8:-2] == [
        "--targets",
        "flux",
        "--budgets",
        "3",
        "--pairs",
        "2",
    ]
    assert lease.job_command("auto=wan,3,steps=2,warmup=1", tmp_path)[-10:-2] == [
        "--targets",
        "wan",
        "--budgets",
        "3",
        "--steps",
        "2",
        "--warmup",
        "1",
    ]
    assert lease.job_command("auto=wan,steps=2,no-adjacent", tmp_path)[-5:-2] == [
        "--steps",
        "2",
        "--no-adjacent",
    ]
    assert lease.job_command("auto=wan,3,no-gaps", tmp_path)[-5:-2] == ["--budgets", "3", "--no-gaps"]
    assert lease.job_command("bench-lora-all,shapes=0,steps=20", tmp_path)[-4:] == [
        "--shapes",
        "0",
        "--steps",
        "20",
    ]
    assert lease.job_command("auto=wan,0", tmp_path)[-4:-2] == ["--budgets", "0"]
    assert lease.job_command("auto=wan,0,gaps=40GiB:,warmup=2", tmp_path)[-8:-2] == [
        "--budgets",
        "0",
        "--warmup",
        "2",
        "--gap-range",
        "40GiB:",
    ]
    assert "--gap-range" not in lease.job_command("auto=wan,0", tmp_path)
    assert lease.job_command("diagnose=wan,modes=offload_attention+auto@103.8GiB,steps=2", tmp_path)[3:] == [
        "--family",
        "wan",
        "--modes",
        "offload_attention,auto@103.8GiB",
        "--steps",
        "2",
        "--out",
        str(tmp_path / "diagnose" / "diagnose_wan_modes_offload_attention_auto@103.8GiB_steps_2"),
    ]
    assert lease.job_command("diagnose", tmp_path)[3:5] == ["--family", "flux"]
    assert lease.job_command("interleaved=steps=300", tmp_path)[3:] == [
        "--shape",
        "0",
        "--steps",
        "300",
        "--out",
        str(tmp_path / "interleaved"),
    ]
    assert lease.job_command("interleaved=1", tmp_path)[3:5] == ["--shape", "1"]
    assert lease.job_command("interleaved=compile=inductor", tmp_path)[3:] == [
        "--shape",
        "0",
        "--compile",
        "inductor",
        "--out",
        str(tmp_path / "interleaved"),
    ]
    # two lanes on one target write to folders of their own
    assert lease.job_command("auto=wan,0", tmp_path)[-1] == str(tmp_path / "auto" / "auto_wan_0")
    assert lease.job_command("auto=wan,3,no-gaps", tmp_path)[-1] == str(
        tmp_path / "auto" / "auto_wan_3_no-gaps"
    )
    assert "--targets" not in lease.job_command("auto", tmp_path)
    assert lease.job_command("families", tmp_path)[-3:] == ["all", "--out", str(tmp_path / "families")]
    with pytest.raises(SystemExit, match="unknown job 'benchh'"):
        lease.job_command("benchh", tmp_path)


def test_deadline_cuts_jobs_and_everything_is_packed(lease, tmp_path, monkeypatch):
    scripts = {"fast": "print('done fast')", "slow": "import time; time.sleep(60)"}
    monkeypatch.setattr(lease, "job_command", lambda job, out: [sys.executable, "-c", scripts[job]])
    run = lease.Lease(tmp_path, budget_s=3, min_job_s=0.5)
    run.run_phase("0:fast 1:slow 0:slow@1")
    run.run_phase("fast")  # past the deadline: skipped, not started
    archive = run.pack()
    summary = (tmp_path / "summary.txt").read_text()
    assert "fast (gpu 0): rc=0" in summary and "done fast" in summary
    assert "slow (gpu 1): rc=timeout" in summary
    assert "slow (gpu 0): rc=timeout in 1 s" in summary  # its own cap, before the deadline
    assert "SKIPPED fast" in summary
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames())[:1] == ["logs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.tar.gz", "summary.txt"]
