#!/usr/bin/env bash
# auto's budget promise, memfit against its peers on every family, and auto's floors, on one H200: each part fits
# one device call of at most 9.5 minutes. Run from the repository root with the wheels carried in .whl/
# (benchmarks/tools/device_wheels.sh):
#
#     OUT=/where/results/go MEMFIT_GIT_COMMIT=<sha> PARTS=families-image bash benchmarks/tools/device_sweeps.sh
#
# Parts (PARTS, in the order given; default budget):
#   budget    memfit_benchmarks.budget_promise: the synthetic stack (3072 wide x 15 blocks, 16384 tokens: the budgets
#             fall between its modes' peaks; at 4096 tokens no checkpointing fits them all), then Flux
#             at its full size (4096 tokens), each target and config in its own process (BUDGET_TARGETS); configs full fine-tune, LoRA
#             r16 on the attention projections, LoRA r16 on every block linear, in that order (BUDGET_CONFIGS);
#             budgets 16, 24, 32, 48 GiB and each target's floor (BUDGET_SIZES), the process limited to the budget; auto and the
#             fixed modes none, torch-ffn, torch, unsloth-ffn, unsloth in 3 paired rounds, BUDGET_STEPS timed steps
#             per measurement (default 1; FLOOR_STEPS, default 3, at the floor). Writes
#             $BUDGET_STEM.{json,md} (default budget-promise) and budget.log.
#   families-image   flux, krea2        } memfit_benchmarks.families at each family's published size, LoRA on
#   families-video   wan, ltxvideo2     } every block linear and on the attention projections, 3 paired rounds:
#   families-rest    mageflow, z-image, } memfit torch and unsloth against diffusers' own checkpointing, torch-ffn
#                    chroma             } and unsloth-ffn against torch.utils.checkpoint on each FFN region
#             (FAMILY_MODES). One warm-up step, then timed steps until they add up to FAMILY_MIN_S seconds
#             (default 2: 1-5 steps; one timed step of 0.6-1.3 s left the paired ratios ~1% apart between rounds).
#             Wan at 4680 tokens (one 480x832 clip of 3 latent frames; 14040 by default) and LTX-2 at 3072 video
#             tokens (6144 by default): their steps at the default take 2.4-5 s. Chroma's checkpointing branch calls
#             its blocks differently, so diffusers' checkpointing is no peer there: only its FFN modes run, and its
#             other cells say why. Krea 2 adds ckpt-block: diffusers' checkpointing skips its 4 text-fusion blocks,
#             which memfit checkpoints, and its memfit rows are compared with the peer that does the same work.
#             Writes <part>.tar.gz (family-<name>-full.json each), <part>-summary.md (the headline tables, then
#             each family's report with its checks) and <part>.log. At most two families-* parts per call: the
#             device tool returns 8 files.
#   families-video-full  wan, ltxvideo2 at their presets' default tokens (14040 and 6144: 2.4-5 s steps at the
#             shorter lengths above, roughly 3x at these), the modes of VIDEO_FULL_MODES (default memfit torch against
#             diffusers' own checkpointing, the family check of the peers issue; FAMILY_MIN_S=0 suits steps this long)
#   floors    memfit_benchmarks.floors: per family at its published size, the smallest budget auto meets with
#             and without weight streaming (two profiling forwards each, ~15 s a family). Writes floors.{json,md}.
#
# Time (estimated from the committed step times: results/peers/family-*.json for torch and diffusers' checkpointing
# per config, results/families/*.json for the other modes (lora-all; wan and ltxvideo2 scaled to the tokens above
# by their torch steps; lora-attn as lora-all x the family's torch ratio, 0.93 where not measured); ~2 s per
# measurement outside its timed steps, warm-up step included (the committed families run: 47 measurements with
# ~103 s of steps filled its 200 s share); ~5 s per family to build it and put LoRA on twice; ~10 s to start a
# process; ~8 s to start a budget target's process and build its model; ~0.5 s per budget measurement outside
# its steps, ~1.5 s for auto's planning forward):
#   install ~20 s per call
#   budget: the synthetic stack's three configs took 9.5 min (one call, BUDGET_PART_S=560, the last budget of
#       the last config left out): ~35 s per budget where every mode runs (after the first round only auto and
#       the fixed modes within 15% of the fastest that fits are timed again), a few s where only auto runs (the
#       weights alone over the budget, or below the floor), ~8 s per config to start its process. Flux: estimated
#       ~50 s per budget with fixed modes (0.7 s steps), its 16 GiB and floor budgets auto alone; its full
#       fine-tune ~40 s. So one call per target. Its share here is BUDGET_PART_S (default 330 s): no
#       measurement starts later ("not measured" rows). PARTS=budget BUDGET_PART_S=560 in a call of its own.
#   families-image ~490 s: flux 187 s (36 measurements), krea2 ~270 s (48: ckpt-block too)
#   families-video ~490 s: wan 208 s, ltxvideo2 248 s
#   families-rest  ~500 s: mageflow 176 s, z-image 180 s, chroma 100 s (its FFN modes, in a process of its own)
#       With FAMILY_MIN_S=0 (one timed step): ~320, ~390 and ~350 s. Each family stops starting measurements
#       FAMILY_S (default 300 s) after it was built, each part FAMILIES_PART_S (default: the rest of TOTAL_S)
#       after it started.
#   floors ~2 min for the seven families.
# Nothing starts after TOTAL_S (default 550 s) from the start; what ran is written either way.
# DRY_RUN=1: install nothing, check every command's options and print the plan (the CPU test runs this).
set -uo pipefail
START=$(date +%s)
TOTAL_S="${TOTAL_S:-550}"
BUDGET_PART_S="${BUDGET_PART_S:-330}"
FAMILIES_PART_S="${FAMILIES_PART_S:-$TOTAL_S}"
FAMILY_S="${FAMILY_S:-300}"
FAMILY_MIN_S="${FAMILY_MIN_S:-2}"
FAMILY_MODES="${FAMILY_MODES:-torch,diffusers-ckpt,torch-ffn,ckpt-ffn,unsloth,unsloth-ffn}"
VIDEO_FULL_MODES="${VIDEO_FULL_MODES:-torch,diffusers-ckpt}"
FFN_MODES="torch-ffn,ckpt-ffn,unsloth-ffn,diffusers-ckpt"  # diffusers-ckpt listed so that a row says why it cannot run
BUDGET_TARGETS="${BUDGET_TARGETS:-synthetic-16384,flux}"
BUDGET_CONFIGS="${BUDGET_CONFIGS:-full,attn,all}"
BUDGET_STEM="${BUDGET_STEM:-budget-promise}"
BUDGET_SIZES="${BUDGET_SIZES:-16GiB,24GiB,32GiB,48GiB,floor}"
BUDGET_STEPS="${BUDGET_STEPS:-1}"  # Flux LoRA on every linear: one mode's single steps ranged 0.65-0.94 s over rounds
FLOOR_STEPS="${FLOOR_STEPS:-3}"  # timed steps per measurement at a floor: one step near the limit varied 0.80-0.95 s
source "$(dirname "$0")/device_env.sh"
elapsed() { echo "[$(( $(date +%s) - START )) s] $*"; }
dry="${DRY_RUN:+--dry-run}"
status=0
# the part's deadline: its share from now, never past the whole run's
stop_at() { local share=$(( $(date +%s) + $1 )) end=$(( START + TOTAL_S )); echo $(( share < end ? share : end )); }
run_part() {
    local name=$1; shift
    elapsed "$name"
    "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    elapsed "$name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}
