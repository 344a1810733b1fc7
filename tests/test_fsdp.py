"""FSDP2 on real processes: one 2-process launch of scripts/fsdp_checks.py, many checks;
a 3-process launch for resharding a checkpoint; loading at 1 process and merge-weights here."""

from __future__ import annotations

import json

import pytest
import torch
from fsdp_common import batches, make_model

from conftest import SCRIPTS, torchrun
from hasten import Accelerator, FullyShardedDataParallelPlugin

TOL = 1e-5
PARITY_CASES = [
    "plain",
    "accum4",
    "clip",
    "cpu_offload",
    "no_reshard",
    "activation_checkpointing",
    "activation_checkpointing_offload",
    "size_based",
    "meta_elsewhere",  # cpu_ram_efficient_loading: the other process built the model on the meta device
]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    proc = torchrun(SCRIPTS / "fsdp_checks.py", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "terminate called" not in proc.stderr
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def ranks(launched):
    return launched[1]


def _ok(entry):
    assert "error" not in entry, entry.get("error")
    return entry


@pytest.mark.parametrize("case", PARITY_CASES)
def test_fsdp_trains_like_one_process_with_the_full_batch(ranks, case):
    for res in ranks:
        entry = _ok(res[case])
        assert len(entry["losses"]) == len(entry["ref_losses"]) >= 2
        torch.testing.assert_close(torch.tensor(entry["losses"]), torch.tensor(entry["ref_losses"]), rtol=TOL, atol=TOL)
        torch.testing.assert_close(torch.tensor(entry["norms"]), torch.tensor(entry["ref_norms"]), rtol=TOL, atol=TOL)
    main = ranks[0][case]
    assert main["keys"] == main["ref_keys"]  # the model's own keys, full
    assert main["weight_diff"] <= TOL
    assert ranks[1][case]["keys"] == []  # full state dicts are gathered to the main process only


def test_clipping_returns_the_same_global_norm_on_every_process(ranks):
    a, b = _ok(ranks[0]["clip"]), _ok(ranks[1]["clip"])
    assert a["norms"] == b["norms"] and len(a["norms"]) == 8
    assert any(n > 0.5 for n in a["norms"])  # the clipping did act


def test_wrapping_and_sharding_are_real(ranks):
    for res in ranks:
        facts = _ok(res)["facts"]
        assert facts["distributed_type"] == "FSDP" and facts["strategy"] == "FSDP2Strategy"
        assert facts["layout"] == "dcp" and facts["mesh"] == ["cpu", [2]]
        assert facts["root_is_fsdp"] and facts["blocks_are_fsdp"] == [True, True]
        assert facts["unwrap_is_model"]
        # the optimizer built before prepare now updates the sharded DTensor parameters, hyperparameters kept
        assert facts["optimizer_params_dtensor"] and facts["optimizer_params_are_model_params"]
        assert facts["hyperparameters"] == {"lr": 0.05, "weight_decay": 0.01}
        for name, total in facts["block_global"].items():
            assert facts["block_local"][name] == total // 2, name  # each process holds half of every tensor


def test_ignored_modules_stay_unsharded(ranks):
    for res in ranks:
        entry = _ok(res["ignored"])
        assert entry["head_plain"] == [True, True] and entry["blocks_dtensor"]
        assert len(entry["losses"]) == 2


def test_save_model_gathers_the_full_weights(launched):
    from safetensors.torch import load_file

    out, ranks = launched
    assert ranks[0]["facts"]["save_model"] == ["model.safetensors"] and ranks[1]["facts"]["save_model"] == []
    make_model().load_state_dict(load_file(out / "saved_model" / "model.safetensors"))  # every key, no prefix


def test_activation_checkpointing_wraps_the_blocks(ranks):
    assert _ok(ranks[0]["activation_checkpointing"])["block_children"] == ["CheckpointWrapper"] * 2


def test_bf16_uses_fsdp_mixed_precision(ranks):
    for res in ranks:
        bf16 = _ok(res["bf16"])
        assert bf16["losses"][-1] < 0.8 * bf16["losses"][0]
        assert bf16["inner_output_dtype"] == "torch.bfloat16"  # the forward runs in bf16
        assert bf16["model_output_dtype"] == "torch.float32"  # the prepared model returns fp32
        assert bf16["master_dtypes"] == ["torch.float32"]  # sharded master weights stay fp32
        assert bf16["autocast_forward"] is False  # no autocast forward on top of FSDP's policy


def test_fp16_skips_the_step_on_every_process_when_one_shard_overflows(ranks):
    for res in ranks:
        fp16 = _ok(res["fp16"])
        assert fp16["scaler"] == "ShardedGradScaler"
        # [skipped, weights changed, clip norm finite]: the overflow on one process skips the step on both
        assert fp16["skipped_changed"] == [[False, True, True], [True, False, False]]


@pytest.mark.parametrize("kind, layout", [("SHARDED_STATE_DICT", "dcp"), ("FULL_STATE_DICT", "full")])
def test_checkpoint_resumes_at_two_processes(ranks, kind, layout):
    for res in ranks:
        entry = _ok(res["checkpoints"])[kind]
        assert entry["layout"] == layout
        assert entry["resumed_losses"] == entry["losses"][3:]
    assert ranks[0]["checkpoints"][kind]["load_diff"] == 0.0
    assert ranks[0]["checkpoints"][kind]["final_diff"] == 0.0


def test_bad_input_is_refused_where_it_enters(ranks):
    errors = _ok(ranks[0]["bad_input"])
    assert "already wrapped in DistributedDataParallel" in errors["ddp_model"]
    assert "names ['DecoderLayer'], which the model (TinyNet) does not contain" in errors["unknown_class"]
    assert "Block, LayerNorm, Linear" in errors["unknown_class"]
    assert "prepare the model before the optimizer" in errors["optimizer_first"]


def _one_process_run(checkpoint, strict_world_size):
    acc = Accelerator(
        cpu=True,
        fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]),
        step_scheduler_with_optimizer=False,
    )  # as the 2-process run: one LR step per call
    model = make_model(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    acc.load_state(checkpoint, strict_world_size=strict_world_size)
    loaded = {k: t.clone() for k, t in model.state_dict().items()}
    losses = []
    for x, y in batches(8)[3:6]:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return loaded, losses, model.state_dict()


def test_sharded_checkpoint_loads_at_one_process_and_trains_on(launched):
    out, ranks = launched
    checkpoint = out / "ckpt" / "SHARDED_STATE_DICT"
    with pytest.raises(ValueError, match=r"saved by 2 process\(es\) but this run has 1.*strict_world_size=False"):
        _one_process_run(checkpoint, True)
    loaded, losses, final = _one_process_run(checkpoint, False)
    at_save = torch.load(out / "weights_at_save.pt")
    for k, t in at_save.items():
        torch.testing.assert_close(loaded[k], t, rtol=0, atol=0)
    # the same losses and weights as the uninterrupted 2-process run (the full batch on one process)
    expected = _ok(ranks[0]["checkpoints"])["SHARDED_STATE_DICT"]["losses"][3:]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=TOL, atol=TOL)
    for k, t in torch.load(out / "weights_final.pt").items():
        torch.testing.assert_close(final[k], t, rtol=TOL, atol=TOL)


