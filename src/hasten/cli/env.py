"""``hasten env``: what a bug report needs, as a Markdown block to paste into an issue."""

from __future__ import annotations

import os
import platform
import sys

from hasten import __version__
from hasten.settings import environment
from hasten.settings.accelerate_config import accelerate_default_config_path, is_accelerate_format
from hasten.settings.config_file import default_config_path, find_config_file, is_accelerate_default, read_config_data


def _yes(value: bool) -> str:
    return "yes" if value else "no"


# What hasten uses when present: checkpoints, config files, the report chart, trackers, from_pretrained.
_OPTIONAL = ("safetensors", "pyyaml", "matplotlib", "tensorboard", "wandb", "transformers", "torchao")


def _version(distribution: str) -> str:
    """The installed version of a package, without importing it ("not installed" when absent)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def env_lines() -> list[str]:
    lines = [
        f"hasten: {__version__}",
        f"Python: {platform.python_version()} ({platform.python_implementation()}) at {sys.executable}",
        f"OS: {platform.platform()}",
        f"CPU count: {os.cpu_count()}",
    ]
    try:
        import torch
        import torch.distributed as dist
    except ImportError as err:  # pragma: no cover - torch is a dependency
        lines.append(f"torch: not importable ({err})")
    else:
        lines.append(f"torch: {torch.__version__}")
        cuda = torch.cuda.is_available()
        built = f"torch built with CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build of torch"
        lines.append(f"CUDA available: {_yes(cuda)} ({built})")
        distributed = dist.is_available()
        lines.append(f"torch.distributed available: {_yes(distributed)}")
        lines.append(f"gloo available: {_yes(distributed and dist.is_gloo_available())}")
        nccl = distributed and dist.is_nccl_available()
        nccl_version = ""
        if nccl and cuda:
            try:
                nccl_version = " (version " + ".".join(map(str, torch.cuda.nccl.version())) + ")"
            except Exception:  # noqa: BLE001 - the version is a nice-to-have
                pass
        lines.append(f"NCCL available: {_yes(nccl)}{nccl_version}")
        if cuda:
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                lines.append(f"GPU {i}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
        else:
            lines.append("GPUs: none")
        from hasten.training.float8 import runs_natively

        native, why = runs_natively()
        lines.append(f"fp8 matmuls: {'native' if native else 'emulated'} ({why})")
    lines.append("optional packages: " + ", ".join(f"{name} {_version(name)}" for name in _OPTIONAL))
    visible = environment.get(environment.CUDA_VISIBLE_DEVICES)
    if visible is not None:
        lines.append(f"CUDA_VISIBLE_DEVICES: {visible!r}")
    hasten_env = environment.with_prefix(environment.PREFIX).items()
    lines.append("HASTEN_* environment: " + (", ".join(f"{k}={val}" for k, val in hasten_env) or "none"))
    try:
        path = find_config_file()
    except (OSError, ValueError) as err:  # missing, a folder, too large: a bug report says so
        lines.append(f"config file: {err}")
        return lines
    if path is None:
        lines.append(
            f"config file: none (neither {default_config_path()} nor Accelerate's {accelerate_default_config_path()} "
            "exists)"
        )
    else:
        lines.append(f"config file: {path}{_config_kind(path)}")
        lines.append(_CONTENT)
        lines.append(path.read_text(encoding="utf-8", errors="replace").rstrip())
    return lines


_CONTENT = "config file content:"


def _config_kind(path: os.PathLike) -> str:
    """`` (Accelerate's default config file, in Accelerate's format)`` and the like: which file and format."""
    what = ["Accelerate's default config file"] if is_accelerate_default(path) else []
    try:
        data = read_config_data(path)
    except (OSError, ValueError, ImportError) as err:
        what.append(f"unreadable: {err}")
    else:
        if isinstance(data, dict) and is_accelerate_format(data):
            what.append("in Accelerate's format")
    return f" ({', '.join(what)})" if what else ""


def markdown(lines: list[str]) -> str:
    """``env_lines()`` as a Markdown list; the config file's content as a fenced YAML block under it."""
    out = ["Copy and paste the text below into your bug report.", ""]
    rest = list(lines)
    while rest:
        line = rest.pop(0)
        if line == _CONTENT and rest:
            content = rest.pop(0)
            out += ["- config file content:", "", "  ```yaml", *(f"  {c}" for c in content.splitlines()), "  ```"]
        else:
            out.append(f"- {line}")
    return "\n".join(out)


def env_command() -> int:
    print(markdown(env_lines()))
    return 0
