"""hasten under transformers' own Trainer tests, through ``install_as_accelerate()`` (``make peer-hf``).

    python bench/peer_hf.py                          # the full run, writes its section of bench/PEER.md
    python bench/peer_hf.py --tests /path/to/transformers/tests/trainer   # tests from a local copy
    python bench/peer_hf.py --only test_trainer_accelerator.py --keep /tmp/peer-hf   # a partial run

1. Gets transformers' ``tests/trainer/`` at the tag of the installed transformers (a sparse, shallow
   git clone of github.com/huggingface/transformers), or takes them from ``--tests`` (a folder holding
   those files, e.g. a checkout's ``tests/trainer``). Nothing of transformers' is kept in this
   repository. A file that does not import on the installed transformers because the copy is of
   another version gets the edits in PORTS (the same on both sides, listed in the report). The
   ``parameterized`` wheel the tests import is downloaded onto their path where it is not installed.
2. Runs each test file with pytest twice, CPU only, ``HF_HUB_OFFLINE=1``: once as written (the real
   Accelerate answers ``import accelerate``), once with a small pytest plugin, loaded by ``-p`` before
   collection, that calls ``hasten.install_as_accelerate()`` (every ``accelerate`` module is then
   hasten's). The plugin of each side records which library answered, and the report refuses a run
   where the hook did not take.
3. Counts, per file: tests passing on Accelerate, and of those how many pass on hasten. A test that
   fails on a side because it needs the Hugging Face Hub (a model or tokenizer id, a dataset;
   offline here) is counted apart as "needs the hub", as are tests skipped on Accelerate (a GPU,
   ``@slow``, a missing package).
4. Writes the section between ``<!-- peer-hf -->`` and ``<!-- /peer-hf -->`` of bench/PEER.md (bench/peer.py
   keeps it when it rewrites the file): the table, each test that passes on Accelerate and fails on
   hasten with its error and the reason (REASONS below), and the tests failing on both.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from peer import PARAMETERIZED_VERSION, _env, _run, log  # noqa: E402 - bench/ is not a package

REPO = "https://github.com/huggingface/transformers"
# transformers' Trainer test files that run on CPU (the distributed/, DeepSpeed, FSDP-on-GPU,
# TPU and context-parallel ones need several GPUs or packages hasten refuses).
TEST_FILES = [
    "test_trainer_accelerator.py",
    "test_trainer_evaluation.py",
    "test_trainer_resume.py",
    "test_gradient_clipping.py",
    "test_trainer_callback.py",
    "test_trainer_checkpointing.py",
    "test_trainer_data.py",
    "test_trainer_optimizers.py",
    "test_trainer_utils.py",
    "test_trainer.py",
    "test_training_args.py",
    "test_loss_reduction.py",
    "test_trainer_optimizer_skip.py",
    "test_trainer_sampler_seed.py",
    "test_trainer_autocast.py",
    "test_skip_logits_eval.py",
]
HELPERS = ["__init__.py", "trainer_test_utils.py"]
NOT_RUN = {
    "distributed/*, test_trainer_distributed*.py, test_trainer_fsdp.py, test_trainer_context_parallel*.py, "
    "test_trainer_tpu.py": "several GPUs, DeepSpeed, TPU/XLA (refused by hasten) or torchrun launches of "
    "transformers' own scripts",
    "test_trainer_seq2seq.py, test_trainer_resume_llm.py": "every test loads a model or dataset from the Hugging "
    "Face Hub (offline here) or is `@slow`",
    "test_trainer_hyperparameter.py, test_tensordict_compatibility.py": "Optuna, Ray Tune, W&B sweeps or "
    "tensordict, not installed here",
    "test_data_collator.py": "data collators only: no Trainer, nothing of Accelerate's",
    "test_multi_loss.py, test_per_sample_nested.py, test_trainer_moe_loss.py, test_data_producer.py, "
    "test_emergency_ckpt.py, test_trainer_jit_checkpoint.py": "not of transformers 5.25.0: the copies found test "
    "features 5.25.0 lacks (`logging_loss_components`, `flatten_per_sample_nested_batches`, the MoE loss "
    "partitioning, data producers, emergency checkpoints) or, for the JIT checkpoint one, are an older copy of "
    "tests now in test_trainer_checkpointing.py",
}

# Edits making a copy of another transformers version import on the installed one, applied the same
# on both sides: {file: [(pattern, replacement, why)]}.
PORTS: dict[str, list[tuple[str, str, str]]] = {
    "test_trainer_evaluation.py": [
        (
            r"\n\s+GlueDataset,\n\s+GlueDataTrainingArguments,",
            "",
            "GlueDataset was removed from transformers 5; only the @slow MRPC test (skipped here) uses it",
        )
    ],
}

# Why a test that passes on Accelerate fails on hasten: a regex on the test's id or error -> reason.
# Written by hand after reading each failure; a failure without a reason shows none.
REASONS: list[tuple[str, str]] = []

# An error that says the test wanted the Hugging Face Hub (HF_HUB_OFFLINE=1 here).
HUB = re.compile(
    r"huggingface\.co|offline mode|HF_HUB_OFFLINE|LocalEntryNotFoundError|OfflineModeIsEnabled|"
    r"is not a local folder and is not a valid model identifier|couldn't connect to|Cannot find the requested files"
)

PLUGIN = '''"""bench/peer_hf.py's pytest plugin: installs hasten as accelerate before collection (hasten side)."""
import json
import os
import sys

