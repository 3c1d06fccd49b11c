"""The user-facing configuration: the SPEC §1 keys, validated.

A trainer config (JSON/dict) can be pasted in unchanged; keyword arguments in
Python use the same names.  Validation is strict: a bad value names the key and
the allowed values, an unknown key is an error with a did-you-mean suggestion.

Rules a trainer config meets:

* ``null`` means "unset" (the default) for every optional key: interval, segment stride,
  memory budget, pinned buckets.
* A key spelled twice (``--gradient_checkpointing`` and ``gradient_checkpointing``, a short
  and a long name) with different values is an error.
* With ``gradient_checkpointing`` off, each key is still checked on its own (type and
  range), but not against the others: the keys that only shape checkpointing (stride
  below interval, a memory budget, ``auto`` with interval/stride) cannot clash.
* ``gradient_checkpointing_memory_budget`` is ``auto``'s budget: :func:`as_config` (what
  ``memfit.apply`` reads) refuses it with checkpointing on and a fixed backend, which cannot
  keep a budget. A :class:`MemfitConfig` may carry one (``memfit fit --config`` reads a
  trainer config's budget as its own).
* Integers are ASCII digits (``"3"``; not ``"٣"``, ``"²"`` or ``"--2"``).
* With ``strict=False`` foreign keys are ignored, except near misses of memfit's own
  (a different case, ``-`` for ``_``, or up to three edits): those are errors with a
  did-you-mean, since they are almost certainly typos.
"""

from __future__ import annotations

import difflib
import enum
import functools
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from memfit.errors import ConfigError
from memfit.units import parse_bytes


class Backend(enum.StrEnum):
    """What is dropped/offloaded, and at which scope."""

    TORCH = "torch"  # drop a whole block's activations, recompute in backward
    TORCH_FFN = "torch-ffn"  # only the FFN side of each block
    UNSLOTH = "unsloth"  # like torch, plus the block's saved inputs go to pinned CPU memory
    UNSLOTH_FFN = "unsloth-ffn"  # like torch-ffn, plus the FFN's saved inputs go to pinned CPU memory
    AUTO = "auto"  # a per-block plan under gradient_checkpointing_memory_budget (memfit.auto)

    @property
    def ffn_only(self) -> bool:
        return self in (Backend.TORCH_FFN, Backend.UNSLOTH_FFN)

    @property
    def offloads_inputs(self) -> bool:
        return self in (Backend.UNSLOTH, Backend.UNSLOTH_FFN)


_PREFIX = "gradient_checkpointing"
_DEFAULT_BUCKETS = 12
# optimizer-state bytes per trainable byte, by name (gradient_checkpointing_optimizer_state); AdamW keeps two
# tensors per weight (exp_avg, exp_avg_sq) in its dtype
OPTIMIZER_STATE = {"adamw": 2.0, "adamw8bit": 0.5, "sgd-momentum": 1.0, "none": 0.0}
# what the optimizer's step allocates for the length of the step, per trainable byte, by the same names (a number
# given instead of a name: none). torch's default AdamW on CUDA is foreach: sqrt(exp_avg_sq) for every weight at once
OPTIMIZER_STEP_TEMPORARIES = {"adamw": 1.0, "adamw8bit": 0.0, "sgd-momentum": 0.0, "none": 0.0}


