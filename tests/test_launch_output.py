"""What `hasten launch` prints, captured from real 2-process runs (issue 17 items 3-6, 8, 10, 11;
issue 16 items 6, 7, 9): no OMP_NUM_THREADS banner, no Kineto USDT lines, warnings on one line
from rank 0, one traceback of the rank that failed first (also when it died by a signal and the
agent then stopped the other rank with SIGTERM), the log folder named; Accelerate's flags, typos,
a taken port and absurd process counts refused before anything starts; a closed pipe ends quietly.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hasten.cli import main
from launch_utils import SCRIPTS, launch, launch_env

NOISY = SCRIPTS / "cli_noisy.py"


def _line(text: str) -> int:
    """The line of cli_noisy.py that holds ``text``."""
    return next(i for i, line in enumerate(NOISY.read_text().splitlines(), 1) if text in line)


def _env_without_threads(tmp_path: Path) -> dict[str, str]:
    env = launch_env(TMPDIR=str(tmp_path))
    env.pop("OMP_NUM_THREADS", None)  # as in a fresh shell: torch.distributed.run would print its banner
    env.pop("KINETO_LOG_LEVEL", None)
    return env


def _common_noise_checks(err: str) -> None:
    assert "OMP_NUM_THREADS" not in err and "*****" not in err, err[-3000:]  # torch's banner
    assert "USDT" not in err and "profiler_start" not in err, err[-3000:]  # Kineto
    assert "[rank0]:" not in err and "[rank1]:" not in err  # torch's per-rank traceback prefixes
    # warnings: one line each, the common one once (rank 0), rank 1's own one from rank 1
    common = [line for line in err.splitlines() if "the same warning on every process" in line]
    assert len(common) == 1, err[-3000:]
    assert common[0].endswith(
        f"cli_noisy.py:{_line('the same warning')}: UserWarning: the same warning on every process"
    )
    assert not common[0].startswith("[rank")
    own = [line for line in err.splitlines() if "rank 1 has its own warning" in line]
    assert len(own) == 1 and own[0].startswith("[rank1] "), err[-3000:]
    assert own[0].endswith(f"cli_noisy.py:{_line('its own warning')}: UserWarning: rank 1 has its own warning")
    assert 'warnings.warn("' not in err  # Python's second line (the source line) is not printed


def test_a_raising_rank_gives_one_short_block_without_banner_usdt_or_repeated_warnings(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = launch(
        "--num_processes",
        "2",
        "--cpu",
        NOISY,
        out,
        "raise",
        env=_env_without_threads(tmp_path),
        cwd=SCRIPTS,
        timeout=150,
    )
    err = proc.stderr
    assert proc.returncode == 1, err[-4000:]
    _common_noise_checks(err)
    assert f"\ncli_noisy.py:{_line('the same warning')}: UserWarning" in "\n" + err  # run from its folder: relative
    # threads: cores / processes per machine, set quietly
    expected = str(max(1, len(os.sched_getaffinity(0)) // 2))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["omp"] == expected and r["threads"] == int(expected) for r in ranks), ranks
    # one traceback: rank 1's, once; rank 0's "connection closed by peer" only in the logs
    assert err.count("Traceback (most recent call last)") == 1, err
    assert "boom from rank 1" in err and "Connection closed by peer" not in err
    assert "hasten launch: rank 1 failed first: it exited with code 1" in err
    assert "Sending process" not in err and "failed (exitcode" not in err  # the agent's own lines
    logs = Path(re.search(r"full logs of every rank: (\S+)", err).group(1))
    assert logs.is_dir() and logs.parent == tmp_path  # a temporary folder, kept after the failure
    assert "boom from rank 1" in (logs / "rank1.log").read_text()
    assert "Sending process" in (logs / "launcher.log").read_text()
    rank0 = (logs / "rank0.log").read_text()
    assert "rank 0" in rank0 and ("SIGTERM" in rank0 or "Connection closed by peer" in rank0)


def test_a_rank_killed_by_a_signal_is_blamed_not_the_rank_the_agent_stopped(tmp_path):
    # Rank 1 aborts (SIGABRT: no Python exception, no error file); rank 0 then loses its peer in
    # an all-reduce and is stopped by the agent's SIGTERM. Rank 1 failed first.
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    proc = launch(
        "--num_processes", "2", "--cpu", "--num_cpu_threads_per_process", "3", "--log_dir", "logs", NOISY, out, "abort",
        env=_env_without_threads(tmp_path), cwd=tmp_path, timeout=150,
    )  # fmt: skip
    err = proc.stderr
    assert proc.returncode == 128 + 6, err[-4000:]
    _common_noise_checks(err)
    assert all(json.loads((out / f"rank{r}.json").read_text())["omp"] == "3" for r in range(2))
    assert "hasten launch: rank 1 failed first: it was killed by signal SIGABRT" in err, err
    block = err[err.index("---- traceback of rank 1 ----") :]
    assert "Fatal Python error: Aborted" in block and f'cli_noisy.py", line {_line("    os.abort()")}' in block
    assert "_child.py" not in block and "Extension modules" not in block
    assert "rank 0 also failed" in block
    assert "full logs of every rank: logs" in err  # the folder as given: relative stays relative
    assert (logs / "rank1.log").is_file() and (logs / "launcher.log").is_file()


def test_a_closed_pipe_ends_the_run_quietly(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    command = (
        f"{sys.executable} -m hasten.cli launch --num_processes 2 --cpu {NOISY} {out} print 2>{tmp_path / 'err'}"
        f" | head -n 2; echo ${{PIPESTATUS[0]}} > {tmp_path / 'rc'}"
    )
    proc = subprocess.run(["bash", "-c", command], env=launch_env(), capture_output=True, text=True, timeout=150)
    assert proc.stdout.splitlines() == ["line 0", "line 1"]
    err = (tmp_path / "err").read_text()
    assert "BrokenPipe" not in err and "Traceback" not in err and "hasten launch:" not in err, err[-3000:]
    assert (tmp_path / "rc").read_text().strip() == "141"
    # the parent alone (argparse's help into a closed pipe)
    proc = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m hasten.cli launch --help | head -n 1"],
        env=launch_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.stdout.startswith("usage: hasten launch") and "BrokenPipe" not in proc.stderr


# ----------------------------------------------------------------------------- refused before start


def _error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--num_process", "2"], ["unknown option --num_process; did you mean --num_processes?"]),
        (["--mixed-precison", "bf16"], ["unknown option --mixed-precison; did you mean --mixed-precision?"]),
        (["--verbose"], ["unknown option --verbose", "hasten launch --help"]),
        (  # FSDP1's flag is taken (mapped to FSDP2's), its values checked
            ["--fsdp_sharding_strategy", "FULLY"],
            ["--fsdp_sharding_strategy", "'FULL_SHARD', 'SHARD_GRAD_OP'", "'FULLY'"],
        ),
        (["--fsdp_limit_all_gathers", "true"], ["--fsdp_limit_all_gathers", "FSDP2", "--fsdp_reshard_after_forward"]),
        (
            ["--use_fsdp", "--fsdp_auto_wrap_policy", "layer_wise"],
            ["--fsdp_auto_wrap_policy", "'layer_wise'", "transformer_based_wrap"],
        ),
        (["--use_deepspeed"], ["--use_deepspeed", "DeepSpeed"]),
        (["--dynamo_mode", "fastest"], ["--dynamo_mode", "'fastest'", "max-autotune"]),
        (["--tpu"], ["--tpu", "TPUs are not supported"]),
        (["--gradient_clipping", "1.0"], ["accelerator.clip_grad_norm_"]),
        (["--tee", "3"], ["--log_dir"]),
        (["--debug"], ["--log_dir"]),
        (["--no_python"], ["Python scripts"]),
        (["--multi_cpu", "--multi_gpu"], ["--multi_cpu and --multi_gpu"]),
        (["--gpu_ids", "first"], ["--gpu_ids must be 'all' or GPU numbers"]),
        (["--num_cpu_threads_per_process", "0"], ["--num_cpu_threads_per_process must be an integer >= 1, got 0"]),
        (["--num_processes", "100000"], ["--num_processes 100000", "at most 1024 per machine"]),
    ],
)
def test_accelerate_flags_typos_and_absurd_values_are_answered_before_start(flags, words, capsys):
    err = _error(["launch", *flags, str(NOISY), "x", "ok"], capsys)
    for word in words:
        assert word in err, err


def test_every_accelerate_launch_flag_works_or_names_the_hasten_way():
    from hasten.cli import _accelerate
    from hasten.cli.launch import build_parser

    known = {s for action in build_parser()._actions for s in action.option_strings}
    for name in _accelerate.UNSUPPORTED:
        assert f"--{name}" not in known
        message = _accelerate.advice(f"--{name}")
        assert message.startswith(f"--{name} is an accelerate launch flag that hasten does not implement: ")
    # the ones hasten implements (Accelerate 1.x `accelerate launch --help`)
    for flag in ("--cpu", "--multi_gpu", "--multi_cpu", "--mixed_precision", "--num_processes", "--num_machines",
                 "--num_cpu_threads_per_process", "--gpu_ids", "--same_network", "--machine_rank", "--main_process_ip",
                 "--main_process_port", "--log_dir", "--rdzv_backend", "--max_restarts", "--monitor_interval",
                 "--module", "-m", "--config_file", "--quiet", "-q", "--gradient_accumulation_steps"):  # fmt: skip
        assert flag in known, flag


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_multi_gpu_without_a_gpu_says_so(capsys):
    err = _error(["launch", "--multi_gpu", "--num_processes", "2", str(NOISY), "x", "ok"], capsys)
    assert "--multi_gpu: no CUDA GPU is visible on this machine" in err and "drop --multi_gpu" in err


def test_a_taken_port_is_named_with_the_flag_that_picks_another(capsys):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        err = _error(
            ["launch", "--num_processes", "2", "--main_process_port", str(port), str(NOISY), "x", "ok"], capsys
        )
        assert f"port {port} is taken on this machine" in err and "--main_process_port" in err
        assert "leave the flag out to use a free one" in err and "EADDRINUSE" not in err and "Traceback" not in err
        err = _error(["launch", "--rdzv_backend", "c10d", "--num_processes", "2", "--main_process_port", str(port),
                      str(NOISY), "x", "ok"], capsys)  # fmt: skip
        assert f"port {port} is taken" in err  # c10d would otherwise hang on the stranger's socket


def test_more_processes_than_cores_warns_and_far_more_is_refused(monkeypatch, capsys):
    import argparse

    from hasten.cli import launch as launch_module

    monkeypatch.setattr(launch_module, "_cpu_cores", lambda: 2)
    monkeypatch.setattr(launch_module, "_gpu_count", lambda: 0)
    parser = argparse.ArgumentParser(prog="hasten launch")
    settings = {"num_processes": 4, "num_machines": 1, "cpu": False}
    warning = launch_module.check_process_count(parser, settings, "flag")
    assert warning == (
        "hasten launch: warning: 4 processes on 2 CPU core(s): they share the cores and each runs slower; "
        "--num_processes 2 or fewer is usual"
    )
    assert launch_module.check_process_count(parser, {**settings, "num_processes": 2}, "flag") is None
    with pytest.raises(SystemExit):
        launch_module.check_process_count(parser, {**settings, "num_processes": 17}, "config file")
    err = capsys.readouterr().err
    assert "17 processes on this machine, which has 2 CPU core(s)" in err and "at most 16" in err
    assert "(num_processes from the config file)" in err
    monkeypatch.setattr(launch_module, "_gpu_count", lambda: 2)
    assert "NCCL needs one GPU per process" in launch_module.check_process_count(parser, settings, "flag")


def test_threads_per_process_rule(monkeypatch):
    from hasten.cli import launch as launch_module

    monkeypatch.setattr(launch_module, "_cpu_cores", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch_module.threads_per_process(None, 4) == "4"
    assert launch_module.threads_per_process(None, 32) == "1"
    assert launch_module.threads_per_process(6, 4) == "6"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert launch_module.threads_per_process(None, 4) is None  # the user's own setting stays
    assert launch_module.threads_per_process(5, 4) == "5"  # the flag wins


def test_a_failed_rendezvous_is_one_short_block(monkeypatch, tmp_path, capsys):
    # E.g. the machine hosting the c10d rendezvous is gone: no torch traceback, what to check, the logs.
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from hasten.cli import launch as launch_module

    def lost(_args):
        raise RendezvousConnectionError("The connection to the C10d store has failed. See inner exception for details.")

    monkeypatch.setattr(torch_run, "run", lost)
    monkeypatch.setattr(launch_module, "torch_run_namespace", lambda args, log_dir: None)
    status = launch_module.run_workers(["-m", "hasten.cli._child", "x.py"], log_dir=str(tmp_path / "logs"))
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert "hasten launch: the rendezvous failed: RendezvousConnectionError: The connection to the C10d store" in err
    assert "may be gone, or too few machines joined within join_timeout" in err
    assert f"full logs: {tmp_path / 'logs'}" in err and (tmp_path / "logs").is_dir()
