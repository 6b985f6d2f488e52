"""tools/conformance.py: JUnit parsing, the upstream/ours comparison, the report.

No PyTorch test file is needed: the end-to-end test runs a tiny synthetic test
file, in a temporary directory, through both modes.
"""

from __future__ import annotations

import os
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from torch._inductor.test_case import TestCase, run_tests

from tests.common import load_script

conformance = load_script("tools/conformance.py")

COMPILE_LOG = textwrap.dedent(
    """\
    CppCompileError: C++ compile error
    /tmp/x/cabc.cpp:12:5: error: 'div_floor_integer' is not a member of 'c10'
    """
)
JUNIT = f"""\
<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="test_x.T" name="test_ok" time="1.0"/>
<testcase classname="test_x.T" name="test_compile" time="1.0">
<failure message="torch._inductor.exc.InductorError: CppCompileError: C++ compile error&#10;more"
>{COMPILE_LOG}</failure></testcase>
<testcase classname="test_x.T" name="test_error" time="0.1">
<error message="failed on setup with &quot;RuntimeError: boom&quot;">trace</error>
</testcase>
<testcase classname="test_x.T" name="test_skip" time="0.0">
<skipped type="pytest.skip" message="needs a GPU">skip</skipped></testcase>
<testcase classname="" name="test_y" time="0.0">
<error message="collection failure">Traceback
E   ImportError: cannot import name 'quantizer'</error></testcase>
</testsuite></testsuites>
"""


def case(test_id: str, outcome: str, message: str = "") -> Any:
    return conformance.CaseResult(test_id, outcome, message, message)


def results(*cases: Any) -> dict[str, Any]:
    return {c.test_id: c for c in cases}


class TestJUnit(TestCase):
    def parse(self) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "junit.xml"
            path.write_text(JUNIT)
            return conformance.parse_junit(path)

    def test_outcomes(self) -> None:
        parsed = self.parse()
        outcomes = {i: r.outcome for i, r in parsed.items()}
        self.assertEqual(
            outcomes,
            {
                "test_x.T::test_ok": "passed",
                "test_x.T::test_compile": "failed",
                "test_x.T::test_error": "error",
                "test_x.T::test_skip": "skipped",
                "::test_y": "error",
            },
        )

    def test_messages(self) -> None:
        parsed = self.parse()
        compile_failure = parsed["test_x.T::test_compile"]
        self.assertEqual(
            compile_failure.message,
            "torch._inductor.exc.InductorError: CppCompileError: C++ compile error",
        )
        self.assertEqual(
            conformance.compiler_error(compile_failure.details),
            "/tmp/x/cabc.cpp:12:5: error: 'div_floor_integer' is not a member of 'c10'",
        )
        self.assertEqual(parsed["test_x.T::test_skip"].message, "needs a GPU")

    def test_collection_failure_says_why(self) -> None:
        errors = conformance.collection_errors(self.parse())
        self.assertEqual(
            [e.message for e in errors],
            ["collection failure: ImportError: cannot import name 'quantizer'"],
        )

    def test_compiler_error_absent(self) -> None:
        self.assertIsNone(conformance.compiler_error("AssertionError: 1 != 2"))


