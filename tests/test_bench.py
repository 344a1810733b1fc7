"""The benchmark driver in its smoke mode: every row runs and lands in a well-formed table.

No timing is asserted (the numbers of a --quick run mean nothing); what is checked is that
each row produces numbers, the markdown table has the right shape, the report names the
machine, versions and date, and row 4's byte counts equal what each hook must send.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "bench" / "run.py"
NUMBER = re.compile(r"^\d+\.\d\d$")


def run_bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(RUN), *args], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout
    )


def table_rows(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in lines]


@pytest.mark.slow  # every row's smoke run: 2-5 minutes (rows 4 and 11, below, in make test-slow too)
@pytest.mark.timeout(540)
def test_quick_run_gives_every_row(tmp_path: Path) -> None:
    report, raw = tmp_path / "RESULTS.md", tmp_path / "results.json"
    proc = run_bench("--quick", "--no-others", "--out", str(report), "--json", str(raw), timeout=520)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    rows = table_rows(proc.stdout)
    assert rows[0] == ["#", "Measure", "hasten", "Accelerate", "Lightning Fabric", "Target", "Met"]
    assert all(cell == "---" for cell in rows[1])
    body = rows[2:]
    assert all(len(r) == 7 for r in body), body
    assert {r[0] for r in body} == {"1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "13", "14", "16", "18"}
    for r in body:
        if r[0] == "8":
            assert re.match(r"^\d+\.\d\d / \d+\.\d\d(; \d+\.\d\d / \d+\.\d\d)?$", r[2]), r
        elif r[0] == "13":  # async pause / save cost / verified load, one line per size (the saves alone: — / cost / —)
            assert re.match(r"^(\d+\.\d\d / \d+\.\d\d / \d+\.\d\d|— / \d+\.\d\d / —)$", r[2]), r
            assert re.match(r"^(—|yes|\*\*no\*\*) / (yes|\*\*no\*\*) / (—|yes|\*\*no\*\*)$", r[6]), r
            continue
        elif r[0] == "16":  # S3 save ÷ torch's fastest / verified load ÷ torch's fastest / async pause ÷ sync
            assert re.match(r"^\d+\.\d\d / \d+\.\d\d / \d+\.\d\d$", r[2]), r
            assert re.match(r"^(yes|\*\*no\*\*) / (yes|\*\*no\*\*) / (yes|\*\*no\*\*)$", r[6]), r
            continue
        elif r[0] == "18":  # sp 2 ÷ no sp at three lengths (saved; peak), sp step ÷ hand, checkpointing modes ÷ none
            assert re.match(r"^\d+\.\d\d( / \d+\.\d\d)*(; \d+\.\d\d( / \d+\.\d\d)*)?$", r[2]), r
            assert re.match(r"^((yes|\*\*no\*\*)( / (yes|\*\*no\*\*))*)?$", r[6]), r
            continue
        elif r[0] == "4":
            assert re.match(r"^\d+(\.\d+)? (MB|KB|B)/step, ÷\d+\.\d, loss \d+\.\d{4}$", r[2]), r
        else:
            assert NUMBER.match(r[2]), r
        assert r[6] in ("yes", "**no**", ""), r
    # three precisions (and fp16 scale read-backs) in row 1, two import figures, the six hooks and the fp16
    # wrapper in row 4
    assert sum(r[0] == "1" for r in body) == 4  # three precisions and the fp16 scale read-backs
    assert sum(r[0] == "2" for r in body) == 2
    assert sum(r[0] == "4" for r in body) == 7
    assert sum(r[0] == "10" for r in body) == 1  # the kill (the quick run freezes no node)
    assert sum(r[0] == "11" for r in body) == 2  # save and load
    assert (
        sum(r[0] == "13" for r in body) == 2
    )  # one line per size (two tiny ones in the quick run, the second saves alone)
    assert [r[2].startswith("— / ") for r in body if r[0] == "13"] == [False, True]
    assert sum(r[0] == "14" for r in body) == 2  # fp8 ÷ bf16, hasten fp8 ÷ the hand-written torchao loop
    assert sum(r[0] == "16" for r in body) == 1  # one line per size (one in the quick run)
    assert sum(r[0] == "18" for r in body) == 5  # sp memory saved and peak, sp step, checkpointing memory and step

    text = report.read_text(encoding="utf-8")
    assert text.startswith("# hasten benchmarks (quick smoke run")
    for field in ("- Date: ", "- Machine: ", "- Versions: torch ", "- Load average"):
        assert field in text
    assert table_rows(text) == rows  # the report holds the same table as the printout

    data = json.loads(raw.read_text(encoding="utf-8"))
    assert data["errors"] == {}
    assert sorted(data["results"], key=int) == [
        "1",
        "2",
        "3",
        "4",
        "5",
        "6",
        "7",
        "8",
        "9",
        "10",
        "11",
        "13",
        "14",
        "16",
        "18",
    ]
    long_context = data["results"]["18"]  # hasten's Ulysses saves and computes what the hand-written one does
    assert long_context["time"]["same_first_loss"] and long_context["ac"]["losses_agree"], long_context
    assert all(c["sp2_vs_hand"]["saved"] == pytest.approx(1.0, abs=0.01) for c in long_context["memory"]), long_context
    fp8 = data["results"]["14"]  # hasten's fp8 converts the layers torchao does by hand: the same losses
    assert fp8["finite"] and fp8["fp8_losses_agree"] and fp8["float8_layers"] == fp8["linear_layers"] - 2, fp8
    ddp = data["results"]["3"]["ddp"]
    assert ddp["raw"]["small_first_bucket"] and ddp["raw_again"] == ddp["raw"], ddp
    assert ddp["hasten"] == ddp["raw_cap25"], ddp  # the second baseline buckets as hasten's DDP does
    node_loss = data["results"]["10"]["kill"]
    assert node_loss["total"]["median"] > node_loss["to_restart"]["median"] > 0  # the parts of the recovery
    assert data["results"]["11"]["restored"] is True  # every timed load restored the saved values
    hooks = {h["label"]: h for h in data["results"]["4"]["hooks"]}
    # Counted from the profiler, the bytes are exactly what each hook must send (no timing involved).
    for h in hooks.values():
        assert h["bytes_per_step"] == h["expected_bytes_per_step"], h
    assert hooks["fp16"]["bytes_per_step"] * 2 == hooks["no"]["bytes_per_step"]
    assert hooks["bf16"]["bytes_per_step"] * 2 == hooks["no"]["bytes_per_step"]
    assert (
        hooks["power_sgd r=1"]["bytes_per_step"]
        < hooks["power_sgd r=2"]["bytes_per_step"]
        < hooks["fp16"]["bytes_per_step"]
    )
    assert hooks["power_sgd r=1 + fp16 wrapper"]["bytes_per_step"] * 2 == hooks["power_sgd r=1"]["bytes_per_step"]


@pytest.mark.timeout(300)
@pytest.mark.slow  # > 20 s: make test-slow
def test_quick_rows_with_exact_figures(tmp_path: Path) -> None:
    """The rows whose figures are exact, not timings: row 4's bytes per hook, row 11's restored loads."""
    raw = tmp_path / "results.json"
    proc = run_bench("--quick", "--no-others", "--rows", "4,11", "--json", str(raw), timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    body = table_rows(proc.stdout)[2:]
    assert [r[0] for r in body] == ["4"] * 7 + ["11"] * 2, body
    data = json.loads(raw.read_text(encoding="utf-8"))
    assert data["errors"] == {} and data["results"]["11"]["restored"] is True
    for h in data["results"]["4"]["hooks"]:
        assert h["bytes_per_step"] == h["expected_bytes_per_step"], h


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("lightning") is None,
    reason="Accelerate and Lightning (the `bench` extra) are not installed",
)
def test_quick_step_row_with_accelerate_and_fabric(tmp_path: Path) -> None:
    proc = run_bench("--quick", "--rows", "1", "--json", str(tmp_path / "r.json"), timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    step_rows = [r for r in table_rows(proc.stdout)[2:] if r[1].startswith("Step time")]  # not the "…" rows
    rows = {r[1].split(",")[1].split()[0]: r for r in step_rows}
    assert sorted(rows) == ["bf16", "fp16", "fp32"]
    for precision in ("fp32", "bf16"):
        assert NUMBER.match(rows[precision][3]) and NUMBER.match(rows[precision][4]), rows[precision]
    # On CPU neither runs fp16; the table says what each really ran instead of a ratio.
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))["results"]["1"]["precisions"]["fp16"]
    assert rows["fp16"][3] == f"n/a: runs {data['accelerate_runs']} (fp16 dropped on CPU silently)"
    assert rows["fp16"][4] == f"n/a: runs {data['fabric_runs']} (fp16 dropped on CPU with a warning)"
    assert data["accelerate_runs"] != "fp16" and data["fabric_runs"] != "fp16"


def test_unknown_row_is_refused() -> None:
    proc = run_bench("--rows", "1,99", timeout=60)
    assert proc.returncode == 2
    assert "--rows: unknown row(s) 99; rows are 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_nd_parallel_row(tmp_path: Path) -> None:
    """Row 12 (4-process launches, minutes on 2 cores: not in the quick run of all rows)."""
    raw = tmp_path / "r.json"
    proc = run_bench("--quick", "--rows", "12", "--json", str(raw), timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    body = [r for r in table_rows(proc.stdout)[2:] if r[0] == "12"]
    assert len(body) == 7, body  # memory and step time for each of three layouts, and the crossing bytes
    for r in body[:6]:
        assert re.match(r"^\d+\.\d\d( / \d+\.\d\d; \d+\.\d\d / \d+\.\d\d)?$", r[2]), r
    result = json.loads(raw.read_text(encoding="utf-8"))["results"]["12"]
    for layout, c in result["layouts"].items():
        assert c["same_first_loss"], (layout, c)  # hasten computes what the hand loop computes on that mesh
        assert c["data_ranks"]["hasten"] == c["data_ranks"]["hand"], (layout, c["data_ranks"])
        if "bytes_per_step" in c:  # the same collectives as the hand loop: none added (the root is not re-gathered)
            assert c["bytes_per_step"]["hasten"] == c["bytes_per_step"]["hand"], (layout, c["bytes_per_step"])
    # HSDP sends only the gradient all-reduce across machines: a fraction of FSDP 4's all-gathers and reduce-scatters
    assert 0 < result["crossing_hsdp_vs_fsdp4"] < 0.5, result["crossing_hsdp_vs_fsdp4"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_moe_ep_row(tmp_path: Path) -> None:
    """Row 17 (one 4-process launch: not in the quick run of all rows): the experts' weights per
    process at 1/ep, the step ratios, and the dispatch's bytes, the hand loop's at ep 4."""
    raw = tmp_path / "r.json"
    proc = run_bench("--quick", "--no-others", "--rows", "17", "--json", str(raw), timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    body = [r for r in table_rows(proc.stdout)[2:] if r[0] == "17"]
    assert len(body) == 4 and all(len(r) == 7 for r in body), body  # memory, step time (wall, CPU), bytes
    assert body[0][2] == "0.25 / 0.50" and body[0][6] == "yes / yes", body[0]
    assert NUMBER.match(body[1][2]) and NUMBER.match(body[2][2]), body[1:3]
    assert re.match(r"^\d+\.\d\d / \d+\.\d\d$", body[3][2]) and body[3][6] == "yes", body[3]
    result = json.loads(raw.read_text(encoding="utf-8"))["results"]["17"]
    sent = result["dispatch_bytes_per_step_rank0"]
    assert sent["hasten_ep4"] == sent["hand"] > 0, sent  # the same routing, the same exchange as the hand loop
    assert result["kernels"]["ep4_loop"] == ["cpu/float32: loop"], result["kernels"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("transformers") is None,
    reason="transformers and the real accelerate (the test extra) are not installed",
)
def test_quick_trainer_step_row(tmp_path: Path) -> None:
    """Row 19 (fresh transformers processes, minutes on 2 cores: not in the quick run of all rows): the
    Trainer's step on hasten ÷ on Accelerate, and the import with the installer ÷ without."""
    raw = tmp_path / "r.json"
    proc = run_bench("--quick", "--rows", "19", "--json", str(raw), timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    body = [r for r in table_rows(proc.stdout)[2:] if r[0] == "19"]
    assert len(body) == 2 and all(len(r) == 7 for r in body), body  # the step (1 process), the import
    assert all(NUMBER.match(r[2]) for r in body) and body[0][6] in ("yes", "**no**"), body
    result = json.loads(raw.read_text(encoding="utf-8"))["results"]["19"]
    assert result["procs"]["1"]["losses_equal"], result  # hasten trains the same numbers as Accelerate
    assert result["import"]["median"] > 0 and result["procs"]["1"]["steps_per_run"] == 3, result


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("transformers") is None,
    reason="transformers and the real accelerate (the test extra) are not installed",
)
def test_quick_big_model_offload_row(tmp_path: Path) -> None:
    """Row 20 (four fresh transformers processes: not in the quick run of all rows): generate with half the
    layers on disk ÷ all in memory, on hasten and on Accelerate; the same greedy tokens in all four runs."""
    raw = tmp_path / "r.json"
    proc = run_bench("--quick", "--rows", "20", "--json", str(raw), timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    body = [r for r in table_rows(proc.stdout)[2:] if r[0] == "20"]
    assert len(body) == 3 and all(len(r) == 7 for r in body), body  # time, the model's RSS, the whole RSS
    assert all(NUMBER.match(r[2]) and NUMBER.match(r[3]) for r in body), body
    result = json.loads(raw.read_text(encoding="utf-8"))["results"]["20"]
    assert result["same_tokens"], result
    for lib in ("hasten", "accelerate"):
        assert result["libraries"][lib]["disk"]["meta_layer_fraction"] == 0.5, result  # half the layers on meta
        assert result["libraries"][lib]["memory"]["meta_layer_fraction"] == 0.0, result
    assert "hasten" in result["libraries"]["hasten"]["accelerate"]  # accelerate was hasten in hasten's runs


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_fault_tolerance_row(tmp_path: Path) -> None:
    """Row 21 (a lighthouse, replica-group and elastic launches per round: not in the quick run of all rows):
    a killed replica group loses at most its step in flight on torchft, the elastic restart redoes the steps
    since its checkpoint, and both figures are made (their times are the benchmark's, not asserted)."""
    raw = tmp_path / "r.json"
    proc = run_bench("--quick", "--rows", "21", "--json", str(raw), timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    body = [r for r in table_rows(proc.stdout)[2:] if r[0] == "21"]
    assert len(body) == 2 and all(NUMBER.match(r[2]) for r in body), body
    result = json.loads(raw.read_text(encoding="utf-8"))["results"]["21"]
    assert result["ft"]["failed"]["median"] <= 2, result  # at most the step in flight is lost
    assert result["elastic"]["redone"]["median"] >= 1, result  # the restart redid the steps since its checkpoint
