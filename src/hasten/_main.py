"""``python -m hasten._main (script.py | -m module) [args]``: run a script as ``python script.py``
(``python -m module``) would — same ``sys.argv``, ``sys.path[0]`` and ``__name__ == "__main__"`` —
with ``hasten`` imported first, so its console filters (``hasten/_quiet.py``) are in place before the
script imports transformers. What ``hasten launch`` runs for one process on one machine (it replaces
itself with this process); ``hasten.compat.as_accelerate`` runs scripts the same way after installing
itself. No torch import here."""

from __future__ import annotations

import os
import runpy
import sys


def run_as_main(argv: list[str], usage: str) -> None:
    """Run ``argv`` (``script.py [args]`` or ``-m module [args]``) as the main program."""
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(usage)
    if argv[0] == "-m":
        sys.argv = argv[1:]  # run_module puts the module's path in sys.argv[0]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.realpath(os.path.abspath(argv[0])))  # as `python script.py` does
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":  # pragma: no cover - run by `python -m hasten._main`
    from hasten._main import run_as_main as _run

    _run(sys.argv[1:], "usage: python -m hasten._main (script.py | -m module) [args]")
