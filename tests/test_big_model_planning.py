"""Device-map planning (hasten.big_model.planning / planner) against Accelerate's own test cases
(their expected maps are the spec) and, where Accelerate is importable in a separate process, against
Accelerate itself on a table of models and budgets (tests/big_model_cases.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from big_model_cases import ModelForTest, Tiny, plan_all
from hasten.big_model.planner import infer_auto_device_map
from hasten.big_model.planning import (
    check_device_map,
    clean_device_map,
    get_balanced_memory,
    get_max_memory,
    get_module_size_with_ties,
)
from hasten.big_model.tensors import compute_module_sizes, compute_module_total_buffer_size

TESTS = Path(__file__).resolve().parent


# ------------------------------------------------------- Accelerate's test cases (its tests/test_modeling_utils.py)
def test_clean_device_map():
    assert clean_device_map({"a": 0, "b": 0, "c": 0}) == {"": 0}
    assert clean_device_map({"a.x": 0, "a.y": 0, "b.x": 1, "b.y": 1, "c": 1}) == {"a": 0, "b": 1, "c": 1}
    assert clean_device_map({"a.x": 0, "a.y": 0, "b.x.0": 1, "b.x.1": 1, "b.y.0": 2, "b.y.1": 2, "c": 2}) == {
        "a": 0,
        "b.x": 1,
        "b.y": 2,
        "c": 2,
    }


def test_infer_auto_device_map_accelerate_cases():
    model = ModelForTest()
    assert infer_auto_device_map(model, max_memory={0: 200, 1: 200}) == {"linear1": 0, "batchnorm": 1, "linear2": 1}
    assert infer_auto_device_map(model, max_memory={0: 200, 1: 172, 2: 200}) == {
        "linear1": 0,
        "batchnorm": 1,
        "linear2": 1,
    }
    model.linear1.weight = model.linear2.weight  # tied: both on one device
    assert infer_auto_device_map(model, max_memory={0: 200, 1: 200}) == {"": 0}
    model = nn.Sequential(ModelForTest(), ModelForTest(), ModelForTest())
    assert infer_auto_device_map(model, max_memory={0: 500, 1: 500}) == {
        "0": 0,
        "1.linear1": 0,
        "1.batchnorm": 0,
        "1.linear2": 1,
        "2": 1,
    }
    planned = infer_auto_device_map(model, max_memory={0: 500, 1: 500}, no_split_module_classes=["ModelForTest"])
    assert planned == {"0": 0, "1": 1, "2": 1}


def test_infer_auto_device_map_tied_weights():
    model = nn.Sequential(OrderedDict([(f"layer{i}", ModelForTest()) for i in (1, 2, 3)]))
    model.layer3.linear2.weight = model.layer1.linear2.weight
    expected = {"layer1": 0, "layer3.linear2": 0, "layer2": 1, "layer3.linear1": 1, "layer3.batchnorm": 1}
    assert infer_auto_device_map(model, max_memory={0: 400, 1: 500}) == expected
    model.layer2.linear2.weight = model.layer1.linear2.weight
    expected = {
        "layer1": 0,
        "layer2.linear2": 0,
        "layer3.linear2": 0,
        "layer2.linear1": 1,
        "layer2.batchnorm": 1,
        "layer3.linear1": 1,
        "layer3.batchnorm": 1,
    }
    assert infer_auto_device_map(model, max_memory={0: 400, 1: 500}) == expected
    model.layer2.linear1.weight = model.layer1.linear1.weight
    expected = {
        "layer1": 0,
        "layer2.linear1": 0,
        "layer2.linear2": 0,
        "layer3.linear2": 0,
        "layer2.batchnorm": 1,
        "layer3.linear1": 1,
        "layer3.batchnorm": 1,
    }
    assert infer_auto_device_map(model, max_memory={0: 400, 1: 500}) == expected
    model = nn.Sequential(OrderedDict([(f"linear{i}", nn.Linear(n, n)) for i, n in ((1, 4), (2, 6), (3, 4), (4, 6))]))
    model.linear3.weight = model.linear1.weight
    model.linear3.bias = model.linear1.bias
    planned = infer_auto_device_map(model, max_memory={0: 250, 1: 400})
    assert planned == {"linear1": 0, "linear2": 1, "linear3": 0, "linear4": 1}


def test_infer_auto_device_map_parameter_tied_inside_a_submodule():
    class SubModule(nn.Module):
        def __init__(self, ref: nn.Parameter) -> None:
            super().__init__()
            self.parameter = ref

    class LinearWithSub(nn.Linear):
        def __init__(self) -> None:
            super().__init__(3, 8)
            self.weight_submodule = SubModule(self.weight)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.compute = LinearWithSub()

    infer_auto_device_map(Model(), {0: 4, "cpu": 96000})  # splits without looking for the tie outside


def _buffered_model() -> nn.Module:
    model = ModelForTest()
    model.linear1.register_buffer("test_buffer1", torch.zeros(10, 2))
    model.batchnorm.register_buffer("test_buffer2", torch.zeros(10, 3))
    model.linear2.register_buffer("test_buffer3", torch.zeros(10, 3))
    return model


def test_infer_auto_device_map_buffer_check():
    model = _buffered_model()
    with pytest.warns(UserWarning, match="offload_buffers"):
        planned = infer_auto_device_map(model, max_memory={0: 400, "cpu": "1GB"})
    assert planned == {"linear1": 0, "batchnorm": "cpu", "linear2": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planned = infer_auto_device_map(model, max_memory={0: 400, "cpu": "1GB"}, offload_buffers=True)
    assert planned == {"linear1": 0, "batchnorm": "cpu", "linear2": "cpu"}


def test_infer_auto_device_map_buffer_check_multi_devices():
    model = _buffered_model()
    model.linear3 = nn.Linear(4, 5)
    model.linear3.register_buffer("test_buffer4", torch.zeros(10, 2))
    expected = {"linear1": 0, "batchnorm": 1, "linear2": "cpu", "linear3": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert infer_auto_device_map(model, max_memory={0: 400, 1: 400, "cpu": "1GB"}) == expected
    with pytest.warns(UserWarning, match="offload_buffers"):
        assert infer_auto_device_map(model, max_memory={0: 400, 1: 200, "cpu": "1GB"}) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planned = infer_auto_device_map(model, max_memory={0: 400, 1: 200, "cpu": "1GB"}, offload_buffers=True)
    assert planned == expected


def test_infer_auto_device_map_fallback_allocation(caplog):
    inner = nn.Sequential(
        OrderedDict([("linear1", nn.Linear(10, 4)), ("linear2", nn.Linear(4, 4)), ("linear3", nn.Linear(4, 8))])
    )
    model = nn.Sequential(OrderedDict([("module", inner)]))
    with caplog.at_level(logging.INFO):
        planned = infer_auto_device_map(model, max_memory={0: 256}, fallback_allocation=False)
    assert all(device != 0 for device in planned.values())
    assert "insufficient memory" in caplog.text
    planned = infer_auto_device_map(model, max_memory={0: 256}, fallback_allocation=True)
    assert planned == {"module.linear1": "disk", "module.linear2": 0, "module.linear3": "disk"}


def test_infer_auto_device_map_fallback_allocation_more():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.submodule1 = nn.Linear(20, 20)
            self.submodule2 = nn.Linear(20, 20)

    model = nn.Sequential(OrderedDict([(f"module{i}", Custom()) for i in (1, 2, 3)]))
    planned = infer_auto_device_map(model, max_memory={0: 5000}, fallback_allocation=True)
    assert [n for n, d in planned.items() if d == 0]

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear1 = nn.Linear(10, 10)
            self.linear2 = nn.Linear(10, 10)
            self.linear2.weight = self.linear1.weight

    assert infer_auto_device_map(Tied(), max_memory={0: 600}, fallback_allocation=True) == {"": 0}
    model = nn.Sequential(
        OrderedDict([("linear1", nn.Linear(10, 10)), ("batchnorm", nn.BatchNorm1d(10)), ("linear2", nn.Linear(10, 10))])
    )
    for i, sub in enumerate((model.linear1, model.batchnorm, model.linear2), 1):
        sub.register_buffer(f"buffer{i}", torch.zeros(5))
    with pytest.warns(UserWarning, match="Current model requires"):
        planned = infer_auto_device_map(model, max_memory={0: 678}, fallback_allocation=True, offload_buffers=False)
    assert planned == {"batchnorm": 0, "linear1": "disk", "linear2": "disk"}


def test_get_balanced_memory_accelerate_cases():
    model = ModelForTest()
    assert get_balanced_memory(model, max_memory={0: 200, 1: 200}) == {0: 200, 1: 200}
    assert get_balanced_memory(model, max_memory={0: 200, 2: 200}) == {0: 200, 2: 200}
    assert get_balanced_memory(model, max_memory={0: 300, 1: 300}) == {0: 215, 1: 300}
    assert get_balanced_memory(model, max_memory={0: 300, 1: 500}) == {0: 215, 1: 500}
    assert get_balanced_memory(model, max_memory={0: 300, "cpu": 1000}) == {0: 300, "cpu": 1000}
    assert get_balanced_memory(model, max_memory={0: 0, 1: 300, 2: 300}) == {0: 0, 1: 215, 2: 300}
    assert get_balanced_memory(model, max_memory={0: 0, "cpu": 100}) == {0: 0, "cpu": 100}
    assert isinstance(get_balanced_memory(model, max_memory={0: 300, 1: 300}, no_split_module_classes={"Linear"}), dict)


def test_get_module_size_with_ties():
    model = nn.Sequential(OrderedDict([(f"linear{i}", nn.Linear(n, n)) for i, n in ((1, 4), (2, 6), (3, 4))]))
    model.linear3.weight = model.linear1.weight
    sizes = compute_module_sizes(model)
    queue = list(model.named_children())
    size, names, modules = get_module_size_with_ties(["linear3.weight"], sizes["linear1"], sizes, queue)
    assert names == ["linear3"] and modules == [model.linear3]
    assert size == sizes["linear1"] + sizes["linear3"] - sizes["linear3.weight"]
    assert get_module_size_with_ties([], 7, sizes, queue) == (7, [], [])


def test_compute_module_sizes_and_buffers():
    model = ModelForTest()
    sizes = compute_module_sizes(model)
    assert sizes == {
        "": 236,
        "linear1": 64,
        "linear1.weight": 48,
        "linear1.bias": 16,
        "batchnorm": 72,
        "batchnorm.weight": 16,
        "batchnorm.bias": 16,
        "batchnorm.running_mean": 16,
        "batchnorm.running_var": 16,
        "batchnorm.num_batches_tracked": 8,
        "linear2": 100,
        "linear2.weight": 80,
        "linear2.bias": 20,
    }
    assert compute_module_sizes(model, dtype=torch.float16)["batchnorm"] == 36 + 4  # int64 counter kept
    assert compute_module_total_buffer_size(model) == 40


def test_check_device_map():
    model = ModelForTest()
    check_device_map(model, {"": 0})
    check_device_map(model, {"linear1": 0, "batchnorm": 1, "linear2": "disk"})
    with pytest.raises(ValueError, match="linear2.weight"):
        check_device_map(model, {"linear1": 0, "batchnorm": 1})
    with pytest.warns(UserWarning, match="do not match any submodules"):
        check_device_map(model, {"": 0, "nonexistent": 1})


# ---------------------------------------------------------------- budgets
def test_get_max_memory_reads_orders_and_refuses():
    given = {"cpu": "1KiB", 1: 10, 0: "1MB", "disk": 5}
    assert list(get_max_memory(given).items()) == [(0, 10**6), (1, 10), ("cpu", 1024), ("disk", 5)]
    assert given == {"cpu": "1KiB", 1: 10, 0: "1MB", "disk": 5}  # left as it was
    with pytest.raises(ValueError, match="'gpu' is not recognized"):
        get_max_memory({"gpu": 10})
    with pytest.raises(TypeError, match=r"max_memory\['cpu'\]"):
        get_max_memory({"cpu": [1]})
    measured = get_max_memory()
    assert measured["cpu"] > 0


def test_planning_a_meta_model_gives_the_real_models_map():
    from hasten.big_modeling import init_empty_weights

    with init_empty_weights():
        empty = Tiny()
    budget = {0: 2000, 1: 2000, "cpu": 3000}
    assert infer_auto_device_map(empty, max_memory=budget) == infer_auto_device_map(Tiny(), max_memory=budget)


def test_map_spreads_over_all_devices():
    planned = infer_auto_device_map(Tiny(tie=False), max_memory={0: 2000, 1: 2000, "cpu": 3000})
    assert set(planned.values()) == {0, 1, "cpu", "disk"}
    assert planned["embed"] == 0 and planned["norm"] == "disk"


# ---------------------------------------------------------------- against Accelerate itself
def _reference() -> list | None:
    """Accelerate's plans of tests/big_model_cases.py, from a process that imports Accelerate (not
    hasten); None where it is not installed (HASTEN_ACCELERATE_PATH: a folder to find it in)."""
    env = dict(os.environ)
    extra = os.environ.get("HASTEN_ACCELERATE_PATH")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, str(TESTS)) if p)
    probe = subprocess.run([sys.executable, "-c", "import accelerate"], env=env, capture_output=True, timeout=120)
    if probe.returncode != 0:
        return None
    done = subprocess.run(
        [sys.executable, str(TESTS / "big_model_cases.py")], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.slow  # launches / imports transformers: > 10 s
def test_maps_equal_accelerates():
    reference = _reference()
    if reference is None:
        pytest.skip("accelerate is not importable in a separate process (set HASTEN_ACCELERATE_PATH to a copy)")
    ours = json.loads(json.dumps(plan_all(infer_auto_device_map, get_balanced_memory)))
    assert len(ours) == len(reference) > 50
    different = [(a, b) for a, b in zip(ours, reference) if a != b]
    assert not different, different[:3]
