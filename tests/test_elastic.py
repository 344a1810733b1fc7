"""Elastic launch flags (torchrun's spellings too), SLURM settings, resume-or-start.

(Two launches as two nodes of this machine, a node lost and one joining: test_nodes.py.)

Unit tests of the parsing and of the resolved settings; one real launch with SLURM variables
set on this machine and elastic flags (c10d, MIN:MAX machines, rdzv_conf, restarts).
"""

from __future__ import annotations

import argparse
import os
import socket

import pytest

from hasten.cli import main
from hasten.cli._slurm import first_host, slurm_settings
from hasten.cli.launch import check_port, torch_run_args, worker_store_per_round
from hasten.settings.config_file import resolve_settings
from hasten.settings.environment import TORCH_DISABLE_SHARE_RDZV_TCP_STORE as SHARE_STORE_OFF
from hasten.settings.launch_settings import SettingsError, check_launch_settings, parse_setting_text
from launch_utils import SCRIPTS, free_port, launch, launch_env, read_ranks


@pytest.mark.parametrize(
    "nodelist,host",
    [
        ("node01", "node01"),
        ("node01,node02", "node01"),
        ("node[01-04,07]", "node01"),
        ("node[07,01-04]", "node07"),  # as SLURM wrote it: the first entry
        ("gpu[3-5],cpu1", "gpu3"),
        ("rack[1-2]-n[03,05]", "rack1-n03"),
        ("node[01-04,07]-ib,login", "node01-ib"),
        ("10.0.0.5", "10.0.0.5"),
    ],
)
def test_first_host_of_a_node_list(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("bad", ["", "node[01-04", "node]01[", "node[a-b]", ",node1", "no de1"])
def test_bad_node_lists_are_named(bad):
    with pytest.raises(ValueError, match="SLURM node list"):
        first_host(bad)


SLURM = {
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[07-10]",
    "SLURM_NODELIST": "other[1-4]",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_GPUS_ON_NODE": "8",
}


def test_slurm_settings_from_a_step():
    got = slurm_settings(SLURM)
    assert got == {
        "num_machines": (4, "SLURM_NNODES"),
        "machine_rank": (2, "SLURM_NODEID"),
        "main_process_ip": ("gpu07", "SLURM_JOB_NODELIST"),
        "num_processes": (32, "SLURM_GPUS_ON_NODE x machines"),
    }
    # on CPUs (--cpu) the tasks per node count, not the GPUs; SLURM_NODELIST when there is no job list
    cpu = slurm_settings(
        {**{k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "SLURM_NTASKS_PER_NODE": "2(x4)"}, cpu=True
    )
    assert cpu["num_processes"] == (8, "SLURM_NTASKS_PER_NODE x machines")
    assert cpu["main_process_ip"] == ("other1", "SLURM_NODELIST")
    # outside srun (an sbatch script's own shell, a login node): nothing
    assert slurm_settings({k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}) == {}


@pytest.mark.parametrize(
    "var,value,match",
    [("SLURM_NNODES", "x", "SLURM_NNODES must be a number >= 1"), ("SLURM_NODEID", "-1", "SLURM_NODEID must be"),
     ("SLURM_GPUS_ON_NODE", "0", "SLURM_GPUS_ON_NODE must be a number >= 1")],
)  # fmt: skip
def test_bad_slurm_variables_are_named(var, value, match):
    with pytest.raises(ValueError, match=match):
        slurm_settings({**SLURM, var: value})


def test_flags_win_over_slurm_which_wins_over_the_environment_and_file():
    detected = slurm_settings(SLURM)
    env = {"HASTEN_MIXED_PRECISION": "bf16"}
    resolved = resolve_settings({"machine_rank": 3}, None, env, detected=detected)
    assert resolved["machine_rank"] == (3, "flag")
    assert resolved["num_machines"] == (4, "environment SLURM_NNODES")
    assert resolved["main_process_ip"] == ("gpu07", "environment SLURM_JOB_NODELIST")
    assert resolved["num_processes"] == (32, "environment SLURM_GPUS_ON_NODE x machines")
    assert resolved["mixed_precision"] == ("bf16", "environment HASTEN_MIXED_PRECISION")
    with pytest.raises(SettingsError, match=r"machine_rank must be in 0 .. num_machines-1 = 3, got 5"):
        resolve_settings({}, None, {}, detected={**detected, "machine_rank": (5, "SLURM_NODEID")})


def test_elastic_settings_are_checked_and_reach_torchrun():
    base = {"num_machines": 1, "machine_rank": 0, "main_process_ip": "10.0.0.1", "main_process_port": 29400,
            "rdzv_backend": "c10d", "max_restarts": 3, "monitor_interval": 0.5, "num_processes": 2}  # fmt: skip
    args = torch_run_args(
        {**base, "max_machines": 4, "rdzv_conf": "join_timeout=60,last_call_timeout=5"}, "t.py", False, []
    )
    assert args[0] == "--nnodes=1:4"
    assert {"--nproc-per-node=2", "--max-restarts=3", "--monitor-interval=0.5", "--rdzv-backend=c10d",
            "--rdzv-endpoint=10.0.0.1:29400",
            "--rdzv-conf=join_timeout=60,last_call_timeout=5"} <= set(args)  # fmt: skip
    assert torch_run_args({**base, "max_machines": 1, "rdzv_conf": None}, "t.py", False, [])[0] == "--nnodes=1"
    with pytest.raises(SettingsError, match=r"max_machines must be >= num_machines=2 .*got 1"):
        check_launch_settings({**base, "num_machines": 2, "max_machines": 1})
    with pytest.raises(
        SettingsError, match=r"elastic number of machines \(1:4\) needs rdzv_backend 'c10d', got 'static'"
    ):
        check_launch_settings({**base, "rdzv_backend": "static", "max_machines": 4})
    assert parse_setting_text("rdzv_conf", " join_timeout=60 ") == "join_timeout=60"
    for bad in ("join_timeout", "=5", "a=1,,b=2", "a b=1"):
        with pytest.raises(ValueError, match="rdzv_conf must be key=value pairs"):
            parse_setting_text("rdzv_conf", bad)


@pytest.mark.parametrize(
    "argv,said",
    [
        (["--nnodes", "2:1"], "--nnodes must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX, got '2:1'"),
        (["--nnodes", "a"], "--nnodes must be N or MIN:MAX such as 2 or 1:4, got 'a'"),
        (["--nnodes", "2", "--num_machines", "3"], "--nnodes 2 and --num_machines 3 disagree"),
        (["--node_rank", "1", "--machine_rank", "0", "--num_machines", "2"],
         "--node_rank 1 and --machine_rank 0 disagree"),
        (["--master_addr", "a", "--main_process_ip", "b"], "--master_addr a and --main_process_ip b disagree"),
        (["--rdzv_endpoint", "h:99999"], "--rdzv_endpoint must be HOST or HOST:PORT with a port in 1..65535"),
        (["--rdzv_endpoint", "h:1", "--master_port", "2"], "--rdzv_endpoint 1 and --main_process_port 2 disagree"),
        (["--nproc_per_node", "2", "--num_processes", "3", "--cpu"],
         "--nproc_per_node 2 x 1 machine(s) = 2 and --num_processes 3 disagree"),
        (["--nnodes", "1:3"], "elastic number of machines (1:3) needs rdzv_backend 'c10d'"),
        (["--rdzv_conf", "x"], "rdzv_conf must be key=value pairs"),
    ],
)  # fmt: skip
def test_bad_elastic_flags_are_refused_by_name(argv, said, capsys, monkeypatch):
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    with pytest.raises(SystemExit):
        main(["launch", *argv, str(SCRIPTS / "cli_report.py")])
    assert said in capsys.readouterr().err


def test_c10d_with_several_machines_bootstraps_each_round_afresh(monkeypatch):
    """torch 2.13's shared worker store breaks a machine joining a running job (test_nodes.py):
    with c10d and more than one machine, each rendezvous round gets a fresh one."""
    base = {"rdzv_backend": "c10d", "num_machines": 1, "max_machines": 2}
    monkeypatch.delenv(SHARE_STORE_OFF, raising=False)
    worker_store_per_round({**base, "max_machines": 1})  # one machine: the agent's shared store stays
    worker_store_per_round({**base, "rdzv_backend": "static", "num_machines": 2})
    assert SHARE_STORE_OFF not in os.environ
    worker_store_per_round(base)
    assert os.environ[SHARE_STORE_OFF] == "1"
    monkeypatch.setenv(SHARE_STORE_OFF, "0")  # the user's choice wins
    worker_store_per_round({**base, "num_machines": 2, "max_machines": None})
    assert os.environ[SHARE_STORE_OFF] == "0"


def test_a_taken_port_may_be_this_jobs_rendezvous_with_c10d_and_several_machines(capsys):
    """A second launcher of this machine (a second node, or one joining a running job) finds the
    port taken by the first one's rendezvous store, and torch joins it as a client: not refused."""
    parser = argparse.ArgumentParser(prog="hasten launch")
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        settings = {"main_process_port": port, "num_machines": 1, "max_machines": 2, "machine_rank": 0,
                    "rdzv_backend": "c10d"}  # fmt: skip
        resolved = {"main_process_port": (port, "flag")}
        check_port(parser, settings, resolved)
        for other in ({"max_machines": None}, {"rdzv_backend": "static", "num_machines": 2, "max_machines": None}):
            with pytest.raises(SystemExit):  # one machine with c10d, or static: still refused by name
                check_port(parser, {**settings, **other}, resolved)
    assert f"port {port} is taken" in capsys.readouterr().err


def test_slurm_step_with_elastic_flags_launches(tmp_path):
    """As `srun hasten launch ...` on one node: SLURM gives the machines, the rank, the host and
    the processes (2 tasks per node, on CPUs); torchrun's elastic flags on top."""
    env = launch_env(
        SLURM_STEP_ID="0", SLURM_JOB_ID="1", SLURM_NNODES="1", SLURM_NODEID="0",
        SLURM_JOB_NODELIST="localhost", SLURM_NTASKS_PER_NODE="2",
    )  # fmt: skip
    proc = launch(
        "--cpu", "--nnodes", "1:2", "--rdzv_backend", "c10d", "--rdzv_conf", "last_call_timeout=1,join_timeout=60",
        "--master_port", str(free_port()), "--max_restarts", "1", "--monitor_interval", "0.2",
        SCRIPTS / "cli_report.py", tmp_path, env=env, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = read_ranks(tmp_path, 2)
    assert [(r["rank"], r["world"], r["local_world"]) for r in ranks] == [(0, 2, "2"), (1, 2, "2")]
    assert os.path.exists(tmp_path / "rank1.json") and not os.path.exists(tmp_path / "rank2.json")
