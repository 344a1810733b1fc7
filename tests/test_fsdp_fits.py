"""Sharding that fits (FSDP2): after prepare no process holds more than its share of the model;
models built on the meta device on every process (initialised, or loaded from a DCP checkpoint
or safetensors files, each process reading only its slices) or on all but the main one.

Two launches of scripts/fsdp_fits.py: 2 processes (the reference run writes the checkpoint and
files), then 3 (they load resharded); a 1-process load here."""

from __future__ import annotations

import json

import pytest
import torch
from fits_common import LM, lm_batches, lm_loss

from conftest import SCRIPTS, torchrun
from hasten import Accelerator, FullyShardedDataParallelPlugin

TOL = 1e-5


def _launch(out, phase, n):
    proc = torchrun(SCRIPTS / "fsdp_fits.py", str(out), phase, nproc=n, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(n)]
    for res in ranks:
        for name, entry in res.items():
            assert "error" not in entry, f"{name}: {entry['error']}"
    return ranks


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("fits")


@pytest.fixture(scope="module")
def first(out):
    return _launch(out, "first", 2)


@pytest.fixture(scope="module")
def second(out, first):
    return _launch(out, "second", 3)


def _check_memory(ranks):
    for res in ranks:
        m = res["memory"]
        n, model, unit = m["n"], m["params"] + m["buffers"], m["unit"]
        # after prepare: this process's shards (+5%) and at most one unit gathered
        assert m["after_prepare"] <= model / n * 1.05 + unit, m
        # after AdamW steps: shards of the weights, their gradients and the two moments
        assert m["after_steps"] <= 4 * m["params"] / n * 1.05 + m["buffers"] + unit, m
        # zero_grad freed the gradients; the two AdamW moments are there, and the count sees them
        assert m["after_steps"] > 3 * m["params"] / n * 0.95, m
        assert m["replaced_on_meta"]  # the parameters the optimizer was built with hold no memory


def test_each_process_holds_its_share_at_two(first):
    _check_memory(first)


def test_each_process_holds_its_share_at_three(second):
    _check_memory(second)


def test_every_process_on_meta_initialises_as_the_real_build(first):
    for res in first:
        ref, meta = res["reference"], res["meta_init"]
        assert meta["losses"] == ref["first"]  # bitwise: the same numbers as building the model for real
        assert meta["tied"] and ref["tied"]
        assert meta["inv_freq"][:3] == pytest.approx([1.0, 0.8659643, 0.7498942])  # recomputed by reset_parameters
    assert first[0]["meta_init"]["init_diff"] == 0.0


def test_meta_model_loads_a_checkpoint_at_two_and_three(first, second):
    ref = first[0]["reference"]["after"]
    for res in first:
        assert res["meta_load_state"]["losses"] == ref
    for res in second:  # resharded from 2 to 3 processes
        torch.testing.assert_close(
            torch.tensor(res["meta_load_state"]["losses"]), torch.tensor(ref), rtol=TOL, atol=TOL
        )


def test_meta_model_loads_a_checkpoint_at_one_process(out, first):
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    assert not any(p.is_meta for p in model.parameters()) and model.head.weight is model.embed.weight
    acc.load_state(out / "ck")
    losses = []
    for tokens in lm_batches(9)[3:6]:
        loss = lm_loss(model, tokens)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(first[0]["reference"]["after"]), rtol=TOL, atol=TOL)
    # and the safetensors files, read whole here
    fresh = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    with torch.device("meta"):
        plain = LM()
    plain = fresh.prepare(plain)
    fresh.load_model(plain, out / "st_index")
    assert lm_loss(plain, lm_batches(9)[3]).item() == pytest.approx(first[0]["reference"]["loss_on_saved"], abs=TOL)


@pytest.mark.parametrize("name", ["load_model:model.safetensors", "load_model:st_index"])
def test_safetensors_each_process_reads_only_its_slices(first, second, name):
    ref = first[0]["reference"]["loss_on_saved"]
    for ranks in (first, second):
        if name not in ranks[0]:
            continue
        for res in ranks:
            e = res[name]
            share = e["file_bytes"] / e["n"]
            assert 0.9 * share <= e["bytes_read"] <= 1.05 * share + 16_384, e  # counted by the kernel (/proc/self/io)
            assert e["loss"] == pytest.approx(ref, abs=TOL)
        assert ranks[0][name]["diff"] == 0.0


