#!/usr/bin/env bash
# The GPU checks that are not sweeps, in one device call, each part chosen by name. Run from the repository root
# with the wheels carried in .whl/ (benchmarks/tools/device_wheels.sh):
#
#     OUT=/where/results/go PARTS="gpu budget fit-flash" bash benchmarks/tools/device_checks.sh
#
# Parts (in the order given):
#   gpu          nox -s gpu: the GPU half of the core tests and of the kit for every adapter (log: nox-gpu.log)
#   failed-steps the GPU tests of what a failed step leaves allocated and of auto's budget (test_gpu_failed_steps.py,
#                test_gpu_auto.py; ~2 min; also part of gpu)
#   engine       the GPU tests of the region engine's early stop, of auto (its closed loop measured where each
#                backward ends among them) and of weight streaming (test_gpu_frame.py, test_gpu_auto.py,
#                test_gpu_weights.py; ~2.5 min)
#   budget       auto at 24 GiB on Flux full size, LoRA on the attention projections, in a process limited to
#                24 GiB (memfit_benchmarks.budget_promise; budget-promise-flux.{json,md}; the whole sweep:
#                device_sweeps.sh)
#   fit-flash    memfit fit --preset full --budget 24GiB --sdpa flash on a process limited to 24 GiB
#   fit-default  the same with the default SDPA dispatch (crashed rungs become rows, no traceback)
#   fit-job      memfit fit --resolution 1024x1024 --lora-rank 16 --lora-targets attn --budget 24GiB
#   fit-host     memfit fit on a 16 GiB card (smaller than Flux's weights): built on the host, placed per rung
#   streaming    weight streaming's GPU tests and its Flux benchmark (streaming.{json,md}; STREAM_ARGS adds options,
#                e.g. STREAM_ARGS="--blocks 0,19,27 --budgets 16GiB,12GiB --warmup 4"; --card-budgets 16GiB adds
#                auto on a 16 GiB card with the model starting on the host: ~40-60 s a round more, estimated from
#                moving 22 GiB to the host and back and pinning ~14 GiB at ~2 GB/s)
#   streaming-host  where a streamed step's extra time goes: the pinning probe (does an upload hold the host, does
#                the host slow beside uploads; pinning.{json,md}, ~1 min) and diagnose on Flux full size, unsloth
#                with and without 20 blocks streamed (diagnose-flux.md, ~2.5 min; DIAGNOSE_MODES changes the modes)
#   wan-park     the GPU tests of auto and of weight streaming (test_gpu_auto.py, test_gpu_weights.py: parked blocks
#                and streamed blocks under every policy among them), then Wan 2.1 14B at its preset's 14040 tokens: auto
#                at 24 GiB against torch-ffn and offload_attention unconstrained, two paired rounds (streaming.{json,md};
#                ~7 min: the tests ~1.5 min, the model ~1.5 min, each round ~1.5 min)
#   host-bound   where the synthetic stack's 1024-token step (bound by host time) spends its extra time: the offload
#                GPU tests (test_gpu_offload.py, test_gpu_failed_steps.py), diagnose at synthetic-1024 with a
#                Chrome trace per mode (traces-1024.tar.gz), memfit_benchmarks.trace_gaps over them (gaps-1024.md:
#                the compute stream's idle time, host-bound or waiting, the frames the host ran meanwhile, memfit's
#                functions and the C calls they make; ~2 min; the 1024-token ratios are the interleaved part's)
#   interleaved  the pinning probe (pinning.{json,md}: does the host slow beside uploads, and beside downloads as
#                parking makes them) and the 1024-token pairs stepped in turn on two copies of the model: each memfit
#                mode against its peer, parking against the same recompute, offload_attention against its bound
#                (memfit_benchmarks.interleaved: interleaved.{json,md}; INTERLEAVED_PAIRS picks the pairs and
#                INTERLEAVED_STEPS the steps per row (200); ~5 min:
#                7 pairs of 200 + 200 steps at 40-100 ms)
#   interleaved-runs  more runs of memfit_benchmarks.interleaved, each its own argument list (split as a shell
#                splits words: quote a pair whose side has spaces), separated by ';' in INTERLEAVED_RUNS (default:
#                the cells still open, see below); a family's run steps two copies of its model at its preset's
#                size in turn (interleaved-<family>-<tokens>-<config>.{json,md}; ~1-4 min a family); back here,
#                memfit_benchmarks.stepped_merge folds each file into the committed one
#   wan-queue    Wan 2.1 14B at its preset's tokens: auto at 24 GiB against the same budget planned with each block's
#                copies charged against its own forward (the planner's copy queue off), paired by round, and unsloth
#                unconstrained (fits an H100; streaming.{json,md}; no round starts after WAN_QUEUE_SECONDS, 420)
#   wan-reloads  the GPU tests of auto and of weight streaming (~1.5 min), then Wan 2.1 14B at its preset's tokens:
#                auto at 24 GiB against the same budget planned with each reload hidden behind a backward alone (no
#                credit for the recompute of the block after it), paired by round, unsloth unconstrained and the modes
#                of WAN_FIXED (e.g. offload_attention: an H200 only); streaming.{json,md}; no round starts after
#                WAN_QUEUE_SECONDS (420) from the part's start
#   wan-waits    the GPU tests of auto, of weight streaming and of narrowed up-casts, then Wan 2.1 14B at its
#                preset's tokens: auto at 24 GiB against the same with its backward uploads issued after the
#                reloads (--uploads-late), unsloth unconstrained and the modes of WAN_FIXED (offload_attention where
#                the card is an H200: unconstrained it holds 96 GiB), two rounds, paired; where the upload waits
#                fall (forward or backward) and the link each way beside the other (streaming.{json,md}); no round
#                starts after WAN_QUEUE_SECONDS (420) from the part's start; also the same budget with the reloads
#                ahead by the bytes rule alone (--reloads-one-ahead); WAN_UPLOADS_LATE=0 leaves the late row out,
#                WAN_ONE_AHEAD=0 the one-ahead row; WAN_TESTS=narrow runs the narrowing test alone (~2 min less),
#                WAN_ROUNDS sets the rounds (2); runs of one commit merge (streaming --merge)
#   park-cost    the host time of parking one region, piece by piece: stream and event calls, the copy's issue,
#                the device allocation (alone, and while a freed tensor's copy is in flight), the engine's park and
#                round trip of one tensor (park-cost.{json,md}), and the engine's Python alone on this host, over
#                streams that do nothing (cpu/park-cost.{json,md}; <1 min)
#   reserve      what the caching allocator holds above the allocated peak per offload mode, reloads tied to the
#                copy stream and to none, at 16384 tokens, then each at 1.1x its own peak (memfit_benchmarks.reserve:
#                reserve.{json,md}; ~3 min)
#   cprofile     cProfile over 1024-token steps of torch-ffn, unsloth-ffn and unsloth-ffn with its reloads tied to
#                no stream (cprofile-1024-<row>.txt: where parking's host time goes, function by function; ~1 min)
# Each part's exit status is printed; the script exits non-zero if any part failed.
set -uo pipefail
START=$(date +%s)
source "$(dirname "$0")/device_env.sh"
elapsed() { echo "[$(( $(date +%s) - START )) s] $*"; }
status=0
run_part() {
    local name=$1; shift
    elapsed "$name"
    "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    elapsed "$name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}
