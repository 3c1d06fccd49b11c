"""``python -m memfit_benchmarks.render results/*.json``: markdown tables and PNG plots from results JSON.

For each JSON file, ``<stem>.md`` is written next to it (or under ``--out``): a synthetic or families file through
``report.render_markdown`` (every training config and shape, with the checks against the peers), an ``auto``
sweep target through ``auto_report.render_auto_markdown``; rows whose peak is at or above the ``none`` row's are
listed as ``BUG`` lines. One PNG per file: for a sweep, one panel per (config, shape) entry, peak allocated GiB
against step time, one labelled point per mode (peers in grey), OOM modes named in the panel's title; for an
``auto`` target, step time against budget for ``auto`` and for the fastest fixed mode that fits, the fixed modes
as labelled points at their peak.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memfit_benchmarks.auto_report import auto_unit, render_auto_markdown
from memfit_benchmarks.report import GIB, measured, render_markdown
from memfit_benchmarks.results import entries, load


@contextlib.contextmanager
def _figure(path: Path, panels: int = 1) -> Iterator[list[Any]]:
    """The axes of one figure (``panels`` of them, two columns); written to ``path`` when the block ends, and
    closed either way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 1 if panels == 1 else 2
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 5.5 * rows), squeeze=False)
    try:
        flat = list(axes.flat)
        for ax in flat[panels:]:
            ax.set_visible(False)
        yield flat[:panels]
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def _plot_rows(ax: Any, rows: list[dict[str, Any]], title: str) -> None:
    """Peak allocated memory vs step time, one labelled point per mode; OOM modes in the title."""
    ooms = [r["mode"] for r in rows if r.get("oom")]
    timed = [r for r in rows if measured(r)]
    no_peak = [r for r in timed if r.get("peak_allocated") is None]
    for r in timed:
        if r.get("peak_allocated") is None:
            continue
        x, y = r["step_s"] * 1e3, r["peak_allocated"] / GIB
        color = "tab:red" if r["mode"] == "none" else "tab:gray" if r.get("peer") else "tab:blue"
        ax.scatter([x], [y], s=30, color=color)
        ax.annotate(r["mode"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8, color=color)
    none = next((r for r in timed if r["mode"] == "none" and r.get("peak_allocated")), None)
    if none is not None:
        ax.axhline(none["peak_allocated"] / GIB, color="tab:red", linestyle=":", linewidth=0.8)
    if no_peak:
        ax.text(
            0.5,
            0.5,
            "peak memory not measured on this device:\n"
            + ", ".join(f"{r['mode']} {r['step_s'] * 1e3:.1f} ms" for r in no_peak),
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=8,
            wrap=True,
        )
    ax.set_xlabel("step time (ms, median of timed steps)")
    ax.set_ylabel("peak allocated (GiB)")
    ax.grid(True, alpha=0.3)
    ax.set_title(title + (f"\nOOM: {', '.join(ooms)}" if ooms else ""), fontsize=10)


def plot_entries(payload: dict[str, Any], path: Path) -> Path | None:
    """One panel per entry with rows (None when no entry has any)."""
    shown = [e for e in entries(payload) if e.get("rows")]
    if not shown:
        return None
    what = (
        "synthetic"
        if payload.get("suite") == "synthetic"
        else f"{payload.get('family')} ({payload.get('preset')})"
    )
    with _figure(path, len(shown)) as axes:
        for ax, entry in zip(axes, shown, strict=True):
            _plot_rows(
                ax, entry["rows"], f"{what} {entry.get('label')}, {entry.get('config')} — {payload['device']}"
            )
    return path


def plot_auto(payload: dict[str, Any], path: Path) -> Path:
    """Step time against memory budget: ``auto`` at each budget, the fastest fixed mode that fits it, and every
    fixed mode as a labelled point at its own peak (held bytes off CUDA)."""
    scale, unit = auto_unit(payload)
    rows = payload.get("auto_rows", [])
    with _figure(path) as (ax,):
        for r in payload.get("fixed_rows", []):
            memory = r.get("peak_allocated") if r.get("peak_allocated") is not None else r.get("held_bytes")
            if r.get("oom") or memory is None:
                continue
            x, y = memory / scale, r["step_s"] * 1e3
            ax.scatter([x], [y], s=22, color="tab:red" if r["mode"] == "none" else "tab:gray", zorder=2)
            ax.annotate(
                r["mode"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color="dimgray"
            )
        fixed = [r for r in rows if r.get("best_fixed")]
        ax.step(
            [r["budget_bytes"] / scale for r in fixed],
            [r["best_fixed"]["step_s"] * 1e3 for r in fixed],
            where="post",
            color="tab:blue",
            marker="s",
            label="fastest fixed mode that fits",
            zorder=3,
        )
        timed = [r for r in rows if "step_s" in r and not r.get("unreachable")]
        ax.plot(
            [r["budget_bytes"] / scale for r in timed],
            [r["step_s"] * 1e3 for r in timed],
            color="tab:green",
            marker="o",
            label="auto at the budget",
            zorder=4,
        )
        measured = [r for r in timed if r.get("memory_bytes") is not None]
        ax.scatter(
            [r["memory_bytes"] / scale for r in measured],
            [r["step_s"] * 1e3 for r in measured],
            s=30,
            facecolors="none",
            edgecolors="tab:green",
            label="auto at its measured peak",
            zorder=4,
        )
        for r in timed:
            if "speedup" in r:
                ax.annotate(
                    f"{r['speedup']:.2f}×",
                    (r["budget_bytes"] / scale, r["step_s"] * 1e3),
                    textcoords="offset points",
                    xytext=(0, -12),
                    fontsize=7,
                    ha="center",
                    color="tab:green",
                )
        for r in rows:
            if r.get("unreachable") or r.get("oom"):
                ax.axvline(r["budget_bytes"] / scale, color="tab:orange", linestyle=":", linewidth=0.8)
        if payload.get("high_bytes"):
            ax.axvline(payload["high_bytes"] / scale, color="tab:red", linestyle=":", linewidth=0.8)
        bad = [r for r in rows if r.get("unreachable") or r.get("oom")]
        ax.set_xlabel(f"memory budget / peak ({unit}{'' if unit == 'GiB' else ', held activation bytes'})")
        ax.set_ylabel("step time (ms, median of timed steps)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        title = f"auto vs fixed modes: {payload['target']} ({payload['preset']}) — {payload['device']}"
        if bad:
            title += "\nno auto step at: " + ", ".join(
                f"{r['budget_bytes'] / scale:.2f} ({'unreachable' if r.get('unreachable') else 'OOM'})"
                for r in bad
            )
        ax.set_title(title, fontsize=10)
    return path


def render_payload(payload: dict[str, Any], stem: str, out: Path) -> tuple[Path, list[Path]]:
    """Write ``<stem>.md`` and the PNG of one payload under ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    png = out / f"{stem}.png"
    if payload.get("suite") == "auto":
        text = render_auto_markdown(payload)
        pngs = [plot_auto(payload, png)] if payload.get("auto_rows") else []
    else:
        text = render_markdown(payload)
        pngs = [p for p in (plot_entries(payload, png),) if p is not None]
    if pngs:
        text += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n"
    md = out / f"{stem}.md"
    md.write_text(text)
    return md, pngs


def render_files(paths: list[Path | str], out: Path | str | None = None) -> list[Path]:
    """Render each results JSON; returns every file written."""
    written: list[Path] = []
    for path in map(Path, paths):
        payload = load(path)
        md, pngs = render_payload(payload, path.stem, Path(out) if out is not None else path.parent)
        written += [md, *pngs]
        print(f"rendered {path} -> {md}" + (f" + {len(pngs)} PNG" if pngs else ""), flush=True)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", help="results JSON files")
    parser.add_argument("--out", default=None, help="output folder (default: next to each JSON)")
    args = parser.parse_args(argv)
    return render_files(args.files, args.out)


if __name__ == "__main__":
    main()
