"""nox on a GPU machine that has it only as carried wheels (``benchmarks/tools/run_nox.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _run_nox(*args: str, site: Path | None = None) -> subprocess.CompletedProcess:
    # -S: no site-packages, as on a machine whose Python has no nox
    env = {k: v for k, v in os.environ.items() if k not in ("MEMFIT_NOX_SITE", "PYTHONPATH")}
    if site is not None:
        env["MEMFIT_NOX_SITE"] = str(site)
    return subprocess.run(
        [sys.executable, "-S", str(TOOLS / "run_nox.py"), *args], capture_output=True, text=True, env=env
    )


def test_without_nox_it_says_how_to_carry_it():
    done = _run_nox("-s", "gpu")
    assert done.returncode != 0
    assert "nox is not installed" in done.stderr and "device_wheels.sh" in done.stderr


def test_the_carried_nox_runs_with_the_arguments_after_the_machines_own_packages(tmp_path):
    fake = tmp_path / "nox"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    # a module the machine already has (the standard library's json) is not taken from the carried folder
    (tmp_path / "json.py").write_text("raise RuntimeError('the carried copy shadowed the machine')\n")
    (fake / "__main__.py").write_text("import sys, json\nprint('ran', sys.argv[1:], json.__name__)\n")
    done = _run_nox("-s", "gpu", site=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran ['-s', 'gpu'] json"


def test_the_lease_and_device_scripts_run_nox_through_it(lease, tmp_path):
    assert lease.job_command("gpu", tmp_path)[:3] == [sys.executable, str(TOOLS / "run_nox.py"), "-s"]
    for script in ("device_checks.sh", "remote.sh"):
        text = (TOOLS / script).read_text()
        assert "-m nox" not in text and "run_nox.py" in text
