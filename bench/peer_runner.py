"""Run one of Accelerate's test scripts and record each of its checks (used by bench/peer.py).

    python -m torch.distributed.run --nproc_per_node 2 bench/peer_runner.py SCRIPT.py OUT_DIR

A *check* is one call that the script's ``main()`` makes to a function of the script itself
(``training_check(use_seedable_sampler=True)``, ``test_gather(state)``...). Each such call is
wrapped: an exception is recorded and the call returns None, so ``main()`` goes on to the next
check (what depends on the failed one may fail too, and says so). Each rank writes
OUT_DIR/rank{RANK}.json after every check, so a hang or crash still leaves what ran.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import sys
from typing import Any

_SIMPLE = (bool, int, float, str, type(None))


def _checked_names(source: str) -> set[str]:
    """The module-level functions that ``main()`` calls by name."""
    tree = ast.parse(source)
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
    if main is None:
        return set()
    return {
        n.func.id
        for n in ast.walk(main)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in functions and n.func.id != "main"
    }


def _label(name: str, args: tuple, kwargs: dict) -> str:
    parts = [repr(a) for a in args if isinstance(a, _SIMPLE)]
    parts += [f"{k}={v!r}" for k, v in kwargs.items() if isinstance(v, _SIMPLE)]
    return f"{name}({', '.join(parts)})"


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    rank = os.environ.get("RANK", "0")
    results: list[list[Any]] = []
    status = {"status": "running"}

    def dump() -> None:
        tmp = os.path.join(out, f".rank{rank}.json")
        with open(tmp, "w") as f:
            json.dump({"checks": results, **status}, f)
        os.replace(tmp, os.path.join(out, f"rank{rank}.json"))

    with open(path) as f:
        names = _checked_names(f.read())
    spec = importlib.util.spec_from_file_location("peer_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peer_script"] = module
    spec.loader.exec_module(module)
    depth = [0]
    seen: dict[str, int] = {}

    def wrap(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return fn(*args, **kwargs)
            label = _label(name, args, kwargs)
            seen[label] = seen.get(label, 0) + 1
            if seen[label] > 1:
                label += f" #{seen[label]}"
            depth[0] += 1
            try:
                result = fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - recorded, and main() goes on
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                results.append([label, f"{type(e).__name__}: {first}"[:300]])
                return None
            else:
                results.append([label, None])
                return result
            finally:
                depth[0] -= 1
                dump()

        return checked

    for name in names:
        setattr(module, name, wrap(name, getattr(module, name)))
    dump()
    try:
        module.main()
        status["status"] = "completed"
    except BaseException as e:  # noqa: BLE001 - reported in the JSON
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        status["status"] = f"main() stopped: {type(e).__name__}: {first}"[:300]
    dump()


if __name__ == "__main__":
    main()
