"""Byte sizes as users write them (``24GiB``) and as memfit prints them."""

from __future__ import annotations

_BYTE_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_bytes(text: str) -> int:
    """``"24GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1000000"`` -> bytes (ValueError if not a size)."""
    s = text.strip().lower().removesuffix("b").strip()
    for suffix in sorted(_BYTE_UNITS, key=len, reverse=True):
        if suffix and s.endswith(suffix):
            return int(float(s[: -len(suffix)].strip()) * _BYTE_UNITS[suffix])
    return int(float(s))


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