fit_test() {
    MEMFIT_REQUIRE_CUDA=1 MEMFIT_FIT_LOG_DIR="$OUT/fit" python3 -m pytest core/tests/gpu_fit_24gib.py -v -s \
        -p no:cacheprovider -k "$1"
}
# the headline cells that still tie inside their rounds' spread with no stepped run to settle them (a family's step is
# 0.5-5 s; both copies of a model must fit: LTX-2's FFN modes need an H200), and the 1024-token pairs bound by host
# time (with the reloads tied to no stream against the default: memfit.offload.copy, "Reloads' memory"); stepped_merge
# folds each file into the committed one of the same model
DEFAULT_INTERLEAVED_RUNS="--shape 0 --steps 150 --pairs 'unsloth/ckpt-block,unsloth-ffn/ckpt-ffn,offload_attention/none,\
unsloth-ffn[reloads untied]/unsloth-ffn,offload_attention[reloads untied]/offload_attention';\
 --shape 0 --configs lora-attn --steps 150 --pairs unsloth/ckpt-block,unsloth-ffn/ckpt-ffn;\
 --family wan --tokens 4680 --configs lora-all --steps 20 --pairs torch-ffn/ckpt-ffn;\
 --family wan --configs lora-attn --steps 12 --pairs torch/diffusers-ckpt;\
 --family ltxvideo2 --configs lora-all --steps 16 --pairs torch-ffn/ckpt-ffn,unsloth-ffn/ckpt-ffn"