def test_main_process_weights_reach_meta_processes_buffers_and_ties_too(first):
    ref = first[0]
    for res in first:
        e = res["meta_elsewhere"]
        assert e["losses"] == ref["reference"]["first"]
        assert e["tied"]
        assert e["inv_freq"] == ref["meta_init"]["inv_freq"]  # a non-persistent buffer, broadcast


def test_unsharded_modules_of_a_meta_model_keep_ties_and_train(first):
    for res in first:
        e = res["meta_ignored"]
        assert e["first_loss"] == first[0]["reference"]["first"][0]  # initialised as the real build
        assert e["tied"] and e["plain"] and e["optimizer_has_model_params"] and e["moved"], e


def test_init_empty_weights_models_are_initialised_keeping_their_buffers(first):
    ref = first[0]
    for res in first:
        e = res["empty_weights"]
        assert e["on_meta"]
        assert e["inv_freq"] == ref["meta_init"]["inv_freq"]
        assert e["losses"] == ref["empty_weights"]["losses"]  # the same model on both processes
        assert e["losses"][-1] < e["losses"][0]


def test_init_empty_weights_in_one_process():
    from hasten import init_empty_weights

    with init_empty_weights():
        model = LM()
    assert all(p.is_meta for p in model.parameters()) and not model.rope.inv_freq.is_meta
    assert model.head.weight is model.embed.weight and all(p.requires_grad for p in model.parameters())
    with init_empty_weights(include_buffers=True):
        everything = LM()
    assert model.rope.inv_freq.tolist() == LM().rope.inv_freq.tolist()
    assert everything.rope.inv_freq.is_meta
    assert not torch.nn.Linear(2, 2).weight.is_meta  # the patch is gone after the block
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    model = acc.prepare(model)
    assert not any(p.is_meta for p in model.parameters()) and model.head.weight is model.embed.weight
    assert torch.isfinite(lm_loss(model, lm_batches(1)[0]))


def test_tensors_nothing_fills_are_refused_by_name(first):
    for res in first:
        e = res["unfilled"]
        for what in ("forward", "save_model"):
            assert e[what] is not None and "Raw was built on the meta device" in e[what], e
            assert "gain, shift" in e[what] and "param_init_fn" in e[what]
        assert e["never_written"]
        assert e["init_fn_diff"] == 0.0  # param_init_fn sees full tensors: as on the unsharded model


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL, a process on each); none here")
def test_device_peak_at_prepare_is_a_share_plus_one_unit(tmp_path):
    ranks = _launch(tmp_path, "gpu", 2)
    for res in ranks:
        on_device, offloaded = res["gpu_peak:False"], res["gpu_peak:True"]
        assert on_device["device"].startswith("cuda") and offloaded["device"] == "cpu"
        n = on_device["n"]
        assert on_device["peak"] <= (on_device["params"] / n) * 1.05 + on_device["unit"] + on_device["buffers"], (
            on_device
        )
        # offloaded shards live on the CPU: the device sees the buffers, never a full parameter
        assert offloaded["peak"] <= offloaded["buffers"] + 2**20, offloaded


def test_launcher_exports_what_transformers_reads_for_fsdp_loading(tmp_path):
    """`hasten launch --use_fsdp --fsdp_cpu_ram_efficient_loading true` exports what transformers'
    from_pretrained reads (transformers 4 then builds the model on meta on the other processes;
    5 reads the files everywhere but skips their initialisation); every process gets the main
    process's shards."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install transformers)"
    )
    from launch_utils import free_port, launch

    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "out"
    out.mkdir()
    proc = launch(
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        "--use_fsdp",
        "--fsdp_cpu_ram_efficient_loading",
        "true",
        "--fsdp_transformer_layer_cls_to_wrap",
        "LlamaDecoderLayer",
        SCRIPTS / "fsdp_transformers.py",
        tmp_path / "tiny",
        out,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["env"] == {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}
        assert r["distributed_type"] == "FSDP"
        assert r["transformers_sees_fsdp"]  # transformers' is_fsdp_enabled(): what from_pretrained branches on
    assert not ranks[0]["built_on_meta"]
    if int(transformers.__version__.split(".")[0]) < 5:  # transformers 4 loads the files on the main process only
        assert ranks[1]["built_on_meta"]
    assert ranks[0]["weight_diff"] == 0.0 and ranks[0]["keys_match"]  # every process got the main one's
    assert ranks[0]["logits_sum"] == pytest.approx(ranks[1]["logits_sum"], rel=1e-6)