@dataclass(frozen=True)
class MemfitConfig:
    """Validated memfit configuration.

    Attributes mirror the SPEC §1 keys without the ``gradient_checkpointing_`` prefix.
    """

    enabled: bool = False
    backend: Backend = Backend.TORCH
    interval: int = 1
    segment_stride: int | None = None
    offload_attention: bool = False
    offload_pin_memory_max_buckets: int = _DEFAULT_BUCKETS
    memory_budget: int | None = None  # bytes; the ``auto`` backend's budget (None: the card's free memory)
    stream_blocks: int | str | None = (
        None  # blocks (count) or frozen bytes (a size) whose weights stream from host
    )
    # ``auto``: optimizer-state bytes per trainable byte the trainer keeps (None: AdamW's 2)
    optimizer_state: float | str | None = None

    # -- construction ------------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, strict: bool = True) -> MemfitConfig:
        """Build a config from trainer-style keys (``gradient_checkpointing_backend`` …).

        Args:
            data: the keys of SPEC §1. Short names (``backend``) are accepted too.
            strict: when True (default) an unknown key is a :class:`ConfigError`; when False,
                keys that do not start with ``gradient_checkpointing`` are ignored (a full
                trainer config can be passed), but an unknown ``gradient_checkpointing_*`` key, or a
                near miss of one of memfit's keys (case, ``-``/``_``, up to three edits), is still an
                error, since it is almost certainly a typo.

        Raises:
            ConfigError: a key is unknown or spelled twice with different values, or a value is invalid.

        Example:
            >>> MemfitConfig.from_dict({"gradient_checkpointing": True, "gradient_checkpointing_interval": 2})
        """
        return cls(**_normalise(data, strict=strict))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, strict: bool = True) -> MemfitConfig:
        """Read a JSON trainer config file (e.g. a SimpleTuner ``config.json``).

        Raises:
            ConfigError: the file cannot be read (missing, a directory, not UTF-8) or is not valid JSON, naming
                the path; or as :meth:`from_dict`.
        """
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except FileNotFoundError:
            raise ConfigError(f"memfit config file {os.fspath(path)!r} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(
                f"memfit config path {os.fspath(path)!r} is a directory; give the JSON file (e.g. config.json)"
            ) from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"memfit config file {os.fspath(path)!r} is not UTF-8 text ({exc.reason})"
            ) from None
        except OSError as exc:
            raise ConfigError(
                f"memfit config file {os.fspath(path)!r} cannot be read: {exc.strerror}"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{os.fspath(path)}: not valid JSON ({exc})") from exc
        return cls.from_dict(data, strict=strict)

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        set_("enabled", _as_bool("gradient_checkpointing", self.enabled))
        set_("backend", _as_backend(self.backend))
        set_("interval", _as_int("gradient_checkpointing_interval", self.interval, minimum=1, unset=1))
        set_(
            "segment_stride",
            _as_int("gradient_checkpointing_segment_stride", self.segment_stride, minimum=1, unset=None),
        )
        set_(
            "offload_attention", _as_bool("gradient_checkpointing_offload_attention", self.offload_attention)
        )
        set_(
            "offload_pin_memory_max_buckets",
            _as_int(
                "gradient_checkpointing_offload_pin_memory_max_buckets",
                self.offload_pin_memory_max_buckets,
                minimum=0,
                unset=_DEFAULT_BUCKETS,
            ),
        )
        if self.memory_budget is not None:
            set_("memory_budget", _as_bytes("gradient_checkpointing_memory_budget", self.memory_budget))
        set_("stream_blocks", _as_stream_blocks(self))
        set_("optimizer_state", _as_optimizer_state(self.optimizer_state))
        if self.enabled:  # relations between keys only matter when checkpointing is on
            self._check_relations()

    def _check_relations(self) -> None:
        if self.segment_stride is not None and self.segment_stride < self.interval:
            raise ConfigError(
                f"gradient_checkpointing_segment_stride={self.segment_stride} is smaller than "
                f"gradient_checkpointing_interval={self.interval}; the stride must be >= the interval "
                f"(segments of {self.interval} checkpointed blocks start every `stride` blocks). "
                f"Use a stride of at least {self.interval}, or leave it unset."
            )
        if self.backend is Backend.AUTO:
            fixed = {
                "gradient_checkpointing_interval": self.interval != 1,
                "gradient_checkpointing_segment_stride": self.segment_stride is not None,
                "gradient_checkpointing_offload_attention": self.offload_attention,
            }
            clash = [k for k, set_ in fixed.items() if set_]
            if clash:
                raise ConfigError(
                    f"gradient_checkpointing_backend='auto' plans every block itself (recompute scope, input and "
                    f"attention offload); {', '.join(clash)} would fix what it chooses. Remove "
                    f"{'it' if len(clash) == 1 else 'them'}, or pick a fixed backend."
                )

    # -- views -------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The trainer-style dict, ready to paste into a config file (an unset memory budget is left out)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("memory_budget", "stream_blocks", "optimizer_state") and value is None:
                continue
            if isinstance(value, Backend):
                value = value.value
            out[_long_name(f.name)] = value
        return out

    @property
    def optimizer_state_per_byte(self) -> float:
        """Optimizer-state bytes per trainable byte ``auto`` plans for (AdamW's two tensors when unset)."""
        value = self._optimizer
        return OPTIMIZER_STATE[value] if isinstance(value, str) else float(value)

    @property
    def optimizer_step_temporaries_per_byte(self) -> float:
        """Bytes per trainable byte the optimizer's step allocates while it runs (foreach AdamW when unset: 1)."""
        value = self._optimizer
        return OPTIMIZER_STEP_TEMPORARIES[value] if isinstance(value, str) else 0.0

    @property
    def _optimizer(self) -> float | str:
        """``optimizer_state`` as given, a name or bytes per trainable byte (``"adamw"`` when unset)."""
        return "adamw" if self.optimizer_state is None else self.optimizer_state

    @property
    def stride(self) -> int:
        """Effective segment stride (the interval when no stride is set)."""
        return self.segment_stride if self.segment_stride is not None else self.interval

    @property
    def installs_anything(self) -> bool:
        return self.enabled or self.offload_attention


def _long_name(attr: str) -> str:
    return _PREFIX if attr == "enabled" else f"{_PREFIX}_{attr}"


def _normalise(data: Mapping[str, Any], *, strict: bool) -> dict[str, Any]:
    """Trainer-style keys -> field names; unknown keys, near misses and conflicting spellings are errors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"memfit config must be a mapping of SPEC keys, got {type(data).__name__}")
    known = {_long_name(f.name): f.name for f in fields(MemfitConfig)}
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for raw_key, value in data.items():
        # SimpleTuner-style configs spell keys as command-line flags ("--gradient_checkpointing")
        key = raw_key[2:] if isinstance(raw_key, str) and raw_key.startswith("--") else raw_key
        attr = known.get(key) or (key if key in known.values() else None)
        if attr is None:
            near = _near_miss(str(key), known)
            if not strict and near is None and not str(key).startswith(_PREFIX):
                continue
            raise ConfigError(_unknown_key_message(str(raw_key), list(known), near))
        if attr in values and values[attr] != value:
            raise ConfigError(
                f"memfit config sets {_long_name(attr)} twice, as {spelled[attr]!r}={values[attr]!r} and "
                f"{raw_key!r}={value!r}; keep one of them."
            )
        values[attr] = value
        spelled[attr] = str(raw_key)
    return values


def _unknown_key_message(key: str, known: list[str], near: str | None) -> str:
    close = near or next(iter(difflib.get_close_matches(key, known, n=1, cutoff=0.6)), None)
    hint = f" Did you mean {close!r}?" if close else ""
    return f"unknown memfit config key {key!r}.{hint} Known keys: {', '.join(sorted(known))}."


# A foreign key this close to one of ours (after case and -/_ folding) is a typo, not another tool's key.
_NEAR_MISS_EDITS = 3


def _near_miss(key: str, known: Mapping[str, str]) -> str | None:
    """The memfit key ``key`` almost spells (case, ``-``/``_``, a leading ``--``, up to three edits), if any."""
    folded = key.lstrip("-").lower().replace("-", "_")
    for candidate in known:
        if _within_edits(folded, candidate, _NEAR_MISS_EDITS):
            return candidate
    return None


def _within_edits(a: str, b: str, limit: int) -> bool:
    """Whether the Levenshtein distance of ``a`` and ``b`` is at most ``limit`` (stops early: a trainer config
    has a hundred foreign keys to compare)."""
    if abs(len(a) - len(b)) > limit:
        return False
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        if min(current) > limit:
            return False
        previous = current
    return previous[-1] <= limit


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{key} must be true or false, got {value!r}")


_ASCII_INT = re.compile(r"\s*[+-]?[0-9]+\s*")


def _as_int(key: str, value: Any, *, minimum: int, unset: int | None) -> int | None:
    """An integer >= ``minimum`` (an int, or a string of ASCII digits); ``None`` (JSON null) gives ``unset``."""
    if value is None:
        return unset
    if isinstance(value, str) and _ASCII_INT.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value}")
    return value


def _as_bytes(key: str, value: Any) -> int:
    if isinstance(value, str):
        try:
            value = parse_bytes(value)
        except ValueError:
            raise ConfigError(
                f"{key} must be a size such as 24GiB, 512MiB or a number of bytes, got {value!r}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"{key} must be a positive number of bytes (or a size such as 24GiB), got {value!r}"
        )
    return value


def _as_backend(value: Any) -> Backend:
    try:
        return Backend(value)
    except ValueError:
        allowed = ", ".join(b.value for b in Backend)
        close = difflib.get_close_matches(str(value), [b.value for b in Backend], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"gradient_checkpointing_backend={value!r} is not a known backend.{hint} Allowed: {allowed}."
        ) from None


def as_config(
    config: MemfitConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    /,
    *,
    strict: bool = True,
    **overrides: Any,
) -> MemfitConfig:
    """Normalise whatever the user passed (config object, dict, JSON path, keywords) into a MemfitConfig to install.

    Raises:
        ConfigError: as :meth:`MemfitConfig.from_dict`; or a memory budget with checkpointing on and a fixed backend.
    """
    if config is None:
        base: dict[str, Any] = {}
    elif isinstance(config, MemfitConfig):
        base = config.to_dict()
    elif isinstance(config, (str, os.PathLike)):
        base = MemfitConfig.from_file(config, strict=strict).to_dict()
    elif isinstance(config, Mapping):
        base = _normalise(config, strict=strict)
    else:
        raise ConfigError(
            f"config must be a dict of gradient_checkpointing_* keys, a MemfitConfig or a path to a JSON file; "
            f"got {type(config).__name__}"
        )
    values = _normalise(base, strict=True)
    values.update(_normalise(overrides, strict=strict))  # keyword arguments win over the config's keys
    cfg = MemfitConfig(**values)
    if cfg.enabled and cfg.backend is not Backend.AUTO and cfg.optimizer_state is not None:
        raise ConfigError(
            f"gradient_checkpointing_optimizer_state tells the 'auto' backend's budget how much optimizer state "
            f"the trainer keeps; the fixed backend {cfg.backend.value!r} plans no budget (it would be ignored). Set "
            f"gradient_checkpointing_backend to 'auto', or remove the key (or set it to null)."
        )
    if cfg.enabled and cfg.backend is not Backend.AUTO and cfg.memory_budget is not None:
        # A MemfitConfig may carry a budget with a fixed backend (`memfit fit --config` reads a trainer config's
        # budget as its own); installing one would silently not keep it.
        raise ConfigError(
            f"gradient_checkpointing_memory_budget is the budget the 'auto' backend plans against; the fixed "
            f"backend {cfg.backend.value!r} cannot keep it (it would be ignored). Set "
            f"gradient_checkpointing_backend to 'auto', or remove the budget (or set it to null)."
        )
    return cfg


def _as_optimizer_state(value: Any) -> float | str | None:
    """``gradient_checkpointing_optimizer_state``: optimizer-state bytes per trainable byte, a number >= 0 or a
    name of :data:`OPTIMIZER_STATE`; ``null`` is unset (AdamW)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in OPTIMIZER_STATE:
        return value.strip().lower()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf"):
        return float(value)
    names = ", ".join(f"{n!r} ({v:g})" for n, v in OPTIMIZER_STATE.items())
    raise ConfigError(
        f"gradient_checkpointing_optimizer_state must be the optimizer-state bytes the trainer keeps per trainable "
        f"byte (a number >= 0) or one of {names}, got {value!r}"
    )


def _as_stream_blocks(cfg: MemfitConfig) -> int | str | None:
    """``gradient_checkpointing_stream_blocks``: a count of blocks (an integer >= 0) or a size (``"8GiB"``: stream
    blocks until at least that many frozen bytes stream); ``null`` is unset. Streaming needs checkpointing on (a
    streamed block is recomputed); under ``auto`` only 0 is accepted (never stream: the planner chooses otherwise)."""
    key, value = f"{_PREFIX}_stream_blocks", cfg.stream_blocks
    if value is None:
        return None
    bad = ConfigError(
        f'{key} must be a number of blocks (an integer >= 0) or a positive size such as "8GiB", got {value!r}'
    )
    if isinstance(value, str):
        text = value.strip()
        if text.isascii() and text.isdigit():
            value = int(text)
        else:
            try:
                size = parse_bytes(text) if text.isascii() else 0
            except ValueError:
                size = 0
            if size <= 0:
                raise bad
            value = text
    elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad
    if not value or not cfg.enabled:  # relations between keys only matter when checkpointing is on
        return value
    if cfg.backend is Backend.AUTO:
        raise ConfigError(
            f"{key} fixes how many blocks stream their weights; gradient_checkpointing_backend='auto' plans "
            f"every block itself, weight streaming included. Remove {key} (or set it to 0 to keep every weight on "
            f"the device), or pick a fixed backend ('torch', 'unsloth', ...)."
        )
    return value
