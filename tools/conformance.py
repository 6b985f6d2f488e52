"""Run PyTorch's own Inductor test files twice, with upstream's cpp_wrapper and
with torch_cppwrap's, and list the tests that pass upstream but fail ours.

    python tools/conformance.py --test-dir ~/pytorch/test/inductor \\
        [--file test_cpu_cpp_wrapper.py ...] [-k EXPR] [-n JOBS] [--out report.md]

The test files are PyTorch's: they are read where they are (--test-dir) and
never copied into this repository.  Each file runs in two pytest subprocesses:

* upstream: plain torch, cpp_wrapper on as the file (or FILE_SPECS) sets it;
* ours: the same, with torch_cppwrap imported before collection (the
  conformance_plugin next to this file does it, and stops the run if the
  import patched nothing).

Each run gets a fresh TORCHINDUCTOR_CACHE_DIR (which holds torch_cppwrap's
cache too) and Triton cache under the work directory, so no cache of the user's is read or
written; each test a time limit (SIGALRM, in the plugin), each run a time
limit as a whole.  Outcomes come from pytest's JUnit XML.  The exit status
is 1 when some test passes upstream and fails ours, 0 otherwise.

With --ours-first, ours runs over every test and upstream only over the tests
ours did not pass: a test ours passes cannot be a regression, so the slower
upstream run shrinks to a handful of tests on a large file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS_DIR = Path(__file__).resolve().parent
PLUGIN = "conformance_plugin"
# How long a timed-out pytest run gets to write its report after SIGINT.
INTERRUPT_GRACE_SECONDS = 60
# Read by conformance_plugin.py.
IMPORT_CPPWRAP = "CONFORMANCE_IMPORT_CPPWRAP"
TEST_TIMEOUT = "CONFORMANCE_TEST_TIMEOUT"
STAND_IN_LOG = "CONFORMANCE_STAND_IN_LOG"
PROGRESS_LOG = "CONFORMANCE_PROGRESS_LOG"
# What the plugin writes in each run directory.
STAND_IN_FILE, PROGRESS_FILE = "stand_ins.txt", "progress.jsonl"

MODES = ("upstream", "ours")
OUTCOMES = ("passed", "failed", "error", "skipped")
BROKEN = ("failed", "error")
PYTEST_EXIT = {
    0: "all passed",
    1: "tests failed",
    2: "interrupted",
    3: "internal error",
    4: "usage error",
    5: "no tests collected",
}
# JUnit child element of a <testcase> -> outcome; no child means it passed.
NODE_OUTCOMES = (("failure", "failed"), ("error", "error"), ("skipped", "skipped"))
# pytest's JUnit message for a file that failed to import.
COLLECTION_FAILURE = "collection failure"
COMPILER_ERROR = re.compile(r"^\S+:\d+(?::\d+)?: (?:fatal )?error: .*$", re.MULTILINE)


@dataclass(frozen=True)
class FileSpec:
    """Which tests of a file run (``File.py::Class``) and with what environment."""

    selector: str = ""
    env: Mapping[str, str] = field(default_factory=dict)


# test_torchinductor.py compiles with the Python wrapper unless the environment
# turns cpp_wrapper on (config.cpp_wrapper defaults to TORCHINDUCTOR_CPP_WRAPPER);
# the *_cpp_wrapper.py files turn it on themselves.
CPP_WRAPPER_ON = {"TORCHINDUCTOR_CPP_WRAPPER": "1"}
FILE_SPECS: dict[str, FileSpec] = {
    "test_cpu_cpp_wrapper.py": FileSpec(),
    "test_gpu_cpp_wrapper.py": FileSpec(),
    "test_torchinductor.py": FileSpec("CpuTests", CPP_WRAPPER_ON),
    "test_torchinductor_dynamic_shapes.py": FileSpec(
        "DynamicShapesCpuTests", CPP_WRAPPER_ON
    ),
}
DEFAULT_FILES = (
    "test_cpu_cpp_wrapper.py",
    "test_gpu_cpp_wrapper.py",
    "test_torchinductor.py",
)


@dataclass(frozen=True)
class CaseResult:
    """One test's outcome; message is the first line of what pytest reported."""

    test_id: str
    outcome: str
    message: str = ""
    details: str = ""


@dataclass(frozen=True)
class RunResult:
    """One pytest subprocess: one file in one mode."""

    mode: str
    returncode: int | None  # None: killed at the whole-run time limit
    seconds: float
    log: Path
    results: dict[str, CaseResult]
    stood_in: list[str] = field(default_factory=list)  # borrowed modules replaced

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


@dataclass(frozen=True)
class FileReport:
    name: str
    upstream: RunResult
    ours: RunResult


@dataclass(frozen=True)
class Options:
    test_dir: Path
    work_dir: Path
    keyword: str | None
    jobs: int
    test_timeout: int
    run_timeout: float
    python: str
    # Our wrapper raises instead of falling back to the Python wrapper.
    strict: bool = False
    # Upstream runs only over the tests ours did not pass.
    ours_first: bool = False


# -- JUnit XML ---------------------------------------------------------------


def first_line(text: str, limit: int = 300) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def compiler_error(text: str) -> str | None:
    """The first ``file:line:col: error: ...`` line of a C++ compiler's output."""
    match = COMPILER_ERROR.search(text)
    return match.group(0).strip() if match else None


def _raised(text: str) -> str:
    """The last ``E   ...`` line of a pytest traceback: what was raised."""
    raised = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    return raised[-1] if raised else ""


def _case_result(case: ET.Element) -> CaseResult:
    test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
    for tag, outcome in NODE_OUTCOMES:
        node = case.find(tag)
        if node is not None:
            message = node.get("message") or ""
            details = f"{message}\n{node.text or ''}"
            if message == COLLECTION_FAILURE:  # say why, not just that it failed
                message = f"{message}: {_raised(details)}"
            return CaseResult(test_id, outcome, first_line(message or details), details)
    return CaseResult(test_id, "passed")


def parse_junit(path: Path) -> dict[str, CaseResult]:
    """Outcome of every test case in a pytest ``--junitxml`` file, by test id."""
    root = ET.parse(path).getroot()
    return {r.test_id: r for r in map(_case_result, root.iter("testcase"))}


def junit_id(nodeid: str) -> str:
    """The JUnit test id (``pkg.module.Class::name``) of a pytest node id."""
    path, *classes, name = nodeid.split("::")
    module = path.removesuffix(".py").replace("/", ".")
    return f"{'.'.join([module, *classes])}::{name}"


def parse_progress(path: Path) -> dict[str, CaseResult]:
    """Outcomes from the plugin's record of each test phase, by test id.

    pytest writes its JUnit file only when the session ends, so a run killed
    at its time limit may leave none; this record is written as tests
    finish. The outcomes follow the JUnit file's: a failed call fails, a
    failed setup or teardown is an error, and the first problem is kept.
    """
    results: dict[str, CaseResult] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        test_id = junit_id(entry["nodeid"])
        outcome = entry["outcome"]
        if outcome == "failed" and entry["when"] != "call":
            outcome = "error"
        previous = results.get(test_id)
        if previous is None or previous.outcome == "passed":
            message, details = entry["message"], entry["details"]
            results[test_id] = CaseResult(
                test_id, outcome, first_line(message or details), details
            )
    return results


# -- comparing the two modes ---------------------------------------------------


def count_outcomes(results: Mapping[str, CaseResult]) -> Counter[str]:
    return Counter(r.outcome for r in results.values())


def _ids_where(
    upstream: Mapping[str, CaseResult],
    ours: Mapping[str, CaseResult],
    upstream_outcomes: Iterable[str],
    ours_outcomes: Iterable[str],
) -> list[str]:
    up, our = set(upstream_outcomes), set(ours_outcomes)
    return sorted(
        test_id
        for test_id, result in upstream.items()
        if result.outcome in up and test_id in ours and ours[test_id].outcome in our
    )


def regressions(
    upstream: Mapping[str, CaseResult], ours: Mapping[str, CaseResult]
) -> list[CaseResult]:
    """Tests that pass upstream and fail (or error) with torch_cppwrap."""
    return [ours[i] for i in _ids_where(upstream, ours, ["passed"], BROKEN)]


def broken_in_both(
    upstream: Mapping[str, CaseResult], ours: Mapping[str, CaseResult]
) -> list[str]:
    return _ids_where(upstream, ours, BROKEN, BROKEN)


def fixed_by_ours(
    upstream: Mapping[str, CaseResult], ours: Mapping[str, CaseResult]
) -> list[str]:
    return _ids_where(upstream, ours, BROKEN, ["passed"])


