"""What a checkpoint at a URL asks of the store (issue 57, bench row 16), one process.

A save into a new folder at an S3 URL lists it without s3fs's probes of an empty prefix (a HEAD
and a second listing); the small items of each DCP file come first in it (DCP stores an item that
every process holds whole, such as AdamW's ``step``, once, in one process's file: a process
reading those reads one short range of another's file, not all of it); a load's ranged reads of
a DCP folder begin when its process has planned them, before the processes agree on the plan,
and are the reads ``read_data`` takes (nothing fetched twice).
"""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest

from hasten.checkpoint import dcp_io, storage
from test_checkpoint_storage import _prepared, _Requests, _same, _step, _weights, s3_server, s3_url, url  # noqa: F401


def test_a_save_into_a_new_s3_folder_lists_without_probes_and_loads_back(s3_url, monkeypatch):  # noqa: F811
    requests = _Requests(monkeypatch)
    acc, model, opt = _prepared(fsdp=True)
    at_save = _weights(acc, model)
    requests.take()
    ck = f"{s3_url}/new"
    acc.save_state(ck)
    sent = requests.take()
    ops = [op for op, _, _ in sent]
    # the marks beside the folder and the folder (both at once), then the commit's check: no HEAD, and no
    # second listing asking whether the new folder's name is a file (s3fs's find of an empty prefix)
    assert ops.count("ListObjectsV2") == 2 + 1, sent
    assert {"HeadObject", "HeadBucket", "CopyObject", "DeleteObjects"}.isdisjoint(ops), sent
    assert ops.count("DeleteObject") == 1, sent  # the mark, once the manifest is written
    _step(model, opt)
    assert acc.load_state(ck) == ck
    assert _same(at_save, _weights(acc, model))
    acc.end_training()


def _sizes_in_file_order(folder: str) -> dict[str, list[int]]:
    """``{file: [bytes of each item's tensor chunk (0: not a tensor), in the order they lie in it]}``."""
    with storage.open(f"{folder}/.metadata", "rb") as f:
        metadata = pickle.load(f)
    by_file: dict[str, list[tuple[int, int]]] = {}
    for index, info in metadata.storage_data.items():
        md = metadata.state_dict_metadata[index.fqn]
        size = 0
        for chunk in getattr(md, "chunks", []):
            if list(chunk.offsets) == list(index.offset or chunk.offsets):
                size = math.prod(chunk.sizes) * md.properties.dtype.itemsize
                break
        by_file.setdefault(info.relative_path, []).append((int(info.offset), size))
    return {name: [size for _, size in sorted(items)] for name, items in by_file.items()}


@pytest.mark.parametrize("where", ["disk", "url"])
def test_the_small_items_of_a_dcp_file_come_first(where, tmp_path, url):  # noqa: F811
    acc = _prepared(fsdp=True)[0]
    ck = str(tmp_path / "ck") if where == "disk" else f"{url}/ck"
    acc.save_state(ck)
    for folder in ("model_0", "optimizer_0"):
        for name, sizes in _sizes_in_file_order(f"{ck}/{folder}").items():
            assert len(sizes) > 1 and sizes == sorted(sizes), (folder, name, sizes)
    acc.end_training()


def test_a_loads_ranged_reads_begin_at_its_plan_and_are_not_fetched_again(url, monkeypatch):  # noqa: F811
    made, planned = [], [False]
    original_ranges = storage.Ranges

    class Recorded(original_ranges):
        def __init__(self, fs, regions):
            made.append((planned[0], list(regions)))
            super().__init__(fs, regions)

    monkeypatch.setattr(storage, "Ranges", Recorded)
    reader_class = dcp_io._verifying_reader(True)
    original_prepare = reader_class.prepare_local_plan

    def prepare(self, plan):
        planned[0] = True
        try:
            return original_prepare(self, plan)
        finally:
            planned[0] = False

    monkeypatch.setattr(reader_class, "prepare_local_plan", prepare)
    acc, model, opt = _prepared(fsdp=True)
    ck = f"{url}/ck"
    acc.save_state(ck)
    at_save = _weights(acc, model)
    _step(model, opt)
    acc.load_state(ck)
    assert _same(at_save, _weights(acc, model))
    # one Ranges per DCP folder (the model's, the optimizer's), each made while its plan was prepared
    assert len(made) == 2 and all(early and regions for early, regions in made), made
    assert {r[0].rsplit("/", 2)[-2] for _, regions in made for r in regions} == {"model_0", "optimizer_0"}
    acc.end_training()


def test_a_plan_that_changed_after_it_was_prepared_is_fetched_anew(url, monkeypatch):  # noqa: F811
    closed = []
    original_close = storage.Ranges.close

    def close(self):
        closed.append(self)
        original_close(self)

    monkeypatch.setattr(storage.Ranges, "close", close)
    reader_class = dcp_io._verifying_reader(True)
    original_prepare = reader_class.prepare_local_plan

    def prepare(self, plan):  # the early fetch is of one item fewer than read_data then reads
        original_prepare(self, dataclasses.replace(plan, items=plan.items[1:]))
        return plan

    monkeypatch.setattr(reader_class, "prepare_local_plan", prepare)
    acc, model, opt = _prepared(fsdp=True)
    ck = f"{url}/ck"
    acc.save_state(ck)
    at_save = _weights(acc, model)
    _step(model, opt)
    acc.load_state(ck)
    assert _same(at_save, _weights(acc, model))  # read from new requests, all of it
    assert len(closed) == 4, closed  # per folder: the early fetch dropped, then read_data's own
    acc.end_training()
