"""hasten.logging.get_logger in one process (the 2-process checks are in test_parity.py)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from hasten.logging import MultiProcessAdapter, get_logger


@pytest.fixture(autouse=True)
def root_level():
    """get_logger sets the root logger's level too (as Accelerate's does): put it back."""
    before = logging.root.level
    yield
    logging.root.setLevel(before)


@pytest.fixture
def records():
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    keep = Keep()
    logger = logging.getLogger("hasten-test")
    logger.addHandler(keep)
    yield seen
    logger.removeHandler(keep)
    logger.setLevel(logging.NOTSET)


def test_the_main_process_logs_and_the_record_points_at_the_caller(records, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    logger = get_logger("hasten-test", log_level="info")
    assert isinstance(logger, MultiProcessAdapter) and logger.logger.level == logging.INFO
    logger.info("hello %s", "there")
    logger.log(logging.WARNING, "direct")
    logger.debug("below the level")
    assert [r.getMessage() for r in records] == ["hello there", "direct"]
    assert all(r.filename == "test_logging.py" and r.funcName.startswith("test_the_main") for r in records)


def test_other_ranks_log_only_what_is_marked_for_every_process(records, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    logger = get_logger("hasten-test", log_level="INFO")
    logger.info("main only")
    logger.warning("everyone", main_process_only=False)
    assert [r.getMessage() for r in records] == ["everyone"]


def test_warning_once(records, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    logger = get_logger("hasten-test", log_level="WARNING")
    for _ in range(3):
        logger.warning_once("careful")
    logger.warning_once("another")
    assert [r.getMessage() for r in records] == ["careful", "another"]
    assert records[0].filename == "test_logging.py"


def test_log_level_from_the_environment_and_bad_levels(monkeypatch):
    monkeypatch.setenv("HASTEN_LOG_LEVEL", "ERROR")
    assert get_logger("hasten-env-test").logger.level == logging.ERROR == logging.root.level
    with pytest.raises(ValueError, match="get_logger.log_level must be one of .*'INFO'.*got 'LOUD'"):
        get_logger("hasten-env-test", log_level="loud")
    with pytest.raises(TypeError, match="log_level must be a level name"):
        get_logger("hasten-env-test", log_level=2.5)
    with pytest.raises(TypeError, match="get_logger name must be a str"):
        get_logger(3)


def test_importing_the_logger_imports_no_torch():
    code = "import sys, hasten.logging; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
