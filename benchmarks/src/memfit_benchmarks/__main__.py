"""``python -m memfit_benchmarks``: the synthetic sweep (SPEC §6 shapes, LoRA on a frozen bf16 stack).

Writes ``synthetic-<date>.json`` and ``synthetic-<date>.md`` to ``--out`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
from pathlib import Path

import torch

from memfit_benchmarks.report import render_markdown
from memfit_benchmarks.runner import MODES, add_ratios, measure_mode, pinned_bandwidth
from memfit_benchmarks.synthetic import SYNTHETIC, build, inputs

# (label, width, depth, tokens): width 3072 at 1024/4096/16384 tokens (2x2-packed 64², 128², 256² latents),
# and 32 layers x 4096 wide at 3072 tokens. Depth 15 puts the no-checkpoint peaks near SPEC §6's.
SHAPES = [
    ("3072w x15, 1024 tok", 3072, 15, 1024),
    ("3072w x15, 4096 tok", 3072, 15, 4096),
    ("3072w x15, 16384 tok", 3072, 15, 16384),
    ("4096w x32, 3072 tok", 4096, 32, 3072),
]


def add_lora(model: torch.nn.Module, rank: int = 16) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_qkv", "to_out", "proj_in",
                                                                                  "proj_out"]), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--shapes", default=None, help="comma-separated shape indices (default: all)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs CUDA")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.enable_cudnn_sdp(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    try:
        import diffusers

        diffusers_version = diffusers.__version__
    except ImportError:
        diffusers_version = None
    meta = {
        "suite": "synthetic",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers_version,
        "python": platform.python_version(),
        "git_commit": os.environ.get("MEMFIT_GIT_COMMIT"),
        "sdpa_backend": "flash (cuDNN SDPA disabled)",
        "regime": "frozen bf16 base + LoRA r16 (peft), batch 1, loss = mean(out^2), forward+backward",
        "steps": args.steps,
        "warmup": args.warmup,
        "pinned_bandwidth": pinned_bandwidth(),
    }
    print(json.dumps(meta, indent=1), flush=True)
    results = []
    for label, width, depth, tokens in shapes:
        model = build(dim=width, depth=depth)
        add_lora(model)
        batch = inputs(model, tokens=tokens, generator=torch.Generator().manual_seed(0))
        rows = []
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for mode in MODES:
                row = measure_mode(model, batch, SYNTHETIC.loss, mode, adapter=SYNTHETIC, warmup=args.warmup,
                                   steps=args.steps)
                print(f"[{label}] {mode.name}: {row.get('step_s', 'OOM')} s, "
                      f"peak {row.get('peak_allocated', 0) / 2**30:.2f} GiB", flush=True)
                rows.append(row)
        add_ratios(rows)
        results.append({"shape": label, "width": width, "depth": depth, "tokens": tokens, "rows": rows})
        del model, batch
        torch.cuda.empty_cache()
    payload = {**meta, "results": results}
    stamp = meta["date"][:10]
    (out / f"synthetic-{stamp}.json").write_text(json.dumps(payload, indent=1))
    (out / f"synthetic-{stamp}.md").write_text(render_markdown(payload))
    print(render_markdown(payload), flush=True)


if __name__ == "__main__":
    main()
