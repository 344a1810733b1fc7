"""The printed report: ``format_report`` and its tables."""

from __future__ import annotations

from hasten.report.summary import PHASE_NAMES, OpStats, RankSummary, top_names


def _ms(us: float) -> str:
    return f"{us / 1000:.2f}"


def _spread(values: list[float]) -> tuple[float, int]:
    """(max - min) / mean, and the index of the largest value."""
    mean = sum(values) / len(values)
    worst = max(range(len(values)), key=lambda i: values[i])
    return ((max(values) - min(values)) / mean if mean > 0 else 0.0), worst


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = [(str.ljust if i < left else str.rjust) for i in range(len(header))]
    return ["  ".join(fmt[i](c, widths[i]) for i, c in enumerate(r)).rstrip() for r in [header, *rows]]


def _cut(name: str, width: int = 48) -> str:
    """A display name: autograd's long prefix shortened, then cut to ``width`` characters."""
    if name.startswith(_AUTOGRAD_PREFIX):
        name = "autograd: " + name[len(_AUTOGRAD_PREFIX) :]
    return name if len(name) <= width else name[: width - 1] + "…"


_AUTOGRAD_PREFIX = "autograd::engine::evaluate_function: "


def _ops_table(
    summaries: list[RankSummary], per_rank: list[dict[str, OpStats]], n: int, what: str = "operator"
) -> list[str]:
    ranks = [s.rank for s in summaries]
    wide = len(ranks) <= 6
    header = [what, "calls"]
    header += [f"rank {r}" for r in ranks] if wide else ["min", "mean", "max"]
    if len(ranks) > 1:
        header += ["spread", "most"]
    rows = []
    for name in top_names(per_rank, n):
        values = [ops[name].self_us if name in ops else 0.0 for ops in per_rank]
        calls = max(ops[name].calls if name in ops else 0 for ops in per_rank)
        row = [_cut(name), str(calls)]
        row += (
            [_ms(x) for x in values] if wide else [_ms(min(values)), _ms(sum(values) / len(values)), _ms(max(values))]
        )
        if len(ranks) > 1:
            spread, worst = _spread(values)
            row += [f"{spread:.0%}", f"rank {ranks[worst]}"]
        rows.append(row)
    return _table(header, rows)


def format_report(summaries: list[RankSummary], top: int = 10) -> str:
    """The text report: step breakdown per rank, top operators with their spread across ranks."""
    out: list[str] = []
    ranks = [s.rank for s in summaries]
    out.append(f"hasten profile report: {len(ranks)} rank{'s' if len(ranks) != 1 else ''}")
    out.append("")

    breakdowns = [s.breakdown for s in summaries]
    if all(b is None for b in breakdowns):
        out.append("Per-step breakdown: no hasten labels in these traces (profile with accelerator.profile() to get")
        out.append("forward / backward / optimizer / data ranges).")
    else:
        known = [b for b in breakdowns if b is not None]
        how = (
            "ProfilerStep ranges"
            if all(b.from_profiler_steps for b in known)
            else "optimizer steps (no ProfilerStep ranges: call prof.step() or set step_with_optimizer=True)"
        )
        out.append(f"Per-step time breakdown (ms per step, mean over the profiled steps; steps from {how})")
        header = ["rank", "steps", "step", *PHASE_NAMES]
        rows = []
        for s in summaries:
            b = s.breakdown
            if b is None:
                rows.append([str(s.rank), "0", "-", *["-"] * len(PHASE_NAMES)])
                continue
            cells = [
                f"{_ms(b.phases_us[p])} ({b.phases_us[p] / b.step_us:.0%})" if b.step_us else "0" for p in PHASE_NAMES
            ]
            rows.append([str(s.rank), str(b.steps), _ms(b.step_us), *cells])
        out.extend(_table(header, rows, left=0))
        with_b = [s for s in summaries if s.breakdown is not None]
        if len(with_b) > 1:
            steps = [s.breakdown.step_us for s in with_b]  # type: ignore[union-attr]
            spread, worst = _spread(steps)
            fastest = min(range(len(steps)), key=lambda i: steps[i])
            out.append(
                f"slowest step: rank {with_b[worst].rank} ({_ms(steps[worst])} ms, "
                f"{spread:.0%} spread; fastest rank {with_b[fastest].rank} at {_ms(steps[fastest])} ms)"
            )
            gaps = []
            for p in PHASE_NAMES:
                vals = [s.breakdown.phases_us[p] for s in with_b]  # type: ignore[union-attr]
                hi = max(range(len(vals)), key=lambda i: vals[i])
                gaps.append((vals[hi] - min(vals), p, with_b[hi].rank))
            gap, phase, rank = max(gaps)
            if gap > 0:
                out.append(
                    f"largest gap between ranks: {phase}, rank {rank} spends {_ms(gap)} ms per step more than the "
                    "least busy rank (under DDP the faster ranks wait for the slowest inside backward)"
                )
    out.append("")

    host = [s.ops for s in summaries]
    if any(host):
        out.append(f"Top {top} operators by self CPU time (ms, summed over the profiled steps)")
        out.extend(_ops_table(summaries, host, top))
    else:
        out.append("No CPU operators recorded.")
    device = [s.device_ops for s in summaries]
    if any(device):
        out.append("")
        out.append(f"Top {top} device kernels by time (ms, summed over the profiled steps)")
        out.extend(_ops_table(summaries, device, top, "kernel"))
    user = [s.user_ranges for s in summaries]
    if any(user):
        out.append("")
        out.append("Your record_function ranges (ms, total)")
        out.extend(_ops_table(summaries, user, top, "range"))
    if len(ranks) > 1:
        out.append("")
        out.append("spread = (max - min) / mean across ranks; most = the rank that spent the most time there.")
        out.append("In a collective (c10d::*, gloo:*, nccl:*) the rank with the most time is usually the one")
        out.append("waiting for the others: the straggler is the rank that is late elsewhere.")
    return "\n".join(out) + "\n"
