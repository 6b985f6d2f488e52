"""The pytest plugin tools/conformance.py loads into every run it starts.

It is passed as ``-p conformance_plugin`` (tools/ is on PYTHONPATH), so pytest
loads it before it collects the test files:

* ``CONFORMANCE_IMPORT_CPPWRAP=1`` imports torch_cppwrap at configure time, so
  every graph the tests compile goes through our wrapper, and stops the run
  if the import patched nothing (an unsupported torch would otherwise compare
  upstream against itself);
* ``CONFORMANCE_TEST_TIMEOUT=<seconds>`` fails a test that runs longer, so one
  hang costs one test, not the whole run (pytest-timeout is not a dependency).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Generator
from types import FrameType
from typing import Any

import pytest

IMPORT_CPPWRAP = "CONFORMANCE_IMPORT_CPPWRAP"
TEST_TIMEOUT = "CONFORMANCE_TEST_TIMEOUT"


def _mode() -> str:
    return "ours" if os.environ.get(IMPORT_CPPWRAP) == "1" else "upstream"


def pytest_configure(config: pytest.Config) -> None:
    if _mode() != "ours":
        return
    import torch_cppwrap

    if not torch_cppwrap.is_patched():
        raise pytest.UsageError("torch_cppwrap is imported but patched nothing")


def pytest_report_header(config: pytest.Config) -> str:
    return f"conformance mode: {_mode()}"


def _timeout_seconds() -> int:
    return int(os.environ.get(TEST_TIMEOUT, "0"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    seconds = _timeout_seconds()
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        return (yield)

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"conformance: test ran longer than {seconds}s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        return (yield)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