# families_part PART (FAMILIES MODES TOKENS)...: one families sweep per triple, into the part's folder (one file per
# family, packed into one archive), then the part's summary
families_part() {
    local part=$1; shift
    local dir="${TMPDIR:-/tmp}/memfit-$part" deadline
    deadline=$(stop_at "$FAMILIES_PART_S")
    rm -rf "$dir" && mkdir -p "$dir"
    while [ $# -gt 0 ]; do
        run_part "$part" python3 -m memfit_benchmarks.families --family "$1" --preset full \
            --configs lora-all,lora-attn --modes "$2" ${3:+--tokens "$3"} --rounds 3 --warmup 1 --steps 1 \
            --min-seconds "$FAMILY_MIN_S" --family-seconds "$FAMILY_S" --require-peer --stop-at "$deadline" \
            --no-render --out "$dir" $dry
        shift 3
    done
    python3 -m memfit_benchmarks.headline --results "$dir" --summary "$OUT/$part-summary.md" >/dev/null || status=1
    if ls "$dir"/*.json >/dev/null 2>&1; then
        tar czf "$OUT/$part.tar.gz" -C "$dir" . || status=1
    fi
}
for part in ${PARTS:-budget}; do
    case "$part" in
        budget) run_part budget python3 -m memfit_benchmarks.budget_promise --device cuda --targets "$BUDGET_TARGETS" \
            --configs "$BUDGET_CONFIGS" --stem "$BUDGET_STEM" --budgets "$BUDGET_SIZES" \
            --fixed none,torch-ffn,torch,unsloth-ffn,unsloth --rounds 3 --warmup 1 --auto-warmup 2 --steps "$BUDGET_STEPS" \
            --floor-steps "$FLOOR_STEPS" --stop-at "$(stop_at "$BUDGET_PART_S")" --out "$OUT" $dry ;;
        families-image) families_part "$part" flux "$FAMILY_MODES" "" krea2 "$FAMILY_MODES,ckpt-block" "" ;;
        families-video) families_part "$part" wan,ltxvideo2 "$FAMILY_MODES" "wan=4680,ltxvideo2=3072" ;;
        families-video-full) families_part "$part" wan,ltxvideo2 "$VIDEO_FULL_MODES" "" ;;
        families-rest) families_part "$part" mageflow,z-image "$FAMILY_MODES" "" chroma "$FFN_MODES" "" ;;
        floors) run_part floors python3 -m memfit_benchmarks.floors --family all --preset full \
            --tokens wan=4680,ltxvideo2=3072 --stop-at "$(stop_at "${FLOORS_PART_S:-150}")" --out "$OUT" $dry ;;
        *) echo "unknown part $part (choose from: budget families-image families-video families-video-full families-rest floors)" >&2
            status=1 ;;
    esac
done
elapsed "done (exit $status)"
exit $status
