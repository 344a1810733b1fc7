"""``install_as_accelerate()``: hasten answers every ``import accelerate...`` of the process.

Libraries built on Accelerate (transformers' ``Trainer``, TRL, PEFT, diffusers' scripts) import
``accelerate`` themselves. After ``hasten.install_as_accelerate()`` those imports get hasten's
modules, unchanged, by an import hook (STYLE.md 13: cudf.pandas's module accelerator, PyMySQL's
``install_as_MySQLdb()``), never by a copy:

* a ``MetaPathFinder`` first on ``sys.meta_path`` serves ``accelerate.X.Y`` as the module object
  ``hasten.X.Y`` itself (``sys.modules["accelerate.utils"] is hasten.utils``), when it is first
  imported; a submodule hasten lacks fails as a missing module does (``ModuleNotFoundError``
  naming it), even where a real Accelerate is installed (the finder shadows it);
* the top-level ``accelerate`` is a thin module that forwards every attribute to ``hasten``
  (``accelerate.Accelerator is hasten.Accelerator``) and says ``__version__`` =
  :data:`ACCELERATE_VERSION`, the Accelerate release whose API hasten matches, since libraries
  compare it (transformers wants >= 1.1.0, TRL >= 1.10.1);
* the same finder answers ``importlib.metadata`` for the ``accelerate`` distribution with that
  version (transformers' ``is_accelerate_available`` reads it beside ``find_spec``).

Installing after the real ``accelerate`` was imported is refused (its classes are already bound
in the importing modules), naming the modules loaded. Installing twice does nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

__all__ = ["ACCELERATE_VERSION", "install_as_accelerate", "is_installed"]

#: The Accelerate release whose API hasten matches (pyproject.toml's ``parity`` extra pins the same).
ACCELERATE_VERSION = "1.15.0"

_ALIAS = "accelerate"
_TARGET = "hasten"


def _target_name(fullname: str) -> str:
    return _TARGET + fullname[len(_ALIAS) :]


def _alias_loaded_children(alias: str, module: types.ModuleType) -> None:
    """Register, under ``alias``, the submodules of ``module`` that are loaded already: importing
    one of them through the hook would otherwise set it as an attribute of its parent, over a name
    the parent binds to something else (``hasten.utils.tqdm`` is a function, as in Accelerate)."""
    prefix = module.__name__ + "."
    for name, child in list(sys.modules.items()):
        if name.startswith(prefix) and child is not None:
            sys.modules.setdefault(alias + name[len(module.__name__) :], child)


class _AliasLoader(importlib.abc.Loader):
    """Loads ``accelerate.X`` as the module ``hasten.X`` (the same object). hasten's module is
    imported here, not in the finder, which runs under the interpreter's global import lock."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.target_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self.target_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # the import system set the alias spec on the module: hasten's own stays its spec
        module.__spec__ = self.target_spec
        _alias_loaded_children(_ALIAS + self.target[len(_TARGET) :], module)


