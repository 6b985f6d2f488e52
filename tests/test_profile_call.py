"""scripts/gpu/profile_call.py: the parts that need no GPU."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch._inductor.output_code import CompiledFxGraph
from torch._inductor.test_case import TestCase, run_tests

from tests.common import CppWrapperTestCase, load_script, our_wrappers_created

_profile_call = load_script("scripts/gpu/profile_call.py")


class TestHostSplit(CppWrapperTestCase):
    def test_split_times_our_graph_and_puts_back_what_it_patched(self) -> None:
        def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return (x @ w).relu() + 1

        args = (torch.randn(8, 16), torch.randn(16, 4))
        compiled = torch.compile(fn)
        seen: list[tuple[Any, Any]] = []
        original_call = CompiledFxGraph.__call__

        def recording_call(self: Any, inputs: Any) -> Any:
            seen.append((self, self.current_callable))
            return original_call(self, inputs)

        with our_wrappers_created() as created:
            CompiledFxGraph.__call__ = recording_call  # type: ignore[method-assign]
            try:
                result = compiled(*args)
            finally:
                CompiledFxGraph.__call__ = original_call  # type: ignore[method-assign]
            self.assertTrue(created, "torch_cppwrap generated no code")
            self.assertEqual(result, fn(*args))
            split = _profile_call.host_split_us(
                lambda: compiled(*args), lambda: None, 20
            )
        (graph, graph_callable), *_ = seen
        # The class's __call__ and the graph's callable are as they were.
        self.assertIs(CompiledFxGraph.__call__, original_call)
        self.assertIs(graph.current_callable, graph_callable)
        self.assertEqual(split["host_graph_calls_per_step"], 1)
        # Nested: the step holds the graph, which holds its callable (our
        # module's `call`); Dynamo's guards run outside the graph.
        self.assertGreater(split["host_in_callables_us"], 0.0)
        self.assertLessEqual(split["host_in_callables_us"], split["host_in_graphs_us"])
        self.assertGreater(split["host_outside_graphs_us"], 0.0)
        self.assertLessEqual(split["host_in_graphs_us"], split["host_split_step_us"])


class _Event:
    """A profiler event as gpu_gaps reads one."""

    def __init__(self, name: str, start: float, end: float, device: str) -> None:
        self.name = name
        self.device_type = f"DeviceType.{device}"
        self.time_range = type("Interval", (), {"start": start, "end": end})()


class TestGpuGaps(TestCase):
    @staticmethod
    def _steps(count: int, between: float, inside: float) -> list[_Event]:
        """`count` steps of three kernels (10, 20 and 5 µs), `between` µs idle
        before each step's first and `inside` µs before its last."""
        events, t = [], 0.0
        for _ in range(count):
            t += between
            for name, length, gap in (
                ("a", 10.0, 0.0),
                ("b", 20.0, 0.0),
                ("c", 5.0, inside),
            ):
                t += gap
                events.append(_Event(name, t, t + length, "CUDA"))
                # The host's event of the launch, which is not the GPU's.
                events.append(_Event("cuGraphLaunch", t - 1.0, t, "CPU"))
                t += length
        return events

    def test_idle_time_between_and_inside_steps(self) -> None:
        gaps = _profile_call.gpu_gaps(self._steps(4, between=40.0, inside=3.0), 4)
        self.assertEqual(gaps["gpu_activities_per_step"], 3)
        self.assertAlmostEqual(gaps["gpu_busy_us_per_step"], 35.0)
        self.assertAlmostEqual(gaps["gpu_gap_between_steps_us"], 40.0)
        self.assertAlmostEqual(gaps["gpu_gaps_inside_step_us"], 3.0)
        self.assertAlmostEqual(gaps["gpu_idle_us_per_step"], 43.0)
        largest = gaps["gpu_largest_gaps"][0]
        self.assertEqual((largest["after"], largest["before"]), ("b", "c"))
        self.assertAlmostEqual(largest["us"], 3.0)
        text = _profile_call.markdown([{"workload": "bert", "mode": "cppwrap", **gaps}])
        self.assertIn("3.0 µs idle after b and before c (activity 2 of 3", text)

    def test_overlapping_activities_count_once(self) -> None:
        events = self._steps(2, between=0.0, inside=0.0)
        # The second step's "a" (35-45 µs) starts with the first's "c"
        # (30-35 µs), as on another stream: 5 µs of it overlap.
        events[6].time_range.start = 30.0
        gaps = _profile_call.gpu_gaps(events, 2)
        self.assertAlmostEqual(gaps["gpu_busy_us_per_step"], 35.0)
        self.assertAlmostEqual(gaps["gpu_idle_us_per_step"], 0.0)

    def test_steps_that_differ_are_measured_as_a_whole(self) -> None:
        events = self._steps(3, between=1.0, inside=0.0)
        events[-2].name = "d"
        gaps = _profile_call.gpu_gaps(events, 3)
        self.assertTrue(
            gaps["gpu_gaps_error"].startswith("the steps ran different GPU activities")
        )
        self.assertNotIn("gpu_gap_between_steps_us", gaps)
        # Over the whole run: 3 x 35 µs busy, 1 µs idle before steps 2 and 3.
        self.assertAlmostEqual(gaps["gpu_busy_us_per_step"], 35.0)
        self.assertAlmostEqual(gaps["gpu_idle_us_per_step"], 2.0 / 3)
        gaps = _profile_call.gpu_gaps(events[:-2], 3)  # one activity short
        self.assertAlmostEqual(gaps["gpu_activities_per_step"], 8 / 3)
        self.assertEqual(
            _profile_call.gpu_gaps(events, 1)["gpu_gaps_error"],
            "9 GPU activities for 1 step(s)",
        )
        text = _profile_call.markdown(
            [{"workload": "bert", "mode": "cppwrap", "gpu_gaps_error": "differ"}]
        )
        self.assertIn("- bert / cppwrap: differ", text)


