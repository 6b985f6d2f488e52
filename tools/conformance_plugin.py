"""The pytest plugin tools/conformance.py loads into every run it starts.

It is passed as ``-p conformance_plugin`` (tools/ is on PYTHONPATH), so pytest
loads it before it collects the test files:

* ``CONFORMANCE_IMPORT_CPPWRAP=1`` imports torch_cppwrap at configure time, so
  every graph the tests compile goes through our wrapper, and stops the run
  if the import patched nothing (an unsupported torch would otherwise compare
  upstream against itself);
* ``CONFORMANCE_TEST_TIMEOUT=<seconds>`` fails a test that runs longer, so one
  hang costs one test, not the whole run (pytest-timeout is not a dependency);
* ``CONFORMANCE_PROGRESS_LOG=<path>`` records each test's outcome as it
  finishes (one JSON line per phase that failed or skipped, and per call),
  so a run killed at its time limit before pytest writes its JUnit file
  still counts the tests that ran;
* on a torch older than the test files, ``conformance_backfill`` defines the
  few test helpers they import and the torch lacks, and each test module the
  cpp_wrapper files only borrow test methods from (``BORROWED``) that cannot
  be imported is replaced by a stand-in whose tests skip, naming the reason.
  Both happen in both modes, so they never tilt the comparison.
"""

from __future__ import annotations

import importlib
import importlib.abc
import json
import os
import signal
import sys
import types
import unittest
from collections.abc import Generator, Sequence
from importlib.machinery import ModuleSpec
from types import FrameType
from typing import Any

import pytest

IMPORT_CPPWRAP = "CONFORMANCE_IMPORT_CPPWRAP"
TEST_TIMEOUT = "CONFORMANCE_TEST_TIMEOUT"


def _mode() -> str:
    return "ours" if os.environ.get(IMPORT_CPPWRAP) == "1" else "upstream"


# Test modules test_cpu_cpp_wrapper.py and test_gpu_cpp_wrapper.py import
# only to borrow test methods from their classes.
BORROWED = (
    "test_mkldnn_pattern_matcher",
    "test_cpu_select_algorithm",
    "test_combo_kernels",
    "test_select_algorithm",
    "test_pattern_matcher",
    "test_foreach",
)


def _stand_in_class(module: str, reason: str) -> type:
    message = f"{module} stood in: {reason}"

    class StandIn(unittest.TestCase):
        def __getattr__(self, name: str) -> Any:
            if not name.startswith("test_"):
                raise AttributeError(name)

            def skipped(*args: Any, **kwargs: Any) -> None:
                raise unittest.SkipTest(message)

            skipped.__name__ = name
            return skipped

    return StandIn


def _stand_in_module(name: str, reason: str) -> types.ModuleType:
    module = types.ModuleType(name, f"conformance stand-in: {reason}")
    # Any class the borrowing file asks for; none of them lists a test, so
    # parametrized families borrowed with dir() are simply absent.
    module.__getattr__ = lambda attr: _stand_in_class(name, reason)  # type: ignore[method-assign]
    return module


STAND_IN_LOG = "CONFORMANCE_STAND_IN_LOG"


def _record_stand_in(name: str, reason: str) -> None:
    path = os.environ.get(STAND_IN_LOG)
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{name}: {reason}\n")


class _StandInLoader(importlib.abc.Loader):
    """Runs the real module; if that raises, leaves a stand-in in its place."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        try:
            self.loader.exec_module(module)
        except Exception as error:  # ImportError, or a newer helper's TypeError
            reason = f"{type(error).__name__}: {error}"
            _record_stand_in(module.__name__, reason)
            for attr in [a for a in vars(module) if not a.startswith("__")]:
                delattr(module, attr)
            stand_in = _stand_in_module(module.__name__, reason)
            module.__getattr__ = stand_in.__getattr__  # type: ignore[method-assign]


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Imports each BORROWED module where the borrowing file imports it.

    Importing them up front would change the order in which their own
    imports run (torchvision, for one, cannot be imported twice after a
    failed first attempt); wrapping the loader keeps the natural order.
    """

    def find_spec(
        self,
        name: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> ModuleSpec | None:
        if name not in BORROWED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _StandInLoader(spec.loader)
                return spec
        return None


PROGRESS_LOG = "CONFORMANCE_PROGRESS_LOG"


class _ProgressRecord:
    """Appends each test phase's outcome to a JSON-lines file as it ends."""

    def __init__(self, path: str) -> None:
        self.path = path

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" and report.outcome == "passed":
            return
        if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
            message = report.longrepr[2]
        else:  # what JUnit's message holds: the exception raised
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else ""
        entry = {
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "message": message,
            "details": report.longreprtext,
        }
        with open(self.path, "a", encoding="utf-8") as log:
            log.write(json.dumps(entry) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    import conformance_backfill

    config.stash[BACKFILLED] = conformance_backfill.install()
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder())
    # Under pytest-xdist the controller sees every worker's reports, and a
    # worker (it has config.workerinput) records none.  The environment
    # cannot tell them apart: a run started from inside a worker inherits
    # PYTEST_XDIST_WORKER.
    progress = os.environ.get(PROGRESS_LOG)
    if progress and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_ProgressRecord(progress))
    if _mode() != "ours":
        return
    import torch_cppwrap

    if not torch_cppwrap.is_patched():
        raise pytest.UsageError("torch_cppwrap is imported but patched nothing")


BACKFILLED = pytest.StashKey[list[str]]()


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"conformance mode: {_mode()}"]
    lines += [f"backfilled: {name}" for name in config.stash.get(BACKFILLED, [])]
    return lines


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
