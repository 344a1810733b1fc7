"""The `hasten` command: launch (real processes through torch.distributed.run), config, env.

Each launch costs a few seconds here, so one launch serves several checks (module-scoped
fixtures), and every launch has a timeout so a hang fails the test instead of blocking it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
import yaml

from hasten.cli import main
from launch_utils import SCRIPTS, free_port, launch, launch_env, read_ranks, start_launch


@pytest.fixture(autouse=True)
def _config_home(tmp_path, monkeypatch):
    """In-process commands read and write their config under tmp_path, never the real home."""
    monkeypatch.setenv("HASTEN_CONFIG_HOME", str(tmp_path / "config-home"))


def _run_python(code: str, *, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], input=stdin, env=env or launch_env(), capture_output=True, text=True, timeout=120
    )


# ----------------------------------------------------------------------------- no torch at start-up

NO_TORCH = """
import sys
from hasten.cli import main
try:
    status = main({argv!r})
except SystemExit as exit:
    status = exit.code
print("STATUS", status)
print("TORCH_LOADED", "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["launch", "--help"],
        ["config", "--default"],
        ["config", "show"],
        ["launch", "missing_script.py"],
        ["merge-weights", "--help"],
        ["estimate-memory", "--help"],
    ],
)
def test_commands_that_must_not_import_torch(argv, tmp_path):
    proc = _run_python(NO_TORCH.format(argv=argv), env=launch_env(HASTEN_CONFIG_HOME=str(tmp_path)))
    assert "TORCH_LOADED False" in proc.stdout, proc.stdout + proc.stderr
    if argv == ["--help"]:
        assert "STATUS 0" in proc.stdout and all(c in proc.stdout for c in ("launch", "config", "env"))
        # every subcommand is listed, with its help line (merge-weights was missing, issue 28)
        for command in ("launch", "demo", "config", "env", "profile-report", "merge-weights", "estimate-memory"):
            assert f"\n    {command} " in proc.stdout, (command, proc.stdout)
        assert "join a save_state checkpoint's model weights" in proc.stdout
    if argv[0] == "merge-weights":  # its own parser answers, without torch
        assert "STATUS 0" in proc.stdout and "usage: hasten merge-weights" in proc.stdout
        assert "checkpoint_directory" in proc.stdout and "--unsafe_serialization" in proc.stdout
    if argv[0] == "config" and argv[1] == "--default":
        saved = yaml.safe_load((tmp_path / "default_config.yaml").read_text())
        # only what was chosen is written: launch decides the rest (one process per GPU, no mixed precision)
        assert set(saved) == {"cpu"}
        assert saved["cpu"] is (not os.path.isdir("/proc/driver/nvidia/gpus"))  # what the question offers
    if argv[-1] == "missing_script.py":  # refused before torch.distributed.run (so any process) starts
        assert "STATUS 2" in proc.stdout
        assert "training script 'missing_script.py' not found" in proc.stderr  # named as given


def test_interactive_config_asks_again_after_a_bad_answer(tmp_path):
    # machines: "0" (refused) then 1; cpu: yes; processes: 2; precision: bf16; accumulation: 4
    answers = "0\n1\nyes\n2\nbf16\n4\n"
    proc = _run_python(
        NO_TORCH.format(argv=["config"]), stdin=answers, env=launch_env(HASTEN_CONFIG_HOME=str(tmp_path))
    )
    assert "STATUS 0" in proc.stdout and "TORCH_LOADED False" in proc.stdout, proc.stdout + proc.stderr
    assert "num_machines must be >= 1, got 0" in proc.stderr
    saved = yaml.safe_load((tmp_path / "default_config.yaml").read_text())
    assert saved["num_machines"] == 1 and saved["cpu"] is True and saved["num_processes"] == 2
    assert saved["mixed_precision"] == "bf16" and saved["gradient_accumulation_steps"] == 4


def test_interactive_config_without_answers_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", open(os.devnull))
    with pytest.raises(SystemExit) as exit:
        main(["config", "--config_file", str(tmp_path / "c.yaml")])
    assert exit.value.code == 2
    assert "end of input" in capsys.readouterr().err
    assert not (tmp_path / "c.yaml").exists()


