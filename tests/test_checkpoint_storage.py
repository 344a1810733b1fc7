"""Checkpoints at URLs (issue 49): any installed fsspec protocol, through ``checkpoint.storage``.

One process on ``memory://`` (fsspec's in-process store: fast, no server): save and load of both
layouts, automatic naming with rotation, what an interrupted save leaves passed over and cleaned,
a missing or damaged object refused by name, ``save_model`` and ``merge-weights`` to URLs,
``load_model``/``load_checkpoint_in_model``/``load_state_dict`` reading them back (safetensors in
ranged reads, a missing shard named, a torch file naming code refused), a URL never taken as a
local path and a protocol whose package is missing refused by name.

Two processes on S3 (``moto[server]`` started here on 127.0.0.1, ``s3fs`` as the client,
configured by fsspec's environment only): FSDP2 synchronous and asynchronous saves and loads,
rotation, a missing object, a SIGKILL half way through a save (``tests/scripts/storage_s3.py``).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from hasten import Accelerator, FullyShardedDataParallelPlugin
from hasten.checkpoint import executor, files, storage
from hasten.checkpoint.errors import DamagedCheckpoint
from hasten.checkpoint.merge import merge_weights
from hasten.utils import ProjectConfiguration
from launch_utils import SCRIPTS, launch, launch_env


@pytest.fixture
def url(tmp_path):
    """A folder of fsspec's memory store of this test's own (removed afterwards)."""
    import fsspec

    base = f"memory://hasten-tests/{tmp_path.name}"
    yield base
    fs = fsspec.filesystem("memory")
    if fs.exists(base):
        fs.rm(base, recursive=True)


def _names(location: str) -> list[str]:
    return sorted(storage.of(location).listdir(location))


def _prepared(fsdp=False, **kwargs):
    acc = Accelerator(cpu=True, **({"fsdp_plugin": FullyShardedDataParallelPlugin()} if fsdp else {}), **kwargs)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    _step(model, opt)
    return acc, model, opt


def _step(model, opt):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def _weights(acc, model):
    return {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------- one process, memory://


@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.parametrize("async_save", [False, True])
def test_save_and_load_at_a_url_write_every_file_then_the_manifest(url, fsdp, async_save):
    acc, model, opt = _prepared(fsdp)
    at_save = _weights(acc, model)
    ck = f"{url}/run/ck"
    info = acc.save_state(ck, async_save=async_save)
    acc.wait_for_checkpoint()
    assert info == ck  # the URL as given, never a local path
    expected = ["hasten_checkpoint.json", "loop_state.json"]  # "dcp" keeps hasten's names, "full" has Accelerate's
    expected += ["model_0", "optimizer_0", "rank_0.pt"] if fsdp else ["model.safetensors", "optimizer.bin"]
    expected += [] if fsdp else ["random_states_0.pkl"]
    assert _names(ck) == sorted(expected)
    assert _names(f"{url}/run") == ["ck"]  # no mark left beside it
    manifest = json.loads(storage.read_bytes(f"{ck}/hasten_checkpoint.json"))
    assert manifest["layout"] == ("dcp" if fsdp else "full")
    assert all("xxh3_128" in rec or "parts" in rec for rec in manifest["files"].values())  # checksums as on disk
    _step(model, opt)
    assert acc.load_state(ck) == ck
    assert _same(at_save, _weights(acc, model))
    acc.end_training()


def test_automatic_naming_and_total_limit_at_a_url(url):
    project = f"{url}/project"
    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=2)
    assert config.logging_dir is None  # trackers write local files: a URL is no logging_dir
    acc, model, opt = _prepared(project_config=config)
    for _ in range(3):
        _step(model, opt)
        acc.save_state()
    at_last = _weights(acc, model)
    assert _names(f"{project}/checkpoints") == ["checkpoint_1", "checkpoint_2"]  # whole checkpoints deleted
    _step(model, opt)
    assert acc.load_state() == f"{project}/checkpoints/checkpoint_2"
    assert _same(at_last, _weights(acc, model))
    acc.end_training()


def test_a_folder_an_interrupted_save_left_is_passed_over_then_removed_by_the_next_save(url):
    project = f"{url}/project"
    acc, model, opt = _prepared(project_config=ProjectConfiguration(project_dir=project))
    acc.save_state()
    at_save = _weights(acc, model)
    root = f"{project}/checkpoints"
    # what a save killed after its first files leaves: the folder without a manifest, and its mark
    for name in ("checkpoint_1/model.safetensors", ".checkpoint_1.tmp-0123456789ab", "notes/readme.txt"):
        with storage.open(f"{root}/{name}", "wb") as f:
            f.write(b"partial")
    _step(model, opt)
    with pytest.warns(UserWarning, match=r"passed over 'checkpoint_1' \(no hasten_checkpoint.json\)"):
        assert acc.load_state() == f"{root}/checkpoint_0"
    assert _same(at_save, _weights(acc, model))
    with pytest.raises(ValueError, match="has no hasten_checkpoint.json"):
        acc.load_state(f"{root}/checkpoint_1")  # never loaded, even when named
    acc.save_state()
    # the partial folder and its mark are gone; what hasten did not write stays
    assert _names(root) == ["checkpoint_0", "checkpoint_2", "notes"]
    acc.end_training()


def test_a_missing_or_damaged_object_is_refused_by_name_and_nothing_changes(url):
    acc, model, opt = _prepared()
    ck = f"{url}/ck"
    acc.save_state(ck)
    _step(model, opt)
    before = _weights(acc, model)
    data = bytearray(storage.read_bytes(f"{ck}/random_states_0.pkl"))
    data[len(data) // 2] ^= 1
    with storage.open(f"{ck}/random_states_0.pkl", "wb") as f:
        f.write(bytes(data))
    with pytest.raises(DamagedCheckpoint, match=r"'random_states_0.pkl' does not match its checksum"):
        acc.load_state(ck)
    storage.of(ck).remove(f"{ck}/optimizer.bin")
    with pytest.raises(DamagedCheckpoint, match=r"is incomplete: 'optimizer.bin' is missing"):
        acc.load_state(ck)
    assert _same(before, _weights(acc, model))
    acc.end_training()


def test_a_resave_at_a_url_replaces_the_folder_and_a_foreign_folder_is_refused(url):
    acc, model, opt = _prepared()
    ck = f"{url}/ck"
    acc.save_state(ck)
    with storage.open(f"{ck}/stale.bin", "wb") as f:
        f.write(b"from before")
    _step(model, opt)
    acc.save_state(ck)
    assert "stale.bin" not in _names(ck) and "hasten_checkpoint.json" in _names(ck)
    with storage.open(f"{url}/theirs/data.bin", "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(ValueError, match="is not a hasten checkpoint; refusing to replace it"):
        acc.save_state(f"{url}/theirs")
    assert _names(f"{url}/theirs") == ["data.bin"]
    acc.end_training()


def test_save_model_and_merge_weights_write_to_urls(url):
    from safetensors.torch import load

    acc, model, opt = _prepared(fsdp=True)
    full = _weights(acc, model)
    paths = acc.save_model(model, f"{url}/model")
    assert paths == [f"{url}/model/model.safetensors"]
    assert _same(full, load(storage.read_bytes(paths[0])))
    acc.save_state(f"{url}/ck")
    merged = merge_weights(f"{url}/ck", f"{url}/merged")
    assert merged == f"{url}/merged/model.safetensors"
    assert _same(full, load(storage.read_bytes(merged)))
    acc.end_training()


def _no_whole_downloads(monkeypatch):
    """A safetensors file at a URL is read in ranged reads: a download of a whole object fails the test."""

    def refuse(path):
        raise AssertionError(f"{path} was downloaded whole")

    monkeypatch.setattr(storage, "read_bytes", refuse)


def _fresh_model():
    torch.manual_seed(1)
    return torch.nn.Linear(4, 3)


@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.parametrize("shard", ["10GB", 50])  # one model.safetensors; the weight and the bias in two shards
def test_load_model_reads_what_save_model_wrote_at_a_url(url, monkeypatch, fsdp, shard):
    acc, model, _ = _prepared(fsdp=fsdp)
    full = _weights(acc, model)
    paths = acc.save_model(model, f"{url}/model", max_shard_size=shard)
    assert len(paths) == (1 if shard == "10GB" else 3)
    _no_whole_downloads(monkeypatch)
    for source in (f"{url}/model", f"{url}/model/", paths[-1]):  # the folder, with a '/', the file or the index
        other = acc.prepare(_fresh_model())
        assert not _same(full, _weights(acc, other))
        acc.load_model(other, source)
        assert _same(full, _weights(acc, other)), source
    acc.end_training()


def test_load_checkpoint_in_model_and_load_state_dict_read_urls(url, monkeypatch):
    from hasten.utils import load_checkpoint_in_model, load_state_dict

    acc, model, _ = _prepared()
    full = _weights(acc, model)
    single = acc.save_model(model, f"{url}/single")
    sharded = acc.save_model(model, f"{url}/sharded", max_shard_size=50)
    _no_whole_downloads(monkeypatch)
    for source in (f"{url}/single", single[0], f"{url}/sharded", sharded[-1]):
        other = _fresh_model()
        load_checkpoint_in_model(other, source, strict=True)
        assert _same(full, other.state_dict()), source
    assert _same(full, load_state_dict(single[0]))
    acc.end_training()


def test_a_shard_missing_at_a_url_is_refused_by_name_and_the_model_is_unchanged(url):
    from hasten.utils import load_checkpoint_in_model

    acc, model, _ = _prepared()
    paths = acc.save_model(model, f"{url}/model", max_shard_size=50)
    storage.of(url).remove(paths[1])
    missing = paths[1].rpartition("/")[2]
    other = _fresh_model()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(FileNotFoundError, match=rf"load_model: .*index\.json' lists the file '{missing}'"):
        acc.load_model(other, f"{url}/model")
    with pytest.raises(FileNotFoundError, match=rf"load_checkpoint_in_model: .* lists the file '{missing}'"):
        load_checkpoint_in_model(other, f"{url}/model")
    assert _same(before, other.state_dict())
    acc.end_training()


def test_torch_files_at_a_url_load_and_one_naming_code_is_refused(url):
    from hasten.checkpoint.errors import UnsafeCheckpoint
    from hasten.utils import load_checkpoint_in_model

    acc, model, _ = _prepared()
    full = _weights(acc, model)
    paths = acc.save_model(model, f"{url}/bin", safe_serialization=False, max_shard_size=50)
    assert paths[-1].endswith("pytorch_model.bin.index.json")
    other = _fresh_model()
    acc.load_model(other, f"{url}/bin")
    assert _same(full, other.state_dict())
    bad = f"{url}/bad/pytorch_model.bin"
    with storage.open(bad, "wb") as f:
        torch.save({"weight": torch.zeros(3, 4), "bias": torch.zeros(3), "run": os.system}, f)
    other = _fresh_model()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(UnsafeCheckpoint, match="system"):
        acc.load_model(other, f"{url}/bad")
    with pytest.raises(UnsafeCheckpoint, match="system"):
        load_checkpoint_in_model(other, f"{url}/bad")
    assert _same(before, other.state_dict())
    acc.end_training()


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_loading_a_url_whose_protocol_is_not_installed_is_refused_naming_its_package(tmp_path, monkeypatch):
    from hasten.utils import load_checkpoint_in_model, load_state_dict

    monkeypatch.chdir(tmp_path)
    acc, model, _ = _prepared()
    with pytest.raises(ImportError, match=r"load_model\.directory='gs://b/m' .* pip install gcsfs"):
        acc.load_model(model, "gs://b/m")
    with pytest.raises(ImportError, match=r"load_checkpoint_in_model\.checkpoint=.* pip install gcsfs"):
        load_checkpoint_in_model(model, "gs://b/m")
    with pytest.raises(ImportError, match=r"load_state_dict\.checkpoint_file=.* pip install gcsfs"):
        load_state_dict("gs://b/m/model.safetensors")
    assert os.listdir(tmp_path) == []
    acc.end_training()


def test_a_url_is_never_a_local_path_and_a_missing_protocol_is_refused_naming_its_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    acc, model, _ = _prepared()
    with pytest.raises(ValueError, match="names the protocol 'nosuch', which fsspec does not know"):
        acc.save_state("nosuch://bucket/ck")
    with pytest.raises(ValueError, match=r"is a URL, and save_fsdp_model reads and writes local paths only"):
        files.check_path("save_fsdp_model", "output_dir", "s3://bucket/x")  # a call that takes no URL
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(ImportError, match=r"pip install gcsfs\. Nothing was written"):
            acc.save_state("gs://bucket/run/ck")
        with pytest.raises(ImportError, match=r"project_dir='gs://bucket/run' .* pip install gcsfs"):
            ProjectConfiguration(project_dir="gs://bucket/run")
        with pytest.raises(ImportError, match="pip install gcsfs"):
            acc.load_state("gs://bucket/run/ck")
    assert os.listdir(tmp_path) == []  # nothing written, no folder named 'gs:' or 'nosuch:'
    assert storage.check_location("x", "y", f"file://{tmp_path}/a") == f"{tmp_path}/a"  # file:// is the disk
    acc.end_training()


def test_import_hasten_does_not_import_fsspec():
    code = "import sys, hasten; from hasten import Accelerator; print('fsspec' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------- two processes, S3 (moto)


_BUCKETS = itertools.count()


@pytest.fixture(scope="module")
def s3_server():
    """A moto S3 server on 127.0.0.1 (a free port), with one bucket; the environment that points
    fsspec's s3fs at it (what a user sets for a real endpoint)."""
    pytest.importorskip("s3fs", reason="the S3 tests need hasten[s3] (s3fs)")
    server_mod = pytest.importorskip("moto.server", reason="the S3 tests need moto[server]")
    import s3fs

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "FSSPEC_S3_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "NO_PROXY": "127.0.0.1,localhost",
    }
    fs = s3fs.S3FileSystem(
        key="testing", secret="testing", endpoint_url=env["FSSPEC_S3_ENDPOINT_URL"], skip_instance_cache=True
    )
    # moto keeps its buckets in the process, across servers: a bucket of its own for each module using this
    bucket = f"hasten-test-{os.getpid()}-{next(_BUCKETS)}"
    fs.mkdir(bucket)
    yield env, bucket
    server.stop()


