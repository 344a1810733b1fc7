"""examples/causal_lm.py: a transformers causal LM fine-tuned on hasten. One process learns and saves
a folder transformers loads; the same script under FSDP2 and under Ulysses (2 processes, through
``hasten launch``) prints the one-process losses and learning rates, step by step, and FSDP2 saves
the same weights; shift_labels are built on the whole sequence, so a split keeps every label."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch_utils import launch, launch_env

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'hasten[transformers]')")

EXAMPLE = Path(__file__).parent.parent / "examples" / "causal_lm.py"
ARGS = ("--steps", "12", "--print_every", "1", "--seq_len", "32", "--batch_size", "8", "--lr", "1e-2", "--warmup", "2")
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def _steps(stdout: str) -> list[tuple[float, float]]:
    """(loss, learning rate) of each ``step N: loss L lr R`` line, in order."""
    found = []
    for line in stdout.splitlines():
        if line.startswith("step "):
            words = line.split()
            found.append((float(words[words.index("loss") + 1]), float(words[words.index("lr") + 1])))
    return found


def _done(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("done:"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, a small Llama from its config on the synthetic data: stdout and the saved folder."""
    saved = tmp_path_factory.mktemp("causal_lm") / "model"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *ARGS, "--output_dir", str(saved)],
        env=launch_env(**ENV),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, saved


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("causal_lm_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # main() runs only as a script
    return module


def test_one_process_learns_and_saves_a_folder_transformers_loads(reference):
    stdout, saved = reference
    steps = _steps(stdout)
    assert len(steps) == 12 and _done(stdout) == "done: 12 steps (NO, 1 process(es))"
    losses, lrs = [loss for loss, _ in steps], [lr for _, lr in steps]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3  # it learns
    assert lrs[1] == pytest.approx(1e-2) and lrs[-1] == 0.0  # warm-up to the peak, then down to 0 at the last step
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved, local_files_only=True)
    assert model.config.vocab_size == 256 and model.config.num_hidden_layers == 2


def test_shift_labels_are_built_on_the_whole_sequence_so_a_split_keeps_every_label(example):
    ids = torch.arange(10, 18).reshape(1, 8)
    labels = example.shift_labels_of(ids)
    assert labels.tolist() == [[11, 12, 13, 14, 15, 16, 17, -100]]
    halves = list(zip(ids.chunk(2, dim=1), labels.chunk(2, dim=1)))  # what 2 sp processes hold
    assert halves[0][1].tolist() == [[11, 12, 13, 14]]  # the border's label (14) stays with the first half
    per_slice = torch.cat([example.shift_labels_of(part) for part, _ in halves], dim=1)
    assert (per_slice == -100).sum() == 2 and per_slice[0, 3] == -100  # shifted after the split, it is lost
    # transformers scores shift_labels as given: the loss the script asks for is the model's own shifted loss
    torch.manual_seed(0)
    model = example.build_model(None, 8)
    ids = torch.randint(0, 256, (2, 8))
    own = model(input_ids=ids, labels=ids).loss
    given = model(input_ids=ids, labels=example.shift_labels_of(ids), shift_labels=example.shift_labels_of(ids)).loss
    torch.testing.assert_close(given, own)


def test_a_local_model_folder_and_a_local_text_file(example, reference, tmp_path):
    _, saved = reference
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12, encoding="utf-8")
    args = ["--model", str(saved), "--data", str(text), "--seq_len", "32", "--batch_size", "2", "--steps", "3"]
    losses = example.main([*args, "--print_every", "1"])  # a folder without a tokenizer: the text as bytes
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    rows = example.text_rows(str(text), None, 32, 256)
    assert rows.shape == (len(text.read_bytes()) // 32, 32) and rows[0, :3].tolist() == list(b"The")
    text.write_text("too short", encoding="utf-8")
    with pytest.raises(ValueError, match=r"--data .* holds 9 tokens, fewer than one row of --seq_len 32"):
        example.text_rows(str(text), None, 32, 256)
    with pytest.raises(ValueError, match="needs a vocabulary of 256, the model has 64"):
        example.text_rows(str(text), None, 4, 64)


def _two_processes(reference, tmp_path, *extra: str) -> tuple[str, list[tuple[float, float]]]:
    proc = launch("--cpu", "--num_processes", "2", EXAMPLE, *ARGS, *extra, env=launch_env(**ENV), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps, mine = _steps(reference[0]), _steps(proc.stdout)
    assert len(mine) == len(steps) == 12
    for step, ((loss, lr), (ref_loss, ref_lr)) in enumerate(zip(mine, steps), 1):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5), step  # the same rows, the same updates
        assert lr == ref_lr, step
    return proc.stdout, mine


@pytest.mark.slow
def test_fsdp2_on_two_processes_trains_as_one_process_does(reference, tmp_path):
    stdout, _ = _two_processes(reference, tmp_path, "--fsdp", "--output_dir", str(tmp_path / "model"))
    assert _done(stdout) == "done: 12 steps (FSDP, 2 process(es))"
    from safetensors.torch import load_file

    ours, ref = load_file(tmp_path / "model" / "model.safetensors"), load_file(reference[1] / "model.safetensors")
    assert sorted(ours) == sorted(ref)  # the whole model, gathered from the shards, under its own names
    for name, value in ref.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_ulysses_on_two_processes_trains_as_one_process_does(reference, tmp_path):
    """sp 2 on 2 processes: one data-parallel group, each sequence split in two; the loss is the
    whole sequences' (the same on both processes), so it is the one-process loss of the same rows."""
    stdout, _ = _two_processes(reference, tmp_path, "--sp_size", "2")
    assert _done(stdout) == "done: 12 steps (Ulysses sp 2, 2 process(es))"
