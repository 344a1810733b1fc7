"""Accelerate's global state lives in hasten.compat, which hasten's runtime never imports.

A training run (Accelerator, prepare, steps, save_state, load_state) in a fresh interpreter loads
neither ``hasten.compat`` nor any module holding Accelerate's singleton classes; asked for
afterwards, ``PartialState()``/``AcceleratorState()``/``GradientState()`` agree with the
Accelerator made before them, and ``_reset_state()`` reaches the states made before they loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

from test_import_cycles import import_graph

_RUN = r"""
import json, sys
import torch
from torch.utils.data import DataLoader
from hasten import Accelerator

acc = Accelerator(gradient_accumulation_steps=2, project_dir=sys.argv[1])
older = acc.state
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, 1)
loader = DataLoader(torch.randn(16, 4), batch_size=4, shuffle=True)
model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
for x in loader:
    with acc.accumulate(model):
        acc.backward(model(x).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
acc.gather_for_metrics(model(x))
acc.wait_for_everyone()
acc.load_state(acc.save_state())
singletons = ("PartialState", "AcceleratorState", "GradientState")
res = {
    "compat_loaded": sorted(n for n in sys.modules if n == "hasten.compat" or n.startswith("hasten.compat.")),
    "singleton_holders": sorted(
        n for n, m in list(sys.modules.items())
        if n.startswith("hasten") and m is not None and any(k in vars(m) for k in singletons)
    ),
}

facts = ("num_processes", "process_index", "local_process_index", "num_local_processes", "device", "backend",
         "distributed_type")
shared_before = None
from hasten import AcceleratorState, GradientState, PartialState
from hasten.state import PartialState as StatePath
from hasten.utils import PartialState as UtilsPath

shared_before = dict(PartialState._shared_state)  # the Accelerator's facts, recorded before compat loaded
partial = PartialState()
res["same_facts"] = {f: str(getattr(partial, f)) == str(getattr(acc.state, f)) for f in facts}
res["shared_before"] = {k: str(v) for k, v in shared_before.items()}
res["acc_facts"] = {f: str(getattr(acc.state, f)) for f in facts}
res["paths_agree"] = StatePath is PartialState and UtilsPath is PartialState
res["current"] = [AcceleratorState() is acc.state, GradientState() is acc.gradient_state,
                  isinstance(acc.state, AcceleratorState), isinstance(acc.state, PartialState),
                  isinstance(acc.gradient_state, GradientState), isinstance(partial, AcceleratorState)]
newer = Accelerator(mixed_precision="bf16")
AcceleratorState._reset_state()
try:
    older.num_processes  # made before compat loaded, and not the latest Accelerator's
    res["older_reset"] = None
except AttributeError as exc:
    res["older_reset"] = str(exc)
res["reset_reprs"] = [repr(older), repr(newer.state)]
res["partial_alone"] = str(partial.device)  # resetting AcceleratorStates leaves PartialStates alone
print(json.dumps(res))
"""


def test_a_training_run_never_loads_accelerates_global_state(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _RUN, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.splitlines()[-1])
    assert res["compat_loaded"] == []
    assert res["singleton_holders"] == []  # no runtime module defines or holds the singleton classes

    # Asked for afterwards, Accelerate's names agree with the Accelerator made before them.
    assert all(res["same_facts"].values()), res["same_facts"]
    assert res["shared_before"] == {**res["acc_facts"], "_cpu": "False"}
    assert res["paths_agree"]
    assert res["current"] == [True, True, True, True, True, False]
    assert res["older_reset"] is not None and "AcceleratorState._reset_state()" in res["older_reset"]
    assert res["reset_reprs"] == ["AcceleratorState(reset)", "AcceleratorState(reset)"]
    assert res["partial_alone"] == "cpu"


_RESET_OWN = r"""
import json, sys
from hasten import Accelerator

acc = Accelerator()
acc.state._reset_state()  # Accelerate's test_accelerator_state_after_reset, without compat loaded
try:
    acc.num_processes
    err = None
except AttributeError as exc:
    err = str(exc)
acc.state.someotherthing = "MyValue"
res = {"err": err, "set": acc.state.someotherthing, "repr": repr(acc.state)}
newer = Accelerator()
res["reads_newer"] = acc.state.process_index == newer.process_index == 0
res["compat_loaded"] = sorted(n for n in sys.modules if n.startswith("hasten.compat"))
print(json.dumps(res))
"""


def test_an_accelerators_own_state_resets_without_compat():
    out = subprocess.run([sys.executable, "-c", _RESET_OWN], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.splitlines()[-1])
    assert res["err"] is not None
    assert "`AcceleratorState` object has no attribute `num_processes`" in res["err"]
    assert "This happens if `AcceleratorState._reset_state()`" in res["err"]
    assert res["set"] == "MyValue" and res["repr"] == "AcceleratorState(reset)"
    assert res["reads_newer"]  # a reset state reads the facts of the state made after it
    assert res["compat_loaded"] == []


_ACCELERATE_PATHS = {"hasten", "hasten.state", "hasten.utils", "hasten.data_loader", "hasten.commands.launch"}
# The launcher's worker wrapper installs compat's import hook (``hasten launch --as_accelerate``) before the
# user's script runs: an entry point, not the training runtime.
_HOOK_INSTALLERS = {"hasten.cli._child"}
# Accelerate's module paths whose names live elsewhere in hasten (thin re-exports).
_REEXPORTS = {
    "hasten.state",
    "hasten.optimizer",
    "hasten.scheduler",
    "hasten.local_sgd",
    "hasten.launchers",
    "hasten.parallelism_config",
}


def test_no_runtime_module_imports_compat():
    # Counting imports inside functions and under TYPE_CHECKING: only hasten.compat itself refers
    # to it; Accelerate's paths load it by name on first use of one of its names (not an import
    # hasten's runtime runs: the training run above shows it).
    graph = import_graph(lazy=True, typing=True)
    compat = {name for name in graph if name == "hasten.compat" or name.startswith("hasten.compat.")}
    assert {"hasten.compat.state", "hasten.compat.data_loader"} <= compat
    importers = {name for name, edges in graph.items() if edges & compat and name not in compat}
    assert importers <= _ACCELERATE_PATHS | _HOOK_INSTALLERS, importers - _ACCELERATE_PATHS - _HOOK_INSTALLERS
    runtime = import_graph(lazy=True)  # what really runs: the TYPE_CHECKING blocks left out
    # ``hasten.state`` (Accelerate's path) re-exports compat's classes; no runtime module imports it
    # or any other re-export path, even lazily or for typing.
    assert not {
        name
        for name, edges in runtime.items()
        if edges & compat and name not in compat | {"hasten.state"} | _HOOK_INSTALLERS | {"hasten.commands.launch"}
    }
    assert _REEXPORTS <= set(graph)
    assert not {name for name, edges in graph.items() if edges & _REEXPORTS}
