"""The third-party path, run rather than described: memfit's wheels, an adapter package made from
``adapters/_template`` outside the workspace for a family memfit does not ship (Qwen-Image), installed the
way the template's README says, and the kit run on it with plain pytest.

Nothing is downloaded: the wheels are built with uv's own build backend, and the outside environment is a
fresh venv that sees the workspace's third-party packages (torch, diffusers, pytest) through a directory of
links that leaves out every memfit distribution, so what it imports is the installed wheels and package.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TEMPLATE = REPO / "adapters" / "_template"
QWEN_SOURCES = Path(__file__).parent / "qwenimage" / "memfit_qwenimage"
FAMILY = "qwenimage"


def uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv")
    if not found:
        pytest.fail("uv is not on PATH: the README's set-up (`pip install uv`) installs it")
    return found


def run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None, timeout: int = 120) -> str:
    out = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed:\n{out.stdout[-6000:]}\n{out.stderr[-4000:]}"
    )
    return out.stdout


def ruff_clean_outside(package: Path) -> None:
    """Lint as a third party's repository would, ignoring every ruff setting of this workspace: ruff's
    default import sorting, where memfit is a third-party library and the package itself first-party."""
    rules = "E,F,W,I,B,UP,SIM"
    run(
        sys.executable,
        "-m",
        "ruff",
        "check",
        "--isolated",
        "--select",
        rules,
        "--ignore",
        "E501",
        ".",
        cwd=package,
    )


def make_package(root: Path) -> Path:
    """Step 1 of the template's README outside this repository, then the two modules a developer writes."""
    package = root / f"memfit-{FAMILY}"
    shutil.copytree(TEMPLATE, package, ignore=shutil.ignore_patterns("__pycache__", ".ruff_cache"))
    (package / "conftest.py").unlink()
    (package / "src" / "memfit_template").rename(package / "src" / f"memfit_{FAMILY}")
    for name in ("pyproject.toml", "tests/test_conformance.py"):
        path = package / name
        path.write_text(path.read_text().replace("template", FAMILY).replace("Template", "QwenImage"))
    ruff_clean_outside(package)  # the template as shipped
    for module in ("__init__.py", "presets.py"):
        shutil.copy(QWEN_SOURCES / module, package / "src" / f"memfit_{FAMILY}" / module)
    ruff_clean_outside(package)  # and filled in
    return package


def outside_environment(root: Path, wheels: list[Path], package: Path) -> Path:
    """A venv holding the wheels and the editable package; torch & co. linked in from the workspace."""
    workspace_site = Path(sysconfig.get_paths()["purelib"])
    third_party = root / "third-party"
    third_party.mkdir()
    for entry in workspace_site.iterdir():
        if entry.name.startswith(("memfit", "_memfit", "__editable__")) or entry.suffix == ".pth":
            continue  # memfit's workspace distributions (editable: .pth files) stay out
        (third_party / entry.name).symlink_to(entry)
    venv = root / "venv"
    run(uv(), "venv", "--quiet", "--python", sys.executable, venv, cwd=root)
    python = venv / "bin" / "python"
    site = Path(
        run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root).strip()
    )
    (site / "_third_party.pth").write_text(f"{third_party}\n")
    run(
        uv(),
        "pip",
        "install",
        "--quiet",
        "--offline",
        "--no-deps",
        "--python",
        python,
        *wheels,
        "-e",
        package,
        cwd=root,
    )
    return python


def test_outside_package_passes_the_kit_with_plain_pytest(tmp_path):
    root = tmp_path
    assert REPO not in root.parents, "the package must be built outside the workspace"
    dist = root / "wheels"
    for distribution in ("memfit", "memfit-conformance"):
        run(
            uv(),
            "build",
            "--quiet",
            "--offline",
            "--package",
            distribution,
            "--wheel",
            "--out-dir",
            dist,
            cwd=REPO,
        )
    wheels = sorted(dist.glob("*.whl"))
    assert [w.name.split("-")[0] for w in wheels] == ["memfit", "memfit_conformance"]
    package = make_package(root)
    python = outside_environment(root, wheels, package)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PYTHON", "VIRTUAL_ENV", "UV_"))
    }
    env["OMP_NUM_THREADS"] = "1"

    # What the outside interpreter imports: the installed wheels and the developer's editable package.
    probe = (
        "import json, memfit, memfit_conformance, memfit_qwenimage\n"
        "print(json.dumps({'files': [m.__file__ for m in (memfit, memfit_conformance, memfit_qwenimage)],\n"
        "  'adapters': sorted(memfit.available_adapters()), 'family': memfit.get_adapter('qwenimage').name}))"
    )
    found = json.loads(run(python, "-c", probe, cwd=package, env=env).strip().splitlines()[-1])
    core, kit, adapter = (Path(f) for f in found["files"])
    venv_lib = python.parent.parent / "lib"
    assert venv_lib in core.parents and venv_lib in kit.parents, "memfit must come from the installed wheels"
    assert REPO not in core.resolve().parents and REPO not in kit.resolve().parents
    assert package / "src" in adapter.parents
    assert found["adapters"] == [FAMILY] and found["family"] == FAMILY  # no workspace adapter leaks in

    # The kit, as the README says to run it.
    out = run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=package, env=env, timeout=600)
    summary = out.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary, out[-4000:]
    assert int(re.search(r"(\d+) passed", summary).group(1)) > 100, summary  # the combinations ran too
