"""Reliability of the launcher and the CLI (issue 29, third round; issue 25 item 4).

* a failed worker's cause on the console: the rank that failed first (also when a collective step
  told another rank first), and the exception's own line, ``Type: message``, last;
* plugin values that every worker's Accelerator would refuse are refused by ``hasten launch``
  before any worker starts, with the Accelerator's message;
* noise: Ctrl-C prints one line, compiled DDP prints no "Profiler record function" per rank,
  ``profile-report`` names a missing input as the input;
* ``hasten config`` (--default and the questions agree; no silent overwrite), ``hasten env --help``;
* ``hasten launch --use_fsdp`` exports ACCELERATE_USE_FSDP for transformers' from_pretrained.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launch_utils import SCRIPTS, launch, launch_env, read_ranks, start_launch

TWO = ("--cpu", "--num_processes", "2")


# ---------------------------------------------------------------------- the cause of a failure


def test_exception_lines_cut_embedded_tracebacks_and_keep_each_ranks_error():
    from hasten.cli._failures import _exception_lines, _final_exception

    message = (
        "CheckpointException: CheckpointException ranks:dict_keys([0, 1])\n"
        "Traceback (most recent call last): (RANK 0)\n"
        '  File "/x/torch/filesystem.py", line 520, in create_stream\n'
        "    with path.open(mode) as stream:\n"
        "OSError: [Errno 28] No space left on device: '/ck/__0_0.distcp'\n"
        "Traceback (most recent call last): (RANK 1)\n"
        '  File "/x/torch/serialization.py", line 854, in __exit__\n'
        "    self.file_like.write_end_of_file()\n"
        "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598\n"
    )
    assert _exception_lines(message) == [
        "CheckpointException: CheckpointException ranks:dict_keys([0, 1])",
        "(RANK 0) OSError: [Errno 28] No space left on device: '/ck/__0_0.distcp'",
        "(RANK 1) RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598",
    ]
    chained = (
        'Traceback (most recent call last):\n  File "a.py", line 1, in <module>\n    f()\n'
        "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        'Traceback (most recent call last):\n  File "a.py", line 3, in <module>\n    g()\n'
        "OSError: [Errno 28] No space left on device: '/ck/model.safetensors'\n"
    )
    assert _final_exception(chained.splitlines()) == [
        "OSError: [Errno 28] No space left on device: '/ck/model.safetensors'"
    ]


def test_a_long_traceback_is_shortened_on_the_console_and_whole_in_the_log():
    from hasten.cli._failures import TRACE_HEAD, TRACE_TAIL, _shortened

    trace = "\n".join(f"line {i}" for i in range(200))
    short = _shortened(trace, "/logs/rank0.log").splitlines()
    assert len(short) == TRACE_HEAD + TRACE_TAIL + 1
    assert short[0] == "line 0" and short[-1] == "line 199"
    assert f"({200 - TRACE_HEAD - TRACE_TAIL} lines left out; all of it is in /logs/rank0.log)" in short[TRACE_HEAD]
    assert _shortened("a\nb", None) == "a\nb"


@pytest.mark.parametrize("cleanup", ["quick", "slow"])
def test_the_rank_that_failed_is_blamed_with_its_own_error_line(cleanup, tmp_path):
    """Rank 0 fails alone in a collective step (disk full); rank 1 is told "failed on process 0"
    at once. quick: rank 0 reports within the grace rank 1 gives it (its own traceback is shown);
    slow: the launcher stops rank 0 before it reports (its error comes from rank 1's report).
    Either way rank 0 is named, and the last line is the OSError with its path."""
    target = "/data/run/checkpoints/checkpoint_3/model.safetensors"
    delay = "0.3" if cleanup == "quick" else "8"
    proc = launch(
        *TWO, "--log_dir", tmp_path / "logs", SCRIPTS / "rel_cli_agree.py", tmp_path, delay, target, timeout=120
    )
    assert proc.returncode == 1, proc.stderr[-4000:]
    err = proc.stderr
    assert "hasten launch: rank 0 failed first" in err and "rank 1 failed first" not in err, err
    assert "hasten launch: rank 1 also failed" in err and ", after rank 0 failed" in err
    last = err.strip().splitlines()[-1]
    assert last == f"hasten launch: rank 0 failed with OSError: [Errno 28] No space left on device: '{target}'", err
    if cleanup == "quick":
        block = err[err.index("---- traceback of rank 0 ----") :]
        assert 'rel_cli_agree.py", line' in block and "raise OSError" in block
    else:
        assert "rank 1 reported its error, and the launcher stopped rank 0 (SIGTERM)" in err
        assert "---- traceback" not in err and "Signal 15" not in err
    assert "No space left on device" in (tmp_path / "logs" / "rank1.log").read_text()


# ---------------------------------------------------------------------- refused before any worker


def _accelerator_message(make) -> str:
    with pytest.raises(ValueError) as info:
        make()
    return str(info.value)


def _plugin_refusals() -> dict[str, tuple[list[str], object]]:
    from hasten import FullyShardedDataParallelPlugin, TorchDynamoPlugin

    return {
        "dynamo_backend": (["--dynamo_backend", "nope"], lambda: TorchDynamoPlugin(backend="nope")),
        "fsdp_version": (["--use_fsdp", "--fsdp_version", "1"], lambda: FullyShardedDataParallelPlugin(fsdp_version=1)),
        "reshard": (
            ["--use_fsdp", "--fsdp_reshard_after_forward", "4"],
            lambda: FullyShardedDataParallelPlugin(reshard_after_forward=4).check_num_processes(2),
        ),
    }


@pytest.mark.parametrize("case", ["dynamo_backend", "fsdp_version", "reshard", "reshard_in_config"])
def test_plugin_values_are_refused_before_any_worker_starts(case, tmp_path):
    refusals = _plugin_refusals()
    flags, make = refusals["reshard" if case == "reshard_in_config" else case]
    if case == "reshard_in_config":
        config = tmp_path / "c.yaml"
        config.write_text("fsdp:\n  reshard_after_forward: 4\n")
        flags = ["--config_file", str(config)]
    expected = _accelerator_message(make)  # the message the Accelerator of each worker gives
    logs = tmp_path / "logs"
    proc = launch(*TWO, *flags, "--log_dir", logs, SCRIPTS / "rel_cli_agree.py", tmp_path, "0", "x", timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"hasten launch: error: {expected}" in proc.stderr, proc.stderr
    assert not logs.exists() and not list(tmp_path.glob("started*"))  # no agent ran, no worker started


def test_torch_test_backends_are_not_offered():
    from hasten import TorchDynamoPlugin
    from hasten.settings.plugins import available_backends

    backends = available_backends()
    assert "aot_eager" in backends and "inductor" in backends
    assert not [b for b in backends if "TESTING_ONLY" in b]
    message = _accelerator_message(lambda: TorchDynamoPlugin(backend="nope"))
    assert "'aot_eager'" in message and "TESTING_ONLY" not in message


# ---------------------------------------------------------------------- noise


def test_ctrl_c_prints_one_line_not_a_traceback_per_rank(tmp_path):
    launcher = start_launch(*TWO, SCRIPTS / "rel_cli_agree.py", tmp_path, "sleep", "x", start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.2)
        os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the launcher's group
        _, err = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
    assert launcher.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err[-3000:]
    assert [line for line in err.splitlines() if line.strip()] == [
        "hasten launch: stopped by SIGINT; all workers were stopped"
    ]


def test_compiled_ddp_prints_no_profiler_notice_and_keeps_the_labels(tmp_path):
    script = tmp_path / "compiled.py"
    script.write_text(
        "import json, os, sys, torch\n"
        "from hasten import Accelerator\n"
        "acc = Accelerator(cpu=True)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model, opt = acc.prepare(model, opt)\n"
        "for _ in range(2):\n"
        "    acc.backward(model(torch.randn(4, 8)).sum()); opt.step(); opt.zero_grad()\n"
        "with acc.profile() as prof:\n"
        "    acc.backward(model(torch.randn(4, 8)).sum()); opt.step(); opt.zero_grad()\n"
        "names = {e.name for e in prof.events()}\n"
        "json.dump({'compiled': type(model).__name__, 'labels': sorted(n for n in names if n.startswith('hasten.'))},\n"
        "          open(os.path.join(sys.argv[1], f'rank{acc.process_index}.json'), 'w'))\n"
    )
    proc = launch(*TWO, "--dynamo_backend", "aot_eager", script, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Profiler record function" not in proc.stderr, proc.stderr[-3000:]
    assert "FutureWarning" not in proc.stderr  # torch.distributed.reduce_op's, at the workers' exit
    for rank in read_ranks(tmp_path, 2):
        assert rank["compiled"] == "OptimizedModule"
        assert {"hasten.forward", "hasten.backward", "hasten.optimizer_step"} <= set(rank["labels"]), rank


def test_profile_report_names_a_missing_input(tmp_path, capsys):
    from hasten.cli import main

    missing = tmp_path / "no_such_traces"
    assert main(["profile-report", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"trace folder {missing} does not exist" in err, err
    assert "cannot write" not in err and not missing.exists()


# ---------------------------------------------------------------------- hasten config and env


def test_env_help_has_a_description(capsys):
    from hasten.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["env", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert "bug report" in out and "config file in use" in out


def _config(argv: list[str], home: Path, answers: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hasten.cli", "config", *argv], input=answers, capture_output=True, text=True,
        timeout=60, env=launch_env(HASTEN_CONFIG_HOME=str(home)),
    )  # fmt: skip


def test_config_default_and_the_default_answers_write_the_same_cpu_and_never_overwrite_silently(tmp_path):
    asked, default = tmp_path / "asked", tmp_path / "default"
    # every question answered with its default (Enter): machines, cpu, processes, precision, accumulation
    first = _config([], asked, answers="\n" * 5)
    assert first.returncode == 0, first.stderr
    second = _config(["--default"], default)
    assert second.returncode == 0, second.stderr
    saved_asked = yaml.safe_load((asked / "default_config.yaml").read_text())
    saved_default = yaml.safe_load((default / "default_config.yaml").read_text())
    assert saved_asked["cpu"] == saved_default["cpu"], (saved_asked, saved_default)

    path = default / "default_config.yaml"
    path.write_text("num_processes: 3\nddp: {bucket_cap_mb: 50}\n")
    refused = _config(["--default", "--num_processes", "2"], default)
    assert refused.returncode == 2 and "exists; nothing was written. Pass --force" in refused.stderr
    assert path.read_text() == "num_processes: 3\nddp: {bucket_cap_mb: 50}\n"
    kept = _config([], default, answers="no\n")  # the questions ask first; "no" keeps the file
    assert kept.returncode == 0 and "kept" in kept.stdout and "Replace it" in kept.stdout
    assert path.read_text() == "num_processes: 3\nddp: {bucket_cap_mb: 50}\n"
    eof = _config([], default, answers="")  # no answer: nothing written
    assert eof.returncode == 2 and path.read_text() == "num_processes: 3\nddp: {bucket_cap_mb: 50}\n"
    replaced = _config([], default, answers="yes\n" + "\n" * 5)
    assert replaced.returncode == 0, replaced.stderr
    assert yaml.safe_load(path.read_text())["ddp"] == {"bucket_cap_mb": 50}  # handler sections kept
    forced = _config(["--default", "--force", "--num_processes", "2"], default)
    assert forced.returncode == 0 and yaml.safe_load(path.read_text())["num_processes"] == 2


# ---------------------------------------------------------------------- FSDP and transformers


def test_use_fsdp_exports_accelerates_variable_from_flags_and_from_the_config_file(tmp_path, monkeypatch):
    from hasten.cli import launch as cli_launch
    from hasten.settings.config_file import load_config, resolve_settings

    monkeypatch.setattr(os, "environ", os.environ.copy())  # export_settings sets variables: undone after
    for name in ("ACCELERATE_USE_FSDP", "HASTEN_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
        os.environ.pop(name, None)
    config = tmp_path / "c.yaml"
    config.write_text("fsdp:\n  cpu_ram_efficient_loading: true\n")
    cfg = load_config(config)
    cli_launch.export_settings(resolve_settings({}, cfg, environ={}), cfg)
    assert os.environ["ACCELERATE_USE_FSDP"] == "true" and os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # left in the shell: --no-use_fsdp must win
    cli_launch.export_settings(resolve_settings({"use_fsdp": False}, None, environ={}), None)
    assert os.environ["ACCELERATE_USE_FSDP"] == "false" and os.environ["HASTEN_USE_FSDP"] == "0"


def test_from_pretrained_under_fsdp_launch_loads_real_weights_on_rank_0_only(tmp_path):
    """transformers reads ACCELERATE_USE_FSDP and FSDP_CPU_RAM_EFFICIENT_LOADING (is_fsdp_enabled,
    with the process group up). transformers 5 loads the checkpoint's tensors on every rank and
    leaves on the meta device, on ranks other than 0, what it would have to create (here
    lm_head.weight, left out of the file); prepare then fills those shards from rank 0."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'hasten[transformers]')")
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path / "tiny-llama"
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=128, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(model_dir)
    weights = load_file(model_dir / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    out.mkdir()
    proc = launch(
        *TWO, "--use_fsdp", "--fsdp_cpu_ram_efficient_loading", "true", SCRIPTS / "rel_cli_from_pretrained.py",
        out, model_dir, timeout=300, env=launch_env(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = read_ranks(out, 2)
    for rank in ranks:
        assert rank["ACCELERATE_USE_FSDP"] == "true" and rank["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
        assert rank["is_fsdp_enabled"] is True and rank["strategy"] == "FSDP2Strategy"
        assert rank["loaded_equal"] is True  # what was read is the file's
        assert rank["refused"].startswith("FullyShardedDataParallelPlugin.reshard_after_forward=4 must divide")
    assert set(ranks[0]["devices"].values()) == {"cpu"}
    assert ranks[1]["devices"]["lm_head.weight"] == "meta"
    assert ranks[0]["same_after_prepare"] is True  # rank 1's shards were filled from rank 0's weights
    assert json.dumps(ranks)  # plain data
