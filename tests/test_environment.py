"""hasten.settings.environment is the one module that names and touches the environment (issue 39).

* no other module of src/hasten reads or writes ``os.environ`` (or calls ``os.getenv``/``putenv``);
* every HASTEN_* / ACCELERATE_* variable the README documents is a constant there, spelled as
  the variable, and the launch settings' variables are among them;
* the readers and writers keep the meaning they had where each module read the variable itself.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hasten.settings import environment

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "hasten"
ALLOWED = {SRC / "settings" / "environment.py"}
_OS_ENV_CALLS = {"getenv", "putenv", "unsetenv", "getenvb", "environb"}


def _environment_uses(path: Path) -> list[str]:
    """``os.environ``/``os.getenv``/... in the file's code, and imports of them from ``os``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
            and (node.attr == "environ" or node.attr in _OS_ENV_CALLS)
        ):
            found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name == "environ" or alias.name in _OS_ENV_CALLS:
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: from os import {alias.name}")
    return found


def test_only_the_environment_module_touches_os_environ():
    uses = [use for path in sorted(SRC.rglob("*.py")) if path not in ALLOWED for use in _environment_uses(path)]
    assert uses == [], "read or write the environment through hasten.settings.environment:\n" + "\n".join(uses)


def test_the_scan_sees_a_use(tmp_path):
    """The scan itself finds what it looks for (so an empty result means something)."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom os import getenv\nx = os.environ.get('RANK')\nos.putenv('A', 'b')\n")
    uses = sorted(_environment_uses(probe), key=lambda u: int(u.split(":")[1]))
    assert [u.split(": ", 1)[1] for u in uses] == ["from os import getenv", "os.environ", "os.putenv"]


def _defined_names() -> dict[str, str]:
    return {k: val for k, val in vars(environment).items() if k.isupper() and isinstance(val, str)}


def test_every_documented_variable_is_named_in_the_module():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the README and the guides
    readme = "\n".join(page.read_text(encoding="utf-8") for page in pages)
    documented = set(re.findall(r"\b(?:HASTEN|ACCELERATE)_[A-Z0-9_]*[A-Z0-9]\b", readme))
    assert documented, "the docs document HASTEN_* variables"
    names = _defined_names()
    missing = sorted(name for name in documented if names.get(name) != name)
    assert missing == [], f"documented in the docs, not defined in hasten.settings.environment: {missing}"


def test_constants_are_spelled_as_their_variables():
    names = _defined_names()
    wrong = {k: val for k, val in names.items() if k != val and k != "PREFIX"}
    assert wrong == {}
    assert environment.PREFIX == "HASTEN_"
    for mapping in (environment.FSDP_FIELDS, environment.PARALLELISM_SIZES):
        assert all(names.get(val) == val for val in mapping.values())
    assert all(names.get(n) == n for pair in environment.DYNAMO_FIELDS.values() for n in pair)


def test_every_launch_setting_variable_is_named_in_the_module():
    from hasten.settings.launch_settings import LAUNCH_SETTINGS

    names = _defined_names()
    variables = {s.env for s in LAUNCH_SETTINGS.values() if s.env}
    assert variables and sorted(v for v in variables if names.get(v) != v) == []


def test_choices_holds_no_variable_names():
    from hasten.settings import choices

    assert [k for k in vars(choices) if k.startswith("ENV_")] == []


def test_readers(monkeypatch):
    monkeypatch.delenv("HASTEN_USE_CPU", raising=False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("HASTEN_MIXED_PRECISION", "")
    assert environment.env_text("HASTEN_MIXED_PRECISION", "ACCELERATE_MIXED_PRECISION") == "bf16"
    assert environment.get("HASTEN_MIXED_PRECISION") == "" and environment.is_set("HASTEN_MIXED_PRECISION")
    assert environment.get("HASTEN_USE_CPU", "x") == "x" and not environment.is_set("HASTEN_USE_CPU")
    assert environment.env_flag("HASTEN_USE_CPU", environ={"HASTEN_USE_CPU": "on"}) is True
    monkeypatch.setenv("WORLD_SIZE", " 4 ")
    assert environment.env_int("WORLD_SIZE", 1) == 4
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="environment variable WORLD_SIZE must be an integer, got 'four'"):
        environment.env_int("WORLD_SIZE", 1)
    for raw, rank in (("3", 3), ("x", 0), ("", 0)):
        monkeypatch.setenv("RANK", raw)
        assert environment.env_rank() == rank
    monkeypatch.delenv("RANK")
    assert environment.env_rank() == 0
    with pytest.raises(KeyError):
        environment.require("RANK")
    monkeypatch.setenv("HASTEN_ZZ_PROBE", "1")
    assert environment.with_prefix("HASTEN_ZZ_") == {"HASTEN_ZZ_PROBE": "1"}


def test_writers(monkeypatch):
    monkeypatch.delenv("HASTEN_ZZ_A", raising=False)
    monkeypatch.setenv("HASTEN_ZZ_B", "old")
    with environment.patched({"HASTEN_ZZ_A": "1", "HASTEN_ZZ_B": "new"}):
        assert os.environ["HASTEN_ZZ_A"] == "1" and os.environ["HASTEN_ZZ_B"] == "new"
    assert "HASTEN_ZZ_A" not in os.environ and os.environ["HASTEN_ZZ_B"] == "old"
    monkeypatch.setenv("HASTEN_ZZ_A", "x")  # monkeypatch restores it
    environment.export({"HASTEN_ZZ_A": "2"})
    assert os.environ["HASTEN_ZZ_A"] == "2"
    assert environment.export_default("HASTEN_ZZ_A", "3") == "2"
    monkeypatch.delenv("HASTEN_ZZ_A")
    assert environment.export_default("HASTEN_ZZ_A", "3") == "3"


def test_importing_it_imports_no_torch():
    code = "import sys, hasten.settings.environment; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr
