#!/usr/bin/env bash
# Here (with network): everything the GPU machine needs beside its image (torch, transformers, peft), as wheels in
# .whl/ to carry with a device call: memfit's packages (built from this tree, their commit in .whl/COMMIT), diffusers
# and torchao (for the quantized-base tests; its pure-Python wheel) at uv.lock's versions, and nox with its
# dependencies in .whl/nox/ (device_env.sh installs those apart; run_nox.py runs nox with them).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .whl
mkdir -p .whl/nox
uv build --all-packages -o .whl/ --quiet
rm -f .whl/*.tar.gz
git describe --always --dirty > .whl/COMMIT
fetch() {  # into $1 the wheels, for the machine's Python 3.12, of the locked packages matching the regex $2
    local pins
    pins=$(mktemp)
    uv export --all-packages --no-hashes --format requirements-txt --quiet | grep -iE "^($2)==" | sed 's/ *;.*//' > "$pins"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 -d "$1" "${@:3}" -r "$pins"
    rm -f "$pins"
}
fetch .whl 'diffusers'
fetch .whl 'torchao' --implementation py --abi none --platform any
fetch .whl/nox 'nox|argcomplete|attrs|colorlog|dependency-groups|distlib|filelock|humanize|packaging|platformdirs|python-discovery|virtualenv'
ls .whl .whl/nox
