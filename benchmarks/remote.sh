#!/usr/bin/env bash
# Entry point on the GPU machine (no network, its own Python with torch): install the carried wheels
# next to the machine's torch, then run the nox GPU sessions and the benchmarks. Output goes to $OUT.
#   Here:   rm -f .whl/memfit*; uv build --all-packages -o .whl/ && rm -f .whl/*.tar.gz
#   There:  bash benchmarks/remote.sh [nox sessions... | bench-families]   (default: gpu bench)
#           bash benchmarks/remote.sh lease --budget 570 PHASE...          (memfit_benchmarks.lease)
set -uo pipefail
OUT="${OUT:-/tmp/memfit-out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 MEMFIT_NOX_SYSTEM_PYTHON=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__)"
    git rev-parse HEAD 2>/dev/null || true
} | tee "$OUT/env.txt"
if [ "${1:-}" = lease ]; then  # python -m memfit_benchmarks.lease: phases, GPU lanes, one deadline, one archive
    shift
    exec python3 -m memfit_benchmarks.lease --out "$OUT" "$@"
fi
sessions=("$@")
[ ${#sessions[@]} -eq 0 ] && sessions=(gpu bench)
status=0
for s in "${sessions[@]}"; do
    log="$OUT/nox-$(echo "$s" | tr -c 'A-Za-z0-9._-' '_').log"
    if [ "$s" = bench ]; then
        python3 -m nox -s bench -- --out "$OUT" --regime all 2>&1 | tee "$log" || status=1
    elif [ "$s" = bench-families ]; then
        python3 -m nox -s bench -- --suite families --family "${FAMILIES:-all}" --out "$OUT" 2>&1 | tee "$log" \
            || status=1
    else
        python3 -m nox -s "$s" 2>&1 | tee "$log" || status=1
    fi
done
exit $status
