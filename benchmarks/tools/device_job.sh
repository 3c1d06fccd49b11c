#!/usr/bin/env bash
# memfit against its peers on the synthetic stack, on one H200, in one device call of at most 9 minutes. Run from
# the repository root with the wheels carried in .whl/ (benchmarks/tools/device_wheels.sh):
#
#     OUT=/where/results/go MEMFIT_GIT_COMMIT=<sha> bash benchmarks/tools/device_job.sh
#
# 1. The synthetic stack (flash SDPA, cuDNN off), both LoRA configs, 3 paired rounds: at 1024 and 4096 tokens
#    every main memfit mode and every peer (per-block and per-FFN torch.utils.checkpoint, save_on_cpu); at 16384
#    and 32 x 4096 wide / 3072 tokens the checkpointing modes and their checkpoint peers. At 1024 tokens a step
#    takes 30-90 ms: each measurement there keeps timing until its timed steps add up to 1 s (SHORT_MIN_S), so
#    that a round's ratio is not six launch-bound steps' worth of noise.
# 2. The headline tables of what ran, printed and written with every report to $OUT/summary.md.
# The families (Flux included) against diffusers' checkpointing are device_sweeps.sh's families-* parts.
#
# No measurement starts after BUDGET_S seconds (default 500); what ran is written either way (rows left out
# are marked), in $OUT: env.txt, synthetic.json, summary.md. Time, estimated from the committed step times
# (results/peers/synthetic.json, every round) and ~1 s per measurement outside its steps (the committed run,
# which also built and measured Flux first, reached its 500 s deadline after 167 of its 180 measurements, as
# that rate predicts): ~20 s to install, ~10 s to start, ~415 s for the sweep (per config, lora-all / lora-attn:
# 1024 tokens 62 / 60 s, 48 / 43 s of it without the 1 s minimum; 4096: 45 / 42 s; 16384: 70 / 66 s; 32 x 4096
# wide: 34 / 34 s), ~5 s for the summary: about 7.5 minutes.
# DRY_RUN=1: install nothing, check every command's options and print the plan (the CPU test runs this).
set -uo pipefail
START=$(date +%s)
BUDGET_S="${BUDGET_S:-500}"
SHORT_MIN_S="${SHORT_MIN_S:-1}"  # timed seconds per measurement at 1024 tokens
source "$(dirname "$0")/device_env.sh"
elapsed() { echo "[$(( $(date +%s) - START )) s] $*"; }
dry="${DRY_RUN:+--dry-run}"
status=0

elapsed "synthetic stack: memfit against every peer"
python3 -m memfit_benchmarks --configs lora-all,lora-attn --shapes 0,1,2,3 \
    --modes peers/peers/checkpoint-peers/checkpoint-peers --warmup 2/1/1/1 --steps 6/3/2/2 \
    --min-seconds "$SHORT_MIN_S/0/0/0" --rounds 3 --stop-at $((START + BUDGET_S)) --no-render --out "$OUT" $dry \
    || status=1

elapsed "summary"
python3 -m memfit_benchmarks.headline --results "$OUT" --summary "$OUT/summary.md" || status=1
elapsed "done (exit $status)"
exit $status
