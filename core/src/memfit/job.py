"""The training job ``memfit fit`` measures: which model, at which shape, training what.

A :class:`FitJob` is plain data (it crosses into the measuring child process); :func:`build_workload` turns
it into a model with random weights, forward inputs and a loss, built in the target dtype on the target
device. :func:`job_keys_from_trainer_config` reads the job's shape from a trainer's JSON config (SimpleTuner's
key names), next to the ``gradient_checkpointing*`` keys ``memfit.apply`` reads.
"""

from __future__ import annotations

import enum
import functools
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.adapters.discovery import available_adapters
from memfit.adapters.spec import FamilyAdapter, Preset
from memfit.errors import MemfitError


class Regime(enum.StrEnum):
    """What the step trains."""

    FROZEN = "frozen"  # frozen base, gradients into the inputs only (a stand-in for adapters)
    FULL = "full"  # every parameter trains
    LORA = "lora"  # PEFT LoRA on frozen base weights


class LoraTargets(enum.StrEnum):
    ATTENTION = "attn"  # every nn.Linear inside the family's declared attention regions
    ALL = "all"  # every nn.Linear inside the family's declared blocks


@dataclass(frozen=True)
class FitJob:
    """One training step to measure.

    Args:
        family: the adapter family (``memfit list``).
        preset: the adapter preset to build (ignored when ``model_path`` is set).
        model_path: a diffusers ``config.json``, model folder or pipeline folder: the model is built from that
            configuration with random weights (nothing is downloaded).
        tokens: image tokens per sample (None: the preset's default).
        batch: samples per step.
        regime: what trains (:class:`Regime`).
        lora_rank: LoRA rank (``Regime.LORA``).
        lora_targets: ``"attn"``, ``"all"`` or module names (matched like PEFT's ``target_modules``).
        dtype: weight dtype name (``"bfloat16"`` …).
        device: ``"cuda"``, ``"cuda:1"`` or ``"cpu"``.
        gpu_memory: cap the caching allocator of the measuring process at this many bytes
            (``torch.cuda.set_per_process_memory_fraction``): what a card of that size gives.
        seed: seeds weights and inputs.
    """

    family: str
    preset: str = "tiny"
    model_path: str | None = None
    tokens: int | None = None
    batch: int = 1
    regime: Regime = Regime.FROZEN
    lora_rank: int | None = None
    lora_targets: str | tuple[str, ...] = LoraTargets.ATTENTION.value
    dtype: str = "float32"
    device: str = "cpu"
    gpu_memory: int | None = None
    seed: int = 0


@dataclass
class Workload:
    """A built job: the model, one step's inputs and the loss, plus what the report says about them."""

    model: nn.Module
    inputs: dict[str, Any]
    loss: Callable[[Any], torch.Tensor]
    adapter: FamilyAdapter
    info: dict[str, Any] = field(default_factory=dict)
    # a fresh optimizer for one measurement, stepped inside each measured step (None: forward and backward only)
    optimizer: Callable[[], torch.optim.Optimizer] | None = None
    # where the model trains when its weights start on the host (each measurement places it there with
    # ``memfit.apply(..., device=)``); None: where its weights are
    device: torch.device | None = None

    @property
    def train_device(self) -> torch.device:
        """Where the steps run."""
        return self.device if self.device is not None else next(self.model.parameters()).device


# the share of what the process can hold above which the weights start on the host: a card they would (nearly)
# fill leaves no room for a step, and building the model on it would run out of memory first
HOST_START_SHARE = 0.9


def family_adapter(name: str) -> FamilyAdapter:
    """The installed adapter called ``name``, case-insensitively (``FLUX`` is ``flux``)."""
    adapters = available_adapters()
    for key, adapter in adapters.items():
        if key.casefold() == name.casefold():
            return adapter
    installed = ", ".join(sorted(adapters)) or "none"
    raise MemfitError(
        f"no memfit adapter for family {name!r} is installed (installed: {installed}). "
        f"Install it, e.g. `pip install memfit-{name.lower()}`."
    )


