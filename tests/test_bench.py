"""benchmarks/bench.py: its command line, worker and report."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import weakref
from unittest import mock

from torch._inductor.test_case import TestCase, run_tests

from tests.common import REPO, load_script

_bench = load_script("benchmarks/bench.py")

METRICS = ("compile_s", "e2e_us", "call_us", "mem_peak_mb", "ok", "max_abs_err")


class TestCommandLine(TestCase):
    def test_package_points_at_the_moved_commands(self) -> None:
        # The benchmark and the patch tooling are not in the package any more;
        # their old commands say where they went.
        for command, replacement in (
            ("bench", "python benchmarks/bench.py"),
            ("patches", "python tools/patches.py"),
        ):
            proc = subprocess.run(
                [sys.executable, "-m", "torch_cppwrap", command, "--quick"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            self.assertEqual(proc.returncode, 2, proc.stderr)
            self.assertIn(f"`{replacement}`", proc.stderr)

    def test_help(self) -> None:
        proc = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "bench.py"), "--help"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("--workloads", proc.stdout)

    def test_worker_file_does_not_import_torch_cppwrap(self) -> None:
        # The python and upstream modes run this file as a script; loading it
        # must leave Inductor unpatched.
        code = (
            "import runpy, sys; runpy.run_path(sys.argv[1], run_name='bench'); "
            "print('torch_cppwrap' in sys.modules)"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, _bench.__file__],
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip(), "False")

    def test_timing_cpu_must_be_one_this_process_may_run_on(self) -> None:
        proc = subprocess.run(
            [
                sys.executable,
                str(REPO / "benchmarks" / "bench.py"),
                "--timing-cpu",
                "100000",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(proc.returncode, 2, proc.stderr)
        self.assertIn("--timing-cpu 100000 is not a CPU", proc.stderr)


class TestTiming(TestCase):
    def test_slow_first_calls_do_not_size_the_repeats(self) -> None:
        # A replayed graph's second call captures it (milliseconds); the
        # calls after are fast.  Sized from a slow call, each repeat would
        # time one or two calls: it must be sized from a fast one.
        calls = 0

        def fn() -> None:
            nonlocal calls
            calls += 1
            if calls <= 2:
                time.sleep(0.05)

        timing = _bench.time_per_call(fn, repeats=2, target_s=0.02)
        self.assertGreater(timing.calls_per_repeat, 100)
        self.assertLess(timing.min_us, 1000)


@unittest.skipUnless(hasattr(os, "sched_setaffinity"), "pinning needs Linux")
class TestTimingCpu(TestCase):
    def _in_a_thread(self, environ: dict[str, str]) -> tuple[int | None, set[int]]:
        """pin_timing_thread's answer and the thread's CPUs after it, in a
        thread of its own: pinning moves the calling thread only."""
        seen: list[tuple[int | None, set[int]]] = []

        def run() -> None:
            cpu = _bench.pin_timing_thread()
            seen.append((cpu, os.sched_getaffinity(0)))

        with mock.patch.dict(os.environ, environ):
            thread = threading.Thread(target=run)
            thread.start()
            thread.join()
        (result,) = seen
        return result

    def test_pins_the_timing_thread_to_the_cpu_asked_for(self) -> None:
        allowed = os.sched_getaffinity(0)
        cpu = max(allowed)
        self.assertEqual(
            self._in_a_thread({_bench.TIMING_CPU_ENV: str(cpu)}), (cpu, {cpu})
        )
        # The other threads were left where they were.
        self.assertEqual(os.sched_getaffinity(0), allowed)

    def test_unpinned_it_only_says_where_it_runs(self) -> None:
        allowed = os.sched_getaffinity(0)
        with mock.patch.dict(os.environ):
            os.environ.pop(_bench.TIMING_CPU_ENV, None)
            cpu, after = self._in_a_thread({})
        self.assertIn(cpu, allowed)
        self.assertEqual(after, allowed)


@unittest.skipUnless(os.path.exists("/proc/stat"), "reads Linux's /proc")
class TestHostLoad(TestCase):
    """What else runs on the host while a worker times (host_load), and the
    wait for it to fall quiet first (settle_host)."""

    def _busy_child(self, seconds: float) -> subprocess.Popen:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import time\nt = time.monotonic()\nwhile time.monotonic() - t < {seconds}: pass",
            ]
        )
        self.addCleanup(proc.wait)
        self.addCleanup(proc.kill)
        time.sleep(0.2)  # started, and spinning
        return proc

    def test_another_process_counts(self) -> None:
        self._busy_child(3.0)
        self.assertGreaterEqual(_bench.child_processes(), 1)
        before = _bench.cpu_sample()
        time.sleep(0.4)
        load = _bench.host_load(before, _bench.cpu_sample())
        self.assertGreater(load["others_cpus"], 0.5)
        self.assertGreaterEqual(load["steal_cpus"], 0.0)

    @staticmethod
    def _sample(
        at: float, busy: float, own: float, steal: float = 0.0, thread: float = 0.0
    ):
        return _bench.CpuSample(at=at, busy=busy, steal=steal, own=own, thread=thread)

    def test_this_process_is_left_out(self) -> None:
        # 2 s: the host busy for 5 CPU-seconds, 3 of them this process's,
        # 2 of those the sampling thread's.
        load = _bench.host_load(
            self._sample(10.0, 100.0, 1.0),
            self._sample(12.0, 105.0, 4.0, steal=1.0, thread=2.0),
        )
        self.assertEqual(
            load, {"others_cpus": 1.0, "steal_cpus": 0.5, "own_threads_cpus": 0.5}
        )
        self.assertIsNone(_bench.host_load(None, self._sample(1.0, 1.0, 1.0)))

    def test_settle_waits_for_the_others_to_fall_quiet(self) -> None:
        # Windows of 1 s: two with another process on 2 CPUs, then a quiet one.
        busy = iter([0, 2, 2, 4, 4, 4.1])
        clock = iter(range(100))

        def sample():
            return self._sample(float(next(clock)), next(busy), 0.0)

        with (
            mock.patch.object(_bench, "cpu_sample", sample),
            mock.patch.object(_bench, "SETTLE_WINDOW_S", 0.0),
        ):
            settled = _bench.settle_host(30.0)
        self.assertEqual(
            settled["load_before_timing"],
            {"others_cpus": 0.1, "steal_cpus": 0.0, "own_threads_cpus": 0.0},
        )
        self.assertIsNone(next(busy, None))  # three windows, no more

    def test_settle_gives_up_after_its_time(self) -> None:
        self._busy_child(5.0)
        settled = _bench.settle_host(0.0)
        self.assertLess(settled["settle_waited_s"], 1.0)
        self.assertGreater(
            settled["load_before_timing"]["others_cpus"], _bench.QUIET_CPUS
        )


class TestCudaTiming(TestCase):
    """_time_calls's CUDA branch with its device parts stubbed, since no
    test runs the bench on a GPU: which rows get a latency, and which a
    `call` time."""

    def _time(self, mode: str) -> tuple[dict, list[str]]:

        events: list[str] = []

        class Memory:
            source = "stub"

            def peak_mb(self) -> float:
                events.append("peak")
                return 1.0

            def segments_mb(self) -> dict:
                return {}

        class Module:
            def get_args(self) -> list:
                return []

            def call(self, args: list) -> None:
                events.append("call")

        result = {"device": "cuda"}
        with (
            mock.patch.object(
                _bench, "device_sync", return_value=lambda: events.append("sync")
            ),
            mock.patch.object(_bench, "_replay_state", return_value={}),
            mock.patch.object(
                _bench,
                "time_step_spans",
                side_effect=lambda step, steps: (
                    events.append(f"spans {steps}")
                    or {"gpu_step_span_us": 5.0, "gpu_between_steps_us": 0.5}
                ),
            ),
        ):
            _bench._time_calls(
                result,
                lambda: events.append("step"),
                [Module()],
                _bench.MODES[mode],
                _bench.WORKLOADS["seed"],
                _bench.Budget(repeats=2, target_s=0.002),
                Memory(),
                contextlib.nullcontext,
            )
        return result, events

    def test_latency_waits_for_the_gpu_after_each_call(self) -> None:
        result, events = self._time("cppwrap")
        self.assertGreater(result["e2e_sync_us"], 0)
        self.assertGreaterEqual(result["e2e_sync_us_median"], result["e2e_sync_us"])
        # The peak is taken before the latency is timed; after it, every
        # step is followed by a synchronize.
        after_peak = events[events.index("peak") + 1 :]
        steps = [i for i, e in enumerate(after_peak) if e == "step"]
        self.assertGreater(len(steps), 10)
        for i in steps:
            self.assertEqual(after_peak[i + 1], "sync")
        # The GPU's span per step is read after the timings, from its own steps.
        self.assertEqual(events[-1], f"spans {_bench.SPAN_STEPS}")
        self.assertEqual(result["gpu_step_span_us"], 5.0)
        # Ours replayed: `call` on get_args()'s tensors is not what runs.
        self.assertNotIn("call", events)
        self.assertNotIn("call_us", result)

    def test_host_time_issues_each_call_on_an_idle_gpu(self) -> None:
        events: list[str] = []
        times = _bench.host_times_us(
            lambda: events.append("step"), lambda: events.append("sync"), 4
        )
        self.assertEqual(len(times), 4)
        self.assertEqual(events, ["sync", "step", "sync"] * 4)
        result, _ = self._time("cppwrap")
        self.assertGreater(result["host_us"], 0)
        self.assertIn("host_us", _bench.TIMED)  # the fastest round's is kept

    def test_each_calls_latency_includes_the_wait_and_the_host_time_not(
        self,
    ) -> None:
        # A device that takes 20 ms to finish each call the host issues in 0.
        host, latency = _bench.call_times_us(lambda: None, lambda: time.sleep(0.02), 3)
        self.assertEqual(len(latency), 3)
        for h, whole in zip(host, latency, strict=True):
            self.assertLess(h, 10_000)
            self.assertGreaterEqual(whole, 20_000)
        result, _ = self._time("cppwrap")
        self.assertGreater(result["latency_p50_us"], 0)
        self.assertIn("latency_p50_us", _bench.TIMED)

    def test_kernel_by_kernel_times_call(self) -> None:
        result, events = self._time("cppwrap-no-replay")
        self.assertIn("call", events)
        self.assertGreater(result["call_us"], 0)
        self.assertIn("e2e_sync_us", result)


class TestBenchWorker(TestCase):
    def test_call_is_timed_where_it_is_what_runs(self) -> None:
        # On a GPU, ours replayed and reduce-overhead run CUDA graphs, not the
        # module's `call` on get_args()'s tensors; kernel by kernel, it is.
        self.assertTrue(_bench.replays_graphs(_bench.MODES["cppwrap"]))
        for mode in ("cppwrap-no-replay", "python", "upstream", "reduce-overhead"):
            self.assertFalse(_bench.replays_graphs(_bench.MODES[mode]), mode)

    def test_only_a_training_step_zeroes_gradients(self) -> None:
        # timm's models are built as nn.Modules, which have a zero_grad of
        # their own: an inference step must not call it (it costs ~400 µs a
        # call on ViT-Tiny); a training step calls the one models.py gives.
        import dataclasses

        import torch

        model = torch.nn.Linear(4, 4).eval()
        args = (torch.randn(2, 4),)
        inference = dataclasses.replace(_bench.WORKLOADS["seed"], train=False)
        with mock.patch.object(model, "zero_grad") as zero_grad:
            step = _bench.make_step(
                model, model, args, _bench.MODES["python"], inference
            )
            step()
        zero_grad.assert_not_called()

        def loss(x: torch.Tensor) -> torch.Tensor:
            return model(x).sum()

        loss.zero_grad = mock.Mock()  # type: ignore[attr-defined]
        training = dataclasses.replace(inference, train=True)
        _bench.make_step(loss, loss, args, _bench.MODES["python"], training)()
        loss.zero_grad.assert_called_once_with()  # type: ignore[attr-defined]
        self.assertIsNotNone(model.weight.grad)

    def test_seed_cppwrap_quick(self) -> None:
        with tempfile.TemporaryDirectory() as cache_dir:
            result = _bench.spawn_worker(
                "seed",
                "cppwrap",
                "warm",
                device="cpu",
                quick=True,
                cache_dir=cache_dir,
                timeout_s=300,
            )
        self.assertNotIn(
            "error", result, result.get("traceback") or result.get("output_tail")
        )
        for key in METRICS:
            self.assertIsNotNone(result.get(key), key)
        self.assertIs(result["ok"], True)
        self.assertIs(result["torch_cppwrap_patched"], True)
        self.assertEqual(result["wrappers"], ["torch_cppwrap"])
        self.assertEqual(result["graphs"], 1)
        self.assertGreater(result["e2e_us"], 0)
        self.assertGreater(result["call_us"], 0)
        self.assertGreater(result["host_probe_us"], 0)
        self.assertGreater(result["compile_host_probe_us"], 0)
        self.assertIs(result["timing_cpu_pinned"], False)
        # What else ran beside the timing, and the (here skipped) wait for quiet.
        if os.path.exists("/proc/stat"):
            self.assertEqual(
                set(result["load_during_timing"]),
                {"others_cpus", "steal_cpus", "own_threads_cpus"},
            )
            self.assertGreaterEqual(result["children_at_timing"], 0)
            self.assertLess(result["settle_waited_s"], 1.0)
        # A synchronize after each call only means something on a GPU.
        self.assertNotIn("e2e_sync_us", result)
        # A compile in a new cache builds our module, timed as Inductor's
        # phases are.
        self.assertIn("CppWrapperCodeCache.load", result["compile_phases_s"])
        # ... and split into its steps: the translation units, here the
        # wrapper and the C++ kernels.
        # (Inductor's own phases, such as GraphLowering.codegen, can take less
        # than the 50 ms that compile_phases_s keeps on the seed graph.)
        self.assertIn("GraphBuild.compile_units", result["compile_phases_s"])

    def test_a_crashed_worker_keeps_its_traceback(self) -> None:

        # faulthandler prints the traceback, then a list of extension
        # modules long enough to fill any tail of the output on its own.
        traceback = 'Fatal Python error: Segmentation fault\n  File "bench.py", line 1 in step\n'
        output = "loading...\n" + traceback + "Extension modules: " + "m, " * 5000
        crashed = subprocess.CompletedProcess([], -11, stdout="", stderr=output)
        with (
            tempfile.TemporaryDirectory() as cache_dir,
            mock.patch.object(_bench.subprocess, "run", return_value=crashed),
        ):
            result = _bench.spawn_worker(
                "seed",
                "python",
                "warm",
                device="cpu",
                quick=True,
                cache_dir=cache_dir,
                timeout_s=300,
            )
        self.assertIn("SIGSEGV", result["error"])
        self.assertTrue(
            result["output_tail"].startswith(traceback), result["output_tail"][:200]
        )


class TestReport(TestCase):
    def _record(self, mode: str, scale: float) -> dict:
        return {
            "workload": "seed",
            "mode": mode,
            "error": None,
            "ok": True,
            "cold_compile_s": 10 * scale,
            "warm_compile_s": 2 * scale,
            "e2e_us": 100 * scale,
            "e2e_us_median": 110 * scale,
            "call_us": 10 * scale,
            "call_us_median": 11 * scale,
            "mem_peak_mb": 40.0,
            "max_abs_err": 0.0,
            "warm_fx_cache_hit": True,
            "warm": {},
        }

    def _report(self, records: list[dict]) -> dict:
        """A CPU report of `records` (of workload "seed"), as the bench makes."""
        modes = [r["mode"] for r in records]
        return {
            "meta": _bench._meta("cpu", True, ["seed"], modes, records),
            "results": records,
            "ratios": _bench.ratios(records),
        }

    def test_step_spans_after_the_first_quarter_and_their_report(self) -> None:
        # Eight steps (ms): the first two start late (the host not yet ahead),
        # then each spans 0.4 ms and the next starts 0.01 ms after it ends.
        starts = [0.0, 1.0] + [2.0 + 0.41 * i for i in range(6)]
        ends = [0.5, 1.5] + [2.4 + 0.41 * i for i in range(6)]
        spans = _bench.step_spans(starts, ends)
        self.assertAlmostEqual(spans["gpu_step_span_us"], 400.0)
        self.assertAlmostEqual(spans["gpu_between_steps_us"], 10.0)
        records = [self._record("python", 2.0), self._record("cppwrap", 1.0)]
        records[1].update(spans)
        text = _bench.markdown(self._report(records))
        self.assertIn("- seed / cppwrap: 400.0 (10.0 between)", text)
        self.assertNotIn("- seed / python:", text)

    def test_ratios_and_markdown(self) -> None:
        records = [
            self._record("python", 2.0),
            self._record("upstream", 4.0),
            self._record("cppwrap", 1.0),
        ]
        # The host's speed as each warm process found it; one has none.
        for record, probe in zip(records, (1.5, 2.25, None), strict=True):
            record["warm"] = {"host_probe_us": probe}
        (row,) = _bench.ratios(records)
        self.assertAlmostEqual(row["call_us/python"], 0.5)
        self.assertAlmostEqual(row["e2e_us/upstream"], 0.25)
        self.assertAlmostEqual(row["cold_compile_s/python"], 0.5)
        self.assertAlmostEqual(row["warm_compile_s/upstream"], 0.25)
        report = {
            "meta": _bench._meta(
                "cpu", True, ["seed"], ["python", "upstream", "cppwrap"], records
            ),
            "results": records,
            "ratios": [row],
        }
        text = _bench.markdown(report)
        self.assertIn(
            "| seed | cppwrap | yes | 10.00 | 2.00 | 100.0 | 10.0 | 40.0 |", text
        )
        self.assertIn(
            "| seed | 0.50 | 0.50 | 0.50 | 0.50 | 0.25 | 0.25 | 0.25 | 0.25 |", text
        )
        self.assertNotIn("## Problems", text)
        self.assertEqual(report["meta"]["host_probe_us"], [1.5, 2.25])
        self.assertIn("took 1.50-2.25 µs in the warm processes", text)
        self.assertNotIn("Cold compile by phase", text)
        # No row recorded what else ran while it timed.
        self.assertNotIn("the host while the warm processes timed", text)

    def test_what_else_ran_while_timing_is_reported(self) -> None:
        records = [self._record("python", 2.0), self._record("cppwrap", 1.0)]
        records[0]["warm"] = {
            "load_during_timing": {
                "others_cpus": 1.25,
                "steal_cpus": 0.5,
                "own_threads_cpus": 0.25,
            },
            "settle_waited_s": 3.0,
        }
        records[1]["warm"] = {
            "load_during_timing": {
                "others_cpus": 0.0,
                "steal_cpus": 0.0,
                "own_threads_cpus": 1.0,
            },
            "settle_waited_s": 0.2,
        }
        meta = _bench._meta("cpu", True, ["seed"], ["python", "cppwrap"], records)
        self.assertEqual(meta["others_cpus_during_timing"], [0.0, 1.25])
        self.assertEqual(meta["steal_cpus_during_timing"], [0.0, 0.5])
        self.assertEqual(meta["max_settle_waited_s"], 3.0)
        text = _bench.markdown(
            {"meta": meta, "results": records, "ratios": _bench.ratios(records)}
        )
        self.assertIn(
            "other processes used 0.00-1.25 CPUs, the hypervisor took 0.00-0.50, "
            "the timing process's other threads 0.25-1.00",
            text,
        )
        self.assertIn("waited up to 3.0 s", text)

    def test_per_call_ratios_of_hosts_apart_are_marked(self) -> None:
        records = [
            self._record("python", 2.0),
            self._record("cppwrap", 1.0),
            self._record("reduce-overhead", 1.25),
        ]
        # Ours timed on a host 1.75x slower than the Python wrapper's, 1.17x
        # slower than reduce-overhead's.
        for record, probe in zip(records, (2.0, 3.5, 3.0), strict=True):
            record["warm"] = {"host_probe_us": probe}
        (row,) = _bench.ratios(records)
        self.assertAlmostEqual(row["host_probe:call_us/python"], 1.75)
        self.assertAlmostEqual(
            row["host_probe:e2e_us:cppwrap/reduce-overhead"], 3.5 / 3.0
        )
        self.assertIsNone(row["host_probe:call_us/upstream"])
        report = self._report(records)
        text = _bench.markdown(report)
        # Times per call against the Python wrapper are marked, its compile
        # times are not; nothing against reduce-overhead is.
        self.assertIn("| seed | 0.50 † | 0.50 † | 0.50 | 0.50 | - |", text)
        self.assertIn("| seed | 0.80 | 1.00 |", text)
        self.assertIn("- †: the two rows' processes (the warm ones", text)
        # Hosts 1.4x apart are not.
        records[1]["warm"] = {"host_probe_us": 2.8}
        text = _bench.markdown(self._report(records))
        self.assertIn("| seed | 0.50 | 0.50 | 0.50 | 0.50 | - |", text)
        self.assertNotIn("†", text)

    def test_a_time_is_marked_by_the_probe_of_the_round_that_timed_it(self) -> None:
        # Ours' first round ran on a host 3x slower than the Python
        # wrapper's, its second as fast: each fastest time came from the
        # second round, so no ratio's hosts were apart.
        def timed(scale: float, probe: float) -> dict:
            return {
                "compile_s": 2 * scale,
                "e2e_us": 100 * scale,
                "call_us": 10 * scale,
                "ok": True,
                "host_probe_us": probe,
            }

        rounds = {
            "python": [timed(2.0, 2.0)],
            "cppwrap": [timed(3.0, 6.0), timed(1.0, 2.0)],
        }
        records = [
            {
                **_bench._merge("seed", mode, {"ok": True}, _bench._best_round(r)),
                "warm_rounds": r,
            }
            for mode, r in rounds.items()
        ]
        (row,) = _bench.ratios(records)
        self.assertAlmostEqual(row["e2e_us/python"], 0.5)
        self.assertAlmostEqual(row["host_probe:e2e_us/python"], 1.0)
        self.assertEqual(row["host_apart"], [])
        report = self._report(records)
        self.assertEqual(report["meta"]["host_probe_us"], [2.0, 6.0])
        self.assertNotIn("†", _bench.markdown(report))
        # Had the slow host's round timed the fastest, they would be.
        records[1]["warm"] = _bench._best_round([timed(3.0, 2.0), timed(1.0, 6.0)])
        self.assertEqual(
            _bench.ratios(records)[0]["host_apart"], ["call_us/python", "e2e_us/python"]
        )

    def test_compile_ratios_of_hosts_apart_are_marked(self) -> None:
        # Ours' cold process found the host 2x slower than the Python
        # wrapper's before compiling; the warm processes found it alike.
        records = [self._record("python", 1.0), self._record("cppwrap", 1.25)]
        for record, cold_probe in zip(records, (2.0, 4.0), strict=True):
            record["cold"] = {"compile_s": 0.0, "compile_host_probe_us": cold_probe}
            record["warm"] = {"host_probe_us": 3.0, "compile_host_probe_us": 3.0}
        (row,) = _bench.ratios(records)
        self.assertAlmostEqual(row["host_probe:cold_compile_s/python"], 2.0)
        self.assertAlmostEqual(row["host_probe:warm_compile_s/python"], 1.0)
        self.assertEqual(row["host_apart"], ["cold_compile_s/python"])
        report = self._report(records)
        self.assertEqual(report["meta"]["compile_host_probe_us"], [2.0, 4.0])
        text = _bench.markdown(report)
        self.assertIn("| seed | 1.25 | 1.25 | 1.25 † | 1.25 | - |", text)
        self.assertIn("the same before each compile: 2.00-4.00 µs", text)
        self.assertIn("(the warm ones, or for a cold compile the cold ones)", text)

    def test_a_warm_compile_is_marked_by_the_probe_before_it(self) -> None:
        # The round that compiled fastest went with the host probe taken
        # before its compile, not with the one taken before its timing.
        rounds = [
            {"compile_s": 3.0, "compile_host_probe_us": 6.0, "host_probe_us": 2.0},
            {"compile_s": 2.0, "compile_host_probe_us": 2.5, "host_probe_us": 6.0},
        ]
        best = _bench._best_round(rounds)
        self.assertEqual(best["compile_s"], 2.0)
        self.assertEqual(best["probe_of"]["compile_s"], 2.5)

    def test_the_first_call_starts_from_a_collected_heap(self) -> None:
        class Cycle:
            pass

        with _bench.gc_paused():  # only the call's own collection frees it
            garbage = Cycle()
            garbage.me = garbage  # type: ignore[attr-defined]
            ref = weakref.ref(garbage)
            del garbage
            seen: list[object] = []
            synced: list[bool] = []
            actual, seconds = _bench.timed_first_call(
                lambda: seen.append(ref()) or "out", lambda: synced.append(True)
            )
        self.assertEqual(seen, [None])
        self.assertEqual(synced, [True])
        self.assertEqual(actual, "out")
        self.assertGreaterEqual(seconds, 0.0)

    def test_compile_phases_that_differ(self) -> None:
        cold_phases = {
            "python": {"GraphLowering.codegen": 3.0, "gc": 0.1},
            "cppwrap": {
                "GraphLowering.codegen": 4.5,
                "CppWrapperCodeCache.load": 0.9,
                "gc": 0.2,
            },
        }
        warm_phases = {
            "python": {"bytecode_tracing": 0.8, "OutputGraph.call_user_compiler": 0.85},
            "cppwrap": {"bytecode_tracing": 1.2, "OutputGraph.call_user_compiler": 0.7},
        }
        self.assertEqual(
            _bench.compile_phase_gaps(cold_phases["cppwrap"], cold_phases["python"]),
            [
                ("GraphLowering.codegen", 4.5, 3.0),
                ("CppWrapperCodeCache.load", 0.9, 0.0),
            ],
        )
        # As the bench merges each mode's cold and warm processes.
        records = [
            _bench._merge(
                "seed",
                mode,
                {"ok": True, "compile_s": 10.0, "compile_phases_s": cold_phases[mode]},
                {"ok": True, "compile_s": 2.0, "compile_phases_s": warm_phases[mode]},
            )
            for mode in ("python", "cppwrap")
        ]
        text = _bench.markdown(self._report(records))
        cold = text.index("Cold compile by phase")
        warm = text.index("Warm compile by phase")
        self.assertIn(
            "- seed: GraphLowering.codegen 4.50 / 3.00; CppWrapperCodeCache.load 0.90 / 0.00",
            text[cold:warm],
        )
        # The backend's 0.15 s is under the 0.2 s that makes a gap.
        self.assertIn("- seed: bytecode_tracing 1.20 / 0.80\n", text[warm:])

    def test_cuda_comparisons_and_replays(self) -> None:
        records = [
            self._record("python", 4.0),
            self._record("cppwrap", 1.0),
            self._record("cppwrap-no-replay", 2.0),
            self._record("reduce-overhead", 1.25),
        ]
        records[1]["mem_peak_mb"] = 50.0
        # Latency (a synchronize after each call): ours 300 µs, CUDA graphs 400.
        records[1]["e2e_sync_us"] = 300.0
        records[3]["e2e_sync_us"] = 400.0
        # The median call's latency: ours 250, CUDA graphs 500.
        records[1]["latency_p50_us"] = 250.0
        records[3]["latency_p50_us"] = 500.0
        # Host time per call (on an idle GPU): ours 120 against CUDA graphs'
        # 150; kernel by kernel 100 against the Python wrapper's 400.
        for record, host in zip(records, (400.0, 120.0, 100.0, 150.0), strict=True):
            record["host_us"] = host
        records[1]["warm"] = {
            "replay": [
                {
                    "state": "ready",
                    "blocker": None,
                    "stats": [
                        {"state": "ready", "replays": 12, "missed": 0},
                        {"state": "ready", "replays": 40, "missed": 1},
                    ],
                },
                {"state": "kernel by kernel", "blocker": "only 1 launch(es)"},
            ]
        }
        (row,) = _bench.ratios(records)
        self.assertAlmostEqual(row["e2e_us:cppwrap/reduce-overhead"], 0.8)
        self.assertAlmostEqual(row["mem_peak_mb:cppwrap/reduce-overhead"], 1.25)
        self.assertAlmostEqual(row["e2e_us:cppwrap-no-replay/python"], 0.5)
        self.assertAlmostEqual(row["e2e_sync_us:cppwrap/reduce-overhead"], 0.75)
        self.assertAlmostEqual(row["latency_p50_us:cppwrap/reduce-overhead"], 0.5)
        self.assertAlmostEqual(row["host_us:cppwrap/reduce-overhead"], 0.8)
        self.assertAlmostEqual(row["host_us:cppwrap-no-replay/python"], 0.25)
        report = self._report(records)
        text = _bench.markdown(report)
        self.assertIn(
            "| seed | 0.80 | 0.75 | 0.50 | 0.80 | 1.25 | 0.50 | 0.25 | 0.50 |", text
        )
        self.assertIn("| median latency ours/reduce-overhead |", text)
        # A CPU report has no latency or host column; a CUDA one has, "-"
        # where a mode has none.
        self.assertNotIn("latency µs/call", text)
        self.assertNotIn("host µs/call", text)
        cuda = _bench.markdown({**report, "meta": {**report["meta"], "device": "cuda"}})
        self.assertIn(
            "| e2e µs/call | latency µs/call | host µs/call | `call` µs/call |", cuda
        )
        self.assertIn(
            "| seed | cppwrap | yes | 10.00 | 2.00 | 100.0 | 300.0 | 120.0 | 10.0 |",
            cuda,
        )
        self.assertIn(
            "| seed | python | yes | 40.00 | 8.00 | 400.0 | - | 400.0 | 40.0 |", cuda
        )
        self.assertIn(
            "- seed: replayed: 2 graph(s), 12, 40 replays, 1 missed; "
            "kernel by kernel: only 1 launch(es)",
            text,
        )
        # Without those modes, neither table.
        text = _bench.markdown(
            {**report, "results": records[:2], "ratios": _bench.ratios(records[:1])}
        )
        self.assertNotIn("Against CUDA graphs", text)

    def _run_fake(self, worker, out=None, rounds=1, **kwargs):
        """run_bench of the seed workload in two modes, with `worker` for the
        worker processes; the report so far written to `out` if given."""
        with (
            mock.patch.object(_bench, "spawn_worker", worker),
            mock.patch.object(_bench, "progress"),
        ):
            return _bench.run_bench(
                ["seed"],
                ["python", "upstream"],
                device="cpu",
                quick=True,
                timeout_s=1.0,
                rounds=rounds,
                on_record=None
                if out is None
                else lambda partial: _bench.write_report(partial, out, final=False),
                **kwargs,
            )

    def test_rounds_alternate_and_keep_the_fastest(self) -> None:
        from pathlib import Path

        calls = []

        def worker(workload, mode, phase, **kwargs):
            calls.append((mode, phase))
            # python is slow in its first warm round, fast in its second.
            slow = mode == "python" and calls.count((mode, "warm")) == 1
            e2e = 9.0 if slow else 3.0
            return {"compile_s": 1.0, "ok": True, "e2e_us": e2e, "call_us": 2.0}

        with tempfile.TemporaryDirectory() as tmp:
            report = self._run_fake(worker, Path(tmp), rounds=2)
        self.assertEqual(
            calls,
            [
                ("python", "cold"),
                ("upstream", "cold"),
                ("python", "warm"),
                ("upstream", "warm"),
                ("upstream", "warm"),  # the second round in the other order
                ("python", "warm"),
            ],
        )
        python = next(r for r in report["results"] if r["mode"] == "python")
        self.assertEqual(python["e2e_us"], 3.0)
        self.assertEqual([r["e2e_us"] for r in python["warm_rounds"]], [9.0, 3.0])
        self.assertEqual(report["meta"]["rounds"], 2)

    def test_cold_rounds_compile_in_fresh_caches_and_keep_the_fastest(self) -> None:
        calls = []
        existed = []

        def worker(workload, mode, phase, cache_dir, **kwargs):
            calls.append((mode, phase, cache_dir))
            if phase == "cold":
                # Each cold compile finds its cache empty.
                existed.append(os.listdir(cache_dir))
                with open(os.path.join(cache_dir, "compiled"), "w") as f:
                    f.write(mode)
            # upstream compiles slowly in its first cold round only.
            first = sum(1 for m, p, _ in calls if (m, p) == (mode, phase)) == 1
            slow = mode == "upstream" and phase == "cold" and first
            return {
                "compile_s": 9.0 if slow else 2.0,
                "compile_phases_s": {"codegen": 8.0 if slow else 1.0},
                "compile_host_probe_us": 5.0 if slow else 3.0,
                "ok": True,
                "e2e_us": 3.0,
            }

        report = self._run_fake(worker, cold_rounds=2)
        self.assertEqual(
            [(m, p) for m, p, _ in calls],
            [
                ("python", "cold"),
                ("upstream", "cold"),
                ("upstream", "cold"),  # the second round in the other order
                ("python", "cold"),
                ("python", "warm"),
                ("upstream", "warm"),
            ],
        )
        self.assertEqual(existed, [[], [], [], []])
        # The warm process reads the cache of the mode's last cold compile.
        dirs = {m: [d for mm, p, d in calls if mm == m] for m in ("python", "upstream")}
        for cold1, cold2, warm in dirs.values():
            self.assertNotEqual(cold1, cold2)
            self.assertEqual(cold2, warm)
        row = {r["mode"]: r for r in report["results"]}["upstream"]
        self.assertEqual(row["cold_compile_s"], 2.0)
        self.assertEqual(row["cold_phases_s"], {"codegen": 1.0})
        self.assertEqual([r["compile_s"] for r in row["cold_rounds"]], [9.0, 2.0])
        self.assertEqual(row["cold"]["probe_of"]["compile_s"], 3.0)
        self.assertEqual(report["meta"]["cold_rounds"], 2)
        self.assertEqual(report["meta"]["compile_host_probe_us"], [3.0, 5.0])
        self.assertIn("cold rounds: 2", _bench.markdown(report))
        self.assertEqual(_bench.main(["--cold-rounds", "0"]), 2)

    def _table_of_a_stopped_run(self, worker, rounds):
        """bench.md as a run left it when `worker` raised KeyboardInterrupt
        (which stands in for the run being killed)."""
        from pathlib import Path

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            with self.assertRaises(KeyboardInterrupt):
                self._run_fake(worker, out, rounds=rounds)
            return (out / "bench.md").read_text()

    def test_each_row_is_written_as_it_finishes(self) -> None:
        # A run stopped by a time limit keeps the rows it finished.
        calls = []

        def worker(workload, mode, phase, **kwargs):
            calls.append((mode, phase))
            if len(calls) == 5:  # the second round's first worker
                raise KeyboardInterrupt  # stands in for the run being killed
            return {"compile_s": 1.0, "ok": True, "e2e_us": 3.0, "call_us": 2.0}

        text = self._table_of_a_stopped_run(worker, rounds=2)
        self.assertIn("| seed | python | yes | 1.00 | 1.00 | 3.0 | 2.0 |", text)
        self.assertIn("| seed | upstream | yes | 1.00 | 1.00 | 3.0 | 2.0 |", text)
        self.assertIn("- rounds: 1 (warm processes per mode", text)

    def test_a_run_stopped_while_timing_keeps_its_cold_compiles(self) -> None:
        # Stopped at the first warm process: both cold compiles are written,
        # with no timing, and are not reported as problems.
        calls = []

        def worker(workload, mode, phase, **kwargs):
            calls.append((mode, phase))
            if phase == "warm":
                raise KeyboardInterrupt  # stands in for the run being killed
            return {"compile_s": 7.0, "ok": True}

        text = self._table_of_a_stopped_run(worker, rounds=1)
        self.assertIn("| seed | python | yes | 7.00 | - |", text)
        self.assertIn("| seed | upstream | yes | 7.00 | - |", text)
        self.assertNotIn("## Problems", text)

    def test_jobs_overlap_cold_compiles_and_time_alone(self) -> None:
        import threading
        import time

        lock = threading.Lock()
        running = {"cold": 0, "warm": 0}
        most = {"cold": 0, "warm": 0}
        timed_beside_a_compile = []

        def worker(workload, mode, phase, **kwargs):
            with lock:
                running[phase] += 1
                most[phase] = max(most[phase], running[phase])
                if running["warm"] and running["cold"]:
                    timed_beside_a_compile.append((workload, mode, phase))
            time.sleep(0.2)
            with lock:
                running[phase] -= 1
            return {"compile_s": 1.0, "ok": True, "e2e_us": 3.0, "call_us": 2.0}

        with (
            mock.patch.object(_bench, "spawn_worker", worker),
            mock.patch.object(_bench, "progress"),
        ):
            report = _bench.run_bench(
                ["seed", "mlp", "convnet"],
                ["python", "upstream"],
                device="cpu",
                quick=True,
                timeout_s=1.0,
                jobs=3,
            )
        self.assertEqual(most["warm"], 1)
        self.assertGreater(most["cold"], 1)
        # Nothing compiles while a warm process times its calls.
        self.assertEqual(timed_beside_a_compile, [])
        # The rows keep the order the workloads were asked for in.
        self.assertEqual(
            [r["workload"] for r in report["results"]],
            ["seed", "seed", "mlp", "mlp", "convnet", "convnet"],
        )

    def test_warm_jobs_run_side_by_side_and_take_turns_to_time(self) -> None:
        import threading
        import time

        lock = threading.Lock()
        running = {"cold": 0, "warm": 0}
        most = {"cold": 0, "warm": 0}
        lock_files: dict[str, set[str | None]] = {"cold": set(), "warm": set()}

        def worker(workload, mode, phase, extra_env=None, **kwargs):
            with lock:
                running[phase] += 1
                most[phase] = max(most[phase], running[phase])
                lock_files[phase].add((extra_env or {}).get(_bench.TIMING_LOCK_ENV))
            time.sleep(0.2)
            with lock:
                running[phase] -= 1
            return {"compile_s": 1.0, "ok": True, "e2e_us": 3.0}

        with (
            mock.patch.object(_bench, "spawn_worker", worker),
            mock.patch.object(_bench, "progress"),
        ):
            _bench.run_bench(
                ["seed", "mlp", "convnet"],
                ["python"],
                device="cpu",
                quick=True,
                timeout_s=1.0,
                warm_jobs=3,
            )
        self.assertEqual(most, {"cold": 1, "warm": 3})
        # Every warm process was told of one lock file; no cold one was.
        self.assertEqual(lock_files["cold"], {None})
        (path,) = lock_files["warm"]
        self.assertIsNotNone(path)
        self.assertFalse(os.path.exists(os.path.dirname(path)))  # cleaned up

    def test_timing_turns_exclude_compiles_and_other_timings(self) -> None:
        import threading

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "lock")

            def gets_turn_while(held: list[bool], alone: bool) -> bool:
                """Whether a worker gets its turn (`alone`: to time) while
                other workers hold theirs (`held`: alone or not)."""
                holders = [_bench.TimingTurns(path) for _ in held]
                for holder, holder_alone in zip(holders, held, strict=True):
                    holder.take(alone=holder_alone)
                turns = _bench.TimingTurns(path)
                thread = threading.Thread(target=turns.take, kwargs={"alone": alone})
                thread.start()
                thread.join(0.5)
                got_it = not thread.is_alive()
                for holder in holders:  # those workers end
                    holder.close()
                thread.join(10)
                self.assertFalse(thread.is_alive())
                turns.close()
                return got_it

            self.assertTrue(gets_turn_while([False, False], alone=False))
            self.assertFalse(gets_turn_while([False], alone=True))
            self.assertFalse(gets_turn_while([True], alone=True))
            self.assertFalse(gets_turn_while([True], alone=False))
            # A worker's own shared turn becomes its timing turn, which keeps
            # the others out until the worker ends.
            turns = _bench.TimingTurns(path)
            turns.take(alone=False)
            turns.take(alone=True)
            other = _bench.TimingTurns(path)
            thread = threading.Thread(target=other.take, kwargs={"alone": False})
            thread.start()
            thread.join(0.5)
            self.assertTrue(thread.is_alive())
            turns.close()
            thread.join(10)
            self.assertFalse(thread.is_alive())
            other.close()
        _bench.worker_turns.cache_clear()
        with mock.patch.dict(os.environ, {_bench.TIMING_LOCK_ENV: ""}):
            self.assertIsNone(_bench.worker_turns())
        _bench.worker_turns.cache_clear()

    def test_kernel_by_kernel_times_on_the_cache_of_our_cold_compile(self) -> None:

        calls: list[tuple[str, str, str]] = []

        def worker(workload, mode, phase, cache_dir, **kwargs):
            calls.append((mode, phase, cache_dir))
            return {
                "compile_s": 1.0,
                "ok": True,
                "e2e_us": 3.0,
                "mem_segments_mb": {"0, 0": [2.0], "0, 1": [32.0, 20.0]},
            }

        # No GPU needed: the workers are stand-ins.
        no_gpu = (
            mock.patch.object(
                _bench, "runtime_installation", lambda *a: contextlib.nullcontext({})
            ),
            mock.patch("torch.cuda.get_device_name", lambda *a: "a stand-in GPU"),
        )
        with (
            mock.patch.object(_bench, "spawn_worker", worker),
            mock.patch.object(_bench, "progress"),
            no_gpu[0],
            no_gpu[1],
        ):
            report = _bench.run_bench(
                ["mlp"],
                ["cppwrap", "cppwrap-no-replay"],
                device="cuda",
                quick=True,
                timeout_s=1.0,
            )
        phases = [(mode, phase) for mode, phase, _ in calls]
        self.assertEqual(
            phases,
            [("cppwrap", "cold"), ("cppwrap", "warm"), ("cppwrap-no-replay", "warm")],
        )
        self.assertEqual(len({d for _, _, d in calls}), 1)
        row = {r["mode"]: r for r in report["results"]}["cppwrap-no-replay"]
        self.assertEqual((row["ok"], row["cold_compile_s"]), (True, None))
        # What a CUDA row's peak is made of is kept, and the report says where.
        self.assertEqual(row["mem_segments_mb"], {"0, 0": [2.0], "0, 1": [32.0, 20.0]})
        self.assertIn("`mem_segments_mb`", _bench.markdown(report))
        # Alone, it compiles cold for itself.
        calls.clear()
        with (
            mock.patch.object(_bench, "spawn_worker", worker),
            mock.patch.object(_bench, "progress"),
            no_gpu[0],
            no_gpu[1],
        ):
            _bench.run_bench(
                ["mlp"], ["cppwrap-no-replay"], device="cuda", quick=True, timeout_s=1.0
            )
        self.assertEqual(
            [(m, p) for m, p, _ in calls],
            [("cppwrap-no-replay", "cold"), ("cppwrap-no-replay", "warm")],
        )


class TestModels(TestCase):
    def test_models_are_asked_for_by_name_and_run_as_described(self) -> None:
        self.assertEqual(set(_bench.REAL_MODELS) & set(_bench.DEFAULT_WORKLOADS), set())
        specs = _bench.WORKLOADS
        self.assertTrue(specs["gpt2_train_step"].train)
        self.assertTrue(specs["gpt2_dynamic"].dynamic)
        for name in ("resnet18", "vit_tiny", "gpt2", "bert", "t5"):
            self.assertIn(name, _bench.REAL_MODELS)
        # Kernel by kernel is ours with replay switched off in the worker.
        mode = _bench.MODES["cppwrap-no-replay"]
        self.assertTrue(mode.imports_torch_cppwrap and mode.cuda_only)
        self.assertIn(("TORCH_CPPWRAP_CUDA_GRAPHS", "0"), mode.environ)


if __name__ == "__main__":
    run_tests()