@pytest.fixture(scope="module")
def launched_s3(s3_server, tmp_path_factory):
    env, bucket = s3_server
    out = tmp_path_factory.mktemp("s3")
    proc = launch(
        "--num_processes", "2", "--cpu", "--max_restarts", "1", SCRIPTS / "storage_s3.py", out, bucket,
        env=launch_env(TMPDIR=str(out), **env), cwd=str(out), timeout=420,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {a: [json.loads((out / f"attempt{a}_rank{r}.json").read_text()) for r in (0, 1)] for a in (0, 1)}


# the first S3 test runs the launch (about 80 s on a busy 2-core machine): more than pytest's 300 s default allows
_LAUNCH_TIME = pytest.mark.timeout(600)


def _ok(rec):
    assert not (isinstance(rec, dict) and "tb" in rec), rec.get("tb")
    return rec


@_LAUNCH_TIME
def test_s3_fsdp2_sync_and_async_saves_load_back_and_record_what_a_disk_save_records(launched_s3, s3_server):
    bucket = s3_server[1]
    for rec in launched_s3[0]:
        got = _ok(rec["sync_async"])
        assert got["info"] == f"s3://{bucket}/run/sync"
        assert got["sync_loaded_is_at_save"] and got["async_loaded_is_at_save"]
        assert got["returned_before_manifest"]  # the asynchronous save uploads in the background
        # sizes and checksums: the same bytes as the local save's (DCP's .metadata holds a save id of its own)
        assert got["records_differ"] == ["model_0/.metadata", "optimizer_0/.metadata"], got["records_differ"]
        assert "model_0/__1_0.distcp" in got["files"] and got["no_local_s3_folder"]


@_LAUNCH_TIME
def test_s3_automatic_naming_rotates_whole_checkpoints(launched_s3, s3_server):
    bucket = s3_server[1]
    for rec in launched_s3[0]:
        got = _ok(rec["rotation"])
        assert got["left"] == ["checkpoint_1", "checkpoint_2"]  # no marks, no partial folders
        assert got["loaded"] == f"s3://{bucket}/auto/checkpoints/checkpoint_2" and got["loaded_is_last"]


@_LAUNCH_TIME
def test_s3_a_missing_object_is_refused_by_name_on_every_process(launched_s3):
    errors = [_ok(rec["missing"]) for rec in launched_s3[0]]
    for got in errors:
        assert got["error"] is not None and "'model_0/__1_0.distcp' is missing" in got["error"], got["error"]
        assert got["unchanged"]


@_LAUNCH_TIME
def test_s3_a_save_killed_half_way_leaves_the_previous_checkpoint_loadable(launched_s3):
    for rec in launched_s3[0]:
        assert "not_killed" not in rec
    for rec in launched_s3[1]:
        got = _ok(rec["resume"])
        marks = [e for e in got["found"] if e.startswith(".checkpoint_1.tmp-")]
        assert len(marks) == 1 and [e for e in got["found"] if e not in marks] == ["checkpoint_0", "checkpoint_1"]
        assert "hasten_checkpoint.json" not in got["partial"]["files"] and got["partial"]["files"]
        assert got["loaded"].endswith("/killed/checkpoints/checkpoint_0") and got["loaded_is_saved"]
        if rec["rank"] == 0:
            assert (
                len(got["passed_over"]) == 1 and "'checkpoint_1' (no hasten_checkpoint.json)" in got["passed_over"][0]
            )
        assert got["left"] == ["checkpoint_0", "checkpoint_2"]  # the next save removed the partial one


# ---------------------------------------------------------------------- requests at a URL (issue 57)


def test_a_damaged_item_of_a_dcp_file_at_a_url_is_refused_by_its_bytes(url):
    acc, model, opt = _prepared(fsdp=True)
    ck = f"{url}/ck"
    acc.save_state(ck)
    _step(model, opt)
    before = _weights(acc, model)
    path = f"{ck}/model_0/__0_0.distcp"
    data = bytearray(storage.read_bytes(path))
    data[len(data) // 2] ^= 1  # the same size: only the item's checksum can tell
    with storage.open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(DamagedCheckpoint, match=r"'model_0/__0_0.distcp' bytes \d+-\d+ do not match"):
        acc.load_state(ck)
    assert _same(before, _weights(acc, model))
    acc.end_training()


class _Fetches:
    """A filesystem whose ``cat_file`` serves ``data`` and records each range asked; with
    ``together``, each call waits until that many are in progress at once (a barrier: a reader
    that fetched one range at a time would break it)."""

    def __init__(self, data: bytes, together: int = 0) -> None:
        import threading

        self.data, self.asked = data, []
        self.barrier = threading.Barrier(together, timeout=60) if together else None

    def cat_file(self, path, start=None, end=None):
        self.asked.append((path, start, end))
        if self.barrier is not None:
            self.barrier.wait()
        return self.data[start:end]


def test_ranges_share_requests_between_neighbours_split_large_items_and_fetch_concurrently(monkeypatch):
    monkeypatch.setattr(storage, "RANGE_CHUNK", 100)
    monkeypatch.setattr(storage, "RANGE_GAP", 10)
    data = bytes(range(256)) * 4
    # neighbours (and a gap of 10) share a request; 30 bytes further is another; 250 bytes are 3 requests,
    # the last shared with the item 5 bytes after them
    regions = [("u", 0, 20), ("u", 20, 30), ("u", 60, 10), ("u", 100, 5), ("u", 300, 250), ("u", 555, 5)]
    regions += [("v", 0, 8), ("u", 20, 30)]  # an item read twice is fetched once
    fs = _Fetches(data, together=3)  # the first three requests are all in flight at once
    monkeypatch.setattr(storage, "RANGE_AHEAD", 1000)
    ranges = storage.Ranges(fs, regions)
    try:
        for where, offset, length in regions:
            assert bytes(ranges.take(where, offset, length)) == data[offset : offset + length]
    finally:
        ranges.close()
    asked = sorted(fs.asked)
    assert asked == [("u", 0, 70), ("u", 100, 105), ("u", 300, 400), ("u", 400, 500), ("u", 500, 560), ("v", 0, 8)]


def test_ranges_fetch_no_further_ahead_than_allowed_and_say_where_a_file_ends(monkeypatch):
    monkeypatch.setattr(storage, "RANGE_CHUNK", 10)
    monkeypatch.setattr(storage, "RANGE_GAP", 0)
    monkeypatch.setattr(storage, "RANGE_AHEAD", 20)
    fs = _Fetches(bytes(50))
    regions = [("u", i * 20, 10) for i in range(3)] + [("u", 45, 10)]  # the last one runs past the end
    ranges = storage.Ranges(fs, regions)
    try:
        assert len(fs.asked) <= 2  # 20 bytes ahead: two requests before anything is taken
        for where, offset, length in regions[:3]:
            assert ranges.take(where, offset, length) is not None
        assert ranges.take(*regions[3]) is None  # 5 bytes of 10: short, for the reader to refuse
    finally:
        ranges.close()
    assert len(fs.asked) == 4


class _Uploads:
    def __init__(self):
        self.piped, self.opened = [], []

    def pipe_file(self, path, data):
        self.piped.append((path, bytes(data)))

    def open(self, path, mode):
        import io

        stream = io.BytesIO()
        stream.close = lambda: self.opened.append((path, stream.getvalue()))
        return stream


def test_an_upload_is_one_pipe_at_close_and_streams_past_its_limit():
    fs = _Uploads()
    up = storage.Upload(fs, "s3://b/f", limit=10)
    up.write(b"abc")
    up.write(memoryview(b"defg"))
    assert up.tell() == 7 and fs.piped == []  # nothing sent before close
    up.close()
    assert fs.piped == [("s3://b/f", b"abcdefg")] and fs.opened == []
    big = storage.Upload(fs, "s3://b/g", limit=10)
    for chunk in (b"0123456", b"789ab", b"c"):
        big.write(chunk)
    big.close()
    assert fs.opened == [("s3://b/g", b"0123456789abc")] and len(fs.piped) == 1
    dropped = storage.Upload(fs, "s3://b/h", limit=10)
    dropped.write(b"x")
    dropped.discard()
    dropped.close()
    assert len(fs.piped) == 1 and len(fs.opened) == 1  # a failed write sends nothing


class _SlowUploads(_Uploads):
    """Each upload waits until the test lets it go (``go``); one path fails (``fail``)."""

    def __init__(self, fail=None):
        import threading

        super().__init__()
        self.go, self.fail = threading.Event(), fail

    def pipe_file(self, path, data):
        assert self.go.wait(30)
        if path == self.fail:
            raise OSError(28, "No space left on device")
        super().pipe_file(path, data)


def test_uploads_later_go_on_while_the_caller_writes_and_all_end_with_the_block():
    fs = _SlowUploads()
    with executor.uploads_later():
        for name in ("a", "b"):
            up = storage.Upload(fs, f"s3://b/{name}")
            up.write(name.encode())
            up.close()  # returns before its upload ended
        assert fs.piped == []
        fs.go.set()
    assert sorted(fs.piped) == [("s3://b/a", b"a"), ("s3://b/b", b"b")]  # every upload ended at the block's end
    failing = _SlowUploads(fail="s3://b/bad")
    failing.go.set()
    with pytest.raises(OSError, match="s3://b/bad"), executor.uploads_later():  # the failure names its object
        for name in ("ok", "bad"):
            up = storage.Upload(failing, f"s3://b/{name}")
            up.write(b"x")
            up.close()
    assert failing.piped == [("s3://b/ok", b"x")]
    raised = _SlowUploads()
    with pytest.raises(KeyError), executor.uploads_later():  # the block's own error, once its uploads ended
        up = storage.Upload(raised, "s3://b/c")
        up.write(b"c")
        up.close()
        raised.go.set()
        raise KeyError("the save failed")
    assert raised.piped == [("s3://b/c", b"c")]


@pytest.fixture
def s3_url(s3_server, monkeypatch, tmp_path):  # noqa: F811 - s3_server is this module's fixture
    """A folder of the module's moto server, reached through fsspec's configuration."""
    import fsspec.config

    env, bucket = s3_server
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": env["FSSPEC_S3_ENDPOINT_URL"]})
    return f"s3://{bucket}/{tmp_path.name}"


class _Requests:
    """Every request s3fs sends (at aiobotocore's client): ``(operation, key, range)``."""

    def __init__(self, monkeypatch):
        from aiobotocore.client import AioBaseClient

        self.sent: list[tuple[str, str, str | None]] = []
        original = AioBaseClient._make_api_call

        async def counted(client, operation, params):
            self.sent.append((str(operation), str(params.get("Key", "")), params.get("Range")))
            return await original(client, operation, params)

        monkeypatch.setattr(AioBaseClient, "_make_api_call", counted)

    def take(self) -> list[tuple[str, str, str | None]]:
        sent, self.sent = self.sent, []
        return sent


def test_a_resave_at_an_s3_url_lists_its_folder_twice_and_copies_nothing(s3_url, monkeypatch):
    requests = _Requests(monkeypatch)
    acc, model, opt = _prepared(fsdp=True)
    ck = f"{s3_url}/ck"
    acc.save_state(ck)
    _step(model, opt)
    at_save = _weights(acc, model)
    requests.take()
    acc.save_state(ck)  # a re-save: the previous copy deleted, then every file written
    sent = requests.take()
    ops = [op for op, _, _ in sent]
    # the marks beside the folder, the folder before (what to delete) and after (the commit's check)
    assert ops.count("ListObjectsV2") == 3, sent
    assert {"HeadObject", "HeadBucket", "CopyObject"}.isdisjoint(ops), sent  # no probes, no rename
    assert ops.count("DeleteObjects") == 1, sent  # the previous copy in one request, once its manifest went
    puts = [key.split("/ck/")[-1] for op, key, _ in sent if op == "PutObject"]
    assert "model_0/.metadata" in puts and not any(p.endswith(".metadata.tmp") for p in puts), puts
    assert len(sent) <= 16, sent
    _step(model, opt)
    requests.take()
    assert acc.load_state(ck) == ck
    sent = requests.take()
    reads = [(key, rng) for op, key, rng in sent if key.endswith(".distcp")]
    assert reads and all(op == "GetObject" for op, key, _ in sent if key.endswith(".distcp")), sent
    assert all(rng is not None and rng.startswith("bytes=") for _, rng in reads), reads  # ranged, no probe
    assert len({key for key, _ in reads}) == len(reads), reads  # each small file in one request
    ops = [op for op, _, _ in sent]
    # one listing of the folder for every check of the load (the manifest's, each DCP folder's, the rest's)
    assert ops.count("ListObjectsV2") == 1, sent
    # no probe: the manifest is one GET, and each other file is downloaded once, its checksum verified on
    # the bytes then read (.metadata unpickled, loop_state.json and rank_0.pt loaded from them)
    assert "HeadObject" not in ops, sent
    gets = [key.split("/ck/")[-1] for op, key, _ in sent if op == "GetObject"]
    assert len(gets) == len(set(gets)), gets
    assert {"hasten_checkpoint.json", "model_0/.metadata", "optimizer_0/.metadata", "loop_state.json"} <= set(gets)
    assert len(sent) == len(gets) + 1, sent
    assert _same(at_save, _weights(acc, model))
    acc.end_training()