class _HostEvent:
    """A host event as launch_split reads one: its own time is its total
    less its children's."""

    def __init__(self, name: str, total: float, *children: _HostEvent) -> None:
        self.name = name
        self.device_type = "DeviceType.CPU"
        self.cpu_time_total = total
        self.self_cpu_time_total = total - sum(c.cpu_time_total for c in children)
        self.cpu_children = list(children)
        self.cpu_parent: _HostEvent | None = None
        for child in children:
            child.cpu_parent = self


class TestLaunchSplit(TestCase):
    @staticmethod
    def _call(graph_own: float, launcher_own: float) -> list[_HostEvent]:
        """One call of a compiled graph: a cuBLAS matmul (12 µs, 4 of them
        its launch) and a Triton launch (`launcher_own` µs, then 4 µs in the
        driver), with `graph_own` µs of the wrapper's code around them."""
        launch = _HostEvent("cudaLaunchKernel", 4.0)
        mm = _HostEvent("aten::mm", 12.0, launch)
        driver = _HostEvent("cuLaunchKernel", 4.0)
        triton = _HostEvent("triton_poi_fused_add_0", launcher_own + 4.0, driver)
        graph = _HostEvent(
            "## Call CompiledFxGraph fabc ##",
            graph_own + 12.0 + triton.cpu_time_total,
            mm,
            triton,
        )
        return [graph, mm, launch, triton, driver]

    def test_the_wrappers_own_time_leaves_out_what_it_calls(self) -> None:
        ours = _profile_call.launch_split(self._call(3.0, 0.5) * 2, 2)
        python = _profile_call.launch_split(self._call(20.0, 10.0) * 2, 2)
        self.assertEqual(ours["extern_calls_per_call"], 1)
        self.assertEqual(ours["triton_launches_per_call"], 1)
        self.assertAlmostEqual(ours["extern_host_us_per_call"], 12.0)
        self.assertAlmostEqual(ours["wrapper_own_us_per_call"], 3.5)
        self.assertAlmostEqual(python["wrapper_own_us_per_call"], 30.0)
        text = _profile_call.markdown(
            [
                {"workload": "bert", "mode": "cppwrap-no-replay", **ours},
                {"workload": "bert", "mode": "python", **python},
            ]
        )
        self.assertIn(
            "- bert: the wrapper's own host µs per call (profiled), "
            "cppwrap-no-replay / python = 4 / 30 = 0.12",
            text,
        )


