"""hasten's benchmarks: one markdown table, hasten against raw PyTorch (and Accelerate / Fabric).

    python bench/run.py            # the full run (`make bench`), writes bench/RESULTS.md
    python bench/run.py --quick    # a smoke run: few steps, numbers meaningless, writes nothing

Each row runs as its own script (bench/scripts/), in a fresh process, or under
``python -m torch.distributed.run`` for the 2-process rows, and hands back JSON. Every figure
is a ratio taken within one run, the variants interleaved, the median over rounds (see
bench/scripts/_harness.py); the quartiles and the A/A controls are in the notes below the
table in RESULTS.md. This file only runs the scripts and formats what they return.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
SCRIPTS = BENCH / "scripts"
ROOT = BENCH.parent

# Per row: script, runs under torch.distributed.run, full arguments, quick arguments.
ROWS: dict[str, tuple[str, bool, list[str], list[str]]] = {
    "1": (
        "step_overhead.py",
        False,
        ["--rounds", "300", "--steps", "8"],
        ["--rounds", "3", "--steps", "3", "--samples", "96"],
    ),
    "2": (
        "import_time.py",
        False,
        ["--rounds", "8", "--rounds-others", "3"],
        ["--rounds", "1", "--rounds-others", "1"],
    ),
    "3": (
        "ddp_throughput.py",
        True,
        ["--rounds", "120", "--steps", "8"],
        ["--rounds", "2", "--steps", "2", "--samples", "256"],
    ),
    "4": (
        "comm_bytes.py",
        True,
        ["--steps", "100", "--measured", "3"],
        ["--steps", "6", "--measured", "2", "--samples", "512"],
    ),
    "5": (
        "launch_latency.py",
        False,
        ["--rounds", "8", "--rounds-others", "3"],
        ["--rounds", "1", "--rounds-others", "1"],
    ),
    "6": (
        "profiler_cost.py",
        False,
        ["--rounds", "500", "--steps", "8"],
        ["--rounds", "3", "--steps", "3", "--samples", "96"],
    ),
    "7": (
        "compile_speed.py",
        False,
        ["--rounds", "20", "--steps", "5", "--cold-rounds", "2"],
        ["--rounds", "2", "--steps", "2", "--cold-rounds", "1", "--backend", "aot_eager"],
    ),
    "8": (
        "fsdp_memory.py",
        False,
        ["--widths", "1024,2048", "--procs", "2,4", "--steps", "3"],
        ["--widths", "64", "--procs", "2", "--steps", "1"],
    ),
    "9": ("fsdp_step.py", True, ["--rounds", "8", "--steps", "3"], ["--rounds", "1", "--steps", "1", "--width", "64"]),
    "10": (
        "node_loss.py",
        False,
        ["--rounds", "5", "--freeze-rounds", "2", "--timeouts", "10,20"],
        ["--rounds", "1", "--freeze-rounds", "0"],
    ),
    "11": ("checkpoint_io.py", True, ["--rounds", "8"], ["--rounds", "2", "--width", "64"]),
    "12": (
        "nd_parallel.py",
        False,
        ["--rounds", "6"],
        ["--width", "64", "--blocks", "2", "--steps", "1", "--rounds", "1", "--block-steps", "1", "--count-steps", "1"],
    ),
    "13": (
        "checkpoint_async.py",
        True,
        ["--widths", "1024,2048,4608", "--rounds", "8", "--big-rounds", "2"],
        ["--widths", "64,128", "--rounds", "1", "--big-rounds", "1", "--saves-only", "128"],
    ),
    "14": (
        "fp8_step.py",
        False,
        ["--rounds", "10", "--steps", "3"],
        ["--rounds", "1", "--steps", "1", "--width", "64", "--seq", "16"],
    ),
    "15": ("pipeline_step.py", False, [], ["--quick"]),  # it starts its own 4-process launches
    "16": (
        "checkpoint_s3.py",
        True,
        ["--widths", "336,672", "--rounds", "4", "--profile"],
        ["--widths", "128", "--rounds", "1", "--profile"],
    ),
    "17": ("moe_ep.py", False, ["--rounds", "16"], ["--quick"]),  # it starts its own 4-process launch
    "18": ("long_context.py", True, [], ["--quick"]),
    "19": (
        "trainer_step.py",
        False,
        ["--rounds", "6", "--procs", "1,2", "--import-rounds", "6"],
        ["--rounds", "1", "--steps", "3", "--warmup", "2", "--import-rounds", "1"],
    ),  # each run a fresh process (one per library), its own 2-process launches
    "20": ("big_model_offload.py", False, ["--rounds", "6"], ["--quick"]),  # a fresh process per run
    # its own lighthouse and replica-group launches (FT), and elastic launches, per round
    "21": (
        "ft_bench.py",
        False,
        ["--kill-rounds", "3", "--rounds", "5"],
        ["--kill-rounds", "1", "--rounds", "1", "--timed-steps", "20"],
    ),
}
TITLES = {
    "1": "step overhead",
    "2": "import",
    "3": "DDP throughput",
    "4": "gradient communication per hook",
    "5": "launch latency",
    "6": "profiler cost",
    "7": "torch.compile (inductor)",
    "8": "FSDP2 memory per process",
    "9": "FSDP2 step time",
    "10": "node loss to training again",
    "11": "checkpoint save and load, DCP vs full",
    "12": "N-D parallelism (FSDP 4, HSDP 2 × 2, TP 2 × FSDP 2)",
    "13": "checkpoints as the state grows: async pause, save cost, verified load",
    "14": "fp8 training step (torchao)",
    "15": "pipeline parallelism (4 stages): step time, bubble, memory",
    "16": "checkpoints on an S3 server (moto, local) ÷ torch's own ways to the same server",
    "17": "expert parallelism (MoE, 4 processes): expert memory, step time, dispatch bytes",
    "18": "long context (2 processes): Ulysses sequence parallelism, selective activation checkpointing",
    "19": "transformers' Trainer on hasten (install_as_accelerate) ÷ on Accelerate: step time, import",
    "20": "generate with half the layers on disk ÷ all in memory (install_as_accelerate, beside Accelerate)",
    "21": "a replica group killed: torchft (FaultToleranceKwargs) ÷ an elastic restart from a checkpoint",
}
NA = "—"
# Full-run time limits (seconds) of the rows that compile with inductor, train or checkpoint a ~50M
# model, or start two launches per round.
SLOW_ROWS = {
    **{"7": 1500, "8": 1200, "9": 1200, "10": 1200, "11": 1200, "12": 2400},
    **{"13": 3000, "14": 900, "15": 900, "16": 2400, "17": 900, "18": 900, "19": 3600, "20": 1800, "21": 1800},
}
# Rows whose quick run starts 4-process launches, or several fresh transformers processes (minutes on 2
# cores): left out of a quick run of all rows unless named in --rows.
QUICK_OPTIONAL = ("12", "15", "17", "19", "20", "21")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    """This environment without launcher or library settings that would change a row."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC")
    return {k: v for k, v in os.environ.items() if not k.startswith(("HASTEN_", "ACCELERATE_", *drop))}


_CAUSE = re.compile(r"Traceback|Error|terminate called|what\(\)|Fatal Python|Abort|Segmentation|Killed")


def why(proc: subprocess.CompletedProcess) -> str:
    """What a failed row printed that says why: the lines naming a cause (a worker's traceback,
    a C++ exception's ``what()``, a fatal signal; torchrun's summary names only the signal), then
    the last 15 lines."""
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    causes = [line for line in lines[:-15] if _CAUSE.search(line)][:20]
    return "\n".join([*causes, *(["..."] if causes else []), *lines[-15:]])


def run_row(row: str, quick: bool, others: bool, timeout: float) -> dict:
    script, distributed, full, small = ROWS[row]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        args = [*(small if quick else full), "--out", out, *([] if others else ["--no-others"])]
        if distributed:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(free_port()),
                # through hasten's worker (as `hasten launch` runs a script): it ends the process in
                # order, where the interpreter's own teardown can race gloo's threads (SIGABRT at exit)
                "-m",
                "hasten.cli._child",
                str(SCRIPTS / script),
                *args,
            ]
        else:
            cmd = [sys.executable, str(SCRIPTS / script), *args]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout)
        took = time.perf_counter() - start
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"row {row} ({script}) failed with exit status {proc.returncode}:\n" + why(proc))
        with open(out, encoding="utf-8") as fp:
            result = json.load(fp)
    result["seconds"] = round(took, 1)
    return result


# ---------------------------------------------------------------------- formatting


def r2(s: dict | None) -> str:
    return NA if s is None else f"{s['median']:.2f}"