if os.environ.get("PEER_HF_SIDE") == "hasten":
    import hasten

    hasten.install_as_accelerate()


def pytest_sessionfinish(session, exitstatus):
    top = sys.modules.get("accelerate")
    accelerator = getattr(top, "Accelerator", None) if top is not None else None
    # a module of the real Accelerate: a file in its package folder (the hook's top-level module answers hasten's)
    where = os.sep + "accelerate" + os.sep
    loaded = {n: m.__name__ for n, m in list(sys.modules.items()) if n.split(".")[0] == "accelerate"
              and where in str(getattr(m, "__file__", None) or "")}
    with open(os.environ["PEER_HF_RECORD"], "w") as f:
        json.dump({
            "accelerator_module": getattr(accelerator, "__module__", None),
            "real_accelerate_modules": sorted(n for n, name in loaded.items() if name.startswith("accelerate")),
        }, f)
'''


# ---------------------------------------------------------------------- getting the tests
def clone_tests(version: str, work: Path) -> Path:
    """transformers' tests/trainer at tag v{version}: a shallow, sparse clone."""
    dest = work / "transformers-src"
    git = ["git", "-c", "advice.detachedHead=false"]
    subprocess.run(
        [*git, "clone", "-q", "--depth", "1", "--filter=blob:none", "--sparse", "--branch", f"v{version}", REPO, dest],
        check=True,
        timeout=600,
    )
    subprocess.run([*git, "-C", dest, "sparse-checkout", "set", "tests/trainer"], check=True, timeout=600)
    return dest / "tests" / "trainer"


def wheels_for_tests(work: Path) -> list[Path]:
    """The ``parameterized`` wheel transformers' tests import (test_trainer_optimizers.py), downloaded into
    ``work`` and put on the tests' path where this environment lacks it (as bench/peer.py does)."""
    if importlib.util.find_spec("parameterized") is not None:
        return []
    dl = work / "download"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "-q", "--no-deps", "-d", str(dl)]
    subprocess.run([*pip, "--only-binary", ":all:", f"parameterized=={PARAMETERIZED_VERSION}"], check=True, timeout=600)
    return sorted(dl.glob("parameterized-*.whl"))


def stage(source: Path, folder: Path, only: set[str]) -> tuple[list[str], list[str]]:
    """Copies the helpers and test files into folder/tests/trainer; returns the files staged and the ports made."""
    target = folder / "tests" / "trainer"
    target.mkdir(parents=True, exist_ok=True)
    (folder / "tests" / "__init__.py").write_text("")
    (target / "__init__.py").write_text("")
    for name in HELPERS[1:]:
        shutil.copy(source / name, target / name)
    staged, ported = [], []
    for name in TEST_FILES:
        if (only and name not in only) or not (source / name).exists():
            continue
        text = (source / name).read_text()
        for pattern, replacement, why in PORTS.get(name, []):
            text, n = re.subn(pattern, replacement, text)
            if n:
                ported.append(f"{name}: {why}")
        (target / name).write_text(text)
        staged.append(name)
    return staged, ported


# ---------------------------------------------------------------------- running
def run_file(folder: Path, file: str, env: dict[str, str], side: str, timeout: float) -> dict[str, tuple[str, str]]:
    """{test id: (outcome, error)}; outcome passed | failed | skipped | hub; error: its first lines."""
    xml = folder / f"{side}-{file}.xml"
    record = folder / f"{side}-{file}.json"
    env = {**env, "PEER_HF_SIDE": side, "PEER_HF_RECORD": str(record), "HF_HUB_OFFLINE": "1"}
    env.update({"TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "peer_hf_plugin", "-p", "no:cacheprovider", "-o", "addopts="]
    cmd += ["--timeout", "300", "--junitxml", str(xml), "--rootdir", str(folder), f"tests/trainer/{file}"]
    code, out = _run(cmd, folder, env, timeout)
    (folder / f"{side}-{file}.log").write_text(out)
    if not xml.exists():
        why = "timed out" if code is None else f"exited {code}"
        return {f"{file} (the whole file)": ("failed", f"no result: pytest {why}")}
    _check_side(file, side, json.loads(record.read_text()) if record.exists() else {})
    results: dict[str, tuple[str, str]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        tid = f"{cls}.{case.get('name', '')}" if cls and cls != Path(file).stem else case.get("name", "")
        outcome, error = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is None:
                continue
            text = "\n".join(x for x in (el.get("message") or "", el.text or "") if x)
            outcome = "skipped" if tag == "skipped" else ("hub" if HUB.search(text) else "failed")
            error = _first_error(el.get("message") or el.text or "")
            break
        results[tid] = (outcome, error)
    return results


def _check_side(file: str, side: str, seen: dict) -> None:
    """Refuses a run where ``accelerate`` was not the library its side says: on hasten's side,
    ``accelerate.Accelerator`` is hasten's and no module of the real Accelerate was loaded."""
    want = "hasten.accelerator" if side == "hasten" else "accelerate.accelerator"
    real = seen.get("real_accelerate_modules", []) if side == "hasten" else []
    if seen.get("accelerator_module") not in (want, None) or real:  # None: the file never imported accelerate
        raise RuntimeError(
            f"{file} on {side}: accelerate.Accelerator was {seen.get('accelerator_module')}, not {want}"
            + (f"; the real Accelerate's {real[:3]} were loaded" if real else "")
        )


def _first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in lines:  # the exception line, where pytest's message is a source excerpt
        if re.match(r"^(E\s+)?[A-Za-z_.]*(Error|Exception|Interrupt|Failed)\b", ln):
            return ln.removeprefix("E").strip()[:300]
    return (lines[0] if lines else "")[:300]


# ---------------------------------------------------------------------- report
def reason_for(test: str, error: str) -> str:
    for text in (test, error):
        for pattern, reason in REASONS:
            if re.search(pattern, text):
                return reason
    return ""


MARK_BEGIN, MARK_END = "<!-- peer-hf -->", "<!-- /peer-hf -->"


def section(rows: list[dict], info: dict) -> tuple[str, int, int, int]:
    """The markdown section; the tests passing on Accelerate, those passing on hasten too, and hasten's
    own passing count."""
    lines = [
        MARK_BEGIN,
        "## transformers' Trainer tests, on hasten through `install_as_accelerate()`",
        "",
        f"`make peer-hf` (bench/peer_hf.py), {datetime.date.today().isoformat()}: transformers "
        f"{info['transformers']}'s Trainer tests ({info['source']}), each file run by pytest twice, CPU only, "
        "`HF_HUB_OFFLINE=1`: as written, on Accelerate "
        f"{info['accelerate']} (column A), and with a pytest plugin that calls `hasten.install_as_accelerate()` "
        "before collection (column H; every `accelerate` module is hasten's, checked after each run). "
        "Tests that need the Hugging Face Hub (a model, tokenizer or dataset id) fail offline and are counted "
        "apart, as are tests skipped on Accelerate (a GPU, `@slow`, a package not installed). "
        f"Run time {info['elapsed'] / 60:.0f} min.",
        "",
        "| file | tests | skipped on A | need the hub | pass on A | of those, pass on H | pass on H |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    hasten_only, both, other = [], [], []
    tot = {"n": 0, "skip": 0, "hub": 0, "a": 0, "ah": 0, "h": 0}
    for row in rows:
        acc, hst = row["accelerate"], row["hasten"]
        ids = sorted(set(acc) | set(hst))
        n = {
            "n": len(ids),
            "skip": sum(acc.get(t, ("", ""))[0] == "skipped" for t in ids),
            "hub": sum("hub" in (acc.get(t, ("", ""))[0], hst.get(t, ("", ""))[0]) for t in ids),
            "a": sum(acc.get(t, ("", ""))[0] == "passed" for t in ids),
            "ah": sum(acc.get(t, ("", ""))[0] == hst.get(t, ("", ""))[0] == "passed" for t in ids),
            "h": sum(hst.get(t, ("", ""))[0] == "passed" for t in ids),
        }
        for k, v in n.items():
            tot[k] += v
        lines.append(f"| {row['name']} | {n['n']} | {n['skip']} | {n['hub']} | {n['a']} | {n['ah']} | {n['h']} |")
        for t in ids:
            a, h = acc.get(t, ("missing", "did not run")), hst.get(t, ("missing", "did not run"))
            if a[0] == "passed" and h[0] != "passed":
                why = reason_for(f"{row['name']}::{t}", h[1])
                hasten_only.append(f"- `{row['name']}::{t}`: {h[1] or h[0]}" + (f" — **{why}**" if why else ""))
            elif a[0] == h[0] == "failed":
                both.append(f"- `{row['name']}::{t}`: A: {a[1]}" + ("" if h[1] == a[1] else f"; H: {h[1]}"))
            elif a[0] == "failed" and h[0] == "passed":
                other.append(f"- `{row['name']}::{t}`: fails on Accelerate ({a[1]}), passes on hasten")
    pct = 100.0 * tot["ah"] / tot["a"] if tot["a"] else 0.0
    lines.append(
        f"| **total** | **{tot['n']}** | {tot['skip']} | {tot['hub']} | **{tot['a']}** | "
        f"**{tot['ah']} ({pct:.0f}%)** | {tot['h']} |"
    )
    lines += ["", "### Tests that pass on Accelerate and fail on hasten", ""]
    lines += hasten_only or ["None."]
    lines += ["", "### Tests that fail on both (not counted)", ""]
    lines += both or ["None."]
    if other:
        lines += ["", "### Tests that fail on Accelerate and pass on hasten", "", *other]
    if info["ported"]:
        lines += ["", "### Edits to the copies (the same on both sides)", ""]
        lines += [f"- {p}" for p in info["ported"]]
    lines += ["", "### Not run", ""]
    lines += [f"- {files}: {why}" for files, why in NOT_RUN.items()]
    if info["missing"]:
        lines.append(f"- {', '.join(info['missing'])}: not in the copy of the tests used")
    lines.append(MARK_END)
    return "\n".join(lines) + "\n", tot["a"], tot["ah"], tot["h"]


def write_section(path: Path, text: str) -> None:
    """Replaces the peer-hf section of ``path`` (or appends it), leaving the rest as it is."""
    old = path.read_text() if path.exists() else ""
    if MARK_BEGIN in old and MARK_END in old:
        head, rest = old.split(MARK_BEGIN, 1)
        new = head + text.rstrip("\n") + rest.split(MARK_END, 1)[1]
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text
    path.write_text(new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", default="", help="a folder of transformers' tests/trainer files (default: a clone)")
    parser.add_argument("--tests-note", default="", help="where the --tests copy came from, for the report")
    parser.add_argument("--only", default="", help="comma-separated test files to run (default: all)")
    parser.add_argument("--keep", default="", help="work in this folder and keep it (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per file and side")
    parser.add_argument("--out", default=str(BENCH / "PEER.md"))
    args = parser.parse_args()
    only = {x for x in args.only.split(",") if x}
    start = time.monotonic()
    version = importlib.metadata.version("transformers")
    work = Path(args.keep or tempfile.mkdtemp(prefix="hasten-peer-hf-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.tests:
            source, where = Path(args.tests), args.tests_note or f"a copy given with --tests: {args.tests}"
        else:
            try:
                source, where = clone_tests(version, work), f"tag v{version} of {REPO}"
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                raise SystemExit(
                    f"could not clone tag v{version} of {REPO} ({exc}); give a local copy of its tests/trainer "
                    "folder with --tests (make peer-hf PEER_HF_TESTS=/path/to/transformers/tests/trainer)"
                ) from None
        folder = work / "run"
        staged, ported = stage(source, folder, only)
        (work / "plugin").mkdir(exist_ok=True)
        (work / "plugin" / "peer_hf_plugin.py").write_text(PLUGIN)
        env = _env([work / "plugin", ROOT / "src", *wheels_for_tests(work)], work / "config")
        rows = []
        for file in staged:
            log(f"{file}: on Accelerate, then on hasten")
            acc = run_file(folder, file, env, "accelerate", args.timeout)
            hst = run_file(folder, file, env, "hasten", args.timeout)
            rows.append({"name": file, "accelerate": acc, "hasten": hst})
        info = {
            "transformers": version,
            "accelerate": importlib.metadata.version("accelerate"),
            "source": where,
            "elapsed": time.monotonic() - start,
            "ported": ported,
            "missing": [f for f in TEST_FILES if f not in staged and not (only and f not in only)],
        }
        text, n_acc, n_both, _ = section(rows, info)
        write_section(Path(args.out), text)
        log(f"{n_both} of {n_acc} tests passing on Accelerate pass on hasten; wrote {args.out}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
