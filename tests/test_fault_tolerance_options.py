"""torchft DiLoCo's options on FaultToleranceKwargs: ``fragment_sync_delay`` and ``should_quantize``.

Fast: the handler refuses bad values, naming the field; ``should_quantize`` is refused where it
cannot quantize (no CUDA GPU or no triton: torchft would silently send full precision), at
construction and again where the model is not on a CUDA GPU (``semi_sync``). Slow: two replica
groups (``hasten lighthouse`` and a ``hasten launch`` each, on gloo) train with Streaming DiLoCo
and a fragment_sync_delay, against the same algorithm by hand at every step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from launch_utils import SCRIPTS, free_port, launch_env

pytest.importorskip("torchft")

from hasten import FaultToleranceKwargs  # noqa: E402
from hasten.settings import fault_tolerance as settings  # noqa: E402
from hasten.strategies import fault_tolerance as strategy  # noqa: E402

DILOCO = {"semi_sync": "diloco", "sync_every": 4}


# ---------------------------------------------------------------------------- the handler
@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"fragment_sync_delay": -1}, ValueError, "fragment_sync_delay must be >= 0, got -1"),
        ({"fragment_sync_delay": 1.5, **DILOCO}, TypeError, "fragment_sync_delay"),
        ({"fragment_sync_delay": True, **DILOCO}, TypeError, "fragment_sync_delay"),
        ({"fragment_sync_delay": 1}, ValueError, "fragment_sync_delay=1 needs semi_sync='diloco', got semi_sync=None"),
        ({"fragment_sync_delay": 1, "semi_sync": "local_sgd"}, ValueError, "fragment_sync_delay=1 needs semi_sync"),
        (
            {"fragment_sync_delay": 4, **DILOCO},
            ValueError,
            "fragment_sync_delay=4 must be below sync_every / fragments = 4",
        ),
        (
            {"fragment_sync_delay": 2, "fragments": 2, **DILOCO},
            ValueError,
            "fragment_sync_delay=2 must be below sync_every / fragments = 2",
        ),
        ({"should_quantize": 1, **DILOCO}, TypeError, "should_quantize must be True or False, got 1"),
        ({"should_quantize": True}, ValueError, "should_quantize=True needs semi_sync='diloco', got semi_sync=None"),
        ({"should_quantize": True, "semi_sync": "local_sgd"}, ValueError, "should_quantize=True needs semi_sync"),
    ],
)
def test_handler_refuses_bad_values_naming_the_field(kwargs, error, words):
    with pytest.raises(error, match="FaultToleranceKwargs") as caught:
        FaultToleranceKwargs(**kwargs)
    assert words in str(caught.value)


def test_good_values_are_kept_and_resolved():
    handler = FaultToleranceKwargs(lighthouse="http://h:1", fragment_sync_delay=1, fragments=2, **DILOCO)
    assert handler.resolved().fragment_sync_delay == 1
    assert handler.to_kwargs()["fragment_sync_delay"] == 1
    assert FaultToleranceKwargs().fragment_sync_delay == 0 and FaultToleranceKwargs().should_quantize is False


@pytest.mark.parametrize(
    ("cuda", "triton", "missing"),
    [(False, False, "a CUDA GPU and triton"), (False, True, "a CUDA GPU"), (True, False, "triton")],
)
def test_should_quantize_is_refused_without_a_gpu_or_triton(monkeypatch, cuda, triton, missing):
    """torchft quantizes only with triton (on the GPU); without it it sends full precision silently:
    hasten refuses instead, naming what is missing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(settings, "_has_triton", lambda: triton)
    with pytest.raises(ValueError, match="FaultToleranceKwargs.should_quantize=True needs") as caught:
        FaultToleranceKwargs(should_quantize=True, **DILOCO)
    assert f"needs {missing} (" in str(caught.value) and "unquantized" in str(caught.value)


def test_should_quantize_on_this_machine_is_refused_or_allowed_as_it_can_run():
    """No monkeypatching: the refusal follows the machine (a CPU-only torch here: refused)."""
    able = torch.cuda.is_available() and settings._has_triton()
    if able:
        assert FaultToleranceKwargs(should_quantize=True, **DILOCO).should_quantize is True
    else:
        with pytest.raises(ValueError, match="should_quantize=True needs"):
            FaultToleranceKwargs(should_quantize=True, **DILOCO)


