"""A short training loop with Hugging Face accelerate and memfit on the tiny Flux (CPU is fine).

    uv run --all-packages python examples/accelerate_train.py --steps 4

memfit is applied to the transformer before ``accelerator.prepare``; accelerate's gradient accumulation
and autocast (bf16 where the hardware supports it) wrap the model's forward, and memfit replays the
autocast state in each recompute.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator

import memfit
import memfit_flux


def bf16_available() -> bool:
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--backend", default="torch-ffn")
    parser.add_argument("--mixed-precision", default="auto", choices=["auto", "bf16", "no"])
    args = parser.parse_args(argv)

    mixed = args.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if bf16_available() else "no"
    accelerator = Accelerator(mixed_precision=mixed, gradient_accumulation_steps=args.accumulation)

    preset = memfit_flux.ADAPTER.presets["tiny"]
    model = preset.build(seed=0)
    handle = memfit.apply(
        model,
        {
            "gradient_checkpointing": True,
            "gradient_checkpointing_backend": args.backend,
            "gradient_checkpointing_interval": 2,
        },
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)

    generator = torch.Generator().manual_seed(0)
    losses: list[float] = []
    for _ in range(args.steps * args.accumulation):
        with accelerator.accumulate(model):
            inputs = preset.inputs(accelerator.unwrap_model(model), tokens=16, generator=generator)
            target = torch.randn_like(inputs["hidden_states"])
            pred = model(**inputs)[0]
            loss = torch.nn.functional.mse_loss(pred.float(), target.float())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    accelerator.print(f"mixed_precision={mixed} steps={args.steps} losses={[round(x, 4) for x in losses]}")
    accelerator.print(f"memfit: {handle.stats()['recomputes']} regions recomputed")
    handle.remove()
    return losses


if __name__ == "__main__":
    main()
