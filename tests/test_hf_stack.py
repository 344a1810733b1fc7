"""The Hugging Face stack on hasten through install_as_accelerate() (issue 58): TRL, PEFT, the Trainer's
resume across libraries, FSDP2 through the Trainer, diffusers' unconditional training loop.

Each scenario runs the same script under the real Accelerate (the ``parity`` pin) and under the hook,
in two fresh interpreters (the hook is process-wide), and compares the loss of every step: they are
bit-identical. Those runs take minutes on a 2-core machine and are marked slow; the behaviours they
needed (a tracker skips what it cannot log, an Accelerate checkpoint without a model file loads) have
fast unit tests here.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hasten import Accelerator
from launch_utils import SCRIPTS, free_port, launch_env

HAS = {name: importlib.util.find_spec(name) is not None for name in ("accelerate", "transformers", "trl", "peft")}
HAS["diffusers"] = importlib.util.find_spec("diffusers") is not None
HAS["tensorboard"] = importlib.util.find_spec("tensorboard") is not None


def needs(*names: str) -> pytest.MarkDecorator:
    missing = [n for n in names if not HAS[n]]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {missing} (the test extra)")


def _start(*command: object, timeout: float) -> tuple[subprocess.Popen, float]:
    proc = subprocess.Popen(
        [str(c) for c in command], env=launch_env(HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    return proc, timeout


def _wait(*started: tuple[subprocess.Popen, float]) -> None:
    """Wait for every process started together (they run at once); each must exit 0."""
    failed = []
    for proc, timeout in started:
        output, _ = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            failed.append(f"{proc.args[1:4]} exited {proc.returncode}:\n{output[-4000:]}")
    assert not failed, "\n".join(failed)


def _result(folder: Path, name: str) -> dict:
    return json.loads((folder / f"{name}.json").read_text())


def _same(ours: list[float], theirs: list[float], n: int) -> None:
    assert len(ours) == len(theirs) == n, (ours, theirs)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-6, (ours, theirs)


def _libraries(ours: dict, theirs: dict, world: int = 1) -> None:
    assert ours["accelerate"] == "hasten.accelerator" and theirs["accelerate"] == "accelerate.accelerator"
    assert ours["world"] == theirs["world"] == world


STACK = SCRIPTS / "hf_stack.py"
DIFFUSERS = SCRIPTS / "hf_diffusers.py"


# ------------------------------------------------------------------ fast: what the scenarios needed


@needs("tensorboard")
def test_tensorboard_skips_values_it_cannot_log_as_accelerates(tmp_path, caplog):
    """diffusers' train_unconditional.py logs ``ema_decay=None`` without EMA: skipped, not an error
    (Accelerate's tracker skips it silently: the diffusers scenario below logs None under both)."""
    from test_tracking import read_events

    acc = Accelerator(log_with="tensorboard", project_dir=tmp_path / "hasten")
    acc.init_trackers("run")
    with caplog.at_level(logging.WARNING):
        acc.log({"loss": 0.5, "ema_decay": None, "sizes": [1, 2], "lr": torch.tensor(0.25)}, step=1)
        acc.log({"loss": 0.25, "group": {"a": 1.0, "b": None}}, step=2)
    acc.end_training()
    events = read_events(tmp_path / "hasten" / "run")
    assert sorted(events.Tags()["scalars"]) == ["loss", "lr"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert sorted(os.listdir(tmp_path / "hasten" / "run")).count("group_a") == 1
    assert "group_b" not in os.listdir(tmp_path / "hasten" / "run")
    for key, kind in (("ema_decay", "NoneType"), ("sizes", "list"), ("group/b", "NoneType")):
        assert f"'{key}' is a {kind}, not logged" in caplog.text, caplog.text


def _accelerate_folder_without_model(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    """An Accelerate save_state folder whose model a save hook took (written as ``unet.pt`` instead)."""
    from test_accelerate_checkpoint import Counter, _objects, _train, _write_accelerate_folder

    model, opt, sched = _objects(mixed_precision="no")
    _train(model, opt, sched)
    _write_accelerate_folder(path, model, opt, sched, Counter(7), step=3)
    os.remove(path / "model.safetensors")
    torch.save(model.state_dict(), path / "unet.pt")
    return model, opt, sched


def test_accelerate_checkpoint_without_a_model_file_loads(tmp_path):
    """diffusers' save hooks pop the weights and write ``unet/``: Accelerate's folder then has
    optimizer, scheduler and random states only; load_state reads it, its load hook the model."""
    from test_accelerate_checkpoint import Counter, _draws, _objects

    path = tmp_path / "checkpoints" / "checkpoint_0"
    model, opt, sched = _accelerate_folder_without_model(path)
    expected = _draws()

    acc = Accelerator(project_dir=tmp_path)
    fresh, fresh_opt, fresh_sched = acc.prepare(*_objects(seed=1))
    counter = Counter()
    acc.register_for_checkpointing(counter)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"holds the weights of 0 model\(s\), but 1 are prepared"):
        acc.load_state(path)  # without a hook taking the model out: refused, nothing changed
    assert counter.value == 0 and all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())

    def load_hook(models, input_dir):
        models.pop().load_state_dict(torch.load(os.path.join(input_dir, "unet.pt")))

    acc.register_load_state_pre_hook(load_hook)
    assert acc.load_state() == str(path)  # found in project_dir as the newest loadable checkpoint
    assert _draws() == expected and counter.value == 7
    for a, b in zip(model.state_dict().values(), acc.unwrap_model(fresh).state_dict().values()):
        assert torch.equal(a, b)
    for k, s in opt.state_dict()["state"].items():
        assert torch.equal(s["exp_avg"], fresh_opt.state_dict()["state"][k]["exp_avg"])
    assert fresh_sched.get_last_lr() == sched.get_last_lr()


# ------------------------------------------------------------------ TRL, PEFT, the Trainer's resume (1 process)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Path]:
    """sft, dpo, lora and full (8 steps, a checkpoint at 4) under each library, the two runs at once."""
    folders = {mode: tmp_path_factory.mktemp(mode) for mode in ("plain", "install")}
    scenarios = "sft,dpo,lora,full"
    _wait(*(_start(sys.executable, STACK, mode, folder, scenarios, timeout=900) for mode, folder in folders.items()))
    return folders


@pytest.mark.slow
@pytest.mark.timeout(1200)  # several interpreters with transformers on 2 shared cores
@needs("accelerate", "transformers", "trl", "peft")
def test_trl_sft_and_dpo_losses_equal_accelerates(one_process):
    for scenario in ("sft", "dpo"):
        ours, theirs = _result(one_process["install"], scenario), _result(one_process["plain"], scenario)
        _libraries(ours, theirs)
        _same(ours["losses"], theirs["losses"], 4)
    assert _result(one_process["install"], "dpo")["margins"] == _result(one_process["plain"], "dpo")["margins"]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # several interpreters with transformers on 2 shared cores
@needs("accelerate", "transformers", "trl", "peft")
def test_peft_lora_through_the_trainer_losses_equal_accelerates(one_process):
    ours, theirs = _result(one_process["install"], "lora"), _result(one_process["plain"], "lora")
    _libraries(ours, theirs)
    _same(ours["losses"], theirs["losses"], 4)
    assert ours["trainable"] == theirs["trainable"] == 1024  # the adapters only: 2 layers x (32x4 + 4x96)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # several interpreters with transformers on 2 shared cores
@needs("accelerate", "transformers", "trl", "peft")
def test_trainer_resumes_a_checkpoint_the_other_library_wrote(one_process, tmp_path):
    full = {mode: _result(folder, "full") for mode, folder in one_process.items()}
    _libraries(full["install"], full["plain"])
    _same(full["install"]["losses"], full["plain"]["losses"], 8)
    assert full["install"]["saved"] == full["plain"]["saved"]
    checkpoint = {mode: one_process[mode] / "full" / "checkpoint-4" for mode in one_process}
    _wait(
        _start(sys.executable, STACK, "install", tmp_path / "ours", "resume", checkpoint["plain"], timeout=600),
        _start(sys.executable, STACK, "plain", tmp_path / "theirs", "resume", checkpoint["install"], timeout=600),
    )
    ours, theirs = _result(tmp_path / "ours", "resume"), _result(tmp_path / "theirs", "resume")
    _libraries(ours, theirs)
    assert ours["steps"] == theirs["steps"] == 8
    _same(ours["losses"], full["plain"]["losses"][4:], 4)  # hasten from Accelerate's = uninterrupted
    _same(theirs["losses"], full["plain"]["losses"][4:], 4)  # and the reverse


@pytest.mark.slow
@pytest.mark.timeout(1200)  # several interpreters with transformers on 2 shared cores
@needs("accelerate", "transformers", "trl", "peft")
def test_trl_and_peft_two_processes_equal_accelerates(tmp_path):
    """``hasten launch --as_accelerate`` (the script unchanged) against torchrun on Accelerate."""
    _wait(
        _start(
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
            STACK, "plain", tmp_path / "theirs", "sft,dpo,lora", timeout=900,
        ),
        _start(
            sys.executable, "-m", "hasten.cli", "launch", "--as_accelerate", "--cpu", "--num_processes", "2",
            "--main_process_port", free_port(), STACK, "plain", tmp_path / "ours", "sft,dpo,lora", timeout=900,
        ),
    )  # fmt: skip
    for scenario in ("sft", "dpo", "lora"):
        ours, theirs = _result(tmp_path / "ours", scenario), _result(tmp_path / "theirs", scenario)
        _libraries(ours, theirs, world=2)
        _same(ours["losses"], theirs["losses"], 4)
    assert _result(tmp_path / "ours", "dpo")["margins"] == _result(tmp_path / "theirs", "dpo")["margins"]


# ------------------------------------------------------------------ FSDP2 through the Trainer (2 processes)


FSDP_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_processes: 2
use_cpu: true
mixed_precision: 'no'
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)  # several interpreters with transformers on 2 shared cores
@needs("accelerate", "transformers")
def test_fsdp2_through_the_trainer_two_processes(tmp_path):
    """TrainingArguments(fsdp=..., fsdp_config={"version": 2}) under ``hasten launch --as_accelerate``
    against torchrun on Accelerate, and an Accelerate FSDP config file through ``--config_file``;
    each saves at step 4 and resumes from it. On a CPU, Accelerate 1.15 does not shard (its FSDP
    is for accelerators: MULTI_CPU stays DDP), so its losses are DDP's: FSDP2's must equal them."""
    hasten = [sys.executable, "-m", "hasten.cli", "launch", "--as_accelerate"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    config = tmp_path / "fsdp.yaml"
    config.write_text(FSDP_CONFIG)
    _wait(
        _start(*torchrun, "--master_port", free_port(), STACK, "plain", tmp_path / "theirs", "fsdp", timeout=600),
        _start(
            *hasten,
            "--cpu",
            "--num_processes",
            "2",
            "--main_process_port",
            free_port(),
            STACK,
            "plain",
            tmp_path / "args",
            "fsdp,fsdp_resume",
            timeout=600,
        ),  # fmt: skip
    )
    _wait(
        _start(
            *hasten,
            "--config_file",
            config,
            "--main_process_port",
            free_port(),
            STACK,
            "plain",
            tmp_path / "file",
            "full,resume",
            timeout=600,
        )  # fmt: skip
    )
    theirs = _result(tmp_path / "theirs", "fsdp")
    for ours, resumed in (
        (_result(tmp_path / "args", "fsdp"), _result(tmp_path / "args", "fsdp_resume")),
        (_result(tmp_path / "file", "full"), _result(tmp_path / "file", "resume")),
    ):
        _libraries(ours, theirs, world=2)
        assert ours["param_type"] == "DTensor" and theirs["param_type"] == "Parameter"  # sharded / DDP
        _same(ours["losses"], theirs["losses"], 8)
        assert resumed["steps"] == 8
        _same(resumed["losses"], theirs["losses"][4:], 4)
    args = _result(tmp_path / "args", "fsdp")["saved"]
    assert "pytorch_model_fsdp.bin" in args and "optimizer.bin" in args  # FULL_STATE_DICT (the Trainer's default)
    file = _result(tmp_path / "file", "full")["saved"]
    assert "pytorch_model_fsdp_0" in file and "optimizer_0" in file  # SHARDED_STATE_DICT: DCP folders


# ------------------------------------------------------------------ diffusers' unconditional training loop


@pytest.mark.slow
@pytest.mark.timeout(1200)  # several interpreters with transformers on 2 shared cores
@needs("accelerate", "diffusers", "tensorboard")
def test_diffusers_unconditional_loop_equal_accelerates_and_resumes_its_checkpoint(tmp_path):
    """EMA, save/load pre-hooks that write ``unet/`` themselves, ``ema_decay`` logged to TensorBoard;
    hasten resumes the checkpoint Accelerate wrote (no model file in it) and its own."""
    folders = {mode: tmp_path / mode for mode in ("plain", "install")}
    _wait(*(_start(sys.executable, DIFFUSERS, mode, folder, timeout=600) for mode, folder in folders.items()))
    ours, theirs = (_result(folders[m], "result") for m in ("install", "plain"))
    assert ours["accelerate"] == "hasten.accelerator" and theirs["accelerate"] == "accelerate.accelerator"
    steps = [str(s) for s in range(1, 9)]
    _same([ours["losses"][s] for s in steps], [theirs["losses"][s] for s in steps], 8)
    assert ours["decays"] == theirs["decays"] and ours["ema_step"] == theirs["ema_step"] == 8
    assert ours["ema_sum"] == theirs["ema_sum"] and ours["logs"] == theirs["logs"] == ["train_unconditional"]
    assert "unet" in theirs["saved"] and "model.safetensors" not in theirs["saved"]  # the hook took the model
    _wait(
        _start(sys.executable, DIFFUSERS, "install", tmp_path / "from_theirs", folders["plain"] / "checkpoint-4",
               timeout=600),
        _start(sys.executable, DIFFUSERS, "install", tmp_path / "from_ours", folders["install"] / "checkpoint-4",
               timeout=600),
    )  # fmt: skip
    for folder in ("from_theirs", "from_ours"):
        resumed = _result(tmp_path / folder, "result")
        assert sorted(resumed["losses"], key=int) == steps[4:], resumed
        _same([resumed["losses"][s] for s in steps[4:]], [theirs["losses"][s] for s in steps[4:]], 4)
        assert resumed["ema_step"] == 8 and resumed["ema_sum"] == theirs["ema_sum"]


# ------------------------------------------------------------------ tensor parallelism through the Trainer

TP_SCENARIOS = "tp,tp_resume,tp_full,tp_full_resume"


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory) -> Path:
    """The tp scenarios (8 steps saving at step 4, then resumed from it; each with the default and with the
    Trainer's FULL_STATE_DICT) under ``hasten launch --as_accelerate`` on 2 processes, in one launch."""
    folder = tmp_path_factory.mktemp("tp")
    hasten = [sys.executable, "-m", "hasten.cli", "launch", "--as_accelerate", "--cpu", "--num_processes", "2"]
    _wait(_start(*hasten, "--main_process_port", free_port(), STACK, "plain", folder, TP_SCENARIOS, timeout=600))
    return folder


