"""Model sizes and dummy inputs for <Family> (random weights; nothing is downloaded).

Fill in the three functions. A worked example is ``adapters/chroma/src/memfit_chroma/presets.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# from diffusers import <ModelClass>

# Small widths, few blocks: the kit builds this model once per test class and runs ~150 steps with it.
TINY: dict[str, Any] = dict(
    # num_layers=3, num_attention_heads=4, attention_head_dim=8, ...
)
# The published configuration. Cite where the numbers come from, e.g.
# "<org>/<repo> transformer/config.json (revision / date)".
FULL: dict[str, Any] = dict(
    # num_layers=..., num_attention_heads=..., attention_head_dim=..., ...
)


def _build(config: dict[str, Any], dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    raise NotImplementedError("construct the model class from `config` (see memfit_chroma.presets._build)")
    # with torch.device(device):
    #     model = <ModelClass>(**config)
    # return model.to(dtype=dtype)


def build_tiny(
    *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
) -> nn.Module:
    torch.manual_seed(seed)
    return _build(TINY, dtype, device)


def build_full(
    *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda", seed: int = 0
) -> nn.Module:
    torch.manual_seed(seed)
    return _build(FULL, dtype, device)


def make_inputs(
    model: nn.Module, *, tokens: int | None = None, batch: int = 1, generator: torch.Generator | None = None
) -> dict[str, Any]:
    """Forward kwargs for one training step: ``tokens`` image tokens (round to a valid latent shape).

    Build every random tensor from ``generator`` on the CPU, then move it to the model's device and
    dtype, so that the same seed gives the same inputs everywhere. Pass what trainers pass (masks, ids,
    ``return_dict=False``), not only what the forward minimally needs: the kit checks the model as it is
    really called.
    """
    raise NotImplementedError("return the model's forward kwargs (see memfit_chroma.presets.make_inputs)")
