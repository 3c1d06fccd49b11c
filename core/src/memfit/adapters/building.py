"""Helpers adapters use to declare presets: random-weight models and token grids.

Every adapter's presets build a model of a published configuration with random weights
(nothing is downloaded) the way ``from_pretrained(torch_dtype=...)`` would leave it:
parameters and floating buffers in ``dtype``, except the model's ``_keep_in_fp32_modules``
(diffusers' convention: norms, rotary tables, time embedders) which stay float32.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn


def _resolve(model_cls: str | type[nn.Module]) -> type[nn.Module]:
    """``"package.module:Class"`` -> the class (imported on first use: adapter discovery stays cheap)."""
    if not isinstance(model_cls, str):
        return model_cls
    module, _, name = model_cls.partition(":")
    return getattr(importlib.import_module(module), name)


def cast_like_from_pretrained(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters and buffers to ``dtype``, keeping ``_keep_in_fp32_modules`` in float32.

    (``ModelMixin.to(dtype)`` would cast those too — and diffusers warns about it.)
    """
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for slot in (module._parameters, module._buffers):
                for name, tensor in slot.items():
                    if tensor is None or not tensor.is_floating_point():
                        continue
                    parts = f"{module_name}.{name}".split(".")
                    target = torch.float32 if any(k in parts for k in keep) else dtype
                    if tensor.dtype == target:
                        continue
                    if isinstance(tensor, nn.Parameter):
                        tensor.data = tensor.data.to(target)
                    else:
                        slot[name] = tensor.to(target)
    return model


def build_model(
    model_cls: str | type[nn.Module],
    config: Mapping[str, Any],
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
) -> nn.Module:
    """A ``model_cls(**config)`` with random weights (seeded), built on ``device``, cast like from_pretrained."""
    cls = _resolve(model_cls)
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(**config)
    return cast_like_from_pretrained(model, dtype)


def preset_builders(
    model_cls: str | type[nn.Module],
    tiny: Mapping[str, Any],
    full: Mapping[str, Any],
    *,
    after_build: Callable[[nn.Module], None] | None = None,
) -> tuple[Callable[..., nn.Module], Callable[..., nn.Module]]:
    """``(build_tiny, build_full)``: tiny defaults to float32 on CPU (tests), full to bfloat16 on CUDA.

    Args:
        after_build: called on every freshly built model (e.g. to give zero-initialised pad tokens values).
    """

    def make(
        config: Mapping[str, Any], default_dtype: torch.dtype, default_device: str
    ) -> Callable[..., nn.Module]:
        def build(
            *, dtype: torch.dtype = default_dtype, device: str | torch.device = default_device, seed: int = 0
        ) -> nn.Module:
            model = build_model(model_cls, config, dtype=dtype, device=device, seed=seed)
            if after_build is not None:
                after_build(model)
            return model

        return build

    return make(tiny, torch.float32, "cpu"), make(full, torch.bfloat16, "cuda")


def near_square_grid(tokens: int) -> tuple[int, int]:
    """``(h, w)`` with ``h * w == tokens`` exactly, as square as possible (a prime gives ``1 x tokens``)."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    h = math.isqrt(tokens)
    while tokens % h:
        h -= 1
    return h, tokens // h


def packed_image_ids(h: int, w: int) -> torch.Tensor:
    """Rotary coordinates of an ``h x w`` packed-latent grid, one row ``(0, row, col)`` per token (float32,
    shape ``(h * w, 3)``): the image position ids Flux-style pipelines build."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)