class TestStepSpans(TestCase):
    def test_the_unprofiled_spans_have_their_columns(self) -> None:
        spans = {"gpu_step_span_us": 400.0, "gpu_between_steps_us": 10.0}
        text = _profile_call.markdown(
            [{"workload": "gpt2", "mode": "cppwrap", **spans}]
        )
        self.assertIn("GPU µs per step, unprofiled (events)", text)
        self.assertIn("| 400.0 | 10.0 |", text)


class TestChildCommand(TestCase):
    def test_the_flags_reach_the_child(self) -> None:
        seen: list[list[str]] = []

        def fake_run(cmd: list[str], **kwargs: Any) -> Any:
            seen.append(cmd)
            return subprocess.CompletedProcess(cmd, 0, 'RESULT {"ok": 1}\n', "")

        with (
            tempfile.TemporaryDirectory() as out,
            mock.patch.object(_profile_call.subprocess, "run", fake_run),
        ):
            record = _profile_call.run_child(
                "mlp",
                "cppwrap",
                Path(out),
                10.0,
                {},
                gaps=True,
                eager_first="drop",
                graph_dump=True,
                keep_cached_memory=True,
                inductor_config={"triton.autotune_pointwise": False},
            )
            _profile_call.run_child("mlp", "cppwrap", Path(out), 10.0, {})
        self.assertEqual(record, {"ok": 1})
        self.assertEqual(
            seen[0][-7:],
            [
                "--gpu-gaps",
                "--eager-first",
                "drop",
                "--graph-dump",
                "--keep-cached-memory",
                "--inductor-config",
                "triton.autotune_pointwise=False",
            ],
        )
        for flag in (
            "--eager-first",
            "--graph-dump",
            "--keep-cached-memory",
            "--inductor-config",
        ):
            self.assertNotIn(flag, seen[1])

    def test_the_child_is_told_what_the_flags_ask(self) -> None:
        parser_args = (
            ["--eager-first"],
            ["--eager-first", "drop", "--keep-cached-memory"],
            ["--eager-first", "libs"],
            ["--eager-first", "cublas", "--inductor-config", "max_autotune=True"],
            [],
        )
        seen: list[dict[str, Any]] = []
        for args in parser_args:
            with (
                tempfile.TemporaryDirectory() as out,
                mock.patch.object(
                    _profile_call.sys,
                    "argv",
                    ["profile_call.py", "--out", out, *args, "--child", "mlp", "x"],
                ),
                mock.patch.object(
                    _profile_call, "child", lambda *a, **k: seen.append(k) or {}
                ),
                mock.patch("builtins.print"),
            ):
                self.assertEqual(_profile_call.main(), 0)
        self.assertEqual(
            [k["eager_first"] for k in seen], ["hold", "drop", "libs", "cublas", None]
        )
        self.assertEqual(
            [k["keep_cached_memory"] for k in seen],
            [False, True, False, False, False],
        )
        self.assertEqual(
            [k["inductor_config"] for k in seen],
            [{}, {}, {}, {"max_autotune": True}, {}],
        )

    def test_a_bad_inductor_config_setting_is_refused_before_any_child(
        self,
    ) -> None:
        self.assertEqual(
            _profile_call.config_setting("triton.autotune_pointwise=False"),
            ("triton.autotune_pointwise", False),
        )
        for text, says in (
            ("max_autotune", "is not KEY=VALUE"),
            ("triton.no_such_entry=1", "has no 'triton.no_such_entry'"),
            ("max_autotune=yes please", "is not a Python literal"),
            ("max_autotune=3", "takes a bool"),
        ):
            with self.subTest(text=text), mock.patch("sys.stderr") as stderr:
                with (
                    tempfile.TemporaryDirectory() as out,
                    mock.patch.object(
                        _profile_call.sys,
                        "argv",
                        ["profile_call.py", "--out", out, "--inductor-config", text],
                    ),
                    mock.patch.object(_profile_call, "run_child") as run_child,
                    self.assertRaises(SystemExit),
                ):
                    _profile_call.main()
                run_child.assert_not_called()
                written = "".join(c.args[0] for c in stderr.write.call_args_list)
                self.assertIn(says, written)

    def test_the_child_applies_the_config_for_its_life(self) -> None:
        from torch._inductor import config

        applied: list[bool] = []

        class Stop(Exception):
            pass

        def stop_at_build(*args: Any) -> Any:
            applied.append(config.triton.autotune_pointwise)
            raise Stop

        bench = mock.MagicMock()
        bench.MODES = {"cppwrap": _profile_call.load_bench().MODES["cppwrap"]}
        bench.WORKLOADS = {"mlp": mock.MagicMock(build=stop_at_build)}
        # What the child sets before it builds the workload, put back after.
        restored = {
            "triton.autotune_pointwise": True,
            "cpp_wrapper": config.cpp_wrapper,
            "cpp.enable_kernel_profile": config.cpp.enable_kernel_profile,
        }
        with (
            config.patch(restored),
            torch.random.fork_rng(),
            mock.patch.object(_profile_call, "load_bench", return_value=bench),
            tempfile.TemporaryDirectory() as out,
            self.assertRaises(Stop),
        ):
            _profile_call.child(
                "mlp",
                "cppwrap",
                Path(out),
                inductor_config={"triton.autotune_pointwise": False},
            )
        self.assertEqual(applied, [False])
        self.assertTrue(config.triton.autotune_pointwise)

    def test_the_library_settings_set_up_only_their_libraries(self) -> None:
        fake_torch = mock.MagicMock()
        ran: dict[str, list[str]] = {}
        for setting in ("libs", "cudnn", "cublas", "cublas-side"):
            fake_torch.reset_mock()
            _profile_call.warm_libraries(fake_torch, _profile_call.LIBRARIES[setting])
            ran[setting] = [
                name
                for name, called in (
                    ("conv2d", fake_torch.nn.functional.conv2d.called),
                    ("mm", fake_torch.mm.called),
                    ("side stream", fake_torch.cuda.Stream.called),
                )
                if called
            ]
            # The stream made is the one they run on.
            fake_torch.cuda.stream.assert_called_once_with(
                fake_torch.cuda.Stream.return_value
                if fake_torch.cuda.Stream.called
                else None
            )
            fake_torch.cuda.synchronize.assert_called_once()
        self.assertEqual(
            ran,
            {
                "libs": ["conv2d", "mm"],
                "cudnn": ["conv2d"],
                "cublas": ["mm"],
                "cublas-side": ["mm", "side stream"],
            },
        )


