#!/usr/bin/env bash
# Here (with network): nox and its dependencies, at the versions uv.lock pins, as wheels for the GPU machine, which
# has no nox. They go to .whl/nox/ (carried with .whl; device_env.sh installs them apart, run_nox.py runs nox).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl/nox
rm -f .whl/nox/*.whl
# nox and what it needs, pinned as the workspace locks them (no hashes: pip downloads by name and version)
uv export --all-packages --no-hashes --format requirements-txt --quiet \
    | grep -iE '^(nox|argcomplete|attrs|colorlog|dependency-groups|distlib|filelock|humanize|packaging|platformdirs|python-discovery|virtualenv)==' \
    | sed 's/ *;.*//' > .whl/nox/requirements.txt
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 -d .whl/nox -r .whl/nox/requirements.txt
ls .whl/nox
