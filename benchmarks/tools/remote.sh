#!/usr/bin/env bash
# Entry point on the GPU machine (no network, its own Python with torch): install the carried wheels
# next to the machine's torch, then run the nox GPU sessions and the benchmarks. Output goes to $OUT.
#   Here:   bash benchmarks/tools/device_wheels.sh   (memfit's wheels, their commit, diffusers, torchao, nox)
#   There:  bash benchmarks/tools/remote.sh [nox sessions... | bench-families]   (default: gpu bench)
#           bash benchmarks/tools/remote.sh lease --budget 570 PHASE...          (benchmarks/tools/lease.py)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
if [ "${1:-}" = lease ]; then  # phases, GPU lanes, one deadline, one archive
    shift
    exec python3 "$(dirname "$0")/lease.py" --out "$OUT" "$@"
fi
sessions=("$@")
[ ${#sessions[@]} -eq 0 ] && sessions=(gpu bench)
status=0
for s in "${sessions[@]}"; do
    log="$OUT/nox-$(echo "$s" | tr -c 'A-Za-z0-9._-' '_').log"
    if [ "$s" = bench ]; then
        python3 "$(dirname "$0")/run_nox.py" -s bench -- --out "$OUT" --configs all 2>&1 | tee "$log" || status=1
    elif [ "$s" = bench-families ]; then
        python3 "$(dirname "$0")/run_nox.py" -s bench -- --suite families --family "${FAMILIES:-all}" --out "$OUT" 2>&1 | tee "$log" \
            || status=1
    else
        python3 "$(dirname "$0")/run_nox.py" -s "$s" 2>&1 | tee "$log" || status=1
    fi
done
exit $status
