"""The PNG chart (matplotlib, imported here only and only when the chart is drawn)."""

from __future__ import annotations

from typing import IO, Any

from hasten.report.summary import PHASE_NAMES, RankSummary, top_names
from hasten.report.tables import _cut

_COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "optimizer": "#55A868",
    "data": "#C44E52",
    "other": "#B8B8B8",
}


def _import_matplotlib() -> tuple[Any, Any] | None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure, FigureCanvasAgg


def write_chart(summaries: list[RankSummary], path: str | IO[bytes], top: int = 10, title: str = "") -> bool:
    """Write the PNG chart (to a path or a binary file); False (and nothing written) when matplotlib is not
    installed."""
    mpl = _import_matplotlib()
    if mpl is None:
        return False
    Figure, FigureCanvasAgg = mpl
    ranks = [s.rank for s in summaries]
    names = top_names([s.ops for s in summaries], min(top, 10))
    height = max(4.0, 0.42 * max(len(ranks), len(names)) + 1.8)
    fig = Figure(figsize=(13, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, width_ratios=[1, 1.15])

    # Step-time breakdown per rank: one stacked bar each, the step time written at its end.
    y = list(range(len(ranks)))
    start = [0.0] * len(ranks)
    steps_ms = [s.breakdown.step_us / 1000 if s.breakdown else 0.0 for s in summaries]
    longest = max(steps_ms, default=0.0)
    for phase in PHASE_NAMES:
        widths = [(s.breakdown.phases_us[phase] / 1000 if s.breakdown else 0.0) for s in summaries]
        bars = left.barh(y, widths, left=start, color=_COLORS[phase], label=phase, height=0.55)
        for bar, w in zip(bars, widths):
            if longest and w / longest > 0.09:
                left.text(
                    bar.get_x() + w / 2,
                    bar.get_y() + bar.get_height() / 2,
                    f"{w:.1f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                )
        start = [a + b for a, b in zip(start, widths)]
    for i, total in enumerate(steps_ms):
        left.text(total, i, f" {total:.1f} ms", ha="left", va="center", fontsize=8)
    left.set_xlim(0, longest * 1.18 if longest else 1)
    left.set_ylim(len(ranks) - 0.4 if len(ranks) > 1 else 0.9, -0.6 if len(ranks) > 1 else -0.9)
    left.set_yticks(y, [f"rank {r}" for r in ranks])
    left.set_xlabel("ms per step (mean over the profiled steps)")
    has_breakdown = any(s.breakdown is not None for s in summaries)
    left.set_title("Step time by phase" if has_breakdown else "Step time by phase (no hasten labels found)")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=5, frameon=False, fontsize=8)
    left.grid(axis="x", alpha=0.3)

    # Top operators by self CPU time, one bar per rank.
    n = len(ranks)
    bar_h = 0.8 / n
    # Rank colours, distinct from the phase colours on the left.
    cmap = ["#2F4B7C", "#A05195", "#FFA600", "#665191", "#D45087", "#003F5C", "#FF7C43", "#7A7A7A"]
    for i, s in enumerate(summaries):
        ys = [j - 0.4 + bar_h * (i + 0.5) for j in range(len(names))]
        vals = [s.ops[k].self_us / 1000 if k in s.ops else 0.0 for k in names]
        right.barh(ys, vals, height=bar_h, color=cmap[i % len(cmap)], label=f"rank {s.rank}")
    right.set_yticks(list(range(len(names))), [_cut(k, 36) for k in names], fontsize=8)
    right.invert_yaxis()
    right.set_xlabel("self CPU time, ms (summed over the profiled steps)")
    right.set_title(f"Top {len(names)} operators by self CPU time")
    if n > 1:
        right.legend(loc="lower right", fontsize=8)
    right.grid(axis="x", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.savefig(path, format="png")
    return True
