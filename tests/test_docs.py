"""The docs site cannot rot (issue 50): it builds in strict mode (a broken link, anchor or
reference fails), its API reference is current and covers every public name of ``hasten`` and
``hasten.utils`` (each with a docstring), and every Python block of the README and the guides runs
(on one process, beside small stand-ins for the ``model``, ``optimizer``, ``loader`` ... a
fragment uses) or, where a page says it needs several processes or files it does not show, compiles."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
#: a page marks a block it cannot run here, and says why in its own text
COMPILE_ONLY = "<!-- docs-test: compile-only -->"
_BLOCK = re.compile(r"(<!-- docs-test: compile-only -->\n[ ]*)?```python\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, int, str, bool]]:
    found = []
    for page in PAGES:
        for i, m in enumerate(_BLOCK.finditer(page.read_text(encoding="utf-8"))):
            source = textwrap.dedent(m.group(2))  # a block inside a list item is indented
            found.append((page.relative_to(ROOT).as_posix(), i, source, bool(m.group(1))))
    return found


BLOCKS = _blocks()


def _stand_ins() -> dict:
    """What the fragments use without defining it: one process's small objects."""
    sys.path.insert(0, str(ROOT / "examples"))
    from fsdp import TinyTransformer  # the sharding page's model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    class Tracker:
        def state_dict(self):
            return {"seen": 1}

        def load_state_dict(self, state):
            pass

    return {
        "torch": torch,
        "model": model,
        "optimizer": optimizer,
        "loader": torch.utils.data.DataLoader(data, batch_size=16),
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=10),
        "loss_fn": torch.nn.functional.mse_loss,
        "my_tracker": Tracker(),
        "resume": False,
        "num_epochs": 1,
        "epochs": 1,
        "keep": lambda module, name: True,
        "TinyTransformer": TinyTransformer,
        "loss": torch.zeros(()),
    }


def test_every_block_is_found():
    assert len(BLOCKS) >= 10 and {page for page, *_ in BLOCKS} >= {"README.md", "docs/sharding.md"}


@pytest.mark.parametrize(("page", "index", "source", "compile_only"), BLOCKS, ids=[f"{b[0]}#{b[1]}" for b in BLOCKS])
def test_python_block_runs(page, index, source, compile_only, tmp_path, monkeypatch):
    code = compile(source, f"{page} block {index}", "exec")
    if compile_only:
        text = (ROOT / page).read_text(encoding="utf-8")
        marker = [m.start() for m in _BLOCK.finditer(text)][index]
        assert "process" in text[max(0, marker - 400) : marker] or "checkpoint" in text[max(0, marker - 400) : marker]
        return  # the page says why it cannot run on one process here
    monkeypatch.chdir(tmp_path)
    namespace = _stand_ins()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(code, namespace)
    finally:
        accelerator = namespace.get("accelerator")
        if accelerator is not None:
            accelerator.end_training()


def _public(module) -> list[tuple[str, object]]:
    return [(n, getattr(module, n)) for n in module.__all__ if not n.startswith("__")]


def test_the_reference_pages_are_current():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gen_docs_reference.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_every_public_name_is_in_the_reference_with_a_docstring():
    import hasten
    import hasten.utils

    api = (DOCS / "reference" / "api.md").read_text(encoding="utf-8")
    utils = (DOCS / "reference" / "utils.md").read_text(encoding="utf-8")
    undocumented = []
    for module, page in ((hasten, api), (hasten.utils, utils)):
        for name, obj in _public(module):
            listed = f"`from hasten import {name}`" in api or f"`from {module.__name__} import {name}`" in page
            assert listed, f"{module.__name__}.{name} is not in the reference"
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and not (obj.__doc__ or "").strip():
                undocumented.append(f"{module.__name__}.{name}")
    assert undocumented == [], f"public names without a docstring: {undocumented}"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="the docs extra is not installed (make docs)")
def test_the_site_builds_in_strict_mode(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for page in ("index.html", "launching/index.html", "reference/api/index.html", "reference/utils/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "gradient_accumulation_steps" in api  # mkdocstrings rendered Accelerator's signature
