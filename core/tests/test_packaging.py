"""The wheels ``uv build --all-packages`` makes are ready for an index: complete metadata, the license text,
and each adapter pinned to memfit's minor version and to the library range its declarations were verified on."""

from __future__ import annotations

import email.parser
import importlib
import os
import shutil
import subprocess
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import memfit

REPO = Path(__file__).resolve().parents[2]
UNPUBLISHED = {"memfit-benchmarks"}  # reproducible sweeps, kept in the repository only
URLS = {"Homepage", "Repository", "Issues"}


@dataclass
class Wheel:
    metadata: email.message.Message
    files: dict[str, bytes]

    def requirement(self, name: str) -> Requirement:
        found = [r for r in map(Requirement, self.metadata.get_all("Requires-Dist") or []) if r.name == name]
        assert len(found) == 1, f"{self.metadata['Name']}: {len(found)} requirements on {name}"
        return found[0]

    def entry_points(self) -> list[str]:
        text = next(
            (v.decode() for k, v in self.files.items() if k.endswith(".dist-info/entry_points.txt")), ""
        )
        section = text.split("[memfit.adapters]")[1].split("\n[")[0] if "[memfit.adapters]" in text else ""
        return [line.split("=")[1].strip() for line in section.splitlines() if "=" in line]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Wheel]:
    uv = os.environ.get("UV") or shutil.which("uv")
    if not uv:
        pytest.fail("uv is not on PATH: the README's set-up (`pip install uv`) installs it")
    out = tmp_path_factory.mktemp("wheels")
    cmd = [uv, "build", "--all-packages", "--wheel", "--offline", "--quiet", "--out-dir", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    found = {}
    for path in out.glob("*.whl"):
        with zipfile.ZipFile(path) as whl:
            files = {name: whl.read(name) for name in whl.namelist() if ".dist-info/" in name}
        meta = next(v for k, v in files.items() if k.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(meta.decode())
        found[metadata["Name"]] = Wheel(metadata, files)
    return {name: wheel for name, wheel in found.items() if name not in UNPUBLISHED}


def test_every_published_distribution_is_built(wheels):
    adapters = {f"memfit-{p.name}" for p in (REPO / "adapters").iterdir() if (p / "pyproject.toml").exists()}
    adapters.discard("memfit-_template")
    assert set(wheels) == {"memfit", "memfit-conformance", *adapters}


def test_metadata_is_complete(wheels):
    license_text = (REPO / "LICENSE").read_bytes()
    assert license_text.lstrip().startswith(b"Apache License")
    for name, wheel in wheels.items():
        meta = wheel.metadata
        assert meta["License-Expression"] == "Apache-2.0", name
        assert meta["License-File"] == "LICENSE", name
        shipped = [v for k, v in wheel.files.items() if k.endswith(".dist-info/licenses/LICENSE")]
        assert shipped == [license_text], f"{name}: the wheel does not carry the repository's LICENSE"
        assert meta["Author"] == "memfit developers", name
        classifiers = meta.get_all("Classifier") or []
        assert "Programming Language :: Python :: 3.11" in classifiers, name
        assert any(c.startswith("Development Status ::") for c in classifiers), name
        urls = {u.split(",")[0] for u in meta.get_all("Project-URL") or []}
        assert urls >= URLS, f"{name}: project URLs {urls}"
        assert meta["Requires-Python"] == ">=3.11", name
        assert meta["Summary"] and meta["Description-Content-Type"] == "text/markdown", name
        assert meta.get_payload().strip(), f"{name}: no long description (README)"
        assert meta.get_all("Requires-Dist"), name


def test_memfit_is_pinned_to_its_minor_version(wheels):
    version = Version(memfit.__version__)
    assert Version(wheels["memfit"].metadata["Version"]) == version
    next_minor = Version(f"{version.major}.{version.minor + 1}")
    for name, wheel in wheels.items():
        if name == "memfit":
            continue
        spec = wheel.requirement("memfit").specifier
        assert version in spec and next_minor not in spec, f"{name} requires memfit{spec}"


def test_adapters_pin_the_library_range_they_were_verified_on(wheels):
    checked = 0
    for name, wheel in wheels.items():
        for target in wheel.entry_points():
            module, _, attr = target.partition(":")
            adapter = getattr(importlib.import_module(module), attr)
            assert adapter.verified_versions, f"{adapter.name}: no verified version declared"
            for library, versions in adapter.verified_versions.items():
                for version in versions:
                    verified_version = Version(version)
                    spec = wheel.requirement(library).specifier
                    next_minor = Version(f"{verified_version.major}.{verified_version.minor + 1}")
                    assert verified_version in spec and next_minor not in spec, (
                        f"{name} requires {library}{spec}; {adapter.name} was verified on {library} {version}"
                    )
                    checked += 1
    assert checked >= 8  # every shipped adapter