@pytest.mark.slow
@pytest.mark.timeout(1200)  # several interpreters with transformers on 2 shared cores
@needs("accelerate", "transformers")
def test_tensor_parallelism_through_the_trainer_trains_as_one_process(one_process, tensor_parallel):
    """TrainingArguments(parallelism_config=ParallelismConfig(tp_size=2)): the Trainer builds the
    Accelerator with it, hasten shards the Llama's layers by its tp plan over 2 processes (one
    data-parallel rank), and the 8 steps' losses are one process's on Accelerate. (Accelerate 1.15
    itself refuses a ParallelismConfig on CPU processes, MULTI_CPU, and shards only a model
    transformers sharded at load, from_pretrained(tp_plan="auto").)"""
    theirs = _result(one_process["plain"], "full")
    for scenario in ("tp", "tp_full"):
        ours = _result(tensor_parallel, scenario)
        assert ours["accelerate"] == "hasten.accelerator" and ours["world"] == 2, ours
        assert ours["param_type"] == "DTensor", ours
        assert len(ours["losses"]) == len(theirs["losses"]) == 8
        assert max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])) <= 1e-5, (ours, theirs)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # several interpreters with transformers on 2 shared cores
@needs("accelerate", "transformers")
def test_tensor_parallel_trainer_checkpoints_resume_to_the_uninterrupted_losses(one_process, tensor_parallel):
    """hasten runs tp_size=2 as FSDP2 on the (dp_shard=1, tp=2) mesh and its state names that plugin, so
    the Trainer saves by its FSDP paths, every process gathering (save_pretrained on rank 0 alone cannot
    gather DTensors). Its default SHARDED_STATE_DICT writes DCP folders; fsdp_config={"version": 2} (the
    Trainer's FULL_STATE_DICT) writes the whole weights, equal to one process's checkpoint on Accelerate,
    and the whole optimizer state. Either resumes, optimizer state included, to the uninterrupted losses."""
    sharded, full = _result(tensor_parallel, "tp"), _result(tensor_parallel, "tp_full")
    assert sharded["state_dict_type"] == "SHARDED_STATE_DICT"
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(sharded["saved"]), sharded["saved"]
    assert "model.safetensors" not in sharded["saved"]
    assert {"model.safetensors", "optimizer.bin", "scheduler.pt"} <= set(full["saved"]), full["saved"]
    from safetensors.torch import load_file

    ours = load_file(tensor_parallel / "tp_full" / "checkpoint-4" / "model.safetensors")
    theirs = load_file(one_process["plain"] / "full" / "checkpoint-4" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in theirs)  # gathered, not this process's shards
    assert max((ours[k] - theirs[k]).abs().max().item() for k in theirs) <= 1e-5
    for saved, resumed in (
        (sharded, _result(tensor_parallel, "tp_resume")),
        (full, _result(tensor_parallel, "tp_full_resume")),
    ):
        assert resumed["steps"] == 8 and resumed["world"] == 2, resumed
        assert resumed["adam_steps"] == 8  # the optimizer's 4 steps were loaded (a fresh one would count 4)
        _same(resumed["losses"], saved["losses"][4:], 4)
