"""Issue 57, storage: a failed re-save at a URL keeps the previous checkpoint, a URL is never a local
path (``save``, ``utils.save``/``load``, ``write_basic_config``), typos and odd URLs refused with
one clear error, a dying store one ``CheckpointError`` on every process, no password written in a
URL in any message, nested per-worker folders refused, ``missing_ok`` named, ``naming.py`` split.

One process on ``memory://`` (fsspec's in-process store) and on S3 (moto); two processes (FSDP2)
on a moto server of this module's own, which the script kills during a save
(``tests/scripts/round6_storage_s3.py``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from types import SimpleNamespace

import pytest
import torch

import hasten.utils
from hasten import Accelerator, FullyShardedDataParallelPlugin
from hasten.checkpoint import storage
from hasten.checkpoint.errors import DamagedCheckpoint
from hasten.utils import ProjectConfiguration
from launch_utils import SCRIPTS, launch, launch_env
from test_checkpoint_storage import s3_server  # noqa: F401 - the module's moto server, a fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def url(tmp_path):
    import fsspec

    base = f"memory://hasten-r6/{tmp_path.name}"
    yield base
    fs = fsspec.filesystem("memory")
    if fs.exists(base):
        fs.rm(base, recursive=True)


def _prepared(fsdp=False):
    acc = Accelerator(cpu=True, **({"fsdp_plugin": FullyShardedDataParallelPlugin()} if fsdp else {}))
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


class _Breaks:
    """A registered object whose ``state_dict`` raises once told to."""

    def __init__(self):
        self.fail = False

    def state_dict(self):
        if self.fail:
            raise RuntimeError("state_dict broke")
        return {"n": 1}

    def load_state_dict(self, sd):
        pass


# ---------------------------------------------------------------------- 1. a failed re-save keeps the previous copy


@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.parametrize("async_save", [False, True])
def test_a_resave_at_a_url_that_fails_before_writing_keeps_the_previous_checkpoint(url, fsdp, async_save):
    acc, model, opt = _prepared(fsdp)
    breaks = _Breaks()
    acc.register_for_checkpointing(breaks)
    ck = f"{url}/ck"
    acc.save_state(ck)
    saved = _weights(acc, model)
    before = storage.of(ck).sizes(ck)
    _step(model, opt)
    breaks.fail = True  # a registered object's state_dict raises
    with pytest.raises(RuntimeError, match="state_dict broke"):
        acc.save_state(ck, async_save=async_save)
        acc.wait_for_checkpoint()
    breaks.fail = False

    def hook(models, weights, output_dir):
        raise OSError("the pre-hook broke")

    handle = acc.register_save_state_pre_hook(hook)
    with pytest.raises(Exception, match="the pre-hook broke"):
        acc.save_state(ck, async_save=async_save)
        acc.wait_for_checkpoint()
    handle.remove()
    assert storage.of(ck).sizes(ck) == before  # the previous copy, every object as it was, no mark beside it
    assert [n for n in storage.of(url).listdir(url)] == ["ck"]
    _step(model, opt)
    acc.load_state(ck)
    assert all(torch.equal(v, saved[k]) for k, v in _weights(acc, model).items())
    acc.end_training()


def test_a_pre_hook_at_a_url_writes_a_local_folder_that_lands_in_the_checkpoint(url):
    acc, model, _ = _prepared()
    seen = []

    def hook(models, weights, output_dir):
        seen.append(output_dir)
        with open(os.path.join(output_dir, "extra.txt"), "w") as f:  # plain open: a local folder
            f.write(f"save {len(seen)}")

    acc.register_save_state_pre_hook(hook)
    ck = f"{url}/ck"
    acc.save_state(ck)
    acc.save_state(ck)  # a re-save: the previous copy goes, the hook's new file lands
    assert storage.read_bytes(f"{ck}/extra.txt") == b"save 2"
    assert all(not storage.is_url(d) and not os.path.exists(d) for d in seen)  # removed after each save
    acc.end_training()


# ---------------------------------------------------------------------- 3. a URL is never a local path


def test_save_and_utils_save_write_urls_and_load_reads_them(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    acc, model, _ = _prepared()
    acc.save({"w": torch.arange(3)}, f"{url}/a/obj.pt")
    hasten.utils.save({"w": torch.arange(4)}, f"{url}/b/obj.pt")
    hasten.utils.save({"w": torch.ones(2)}, f"{url}/c/w.safetensors", safe_serialization=True)
    assert torch.equal(hasten.utils.load(f"{url}/a/obj.pt")["w"], torch.arange(3))
    assert torch.equal(hasten.utils.load(f"{url}/b/obj.pt", weights_only=False)["w"], torch.arange(4))
    assert storage.isfile(f"{url}/c/w.safetensors")
    with pytest.raises(ValueError, match=r"write_basic_config\.save_location='memory://x/c\.yaml' is a URL"):
        hasten.utils.write_basic_config(save_location="memory://x/c.yaml")
    with pytest.raises(ValueError, match=r"save\.f='http://127\.0\.0\.1:9/x\.pt'.*read-only"):
        acc.save({"w": 1}, "http://127.0.0.1:9/x.pt")
    assert os.listdir(tmp_path) == []  # no folder named 'memory:' or 'http:'
    acc.end_training()


# ---------------------------------------------------------------------- 4. typos, 5. odd URLs


TYPOS = [
    ("s3:/bucket/x", "s3://bucket/x"),
    ("s3:bucket/x", "s3://bucket/x"),
    ("memory:/bucket/x", "memory://bucket/x"),
    ("file:rel", "rel"),
    ("file:/abs/x", "file:///abs/x"),
]


@pytest.mark.parametrize(("typo", "meant"), TYPOS)
def test_a_one_character_typo_of_a_url_is_refused_naming_the_url_meant(typo, meant, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    acc, model, _ = _prepared()
    said = f"not a URL.*did you mean '{meant}'"
    for call in (
        lambda: acc.save_state(typo),
        lambda: acc.load_state(typo),
        lambda: acc.save({"a": 1}, typo),
        lambda: hasten.utils.save({"a": 1}, typo),
        lambda: acc.save_model(model, typo),
        lambda: ProjectConfiguration(project_dir=typo),
        lambda: hasten.utils.write_basic_config(save_location=typo),
    ):
        with pytest.raises(ValueError, match=said):
            call()
    assert os.listdir(tmp_path) == []
    acc.save_state("s3")  # a local folder named like a protocol, without a colon, is a folder
    assert os.path.isfile(tmp_path / "s3" / "hasten_checkpoint.json")
    acc.end_training()


ODD = [
    ("s3::/x", "chained URL.*target is not a URL: did you mean 's3://x'"),
    ("memory:///x", None),  # memory's paths may start with '/': allowed
    ("s3:///x", "names no bucket or host: did you mean 's3://x'"),
    ("s3://b//x", r"names an empty path segment \('//'\): did you mean 's3://b/x'"),
    ("https://127.0.0.1:9/ck", "fsspec's 'https' protocol is read-only, nothing can be written there"),
]


@pytest.mark.parametrize(("odd", "said"), ODD)
def test_odd_urls_get_one_clear_error_before_anything_is_written(odd, said):
    acc, _, _ = _prepared()
    if said is None:
        acc.save_state(odd)
        assert acc.load_state(odd) == odd
        storage.of(odd).rmtree(odd)
    else:
        with pytest.raises(ValueError, match=said):
            acc.save_state(odd)
    acc.end_training()


def test_a_deeply_nested_manifest_is_a_damaged_checkpoint_naming_the_file(url):
    acc, model, _ = _prepared()
    ck = f"{url}/ck"
    acc.save_state(ck)
    with storage.open(f"{ck}/hasten_checkpoint.json", "wb") as f:
        f.write(b"[" * 5_000_000 + b"]" * 5_000_000)  # 10 MB
    before = _weights(acc, model)
    with pytest.raises(DamagedCheckpoint, match=r"the manifest '.*/ck/hasten_checkpoint\.json' is damaged: its JSON"):
        acc.load_state(ck)
    assert all(torch.equal(v, before[k]) for k, v in _weights(acc, model).items())
    acc.save_state(ck)  # a re-save over it: replaced
    acc.load_state(ck)
    acc.end_training()


# ---------------------------------------------------------------------- 7. secrets


def _shown(exc: BaseException) -> str:
    """Every message a traceback of ``exc`` prints: its own and those of the errors it was raised
    from or during, as Python chains them (the source lines, this file's, are left out)."""
    shown, seen, e = [], set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        shown += traceback.format_exception_only(type(e), e)
        e = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
    return "".join(shown)


def test_a_password_in_a_url_appears_in_no_error(tmp_path):
    acc, _, _ = _prepared()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there: the connection is refused
    cases = [
        (lambda: acc.save_state(f"ftp://u:PW123@127.0.0.1:{port}/x"), "ftp://u:***@127.0.0.1"),
        (lambda: acc.load_state(f"ftp://u:PW123@127.0.0.1:{port}/x"), None),  # the OS's refusal, no URL
        (lambda: acc.load_state("memory://KEY:PW123@b/none"), "memory://KEY:***@b/none"),
        (lambda: acc.save_state("s3://KEY:PW123@/x"), "s3://KEY:***@/x"),
        (lambda: hasten.utils.load("memory://KEY:PW123@b/none.pt"), "KEY:***@"),
    ]
    for call, redacted in cases:
        with pytest.raises(Exception) as info:
            call()
        shown = _shown(info.value)
        assert "PW123" not in shown, shown
        assert redacted is None or redacted in str(info.value), str(info.value)
    acc.end_training()


def test_a_key_and_secret_in_an_s3_url_appear_in_no_error_of_the_storage_library(s3_server, monkeypatch):  # noqa: F811
    env, bucket = s3_server
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    acc, _, _ = _prepared()
    for call in (
        lambda: acc.save_state(f"s3://KEY:SECRET99@{bucket}/x"),
        lambda: acc.load_state(f"s3://KEY:SECRET99@{bucket}/x"),
    ):
        with pytest.raises(Exception) as info:
            call()
        assert "SECRET99" not in _shown(info.value), _shown(info.value)
    acc.end_training()


def test_redact_hides_only_the_password():
    from hasten.settings.locations import redact

    assert redact("at 'ftp://u:PW@h/x' and s3://KEY:SECRET@b/x") == "at 'ftp://u:***@h/x' and s3://KEY:***@b/x"
    assert redact("s3://bucket/a:b@c d:/x@y") == "s3://bucket/a:b@c d:/x@y"


# ---------------------------------------------------------------------- 2. nested Ray folders, 8. missing_ok


def test_nested_per_worker_folders_are_refused_naming_both(tmp_path, monkeypatch):
    from hasten.checkpoint import checkpointer
    from hasten.distributed import ops

    outer, inner = str(tmp_path / "w0"), str(tmp_path / "w0" / "w1")
    monkeypatch.setattr(ops, "gather_object", lambda obj: [(outer, True), (inner, True)])
    ctx = SimpleNamespace(state=SimpleNamespace(use_distributed=True))
    with pytest.raises(ValueError, match=rf"{inner!r} lies inside {outer!r}"):
        checkpointer.own_folders(ctx, outer, False)
    monkeypatch.setattr(ops, "gather_object", lambda obj: [(outer, True), (str(tmp_path / "w1"), True)])
    assert checkpointer.own_folders(ctx, outer, False)  # side by side: each its own
    monkeypatch.setattr(ops, "gather_object", lambda obj: [(outer, True), (str(tmp_path / "w01"), True)])
    assert checkpointer.own_folders(ctx, outer, False)  # a name that starts like another is no nesting


def test_load_state_without_checkpoints_names_missing_ok(tmp_path):
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match=r"load_state\(missing_ok=True\)"):
        acc.load_state()
    assert acc.load_state(missing_ok=True) is None
    acc.end_training()