def test_config_default_keeps_handler_sections_and_takes_flags(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("num_processes: 4\nddp:\n  bucket_cap_mb: 50\n")
    argv = ["config", "--default", "--config_file", str(path), "--num_processes", "2", "--mixed_precision", "fp16"]
    assert main([*argv, "--force"]) == 0  # the file exists: replaced only with --force
    saved = yaml.safe_load(path.read_text())
    assert saved["num_processes"] == 2 and saved["mixed_precision"] == "fp16"
    assert saved["ddp"] == {"bucket_cap_mb": 50}
    assert "gradient_accumulation_steps" not in saved  # not chosen: the script's Accelerator decides
    # only what is set: the flags, cpu and the kept section (issue 61: it wrote 53 null keys of 60)
    assert set(saved) == {"num_processes", "mixed_precision", "cpu", "ddp"} and None not in saved.values()
    assert "kept the handler sections ddp" in capsys.readouterr().out


def test_config_show_precedence_flag_env_file_default(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(
        "num_processes: 4\nmixed_precision: fp16\ngradient_accumulation_steps: 3\nddp: {bucket_cap_mb: 50}\n"
    )
    monkeypatch.setenv("HASTEN_GRADIENT_ACCUMULATION_STEPS", "5")
    assert main(["config", "show", "--config_file", str(path), "--mixed_precision", "bf16"]) == 0
    out = capsys.readouterr().out
    lines = {line.split(":")[0]: line for line in out.splitlines() if not line.startswith(("#", " "))}
    assert f"# config file: {path}" in out
    assert "bf16" in lines["mixed_precision"] and "# flag" in lines["mixed_precision"]
    assert (
        ": 5 " in lines["gradient_accumulation_steps"]
        and "HASTEN_GRADIENT_ACCUMULATION_STEPS" in lines["gradient_accumulation_steps"]
    )
    assert ": 4 " in lines["num_processes"] and "# config file" in lines["num_processes"]
    assert ": 1 " in lines["num_machines"] and "# default" in lines["num_machines"]
    assert "bucket_cap_mb: 50" in out and "DistributedDataParallelKwargs" in out


def test_config_show_reports_a_bad_file_with_its_line(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("num_processes: 2\nddp:\n  bucket_cap_mb: -1\n")
    with pytest.raises(SystemExit):
        main(["config", "show", "--config_file", str(path)])
    err = capsys.readouterr().err
    assert f"{path}, line 3" in err and "bucket_cap_mb" in err


def test_env_prints_what_a_bug_report_needs(tmp_path, monkeypatch, capsys):
    import platform

    import torch

    path = tmp_path / "c.yaml"
    path.write_text("num_processes: 2\n")
    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(path))
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    # a Markdown list to paste into an issue, the config file as a fenced YAML block
    assert out.startswith("Copy and paste the text below into your bug report.\n\n- hasten: 0.1.0\n")
    assert f"- config file: {path}\n- config file content:\n\n  ```yaml\n  num_processes: 2\n  ```" in out
    assert all(line.startswith(("- ", "  ")) for line in out.splitlines()[2:] if line)
    assert "hasten: 0.1.0" in out
    assert f"Python: {platform.python_version()}" in out
    assert f"torch: {torch.__version__}" in out
    assert f"CPU count: {os.cpu_count()}" in out
    assert f"CUDA available: {'yes' if torch.cuda.is_available() else 'no'}" in out
    assert "gloo available: yes" in out and "NCCL available:" in out
    from importlib import metadata

    assert f"safetensors {metadata.version('safetensors')}" in out and "tensorboard " in out
    assert "GPU" in out and "OS: " in out
    if not torch.cuda.is_available():  # fp8 on this machine: torchao's emulation, and why
        assert "- fp8 matmuls: emulated (no CUDA GPU: torchao emulates fp8" in out
    assert "torchao " in out
    assert f"config file: {path}" in out and "num_processes: 2" in out


# ----------------------------------------------------------------------------- flag validation


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--num_processes", "0"], ["--num_processes", ">= 1", "got 0"]),
        (["--num-processes", "two"], ["--num_processes", "integer", "'two'"]),
        (["--main_process_port", "70000"], ["--main_process_port", "<= 65535"]),
        (["--main_process_port", "0"], ["--main_process_port", ">= 1"]),
        (["--gradient_accumulation_steps", "0"], ["--gradient_accumulation_steps", ">= 1"]),
        (["--mixed_precision", "fp4"], ["--mixed_precision", "'no', 'fp16', 'bf16', 'fp8'"]),
        (["--rdzv_backend", "etcd"], ["--rdzv_backend", "'static', 'c10d'"]),
        (["--max_restarts", "-1"], ["--max_restarts", ">= 0"]),
        (["--monitor_interval", "0"], ["--monitor_interval", "> 0"]),
        (
            ["--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "127.0.0.1"],
            ["machine_rank", "0 .. num_machines-1 = 1"],
        ),
        (
            ["--num_machines", "2", "--num_processes", "3", "--main_process_ip", "127.0.0.1"],
            ["num_processes", "multiple of num_machines=2"],
        ),
        (["--num_machines", "2", "--num_processes", "4"], ["main_process_ip", "num_machines=2"]),
    ],
)
def test_bad_flags_are_argparse_errors_naming_the_flag(flags, words, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["launch", *flags, "script.py"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "hasten launch: error:" in err
    for word in words:
        assert word in err


def test_missing_script_and_module_are_named(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["launch", "--num_processes", "2", "nope/train.py", "--lr", "1"])
    err = capsys.readouterr().err
    assert "training script 'nope/train.py' not found" in err  # as the user wrote it: relative stays relative
    assert str(tmp_path) not in err
    with pytest.raises(SystemExit):
        main(["launch", "-m", "no_such_pkg.train"])
    assert "module 'no_such_pkg.train' not found" in capsys.readouterr().err


def test_bad_config_file_stops_the_launch_with_file_and_line(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("num_processes: 2\nddp:\n  bucket_cap: 10\n")
    with pytest.raises(SystemExit):
        main(["launch", "--config_file", str(path), str(SCRIPTS / "cli_report.py")])
    err = capsys.readouterr().err
    assert f"{path}, line 3" in err and "'bucket_cap'" in err and "bucket_cap_mb" in err
    with pytest.raises(SystemExit):
        main(["launch", "--config_file", str(tmp_path / "absent.yaml"), "x.py"])
    assert str(tmp_path / "absent.yaml") in capsys.readouterr().err


def test_split_argv_stops_at_the_script_or_double_dash():
    from hasten.cli.launch import build_parser, split_argv

    parser = build_parser()
    assert split_argv(parser, ["--num_processes", "2", "--cpu", "s.py", "--num_processes", "3"]) == (
        ["--num_processes", "2", "--cpu"],
        ["s.py", "--num_processes", "3"],
    )
    assert split_argv(parser, ["--mixed_precision=bf16", "--", "-odd.py", "--", "x"]) == (
        ["--mixed_precision=bf16"],
        ["-odd.py", "--", "x"],
    )
    assert split_argv(parser, ["-m", "pkg.mod", "a"]) == (["-m"], ["pkg.mod", "a"])


def test_torch_run_arguments():
    from hasten.cli.launch import torch_run_args

    s = {
        "num_machines": 2,
        "num_processes": 4,
        "machine_rank": 1,
        "main_process_ip": "10.0.0.1",
        "main_process_port": 1234,
        "rdzv_backend": "static",
        "max_restarts": 0,
        "monitor_interval": 0.1,
    }
    args = torch_run_args(s, "train.py", False, ["--lr", "1"])
    assert args[:2] == ["--nnodes=2", "--nproc-per-node=2"]
    assert {"--node-rank=1", "--master-addr=10.0.0.1", "--master-port=1234", "--rdzv-backend=static"} <= set(args)
    assert args[-5:] == ["--module", "hasten.cli._child", "train.py", "--lr", "1"]
    c10d = torch_run_args({**s, "rdzv_backend": "c10d"}, "pkg.mod", True, [])
    assert "--rdzv-endpoint=10.0.0.1:1234" in c10d and c10d[-3:] == ["hasten.cli._child", "-m", "pkg.mod"]
    one_machine = torch_run_args(
        {**s, "num_machines": 1, "machine_rank": 0, "main_process_port": None}, "t.py", False, []
    )
    assert not any(a.startswith(("--master-port", "--node-rank")) for a in one_machine)  # torch picks a free port


def test_script_arguments_never_reach_torchruns_parser(tmp_path):
    """`--node A` is an ambiguous abbreviation of torchrun's --node-rank/--node_rank: torch's parser
    refuses it even after the script name (pytorch/pytorch#120601); hasten passes it through."""
    from hasten.cli.launch import torch_run_namespace

    args = torch_run_namespace(
        ["--nnodes=1", "--nproc-per-node=2", "--module", "hasten.cli._child", "t.py", "--node", "A", "--nproc", "3"],
        str(tmp_path),
    )
    assert args.training_script == "hasten.cli._child" and args.module and args.nproc_per_node == "2"
    assert args.training_script_args == ["t.py", "--node", "A", "--nproc", "3"]
    assert args.log_dir == str(tmp_path)


# ----------------------------------------------------------------------------- real launches


@pytest.fixture(scope="module")
def flag_run(tmp_path_factory):
    """2 gloo processes: flags, a config file's handler sections, code-vs-flag disagreement, `--`."""
    out = tmp_path_factory.mktemp("flags")
    cfg = out / "hasten.yaml"
    cfg.write_text(
        "num_processes: 1\nmixed_precision: fp16\nddp:\n  bucket_cap_mb: 50\n  comm_hook: fp16\n"
        "process_group: {timeout: 123}\n"
    )
    proc = launch(
        "--num_processes", "2", "--config_file", cfg, "--mixed_precision", "bf16",
        "--gradient_accumulation_steps", "4",
        "--", SCRIPTS / "cli_report.py", out, "--code-steps", "2", "--nod", "A", "--", "--num_processes", "9",
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return cfg, read_ranks(out, 2)


def test_flags_reach_the_accelerator(flag_run):
    _, ranks = flag_run
    for r, rep in enumerate(ranks):
        assert (rep["rank"], rep["world"], rep["local_rank"]) == (r, 2, r)
        assert rep["device"] == "cpu" and rep["backend"] == "gloo"  # 2 gloo processes without a GPU
        assert rep["mixed_precision"] == "bf16"  # the flag beats the file's fp16
        assert rep["rank_sum"] == 3.0


def test_config_file_handlers_reach_the_accelerator(flag_run):
    cfg, ranks = flag_run
    for rep in ranks:
        assert rep["hasten_env"]["HASTEN_CONFIG_FILE"] == str(cfg)
        assert rep["bucket_bytes_cap"] == 50 * 1024 * 1024
        assert rep["ddp_comm_hook"] == "fp16"
        assert rep["pg_timeout_s"] == 123.0


def test_code_wins_over_the_flag_with_one_warning(flag_run):
    _, ranks = flag_run
    for rep in ranks:
        assert rep["steps"] == 2 and rep["hasten_env"]["HASTEN_GRADIENT_ACCUMULATION_STEPS"] == "4"
        said = [w for w in rep["warnings"] if "gradient_accumulation_steps" in w]
        assert len(said) == 1 and "using 2" in said[0] and "\n" not in said[0]


def test_script_arguments_pass_through_unchanged(flag_run):
    _, ranks = flag_run
    for rep in ranks:
        # "--nod" abbreviates torchrun's --node-rank/--node_rank ambiguously: never seen by its parser
        assert rep["argv"][2:] == ["--code-steps", "2", "--nod", "A", "--", "--num_processes", "9"]
        assert rep["argv"][0] == str(SCRIPTS / "cli_report.py")
        assert rep["name"] == "__main__" and rep["file"] == str(SCRIPTS / "cli_report.py")
        assert rep["path0"] == os.path.realpath(SCRIPTS)


def test_one_process_is_the_same_as_python_script(tmp_path):
    plain, launched = tmp_path / "plain", tmp_path / "launched"
    plain.mkdir()
    launched.mkdir()
    env = launch_env()
    ran = subprocess.run(
        [sys.executable, str(SCRIPTS / "cli_report.py"), str(plain), "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    proc = launch(SCRIPTS / "cli_report.py", launched, "x", env=env, timeout=120)  # no flags at all
    assert proc.returncode == 0, proc.stderr
    a, b = read_ranks(plain, 1)[0], read_ranks(launched, 1)[0]
    assert b["rank_env"] is None and b["world"] == 1
    b["argv"][1] = a["argv"][1]  # only the output folder differs
    assert a == b


@pytest.mark.slow  # > 20 s: make test-slow
def test_two_machines_on_loopback_form_one_world_in_module_mode(tmp_path):
    port = free_port()
    procs = [
        start_launch(
            "--num_machines",
            "2",
            "--machine_rank",
            str(m),
            "--num_processes",
            "4",
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            "-m",
            "cli_report",
            tmp_path,
            cwd=SCRIPTS,
            env=launch_env(CLI_TEST_MACHINE=str(m)),
        )  # fmt: skip
        for m in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    ranks = read_ranks(tmp_path, 4)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["machine_tag"] for r in ranks] == ["0", "0", "1", "1"]
    assert all(r["world"] == 4 and r["local_world"] == "2" and r["rank_sum"] == 10.0 for r in ranks)
    assert all(r["name"] == "__main__" and r["file"] == str(SCRIPTS / "cli_report.py") for r in ranks)


def test_a_crashing_rank_stops_the_run_and_is_named():
    # Rank 0 sleeps 600 s: only the launcher stopping it lets the run end before the timeout.
    # (This launch also uses torch's c10d rendezvous; the others use the default static one.)
    proc = launch("--rdzv_backend", "c10d", "--num_processes", "2", SCRIPTS / "cli_crash.py", "1", timeout=120)
    assert proc.returncode == 1, proc.stderr[-4000:]
    err = proc.stderr
    assert "hasten launch: rank 1 failed first: it exited with code 1" in err
    summary = err[err.index("hasten launch: rank 1 failed first") :]
    assert "---- traceback of rank 1 ----" in summary and 'cli_crash.py", line' in summary
    assert "RuntimeError: boom from rank 1" in summary
    assert "_child.py" not in summary  # the traceback starts in the user's script
    assert "rank 0 also failed: it was killed by signal SIGTERM" in summary


def test_a_hung_collective_fails_after_the_process_group_timeout():
    # Rank 1 sleeps 600 s instead of joining: the 5 s gloo timeout must end the run first.
    proc = launch("--num_processes", "2", SCRIPTS / "cli_timeout.py", timeout=150)
    assert proc.returncode != 0
    assert "all_reduce returned" not in proc.stdout
    assert "hasten launch: rank 0 failed first" in proc.stderr, proc.stderr[-4000:]
    summary = proc.stderr[proc.stderr.index("hasten launch: rank 0 failed first") :]
    assert "timed out" in summary.lower() or "timeout" in summary.lower()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_every_worker(sig, tmp_path):
    launcher = start_launch("--num_processes", "2", SCRIPTS / "cli_sleep.py", tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.2)
        workers = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        family = psutil.Process(launcher.pid).children(recursive=True)
        assert set(workers) <= {p.pid for p in family}
        os.kill(launcher.pid, sig)
        _, err = launcher.communicate(timeout=90)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + sig, err[-3000:]
    assert f"stopped by {signal.Signals(sig).name}" in err
    _, alive = psutil.wait_procs(family, timeout=30)
    assert alive == [], f"orphans left: {alive}"


def test_a_worker_dies_with_its_launcher(tmp_path):
    """torch's agent starts each worker in a session of its own: SIGKILL to the launcher alone (the
    OOM killer, a scheduler) must not leave the worker running, an orphan still in the job's
    collectives that no agent watches."""
    launcher = start_launch(
        "--num_processes", "1", "--max_restarts", "1", SCRIPTS / "cli_sleep.py", tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    worker = None
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pid0").exists():
            assert launcher.poll() is None, "the launcher ended early"
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.1)
        worker = psutil.Process(int((tmp_path / "pid0").read_text()))
        assert worker.ppid() == launcher.pid and os.getpgid(worker.pid) != os.getpgid(launcher.pid)
        launcher.kill()
        launcher.wait(timeout=30)
        _, alive = psutil.wait_procs([worker], timeout=30)
        assert alive == [], "the worker outlived its launcher"
    finally:
        launcher.kill()
        if worker is not None and worker.is_running():
            worker.kill()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the default is one process per GPU")
def test_on_a_gpu_machine_one_process_per_gpu_and_cpu_forces_gloo(tmp_path):
    gpus, cpu = tmp_path / "gpus", tmp_path / "cpu"
    gpus.mkdir()
    cpu.mkdir()
    proc = launch(SCRIPTS / "cli_report.py", gpus, timeout=180)  # no --num_processes: one per GPU
    assert proc.returncode == 0, proc.stderr[-4000:]
    count = torch.cuda.device_count()
    for r, rep in enumerate(read_ranks(gpus, count)):
        assert rep["world"] == count and rep["device"] == f"cuda:{r}"
        assert rep["backend"] == ("nccl" if count > 1 else None)
    proc = launch("--cpu", "--num_processes", "2", SCRIPTS / "cli_report.py", cpu, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rep in read_ranks(cpu, 2):
        assert rep["device"] == "cpu" and rep["backend"] == "gloo" and rep["hasten_env"]["HASTEN_USE_CPU"] == "1"
