"""Where automatically named checkpoints live, and their rotation (``total_limit``)."""

from __future__ import annotations

import os
import re
import secrets
import shutil

CHECKPOINTS = "checkpoints"
ITERATION = re.compile(r"checkpoint_(\d+)")


def checkpoints_root(project_dir: str | os.PathLike | None, call: str) -> str:
    if project_dir is None:
        raise ValueError(
            f"{call}() without a directory uses automatic naming under Accelerator(project_dir=...) "
            "(or ProjectConfiguration(project_dir=...)), but project_dir is None: pass a directory or set project_dir"
        )
    return os.path.join(os.path.abspath(project_dir), CHECKPOINTS)


def iteration_of(directory: str) -> int | None:
    """N for a directory named ``checkpoint_N``, else None."""
    match = ITERATION.fullmatch(os.path.basename(directory))
    return int(match.group(1)) if match else None


def iterations(root: str) -> list[int]:
    """The N of every ``checkpoint_N`` directory in ``root``, sorted."""
    if not os.path.isdir(root):
        return []
    found = (ITERATION.fullmatch(e) for e in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


def remove_tree(path: str) -> None:
    """Rename aside (so a crash never leaves a half-deleted checkpoint at its name), then delete."""
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, f".{name}.del-{secrets.token_hex(6)}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def rotate(root: str, keep: int, protect: str) -> None:
    """Keep the newest ``keep`` checkpoints in ``root``; ``protect`` (the one just written) stays."""
    for n in iterations(root)[:-keep]:
        path = os.path.join(root, f"checkpoint_{n}")
        if path != protect:
            remove_tree(path)