for part in ${PARTS:-gpu}; do
    case "$part" in
        gpu) run_part nox-gpu python3 benchmarks/tools/run_nox.py -s gpu ;;
        failed-steps) run_part failed-steps env MEMFIT_REQUIRE_CUDA=1 python3 -m pytest \
                core/tests/test_gpu_failed_steps.py core/tests/test_gpu_auto.py -m gpu -q -p no:cacheprovider ;;
        engine) run_part engine env MEMFIT_REQUIRE_CUDA=1 python3 -m pytest core/tests/test_gpu_frame.py \
                core/tests/test_gpu_auto.py core/tests/test_gpu_weights.py -m gpu -q -p no:cacheprovider ;;
        budget) run_part budget python3 -m memfit_benchmarks.budget_promise --targets flux --configs attn \
            --budgets 24GiB --fixed torch,unsloth --rounds 1 --steps 5 --stem budget-promise-flux --out "$OUT" ;;
        fit-flash) run_part fit-flash fit_test "24gib_card_with_flash" ;;
        fit-default) run_part fit-default fit_test "default_attention_dispatch" ;;
        fit-job) run_part fit-job fit_test "lora_job_at_1024px" ;;
        fit-host) run_part fit-host fit_test "16gib_card_builds_on_the_host" ;;
        streaming) run_part streaming-tests env MEMFIT_REQUIRE_CUDA=1 python3 -m pytest core/tests/test_gpu_weights.py \
                -m gpu -q -p no:cacheprovider
            run_part streaming python3 -m memfit_benchmarks.streaming --out "$OUT" ${STREAM_ARGS:-} ;;
        streaming-host) run_part pinning python3 -m memfit_benchmarks.pinning --out "$OUT"
            run_part diagnose python3 -m memfit_benchmarks.diagnose --family flux --no-traces --steps 2 --warmup 2 \
                --modes "${DIAGNOSE_MODES:-unsloth,unsloth+stream20,auto@16GiB}" --out "$OUT" ;;
        wan-park) run_part gpu-auto env MEMFIT_REQUIRE_CUDA=1 python3 -m pytest core/tests/test_gpu_auto.py \
                core/tests/test_gpu_weights.py -m gpu -q -p no:cacheprovider
            run_part streaming-wan python3 -m memfit_benchmarks.streaming --family wan --backend torch-ffn --blocks 0 \
                --fixed offload_attention --budgets 24GiB --rounds 2 --warmup 2 --steps 2 --out "$OUT" ;;
        wan-queue) run_part streaming-wan-queue python3 -m memfit_benchmarks.streaming --family wan --backend unsloth \
                --blocks 0 --budgets 24GiB --per-block --rounds 2 --warmup 2 --steps 2 \
                --stop-at $(( $(date +%s) + ${WAN_QUEUE_SECONDS:-420} )) --out "$OUT" ;;
        host-bound) run_part offload-tests env MEMFIT_REQUIRE_CUDA=1 python3 -m pytest core/tests/test_gpu_offload.py \
                core/tests/test_gpu_failed_steps.py -m gpu -q -p no:cacheprovider
            diag="${TMPDIR:-/tmp}/memfit-diagnose-1024"
            rm -rf "$diag"
            run_part diagnose-1024 python3 -m memfit_benchmarks.diagnose --family synthetic-1024 --steps 5 --warmup 3 \
                --modes "${DIAGNOSE_MODES:-none,torch-ffn,unsloth-ffn,offload_attention,offload_attention[hooks only]}" \
                --out "$diag"
            cp "$diag"/diagnose-*.md "$OUT/" 2>/dev/null
            run_part trace-gaps python3 -m memfit_benchmarks.trace_gaps "$diag"/trace-*.json.gz --out "$OUT/gaps-1024.md"
            tar czf "$OUT/traces-1024.tar.gz" -C "$diag" . || status=1 ;;
        interleaved) run_part pinning python3 -m memfit_benchmarks.pinning --out "$OUT"
            run_part interleaved python3 -m memfit_benchmarks.interleaved --shape 0 --steps "${INTERLEAVED_STEPS:-200}" \
                ${INTERLEAVED_PAIRS:+--pairs "$INTERLEAVED_PAIRS"} --out "$OUT" ;;
        interleaved-runs) IFS=';' read -ra runs <<< "${INTERLEAVED_RUNS:-$DEFAULT_INTERLEAVED_RUNS}"
            # every run's files in one archive (a device call brings back a few files only)
            mkdir -p "$OUT/interleaved-runs"
            for args in "${runs[@]}"; do
                # each run's arguments as a shell would split them: quote a side with spaces in it
                # ('offload_attention[hooks only]/none')
                eval "run_args=($args)"
                elapsed "interleaved $args"
                python3 -m memfit_benchmarks.interleaved "${run_args[@]}" --out "$OUT/interleaved-runs" \
                    >> "$OUT/interleaved-runs.log" 2>&1 || { status=1; elapsed "interleaved $args: failed"; }
            done
            tail -n 40 "$OUT/interleaved-runs.log"
            tar czf "$OUT/interleaved-runs.tar.gz" -C "$OUT" interleaved-runs && rm -rf "$OUT/interleaved-runs" ;;
        wan-reloads) part_start=$(date +%s)
            run_part gpu-auto env MEMFIT_REQUIRE_CUDA=1 python3 -m pytest core/tests/test_gpu_auto.py \
                core/tests/test_gpu_weights.py \
                core/tests/test_gpu_offload.py::test_wans_float32_norms_are_parked_narrow_on_cuda \
                -m gpu -q -p no:cacheprovider
            run_part streaming-wan-reloads python3 -m memfit_benchmarks.streaming --family wan --backend unsloth \
                --blocks 0 ${WAN_FIXED:+--fixed "$WAN_FIXED"} --budgets 24GiB --reloads-alone --rounds 2 --warmup 2 \
                --steps 2 --stop-at $(( part_start + ${WAN_QUEUE_SECONDS:-420} )) --out "$OUT" ;;
        wan-waits) part_start=$(date +%s)
            fixed=${WAN_FIXED-}
            if [ -z "${WAN_FIXED+x}" ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
                fixed=offload_attention
            fi
            late=${WAN_UPLOADS_LATE-1}; [ "$late" = 0 ] && late=
            one=${WAN_ONE_AHEAD-1}; [ "$one" = 0 ] && one=
            narrow_test=core/tests/test_gpu_offload.py::test_wans_float32_norms_are_parked_narrow_on_cuda
            if [ "${WAN_TESTS:-all}" = narrow ]; then tests=("$narrow_test")
            else tests=(core/tests/test_gpu_auto.py core/tests/test_gpu_weights.py "$narrow_test"); fi
            run_part gpu-auto env MEMFIT_REQUIRE_CUDA=1 python3 -m pytest "${tests[@]}" -m gpu -q -p no:cacheprovider
            run_part streaming-wan-waits python3 -m memfit_benchmarks.streaming --family wan --backend unsloth \
                --blocks 0 ${fixed:+--fixed "$fixed"} --budgets 24GiB ${late:+--uploads-late} \
                ${one:+--reloads-one-ahead} \
                --rounds "${WAN_ROUNDS:-2}" --warmup 2 \
                --steps 2 \
                --stop-at $(( part_start + ${WAN_QUEUE_SECONDS:-420} )) --out "$OUT" ;;
        park-cost) run_part park-cost python3 -m memfit_benchmarks.park_cost --out "$OUT"
            run_part park-cost-cpu python3 -m memfit_benchmarks.park_cost --device cpu --out "$OUT/cpu" ;;
        reserve) run_part reserve python3 -m memfit_benchmarks.reserve --limits 1.1 --out "$OUT" ;;
        cprofile) run_part cprofile python3 benchmarks/tools/cprofile_steps.py --out "$OUT" \
                torch-ffn unsloth-ffn "unsloth-ffn[reloads untied]" ;;
        *) echo "unknown part $part" >&2; status=1 ;;
    esac
done
elapsed "done (exit $status)"
exit $status
