"""Checks of the machine a run starts on (``accelerate.utils.other``: ``check_os_kernel``)."""

from __future__ import annotations

import platform
import re

from hasten.logging import get_logger

__all__ = ["check_os_kernel"]

MIN_LINUX_KERNEL = (5, 5, 0)


def check_os_kernel() -> None:
    """Warn (through the ``hasten`` logger, main process) when the Linux kernel is older than 5.5,
    where processes of a distributed run can hang (as Accelerate warns). Other systems: nothing."""
    info = platform.uname()
    if info.system != "Linux":
        return
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", info.release)
    if match is None:
        return
    version = tuple(int(x) for x in match.groups())
    if version < MIN_LINUX_KERNEL:
        found, least = ".".join(map(str, version)), ".".join(map(str, MIN_LINUX_KERNEL))
        get_logger("hasten").warning(
            f"Detected kernel version {found}, which is below the recommended minimum of {least}; processes of a "
            "distributed run can hang on it. Upgrade the kernel to this version or later.",
            main_process_only=True,
        )