def preset_of(adapter: FamilyAdapter, name: str) -> Preset:
    try:
        return adapter.presets[name]
    except KeyError:
        raise MemfitError(
            f"family {adapter.name!r} has no preset {name!r}; available: {', '.join(adapter.presets)}"
        ) from None


def inputs_preset(adapter: FamilyAdapter, job: FitJob) -> Preset:
    """The preset whose ``inputs`` (and pixel grid) drive ``job``: a config-built model uses the full size's."""
    if job.model_path is None:
        return preset_of(adapter, job.preset)
    return adapter.presets.get("full") or next(iter(adapter.presets.values()))


def read_model_path(path: str) -> tuple[dict[str, Any], str]:
    """``--model PATH``: the diffusers transformer config there and the class it was written for
    (``_class_name``).

    Raises:
        MemfitError: no config there, not JSON, or no ``_class_name`` (the message names the path).
    """
    from memfit.adapters.building import read_model_config

    try:
        config, _ = read_model_config(path)
    except (FileNotFoundError, ValueError) as exc:
        raise MemfitError(f"--model {path}: {exc}") from None
    name = config.get("_class_name")
    if not isinstance(name, str):
        raise MemfitError(
            f"--model {path}: the config has no _class_name; memfit fit builds diffusers transformer configs "
            f"(the transformer/config.json of a diffusers model folder)"
        )
    return config, name


def adapter_for_class(class_name: str) -> FamilyAdapter:
    for adapter in available_adapters().values():
        if class_name in adapter.model_classes:
            return adapter
    served = ", ".join(sorted(c for a in available_adapters().values() for c in a.model_classes))
    raise MemfitError(
        f"no installed memfit adapter serves {class_name} (served: {served}); install its family's adapter"
    )


# -- building --------------------------------------------------------------------------------------------------


def build_workload(job: FitJob) -> Workload:
    """Build ``job``: the model (random weights, in the target dtype on the target device), LoRA if asked,
    the inputs (seeded) and the loss. On CUDA with ``gpu_memory`` the allocator is capped first.

    Raises:
        MemfitError: the job cannot be built as described (unknown LoRA target, no config, …).
        torch.OutOfMemoryError: the weights do not fit.
    """
    device = torch.device(job.device)
    dtype = getattr(torch, job.dtype)
    info: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        info.update(_prepare_cuda(device, job.gpu_memory))
    start = time.perf_counter()
    on_host = device.type == "cuda" and _weights_exceed(job, dtype, device)
    model, adapter = _build_model(job, dtype, torch.device("cpu") if on_host else device)
    info["build_seconds"] = time.perf_counter() - start
    preset = inputs_preset(adapter, job)
    if job.regime is Regime.LORA:
        assert job.lora_rank is not None
        targets = add_lora(model, adapter, rank=job.lora_rank, targets=job.lora_targets, dtype=dtype)
        info["lora_modules"] = len(targets)
    else:
        model.requires_grad_(job.regime is Regime.FULL)
    model.train()
    tokens = job.tokens or preset.default_tokens
    generator = torch.Generator().manual_seed(job.seed)
    inputs = preset.inputs(model, tokens=tokens, batch=job.batch, generator=generator)
    if on_host:
        inputs = _moved(inputs, device)
        info["weights_on_host"] = True
    if job.regime is Regime.FROZEN:
        _require_input_grad(inputs)
    params = list(model.parameters())
    info.update(
        tokens=tokens,
        weights_bytes=sum(p.numel() * p.element_size() for p in params),
        parameters=sum(p.numel() for p in params),
        trainable_parameters=sum(p.numel() for p in params if p.requires_grad),
    )
    optimizer = None
    if (
        job.regime is Regime.FULL
    ):  # its state is what a full fine-tune adds: every rung carries it, as training does
        info["optimizer"] = "AdamW"
        optimizer = functools.partial(_adamw, model)
    return Workload(model, inputs, adapter.loss, adapter, info, optimizer, device if on_host else None)


