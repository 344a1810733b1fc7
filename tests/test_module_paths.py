"""The README's "Module paths" table cannot lie: every module path and name it claims imports.

Each row maps an Accelerate module path to hasten's, with the names hasten has there (the
backticked identifiers of the third column). The hasten path must be Accelerate's with
``accelerate`` swapped for ``hasten`` (the one-line ``sed`` a user applies to a script).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "docs" / "accelerate.md"  # the table moved from README.md
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _table() -> list[tuple[str, str, list[str], str]]:
    """(accelerate path, hasten path, names, the names cell) of each row of the table."""
    text = README.read_text()
    match = re.search(r"^### Module paths\n(.*?)(?=^#{2,3} |\Z)", text, re.M | re.S)
    assert match, "docs/accelerate.md has no '### Module paths' section"
    rows = []
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 3 or cells[0] in ("Accelerate", "---") or set(cells[0]) <= {"-"}:
            continue
        accelerate, hasten = (c.strip("`") for c in cells[:2])
        names = [n for n in re.findall(r"`([^`]+)`", cells[2]) if _IDENT.match(n)]
        rows.append((accelerate, hasten, names, cells[2]))
    return rows


ROWS = _table()


def test_table_is_there_and_covers_the_issue_paths():
    paths = {accelerate for accelerate, *_ in ROWS}
    # The paths real scripts import (issue 28); a table that lost a row fails here.
    for path in (
        "accelerate.data_loader",
        "accelerate.optimizer",
        "accelerate.scheduler",
        "accelerate.local_sgd",
        "accelerate.utils.operations",
        "accelerate.utils.dataclasses",
        "accelerate.utils.memory",
        "accelerate.utils.random",
        "accelerate.utils.other",
        "accelerate.utils.imports",
    ):
        assert path in paths, path
    assert all(names for _, _, names, _ in ROWS)


@pytest.mark.parametrize(("accelerate", "hasten", "names"), [r[:3] for r in ROWS], ids=[r[0] for r in ROWS])
def test_every_claimed_path_and_name_imports(accelerate, hasten, names):
    assert hasten == "hasten" + accelerate[len("accelerate") :], f"{hasten} is not {accelerate} with hasten swapped in"
    module = importlib.import_module(hasten)
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{hasten} lacks {missing}"
    public = getattr(module, "__all__", None)
    if public is not None:
        assert set(names) <= set(public), f"{hasten}.__all__ lacks {sorted(set(names) - set(public))}"


def test_utils_rows_are_in_hasten_utils():
    utils = importlib.import_module("hasten.utils")
    for accelerate, hasten, names, _ in ROWS:
        if accelerate.startswith("accelerate.utils."):
            missing = [n for n in names if not hasattr(utils, n)]
            assert not missing, f"hasten.utils lacks {missing} of {hasten}"


def test_counts_the_table_states_are_true():
    for _, hasten, _, cell in ROWS:
        for count in re.findall(r"the (\d+) `is_\*_available` helpers", cell):
            module = importlib.import_module(hasten)
            helpers = [n for n in module.__all__ if re.fullmatch(r"is_\w+_available", n)]
            assert len(helpers) == int(count), (
                f"{hasten} has {len(helpers)} is_*_available helpers, the README says {count}"
            )


def test_the_sed_swap_imports_each_name_in_a_fresh_interpreter():
    # As a script does it: `from hasten.X import a, b` (a fresh process: no module loaded by another test).
    lines = [f"from {hasten} import {', '.join(names)}" for _, hasten, names, _ in ROWS]
    subprocess.run([sys.executable, "-c", "\n".join(lines)], check=True, timeout=120)