class TestComparison(TestCase):
    upstream = results(
        case("t::same", "passed"),
        case("t::regressed", "passed"),
        case("t::both", "failed", "old API"),
        case("t::fixed", "error", "boom"),
        case("t::crashed", "passed"),
        case("t::skipped", "skipped"),
    )
    ours = results(
        case("t::same", "passed"),
        case("t::regressed", "failed", "AssertionError: no profiler event"),
        case("t::both", "error", "old API"),
        case("t::fixed", "passed"),
        case("t::skipped", "skipped"),
    )

    def test_regressions(self) -> None:
        found = conformance.regressions(self.upstream, self.ours)
        self.assertEqual([c.test_id for c in found], ["t::regressed"])
        self.assertEqual(found[0].message, "AssertionError: no profiler event")

    def test_other_lists(self) -> None:
        self.assertEqual(
            conformance.broken_in_both(self.upstream, self.ours), ["t::both"]
        )
        self.assertEqual(
            conformance.fixed_by_ours(self.upstream, self.ours), ["t::fixed"]
        )
        self.assertEqual(
            conformance.missing_in_ours(self.upstream, self.ours), ["t::crashed"]
        )

    def test_counts(self) -> None:
        counts = conformance.count_outcomes(self.ours)
        self.assertEqual(
            (counts["passed"], counts["failed"], counts["error"]), (2, 1, 1)
        )

    def test_report(self) -> None:
        log = Path("/logs/pytest.log")
        report = conformance.FileReport(
            "test_x.py",
            conformance.RunResult("upstream", 1, 10.0, log, self.upstream),
            conformance.RunResult("ours", None, 20.0, log, self.ours),
        )
        text = conformance.render_report([report], ["- torch: test"])
        self.assertIn("| upstream | 3 | 1 | 1 | 1 | 6 | 1 (tests failed) | 10s |", text)
        self.assertIn(
            "| ours | 2 | 1 | 1 | 1 | 5 | killed at the run time limit |", text
        )
        self.assertIn("### Pass upstream, fail ours (1)", text)
        self.assertIn("- `t::regressed`: AssertionError: no profiler event", text)
        self.assertIn("### Pass upstream, no outcome in ours (1)", text)
        self.assertIn("Fail (or error) in both modes: 1.", text)


SYNTHETIC_TESTS = textwrap.dedent(
    """\
    import sys

    import pytest


    def test_same():
        assert True


    def test_differs():
        assert "torch_cppwrap" not in sys.modules, "torch_cppwrap is imported"


    def test_skipped():
        pytest.skip("synthetic skip")
    """
)


PHASE_TESTS = textwrap.dedent(
    """\
    import pytest


    @pytest.fixture
    def broken():
        raise RuntimeError("setup broke")


    def test_passes():
        pass


    def test_fails():
        assert False, "wrong answer"


    def test_skips():
        pytest.skip("later")


    def test_setup_fails(broken):
        pass


    class TestGroup:
        @pytest.mark.parametrize("p", ["a.b"])
        def test_param(self, p):
            pass
    """
)


class TestRuns(TestCase):
    def options(self, tmp: Path, keyword: str | None = None) -> Any:
        return conformance.Options(
            test_dir=tmp / "tests",
            work_dir=tmp / "work",
            keyword=keyword,
            jobs=1,
            test_timeout=300,
            run_timeout=600,
            python=sys.executable,
        )

    def setup_dirs(self, tmp: Path) -> None:
        (tmp / "tests").mkdir()
        (tmp / "tests" / "test_synthetic.py").write_text(SYNTHETIC_TESTS)
        (tmp / "work").mkdir()
        (tmp / "work" / "pytest.ini").write_text("[pytest]\n")

    def test_both_modes(self) -> None:
        with tempfile.TemporaryDirectory() as name:
            tmp = Path(name)
            self.setup_dirs(tmp)
            report = conformance.run_file("test_synthetic.py", self.options(tmp))
            self.assertEqual(report.upstream.returncode, 0)
            self.assertEqual(report.ours.returncode, 1)
            found = conformance.regressions(
                report.upstream.results, report.ours.results
            )
            self.assertEqual(
                [c.test_id for c in found], ["test_synthetic::test_differs"]
            )
            self.assertIn("torch_cppwrap is imported", found[0].message)
            counts = conformance.count_outcomes(report.ours.results)
            self.assertEqual((counts["passed"], counts["skipped"]), (1, 1))
            # Nothing written beside the test file; the caches are gone.
            self.assertEqual(
                sorted(p.name for p in (tmp / "tests").iterdir()),
                ["test_synthetic.py"],
            )
            self.assertFalse(
                (tmp / "work" / "test_synthetic" / "ours" / "cache").exists()
            )

    def test_ours_first_reruns_only_what_ours_did_not_pass(self) -> None:
        import dataclasses

        with tempfile.TemporaryDirectory() as name:
            tmp = Path(name)
            self.setup_dirs(tmp)
            options = dataclasses.replace(self.options(tmp), ours_first=True)
            report = conformance.run_file("test_synthetic.py", options)
            self.assertEqual(len(report.ours.results), 3)
            self.assertEqual(
                sorted(report.upstream.results),
                ["test_synthetic::test_differs", "test_synthetic::test_skipped"],
            )
            found = conformance.regressions(
                report.upstream.results, report.ours.results
            )
            self.assertEqual(
                [c.test_id for c in found], ["test_synthetic::test_differs"]
            )

    def test_node_id(self) -> None:
        self.assertEqual(
            conformance.node_id("test_torchinductor.CpuTests::test_add_cpu"),
            "test_torchinductor.py::CpuTests::test_add_cpu",
        )
        self.assertEqual(
            conformance.node_id("test_synthetic::test_same[a.b]"),
            "test_synthetic.py::test_same[a.b]",
        )

    def test_no_tests_collected(self) -> None:
        with tempfile.TemporaryDirectory() as name:
            tmp = Path(name)
            self.setup_dirs(tmp)
            options = self.options(tmp, keyword="matches_nothing")
            run = conformance.run_mode("test_synthetic.py", "upstream", options)
            self.assertEqual(run.returncode, 5)
            self.assertEqual(run.results, {})
            self.assertIn("5 (no tests collected)", conformance._mode_row(run))

    def test_strict_reaches_only_our_runs_and_is_never_inherited(self) -> None:
        import dataclasses
        from unittest import mock

        with (
            tempfile.TemporaryDirectory() as name,
            mock.patch.dict(os.environ, {"TORCH_CPPWRAP_STRICT": "1"}),
        ):
            tmp = Path(name)
            default = self.options(tmp)
            strict = dataclasses.replace(default, strict=True)
            spec = conformance.FileSpec()
            env = conformance.pytest_env("ours", spec, default, tmp)
            self.assertEqual(env["TORCH_CPPWRAP_STRICT"], "0")
            env = conformance.pytest_env("ours", spec, strict, tmp)
            self.assertEqual(env["TORCH_CPPWRAP_STRICT"], "1")
            self.assertEqual(env["CONFORMANCE_IMPORT_CPPWRAP"], "1")

    def test_progress_record_agrees_with_junit(self) -> None:
        # A run killed at its limit may leave no JUnit file; the plugin's
        # record must then give the same ids and outcomes, under xdist too.
        import dataclasses

        with tempfile.TemporaryDirectory() as name:
            tmp = Path(name)
            self.setup_dirs(tmp)
            (tmp / "tests" / "test_phases.py").write_text(PHASE_TESTS)
            options = dataclasses.replace(self.options(tmp), jobs=2)
            run = conformance.run_mode("test_phases.py", "upstream", options)
            progress = tmp / "work" / "test_phases" / "upstream" / "progress.jsonl"
            recorded = conformance.parse_progress(progress)
            outcomes = {i: r.outcome for i, r in run.results.items()}
            self.assertEqual({i: r.outcome for i, r in recorded.items()}, outcomes)
            self.assertEqual(
                outcomes,
                {
                    "test_phases::test_passes": "passed",
                    "test_phases::test_fails": "failed",
                    "test_phases::test_skips": "skipped",
                    "test_phases::test_setup_fails": "error",
                    "test_phases.TestGroup::test_param[a.b]": "passed",
                },
            )
            fails = recorded["test_phases::test_fails"]
            self.assertEqual(fails.message, "AssertionError: wrong answer")
            self.assertEqual(
                recorded["test_phases::test_skips"].message, "Skipped: later"
            )
            for test_id in recorded:
                self.assertEqual(
                    conformance.junit_id(conformance.node_id(test_id)), test_id
                )

    def test_run_time_limit(self) -> None:
        with tempfile.TemporaryDirectory() as name:
            log = Path(name) / "log"
            command = [sys.executable, "-c", "import time; time.sleep(60)"]
            code = conformance.run_subprocess(command, {}, Path(name), log, 1)
            self.assertIsNone(code)


if __name__ == "__main__":
    run_tests()