def collection_errors(results: Mapping[str, CaseResult]) -> list[CaseResult]:
    """Files (or classes) that failed to import, so none of their tests ran."""
    return [r for r in results.values() if r.message.startswith(COLLECTION_FAILURE)]


def missing_in_ours(
    upstream: Mapping[str, CaseResult], ours: Mapping[str, CaseResult]
) -> list[str]:
    """Tests that pass upstream and have no outcome in ours (a crash, a time limit)."""
    return sorted(
        i for i, r in upstream.items() if r.outcome == "passed" and i not in ours
    )


# -- the markdown report -------------------------------------------------------


def _exit_text(run: RunResult) -> str:
    if run.returncode is None:
        return "killed at the run time limit"
    meaning = PYTEST_EXIT.get(run.returncode, "unknown")
    return f"{run.returncode} ({meaning})"


def _mode_row(run: RunResult) -> str:
    counts = count_outcomes(run.results)
    cells = [run.mode, *(str(counts[o]) for o in OUTCOMES), str(len(run.results))]
    cells += [_exit_text(run), f"{run.seconds:.0f}s"]
    return "| " + " | ".join(cells) + " |"


def _regression_lines(case: CaseResult) -> list[str]:
    lines = [f"- `{case.test_id}`: {case.message or '(no message)'}"]
    error = compiler_error(case.details)
    if error:
        lines.append(f"  - compiler: `{error}`")
    return lines


def _id_list(title: str, ids: Sequence[str]) -> list[str]:
    if not ids:
        return []
    return [f"### {title} ({len(ids)})", "", *(f"- `{i}`" for i in ids), ""]


def _collection_lines(run: RunResult) -> list[str]:
    errors = collection_errors(run.results)
    if not errors:
        return []
    title = f"### Collection errors, {run.mode} ({len(errors)})"
    return [title, "", *(f"- `{e.test_id}`: {e.message}" for e in errors), ""]


TABLE_HEAD = "| mode | passed | failed | error | skipped | total | pytest exit | time |"
TABLE_RULE = "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"


def render_file(report: FileReport) -> list[str]:
    up, ours = report.upstream.results, report.ours.results
    lines = [f"## {report.name}", ""]
    lines += [TABLE_HEAD, TABLE_RULE]
    lines += [_mode_row(report.upstream), _mode_row(report.ours), ""]
    broken = regressions(up, ours)
    lines += [f"### Pass upstream, fail ours ({len(broken)})", ""]
    for case in broken:
        lines += _regression_lines(case)
    lines += [""] if broken else ["None.", ""]
    lines += _id_list("Pass upstream, no outcome in ours", missing_in_ours(up, ours))
    lines += _id_list("Fail upstream, pass ours", fixed_by_ours(up, ours))
    for run in (report.upstream, report.ours):
        lines += _collection_lines(run)
    for run in (report.upstream, report.ours):
        lines += _id_list(f"Borrowed modules stood in, {run.mode}", run.stood_in)
    lines += [f"Fail (or error) in both modes: {len(broken_in_both(up, ours))}.", ""]
    lines += [f"Logs: `{report.upstream.log}`, `{report.ours.log}`.", ""]
    return lines


def render_report(reports: Sequence[FileReport], header: Sequence[str]) -> str:
    lines = ["# Conformance: upstream cpp_wrapper vs torch_cppwrap", "", *header, ""]
    for report in reports:
        lines += render_file(report)
    return "\n".join(lines).rstrip() + "\n"


# -- running pytest -------------------------------------------------------------


def node_id(test_id: str) -> str:
    """pytest's node id for a JUnit test id (``pkg.module.Class::name``)."""
    classname, _, name = test_id.partition("::")
    module, classes = classname, ""
    # JUnit joins module and class with dots; class names start upper-case.
    parts = classname.split(".")
    for i, part in enumerate(parts):
        if part[:1].isupper():
            module, classes = ".".join(parts[:i]), "::".join(parts[i:])
            break
    path = module.replace(".", "/") + ".py"
    return "::".join(p for p in (path, classes, name) if p)


