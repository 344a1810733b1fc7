"""hasten as a drop-in for Accelerate, measured on Accelerate's own tests (``make peer``).

    python bench/peer.py                   # the full run, writes bench/PEER.md
    python bench/peer.py --only test_cpu.py,test_ops.py --keep /tmp/peer   # a partial run, for debugging

1. Downloads the pinned Accelerate sdist (``pip download --no-deps --no-binary :all:``) and the
   ``parameterized`` wheel its tests use into a temporary folder. Nothing of Accelerate's is
   kept in this repository.
2. Copies the test files and the test scripts that can run on CPU, and rewrites every
   ``from accelerate... import a, b`` so that each name hasten offers comes from hasten
   (``accelerate`` -> ``hasten``, ``accelerate.utils`` -> ``hasten.utils``...); the other names
   (Accelerate's test helpers, its internals) stay Accelerate's. Accelerate's test scripts that
   the tests import (``test_script``, ``test_ops``...) are the rewritten copies. A test that listens
   on an Accelerate module's logger (``assertLogs("accelerate.utils.environment")``) listens on the
   hasten module its names were moved to.
3. Runs each test file with pytest, and each script on 2 processes (``torch.distributed.run``,
   one check per call its ``main()`` makes: bench/peer_runner.py), once as written (Accelerate)
   and once rewritten (hasten), CPU only.
4. Writes bench/PEER.md: per file, the checks passing on Accelerate and how many of them pass on
   hasten, and each failing one with its error and the reason (REASONS below).

A test that uses no name taken from hasten tests Accelerate on both sides; it is counted apart
("untouched") and not in the ratio.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
HASTEN_SRC = ROOT / "src"
ACCELERATE_VERSION = "1.15.0"
PARAMETERIZED_VERSION = "0.9.0"

# Accelerate's test files that run on CPU and test what hasten offers.
TEST_FILES = [
    "test_accelerator.py",
    "test_big_modeling.py",
    "test_cpu.py",
    "test_data_loader.py",
    "test_grad_sync.py",
    "test_hooks.py",
    "test_kwargs_handlers.py",
    "test_logging.py",
    "test_memory_utils.py",
    "test_metrics.py",
    "test_modeling_utils.py",
    "test_offload.py",
    "test_optimizer.py",
    "test_scheduler.py",
    "test_state_checkpointing.py",
    "test_tracking.py",
    "test_utils.py",
]
# Accelerate's test scripts (accelerate/test_utils/scripts), run on 2 CPU processes.
SCRIPTS = ["test_script.py", "test_ops.py", "test_sync.py", "test_ddp_comm_hook.py"]
# The rest, and why they are not run.
NOT_RUN = {
    "test_load_checkpoint_and_dispatch_with_broadcast.py, test_quantization.py, "
    "test_activation_checkpointing_offload.py": (
        "loading a checkpoint broadcast over several GPUs, bitsandbytes quantization, activation offloading: "
        "not part of hasten"
    ),
    "test_cli.py, test_launch.py, test_sagemaker.py, test_dataclasses.py, test_imports.py": (
        "Accelerate's own CLI, config files, SageMaker and import timing (hasten has its own `hasten launch`/`config`)"
    ),
    "test_fp8.py, test_tpu.py": "FP8 and TPU/XLA: refused by hasten",
    "test_examples.py, test_compile.py, test_multidevice.py": "need transformers/datasets or several GPUs",
    "Accelerate's examples/ (nlp_example.py, by_feature/*)": (
        "not in the sdist, and the repository they live in cannot be reached from the machines this runs on"
    ),
    "scripts test_notebook.py, test_merge_weights.py, test_cli.py, test_distributed_data_loop.py, external_deps/*": (
        "notebook hardware checks, FSDP weight merging, a CLI stub, a script that asserts two GPUs, "
        "transformers/datasets/evaluate"
    ),
}

# Where each Accelerate module's names live in hasten (a name moves only if hasten has it there).
MODULE_MAP = {
    "accelerate": "hasten",
    "accelerate.accelerator": "hasten.accelerator",
    "accelerate.state": "hasten.state",
    "accelerate.utils": "hasten.utils",
    "accelerate.utils.dataclasses": "hasten.utils.dataclasses",
    "accelerate.utils.operations": "hasten.utils.operations",
    "accelerate.utils.memory": "hasten.utils.memory",
    "accelerate.utils.random": "hasten.utils.random",
    "accelerate.utils.other": "hasten.utils.other",
    "accelerate.utils.imports": "hasten.utils.imports",
    "accelerate.utils.constants": "hasten.utils.constants",
    "accelerate.utils.environment": "hasten.utils.environment",
    "accelerate.utils.versions": "hasten.utils.versions",
    "accelerate.utils.tqdm": "hasten.utils.tqdm",
    "accelerate.utils.fsdp_utils": "hasten.utils.fsdp_utils",
    "accelerate.utils.modeling": "hasten.utils.modeling",
    "accelerate.utils.offload": "hasten.utils.offload",
    "accelerate.hooks": "hasten.hooks",
    "accelerate.parallelism_config": "hasten.parallelism_config",
    "accelerate.data_loader": "hasten.data_loader",
    "accelerate.optimizer": "hasten.optimizer",
    "accelerate.scheduler": "hasten.scheduler",
    "accelerate.local_sgd": "hasten.local_sgd",
    "accelerate.big_modeling": "hasten.big_modeling",
    "accelerate.tracking": "hasten.tracking",
    "accelerate.logging": "hasten.logging",
    "accelerate.launchers": "hasten.launchers",
}
SCRIPT_MODULES = {Path(s).stem for s in SCRIPTS}

# Why a check that passes on Accelerate fails on hasten: a regex on the check's id -> reason.
# Written by hand after reading each failure; a failure without a reason shows none.
REASONS: list[tuple[str, str]] = [
    (
        r"rng_sync_check",
        "harness: the check's helper are_the_same_tensors (accelerate.test_utils, not swapped) reads Accelerate's own "
        "AcceleratorState, which only Accelerate's Accelerator initialises",
    ),
    (
        r"test_cpu.py::MultiCPUTester.test_cpu$",
        "harness: runs all of test_script.main() in one call, which fails at rng_sync_check "
        "(scripts/test_script.py, below)",
    ),
    (
        r"DVCLiveTrackingTest",
        "end_training: hasten lets go of the finished trackers (accelerator.trackers is empty after it, so a second "
        "end_training or a log finishes nothing twice); Accelerate keeps them, and the test reads trackers[0].live "
        "after it",
    ),
]


def log(msg: str) -> None:
    print(f"[peer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------- download
def fetch(work: Path) -> tuple[Path, Path]:
    """The unpacked Accelerate sdist's folder and the parameterized wheel."""
    dl = work / "download"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "-q", "--no-deps", "-d", str(dl)]
    subprocess.run([*pip, "--no-binary", ":all:", f"accelerate=={ACCELERATE_VERSION}"], check=True, timeout=600)
    subprocess.run([*pip, "--only-binary", ":all:", f"parameterized=={PARAMETERIZED_VERSION}"], check=True, timeout=600)
    sdist = next(dl.glob("accelerate-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    return work / f"accelerate-{ACCELERATE_VERSION}", next(dl.glob("parameterized-*.whl"))


# ---------------------------------------------------------------------- rewriting
def _hasten_has(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def rewrite(source: str) -> tuple[str, set[str]]:
    """``source`` with the names hasten offers imported from hasten; returns it and those local names."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    swapped: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("accelerate"):
            continue
        target = MODULE_MAP.get(node.module)
        moved, kept, scripts = [], [], []
        for alias in node.names:
            text = alias.name + (f" as {alias.asname}" if alias.asname else "")
            if node.module.startswith("accelerate.test_utils") and alias.name in SCRIPT_MODULES:
                scripts.append(text)
            elif target and alias.name != "*" and _hasten_has(target, alias.name):
                moved.append(text)
                swapped.add(alias.asname or alias.name)
            else:
                kept.append(text)
        if not moved and not scripts:
            continue
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        new = []
        if moved:
            new.append(f"{indent}from {target} import {', '.join(moved)}\n")
        if scripts:
            new.append(f"{indent}from peer_scripts import {', '.join(scripts)}\n")
        if kept:
            new.append(f"{indent}from {node.module} import {', '.join(kept)}\n")
        edits.append((node.lineno - 1, node.end_lineno, "".join(new)))
    for start, end, text in sorted(edits, reverse=True):
        lines[start:end] = [text]
    return _listen_on_hasten(lines), swapped


# The calls whose first argument names a logger: a test listening on an Accelerate module's logger
# listens on the hasten module that the imports were moved to (each module logs on its own name).
_LOGGER_CALLS = {"assertLogs", "assertNoLogs", "getLogger", "get_logger"}


def _listen_on_hasten(lines: list[str]) -> str:
    """``lines`` with each ``assertLogs("accelerate.x")`` (and the like) naming the module that
    MODULE_MAP moves ``accelerate.x``'s names to."""
    source = "".join(lines)
    spans = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        arg = node.args[0]
        if name in _LOGGER_CALLS and isinstance(arg, ast.Constant) and arg.value in MODULE_MAP:
            spans.append((arg.lineno - 1, arg.col_offset, arg.end_col_offset, repr(MODULE_MAP[arg.value])))
    lines = source.splitlines(keepends=True)
    for row, start, end, text in sorted(spans, reverse=True):
        line = lines[row].encode()  # ast's offsets count UTF-8 bytes
        lines[row] = (line[:start] + text.encode() + line[end:]).decode()
    return "".join(lines)


def touching_tests(source: str, swapped: set[str]) -> dict[str, bool]:
    """For each test function (``Class.test_x`` or ``test_x``): does it use a name taken from hasten?

    Follows the module's functions and classes it names and its class's own methods and setUp.
    """
    tree = ast.parse(source)

    def names(node: ast.AST) -> set[str]:
        out = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                out.add(n.id)
            elif isinstance(n, ast.Attribute):
                out.add(n.attr)
        return out

    defs = {n.name: names(n) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    touches = {k: bool(v & swapped) for k, v in defs.items()}
    for _ in range(10):  # fixpoint over module-level definitions
        for k, used in defs.items():
            touches[k] = touches[k] or any(touches.get(u) for u in used if u != k)
    result: dict[str, bool] = {}

    def direct(used: set[str]) -> bool:
        return bool(used & swapped) or any(touches.get(u) for u in used)

    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            result[node.name] = direct(names(node))
        elif isinstance(node, ast.ClassDef):
            methods = {m.name: names(m) for m in node.body if isinstance(m, ast.FunctionDef)}
            setup = set().union(*(methods.get(s, set()) for s in ("setUp", "setUpClass")))
            class_level = names(ast.Module(body=[d for d in node.decorator_list] + list(node.bases), type_ignores=[]))
            for name, used in methods.items():
                if name.startswith("test"):
                    helpers = set().union(*(methods[u] for u in used if u in methods and u != name))
                    result[f"{node.name}.{name}"] = direct(used | helpers | setup | class_level)
    return result


# ---------------------------------------------------------------------- running
def _env(pythonpath: list[Path], config_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "HASTEN_", "PET_", "TORCHELASTIC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    config_home.mkdir(parents=True, exist_ok=True)  # empty: no config file of the user's is read
    env["HASTEN_CONFIG_HOME"] = str(config_home)
    env["WANDB_MODE"] = "disabled"
    env["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 refuses the folder store Accelerate's tests log to, without it
    # ClearML's reporter runs in a process forked from the test process, which can hang there (locks held
    # by other trackers' threads at the fork) until pytest's timeout; in a thread of the test process, it does not.
    clearml_conf = config_home.with_name(config_home.name + "-clearml.conf")
    clearml_conf.write_text("sdk { development { report_use_subprocess: false, vcs_repo_detect_async: false } }\n")
    env["CLEARML_CONFIG_FILE"] = str(clearml_conf)
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def run_pytest(folder: Path, file: str, env: dict[str, str], timeout: float) -> dict[str, tuple[str, str]]:
    """{test id: (outcome, first line of the error)} from pytest's junit XML."""
    xml = folder / f"{file}.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--timeout",
        "300",
        "--junitxml",
        str(xml),
        "--rootdir",
        str(folder),
        f"tests/{file}",
    ]
    code, out = _run(cmd, folder, env, timeout)
    (folder / f"{file}.log").write_text(out)
    results: dict[str, tuple[str, str]] = {}
    if not xml.exists():
        return {
            f"{file} (the whole file)": (
                "error",
                "no result: pytest " + ("timed out" if code is None else f"exited {code}"),
            )
        }
    for case in ET.parse(xml).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        name = case.get("name", "")
        tid = f"{cls}.{name}" if cls and cls != Path(file).stem else name
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (
                    (el.get("message") or (el.text or "")).strip().splitlines()[0][:300]
                    if (el.get("message") or el.text)
                    else ""
                )
                break
        results[tid] = (outcome, message)
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(script: Path, out: Path, env: dict[str, str], timeout: float) -> dict[str, tuple[str, str]]:
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **env,
        "ACCELERATE_USE_CPU": "1",
    }  # else Accelerate runs each CPU process alone (as `accelerate launch --cpu`)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        str(BENCH / "peer_runner.py"),
        str(script),
        str(out),
    ]
    code, log_text = _run(cmd, out, env, timeout)
    (out / "log.txt").write_text(log_text)
    merged: dict[str, tuple[str, str]] = {}
    stops = []
    for rank in range(2):
        path = out / f"rank{rank}.json"
        if not path.exists():
            stops.append(f"rank {rank} wrote nothing")
            continue
        data = json.loads(path.read_text())
        if data.get("status") != "completed":
            stops.append(f"rank {rank}: {data.get('status')}" + (" (timed out)" if code is None else ""))
        for label, error in data["checks"]:
            if error is not None:
                merged[label] = ("failed", f"rank {rank}: {error}")
            else:
                merged.setdefault(label, ("passed", ""))
    if stops:
        merged["(script ran to the end)"] = ("failed", "; ".join(stops))
    else:
        merged["(script ran to the end)"] = ("passed", "")
    return merged


# ---------------------------------------------------------------------- report
def reason_for(check: str, error: str) -> str:
    """The first reason whose pattern is found in the check's id, else in its error."""
    for text in (check, error):
        for pattern, reason in REASONS:
            if re.search(pattern, text):
                return reason
    return ""


def write_report(rows: list[dict], path: Path, elapsed: float) -> tuple[int, int]:
    total_a = total_h = 0
    lines = [
        "# hasten on Accelerate's own tests",
        "",
        f"`make peer` (bench/peer.py), {datetime.date.today().isoformat()}: Accelerate {ACCELERATE_VERSION}'s tests "
        "and test scripts, run as written (Accelerate) and with every name hasten offers imported from hasten "
        "instead (hasten; a test listening on an Accelerate module's logger listens on that hasten module's), CPU "
        "only; scripts on 2 processes. A check is a pytest test, or one call a script's "
        '`main()` makes to one of its check functions. "Untouched" tests use no name taken from hasten '
        "(they test Accelerate on both sides) and are not counted, nor are tests skipped on Accelerate (a GPU, "
        "torchdata's StatefulDataLoader, `datasets`, the tests Accelerate itself marks skip or slow). The "
        "trackers' packages are installed (`make peer` has a venv of its own), so Accelerate's tracker tests run. "
        f"Run time {elapsed / 60:.0f} min.",
        "",
        "| file | passing on Accelerate | of those, passing on hasten | untouched (not counted) |",
        "|---|---:|---:|---:|",
    ]
    failures: list[str] = []
    for row in rows:
        acc, hst, touched = row["accelerate"], row["hasten"], row["touched"]
        counted = [c for c, (o, _) in acc.items() if o == "passed" and touched.get(c, True)]
        untouched = sum(1 for c, (o, _) in acc.items() if o == "passed" and not touched.get(c, True))
        ok = [c for c in counted if hst.get(c, ("missing", ""))[0] == "passed"]
        total_a += len(counted)
        total_h += len(ok)
        lines.append(f"| {row['name']} | {len(counted)} | {len(ok)} | {untouched} |")
        for c in counted:
            if c in ok:
                continue
            outcome, error = hst.get(c, ("missing", "did not run on hasten"))
            why = reason_for(f"{row['name']}::{c}", error)
            failures.append(f"- `{row['name']}::{c}`: {error or outcome}" + (f" — **{why}**" if why else ""))
    pct = 100.0 * total_h / total_a if total_a else 0.0
    lines.append(f"| **total** | **{total_a}** | **{total_h} ({pct:.0f}%)** | |")
    lines += ["", "## Checks that pass on Accelerate and fail on hasten", ""]
    lines += failures or ["None."]
    lines += ["", "## Not run", ""]
    lines += [f"- {files}: {why}" for files, why in NOT_RUN.items()]
    old = path.read_text() if path.exists() else ""
    if "<!-- peer-hf -->" in old:  # `make peer-hf`'s section (bench/peer_hf.py) stays
        lines += ["", "<!-- peer-hf -->" + old.split("<!-- peer-hf -->", 1)[1].rstrip("\n")]
    path.write_text("\n".join(lines) + "\n")
    return total_a, total_h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated test files / scripts to run (default: all)")
    parser.add_argument("--keep", default="", help="work in this folder and keep it (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per file and side")
    parser.add_argument("--out", default=str(BENCH / "PEER.md"))
    args = parser.parse_args()
    only = {x for x in args.only.split(",") if x}
    start = time.monotonic()
    sys.path.insert(0, str(HASTEN_SRC))
    work = Path(args.keep or tempfile.mkdtemp(prefix="hasten-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        sdist, wheel = fetch(work)
        log(f"Accelerate {ACCELERATE_VERSION} unpacked in {sdist}")
        acc_src = sdist / "src"
        script_dir = acc_src / "accelerate" / "test_utils" / "scripts"
        acc_dir, hst_dir = work / "accelerate", work / "hasten"
        for d in (acc_dir / "tests", hst_dir / "tests", hst_dir / "peer_scripts"):
            d.mkdir(parents=True, exist_ok=True)
        (hst_dir / "peer_scripts" / "__init__.py").write_text("")
        for name in SCRIPTS:
            text, _ = rewrite((script_dir / name).read_text())
            (hst_dir / "peer_scripts" / name).write_text(text)
        env_acc = _env([acc_src, wheel], work / "config-accelerate")
        env_hst = _env([HASTEN_SRC, hst_dir, acc_src, wheel], work / "config-hasten")
        rows = []
        for file in TEST_FILES:
            if only and file not in only:
                continue
            source = (sdist / "tests" / file).read_text()
            shutil.copy(sdist / "tests" / file, acc_dir / "tests" / file)
            text, swapped = rewrite(source)
            (hst_dir / "tests" / file).write_text(text)
            log(f"{file}: {len(swapped)} names from hasten; running on Accelerate, then on hasten")
            acc = run_pytest(acc_dir, file, env_acc, args.timeout)
            hst = run_pytest(hst_dir, file, env_hst, args.timeout)
            touched_fns = touching_tests(text, swapped)
            touched = {}
            for tid in acc:
                base = max((k for k in touched_fns if tid == k or tid.startswith(k + "_")), key=len, default=None)
                touched[tid] = touched_fns.get(base, True) if base else True
            rows.append({"name": file, "accelerate": acc, "hasten": hst, "touched": touched})
        for name in SCRIPTS:
            if only and name not in only:
                continue
            log(f"script {name}: on Accelerate, then on hasten (2 processes each)")
            acc = run_script(script_dir / name, work / "runs" / "accelerate" / name, env_acc, args.timeout)
            hst = run_script(hst_dir / "peer_scripts" / name, work / "runs" / "hasten" / name, env_hst, args.timeout)
            rows.append({"name": f"scripts/{name}", "accelerate": acc, "hasten": hst, "touched": {}})
        out = Path(args.out)
        total_a, total_h = write_report(rows, out, time.monotonic() - start)
        log(f"{total_h} of {total_a} checks passing on Accelerate pass on hasten; wrote {out}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
