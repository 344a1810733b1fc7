"""``accelerate.commands.config``'s ``default_config_file`` and ``load_config_from_file``.

``default_config_file`` is the config file ``hasten launch`` reads when none is named: the one
``hasten config`` writes, else Accelerate's default file when only that one exists (either
format is read). ``load_config_from_file`` reads and checks a file as ``hasten launch`` does and
gives its keys, as Accelerate's config classes do (attributes, ``to_dict()``).
"""

from __future__ import annotations

import os
from typing import Any

from hasten.settings import config_file as _config

__all__ = ["default_config_file", "load_config_from_file"]


def _default_path() -> str:
    try:
        found = _config.find_config_file(None)
    except (OSError, ValueError):  # $HASTEN_CONFIG_FILE names no file: hasten launch says so when it runs
        found = None
    return str(found if found is not None else _config.default_config_path())


#: the config file read when none is named (a path; the file may not exist)
default_config_file = _default_path()


class LoadedConfig:
    """A config file's keys, as attributes and as ``to_dict()`` (Accelerate's ``ClusterConfig``
    gives the same two views); ``path`` is the file, ``format`` "hasten" or "accelerate"."""

    def __init__(self, path: str, data: dict[str, Any], format: str) -> None:
        self.path = path
        self.format = format
        self._data = dict(data)
        for key, value in data.items():
            if isinstance(key, str) and key.isidentifier() and not hasattr(type(self), key):
                setattr(self, key, value)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)

    def __repr__(self) -> str:
        return f"LoadedConfig({self.path!r}, {self._data!r})"


def load_config_from_file(config_file: str | os.PathLike | None = None) -> LoadedConfig:
    """Read ``config_file`` (default: :data:`default_config_file`), checked as ``hasten launch``
    checks it (a bad key or value is an error naming the line)."""
    path = os.fspath(config_file) if config_file is not None else default_config_file
    if not os.path.isfile(path):
        raise ValueError(
            f"The passed configuration file {path!r} does not exist"
            + ("" if config_file is not None else ": write one with `hasten config` (or name one)")
        )
    cfg = _config.load_config(path)
    data = _config.read_config_data(path) or {}
    return LoadedConfig(str(cfg.path), data, cfg.format)
