"""One worker of ``hasten launch``: ``python -m hasten.cli._child (script.py | -m module) [args]``.

Runs the script (or module) as ``python script.py`` (``python -m module``) would: same
``sys.argv``, ``sys.path[0]``, ``__name__ == "__main__"`` and absolute ``__file__``. When
the script raises, the exception is written to the error file that torch.distributed.run's
agent names in ``TORCHELASTIC_ERROR_FILE`` (the format of torch's ``@record``), then the
traceback is printed through ``sys.excepthook`` and the worker exits with status 1.
No torch import here: the script imports what it needs.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from types import TracebackType

_OWN_FILES = {__file__, getattr(runpy, "__file__", None), "<frozen runpy>"}


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without this wrapper's and runpy's frames."""
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in _OWN_FILES:
        tb = tb.tb_next
    return tb


def _write_error_file(exc: BaseException, tb: TracebackType | None) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(exc), exc, tb)),
                "timestamp": str(int(now)),
                "hasten_time": now,  # sub-second, to tell which rank failed first
            },
        }
    }
    try:
        with open(path, "w", encoding="utf-8") as fp:
            json.dump(data, fp)
    except OSError:  # pragma: no cover - the traceback is still printed below
        pass


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m hasten.cli._child (script.py | -m module) [args]")
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]  # run_module puts the module's path in sys.argv[0]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            path = os.path.abspath(argv[0])
            sys.path[0] = os.path.dirname(os.path.realpath(path))  # as `python script.py` does
            runpy.run_path(path, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - report it the way an uncaught exception is reported
        tb = _user_frames(exc.__traceback__)
        _write_error_file(exc, tb)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.stderr.flush()
        raise SystemExit(1) from None


if __name__ == "__main__":
    main(sys.argv[1:])