def test_the_checkpoint_package_keeps_modules_under_500_lines():
    folder = os.path.join(ROOT, "src", "hasten", "checkpoint")
    for name in os.listdir(folder):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                assert sum(1 for _ in f) < 500, name


# ---------------------------------------------------------------------- two processes, S3 (a server killed)


@pytest.fixture(scope="module")
def killable_s3(tmp_path_factory):
    """A moto S3 server in a process of its own (so that the script can kill it), with one bucket."""
    pytest.importorskip("s3fs", reason="the S3 tests need hasten[s3] (s3fs)")
    pytest.importorskip("moto.server", reason="the S3 tests need moto[server]")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=f, stderr=f
        )
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "FSSPEC_S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "NO_PROXY": "127.0.0.1,localhost",
    }
    import s3fs

    deadline = time.monotonic() + 60
    while True:
        try:
            fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=endpoint, skip_instance_cache=True)
            fs.mkdir("hasten-r6")
            break
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"the moto server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
    yield env, "hasten-r6", proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


@pytest.mark.timeout(600)
@pytest.mark.slow  # launches / imports transformers: > 10 s
def test_two_processes_fsdp2_at_s3_failed_resaves_keep_the_previous_copy_and_a_dead_store_is_one_error(
    killable_s3, tmp_path
):
    env, bucket, server = killable_s3
    proc = launch(
        "--num_processes", "2", "--cpu", SCRIPTS / "round6_storage_s3.py", tmp_path, bucket, str(server.pid),
        env=launch_env(TMPDIR=str(tmp_path), **env), cwd=str(tmp_path), timeout=420,
    )  # fmt: skip
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert proc.returncode == 0, proc.stderr[-6000:]
    for rec in ranks:
        assert "tb" not in rec, rec["tb"]
        for case in ("state_dict", "pre_hook"):
            got = rec[case]
            assert got["error"] is not None and got["kept"] == got["before"], got
            assert got["loaded_is_saved"], got
        dead = rec["dead"]
        assert dead["type"] == "CheckpointError", dead  # every process the same type, never botocore's
        assert "cannot write the checkpoint 's3://hasten-r6/run/ck'" in dead["message"], dead
        assert "previous copy in that folder had been deleted" in dead["message"], dead  # the stated loss case
        assert dead["chained"], dead  # raised from the original error


def test_calls_that_write_local_folders_only_refuse_urls_and_typos_by_name(tmp_path, monkeypatch):
    from hasten import ProfileKwargs
    from hasten.utils import offload_state_dict

    monkeypatch.chdir(tmp_path)
    for value, said in (("s3://b/x", "is a URL, and .* local paths only"), ("s3:/b/x", "did you mean 's3://b/x'")):
        with pytest.raises(ValueError, match=r"ProfileKwargs\.output_trace_dir=.*" + said):
            ProfileKwargs(output_trace_dir=value)
        with pytest.raises(ValueError, match=r"offload_state_dict\.save_dir=.*" + said):
            offload_state_dict(value, {"w": torch.ones(2)})
    assert os.listdir(tmp_path) == []