# What cudaGraphDebugDotPrint writes with its verbose flag (torch's
# debug_dump), in outline: a cluster per graph, a record per node whose label
# starts with the node's kind, then the edges.
_DOT = r"""digraph dot {
subgraph cluster_7 {
label="graph_7" graph[style="dashed"];
"graph_7_node_0"[style="bold" shape="record" label="{MEMCPY
| {ID | 0 (topoId: 2) | (0x7F00AA000000) -\> (0x7F00AB000000)}
| {{node handle} | {0x000055E7277A5C20}}
}"];
"graph_7_node_1"[style="bold" shape="record" label="{KERNEL
| {ID | 1 (topoId: 1) | triton_poi_fused_0\<\<\<8,128,0\>\>\>}
| {{node handle | func handle} | {0x000055E7277A5D30 | 0x000055E7270A5A90}}
| {priority | 0}
}"];
"graph_7_node_2"[style="bold" shape="record" label="{KERNEL
| {ID | 2 (topoId: 0) | triton_poi_fused_1\<\<\<8,128,0\>\>\>}
| {{node handle | func handle} | {0x000055E7277A5E40 | 0x000055E7270A5BA0}}
| {priority | 0}
}"];
"graph_7_node_0" -> "graph_7_node_1";
"graph_7_node_0" -> "graph_7_node_2";
}
}
"""


