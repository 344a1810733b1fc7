"""Models and budgets for the device-map tests: the same table is planned by hasten in the test
and by Accelerate in a subprocess (tests/test_big_model_planning.py), so both read it from here.
Only torch is imported: the reference process imports Accelerate, never hasten."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn


class ModelForTest(nn.Module):  # Accelerate's test model (tests/test_modeling_utils.py)
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.batchnorm(self.linear1(x)))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x + self.attn(x))


class Tiny(nn.Module):
    """A small decoder-shaped model: embedding, blocks, norm, head (tied to the embedding or not), a buffer."""

    def __init__(self, d: int = 8, n: int = 4, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 16, bias=False)
        self.register_buffer("pos", torch.arange(4).float())
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def cases() -> list[tuple[str, nn.Module, dict]]:
    """(name, model, infer_auto_device_map's keyword arguments) for a spread of budgets that put
    layers on two accelerators, the CPU and the disk."""
    torch.manual_seed(0)
    found: list[tuple[str, nn.Module, dict]] = []
    small = ModelForTest()
    for budget in ({0: 200, 1: 200}, {0: 100, 1: 100, "cpu": 100}, {0: 200, 1: 172, 2: 200}, {0: 50, "cpu": 60}):
        found.append(("ModelForTest", small, {"max_memory": budget}))
        found.append(
            ("ModelForTest/no-split", small, {"max_memory": budget, "no_split_module_classes": ["BatchNorm1d"]})
        )
        found.append(("ModelForTest/fallback", small, {"max_memory": budget, "fallback_allocation": True}))
    seq = nn.Sequential(OrderedDict([(f"layer{i}", ModelForTest()) for i in range(1, 4)]))
    seq.layer3.linear2.weight = seq.layer1.linear2.weight
    found.append(("Sequential/tied", seq, {"max_memory": {0: 400, 1: 500}}))
    for tie in (True, False):
        model = Tiny(tie=tie)
        name = "tied" if tie else "untied"
        for budget in (
            {0: 2000, 1: 2000, "cpu": 3000},
            {0: 1500, "cpu": 1500},
            {"cpu": 2500},
            {0: 800, 1: 800, "cpu": 900},
        ):
            found.append((name, model, {"max_memory": budget}))
            found.append((name + "/blocks", model, {"max_memory": budget, "no_split_module_classes": ["Block"]}))
            found.append(
                (
                    name + "/fp16",
                    model,
                    {"max_memory": budget, "no_split_module_classes": ["Block"], "dtype": "float16"},
                )
            )
            found.append(
                (
                    name + "/offload-buffers",
                    model,
                    {"max_memory": budget, "no_split_module_classes": ["Block"], "offload_buffers": True},
                )
            )
            found.append((name + "/fallback", model, {"max_memory": budget, "fallback_allocation": True}))
            found.append((name + "/raw", model, {"max_memory": budget, "clean_result": False}))
    return found


def plan_all(infer_auto_device_map, get_balanced_memory) -> list:
    """Each case's map (sorted pairs, devices as strings) and balanced budgets, or the error's type."""
    import warnings

    results = []
    for name, model, kwargs in cases():
        kwargs = {k: dict(v) if isinstance(v, dict) else v for k, v in kwargs.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                planned = sorted((k, str(v)) for k, v in infer_auto_device_map(model, **kwargs).items())
            except Exception as error:  # noqa: BLE001 - compared, not hidden
                planned = f"error ({type(error).__mro__[-2].__name__})"
            budgets = []
            for low_zero in (False, True):
                balanced = get_balanced_memory(
                    model,
                    max_memory=dict(kwargs["max_memory"]),
                    no_split_module_classes=kwargs.get("no_split_module_classes"),
                    low_zero=low_zero,
                )
                budgets.append(sorted((str(k), v) for k, v in balanced.items()))
        results.append([name, str(kwargs["max_memory"]), planned, budgets])
    return results


if __name__ == "__main__":  # the reference side: python big_model_cases.py (Accelerate importable)
    import json

    from accelerate.utils.modeling import get_balanced_memory, infer_auto_device_map

    print(json.dumps(plan_all(infer_auto_device_map, get_balanced_memory)))
