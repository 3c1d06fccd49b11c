"""The user-facing configuration: the SPEC §1 keys, validated.

A trainer config (JSON/dict) can be pasted in unchanged; keyword arguments in
Python use the same names.  Validation is strict: a bad value names the key and
the allowed values, an unknown key is an error with a did-you-mean suggestion.
"""

from __future__ import annotations

import difflib
import enum
import json
import os
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
    offload_pin_memory_max_buckets: int = 12
    memory_budget: int | None = None  # bytes; the ``auto`` backend's budget (None: the card's free memory)
    stream_blocks: int | str | None = (
        None  # blocks (count) or frozen bytes (a size) whose weights stream from host
    )

    # -- construction ------------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, strict: bool = True) -> MemfitConfig:
        """Build a config from trainer-style keys (``gradient_checkpointing_backend`` …).

        Args:
            data: the keys of SPEC §1. Short names (``backend``) are accepted too.
            strict: when True (default) an unknown key is a :class:`ConfigError`; when False,
                keys that do not start with ``gradient_checkpointing`` are ignored (a full
                trainer config can be passed), but an unknown ``gradient_checkpointing_*`` key
                is still an error, since it is almost certainly a typo.

        Raises:
            ConfigError: a key is unknown or a value is invalid.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"memfit config must be a mapping of SPEC keys, got {type(data).__name__}")
        values: dict[str, Any] = {}
        known = {_long_name(f.name): f.name for f in fields(cls)}
        for raw_key, value in data.items():
            # SimpleTuner-style configs spell keys as command-line flags ("--gradient_checkpointing")
            key = raw_key[2:] if isinstance(raw_key, str) and raw_key.startswith("--") else raw_key
            attr = known.get(key) or (key if key in known.values() else None)
            if attr is None:
                if not strict and not str(key).startswith(_PREFIX):
                    continue
                raise ConfigError(_unknown_key_message(str(key), list(known)))
            values[attr] = value
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, strict: bool = True) -> MemfitConfig:
        """Read a JSON trainer config file (e.g. a SimpleTuner ``config.json``)."""
        with open(path, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(data, strict=strict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "enabled", _as_bool("gradient_checkpointing", self.enabled))
        object.__setattr__(self, "backend", _as_backend(self.backend))
        object.__setattr__(
            self, "interval", _as_int("gradient_checkpointing_interval", self.interval, minimum=1)
        )
        if self.segment_stride is not None:
            stride = _as_int("gradient_checkpointing_segment_stride", self.segment_stride, minimum=1)
            if stride < self.interval:
                raise ConfigError(
                    f"gradient_checkpointing_segment_stride={stride} is smaller than "
                    f"gradient_checkpointing_interval={self.interval}; the stride must be >= the interval "
                    f"(segments of {self.interval} checkpointed blocks start every `stride` blocks). "
                    f"Use a stride of at least {self.interval}, or leave it unset."
                )
            object.__setattr__(self, "segment_stride", stride)
        object.__setattr__(
            self,
            "offload_attention",
            _as_bool("gradient_checkpointing_offload_attention", self.offload_attention),
        )
        object.__setattr__(
            self,
            "offload_pin_memory_max_buckets",
            _as_int(
                "gradient_checkpointing_offload_pin_memory_max_buckets",
                self.offload_pin_memory_max_buckets,
                minimum=0,
            ),
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
        if self.memory_budget is not None:
            object.__setattr__(
                self, "memory_budget", _as_bytes("gradient_checkpointing_memory_budget", self.memory_budget)
            )
        object.__setattr__(self, "stream_blocks", _as_stream_blocks(self))

    # -- views -------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The trainer-style dict, ready to paste into a config file (an unset memory budget is left out)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("memory_budget", "stream_blocks") and value is None:
                continue
            if isinstance(value, Backend):
                value = value.value
            out[_long_name(f.name)] = value
        return out

    @property
    def stride(self) -> int:
        """Effective segment stride (the interval when no stride is set)."""
        return self.segment_stride if self.segment_stride is not None else self.interval

    @property
    def installs_anything(self) -> bool:
        return self.enabled or self.offload_attention


def _long_name(attr: str) -> str:
    return _PREFIX if attr == "enabled" else f"{_PREFIX}_{attr}"


def _unknown_key_message(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown memfit config key {key!r}.{hint} Known keys: {', '.join(sorted(known))}."


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{key} must be true or false, got {value!r}")


def _as_int(key: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        else:
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
    """Normalise whatever the user passed (config object, dict, JSON path, keywords) into a MemfitConfig."""
    if config is None:
        base: dict[str, Any] = {}
    elif isinstance(config, MemfitConfig):
        base = config.to_dict()
    elif isinstance(config, (str, os.PathLike)):
        base = MemfitConfig.from_file(config, strict=strict).to_dict()
    elif isinstance(config, Mapping):
        base = dict(config)
    else:
        raise ConfigError(
            f"config must be a dict of gradient_checkpointing_* keys, a MemfitConfig or a path to a JSON file; "
            f"got {type(config).__name__}"
        )
    base.update(overrides)
    return MemfitConfig.from_dict(base, strict=strict)


def _as_stream_blocks(cfg: MemfitConfig) -> int | str | None:
    """``gradient_checkpointing_stream_blocks``: a count of blocks (an integer >= 0) or a size (``"8GiB"``: stream
    blocks until at least that many frozen bytes stream); ``null`` is unset. Streaming needs checkpointing on (a
    streamed block is recomputed) and a fixed backend."""
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
    if not value:
        return value
    if not cfg.enabled:
        raise ConfigError(
            f"{key}={value!r} needs memfit's checkpointing on (a block whose weights stream is recomputed in "
            f"backward): set gradient_checkpointing: true, or unset {key}. (With it on, this means FSDP's "
            f"activation checkpointing is already on the model and turned memfit's off: remove FSDP's checkpoint "
            f"wrapper.)"
        )
    if cfg.backend is Backend.AUTO:
        raise ConfigError(
            f"{key} fixes how many blocks stream their weights; gradient_checkpointing_backend='auto' plans "
            f"every block itself. Remove {key}, or pick a fixed backend ('torch', 'unsloth', ...)."
        )
    return value