class TestGraphDump(TestCase):
    @staticmethod
    def markdown_of(dumps: list[dict[str, Any]]) -> str:
        """profile.md's text for one record of MLP under ours with `dumps`."""
        record = {"workload": "mlp", "mode": "cppwrap", "process": 1}
        return _profile_call.markdown([{**record, "cuda_graph_dumps": dumps}])

    def test_summary_counts_kinds_edges_and_forks(self) -> None:
        summary = _profile_call.graph_summary(_DOT)
        self.assertEqual(summary["nodes"], 3)
        self.assertEqual(summary["kinds"], {"MEMCPY": 1, "KERNEL": 2})
        self.assertEqual(summary["edges"], 2)
        self.assertEqual(summary["forks"], 1)

    def test_digest_ignores_addresses_and_graph_ids_only(self) -> None:
        digest = _profile_call.graph_summary(_DOT)["digest"]
        moved = _DOT.replace("0x7F00", "0x7E11").replace("graph_7", "graph_12")
        self.assertEqual(_profile_call.graph_summary(moved)["digest"], digest)
        renamed = _DOT.replace("triton_poi_fused_1", "triton_poi_fused_2")
        self.assertNotEqual(_profile_call.graph_summary(renamed)["digest"], digest)

    def test_every_capture_is_dumped_and_summarised(self) -> None:
        calls: list[str] = []

        class FakeGraph:
            # torch.cuda.CUDAGraph's binding: only a graph made with
            # keep_graph=True still has its cudaGraph_t when capture_end
            # returns, and so something for debug_dump to write.
            def __init__(self, keep_graph: bool = False) -> None:
                self.keep_graph = keep_graph

            def capture_begin(self, pool: Any = None) -> None:
                calls.append("begin")

            def capture_end(self) -> None:
                calls.append("end")

            def debug_dump(self, path: str) -> None:
                calls.append("dump")
                if self.keep_graph:
                    Path(path).write_text(_DOT)

            def instantiate(self) -> None:
                calls.append("instantiate")

        with (
            tempfile.TemporaryDirectory() as out,
            mock.patch.object(torch.cuda, "CUDAGraph", FakeGraph),
        ):
            dumps = _profile_call.dump_captured_graphs(Path(out), "mlp_cppwrap_1")
            for _ in range(2):
                graph = FakeGraph()
                graph.capture_begin(pool=None)
                graph.capture_end()
            files = sorted(p.name for p in Path(out).iterdir())
        self.assertEqual(calls, ["begin", "end", "dump", "instantiate"] * 2)
        self.assertEqual(
            files, ["graph_mlp_cppwrap_1_0.dot", "graph_mlp_cppwrap_1_1.dot"]
        )
        self.assertEqual([d["file"] for d in dumps], files)
        self.assertEqual(dumps[0]["kinds"], {"MEMCPY": 1, "KERNEL": 2})
        text = self.markdown_of(dumps)
        self.assertIn(
            "- mlp / cppwrap (process 1): CUDA graph 0: 3 nodes (KERNEL 2, MEMCPY 1), "
            "2 edges, 1 forks",
            text,
        )

    def test_a_dump_that_fails_never_fails_the_capture(self) -> None:
        # On torch 2.11 with CUDA, debug_dump wrote no file for some
        # captures; the capture itself must go on and the record say so.
        ended: list[int] = []

        class SilentGraph:
            def __init__(self, keep_graph: bool = False) -> None:
                pass

            def capture_begin(self, pool: Any = None) -> None:
                pass

            def capture_end(self) -> None:
                ended.append(1)

            def debug_dump(self, path: str) -> None:
                pass

            def instantiate(self) -> None:
                ended.append(2)
                raise RuntimeError("instantiated already")

        with (
            tempfile.TemporaryDirectory() as out,
            mock.patch.object(torch.cuda, "CUDAGraph", SilentGraph),
        ):
            dumps = _profile_call.dump_captured_graphs(Path(out), "mlp_cppwrap_1")
            graph = SilentGraph()
            graph.capture_begin()
            graph.capture_end()
        # Neither a dump that fails nor an instantiate that fails is raised.
        self.assertEqual(ended, [1, 2])
        self.assertEqual(
            dumps,
            [
                {
                    "file": "graph_mlp_cppwrap_1_0.dot",
                    "error": "FileNotFoundError: debug_dump wrote no file",
                    "instantiate_error": "RuntimeError: instantiated already",
                }
            ],
        )
        text = self.markdown_of(dumps)
        self.assertIn(
            "- mlp / cppwrap (process 1): CUDA graph 0: no dump "
            "(FileNotFoundError: debug_dump wrote no file)",
            text,
        )


if __name__ == "__main__":
    run_tests()
