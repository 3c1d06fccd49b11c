"""Helpers adapters use to declare presets: random-weight models and token grids.

Every adapter's presets build a model of a published configuration with random weights
(nothing is downloaded) the way ``from_pretrained(torch_dtype=...)`` would leave it:
parameters and floating buffers in ``dtype``, except the model's ``_keep_in_fp32_modules``
(diffusers' convention: norms, rotary tables, time embedders) which stay float32.

Weights are created directly in ``dtype`` on the target device (the model is constructed under
that default dtype, as ``from_pretrained`` does), so building needs the weights' own size and no
float32 intermediate: a 12B model in bfloat16 builds within 24 GiB.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
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


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Construct floating tensors in ``dtype`` inside the block (``torch.set_default_dtype``), restored after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    model_cls: str | type[nn.Module],
    config: Mapping[str, Any],
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
) -> nn.Module:
    """A ``model_cls(**config)`` with random weights (seeded), cast like ``from_pretrained``.

    The weights are allocated once, in ``dtype``, on ``device``: the peak while building is the size of the
    weights (plus the float32 copies of ``_keep_in_fp32_modules``, which are small), never a float32 model.

    Args:
        model_cls: the class, or ``"package.module:Class"`` (imported on first use).
        config: constructor keyword arguments; a diffusers-style class (with ``from_config``) also accepts a
            ``config.json`` mapping with its bookkeeping keys (``_class_name`` …).
        dtype: floating dtype of the weights (``torch.bfloat16`` for the published sizes).
        device: where the weights live.
        seed: seeds the random initialisation.

    Example:
        >>> build_model("diffusers:FluxTransformer2DModel", FULL, dtype=torch.bfloat16, device="cuda")
    """
    cls = _resolve(model_cls)
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        model = cls(**config) if not _is_config_file(config) else cls.from_config(dict(config))
    return cast_like_from_pretrained(model, dtype)


def _is_config_file(config: Mapping[str, Any]) -> bool:
    """A ``config.json`` as diffusers writes it carries ``_class_name``/``_diffusers_version``."""
    return any(str(k).startswith("_") for k in config)


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON file holding one object (ValueError naming the file and the problem otherwise)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return data


def read_model_config(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Path]:
    """The transformer ``config.json`` at ``path``: the file itself, a model folder holding one, or a
    pipeline folder with a ``transformer/`` subfolder. Returns the parsed mapping and the file read.

    Raises:
        FileNotFoundError: no config.json there (the message lists where it looked).
        ValueError: the file is not a JSON object.
    """
    root = Path(path)
    candidates = (
        [root]
        if root.is_file()
        else [root / "config.json", root / "transformer" / "config.json"]
        if root.is_dir()
        else []
    )
    for candidate in candidates:
        if candidate.is_file():
            return read_json_object(candidate), candidate
    looked = ", ".join(str(c) for c in candidates) or f"{root} (does not exist)"
    raise FileNotFoundError(f"no model config.json found; looked at {looked}")


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
