"""How ``memfit fit`` shows a :class:`~memfit.fit.FitReport`: one line per rung, the ladder table, the plot."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from memfit.fit import FitReport, RungResult
from memfit.units import format_bytes


def step_text(r: RungResult) -> str:
    """``"612.3 ms ±2%"``: the median step and the spread of the timed steps."""
    m = r.measurement
    if m is None:
        return "-"
    half = m.step_spread * 50  # the spread is twice the median absolute deviation: ± is half of it, in %
    spread = f" ±{half:.0f}%" if half >= 1 else f" ±{half:.1f}%" if m.step_spread else ""
    return f"{m.step_seconds * 1e3:.1f} ms{spread}"


def rung_line(k: int, n: int, r: RungResult) -> str:
    """The line printed as each rung finishes (also when output is a file or a CI log)."""
    m = r.measurement
    if m is None:
        what = r.status
    else:
        parts = [f"held {format_bytes(m.held_bytes)}"]
        if m.peak_bytes is not None:
            parts.append(f"peak {format_bytes(m.peak_bytes)}")
        parts.append(step_text(r))
        what = f"{', '.join(parts)}: {r.status}"
    return f"rung {k}/{n} {escape(r.rung.name)}: {escape(what)}"


def crash_line(advice: str) -> str:
    return f"[bold red]Crashed rungs.[/] {escape(advice)}"


def ladder_table(report: FitReport, budget: int | None) -> Table:
    on_cuda = report.ranking == "step time"
    table = Table(
        title=f"decision ladder ({report.metric}; budget {format_bytes(budget) if budget else 'none'}; "
        f"attention: {report.sdpa})"
    )
    columns = ["rung", "peak allocated", "peak reserved", "held activations", "step", "× none", "status"]
    if not on_cuda:
        columns = ["rung", "held activations", "CPU step (does not rank)", "status"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("rung", "status") else "right", overflow="fold")
    for r in report.results:
        m = r.measurement
        held = format_bytes(m.held_bytes) if m is not None else "-"
        status = r.status_with("recommended") if r is report.recommended else r.status
        if on_cuda:
            table.add_row(
                escape(r.rung.name),
                format_bytes(m.peak_bytes) if m is not None else "-",
                format_bytes(m.peak_reserved_bytes) if m is not None else "-",
                held,
                step_text(r),
                f"{r.ratio_to_none:.2f}" if r.ratio_to_none else "-",
                escape(status),
            )
        else:
            table.add_row(escape(r.rung.name), held, step_text(r), escape(status))
    return table


def draw_plot(report: FitReport) -> tuple[Any, list[Any]]:
    """The memory/time figure and its point labels (placed so that no two overlap).

    Fitting rungs are green dots, rungs over the budget red crosses, the recommendation a star; the budget is a
    dashed line; rungs that failed (no measurement) are listed under the axes.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    measured = [r for r in report.results if r.measurement is not None]
    styles = {
        "fits": dict(color="tab:green", marker="o", label="fits the budget"),
        "over": dict(color="tab:red", marker="x", label="does not fit"),
    }
    seen: set[str] = set()
    labels = []
    for r in measured:
        assert r.measurement is not None
        x, y = r.measurement.step_seconds * 1e3, (r.budget_bytes_used or 0) / 2**20
        kind = "fits" if r.fits else "over"
        style = dict(styles[kind])
        if kind in seen:
            style.pop("label")
        seen.add(kind)
        ax.scatter([x], [y], s=36, zorder=3, **style)
        if r.measurement.step_spread:
            half = r.measurement.step_seconds * 1e3 * r.measurement.step_spread / 2
            ax.errorbar(
                [x], [y], xerr=[[half], [half]], color=style["color"], alpha=0.4, zorder=2, fmt="none"
            )
        labels.append(
            ax.annotate(
                r.rung.name,
                (x, y),
                xytext=(6, 4),
                textcoords="offset points",
                fontsize=8,
                arrowprops=dict(arrowstyle="-", color="0.6", lw=0.5),
            )
        )
    rec = report.recommended
    if rec is not None and rec.measurement is not None:
        ax.scatter(
            [rec.measurement.step_seconds * 1e3],
            [(rec.budget_bytes_used or 0) / 2**20],
            s=240,
            marker="*",
            color="gold",
            edgecolors="black",
            zorder=4,
            label=f"recommended: {rec.rung.name}",
        )
    if report.budget_bytes:
        ax.axhline(report.budget_bytes / 2**20, linestyle="--", color="gray", label="budget")
    failed = [r for r in report.results if r.measurement is None]
    if failed:
        text = "; ".join(f"{r.rung.name}: {r.status}" for r in failed)
        fig.text(0.01, 0.01, f"not measured: {text}", fontsize=7, wrap=True, va="bottom")
    ax.set_xlabel("step time (ms)" + ("" if report.ranking == "step time" else ", CPU: does not rank"))
    ax.set_ylabel(f"{report.metric} (MiB)")
    ax.set_title(f"memfit fit: memory vs step time (attention: {report.sdpa})", fontsize=9)
    ax.margins(x=0.25, y=0.15)  # room for the labels right of and below their points
    handles, names = ax.get_legend_handles_labels()
    order = ("fits", "does not", "recommended", "budget")  # the same order whichever rung came first
    ranked = sorted(
        zip(names, handles, strict=True), key=lambda nh: [nh[0].startswith(o) for o in order].index(True)
    )
    ax.legend([h for _, h in ranked], [n for n, _ in ranked], fontsize=8, loc="best")
    fig.tight_layout(rect=(0, 0.06 if failed else 0, 1, 1))
    _separate_labels(fig, labels)
    return fig, labels


def label_box(label: Any, renderer: Any) -> Any:
    """The window extent of an annotation's text alone (its own extent includes the leader line)."""
    from matplotlib.text import Text

    label.update_positions(renderer)
    return Text.get_window_extent(label, renderer)


def _separate_labels(fig: Any, labels: list[Any]) -> None:
    """Move labels down, one line at a time, until no two overlap (a leader line joins each to its point)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    points_per_pixel = 72 / fig.dpi
    for _ in range(len(labels) ** 2 + 1):  # each move clears one pair; a label passes each other once
        boxes = [label_box(t, renderer) for t in labels]
        moved = False
        for i in range(len(labels)):
            for j in range(i):
                if boxes[i].overlaps(boxes[j]):
                    dx, dy = labels[i].xyann
                    labels[i].xyann = (dx, dy - (boxes[i].height + 2) * points_per_pixel)
                    boxes[i] = label_box(labels[i], renderer)
                    moved = True
        if not moved:
            return


def write_plot(report: FitReport, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, _ = draw_plot(report)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