def test_merge_weights_gives_one_file_the_plain_model_loads(launched, tmp_path):
    from safetensors.torch import load_file

    from hasten.cli import main

    out, _ = launched
    assert main(["merge-weights", str(out / "ckpt" / "SHARDED_STATE_DICT"), str(tmp_path / "merged")]) == 0
    model = make_model(seed=5)
    model.load_state_dict(load_file(tmp_path / "merged" / "model.safetensors"))  # strict: every key, no prefix
    for k, t in torch.load(out / "weights_at_save.pt").items():
        torch.testing.assert_close(model.state_dict()[k], t, rtol=0, atol=0)
    assert main(["merge-weights", str(out / "ckpt" / "FULL_STATE_DICT"), str(tmp_path / "full")]) == 0
    assert set(load_file(tmp_path / "full" / "model.safetensors")) == set(model.state_dict())


@pytest.mark.parametrize("damage", ["bit flip", "cut in half"])
def test_merge_weights_refuses_a_damaged_checkpoint_by_file_and_writes_nothing(launched, tmp_path, capsys, damage):
    import shutil

    from hasten.cli import main

    out, _ = launched
    ck = tmp_path / "ck"
    shutil.copytree(out / "ckpt" / "SHARDED_STATE_DICT", ck)
    shard = ck / "model_0" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "bit flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    assert main(["merge-weights", str(ck), str(tmp_path / "merged")]) == 1
    err = capsys.readouterr().err
    what = "do not match their checksum" if damage == "bit flip" else "has"  # the damaged item's bytes, named
    assert err.startswith("hasten merge-weights: the checkpoint") and "'model_0/__0_0.distcp'" in err and what in err, (
        err
    )
    assert "load_state" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "merged").exists()  # no output, not even an empty folder


