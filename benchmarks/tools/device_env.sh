# Sourced by the GPU-machine scripts (no network, the machine's own python3 with torch): installs the carried
# wheels (.whl/, from benchmarks/tools/device_wheels.sh: memfit's, their commit in .whl/COMMIT, diffusers, torchao)
# into /tmp/site next to the machine's torch, exports the environment the benchmarks run in, and records it in
# $OUT/env.txt.
# DRY_RUN=1 (a CPU check of the scripts): nothing is installed and the python3 on PATH is used as it is.
OUT="${OUT:-/tmp/memfit-out}"
mkdir -p "$OUT"
if [ -n "${DRY_RUN:-}" ]; then
    echo "dry run: $(python3 --version)" | tee "$OUT/env.txt"
    export PYTHONUNBUFFERED=1
    return 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "could not install the carried wheels from .whl/ (carry .whl with the run)" >&2; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 MEMFIT_NOX_SYSTEM_PYTHON=1
# nox and its dependencies (.whl/nox/), apart: run_nox.py puts them after the machine's packages
if compgen -G ".whl/nox/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/nox-site \
        .whl/nox/*.whl || { echo "could not install the carried nox wheels from .whl/nox/" >&2; exit 1; }
    export MEMFIT_NOX_SITE=/tmp/nox-site
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the commit the wheels were built from: MEMFIT_GIT_COMMIT, else .whl/COMMIT (written beside them), never this
# copy's git HEAD (the device's copy of the tree need not carry the commit the wheels came from)
export MEMFIT_GIT_COMMIT="${MEMFIT_GIT_COMMIT:-$(cat .whl/COMMIT 2>/dev/null || true)}"
{
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, diffusers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__, 'peft', peft.__version__)"
    echo "commit: ${MEMFIT_GIT_COMMIT:-unknown}"
} | tee "$OUT/env.txt"