class _TopLoader(importlib.abc.Loader):
    """Makes the top-level ``accelerate``: a package with no folder (its submodules all come
    through the finder) whose attributes are hasten's."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _AccelerateModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__version__ = ACCELERATE_VERSION
        module.__path__ = []


class _AccelerateModule(types.ModuleType):
    """``accelerate``: every attribute is ``hasten``'s, and a submodule of hasten's is loaded on
    first use (as Accelerate's ``__init__`` imports its submodules)."""

    def __getattr__(self, name: str) -> Any:
        hasten = importlib.import_module(_TARGET)
        try:
            return getattr(hasten, name)
        except AttributeError:
            if name.startswith("_") or importlib.util.find_spec(f"{_TARGET}.{name}") is None:
                raise AttributeError(f"module 'accelerate' (hasten) has no attribute {name!r}") from None
        return importlib.import_module(f"{_ALIAS}.{name}")

    def __dir__(self) -> list[str]:
        hasten = importlib.import_module(_TARGET)
        return sorted(set(dir(hasten)) | set(self.__dict__))


class _Distribution(importlib.metadata.Distribution):
    """The ``accelerate`` distribution's metadata: hasten, at the Accelerate version it matches."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (
                "Metadata-Version: 2.1\n"
                f"Name: {_ALIAS}\n"
                f"Version: {ACCELERATE_VERSION}\n"
                "Summary: hasten, installed as accelerate (hasten.install_as_accelerate())\n"
            )
        return None

    def locate_file(self, path: Any) -> Any:
        import pathlib

        return pathlib.Path(importlib.import_module(_TARGET).__file__).parent / str(path)


class AccelerateFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` once installed: ``accelerate`` and its submodules are hasten's."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == _ALIAS:
            spec = importlib.machinery.ModuleSpec(_ALIAS, _TopLoader(), origin="hasten (install_as_accelerate)")
            spec.submodule_search_locations = []
            return spec
        if not fullname.startswith(_ALIAS + "."):
            return None
        name = _target_name(fullname)
        found = importlib.util.find_spec(name)  # its parent is loaded already: this imports nothing
        if found is None:
            return None  # and the alias's parent has no folder: "No module named 'accelerate.X'"
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(name), origin=found.origin)
        if found.submodule_search_locations is not None:
            spec.submodule_search_locations = []
        return spec

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterator[importlib.metadata.Distribution]:
        name = context.name if context is not None else None
        if name is not None and name.replace("-", "_").replace(".", "_").lower() == _ALIAS:
            yield _Distribution()

    def invalidate_caches(self) -> None:
        return None


_finder = AccelerateFinder()


def is_installed() -> bool:
    """Whether ``install_as_accelerate()`` is in effect in this process."""
    return _finder in sys.meta_path


def _loaded_accelerate() -> list[str]:
    """The modules of a real Accelerate already imported (not hasten's aliases)."""
    found = []
    for name, module in list(sys.modules.items()):
        if name == _ALIAS or name.startswith(_ALIAS + "."):
            if not isinstance(module, _AccelerateModule) and not (
                module is not None and getattr(module, "__name__", "").startswith(_TARGET)
            ):
                found.append(name)
    return sorted(found)


def install_as_accelerate() -> None:
    """Make ``import accelerate...`` give hasten's modules, in this process (see the module's text).

    Call it before transformers, TRL, PEFT or diffusers is imported (``hasten launch
    --as_accelerate`` calls it in every process before the script runs). Installing after the
    real ``accelerate`` was imported is refused; installing twice does nothing.
    """
    if is_installed():
        return
    loaded = _loaded_accelerate()
    if loaded:
        shown = ", ".join(loaded[:8]) + (f" and {len(loaded) - 8} more" if len(loaded) > 8 else "")
        raise RuntimeError(
            "install_as_accelerate() must run before accelerate is imported: the real accelerate's modules "
            f"are loaded already ({shown}), and the code that imported them holds its classes. Call "
            "hasten.install_as_accelerate() first thing in the script (before importing transformers, trl, "
            "peft or diffusers), or run it with `hasten launch --as_accelerate`"
        )
    sys.meta_path.insert(0, _finder)
    importlib.invalidate_caches()


def run(argv: list[str]) -> None:
    """``python -m hasten.compat.as_accelerate (script.py | -m module) [args]``: run an unmodified
    script as ``python script.py`` would, with hasten installed as accelerate first (what
    ``hasten launch --as_accelerate`` runs for one process; its workers install it themselves)."""
    from hasten._main import run_as_main

    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit("usage: python -m hasten.compat.as_accelerate (script.py | -m module) [args]")
    install_as_accelerate()
    run_as_main(argv, "")


if __name__ == "__main__":  # pragma: no cover - run by `python -m` (the installed module is the imported one)
    from hasten.compat.as_accelerate import run as _run

    _run(sys.argv[1:])