def met(value: float, op: str, target: float) -> str:
    ok = value <= target if op == "<=" else value >= target
    return "yes" if ok else "**no**"


def size(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


Line = tuple[str, str, str, str, str, str, str]


def lines_step(r: dict) -> list[Line]:
    out: list[Line] = []
    what = {
        "fp32": "fp32",
        "bf16": "bf16 (raw: `torch.autocast` by hand)",
        "fp16": 'fp16 (raw: autocast + `GradScaler("cpu")` by hand)',
    }
    for precision, e in r["precisions"].items():
        cells = []
        for lib in ("accelerate", "fabric"):
            runs = e.get(f"{lib}_runs")
            if lib not in e:
                cells.append(NA)
            elif runs != precision:
                how = "silently" if lib == "accelerate" else "with a warning"
                cells.append(f"n/a: runs {runs} ({precision} dropped on CPU {how})")
            else:
                cells.append(r2(e[lib]))
        h = e["hasten"]["median"]
        out.append(
            (
                "1",
                f"Step time ÷ raw loop, {what.get(precision, precision)}",
                r2(e["hasten"]),
                *cells,
                "≤ 1.05",
                met(h, "<=", 1.05),
            )
        )
        if "scale_reads_per_step" in e:  # each a device sync on a GPU; hasten used to make 2 per step
            reads = e["scale_reads_per_step"]
            out.append(
                (
                    "1",
                    "… fp16: `GradScaler.get_scale()` read-backs per optimizer step (a GPU sync each; was 2)",
                    f"{reads:.2f}",
                    NA,
                    NA,
                    "0",
                    met(reads, "<=", 0),
                )
            )
    return out


def lines_import(r: dict) -> list[Line]:
    def total(name: str) -> str:  # torch + the library's own imports, timed in one process
        return f"{1 + r[name]['own_share']:.2f}"

    acc = f"{total('accelerate')} (`from accelerate import Accelerator`)" if "accelerate" in r else NA
    fab = f"{total('fabric')} (`from lightning.fabric import Fabric`)" if "fabric" in r else NA
    h, ha = r["hasten"]["median"], 1 + r["hasten_accelerator"]["own_share"]
    return [
        (
            "2",
            "`import hasten` ÷ `import torch` (CPU time; lazy: loads no torch)",
            r2(r["hasten"]),
            NA,
            NA,
            "≤ 1.03",
            met(h, "<=", 1.03),
        ),
        (
            "2",
            "`from hasten import Accelerator` ÷ `import torch`, the honest one (in one process: torch, then the "
            "library on top)",
            total("hasten_accelerator"),
            acc,
            fab,
            "≤ 1.03",
            met(ha, "<=", 1.03),
        ),
    ]


def lines_ddp(r: dict) -> list[Line]:
    h, same = r["hasten"]["median"], r["hasten_vs_raw_cap25"]["median"]
    return [
        (
            "3",
            "DDP throughput ÷ raw DDP loop with DDP's defaults (2 processes, gloo, samples/s; raw ≈ "
            f"{r['raw_samples_per_s']:.0f}/s)",
            r2(r["hasten"]),
            r2(r.get("accelerate")),
            r2(r.get("fabric")),
            "≥ 0.97",
            met(h, ">=", 0.97),
        ),
        (
            "3",
            "… ÷ raw DDP loop with `bucket_cap_mb=25`, the buckets hasten's DDP gets (no small first bucket)",
            r2(r["hasten_vs_raw_cap25"]),
            NA,
            NA,
            "≥ 0.97",
            met(same, ">=", 0.97),
        ),
    ]


def lines_comm(r: dict) -> list[Line]:
    out: list[Line] = []
    for h in r["hooks"]:
        ok = abs(h["bytes_per_step"] - h["expected_bytes_per_step"]) <= 0.01 * h["expected_bytes_per_step"]
        cell = f"{size(h['bytes_per_step'])}/step, ÷{h['cut']:.1f}, loss {h['final_loss']:.4f}"
        target = f"{size(h['expected_bytes_per_step'])}, ÷{h['expected_cut']:.1f}"
        out.append(
            (
                "4",
                f"comm hook `{h['label']}`: bytes all-reduced, cut vs `no`, loss after {r['steps']} steps",
                cell,
                NA,
                NA,
                target,
                "yes" if ok else "**no**",
            )
        )
    return out


def lines_launch(r: dict) -> list[Line]:
    h = r["hasten"]["median"]
    acc = f"{r2(r['accelerate'])} (`accelerate launch --multi_gpu`)" if "accelerate" in r else NA
    fab = f"{r2(r['fabric'])} (`fabric run`)" if "fabric" in r else NA
    return [
        (
            "5",
            "`hasten launch --num_processes 2 noop.py` ÷ `torchrun --nproc_per_node 2 noop.py` (torchrun ≈ "
            f"{r['torchrun_s']:.1f} s)",
            r2(r["hasten"]),
            acc,
            fab,
            "≤ 1.05",
            met(h, "<=", 1.05),
        )
    ]


def lines_profile(r: dict) -> list[Line]:
    h = r["profiled"]["median"]
    return [
        (
            "6",
            "loop in `accelerator.profile()`, `wait` steps ÷ no profiler",
            r2(r["profiled"]),
            NA,
            NA,
            "≤ 1.02",
            met(h, "<=", 1.02),
        ),
        (
            "6",
            "… for comparison, torch's own: bare `torch.profiler.profile` + `prof.step()`, same schedule ÷ no profiler",
            r2(r["torch_profiler"]),
            NA,
            NA,
            "",
            "",
        ),
        (
            "6",
            "… `accelerator.profile()` ÷ bare `torch.profiler.profile` (below 1: hasten skips the work torch does on "
            "idle steps)",
            r2(r["profiled_vs_torch_profiler"]),
            NA,
            NA,
            "",
            "",
        ),
    ]


def kernels(r: dict) -> str:
    """Row 7: what each cold child compiled (graphs, C++ kernels), where the script reported it."""
    c = r.get("cold_compiled")
    if not c or c.get("regional", {}).get("kernels") is None:
        return ""
    reg, whole = c["regional"], c["whole"]
    return f"; {reg['graphs']} ÷ {whole['graphs']} graph, {reg['kernels']} ÷ {whole['kernels']} `.so` built"


def lines_compile(r: dict) -> list[Line]:
    h, c = r["hasten_vs_raw"]["median"], r["regional_vs_whole_cold"]["median"]
    acc = r2(r["accelerate_vs_raw"]) if "accelerate_vs_raw" in r else NA
    cold = r["cold_s"]
    return [
        (
            "7",
            "compiled step (inductor, 8-block transformer) ÷ hand-written `torch.compile` loop",
            r2(r["hasten_vs_raw"]),
            acc,
            NA,
            "≤ 1.02",
            met(h, "<=", 1.02),
        ),
        ("7", "… compiled ÷ eager (hasten)", r2(r["compiled_vs_eager"]), NA, NA, "", ""),
        (
            "7",
            f"cold compile, regional ÷ whole model ({cold['regional']:.1f} s ÷ {cold['whole']:.1f} s{kernels(r)})",
            r2(r["regional_vs_whole_cold"]),
            NA,
            NA,
            "≤ 0.5",
            met(c, "<=", 0.5),
        ),
    ]


def lines_fsdp(r: dict) -> list[Line]:
    """Row 8: per process, hasten ÷ the hand-written fully_shard loop (goal <= 1.05), ÷ DDP, and the 1/N line."""
    out: list[Line] = []
    for g in r["grid"]:
        where = f"{g['params'] / 1e6:.0f}M parameters, {g['processes']} processes"
        h, vs = g["vs_hand"], g["vs_ddp"]
        worst = max(h.values())
        out.append(
            (
                "8",
                "memory per process ÷ hand-written `fully_shard` loop, live tensors after prepare / after "
                f"{r['steps']} AdamW steps; RSS after prepare / after steps ({where}; hasten "
                f"{mb(g['hasten']['live_steps'])} live after steps)",
                f"{h['live_prepare']:.2f} / {h['live_steps']:.2f}; {h['rss_prepare']:.2f} / {h['rss_steps']:.2f}",
                NA,
                NA,
                "≤ 1.05",
                met(worst, "<=", 1.05),
            )
        )
        if vs is not None:
            out.append(
                (
                    "8",
                    f"… hasten FSDP2 ÷ hasten DDP, live tensors / RSS after steps ({where})",
                    f"{vs['live_steps']:.2f} / {vs['rss_steps']:.2f}",
                    "n/a: FSDP falls back to DDP on CPU",
                    NA,
                    "",
                    "",
                )
            )
    for c in r["scaling"]:
        out.append(
            (
                "8",
                f"… memory per process at {c['to']} ÷ at {c['from']} processes, live tensors / RSS after steps "
                f"({c['params'] / 1e6:.0f}M; the hand-written loop: {c['hand']['live_steps']:.2f} / "
                f"{c['hand']['rss_steps']:.2f})",
                f"{c['hasten']['live_steps']:.2f} / {c['hasten']['rss_steps']:.2f}",
                NA,
                NA,
                f"≈ {c['from'] / c['to']:.2f}",
                "",
            )
        )
    return out


def mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


def lines_fsdp_step(r: dict) -> list[Line]:
    s = r["step_vs_hand"]["median"]
    return [
        (
            "9",
            f"FSDP2 step ÷ hand-written `fully_shard` loop, same wrapping ({r['params'] / 1e6:.0f}M parameters, "
            f"2 processes, hand step {r['hand_step_s'] * 1e3:.0f} ms); samples/s is the inverse",
            r2(r["step_vs_hand"]),
            NA,
            NA,
            "≤ 1.03",
            met(s, "<=", 1.03),
        )
    ]


def lines_node_loss(r: dict) -> list[Line]:
    c, k = r["config"], r["kill"]
    rdzv = dict(kv.split("=") for kv in c["rdzv_conf"].split(","))
    out: list[Line] = [
        (
            "10",
            "node lost (SIGKILL to one of 2 nodes' launcher, 1 process each, c10d): seconds to the first step at 1 "
            f"node (rendezvous heartbeats {rdzv['keep_alive_interval']} s × {rdzv['keep_alive_max_attempt']}, last "
            f"call {rdzv['last_call_timeout']} s, monitor {c['monitor_interval']} s: {k['to_restart']['median']:.1f} s "
            f"to the restarted worker, {k['startup']['median']:.1f} s its start and `load_state`)",
            f"{k['total']['median']:.2f}",
            NA,
            NA,
            "",
            "",
        )
    ]
    for timeout, f in r["freeze"].items():
        out.append((
            "10",
            f"… node frozen (SIGSTOP: no connection closes), detected by the process-group timeout of {timeout} s "
            f"(`InitProcessGroupKwargs(timeout=...)`): {f['to_restart']['median']:.1f} s to the restarted worker",
            f"{f['total']['median']:.2f}", NA, NA, "", "",
        ))  # fmt: skip
    return out


def lines_checkpoint(r: dict) -> list[Line]:
    s, b = r["times_s"], r["bytes"]
    what = f"{r['params'] / 1e6:.1f}M parameters + AdamW, FSDP2, {r['processes']} processes"
    return [
        (
            "11",
            "checkpoint save, DCP (`save_state`: each rank writes its shards) ÷ rank 0 writing the gathered full "
            f"state dict ({what}; {s['dcp_save']['median']:.1f} s ÷ {s['full_save']['median']:.1f} s, {size(b['dcp'])} "
            f"÷ {size(b['full'])})",
            r2(r["save_ratio"]),
            NA,
            NA,
            "",
            "",
        ),
        (
            "11",
            "checkpoint load, DCP (`load_state`, checksums verified) ÷ rank 0 reading the full state dict and "
            f"broadcasting it ({s['dcp_load']['median']:.1f} s ÷ {s['full_load']['median']:.1f} s; DCP with "
            f"`verify_checksums=False` {s['dcp_unverified_load']['median']:.1f} s)",
            r2(r["load_ratio"]),
            NA,
            NA,
            "",
            "",
        ),
    ]


ND_NAMES = {"fsdp4": "FSDP 4", "hsdp": "HSDP 2 × 2", "tp_fsdp": "TP 2 × FSDP 2"}


def lines_nd(r: dict) -> list[Line]:
    """Row 12: per layout, memory and step time ÷ the hand-written loop on the same mesh; bytes crossing machines."""
    out: list[Line] = []
    for layout, c in r["layouts"].items():
        m = c["memory_vs_hand"]
        where = f"{ND_NAMES[layout]}, {r['params'] / 1e6:.1f}M parameters, {r['processes']} processes"
        same = (
            "same first loss as the hand loop" if c["same_first_loss"] else "**first loss differs from the hand loop**"
        )
        out.append(
            (
                "12",
                f"memory per process ÷ hand-written loop on the same mesh, live tensors after prepare / after steps; "
                f"RSS after prepare / after steps ({where}; hasten {mb(c['hasten']['live_steps'])} live after steps)",
                f"{m['live_prepare']:.2f} / {m['live_steps']:.2f}; {m['rss_prepare']:.2f} / {m['rss_steps']:.2f}",
                NA,
                NA,
                "≤ 1.05",
                met(max(m.values()), "<=", 1.05),
            )
        )
        s = c["step_vs_hand"]["median"]
        out.append(
            (
                "12",
                f"… step time ÷ hand-written loop ({where}; hand step {c['hand_step_s'] * 1e3:.0f} ms; {same})",
                r2(c["step_vs_hand"]),
                NA,
                NA,
                "≤ 1.05",
                met(s, "<=", 1.05) if c["same_first_loss"] else "**no**",
            )
        )
    if "crossing_hsdp_vs_fsdp4" in r:
        b = {k: r["layouts"][k]["bytes_per_step"]["hasten"]["crossing"] for k in ("fsdp4", "hsdp")}
        x = r["crossing_hsdp_vs_fsdp4"]
        out.append(
            (
                "12",
                f"… bytes crossing the replicate dim (2 machines of 2 processes) per step, HSDP 2 × 2 ÷ FSDP 4 "
                f"({size(b['hsdp'])} ÷ {size(b['fsdp4'])}, FSDP2's collectives counted with their groups)",
                f"{x:.3f}",
                NA,
                NA,
                "< 1",
                met(x, "<=", 0.999),
            )
        )
    return out


def lines_checkpoint_async(r: dict) -> list[Line]:
    out: list[Line] = []
    for z in r["sizes"]:
        t = z["times_s"]
        big = z["params"] >= 1.5e8  # the goal for the pause is at 200M parameters and more
        what = (
            f"{z['params'] / 1e6:.{0 if z['params'] >= 1e7 else 1}f}M parameters + AdamW ({size(z['state_bytes'])} of "
            f"state), FSDP2, {r['processes']} processes: "
        )
        save_cost = (
            f"synchronous `save_state` ÷ each process `torch.save`-ing its shards ({t['sync']['median']:.2f} s ÷ "
            f"{t['torch_save']['median']:.2f} s; A/A, `torch.save` ÷ `torch.save` in the same round: "
            f"{z['torch_save_a_a']['median']:.2f})"
        )
        if z.get("saves_only"):
            ratio = z["sync_over_torch_save"]["median"]
            out.append(
                (
                    "13",
                    f"{what}loop blocked by an async save: not run / {save_cost} / verified load: not run "
                    f"({z['saves_only']})",
                    f"— / {ratio:.2f} / —",
                    NA,
                    NA,
                    "— / ≤ 1.10 / —",
                    f"— / {met(ratio, '<=', 1.10)} / —",
                )
            )
            continue
        ratios = (
            z["async_over_sync"]["median"],
            z["sync_over_torch_save"]["median"],
            z["verified_over_unverified"]["median"],
        )
        out.append((
            "13",
            f"{what}loop blocked by `save_state(async_save=True)` and the next `optimizer.step()`'s wait for its copy "
            f"÷ by a synchronous `save_state` ({t['async_blocked']['median']:.2f} s ÷ {t['sync']['median']:.2f} s; in "
            f"place {t['async_total']['median']:.2f} s after the call, a training step included; that step's forward "
            f"and backward {t['fb_beside_async']['median']:+.2f} s beside the background copy and write, on the same "
            f"cores) / {save_cost} / `load_state` verified ÷ `verify_checksums=False` "
            f"({t['load_verified']['median']:.2f} s ÷ {t['load_unverified']['median']:.2f} s)",
            " / ".join(f"{x:.2f}" for x in ratios), NA, NA,
            ("≤ 0.10" if big else "—") + " / ≤ 1.10 / ≤ 1.10",
            " / ".join(
                [met(ratios[0], "<=", 0.10) if big else "—", met(ratios[1], "<=", 1.10), met(ratios[2], "<=", 1.10)]
            ),
        ))  # fmt: skip
    for z in r["skipped"]:
        out.append(("13", f"{z['params'] / 1e6:.0f}M parameters: not run ({z['reason']})", NA, NA, NA, "", ""))
    return out


def lines_fp8(r: dict) -> list[Line]:
    """Row 14: fp8 ÷ bf16 step (hasten), and hasten fp8 ÷ the hand-written torchao loop."""
    loss = r["last_loss"]
    where = (
        f"{r['blocks']} blocks of width {r['width']}, {r['params'] / 1e6:.1f}M parameters, {r['float8_layers']} of "
        f"{r['linear_layers']} Linear layers in float8, batch {r['batch']} × {r['seq']} tokens, {r['device']}"
    )
    if r["emulated"]:
        where += ": torchao emulates fp8"
    fp8 = r["fp8_vs_bf16"]["median"]
    step = r["step_s"]
    same = r["finite"] and r["fp8_losses_agree"]
    losses = (
        f"losses after {r['steps_run']['fp8']} steps: fp8 {loss['fp8']:.5f}, hand {loss['torchao']:.5f}, bf16 "
        f"{loss['bf16']:.5f}: " + ("finite, fp8 ones agree" if same else "**not finite or fp8 ones differ**")
    )
    h = r["fp8_vs_torchao"]["median"]
    return [
        (
            "14",
            f'fp8 step ÷ bf16 step, hasten (`Accelerator(mixed_precision="fp8")` ÷ `"bf16"`, AdamW; {where}; '
            f"{step['fp8']['median'] * 1e3:.0f} ms ÷ {step['bf16']['median'] * 1e3:.0f} ms)",
            r2(r["fp8_vs_bf16"]),
            NA,
            NA,
            "emulated: records the cost" if r["emulated"] else "< 1",
            "" if r["emulated"] else ("yes" if fp8 < 1 else "**no**"),
        ),
        (
            "14",
            "… hasten fp8 step ÷ hand-written torchao loop (`convert_to_float8_training`, same filter and config, "
            f"bf16 `torch.autocast`, AdamW; hand step {step['torchao']['median'] * 1e3:.0f} ms; {losses})",
            r2(r["fp8_vs_torchao"]),
            NA,
            NA,
            "≤ 1.02",
            met(h, "<=", 1.02) if same else "**no**",
        ),
    ]


def _pipeline_script() -> Any:
    """bench/scripts/pipeline_step.py as a module (its rows and notes are formatted there)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pipeline_step", SCRIPTS / "pipeline_step.py")
    module = sys.modules.get(spec.name)
    if module is None:
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (dataclasses look it up)
        spec.loader.exec_module(module)
    return module


def lines_pipeline(r: dict) -> list[Line]:
    """Row 15: hasten's pipeline step ÷ a hand-written torch.distributed.pipelining loop, the
    measured bubble, memory per process (the script's own rows)."""
    rows = _pipeline_script().markdown_rows(r)
    return [tuple(cell.strip() for cell in row.strip().strip("|").split("|")) for row in rows]


S3_BEST = {
    "dcp_s3": "DCP's `FsspecWriter`",
    "pipe_s3": "one `fs.pipe()` of the serialized shards",
    "save_pipe_s3": "`torch.save` + one `fs.pipe()`",
    "dcp_load_s3": "DCP's `FsspecReader`",
    "cat_s3": "one `fs.cat()`",
}


def lines_checkpoint_s3(r: dict) -> list[Line]:
    """Row 16, one line per size: save and load through fsspec to a local S3 server ÷ the best of
    torch's own ways to the same server (DCP's fsspec writer and reader, one fs.pipe / fs.cat of
    the same bytes), and the async pause there."""
    out = []
    for z in r["sizes"]:
        t = z["times_s"]
        ratios = [z[k]["median"] for k in ("sync_s3_over_best", "load_s3_over_best", "async_over_sync_s3")]
        what = (
            f"{z['state_mb']:.0f} MB of state ({z['params'] / 1e6:.0f}M parameters + AdamW, FSDP2, {r['processes']} "
            f"processes), moto's S3 server on 127.0.0.1 ({z['rounds']} rounds): synchronous `save_state` ÷ the fastest "
            f"of torch's ways to the same server, here {S3_BEST[z['best_save']]} ({t['sync_s3']['median']:.2f} s ÷ "
            f"{t[z['best_save']]['median']:.2f} s; ÷ DCP's writer {z['sync_s3_over_dcp']['median']:.2f}, ÷ one pipe "
            f"{z['sync_s3_over_pipe']['median']:.2f}; ÷ disk {z['sync_s3_over_disk']['median']:.1f}) / `load_state` "
            f"(verified) ÷ the fastest, here {S3_BEST[z['best_load']]} ({t['load_s3']['median']:.2f} s ÷ "
            f"{t[z['best_load']]['median']:.2f} s; ÷ DCP's reader {z['load_s3_over_dcp']['median']:.2f}) / loop "
            "blocked by `save_state(async_save=True)` ÷ a synchronous save"
        )
        out.append(
            (
                "16",
                what,
                " / ".join(f"{x:.2f}" for x in ratios),
                NA,
                NA,
                "≤ 1.1 / ≤ 1.1 / ≤ 0.10",
                " / ".join(met(x, "<=", goal) for x, goal in zip(ratios, (1.1, 1.1, 0.10))),
            )
        )
    return out


def notes_checkpoint_s3(r: dict) -> list[str]:
    """Row 16's notes: every ratio with its spread, the A/A controls, the seconds, the requests."""
    out = []
    for z in r["sizes"]:
        ratios = (
            ("save ÷ DCP's FsspecWriter", "sync_s3_over_dcp"),
            ("save ÷ one fs.pipe()", "sync_s3_over_pipe"),
            ("save ÷ torch.save + fs.pipe()", "sync_s3_over_save_pipe"),
            ("A/A pipe ÷ pipe", "pipe_aa"),
            ("load ÷ DCP's FsspecReader", "load_s3_over_dcp"),
            ("load ÷ one fs.cat()", "load_s3_over_cat"),
            ("A/A cat ÷ cat", "cat_aa"),
            ("save S3 ÷ disk", "sync_s3_over_disk"),
            ("load S3 ÷ disk", "load_s3_over_disk"),
            ("async pause ÷ sync, S3", "async_over_sync_s3"),
            ("at disk", "async_over_sync_disk"),
        )
        requests = "; ".join(
            f"{arm}: "
            + ", ".join(f"{op} {n}" for op, n in q["requests"].items())
            + (f" (bodies MB {', '.join(f'{x:g}' for x in q['upload_mb'] if x)})" if any(q["upload_mb"]) else "")
            + f", at most {q['most_at_once']} at once"
            for arm, q in z.get("requests", {}).items()
            if q["requests"]
        )
        out.append(
            f"- Row 16, {z['state_mb']:.0f} MB of state ({z['serialized_mb']:.0f} MB serialized; {z['rounds']} rounds, "
            "the arms interleaved, the order reversed every other round, barrier to barrier; load average at the end "
            + ", ".join(f"{x:.1f}" for x in r["loadavg"])
            + "): "
            + ", ".join(f"{name} {spread(z[key])}" for name, key in ratios)
            + "; seconds "
            + ", ".join(f"{name} {spread(s)}" for name, s in z["times_s"].items())
            + (f"; requests of process 0 in the last round: {requests}" if requests else "")
        )
    return out


def lines_moe_ep(r: dict) -> list[Line]:
    """Row 17: expert parallelism at dp_shard 4: the experts' weights per process ÷ without ep, the
    ep-4 step ÷ a hand-written all-to-all + grouped matmul, the dispatch's bytes ÷ the theory."""
    c, t = r["config"], r["step_s"]
    model = (
        f"an MoE of {c['experts']} experts, top-{c['top_k']}, {c['layers']} layers, H {c['hidden']}, I {c['inner']}, "
        f"{c['tokens_per_process']} tokens per process, {c['processes']} gloo processes"
    )
    mem = [r["gathered_ratio_ep4"], r["gathered_ratio_ep2"]]
    step, loop = r["step_ratio_ep4_vs_hand_grouped"]["median"], r["step_ratio_ep4_loop_vs_hand"]["median"]
    cpu_step, cpu_loop = r["cpu_ratio_ep4_vs_hand_grouped"]["median"], r["cpu_ratio_ep4_loop_vs_hand"]["median"]
    kernel = ", ".join(r["kernels"].get("ep4", [])) or "unknown"
    sent, theory = r["dispatch_bytes_per_step_rank0"], r["dispatch_bytes_theory_even_routing"]
    bytes_ratio = [sent[f"hasten_ep{ep}"] / theory[f"ep{ep}"] for ep in (4, 2)]
    bytes_ok = sent["hasten_ep4"] == sent["hand"] and all(0.9 <= x <= 1.1 for x in bytes_ratio)
    return [
        (
            "17",
            f"expert weights a process holds while its experts run ÷ without ep (FSDP 4 gathers all {c['experts']}), "
            f"ep 4 / ep 2 ({model})",
            " / ".join(f"{x:.2f}" for x in mem),
            NA,
            NA,
            "≈ 1/ep: 0.25 / 0.50",
            " / ".join("yes" if abs(x - 1 / ep) < 0.01 else "**no**" for x, ep in zip(mem, (4, 2))),
        ),
        (
            "17",
            "… ep-4 step ÷ hand-written all-to-all + `torch._grouped_mm` (the same weights, the non-experts under "
            f"`fully_shard`; hasten's experts out of FSDP at efsdp 1, run as {kernel}; "
            f"{t['hasten_ep4']['median'] * 1e3:.0f} ms ÷ {t['hand_grouped']['median'] * 1e3:.0f} ms; hasten's loop "
            f"over the experts ÷ a hand-written loop: {loop:.2f})",
            f"{step:.2f}",
            NA,
            NA,
            "≤ 1.05",
            met(step, "<=", 1.05),
        ),
        (
            "17",
            "… the same, rank 0's CPU time per step (`time.process_time`: 4 processes on a shared 2-core machine "
            f"wait for a core more than they compute; {r['cpu_step_s']['hasten_ep4']['median'] * 1e3:.0f} ms ÷ "
            f"{r['cpu_step_s']['hand_grouped']['median'] * 1e3:.0f} ms; the loops': {cpu_loop:.2f})",
            f"{cpu_step:.2f}",
            NA,
            NA,
            "≤ 1.05",
            met(cpu_step, "<=", 1.05),
        ),
        (
            "17",
            "… bytes the dispatch sends per step, rank 0, ÷ the theory for an even routing, ep 4 / ep 2 "
            f"({sent['hasten_ep4']:,} ÷ {theory['ep4']:,.0f} / {sent['hasten_ep2']:,} ÷ {theory['ep2']:,.0f}; "
            f"the hand loop at ep 4: {sent['hand']:,})",
            " / ".join(f"{x:.2f}" for x in bytes_ratio),
            NA,
            NA,
            "≈ 1, the hand loop's",
            "yes" if bytes_ok else "**no**",
        ),
    ]


def tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


AC_NAMES = {"selective": "selective", "every_other_matmul": "selective every other matmul", "full": "full"}


def lines_long_context(r: dict) -> list[Line]:
    """Row 18: Ulysses sp 2's activation memory per process ÷ FSDP 2 without sp on the same 2
    processes, its step ÷ a hand-written Ulysses loop; activation checkpointing's memory and step ÷ none."""
    m = r["model"]
    model = (
        f"Llama {m['params'] / 1e6:.1f}M parameters, {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, "
        f"sdpa, FSDP2 over {r['processes']} gloo processes"
    )
    out: list[Line] = []
    if "memory" in r:
        cells, big = r["memory"], r["memory"][-1]
        at = " / ".join(tokens(c["length"]) for c in cells)
        for what, label in (("saved", "bytes saved for backward"), ("peak", "peak RSS of forward + backward")):
            ratios = [c["sp2_vs_sp1"].get(what) for c in cells]
            if None in ratios:
                continue
            first = what == "saved"
            out.append(
                (
                    "18",
                    (
                        "activation memory per process, sp 2 ÷ FSDP 2 without sp (the same 2 processes: one sequence "
                        f"shared ÷ one each), {label} at {at} tokens ({model}; at {tokens(big['length'])}: "
                        f"{mb(big['sp2'][what])} ÷ {mb(big['sp1'][what])}; the hand-written Ulysses loop "
                        f"{mb(big['hand'][what])})"
                        if first
                        else f"… {label} above its start, sp 2 ÷ FSDP 2 without sp, at {at} tokens (at "
                        f"{tokens(big['length'])}: {mb(big['sp2'][what])} ÷ {mb(big['sp1'][what])})"
                    ),
                    " / ".join(f"{x:.2f}" for x in ratios),
                    NA,
                    NA,
                    "≤ 0.55",
                    " / ".join(met(x, "<=", 0.55) for x in ratios),
                )
            )
    if "time" in r:
        t = r["time"]
        same = "same first loss" if t["same_first_loss"] else "**first loss differs from the hand loop's**"
        s = t["step_vs_hand"]["median"]
        out.append(
            (
                "18",
                f"… step time, hasten sp 2 ÷ hand-written Ulysses loop (`dist.all_to_all_single` around transformers' "
                f"sdpa attention, `fully_shard` on the same 2 processes, token-weighted loss; {tokens(t['length'])} "
                f"tokens; hand step {t['hand_step_s'] * 1e3:.0f} ms; A/A {t['hand_again']['median']:.2f}; CPU time ÷ "
                f"hand's {t['cpu_vs_hand']['median']:.2f}, A/A {t['cpu_hand_again']['median']:.2f}; {same})",
                r2(t["step_vs_hand"]),
                NA,
                NA,
                "≤ 1.03",
                met(s, "<=", 1.03) if t["same_first_loss"] else "**no**",
            )
        )
    if "ac" in r:
        a = r["ac"]
        modes = [mode for mode in AC_NAMES if mode in a["vs_none"]]
        names = " / ".join(AC_NAMES[mode] for mode in modes)
        none = a["memory"]["none"]
        agree = "the same losses" if a["losses_agree"] else "**losses differ**"
        out.append(
            (
                "18",
                f"activation checkpointing {names} ÷ none, memory per process: the forward's tensors alive after it; "
                f"peak RSS of forward + backward above its start ({tokens(a['length'])} tokens, one sequence per "
                f"process, {model}; none: {mb(none['alive'])}; {mb(none['peak'])})",
                " / ".join(f"{a['vs_none'][mode]['alive']:.2f}" for mode in modes)
                + "; "
                + " / ".join(f"{a['vs_none'][mode].get('peak', 0.0):.2f}" for mode in modes),
                NA,
                NA,
                "",
                "",
            )
        )
        out.append(
            (
                "18",
                f"… step time ÷ none, {names} (none {a['step_s']['none']['median'] * 1e3:.0f} ms; CPU time ÷ none's "
                + " / ".join(f"{a['vs_none'][mode]['cpu']['median']:.2f}" for mode in modes)
                + f"; {agree})",
                " / ".join(f"{a['vs_none'][mode]['step']['median']:.2f}" for mode in modes),
                NA,
                NA,
                "",
                "",
            )
        )
    return out


def notes_long_context(r: dict) -> str:
    """Row 18's note: the memory figures per length and variant, the quartiles, the losses."""

    def figures(f: dict) -> str:
        return " / ".join(mb(f[k]) for k in ("saved", "alive", "peak") if k in f)

    parts = []
    for c in r.get("memory", []):
        parts.append(
            f"{tokens(c['length'])} tokens, saved / alive / peak: FSDP 2 without sp {figures(c['sp1'])}, sp 2 "
            f"{figures(c['sp2'])}, hand-written Ulysses {figures(c['hand'])} (sp 2 ÷ hand "
            + " / ".join(f"{x:.3f}" for x in c["sp2_vs_hand"].values())
            + ")"
        )
    if "time" in r:
        t = r["time"]
        parts.append(
            f"step time at {tokens(t['length'])} tokens ({t['rounds']} rounds × {t['steps_per_block']} steps per "
            f"block, interleaved, rank 0): hasten ÷ hand {spread(t['step_vs_hand'])}; A/A hand ÷ hand "
            f"{spread(t['hand_again'])}; CPU time per step (this process's, all threads) hasten ÷ hand "
            f"{spread(t['cpu_vs_hand'])}, A/A {spread(t['cpu_hand_again'])}; step seconds "
            + ", ".join(f"{name} {spread(s)}" for name, s in t["step_s"].items())
            + "; first whole-sequence losses "
            + ", ".join(f"{name} {v:.6f}" for name, v in t["first_loss"].items())
        )
    if "ac" in r:
        a = r["ac"]
        parts.append(
            f"activation checkpointing at {tokens(a['length'])} tokens ({a['rounds']} rounds × "
            f"{a['steps_per_block']} steps per block), saved / alive / peak: "
            + ", ".join(f"{mode} {figures(f)}" for mode, f in a["memory"].items())
            + "; step ÷ none "
            + ", ".join(f"{mode} {spread(v['step'])} (CPU time {spread(v['cpu'])})" for mode, v in a["vs_none"].items())
            + "; last losses "
            + ", ".join(f"{mode} {v:.6f}" for mode, v in a["last_loss"].items())
        )
    return (
        "- Row 18 (memory: one forward + backward per cell after a warm-up step, the largest process's figure; "
        "saved: the bytes `saved_tensors_hooks` sees autograd save in the forward, each storage once, parameters "
        "left out (blind inside checkpointed blocks); alive: every tensor the forward made still alive after it "
        "(a `TorchDispatchMode`), parameters left out; peak: the RSS high-water mark over forward + backward "
        "(reset through `/proc/self/clear_refs`) above the RSS before the forward, glibc told by `mallopt` to "
        f"return freed memory; load average at the end {', '.join(f'{x:.1f}' for x in r['loadavg'])}): "
        + "; ".join(parts)
    )


def _llama_parameters(m: dict) -> int:
    """Parameters of row 19's Llama (trainer_step.py: 4 × width MLP, 32-wide heads, kv heads half the heads,
    untied head)."""
    h, v = m["width"], m["vocab"]
    kv = max(1, h // 64) * (h // max(1, h // 32))
    return 2 * v * h + h + m["layers"] * (2 * h * h + 2 * h * kv + 3 * h * 4 * h + 2 * h)


def lines_trainer_step(r: dict) -> list[Line]:
    """Row 19: the Trainer's step on hasten ÷ on Accelerate per process count; the import with the installer."""
    m, out = r["model"], []
    model = (
        f"a {_llama_parameters(m) / 1e6:.2f}M-parameter Llama from a config ({m['layers']} layers, "
        f"hidden {m['width']}, vocabulary {m['vocab']}), batch {m['batch']} × {m['seq']} tokens, AdamW, fp32"
    )
    for procs, e in r["procs"].items():
        cpu, wall = e["cpu"], e["wall"]
        out.append(
            (
                "19",
                f"transformers `Trainer` step, hasten through `install_as_accelerate()` ÷ the real Accelerate, "
                f"{procs} process{'es' if procs != '1' else ''} ({model}; a fresh process per run, runs alternating; "
                f"the main thread's CPU time per step, median of {e['steps_per_run']} steps; Accelerate "
                f"{cpu['accelerate_step_ms']:.1f} ms; A/A {cpu['aa']['median']:.2f}; wall clock "
                f"{wall['hasten']['median']:.2f}, A/A {wall['aa']['median']:.2f}; losses "
                f"{'identical' if e['losses_equal'] else '**differ**'})",
                r2(cpu["hasten"]),
                NA,
                NA,
                "≤ 0.9",
                met(cpu["hasten"]["median"], "<=", 0.9),
            )
        )
    imp = r["import"]
    out.append(
        (
            "19",
            "`import transformers.trainer` with `import hasten; hasten.install_as_accelerate()` first ÷ without "
            f"(CPU time; {imp['without_cpu_s']:.1f} s without; wall {imp['wall']['median']:.2f})",
            r2(imp),
            NA,
            NA,
            "",
            "",
        )
    )
    return out


def notes_trainer_step(r: dict) -> str:
    """Row 19's note: every ratio with its spread, the step times, the load."""
    parts = []
    for procs, e in r["procs"].items():
        parts.append(
            f"{procs} process(es), {e['rounds']} rounds of Accelerate / hasten / Accelerate again: CPU time per step "
            f"hasten ÷ Accelerate {spread(e['cpu']['hasten'])}, A/A {spread(e['cpu']['aa'])} (medians "
            f"{e['cpu']['hasten_step_ms']:.1f} ms ÷ {e['cpu']['accelerate_step_ms']:.1f} ms); wall clock "
            f"{spread(e['wall']['hasten'])}, A/A {spread(e['wall']['aa'])} ({e['wall']['hasten_step_ms']:.1f} ms ÷ "
            f"{e['wall']['accelerate_step_ms']:.1f} ms)"
        )
    imp = r["import"]
    return (
        f"- Row 19 (transformers {r['versions']['transformers']}, Accelerate {r['versions']['accelerate']}; load "
        f"average at the end {', '.join(f'{x:.1f}' for x in r['loadavg'])}): "
        + "; ".join(parts)
        + f"; `import transformers.trainer` with the installer ÷ without, CPU time {spread(imp)}, wall "
        f"{spread(imp['wall'])} ({imp['with_cpu_s']:.2f} s ÷ {imp['without_cpu_s']:.2f} s)"
    )


def lines_big_model_offload(r: dict) -> list[Line]:
    """Row 20: greedy generate with half the decoder layers on disk ÷ all in memory, per library."""
    m, libs = r["model"], r["libraries"]
    acc = libs.get("accelerate")
    model = (
        f"a {m['parameters'] / 1e6:.0f}M-parameter Llama ({mb(m['bytes'])} fp32, {m['layers']} layers, "
        f"{m['shards']} safetensors shards), {r['new_tokens']} new tokens; tokens "
        f"{'identical' if r['same_tokens'] else '**differ**'}"
    )
    figures = (
        ("time", f"greedy `generate` CPU time, half the layers on disk ÷ all in memory ({model})", "", None),
        (
            "model_rss_generating",
            "peak RSS while generating above the RSS before loading (the model's share), disk ÷ memory "
            f"(the offloaded layers are {m['layer_fraction'] / 2:.0%} of the weights)",
            "≤ 0.7",
            0.7,
        ),
        ("rss_generating", "the process's whole peak RSS while generating, disk ÷ memory", "", None),
    )
    return [
        (
            "20",
            text,
            r2(libs["hasten"][key]),
            r2(acc[key]) if acc else NA,
            NA,
            target,
            met(libs["hasten"][key]["median"], "<=", limit) if limit else "",
        )
        for key, text, target, limit in figures
    ]


def notes_big_model_offload(r: dict) -> str:
    """Row 20's note: the absolute figures per library and placement, the spreads."""
    parts = []
    for lib, e in r["libraries"].items():
        mem, disk = e["memory"], e["disk"]
        parts.append(
            f"{lib}: generate CPU time {mem['generate_cpu_s']:.2f} s in memory, {disk['generate_cpu_s']:.2f} s with "
            f"half on disk (ratio {spread(e['time'])}; wall clock {mem['generate_s']:.2f} s / {disk['generate_s']:.2f} "
            f"s, ratio {spread(e['wall'])}); RSS before loading {mb(mem['rss_before'])} / {mb(disk['rss_before'])}, "
            f"peak while generating {mb(mem['rss_peak'])} / {mb(disk['rss_peak'])} (model's share ratio "
            f"{spread(e['model_rss_generating'])}; anonymous memory {spread(e['anon_generating'])}), process peak "
            f"(loading included) {mb(mem['ru_maxrss'])} / {mb(disk['ru_maxrss'])}; offloaded layers' weights on "
            f"meta between forwards: {disk['meta_layer_fraction']:.0%} of the layers' tensors"
        )
    vs = r.get("hasten_vs_accelerate_disk")
    tail = (
        f"; hasten ÷ Accelerate with half on disk: CPU time {spread(vs['time'])}, RSS {spread(vs['rss_generating'])}"
        if vs
        else ""
    )
    return (
        f"- Row 20 ({r['rounds']} rounds of hasten / Accelerate × memory / disk, a fresh process each, one intra-op "
        f"thread; load average at the end {', '.join(f'{x:.1f}' for x in r['loadavg'])}): " + "; ".join(parts) + tail
    )


def lines_fault_tolerance(r: dict) -> list[Line]:
    """Row 21: the steps a killed replica group costs with torchft ÷ with an elastic restart, and
    the step time of a torchft run ÷ plain DDP's."""
    ft, el, c = r["ft"], r["elastic"], r["config"]
    lost = ft["steps_lost"]["median"] / el["steps_lost"]["median"]
    return [
        (
            "21",
            f"steps lost when one of {c['replicas']} replica groups is SIGKILLed, torchft (the others step on, "
            f"the group rejoins and heals live) ÷ an elastic restart from a checkpoint every {c['elastic_save_every']} "
            f"steps ({ft['steps_lost']['median']:.0f} ÷ {el['steps_lost']['median']:.0f} steps of "
            f"{ft['step_s']['median']:.2f} s: stall ÷ step time + steps redone)",
            f"{lost:.2f}",
            NA,
            NA,
            "",
            "",
        ),
        (
            "21",
            f"step time, torchft (2 replica groups of 1 process) ÷ plain DDP on 2 processes ({c['model']}: "
            f"{ft_ms(r['step_time']['ft_s'])} ÷ {ft_ms(r['step_time']['ddp_s'])})",
            r2(r["step_time"]["ft_over_ddp"]),
            NA,
            NA,
            "",
            "",
        ),
    ]


def ft_ms(s: dict) -> str:
    return f"{s['median'] * 1e3:.1f} ms"


def notes_fault_tolerance(r: dict) -> str:
    ft, el, c = r["ft"], r["elastic"], r["config"]
    return (
        f"- Row 21 (torchft {r.get('torchft', '')}; {c['replicas']} replica groups of {c['processes_per_replica']} "
        f"process, {c['step_sleep_s']} s steps, the group killed at step {c['kill_at_step']}, lighthouse heartbeat "
        f"timeout {c['lighthouse_heartbeat_timeout_ms']} ms): torchft stall {spread(ft['stall_s'])} s, uncommitted "
        f"steps {spread(ft['failed'])}; elastic restart stall {spread(el['stall_s'])} s, steps redone "
        f"{spread(el['redone'])}; steps lost {spread(ft['steps_lost'])} ÷ {spread(el['steps_lost'])}; step time "
        f"ratio {spread(r['step_time']['ft_over_ddp'])} (a few ms of quorum and commit per step, so small steps "
        "show it most)"
    )


FORMAT: dict[str, Callable[[dict], list[Line]]] = {
    "1": lines_step,
    "2": lines_import,
    "3": lines_ddp,
    "4": lines_comm,
    "5": lines_launch,
    "6": lines_profile,
    "7": lines_compile,
    "8": lines_fsdp,
    "9": lines_fsdp_step,
    "10": lines_node_loss,
    "11": lines_checkpoint,
    "12": lines_nd,
    "13": lines_checkpoint_async,
    "14": lines_fp8,
    "15": lines_pipeline,
    "16": lines_checkpoint_s3,
    "17": lines_moe_ep,
    "18": lines_long_context,
    "19": lines_trainer_step,
    "20": lines_big_model_offload,
    "21": lines_fault_tolerance,
}
HEADER = ("#", "Measure", "hasten", "Accelerate", "Lightning Fabric", "Target", "Met")


def table(results: dict[str, dict], errors: dict[str, str]) -> str:
    rows = [HEADER, tuple("---" for _ in HEADER)]
    for row in ROWS:
        if row in results:
            rows.extend(FORMAT[row](results[row]))
        elif row in errors:
            rows.append((row, f"{TITLES[row]}: **failed** ({errors[row].splitlines()[0]})", NA, NA, NA, "", "**no**"))
    return "\n".join("| " + " | ".join(cells) + " |" for cells in rows)


def spread(s: dict) -> str:
    return f"{s['median']:.3f} (quartiles {s['q1']:.3f}–{s['q3']:.3f}, n={s['n']})"


def notes(results: dict[str, dict]) -> list[str]:
    """The quartiles, A/A controls and absolute numbers behind the table."""
    out = []
    if "1" in results:
        r = results["1"]
        out.append(f"- Row 1 ({r['rounds']} rounds × {r['steps_per_round']} steps of each loop, batch {r['batch']}):")
        for p, e in r["precisions"].items():
            parts = [
                f"raw step {e['raw_step_us']:.0f} µs",
                f"A/A raw ÷ raw {spread(e['raw_again'])}",
                f"hasten {spread(e['hasten'])}",
            ]
            parts += [
                f"{lib} {spread(e[lib])} (runs {e[lib + '_runs']})" for lib in ("accelerate", "fabric") if lib in e
            ]
            out.append(f"  - {p}: " + "; ".join(parts))
    if "2" in results:
        r = results["2"]
        parts = [
            f"`{r['commands'][n]}`: CPU time {spread(r[n])}, wall {spread(r[n]['wall'])}"
            + (f", own imports on top of torch +{100 * r[n]['own_share']:.1f}%" if "own_share" in r[n] else "")
            for n in r["commands"]
            if n != "torch"
        ]
        out.append(
            f"- Row 2, each command ÷ `import torch` in its own process (`import torch` ≈ {r['torch_cpu_s']:.2f} s "
            f"CPU, {r['torch_s']:.2f} s wall; the wall time of a 2-4 s import swings by tens of percent with the load; "
            "hasten's commands and the other libraries' run in two groups, each interleaved with its own "
            "`import torch`): " + "; ".join(parts)
        )
    if "3" in results:
        r = results["3"]
        parts = [
            f"{n}: {spread(r[n])}, per rank {', '.join(f'{m:.3f}' for m in r[n]['per_rank_median'])}"
            for n in r
            if isinstance(r[n], dict) and "per_rank_median" in r[n]
        ]
        parts.append(f"hasten ÷ raw_cap25: {spread(r['hasten_vs_raw_cap25'])}")
        out.append("- Row 3 (throughput ratios; `raw_again` is the A/A control): " + "; ".join(parts))
        groups: dict[str, list[str]] = {}
        for n, f in r.get("ddp", {}).items():
            groups.setdefault(json.dumps(f), []).append(n)
        out.append("  DDP as built: " + "; ".join(f"{', '.join(ns)}: `{f}`" for f, ns in groups.items()))
    if "4" in results:
        r = results["4"]
        out.append(
            f"- Row 4: parameter shapes {r['param_shapes']}; DDP buckets (elements) {r['buckets']}; bytes counted from "
            f"`gloo:all_reduce` profiler records over the last {r['measured_steps']} of {r['steps']} steps (all "
            "threads)."
        )
        out.append(
            "  PowerSGD on one m × n matrix cuts m·n/(r(m+n)): 1024×1024 at r=1 → 512×, at r=2 → 256×; biases go "
            "uncompressed, so the whole-model cut is lower."
        )
    if "5" in results:
        r = results["5"]
        out.append(
            f"- Row 5 (torchrun ≈ {r['torchrun_s']:.2f} s; hasten and the other launchers in two groups, each "
            "interleaved with its own torchrun runs): "
            + "; ".join(f"{n}: {spread(r[n])}" for n in r["commands"] if n != "torchrun")
        )
        out.append("  Commands: " + "; ".join(f"`{c}`" for c in r["commands"].values()))
    if "6" in results:
        r = results["6"]
        out.append(
            f"- Row 6 (plain step {r['plain_step_us']:.0f} µs, wait = {r['wait_steps']} steps): profiled "
            f"{spread(r['profiled'])}; bare torch profiler {spread(r['torch_profiler'])}; hasten ÷ bare "
            f"{spread(r['profiled_vs_torch_profiler'])}; A/A {spread(r['plain_again'])}"
        )
    if "8" in results:
        r = results["8"]
        env = " ".join(f"{k}={v}" for k, v in r["malloc_env"].items())
        out.append(
            f"- Row 8: each cell is a launch of its own (every rank builds the model on the CPU with the same seed; "
            f"the largest rank's figure), with glibc returning freed memory (`{env}`), so RSS is live memory. "
            "Live tensors: `hasten.training.memory.live_tensor_bytes()` (every reachable tensor, each storage once). "
            + "; ".join(
                f"{g['params'] / 1e6:.0f}M × {g['processes']}: hasten {mb(g['hasten']['live_steps'])} / RSS "
                f"{mb(g['hasten']['rss_steps'])}, hand {mb(g['hand']['live_steps'])} / {mb(g['hand']['rss_steps'])}"
                + (f", DDP {mb(g['ddp']['live_steps'])} / {mb(g['ddp']['rss_steps'])}" if g["ddp"] else "")
                for g in r["grid"]
            )
            + "".join(f"; left out: {why}" for why in r["skipped"].values())
        )
    if "9" in results:
        r = results["9"]
        out.append(
            f"- Row 9 ({r['rounds']} rounds × {r['steps_per_block']} steps per block, interleaved): hasten ÷ hand "
            f"{spread(r['step_vs_hand'])}; A/A hand ÷ hand {spread(r['hand_again'])}"
        )
    if "10" in results:
        r = results["10"]
        parts = [
            f"kill (process-group timeout {r['config']['kill_pg_timeout_s']:g} s, not reached): "
            + ", ".join(f"{part} {spread(s)}" for part, s in r["kill"].items())
        ]
        parts += [f"freeze, process-group timeout {t} s: " + ", ".join(f"{part} {spread(s)}" for part, s in f.items())
                  for t, f in r["freeze"].items()]  # fmt: skip
        out.append(
            f"- Row 10, seconds (two launches as two nodes of this machine; rendezvous `{r['config']['rdzv_conf']}`, a "
            f"checkpoint every {r['config']['save_every_steps']} steps; from the loss to the restarted worker's start "
            "(`to_restart`: failure seen, agent restart, rendezvous without the lost node), its "
            "imports, process group and `load_state` (`startup`), its first step): " + "; ".join(parts)
        )
    if "11" in results:
        r = results["11"]
        out.append(
            f"- Row 11 ({r['rounds']} rounds, DCP and full interleaved, each timed barrier to barrier; bytes on disk "
            f"DCP {r['bytes']['dcp']}, full {r['bytes']['full']}; every load checked to restore the saved shards: "
            f"{r['restored']}): save DCP ÷ full {spread(r['save_ratio'])}, load {spread(r['load_ratio'])}; seconds "
            + ", ".join(f"{name} {spread(s)}" for name, s in r["times_s"].items())
        )
    if "12" in results:
        r = results["12"]
        parts = []
        for layout, c in r["layouts"].items():
            part = (
                f"{ND_NAMES[layout]}: step ÷ hand {spread(c['step_vs_hand'])}, A/A {spread(c['hand_again'])}; live "
                f"after steps hasten {mb(c['hasten']['live_steps'])}, hand {mb(c['hand']['live_steps'])}; data ranks "
                f"of processes 0-3 {c['data_ranks']['hasten']} (hand {c['data_ranks']['hand']})"
            )
            if "bytes_per_step" in c:
                bp = c["bytes_per_step"]
                part += (
                    f"; bytes per step crossing / all: hasten {size(bp['hasten']['crossing'])} / "
                    f"{size(bp['hasten']['total'])}, hand {size(bp['hand']['crossing'])} / {size(bp['hand']['total'])}"
                )
            parts.append(part)
        out.append(
            "- Row 12 (each memory cell a launch of its own with glibc returning freed memory; step times "
            "interleaved in one launch per layout): " + "; ".join(parts)
        )
    if "13" in results:
        r = results["13"]
        for z in r["sizes"]:
            out.append(
                f"- Row 13, {z['params'] / 1e6:.0f}M parameters ({z['rounds']} rounds, the variants interleaved, "
                f"barrier to barrier; load average at the end {', '.join(f'{x:.1f}' for x in r['loadavg'])}"
                + (f"; the saves alone: {z['saves_only']}" if z.get("saves_only") else "")
                + "): "
                + (f"async pause ÷ sync {spread(z['async_over_sync'])}, " if "async_over_sync" in z else "")
                + f"sync ÷ torch.save {spread(z['sync_over_torch_save'])}, A/A torch.save ÷ torch.save "
                f"{spread(z['torch_save_a_a'])}, "
                + (
                    f"verified ÷ unverified load {spread(z['verified_over_unverified'])}, "
                    if "verified_over_unverified" in z
                    else ""
                )
                + f"sync ÷ DCP alone (torch's writer, no hashing or manifest) {spread(z['sync_over_dcp_alone'])}; "
                f"written under {r.get('dir', '?')}; on one core "
                + ", ".join(
                    f"{a} {gbs:.2f} GB/s"
                    for a, gbs in r.get("checksum_gb_s", {"SHA-256": r.get("sha256_gb_s", 0.0)}).items()
                )
                + "; seconds "
                + ", ".join(f"{name} {spread(s)}" for name, s in z["times_s"].items())
                + (
                    "; the async pause of the first save after a load_state (new host buffers) "
                    f"{z['async_after_load_s']:.2f} s"
                    if "async_after_load_s" in z
                    else ""
                )
            )
    if "14" in results:
        r = results["14"]
        out.append(
            f"- Row 14 ({r['rounds']} rounds × {r['steps_per_round']} steps of each loop, interleaved; "
            f"{r['float8_layers']} float8 layers; {'emulated' if r['emulated'] else 'fp8 matmuls'}): fp8 ÷ bf16 "
            f"{spread(r['fp8_vs_bf16'])}; hasten fp8 ÷ hand {spread(r['fp8_vs_torchao'])}; A/A hand ÷ hand "
            f"{spread(r['torchao_again'])}; step seconds "
            + ", ".join(f"{name} {spread(s)}" for name, s in r["step_s"].items())
            + "; last losses "
            + ", ".join(f"{name} {v:.6f}" for name, v in r["last_loss"].items())
        )
    if "15" in results:
        out.append(_pipeline_script().notes_line(results["15"]))
    if "16" in results:
        out.extend(notes_checkpoint_s3(results["16"]))
    if "17" in results:
        r = results["17"]
        c = r["config"]
        out.append(
            f"- Row 17 ({c['rounds']} rounds × {c['steps']} steps of each loop, interleaved; 4 processes on "
            f"{os.cpu_count()} cores): ep 4 ÷ hand grouped {spread(r['step_ratio_ep4_vs_hand_grouped'])}; ep 4 ÷ "
            f"hand loop {spread(r['step_ratio_ep4_vs_hand'])}; ep 4 with hasten's loop over the experts ÷ hand loop "
            f"{spread(r['step_ratio_ep4_loop_vs_hand'])}; CPU time ep 4 ÷ hand grouped "
            f"{spread(r['cpu_ratio_ep4_vs_hand_grouped'])}, the loops {spread(r['cpu_ratio_ep4_loop_vs_hand'])}; "
            "ep 2 ÷ hand "
            f"{spread(r['step_ratio_ep2_vs_hand'])}; FSDP 4 without ep ÷ hand {spread(r['step_ratio_fsdp_vs_hand'])}; "
            "step seconds "
            + ", ".join(f"{name} {spread(s)}" for name, s in r["step_s"].items())
            + "; kernels "
            + "; ".join(f"{name}: {', '.join(k)}" for name, k in r["kernels"].items())
        )
    if "18" in results:
        out.append(notes_long_context(results["18"]))
    if "19" in results:
        out.append(notes_trainer_step(results["19"]))
    if "20" in results:
        out.append(notes_big_model_offload(results["20"]))
    if "21" in results:
        out.append(notes_fault_tolerance(results["21"]))
    took = ", ".join(f"row {k} {v['seconds']:.0f} s" for k, v in results.items())
    out.append(f"- Time taken: {took}.")
    return out


# ---------------------------------------------------------------------- the machine


def machine() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in open("/proc/meminfo", encoding="utf-8"):
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB RAM"
                break
    except OSError:
        pass
    return {
        "cpu": f"{cpu}, {os.cpu_count()} logical cores" + (f", {mem}" if mem else ""),
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    found = {}
    for dist in ("torch", "hasten", "accelerate", "lightning"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "not installed"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        if commit:
            found["hasten"] += f" (git {commit})"
    except (OSError, subprocess.SubprocessError):
        pass
    return found


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def report(results: dict[str, dict], errors: dict[str, str], info: dict, quick: bool) -> str:
    v = info["versions"]
    head = [
        "# hasten benchmarks" + (" (quick smoke run: numbers not meaningful)" if quick else ""),
        "",
        f"- Date: {info['date']}",
        f"- Machine: {info['machine']['cpu']}; {info['machine']['os']}; Python {info['machine']['python']}",
        f"- Load average (1, 5, 15 min) at start: {info['load_start']}; at end: {info['load_end']} (a shared machine)",
        "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- Command: `{info['command']}` ({info['seconds']:.0f} s)",
        "",
        "Every figure is a ratio measured within one run: the variants interleaved (training loops in blocks of a few "
        "steps in a shuffled order, judged by the block's median step; commands one by one, the order reversed every "
        "other round), the median over rounds; the A/A controls (a variant against an identical copy) in the notes "
        "show how far the method itself strays. Below 1 is faster for time ratios (rows 1, 2, 5, 6, 11); row 3 is a "
        "throughput ratio (above 1 is faster). Row 10 is a time in seconds, its configuration beside it. "
        "Single-process loops use one intra-op thread.",
        "",
    ]
    return "\n".join([*head, table(results, errors), "", "Notes:", "", *notes(results), ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: a few steps per row, meaningless numbers")
    parser.add_argument("--rows", default=",".join(ROWS), help="rows to run, e.g. 1,3 (default: all)")
    parser.add_argument("--no-others", action="store_true", help="leave Accelerate and Lightning Fabric out")
    parser.add_argument(
        "--out",
        help="markdown report to write (default: bench/RESULTS.md for a full run of all rows, nothing with --quick)",
    )
    parser.add_argument("--json", help="also write the raw results as JSON here")
    args = parser.parse_args(argv)
    named_rows = args.rows != ",".join(ROWS)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if args.quick and not named_rows:
        rows = [r for r in rows if r not in QUICK_OPTIONAL]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown row(s) {', '.join(unknown)}; rows are {', '.join(ROWS)}")
    out = args.out
    if out is None and not args.quick and rows == list(ROWS):
        out = str(BENCH / "RESULTS.md")

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "versions": versions(),
        "load_start": load(),
        "command": " ".join(["python bench/run.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    start = time.perf_counter()
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for row in rows:
        print(f"row {row}: {TITLES[row]} ...", file=sys.stderr, flush=True)
        try:
            results[row] = run_row(
                row,
                args.quick,
                not args.no_others,
                timeout=(900 if row in QUICK_OPTIONAL else 240) if args.quick else SLOW_ROWS.get(row, 420),
            )
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            errors[row] = str(exc)
            print(str(exc), file=sys.stderr)
    info["seconds"] = time.perf_counter() - start
    info["load_end"] = load()

    print(table(results, errors))
    if out:
        Path(out).write_text(report(results, errors, info, args.quick), encoding="utf-8")
        print(f"\nwritten: {out}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"info": info, "results": results, "errors": errors}, indent=1), encoding="utf-8"
        )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