def pytest_command(
    name: str,
    spec: FileSpec,
    options: Options,
    junit: Path,
    only: Sequence[str] | None = None,
) -> list[str]:
    """The pytest command line for one file; ``only`` limits it to those node ids."""
    if only is not None:
        targets = list(only)
    else:
        targets = [f"{name}::{spec.selector}" if spec.selector else name]
    command = [options.python, "-m", "pytest", *targets, "-p", PLUGIN]
    # Our own empty ini and conftest cut-off: no addopts or conftest.py from a
    # pytorch checkout around the test files changes how they run.
    command += ["-c", str(options.work_dir / "pytest.ini")]
    # Nothing written into the test directory: no .pytest_cache, no
    # .benchmarks (pytest-benchmark's; naming an absent plugin is harmless).
    command += ["-p", "no:cacheprovider", "-p", "no:benchmark"]
    test_dir = str(options.test_dir)
    command += ["--rootdir", test_dir, "--confcutdir", test_dir]
    command += [f"--junitxml={junit}", "--tb=short", "-q"]
    if options.keyword and only is None:
        command += ["-k", options.keyword]
    if options.jobs > 1:
        command += ["-n", str(options.jobs)]
    return command


def _pythonpath(mode: str, options: Options, inherited: str | None) -> str:
    paths = [str(TOOLS_DIR), str(options.test_dir)]
    if mode == "ours":
        paths.insert(0, str(REPO_ROOT))  # this checkout's torch_cppwrap, not another
    if inherited:
        paths.append(inherited)
    return os.pathsep.join(paths)


def pytest_env(
    mode: str, spec: FileSpec, options: Options, run_dir: Path
) -> dict[str, str]:
    env = {**os.environ, **spec.env}
    env["PYTHONPATH"] = _pythonpath(mode, options, env.get("PYTHONPATH"))
    env[IMPORT_CPPWRAP] = "1" if mode == "ours" else "0"
    env[TEST_TIMEOUT] = str(options.test_timeout)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(run_dir / "cache" / "inductor")
    env["TRITON_CACHE_DIR"] = str(run_dir / "cache" / "triton")
    env[STAND_IN_LOG] = str(run_dir / STAND_IN_FILE)
    env[PROGRESS_LOG] = str(run_dir / PROGRESS_FILE)
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ in the test directory
    # Default: what users get (a graph ours cannot handle falls back to the
    # Python wrapper); --strict: what our generator handles on its own.
    env["TORCH_CPPWRAP_STRICT"] = "1" if options.strict else "0"
    return env


