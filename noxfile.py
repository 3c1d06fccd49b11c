"""nox sessions for memfit.

CPU sessions (``lint``, ``tests``, ``conformance``) run inside the uv workspace environment
(``uv run --all-packages``), so no second multi-GB torch install is made. Plain ``nox`` runs ``lint`` and
``tests``: every CPU test once (``tests`` includes every adapter's kit; ``conformance-<adapter>`` reruns one
adapter's kit alone, for work on that adapter). The GPU sessions
(``gpu``, ``bench``) run on the interpreter that runs nox — on a GPU machine that is the
machine's own Python, with memfit's wheels installed next to it; no venv is created and
nothing is downloaded (see benchmarks/README.md for the exact command).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "none"

ADAPTERS = sorted(
    p.name
    for p in (ROOT / "adapters").iterdir()
    if (p / "pyproject.toml").exists() and not p.name.startswith("_")
)


def _workspace_python(session: nox.Session) -> list[str]:
    """The workspace interpreter: through uv when available, else the one running nox."""
    if shutil.which("uv") and not os.environ.get("MEMFIT_NOX_SYSTEM_PYTHON"):
        return ["uv", "run", "--all-packages", "python"]
    return [sys.executable]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole workspace: lint rules and formatting (as .ci/run checks them)."""
    session.run(*_workspace_python(session), "-m", "ruff", "check", ".", external=True)
    session.run(*_workspace_python(session), "-m", "ruff", "format", "--check", ".", external=True)


@nox.session
def tests(session: nox.Session) -> None:
    """Every CPU test: core, conformance kit, all adapters (GPU tests skip without CUDA)."""
    session.run(*_workspace_python(session), "-m", "pytest", *session.posargs, external=True)


@nox.session
@nox.parametrize("adapter", ADAPTERS)
def conformance(session: nox.Session, adapter: str) -> None:
    """The conformance kit against one adapter at a time (not a default session: ``tests`` runs every kit)."""
    session.run(
        *_workspace_python(session),
        "-m",
        "pytest",
        f"adapters/{adapter}",
        "-q",
        *session.posargs,
        external=True,
    )


@nox.session
@nox.parametrize("adapter", ["core", *ADAPTERS])
def gpu(session: nox.Session, adapter: str) -> None:
    """GPU half of the kit (peak memory, bf16, offload) per adapter; a missing GPU is a failure here."""
    target = "core/tests" if adapter == "core" else f"adapters/{adapter}"
    env = {"MEMFIT_REQUIRE_CUDA": "1", "PYTHONUNBUFFERED": "1"}
    session.run(
        sys.executable,
        "-m",
        "pytest",
        target,
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        # a test module that cannot be imported there (a carried wheel that does not fit the image's torch) fails
        # the session, but the other modules' GPU tests still run
        "--continue-on-collection-errors",
        *session.posargs,
        env=env,
        external=True,
    )


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark sweeps on a GPU machine; results as JSON + markdown + PNG under benchmarks/results/.

    ``nox -s bench -- --configs all --rounds 3`` runs the synthetic sweep (memfit and its peers) in every
    training config; ``nox -s bench -- --suite families --family all`` runs every family at its published size
    (memfit_benchmarks.families). The one-call H200 peer job is benchmarks/tools/device_job.sh.
    """
    session.run(
        sys.executable,
        "-m",
        "memfit_benchmarks",
        *session.posargs,
        env={"PYTHONUNBUFFERED": "1"},
        external=True,
    )
