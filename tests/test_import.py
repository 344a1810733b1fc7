"""`import hasten` stays cheap: public names load on first use, nothing heavy at import."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return set(out.split())


def test_import_hasten_is_lazy():
    mods = _modules_after("import hasten")
    assert "torch" not in mods
    assert "hasten.accelerator" not in mods


def test_accelerator_import_loads_nothing_heavy():
    mods = _modules_after("from hasten import Accelerator, ProfileKwargs")
    assert "torch" in mods
    extra = mods - _modules_after("import torch")  # what hasten adds over torch itself
    for heavy in ("torch.distributed.run", "yaml", "tqdm", "matplotlib", "safetensors", "numpy.testing"):
        assert heavy not in extra, heavy


def test_handlers_import_without_torch():
    mods = _modules_after("from hasten.settings.handlers import DistributedDataParallelKwargs as D; D(bucket_cap_mb=5)")
    assert "torch" not in mods


def test_public_names():
    import hasten

    for name in hasten.__all__:
        assert getattr(hasten, name) is not None
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'Acelerator'"):
        hasten.Acelerator  # noqa: B018
