"""What `make peer-hf` (bench/peer_hf.py: transformers' Trainer tests on hasten) found and measures.

A prepared loader's ``total_batch_size`` and ``total_dataset_length`` (transformers' Trainer tests read
them; the one hasten-only failure of the first run), against the real Accelerate's where installed; and
the report's bookkeeping: which tests count, which need the hub, and that the section it writes into
bench/PEER.md survives `make peer` rewriting the file.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from hasten.data_loader.prepare import prepare_loader
from hasten.state import GradientState

BENCH = Path(__file__).resolve().parents[1] / "bench"


def rank_state(rank: int, n: int = 2) -> SimpleNamespace:
    return SimpleNamespace(
        num_processes=n, process_index=rank, device=torch.device("cpu"), use_distributed=True, backend="gloo"
    )


class Stream(IterableDataset):
    def __iter__(self):
        return (torch.tensor(i) for i in range(10))

    def __len__(self):
        return 10


CASES = [  # (dataset, batch size, processes, split_batches)
    (list(range(20)), 4, 2, False),
    (list(range(20)), 4, 2, True),
    (list(range(21)), 3, 1, False),
    (Stream(), 2, 2, False),
    (Stream(), 4, 2, True),
]


@pytest.mark.parametrize(("data", "size", "n", "split"), CASES)
def test_total_batch_size_and_dataset_length(data, size, n, split):
    loader = prepare_loader(
        DataLoader(data, batch_size=size),
        rank_state(0, n),
        GradientState(),
        device_placement=False,
        split_batches=split,
    )
    assert loader.total_batch_size == (size if split else size * n)
    assert loader.total_dataset_length == len(data)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="the real accelerate is not installed")
@pytest.mark.parametrize(("data", "size", "n", "split"), [c for c in CASES if isinstance(c[0], list)])
def test_total_batch_size_and_dataset_length_as_accelerates(data, size, n, split):
    """Map-style datasets, what the Trainer prepares. (Over an iterable dataset Accelerate's figures are
    this process's: a batch of 2 where a step of 2 processes takes 4, and its shard's length.)"""
    from accelerate.data_loader import prepare_data_loader

    theirs = prepare_data_loader(
        DataLoader(data, batch_size=size), num_processes=n, process_index=0, split_batches=split, put_on_device=False
    )
    ours = prepare_loader(
        DataLoader(data, batch_size=size),
        rank_state(0, n),
        GradientState(),
        device_placement=False,
        split_batches=split,
    )
    assert (ours.total_batch_size, ours.total_dataset_length) == (theirs.total_batch_size, theirs.total_dataset_length)


def _peer_hf():
    sys.path.insert(0, str(BENCH))
    try:
        import peer_hf
    finally:
        sys.path.remove(str(BENCH))
    return peer_hf


def test_report_counts_only_what_passes_on_accelerate_and_names_hasten_only_failures():
    peer_hf = _peer_hf()
    rows = [
        {
            "name": "test_x.py",
            "accelerate": {
                "A.test_ok": ("passed", ""),
                "A.test_ours_fails": ("passed", ""),
                "A.test_hub": ("hub", "OSError: We couldn't connect to 'https://huggingface.co'"),
                "A.test_gpu": ("skipped", "requires a GPU"),
                "A.test_both": ("failed", "AssertionError: x"),
            },
            "hasten": {
                "A.test_ok": ("passed", ""),
                "A.test_ours_fails": ("failed", "AttributeError: y"),
                "A.test_hub": ("hub", "OSError"),
                "A.test_gpu": ("skipped", "requires a GPU"),
                "A.test_both": ("failed", "AssertionError: x"),
            },
        }
    ]
    info = {"transformers": "5", "accelerate": "1", "source": "here", "elapsed": 60.0, "ported": [], "missing": []}
    text, n_acc, n_both, n_hasten = peer_hf.section(rows, info)
    assert (n_acc, n_both, n_hasten) == (2, 1, 1)
    assert "| test_x.py | 5 | 1 | 1 | 2 | 1 | 1 |" in text
    assert "- `test_x.py::A.test_ours_fails`: AttributeError: y" in text
    assert "- `test_x.py::A.test_both`: A: AssertionError: x" in text
    assert peer_hf.HUB.search("OSError: We couldn't connect to 'https://huggingface.co' to load the files")
    assert not peer_hf.HUB.search("AssertionError: 1 != 2")


def test_the_section_is_replaced_in_place_and_survives_make_peer(tmp_path):
    peer_hf = _peer_hf()
    sys.path.insert(0, str(BENCH))
    try:
        import peer
    finally:
        sys.path.remove(str(BENCH))
    path = tmp_path / "PEER.md"
    path.write_text("# peer\n\nbody\n")
    peer_hf.write_section(path, f"{peer_hf.MARK_BEGIN}\nfirst\n{peer_hf.MARK_END}\n")
    peer_hf.write_section(path, f"{peer_hf.MARK_BEGIN}\nsecond\n{peer_hf.MARK_END}\n")
    text = path.read_text()
    assert text.startswith("# peer\n\nbody\n") and "second" in text and "first" not in text
    assert text.count(peer_hf.MARK_BEGIN) == 1
    peer.write_report([], path, 1.0)  # `make peer` rewrites its part of the file
    text = path.read_text()
    assert "# hasten on Accelerate's own tests" in text and "body" not in text
    assert f"{peer_hf.MARK_BEGIN}\nsecond\n{peer_hf.MARK_END}" in text


def test_the_parameterized_wheel_is_fetched_only_where_missing(tmp_path, monkeypatch):
    """transformers' test_trainer_optimizers.py imports ``parameterized``: the run downloads its wheel onto the
    tests' path where the environment lacks it, and downloads nothing where it is installed."""
    peer_hf = _peer_hf()
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "parameterized-0.9.0-py2.py3-none-any.whl").write_bytes(b"")

    monkeypatch.setattr(peer_hf.subprocess, "run", fake_pip)
    monkeypatch.setattr(peer_hf.importlib.util, "find_spec", lambda name: object())
    assert peer_hf.wheels_for_tests(tmp_path) == [] and calls == []
    monkeypatch.setattr(peer_hf.importlib.util, "find_spec", lambda name: None)
    wheels = peer_hf.wheels_for_tests(tmp_path)
    assert [w.name for w in wheels] == ["parameterized-0.9.0-py2.py3-none-any.whl"]
    assert f"parameterized=={peer_hf.PARAMETERIZED_VERSION}" in calls[0]
