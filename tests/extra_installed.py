"""Whether this venv already has what ``pip install -e '.[EXTRA]'`` would install, without pip.

    python tests/extra_installed.py docs      # exit 0: installed; 1: pip is needed (the reason on stderr)

The Makefile's stamp rules run it before pip: a stamp made stale by an edit of pyproject.toml (or
missing, in a venv that ``make test`` set up with the same packages) costs a fraction of a second
instead of pip's ~45 s of re-checking every installed package. It checks that hasten is installed
from this checkout, that every requirement of the project and of the extra is installed at an allowed
version (with the extras those requirements ask for, one level down), as pip would see them.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _missing(requirements: list[str], extra: str | None = None) -> list[str]:
    from packaging.requirements import Requirement

    missing = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": extra or ""}):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{req.name} is not installed")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            missing.append(f"{req.name} {version} is installed, {req.specifier} is asked")
        for sub in sorted(req.extras):  # e.g. mkdocstrings[python]: what its "python" extra asks for
            missing += _missing(metadata.requires(req.name) or [], sub)
    return missing


def main(extras: list[str]) -> int:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    spec = importlib.util.find_spec("hasten")
    if spec is None or spec.origin is None or not Path(spec.origin).resolve().is_relative_to(ROOT / "src"):
        print("hasten is not installed from this checkout", file=sys.stderr)
        return 1
    try:
        missing = _missing(project.get("dependencies", []))
        for extra in extras:
            if extra not in project.get("optional-dependencies", {}):
                print(f"pyproject.toml has no extra {extra!r}", file=sys.stderr)
                return 1
            missing += _missing(project["optional-dependencies"][extra])
    except ImportError:  # no packaging here: let pip decide
        print("packaging is not installed", file=sys.stderr)
        return 1
    for line in missing:
        print(line, file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