def run_subprocess(
    command: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path, timeout: float
) -> int | None:
    """Run ``command`` with its output in ``log``; None if killed at ``timeout``."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGINT first: pytest stops like on Ctrl-C and still writes the
            # JUnit file, so the tests that finished are counted.
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=INTERRUPT_GRACE_SECONDS)
            return None
        finally:
            if proc.poll() is None:  # timed out or interrupted: its whole group goes
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_mode(
    name: str, mode: str, options: Options, only: Sequence[str] | None = None
) -> RunResult:
    spec = FILE_SPECS.get(name, FileSpec())
    run_dir = options.work_dir / Path(name).stem / mode
    run_dir.mkdir(parents=True, exist_ok=True)
    junit, log = run_dir / "junit.xml", run_dir / "pytest.log"
    junit.unlink(missing_ok=True)
    stand_ins, progress = run_dir / STAND_IN_FILE, run_dir / PROGRESS_FILE
    for record in (stand_ins, progress):
        record.unlink(missing_ok=True)
    started = time.monotonic()
    code = run_subprocess(
        pytest_command(name, spec, options, junit, only),
        pytest_env(mode, spec, options, run_dir),
        options.test_dir,
        log,
        options.run_timeout,
    )
    seconds = time.monotonic() - started
    shutil.rmtree(run_dir / "cache", ignore_errors=True)  # caches are big; logs stay
    if junit.exists():
        results = parse_junit(junit)
    else:  # killed before pytest wrote it: what finished still counts
        results = parse_progress(progress) if progress.exists() else {}
    # Each xdist worker records the modules it stood in; one line per module.
    lines = stand_ins.read_text().splitlines() if stand_ins.exists() else []
    return RunResult(mode, code, seconds, log, results, sorted(set(lines)))


def _run_and_say(
    name: str, mode: str, options: Options, only: Sequence[str] | None = None
) -> RunResult:
    scope = "" if only is None else f" ({len(only)} tests ours did not pass)"
    print(f"[conformance] {name}: {mode}{scope} ...", file=sys.stderr, flush=True)
    run = run_mode(name, mode, options, only)
    print(
        f"[conformance] {name}: {mode}: {_exit_text(run)}, "
        f"{len(run.results)} tests, {run.seconds:.0f}s",
        file=sys.stderr,
        flush=True,
    )
    return run


def run_file(name: str, options: Options) -> FileReport:
    if not options.ours_first:
        upstream = _run_and_say(name, "upstream", options)
        return FileReport(name, upstream, _run_and_say(name, "ours", options))
    ours = _run_and_say(name, "ours", options)
    # Collection failures have no node id to rerun; everything else ours did
    # not pass gets its upstream outcome.
    failures = set(collection_errors(ours.results))
    rerun = sorted(
        node_id(r.test_id)
        for r in ours.results.values()
        if r.outcome != "passed" and r not in failures
    )
    if rerun:
        upstream = _run_and_say(name, "upstream", options, rerun)
    else:
        log = options.work_dir / Path(name).stem / "upstream" / "pytest.log"
        upstream = RunResult("upstream", 0, 0.0, log, {})
    return FileReport(name, upstream, ours)


# -- command line ----------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run PyTorch's Inductor tests with upstream's cpp_wrapper and "
        "with torch_cppwrap's; list tests that pass upstream and fail ours."
    )
    parser.add_argument(
        "--test-dir", type=Path, required=True, help="pytorch's test/inductor directory"
    )
    parser.add_argument(
        "--file",
        action="append",
        dest="files",
        metavar="NAME",
        help=f"a test file in --test-dir (repeatable; default: "
        f"those of {', '.join(DEFAULT_FILES)} that exist)",
    )
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument(
        "-n",
        dest="jobs",
        type=int,
        default=1,
        help="pytest-xdist workers per run (default 1)",
    )
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="logs, JUnit files and caches (default: a new temp dir)",
    )
    parser.add_argument(
        "--test-timeout",
        type=int,
        default=900,
        help="seconds one test may run (default 900)",
    )
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=6 * 3600,
        help="seconds one pytest run may take (default 21600)",
    )
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter the tests run with"
    )
    parser.add_argument(
        "--ours-first",
        action="store_true",
        help="run ours over every test, then upstream only over the tests "
        "ours did not pass",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="our wrapper raises where it would fall back to the Python wrapper",
    )
    return parser.parse_args(argv)


def resolve_files(test_dir: Path, names: Sequence[str] | None) -> list[str]:
    if names:
        missing = [n for n in names if not (test_dir / n).is_file()]
        if missing:
            raise SystemExit(f"not in {test_dir}: {', '.join(missing)}")
        return list(names)
    found = [n for n in DEFAULT_FILES if (test_dir / n).is_file()]
    if not found:
        raise SystemExit(f"none of {', '.join(DEFAULT_FILES)} is in {test_dir}")
    return found


def make_options(args: argparse.Namespace) -> Options:
    work_dir = args.work_dir or Path(
        tempfile.mkdtemp(prefix="torch-cppwrap-conformance-")
    )
    work_dir = work_dir.resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "pytest.ini").write_text("[pytest]\n")
    return Options(
        test_dir=args.test_dir.resolve(),
        work_dir=work_dir,
        keyword=args.keyword,
        jobs=args.jobs,
        test_timeout=args.test_timeout,
        run_timeout=args.run_timeout,
        python=args.python,
        strict=args.strict,
        ours_first=args.ours_first,
    )


def torch_version(python: str) -> str:
    script = "import torch; print(torch.__version__, torch.version.git_version)"
    done = subprocess.run([python, "-c", script], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def report_header(options: Options) -> list[str]:
    return [
        f"- torch: {torch_version(options.python)}",
        f"- test dir: `{options.test_dir}`",
        f"- -k: `{options.keyword}`" if options.keyword else "- -k: (all)",
        f"- pytest workers per run: {options.jobs}; "
        f"per-test limit {options.test_timeout}s",
        "- ours: strict (no fallback to the Python wrapper)"
        if options.strict
        else "- ours: default settings (a graph ours cannot handle falls back "
        "to the Python wrapper)",
        *(
            ["- upstream: run only over the tests ours did not pass (--ours-first)"]
            if options.ours_first
            else []
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    files = resolve_files(args.test_dir, args.files)
    options = make_options(args)
    print(f"[conformance] work dir: {options.work_dir}", file=sys.stderr)
    reports = [run_file(name, options) for name in files]
    text = render_report(reports, report_header(options))
    print(text)
    if args.out:
        args.out.write_text(text)
    found = any(regressions(r.upstream.results, r.ours.results) for r in reports)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