def test_semi_sync_refuses_quantizing_a_model_off_the_gpu(monkeypatch):
    """A handler that passed construction (a GPU machine) with the model left on the CPU
    (``Accelerator(cpu=True)``): refused at prepare by ``semi_sync``, naming the device, before
    torchft's DiLoCo is built (the manager is never touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(settings, "_has_triton", lambda: True)
    handler = FaultToleranceKwargs(should_quantize=True, **DILOCO)
    model = torch.nn.Linear(2, 2)
    ft = SimpleNamespace(handler=handler, manager=None)
    with pytest.raises(
        ValueError, match=r"should_quantize=True needs the model on a CUDA GPU and triton, but the model is on cpu"
    ):
        strategy.semi_sync(ft, model, torch.optim.SGD(model.parameters(), lr=0.1))


# ---------------------------------------------------------------------------- two groups (slow)
def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([model.weight.detach().flatten(), model.bias.detach().flatten()]).tolist()


def _diloco_reference(steps: int, sync_every: int, fragments: int, delay: int) -> list[list[float]]:
    """Two groups by hand, as torchft's (Streaming) DiLoCo does it with ``fragment_sync_delay``:
    group g's k-th batch is batch 2k+g; every ``sync_every / fragments`` steps fragment (syncs so
    far % fragments) is synced: ``delay`` steps before the sync its pseudo-gradient (its weights at
    its last sync less each group's now) is taken and averaged; at the sync the fragment goes back
    to its last synced weights and an outer SGD (lr 0.7, Nesterov momentum 0.9) steps them with
    that pseudo-gradient (the steps in between are dropped for that fragment). Group 0's weights
    after each step."""
    x, y = _data()
    torch.manual_seed(0)
    models = [torch.nn.Linear(8, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    inner = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    names = [n for n, _ in models[0].named_parameters()]  # Linear: the weight, the bias (a fragment each at 2)
    pieces = [names] if fragments == 1 else [[n] for n in names]
    synced = {n: p.detach().clone().requires_grad_() for n, p in models[0].named_parameters()}
    outer = [torch.optim.SGD([synced[n] for n in piece], lr=0.7, momentum=0.9, nesterov=True) for piece in pieces]
    every, syncs, trace, pending = sync_every // fragments, 0, [], {}
    for k in range(steps):
        for g, (model, optimizer) in enumerate(zip(models, inner, strict=True)):
            rows = list(range(((2 * k + g) % 16) * 4, ((2 * k + g) % 16) * 4 + 4))
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            optimizer.step()
        local, f = k % every + 1, syncs % fragments
        params = [dict(m.named_parameters()) for m in models]
        with torch.no_grad():
            if local == every - delay:  # prepare: the pseudo-gradient now, averaged
                pending = {n: synced[n] - (params[0][n] + params[1][n]) / 2 for n in pieces[f]}
            if local == every:  # sync: the outer step from the last synced weights
                for n in pieces[f]:
                    synced[n].grad = pending[n]
                outer[f].step()
                for n in pieces[f]:
                    params[0][n].copy_(synced[n])
                    params[1][n].copy_(synced[n])
                syncs += 1
        trace.append(_flat(models[0]))
    return trace


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(p - q) for u, w in zip(a, b, strict=True) for p, q in zip(u, w, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(("fragments", "delay"), [(1, 2), (2, 1)], ids=["diloco-delay2", "streaming-delay1"])
def test_fragment_sync_delay_takes_the_pseudo_gradient_delay_steps_early(tmp_path, fragments, delay):
    """sync_every=4: each fragment's all-reduce starts ``delay`` steps before its sync and the sync
    uses that pseudo-gradient; against the same by hand at every step, and not the delay-0 run's.
    A save_state while an all-reduce is in flight is refused on both groups (nothing written) and
    training goes on; a save outside that window is written."""
    sync_every, syncs = 4, 3
    every = sync_every // fragments
    steps = syncs * every
    port = free_port()
    save_at = (every, 2 * every - delay)  # just after a sync, and in the window an all-reduce is in flight
    env = launch_env(
        FT_OPT_SYNC_EVERY=str(sync_every), FT_OPT_FRAGMENTS=str(fragments), FT_OPT_DELAY=str(delay),
        FT_OPT_SAVE_AT=",".join(map(str, save_at)),
    )  # fmt: skip
    cmd = [sys.executable, "-m", "hasten.cli", "lighthouse", "--port", str(port), "--min_replicas", "2"]
    lighthouse = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    groups: list[subprocess.Popen] = []
    try:
        line = lighthouse.stdout.readline()  # printed once it listens
        assert line.startswith("hasten lighthouse: "), line
        for g in (0, 1):
            cmd = [
                sys.executable, "-m", "hasten.cli", "launch", "--num_processes", "1", "--ft_replica_group", str(g),
                "--ft_num_replica_groups", "2", "--ft_lighthouse", f"http://localhost:{port}",
                str(SCRIPTS / "ft_opt_train.py"), str(tmp_path), str(steps),
            ]  # fmt: skip
            log = open(tmp_path / f"g{g}.log", "w")  # noqa: SIM115 - closed with the process
            groups.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        for g, p in enumerate(groups):
            assert p.wait(timeout=240) == 0, (tmp_path / f"g{g}.log").read_text()[-4000:]
    finally:
        for p in [*groups, lighthouse]:
            if p.poll() is None:
                p.kill()
                p.wait()
    a, b = (json.loads((tmp_path / f"group{g}.json").read_text()) for g in (0, 1))
    assert a["steps"] == b["steps"] == [k // every for k in range(1, steps + 1)]  # one commit per sync
    for saves in (a["saves"], b["saves"]):
        assert [n for n, _ in saves] == list(save_at)
        assert saves[0][1] == "ok"
        assert "all-reduce is in flight" in saves[1][1] and "nothing was written" in saves[1][1], saves[1][1]
    reference = _diloco_reference(steps, sync_every, fragments, delay)
    assert _max_diff(a["trace"], reference) < 1e-5
    assert _max_diff(a["trace"], _diloco_reference(steps, sync_every, fragments, 0)) > 1e-3  # the delay mattered
    for k in range(every - 1, steps, every):  # at each sync the synced fragment is equal in both groups
        f = (k // every) % fragments
        part = slice(0, 36) if fragments == 1 else (slice(0, 32) if f == 0 else slice(32, 36))
        assert a["trace"][k][part] == b["trace"][k][part], k
