#!/usr/bin/env bash
# auto's budget promise and memfit against diffusers' checkpointing on every family, on one H200, in one device
# call of at most 9.5 minutes. Run from the repository root with the wheels carried in .whl/ (memfit's, built
# with `uv build --all-packages -o .whl/`, and diffusers'):
#
#     OUT=/where/results/go MEMFIT_GIT_COMMIT=<sha> PARTS="budget families" bash benchmarks/tools/device_sweeps.sh
#
# Parts (PARTS, in the order given; default both):
#   budget    memfit_benchmarks.budget_promise: the synthetic stack (3072 wide x 15 blocks, 16384 tokens: the budgets
#             fall between its modes' peaks; at 4096 tokens no checkpointing fits them all), then Flux
#             at its full size (4096 tokens), each target and config in its own process (BUDGET_TARGETS); configs full fine-tune, LoRA
#             r16 on the attention projections, LoRA r16 on every block linear, in that order (BUDGET_CONFIGS);
#             budgets 16, 24, 32, 48 GiB and each target's floor (BUDGET_SIZES), the process limited to the budget; auto and the
#             fixed modes none, torch-ffn, torch, unsloth-ffn, unsloth in 3 paired rounds. Writes
#             $BUDGET_STEM.{json,md} (default budget-promise) and budget.log.
#   families  memfit_benchmarks.families: every family at its published size, memfit `torch` against diffusers'
#             own checkpointing, LoRA on every block linear and on the attention projections, 3 paired rounds of
#             1 warm-up + 1 timed step. Wan at 4680 tokens (one 480x832 clip of 3 latent frames; 14040 by
#             default) and LTX-2 at 3072 video tokens (6144 by default): their steps at the default take 2.4-5 s.
#             Chroma's checkpointing branch calls its blocks differently, so it has no peer: its rows say so and
#             nothing is measured. Writes families.tar.gz (family-<name>-full.json each), families-summary.md
#             (the headline tables, then each family's report with its PASS/FAIL checks) and families.log.
#   floors    memfit_benchmarks.floors: per family at its published size, the smallest budget auto meets with
#             and without weight streaming (two profiling forwards each, ~15 s a family). Writes floors.{json,md}.
#
# Time (estimated from the committed step times: benchmarks/results/families/*.json for the families' torch
# steps, results/auto and results/peers for Flux and the synthetic stack; ~0.5 s per measurement outside its
# steps, ~1.5 s for auto's planning forward, ~8 s to start a target's process and build its model):
#   install ~20 s
#   budget: the synthetic stack's three configs took 9.5 min (one call, BUDGET_PART_S=560, the last budget of
#       the last config left out): ~35 s per budget where every mode runs (after the first round only auto and
#       the fixed modes within 15% of the fastest that fits are timed again), a few s where only auto runs (the
#       weights alone over the budget, or below the floor), ~8 s per config to start its process. Flux: estimated
#       ~50 s per budget with fixed modes (0.7 s steps), its 16 GiB and floor budgets auto alone; its full
#       fine-tune ~40 s. So one call per target. Its share here is BUDGET_PART_S (default 330 s): no
#       measurement starts later ("not measured" rows). PARTS=budget BUDGET_PART_S=560 in a call of its own.
#   families ~3.2 min: chroma 2 s, flux 25 s, krea2 37 s, ltxvideo2 34 s, mageflow 20 s, wan 39 s, z-image 23 s
#       (+ ~3 s each to build); share FAMILIES_PART_S (default 200 s), at most FAMILY_S (45 s) per family.
# Nothing starts after TOTAL_S (default 550 s) from the start; what ran is written either way.
# DRY_RUN=1: install nothing, check every command's options and print the plan (the CPU test runs this).
set -uo pipefail
START=$(date +%s)
TOTAL_S="${TOTAL_S:-550}"
BUDGET_PART_S="${BUDGET_PART_S:-330}"
FAMILIES_PART_S="${FAMILIES_PART_S:-200}"
FAMILY_S="${FAMILY_S:-45}"
BUDGET_TARGETS="${BUDGET_TARGETS:-synthetic-16384,flux}"
BUDGET_CONFIGS="${BUDGET_CONFIGS:-full,attn,all}"
BUDGET_STEM="${BUDGET_STEM:-budget-promise}"
BUDGET_SIZES="${BUDGET_SIZES:-16GiB,24GiB,32GiB,48GiB,floor}"
source "$(dirname "$0")/device_env.sh"
elapsed() { echo "[$(( $(date +%s) - START )) s] $*"; }
dry="${DRY_RUN:+--dry-run}"
status=0
# the part's deadline: its share from now, never past the whole run's
stop_at() { local share=$(( $(date +%s) + $1 )) end=$(( START + TOTAL_S )); echo $(( share < end ? share : end )); }
run_part() {
    local name=$1; shift
    elapsed "$name"
    "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    elapsed "$name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}
families_dir="${TMPDIR:-/tmp}/memfit-families"  # seven files: packed into one archive (the tool returns 8 files)
for part in ${PARTS:-budget families}; do
    case "$part" in
        budget) run_part budget python3 -m memfit_benchmarks.budget_promise --device cuda --targets "$BUDGET_TARGETS" \
            --configs "$BUDGET_CONFIGS" --stem "$BUDGET_STEM" --budgets "$BUDGET_SIZES" \
            --fixed none,torch-ffn,torch,unsloth-ffn,unsloth --rounds 3 --warmup 1 --auto-warmup 2 --steps 1 \
            --stop-at "$(stop_at "$BUDGET_PART_S")" --out "$OUT" $dry ;;
        families)
            rm -rf "$families_dir" && mkdir -p "$families_dir"
            run_part families python3 -m memfit_benchmarks.families --family all --preset full \
                --configs lora-all,lora-attn --modes torch,diffusers-ckpt --tokens wan=4680,ltxvideo2=3072 \
                --rounds 3 --warmup 1 --steps 1 --family-seconds "$FAMILY_S" --require-peer \
                --stop-at "$(stop_at "$FAMILIES_PART_S")" --no-render --out "$families_dir" $dry
            python3 -m memfit_benchmarks.headline --results "$families_dir" --summary "$OUT/families-summary.md" \
                >/dev/null || status=1
            if ls "$families_dir"/*.json >/dev/null 2>&1; then
                tar czf "$OUT/families.tar.gz" -C "$families_dir" . || status=1
            fi ;;
        floors) run_part floors python3 -m memfit_benchmarks.floors --family all --preset full \
            --tokens wan=4680,ltxvideo2=3072 --stop-at "$(stop_at "${FLOORS_PART_S:-150}")" --out "$OUT" $dry ;;
        *) echo "unknown part $part (choose from: budget families floors)" >&2; status=1 ;;
    esac
done
elapsed "done (exit $status)"
exit $status
