"""The command line: ``hasten profile-report DIR`` (``add_arguments``, ``run``, ``main``)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from hasten._validate import positive_int_argument
from hasten.report.chart import _import_matplotlib, write_chart
from hasten.report.merge import write_merged_trace
from hasten.report.summary import analyse
from hasten.report.tables import format_report
from hasten.report.traces import DEFAULT_MAX_TRACE_MB, TraceError, find_trace_files, load_traces

MERGED_NAME = "merged_trace.json"
PNG_NAME = "profile_report.png"
INSTALL_HINT = "pip install 'hasten[report]'  (or: pip install matplotlib)"
DESCRIPTION = (
    "Summarise the per-rank traces written by accelerator.profile(): top operators by self time with "
    "their spread across ranks, a per-step breakdown (forward / backward / optimizer / data), one merged "
    "trace for Perfetto or chrome://tracing, and a PNG chart."
)


def _number_argument(parse: Callable[[str], Any], what: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse ``type=``: the text parsed by ``parse`` and accepted by ``ok``, else "must be ``what``"."""

    def check(raw: str) -> Any:
        try:
            value = parse(raw)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {raw!r}")
        return value

    return check


_megabytes = _number_argument(float, "a number of MB > 0", lambda value: math.isfinite(value) and value > 0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="the output_trace_dir holding trace_rank<N>.json files")
    parser.add_argument(
        "--top", type=positive_int_argument(), default=10, help="how many operators to list (default: 10)"
    )
    parser.add_argument(
        "--merged", metavar="PATH", default=None, help=f"where to write the merged trace (default: DIR/{MERGED_NAME})"
    )
    parser.add_argument(
        "--png", metavar="PATH", default=None, help=f"where to write the chart (default: DIR/{PNG_NAME})"
    )
    parser.add_argument("--no-png", action="store_true", help="do not draw the chart")
    parser.add_argument(
        "--max-trace-mb",
        metavar="MB",
        type=_megabytes,
        default=DEFAULT_MAX_TRACE_MB,
        help=f"refuse a trace file larger than this many MB (default: {DEFAULT_MAX_TRACE_MB}); traces are read "
        "streaming, so memory stays bounded, but a larger file takes longer",
    )


class _Output:
    """An output file, created (so checked) before any work: written to a temporary file in its
    folder, which replaces the target only when complete."""

    def __init__(self, path: str, what: str) -> None:
        self.path = path
        if os.path.isdir(path):
            raise TraceError(f"cannot write the {what} to {path}: it is a folder; give a file path")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise TraceError(f"cannot write the {what} to {path}: the folder {folder} does not exist")
        try:
            fd, self.tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
        except OSError as e:
            raise TraceError(f"cannot write the {what} to {path}: {e.strerror or e} (in {folder})") from None
        os.close(fd)

    def commit(self) -> None:
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.remove(self.tmp)


def run(args: argparse.Namespace) -> int:
    """Print the report, write the merged trace and the chart; 0 on success, 2 on bad traces or outputs."""
    outputs: list[_Output] = []
    try:
        find_trace_files(args.dir)  # the input first: a missing folder is named as the input, not an output
        merged = _Output(args.merged or os.path.join(args.dir, MERGED_NAME), "merged trace")
        outputs.append(merged)
        png = None
        if not args.no_png and _import_matplotlib() is not None:
            png = _Output(args.png or os.path.join(args.dir, PNG_NAME), "chart")
            outputs.append(png)
        traces = load_traces(args.dir, args.max_trace_mb)
    except TraceError as e:
        for output in outputs:
            output.discard()
        print(f"hasten profile-report: error: {e}", file=sys.stderr)
        return 2
    try:
        summaries = analyse(traces)
        print(format_report(summaries, args.top), end="")

        with open(merged.tmp, "w", encoding="utf-8") as f:
            write_merged_trace(traces, f, args.max_trace_mb)
        merged.commit()
        print(f"\nmerged trace (one process row per rank): {merged.path}  (open it in https://ui.perfetto.dev)")

        if png is not None:
            steps = max((s.breakdown.steps for s in summaries if s.breakdown), default=0)
            title = f"hasten profile report: {len(traces)} rank{'s' if len(traces) != 1 else ''}" + (
                f", {steps} profiled steps" if steps else ""
            )
            with open(png.tmp, "wb") as f:
                write_chart(summaries, f, args.top, title)
            png.commit()
            print(f"chart: {png.path}")
        elif not args.no_png:
            print(f"chart: skipped, matplotlib is not installed; install it with: {INSTALL_HINT}")
    finally:
        for output in outputs:
            output.discard()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hasten profile-report", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
