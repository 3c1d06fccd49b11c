#!/usr/bin/env bash
# memfit against its peers on one H200, in one device call of at most 9 minutes. Run from the repository root
# with the wheels carried in .whl/ (memfit's, built with `uv build --all-packages -o .whl/`, and diffusers'):
#
#     OUT=/where/results/go MEMFIT_GIT_COMMIT=<sha> bash benchmarks/tools/device_job.sh
#
# 1. Flux at its full preset (4096 tokens): memfit `torch` against diffusers' own checkpointing, LoRA on every
#    block linear and LoRA on the attention projections only, 3 paired rounds (default SDPA dispatch, cuDNN off).
# 2. The synthetic stack (flash SDPA, cuDNN off), both LoRA configs, 3 paired rounds: at 1024 and 4096 tokens
#    every main memfit mode and every peer (per-block and per-FFN torch.utils.checkpoint, save_on_cpu); at 16384
#    and 32 x 4096 wide / 3072 tokens the checkpointing modes and their checkpoint peers.
# 3. The headline tables of what ran, printed and written with every report to $OUT/summary.md.
#
# No measurement starts after BUDGET_S seconds (default 500); what ran is written either way (rows left out
# are marked), in $OUT: env.txt, family-flux-full.json, synthetic.json, summary.md. Estimated from the
# committed step times and ~1 s per measurement outside its steps: ~20 s to install, ~110 s for Flux (its 12B
# model takes ~50 s to build), ~380 s for the synthetic sweep (1024: 45 s, 4096: 46 s, 16384: 68 s, 32 x 4096
# wide: 32 s per config), ~10 s for the summary: about 8.5 minutes.
# DRY_RUN=1: install nothing, check every command's options and print the plan (the CPU test runs this).
set -uo pipefail
START=$(date +%s)
BUDGET_S="${BUDGET_S:-500}"
FLUX_S="${FLUX_S:-170}"  # Flux's own deadline, so that the synthetic sweep keeps its share
source "$(dirname "$0")/device_env.sh"
elapsed() { echo "[$(( $(date +%s) - START )) s] $*"; }
dry="${DRY_RUN:+--dry-run}"
status=0

elapsed "Flux: memfit torch against diffusers' checkpointing"
python3 -m memfit_benchmarks.families --family flux --configs lora-all,lora-attn --modes torch,diffusers-ckpt \
    --rounds 3 --warmup 1 --steps 2 --stop-at $((START + FLUX_S)) --no-render --out "$OUT" $dry || status=1

elapsed "synthetic stack: memfit against every peer"
python3 -m memfit_benchmarks --configs lora-all,lora-attn --shapes 0,1,2,3 \
    --modes peers/peers/checkpoint-peers/checkpoint-peers --warmup 2/1/1/1 --steps 6/3/2/2 \
    --rounds 3 --stop-at $((START + BUDGET_S)) --no-render --out "$OUT" $dry || status=1

elapsed "summary"
python3 -m memfit_benchmarks.headline --results "$OUT" --summary "$OUT/summary.md" || status=1
elapsed "done (exit $status)"
exit $status
