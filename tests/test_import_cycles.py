"""No import cycles inside src/hasten, no source file and no function over the size limits.

The graph is built from the source with ``ast``: the imports a module runs when it is imported
(its top level, class bodies and top-level ``if``/``try`` blocks), not those inside functions
(they run later, when everything is loaded) nor those under ``if TYPE_CHECKING:``. A second
check counts the imports inside functions too (a lazy import must not hide a cycle), a third
those under ``if TYPE_CHECKING:`` as well. An edge
``a -> b`` means importing ``a`` imports ``b``; ``from .pkg import name`` counts as an edge to
``pkg.name`` where that is a module, else to ``pkg`` (never to a package holding the module,
e.g. ``from .. import __version__``: Python imported that package first).

The ground floor: settings/ imports nothing of hasten above it, not even inside a function or
under ``if TYPE_CHECKING:`` (every import statement of the file counts, ``ast.walk``).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "hasten"
MAX_LINES = 900


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(body: list[ast.stmt], lazy: bool, typing: bool) -> list[ast.stmt]:
    """The import statements run when the module is imported; with ``lazy`` also those inside
    functions (run when the function is called), with ``typing`` those under ``if TYPE_CHECKING:``."""
    found: list[ast.stmt] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if typing or not _is_type_checking(node.test):
                found += _import_nodes(node.body, lazy, typing)
            found += _import_nodes(node.orelse, lazy, typing)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += _import_nodes(block, lazy, typing)
        elif isinstance(node, (ast.With, ast.ClassDef, ast.For, ast.While)):
            found += _import_nodes(node.body, lazy, typing)
        elif lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += _import_nodes(node.body, lazy, typing)
    return found


def _edges(name: str, path: Path, modules: dict[str, Path], lazy: bool, typing: bool) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)).body, lazy, typing):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        # A module's own packages are imported before it anyway: an edge to one is no cycle.
        out.update(t for t in targets if t in modules and t != name and not name.startswith(t + "."))
    return out


def import_graph(lazy: bool = False, typing: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules, lazy, typing) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_graph_sees_imports():
    graph = import_graph()
    # A few edges that exist, so an empty or broken graph cannot pass the cycle check.
    assert "hasten.distributed.state" in graph["hasten.accelerator"]
    assert "hasten.data_loader.core" in graph["hasten.data_loader.dispatch"]
    assert "hasten._validate" in graph["hasten.data_loader.core"]  # from .. import _validate


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle in src/hasten: " + " -> ".join(cycle or [])


def test_no_cycles_through_imports_inside_functions():
    # A lazy import is a seam (e.g. a torch-free module building its torch object on demand),
    # not a way to hide a cycle: counted as edges too, the graph is still acyclic.
    graph = import_graph(lazy=True)
    assert "hasten.settings.comm_hooks" in graph["hasten.settings.handlers"]  # DDPKwargs.register_comm_hook()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in src/hasten through an import inside a function: " + " -> ".join(cycle or [])


def test_no_source_file_over_the_limit():
    long = {
        str(p.relative_to(SRC)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"source files over {MAX_LINES} lines: {long}"


def test_no_cycles_through_type_checking_imports():
    # The names a module only annotates with point downwards too (a Protocol or the shared
    # piece moved to the lower module), so the layering reads the same to a type checker.
    graph = import_graph(lazy=True, typing=True)
    assert "hasten.settings.plugins" in graph["hasten.training.compile"]  # under if TYPE_CHECKING:
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in src/hasten through `if TYPE_CHECKING:` imports: " + " -> ".join(cycle or [])


# ---------------------------------------------------------------------- the ground floor

GROUND = "hasten.settings"
#: hasten's modules outside settings/ on the ground floor with it: leaves that import nothing of hasten
GROUND_FLOOR_LEAVES = ("hasten._validate",)


def _every_import(path: Path, name: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every import of hasten anywhere in the file ``path`` of module
    ``name``: top level, ``if TYPE_CHECKING:``, function and method bodies alike (``ast.walk``),
    and ``importlib.import_module``/``__import__`` of a constant name. ``from pkg import x``
    counts as ``pkg.x`` where that is a module of hasten, else as ``pkg`` (a name the package
    itself defines, ``hasten`` included)."""
    modules = _modules()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base) for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return [(line, target) for line, target in found if target == "hasten" or target.startswith("hasten.")]


def _on_the_ground_floor(target: str) -> bool:
    return target == GROUND or target.startswith(GROUND + ".") or target in GROUND_FLOOR_LEAVES


def test_every_import_sees_function_level_and_type_checking_imports(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from hasten import _validate\n"
        "if TYPE_CHECKING:\n    from hasten.strategies.base import Strategy\n"
        "class C:\n    def m(self):\n        from hasten.distributed import state\n"
        "def f():\n    import importlib\n    return importlib.import_module('hasten.checkpoint')\n"
        "def g():\n    from hasten import Accelerator\n"
    )
    seen = {target for _, target in _every_import(source, "hasten.settings.probe")}
    up = {"hasten.strategies.base", "hasten.distributed.state", "hasten.checkpoint", "hasten"}
    assert seen == up | {"hasten._validate"}
    assert {t for t in seen if not _on_the_ground_floor(t)} == up


def test_settings_import_only_the_ground_floor():
    """settings/ is the ground floor (shared/DESIGN.md: imports run downhill): its modules import
    only each other and the leaves listed above, whether at import time, under ``if TYPE_CHECKING:``
    or inside a function. What a setting needs from higher up is an argument, a lookup in the
    module that consumes it, or a piece moved down here."""
    settings = {name: path for name, path in _modules().items() if name == GROUND or name.startswith(GROUND + ".")}
    assert "hasten.settings.resolve" in settings and "hasten.settings.config_file" in settings
    up = [
        f"{path.relative_to(SRC)}:{line} imports {target}"
        for name, path in settings.items()
        for line, target in _every_import(path, name)
        if not _on_the_ground_floor(target)
    ]
    assert not up, "settings/ reaches up (imports must run downhill):\n" + "\n".join(up)
    modules = _modules()
    for leaf in GROUND_FLOOR_LEAVES:
        assert not _every_import(modules[leaf], leaf), f"{leaf} is on the ground floor, so it imports nothing of hasten"


MAX_FUNCTION_LINES = 80


def test_no_function_over_the_limit():
    # A function (its signature, docstring and body) fits on a screen: over 80 lines it is split.
    long = {
        f"{p.relative_to(SRC)}:{node.lineno} {node.name}": size
        for p in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (size := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
