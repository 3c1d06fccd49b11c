"""Reading and writing results files. Pure Python (no torch): the headline reads them without a GPU.

A results file is one run of one sweep: ``suite`` (``synthetic`` or ``families``), the environment (date,
device, versions, commit, pinned bandwidth) and ``results``, a list of entries, each one training config on one
shape (synthetic) or one family: ``config``, ``config_description``, ``label``, ``tokens``, ``steps``,
``warmup``, ``rows`` (one per mode) and ``skipped`` (mode → why it did not run). :func:`entries` also reads the
older layout (one regime per file; a family's rows at the top level) into the same form.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The older layout's regimes as configs. A family's ``lora`` put LoRA on every linear of the declared blocks,
# which is ``lora-all``; the synthetic sweep's ``lora`` also covered the stack's in/out projections and left the
# modulation out, so it keeps its own name.
_LEGACY_FAMILY_CONFIGS = {"lora": "lora-all", "frozen": "frozen", "full": "full"}


def entries(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (config, shape or family) entry of a synthetic or families payload, in either layout."""
    if payload.get("suite") not in ("synthetic", "families"):
        return []
    if "configs" in payload:  # this layout
        return list(payload.get("results", []))
    regime = payload.get("regime", "lora")
    common = {
        "config_description": payload.get("regime_description", regime),
        "steps": payload.get("steps"),
        "warmup": payload.get("warmup"),
    }
    if payload["suite"] == "families":
        return [
            {
                **common,
                "config": _LEGACY_FAMILY_CONFIGS.get(regime, regime),
                "label": payload.get("preset_description") or payload.get("preset"),
                "tokens": payload.get("tokens"),
                "rows": payload.get("rows", []),
                "skipped": payload.get("skipped") or {},
                **({"error": payload["error"]} if payload.get("error") else {}),
            }
        ]
    return [
        {**common, "config": regime, "label": shape["shape"], "skipped": {}, **shape}
        for shape in payload.get("results", [])
    ]


def sweep_name(payload: dict[str, Any]) -> str:
    """``synthetic`` or ``family <name>``: what the headline groups by."""
    return "synthetic" if payload.get("suite") == "synthetic" else str(payload.get("family"))


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def load(path: Path | str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def results_files(root: Path) -> list[Path]:
    """Every results JSON under ``root`` (recursively), sorted."""
    return sorted(p for p in root.rglob("*.json") if p.is_file())


def write_results(
    out: Path, payload: dict[str, Any], render: Callable[[dict[str, Any]], str], *, stem: str | None = None
) -> Path:
    """``<stem>.json`` (default: ``<suite>.json``) and its ``.md`` under ``out`` (the markdown printed too); returns
    the JSON's path."""
    path = write_json(out / f"{stem or payload['suite']}.json", payload)
    markdown = render(payload)
    path.with_suffix(".md").write_text(markdown)
    print(markdown, flush=True)
    return path