def _weights_exceed(job: FitJob, dtype: torch.dtype, device: torch.device) -> bool:
    """The job's weights (counted on a model built on the meta device) exceed :data:`HOST_START_SHARE` of what
    this process can hold on ``device``."""
    from memfit.auto.budget_planner import device_capacity

    capacity = device_capacity(device)
    try:
        shape_only, _ = _build_model(job, dtype, torch.device("meta"))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False  # a builder that needs real tensors: built on the device, as a card that holds it would
    weights = sum(p.numel() * p.element_size() for p in shape_only.parameters())
    return capacity is not None and weights > HOST_START_SHARE * capacity


def _moved(inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``inputs`` on ``device``, each tensor a leaf again (requiring gradients where it did)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(
        torch.Tensor, lambda x: x.detach().to(device).requires_grad_(x.requires_grad), inputs
    )


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    """torch's AdamW over the trainable weights (its defaults, as a trainer's; a tiny rate leaves them near)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-8)


def _prepare_cuda(device: torch.device, gpu_memory: int | None) -> dict[str, Any]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_device(index)
    free, total = torch.cuda.mem_get_info(index)
    out = {"device_name": torch.cuda.get_device_name(index), "total_bytes": total, "free_bytes": free}
    if gpu_memory is not None:
        if gpu_memory > total:
            raise MemfitError(
                f"--gpu-memory {gpu_memory / 2**30:.2f} GiB is more than this card has "
                f"({total / 2**30:.2f} GiB); give at most that"
            )
        torch.cuda.set_per_process_memory_fraction(gpu_memory / total, index)
        out["limit_bytes"] = gpu_memory
    return out


def _build_model(job: FitJob, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, FamilyAdapter]:
    from memfit.adapters.building import build_model

    if job.model_path is None:
        adapter = family_adapter(job.family)
        return preset_of(adapter, job.preset).build(dtype=dtype, device=device, seed=job.seed), adapter
    config, name = read_model_path(job.model_path)
    adapter = adapter_for_class(name)
    import diffusers

    cls = getattr(diffusers, name, None)
    if cls is None:
        raise MemfitError(f"--model {job.model_path}: diffusers {diffusers.__version__} has no class {name}")
    return build_model(cls, config, dtype=dtype, device=device, seed=job.seed), adapter


def _require_input_grad(inputs: dict[str, Any]) -> None:
    """Frozen regime: the latent input carries the gradient (what an adapter's gradient would flow through)."""
    for key in ("hidden_states", "x", "inputs_embeds"):
        value = inputs.get(key)
        tensors = value if isinstance(value, (list, tuple)) else [value]
        flat = [t for v in tensors for t in (v if isinstance(v, (list, tuple)) else [v])]
        found = [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if found:
            for t in found:
                t.requires_grad_(True)
            return
    raise MemfitError(
        "--regime frozen needs a floating latent input (hidden_states, x or inputs_embeds) to carry the "
        "gradient; use --regime full or --lora-rank"
    )


# -- LoRA ------------------------------------------------------------------------------------------------------


def lora_target_names(model: nn.Module, adapter: FamilyAdapter, targets: str | tuple[str, ...]) -> list[str]:
    """Qualified names of the modules LoRA wraps.

    ``"attn"``: every ``nn.Linear`` inside the family's declared attention regions (Flux: ``to_q``, ``to_k``,
    ``to_v``, ``to_out.0``, ``add_*_proj``, ``to_add_out``); ``"all"``: every ``nn.Linear`` inside the declared
    blocks; otherwise module names, each matching a module whose qualified name is it or ends with ``.name``
    (PEFT's ``target_modules`` rule).

    Raises:
        MemfitError: nothing matches, or one of the given names matches no module.
    """
    qualified = {id(m): n for n, m in model.named_modules()}
    if targets in (LoraTargets.ATTENTION.value, LoraTargets.ALL.value):
        regions: list[nn.Module] = []
        for _path, _index, block in adapter.iter_blocks(model):
            regions.extend(adapter.attention_modules(block) if targets == "attn" else [block])
        names = [qualified[id(m)] for region in regions for m in region.modules() if isinstance(m, nn.Linear)]
        if not names:
            what = "attention regions" if targets == "attn" else "blocks"
            raise MemfitError(
                f"family {adapter.name!r} declares no nn.Linear inside its {what}; give --lora-targets as module "
                f"names"
            )
        return list(dict.fromkeys(names))
    names = []
    all_names = list(qualified.values())
    for target in targets:
        matched = [n for n in all_names if n == target or n.endswith("." + target)]
        if not matched:
            linear = sorted(
                {
                    n.split(".", 2)[-1]
                    for n, m in model.named_modules()
                    if isinstance(m, nn.Linear) and "." in n
                }
            )
            raise MemfitError(
                f"LoRA target {target!r} matches no module of {type(model).__name__}; its linear layers are "
                f"named e.g. {', '.join(linear[:12])}"
            )
        names.extend(matched)
    return list(dict.fromkeys(names))


def add_lora(
    model: nn.Module,
    adapter: FamilyAdapter,
    *,
    rank: int,
    targets: str | tuple[str, ...],
    dtype: torch.dtype,
) -> list[str]:
    """Freeze ``model`` and inject PEFT LoRA (rank ``rank``, alpha ``rank``) into ``targets``; the LoRA weights
    are made ``dtype`` (what a bf16 LoRA run trains). Returns the wrapped modules' names."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise MemfitError("--lora-rank needs PEFT: `pip install peft`") from None
    names = lora_target_names(model, adapter, targets)
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=names), model)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
    return names


# -- a trainer's config file -------------------------------------------------------------------------------------

# SimpleTuner's `flux_lora_target` values whose module sets are the two memfit names (attention projections of
# every block; every linear of every block). The other values name hand-picked subsets: pass those as a list.
_SIMPLETUNER_FLUX_TARGETS = {"all": LoraTargets.ATTENTION.value, "all+ffs": LoraTargets.ALL.value}
_MIXED_PRECISION = {"bf16": "bfloat16", "fp16": "float16", "no": "float32", "fp32": "float32"}
MEGAPIXEL_SIDE = 1024  # SimpleTuner's `resolution_type: area`: 1.0 megapixel is a 1024x1024 image


def job_keys_from_trainer_config(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The job's shape from a trainer's JSON config, in ``memfit fit`` option names, plus notes on keys that
    were read but cannot be modelled.

    Read (SimpleTuner names; a leading ``--`` is allowed): ``model_family``, ``model_type`` (``lora`` | ``full``),
    ``pretrained_model_name_or_path`` / ``pretrained_transformer_model_name_or_path`` (a local folder only),
    ``resolution`` with ``resolution_type`` (``pixel``/``pixel_area``: a square of that side; ``area``:
    megapixels), ``num_frames``, ``train_batch_size``, ``lora_rank`` (diffusers scripts: ``rank``),
    ``lora_type``, ``flux_lora_target``, ``lora_target_modules`` / ``lora_layers`` (diffusers scripts: a comma
    list), ``mixed_precision``, ``base_model_precision``. Everything else is the trainer's business.

    Raises:
        MemfitError: a value memfit cannot measure as given (names the key and the fix).
    """
    d = {k[2:] if isinstance(k, str) and k.startswith("--") else k: v for k, v in data.items()}
    out: dict[str, Any] = {}
    notes: list[str] = []
    if "model_family" in d:
        out["family"] = str(d["model_family"])
    model_type = d.get("model_type")
    if model_type is not None:
        if model_type not in ("lora", "full"):
            raise MemfitError(f"model_type {model_type!r}: memfit fit measures 'lora' or 'full'")
        out["regime"] = model_type
    for key in ("pretrained_transformer_model_name_or_path", "pretrained_model_name_or_path"):
        path = d.get(key)
        if isinstance(path, str) and path:
            if os.path.exists(path):
                out["model"] = path
            else:
                notes.append(
                    f"{key} {path!r} is not a local folder (nothing is downloaded): measuring the preset"
                )
            break
    if d.get("resolution") is not None:
        out["resolution"] = _resolution_from_config(d["resolution"], d.get("resolution_type", "pixel_area"))
    if d.get("num_frames") is not None:
        out["frames"] = _positive_int("num_frames", d["num_frames"])
    if d.get("train_batch_size") is not None:
        out["batch"] = _positive_int("train_batch_size", d["train_batch_size"])
    for key in ("lora_rank", "rank"):
        if d.get(key) is not None:
            out["lora_rank"] = _positive_int(key, d[key])
            break
    lora_type = d.get("lora_type")
    if lora_type not in (None, "standard"):
        raise MemfitError(f"lora_type {lora_type!r}: memfit fit measures standard (PEFT) LoRA only")
    targets = _lora_targets_from_config(d)
    if targets is not None:
        out["lora_targets"] = targets
    precision = d.get("mixed_precision")
    if precision is not None:
        if precision not in _MIXED_PRECISION:
            raise MemfitError(f"mixed_precision {precision!r}: expected one of {', '.join(_MIXED_PRECISION)}")
        out["dtype"] = _MIXED_PRECISION[precision]
    base_precision = d.get("base_model_precision")
    if base_precision not in (None, "no_change"):
        notes.append(
            f"base_model_precision {base_precision!r}: memfit fit measures unquantized base weights; a "
            f"quantized base holds less"
        )
    return out, notes


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        raise MemfitError(f"{key} must be a positive integer, got {value!r}")
    if int(value) < 1:
        raise MemfitError(f"{key} must be a positive integer, got {value!r}")
    return int(value)


def _resolution_from_config(value: Any, kind: Any) -> tuple[int, int]:
    if isinstance(value, str) and "x" in value.lower():
        return parse_resolution(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise MemfitError(f"resolution must be a number or WIDTHxHEIGHT, got {value!r}") from None
    if number <= 0:
        raise MemfitError(f"resolution must be positive, got {value!r}")
    if kind == "area":
        side = round(math.sqrt(number) * MEGAPIXEL_SIDE)
    elif kind in ("pixel", "pixel_area"):
        side = round(number)
    else:
        raise MemfitError(f"resolution_type {kind!r}: expected pixel, pixel_area or area")
    return side, side


def _lora_targets_from_config(d: Mapping[str, Any]) -> str | tuple[str, ...] | None:
    for key in ("lora_target_modules", "lora_layers"):
        value = d.get(key)
        if value:
            names = value.split(",") if isinstance(value, str) else list(value)
            return tuple(n.strip() for n in names if str(n).strip())
    flux_target = d.get("flux_lora_target")
    if flux_target is None:
        return None
    if flux_target not in _SIMPLETUNER_FLUX_TARGETS:
        raise MemfitError(
            f"flux_lora_target {flux_target!r} is a hand-picked module set memfit fit does not model; give the "
            f"modules as lora_target_modules (or --lora-targets), or use 'all' (attention) / 'all+ffs'"
        )
    return _SIMPLETUNER_FLUX_TARGETS[flux_target]


def parse_resolution(text: str) -> tuple[int, int]:
    """``"1024x768"`` -> ``(1024, 768)`` (width, height)."""
    parts = text.lower().replace(" ", "").split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or min(int(p) for p in parts) < 1:
        raise MemfitError(f"resolution {text!r} is not WIDTHxHEIGHT in pixels, e.g. 1024x1024")
    return int(parts[0]), int(parts[1])


def read_trainer_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A trainer's JSON config as a mapping (errors name the file and the problem)."""
    from memfit.adapters.building import read_json_object

    if not Path(path).is_file():
        raise MemfitError(f"--config {path}: no such file")
    try:
        return read_json_object(path)
    except ValueError as exc:
        raise MemfitError(f"--config {exc}") from None