def test_merge_weights_refuses_a_file_as_output(launched, tmp_path, capsys):
    from hasten.cli import main

    out, _ = launched
    target = tmp_path / "taken"
    target.write_text("mine")
    assert main(["merge-weights", str(out / "ckpt" / "SHARDED_STATE_DICT"), str(target)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hasten merge-weights: the output") and "is a file" in err, err
    assert target.read_text() == "mine"


def test_sharded_checkpoint_reshards_to_three_processes(launched):
    out, ranks = launched
    proc = torchrun(
        SCRIPTS / "fsdp_reshard.py", str(out / "ckpt" / "SHARDED_STATE_DICT"), str(out), nproc=3, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = [json.loads((out / f"reshard{r}.json").read_text()) for r in range(3)]
    for r in res:
        assert "saved by 2 process(es) but this run has 3" in r["strict_error"]
        assert "reshards the models and optimizers of this sharded checkpoint" in r["strict_error"]
    # each of the 3 processes holds its third (rows 36 = 12 + 12 + 12)
    assert res[0]["local_numel"]["up.weight"] == 432 // 3
    weights = torch.load(out / "reshard_weights.pt")
    for k, t in torch.load(out / "weights_at_save.pt").items():
        torch.testing.assert_close(weights["loaded"][k], t, rtol=0, atol=0)
    expected = ranks[0]["checkpoints"]["SHARDED_STATE_DICT"]["losses"][3:]
    for r in res:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(expected), rtol=TOL, atol=TOL)
    for k, t in torch.load(out / "weights_final.pt").items():
        torch.testing.assert_close(weights["final"][k], t, rtol=TOL, atol=TOL)


def test_launcher_fsdp_and_dynamo_flags_reach_the_accelerator(tmp_path):
    """`hasten launch --use_fsdp --fsdp_* ... --dynamo_backend aot_eager`: an Accelerator() with no
    arguments shards as the flags say, and compiles each block before sharding (torchtitan's order)."""
    from launch_utils import launch, read_ranks

    proc = launch(
        "--num_processes",
        "2",
        "--cpu",
        "--use_fsdp",
        "--fsdp_version",
        "2",
        "--fsdp_auto_wrap_policy",
        "TRANSFORMER_BASED_WRAP",
        "--fsdp_transformer_layer_cls_to_wrap",
        "Block",
        "--fsdp_reshard_after_forward",
        "false",
        "--fsdp_state_dict_type",
        "FULL_STATE_DICT",
        "--fsdp_activation_checkpointing",
        "true",
        "--fsdp_activation_checkpointing_offload",
        "true",
        "--dynamo_backend",
        "aot_eager",
        SCRIPTS / "fsdp_flags.py",
        tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = read_ranks(tmp_path, 2)
    for r in ranks:
        assert r["distributed_type"] == "FSDP" and r["strategy"] == "FSDP2Strategy"
        assert r["wrap"] == "transformer_based_wrap" and r["classes"] == ["Block"]
        assert r["state_dict_type"] == "FULL_STATE_DICT" and r["reshard"] is False and r["activation_checkpointing"]
        assert r["activation_checkpointing_offload"] is True
        assert r["block_compiled"] and r["block_sharded"] == "DTensor"
        assert len(r["losses"]) == 3 and all(0 < loss < 10 for loss in r["losses"])
    assert ranks[0]["losses"] == ranks[1]["losses"]  # one model, sharded
    torch.testing.assert_close(
        torch.tensor(ranks[0]["losses"]), torch.tensor(ranks[0]["eager_losses"]), rtol=1e-5, atol=1e-5
    )
