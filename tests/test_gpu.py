"""torch_cppwrap's CUDA C++ wrapper, compared with eager.  Skips without CUDA."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import textwrap
import threading
import traceback
import unittest
import weakref
from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor import config
from torch._inductor.codecache import PyCodeCache
from torch._inductor.graph import GraphLowering
from torch._inductor.test_case import TestCase, run_tests

import torch_cppwrap
from tests.common import CppWrapperTestCase, our_wrappers_created, seed_cache
from torch_cppwrap._inductor import codecache
from torch_cppwrap._inductor.codegen.cpp_wrapper_gpu import CppWrapperGpu
from torch_cppwrap._inductor.runtime import cuda_graphs

HAS_CUDA = torch.cuda.is_available()
HAS_MULTI_GPU = HAS_CUDA and torch.cuda.device_count() >= 2
requires_cuda = unittest.skipUnless(HAS_CUDA, "needs a CUDA device")


def mlp(depth: int = 8, width: int = 256) -> torch.nn.Module:
    """The benchmark model: Linear + GELU + residual, then LayerNorm."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(width, width)
            self.norm = torch.nn.LayerNorm(width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x + F.gelu(self.linear(x)))

    return torch.nn.Sequential(*[Block() for _ in range(depth)])


def pool_bytes(field: str, *, default_pool: bool = False) -> int:
    """The caching allocator's segments' `field` ("total_size": reserved,
    "allocated_size"), summed over our graphs' memory pools, or over the
    default pool."""
    pools = (
        {(0, 0)} if default_pool else {tuple(p.id) for p in cuda_graphs._pools.values()}
    )
    return sum(
        s[field]
        for s in torch.cuda.memory_snapshot()
        if tuple(s["segment_pool_id"]) in pools
    )


@requires_cuda
class CudaWrapperTestCase(CppWrapperTestCase):
    """CppWrapperTestCase (our classes made the code, results match eager;
    on CUDA, every Triton kernel a cubin launched from C++) with the CUDA
    runtime's artefacts seeded too."""

    def setUp(self) -> None:
        super().setUp()
        seed_cache("cuda")


class TestTritonKernels(CudaWrapperTestCase):
    def test_seed_example(self) -> None:
        def fn(x, y):
            return (x + y).sum()

        x, y = (
            torch.randn(128, 128, device="cuda"),
            torch.randn(128, 128, device="cuda"),
        )
        # The wrapper compiles on its own while the kernels are tuned; the
        # launchers, defined after, compile with the module's link, which
        # takes the wrapper's object instead of compiling it again.
        runs: list[str] = []
        real_run = codecache.Build.run

        def counting(build: codecache.Build, *args: Any) -> Any:
            runs.append(build.name)
            return real_run(build, *args)

        with (
            mock.patch.object(codecache.Build, "run", counting),
            mock.patch.object(
                codecache, "wrapper_object", wraps=codecache.wrapper_object
            ) as early,
        ):
            (source,) = self.check(fn, (x, y), atol=1e-3, rtol=1e-4)
        early.assert_called_once()
        self.assertEqual(
            sorted(r for r in runs if r in ("wrapper", "launchers", "module")),
            ["launchers", "module", "wrapper"],
        )
        self.assertIn("launcher_src = [\nr'''", source)
        self.assertIn("CPPWRAP_CUDA_EMBED_CUBIN(", source)
        self.assertRegex(
            source,
            r"CPPWRAP_CUDA_LAUNCHER void launch_triton_\w+\(int32_t device, void\* stream",
        )
        self.assertIn("cppwrap::cuda::current_stream(0)", source)
        self.assertIn("cppwrap::cuda::DeviceGuard device_guard(0);", source)
        self.assertIn("cppwrap::GilRelease nogil;", source)

    def test_mlp(self) -> None:
        model = mlp(depth=2).cuda()
        with torch.no_grad():
            (source,) = self.check(
                model, (torch.randn(32, 256, device="cuda"),), atol=1e-2, rtol=1e-2
            )
        self.assertRegex(source, r"aoti_torch_cuda_(mm|addmm)_out")

    def launchers_made(self, fn: Callable[..., Any], args: Sequence[Any]) -> dict:
        """Compiles and checks `fn`, counting the launchers the tuning block
        made of each kind."""
        from torch._inductor.runtime import triton_heuristics as th

        made = {"static": 0, "triton": 0}

        def counted(kind: str, original: Any) -> Any:
            def make_launcher(result: Any) -> Any:
                made[kind] += 1
                return original(result)

            return make_launcher

        with (
            mock.patch.object(
                th.StaticTritonCompileResult,
                "make_launcher",
                counted("static", th.StaticTritonCompileResult.make_launcher),
            ),
            mock.patch.object(
                th.TritonCompileResult,
                "make_launcher",
                counted("triton", th.TritonCompileResult.make_launcher),
            ),
        ):
            self.check(fn, args, atol=1e-4, rtol=1e-4)
        return made

    def test_the_tuning_block_launches_kernels_statically(self) -> None:
        # No Triton launcher built with the C compiler while the graph
        # compiles, whether its kernels compile in this process or in a
        # worker.  The constants make the kernels this test's own.
        from torch._inductor.async_compile import (
            AsyncCompile,
            shutdown_compile_workers,
        )

        x = torch.randn(64, 300, device="cuda")
        with self.subTest("in this process"), config.patch(compile_threads=1):
            made = self.launchers_made(
                lambda x: torch.softmax(x * 1.2345, -1) + 0.678, (x,)
            )
            self.assertGreater(made["static"], 0)
            self.assertEqual(made["triton"], 0)
        torch._dynamo.reset()
        with self.subTest("in a worker"), config.patch(compile_threads=2):
            # The pool this starts is stopped with the test; a later compile
            # that wants one starts its own.
            self.addCleanup(shutdown_compile_workers)
            AsyncCompile.use_process_pool()  # starts the pool
            AsyncCompile.wait_pool_ready()
            self.assertTrue(AsyncCompile.use_process_pool())
            made = self.launchers_made(
                lambda x: torch.softmax(x * 3.4567, -1) + 0.891, (x,)
            )
            self.assertGreater(made["static"], 0)
            self.assertEqual(made["triton"], 0)

    def test_kernels_that_triton_launches(self) -> None:
        # Where the static launcher is off, the tuning block runs Triton's
        # launchers, and the wrapper reads the cubin from their binaries.
        def fn(x):
            return torch.softmax(x * 2.3456, -1) + 0.789

        with config.patch(use_static_cuda_launcher=False):
            made = self.launchers_made(fn, (torch.randn(64, 300, device="cuda"),))
        self.assertEqual(made["static"], 0)
        self.assertGreater(made["triton"], 0)

    def test_tuning_left_unset_is_done_while_compiling(self) -> None:
        # torch 2.12 on reads an unset autotune_at_compile_time as "tune at the
        # first launch" for cpp_wrapper; ours tunes while compiling (strict:
        # a fallback would fail the test).
        with config.patch({"triton.autotune_at_compile_time": None}):
            self.check(lambda x: x.cos() * 1.4142, (torch.randn(300, device="cuda"),))

    def test_tuning_at_the_first_launch_is_done_while_compiling(self) -> None:
        # Upstream's wrapper tunes on the first call's inputs when told to;
        # ours tunes while compiling, which a JIT graph does in its first
        # call (strict: a fallback would fail the test).
        with config.patch({"triton.autotune_at_compile_time": False}):
            self.check(lambda x: x.sin() * 1.7321, (torch.randn(300, device="cuda"),))

    def test_debug_settings_fall_back(self) -> None:
        # Ours does not do these on CUDA yet: the Python wrapper compiles the
        # graph (upstream's C++ wrapper fails to build it under
        # triton.debug_sync_kernel, pytorch#140220).
        x = torch.randn(300, device="cuda")
        for n, setting in enumerate(
            (
                "triton.debug_sync_kernel",
                "nan_asserts",
                "profile_bandwidth",
                "memory_planning",
            )
        ):
            scale = 2.2361 + n  # a graph of its own for each

            def fn(x, scale=scale):
                return x.cos() * scale

            counters.clear()
            torch._dynamo.reset()
            with (
                self.subTest(setting),
                torch_cppwrap.config.patch(strict=False),
                config.patch(
                    {"cpp_wrapper": True, "fx_graph_cache": False, setting: True}
                ),
            ):
                self.assertEqual(torch.compile(fn)(x), fn(x))
                self.assertEqual(
                    counters["inductor"]["cppwrap_python_wrapper_fallback"], 1
                )

    def test_no_python_on_the_call_path(self) -> None:
        # Once compiled, the graph runs although Triton's Python launchers
        # would raise.
        from torch._inductor.runtime import triton_heuristics

        def fn(x):
            return torch.relu(x) + 1

        compiled = torch.compile(fn)
        x = torch.randn(256, device="cuda")
        with config.patch(cpp_wrapper=True, fx_graph_cache=False):
            self.assertEqual(compiled(x), fn(x))

            def no_python_launch(*args: Any, **kwargs: Any) -> Any:
                raise AssertionError("a Triton kernel was launched from Python")

            with mock.patch.object(
                triton_heuristics.CachingAutotuner, "run", no_python_launch
            ):
                y = torch.randn(256, device="cuda")
                self.assertEqual(compiled(y), fn(y))


class TestControlFlow(CudaWrapperTestCase):
    """torch.cond and torch.while_loop around Triton kernels: each subgraph
    is a C++ block, and what one declares (its stream, a kernel's size) is
    declared again where another block needs it."""

    def test_while_loop_with_kernels_in_condition_and_body(self) -> None:
        from torch._higher_order_ops.while_loop import while_loop

        def fn(i, x):
            return while_loop(
                lambda i, x: i < 5, lambda i, x: (i + 1, x * 2 + 1), (i, x)
            )

        args = (torch.tensor(0, device="cuda"), torch.randn(6, device="cuda"))
        (source,) = self.check(fn, args)
        # One stream in the loop's block, one in the body's block inside it.
        self.assertEqual(source.count("void* stream0 = "), 2, source)

    def test_cond_branches_launch_one_kernel_of_dynamic_size(self) -> None:
        # Both branches run one pointwise kernel (after the mm, its add and
        # relu), whose size each branch declares in its own block.
        def fn(p, x, w):
            return torch.cond(
                p,
                lambda x, w: torch.relu(x @ w + 1),
                lambda x, w: torch.relu(x @ w.t() + 1),
                (x, w),
            )

        x, w = torch.randn(8, 16, device="cuda"), torch.randn(16, 16, device="cuda")
        for predicate in (True, False):
            torch._dynamo.reset()
            p = torch.tensor(predicate, device="cuda")
            (source,) = self.check(fn, (p, x, w), atol=1e-4, rtol=1e-4, dynamic=True)
            self.assertRegex(
                source, r"(?s)int64_t (\w+_xnumel) = .*} else {.*int64_t \1 = "
            )

    def test_cond_branch_kernel_with_precomputed_size_is_tuned(self) -> None:
        # The broadcast over channels indexes by H*W, which Inductor
        # precomputes as the branch's own `ps0`: the tuning block's example
        # sizes must come from the branch's graph, not the parent's (upstream
        # fails here, PyTorch's test_cond_control_flow_with_precomputed_size).
        def fn(p, x, b):
            return torch.cond(
                p,
                lambda x, b: torch.relu(x + b.view(1, -1, 1, 1)),
                lambda x, b: torch.relu(x - b.view(1, -1, 1, 1)),
                (x, b),
            )

        x, b = torch.randn(2, 4, 6, 5, device="cuda"), torch.randn(4, device="cuda")
        p = torch.tensor(True, device="cuda")
        (source,) = self.check(fn, (p, x, b), dynamic=True)
        self.assertIn("ps0", source)

    def test_nested_compile_region_launches_from_one_lambda(self) -> None:
        @torch.compiler.nested_compile_region
        def block(x, w):
            y = x @ w
            return torch.relu(y) + 1, y.sin()

        def fn(x, w):
            a, b = block(x, w)
            c, d = block(a, w)
            return c + b, d

        x, w = torch.randn(8, 16, device="cuda"), torch.randn(16, 16, device="cuda")
        (source,) = self.check(fn, (x, w), atol=1e-4, rtol=1e-4)
        self.assertEqual(source.count("auto repeated_subgraph0_fn = [&]("), 1)
        self.assertEqual(source.count("= repeated_subgraph0_fn("), 2)


class TestCudaGraphReplay(CudaWrapperTestCase):
    """A graph of CUDA tensors with fixed shapes is captured on its second call
    and replayed as one CUDA graph from the third (cppwrap::cuda::GraphReplay)."""

    def compile_module(
        self, fn: Callable[..., Any], args: Sequence[Any], *, reset: bool = True
    ) -> tuple[Callable[..., Any], Any, str]:
        """Compiles `fn` and makes its first call; returns the compiled
        function, its wrapper module and the module's source.  reset=False
        keeps what Dynamo compiled before (run_and_get_code would reset it,
        and a function compiled earlier would then be compiled again, on
        its next call, outside cpp_wrapper)."""
        compiled = torch.compile(fn)
        before = len(PyCodeCache.modules)
        sources: list[str] = []
        if reset:
            torch._dynamo.reset()
        with (
            config.patch(cpp_wrapper=True, fx_graph_cache=False),
            mock.patch.object(GraphLowering, "save_output_code", sources.append),
        ):
            compiled(*args)
        (source,) = sources
        self.assertIn("from torch_cppwrap._inductor.codecache import", source)
        (module,) = [m for m in PyCodeCache.modules[before:] if hasattr(m, "call")]
        return compiled, module._module, source

    def check_from_threads(
        self, call: Callable[[], torch.Tensor], expected: torch.Tensor, *, calls: int
    ) -> None:
        """Runs `call` `calls` times in each of two threads at once; every
        result must match `expected`, and no thread may raise."""
        results: list[torch.Tensor] = []
        errors: list[str] = []

        def worker() -> None:
            try:
                results.extend(call() for _ in range(calls))
            except Exception:
                errors.append(traceback.format_exc())

        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        torch.cuda.synchronize()
        self.assertFalse(errors, "\n".join(errors))
        self.assertEqual(len(results), 2 * calls)
        for out in results:
            self.assertEqual(out, expected, atol=1e-3, rtol=1e-3)

    def test_mlp_is_replayed_and_matches_eager(self) -> None:
        model = mlp(depth=4).cuda().eval()
        x = torch.randn(32, 256, device="cuda")
        with torch.no_grad():
            compiled, module, source = self.compile_module(model, (x,))
            self.assertIn("return new cppwrap::cuda::GraphReplays(", source)
            # The compile ran call 1; call 2 captures.
            self.assertEqual(module.cuda_graph_state(), "capture")
            outs = []
            for _ in range(4):
                x.copy_(torch.randn(32, 256, device="cuda"))
                outs.append((compiled(x), model(x)))
            self.assertEqual(module.cuda_graph_state(), "ready")
            self.assertEqual(
                module.cuda_graph_stats(),
                [
                    {
                        "state": "ready",
                        "replays": 3,
                        "missed": 0,
                        "recaptures": 0,
                        "declines": 0,
                    }
                ],
            )
            # Every call's result is its own: later replays did not overwrite it.
            for actual, expected in outs:
                self.assertEqual(actual, expected, atol=1e-3, rtol=1e-3)

    def test_input_at_a_new_address_each_call_is_copied_in(self) -> None:
        # Every input but a parameter or buffer is copied in, even one that
        # kept its address over the warm-up and the capture (an activation
        # saved for the backward may, for a few calls): no call misses.
        model = mlp(depth=3).cuda().eval()
        x = torch.randn(32, 256, device="cuda")
        with torch.no_grad():
            compiled, module, _ = self.compile_module(model, (x,))
            for step in range(6):
                if step >= 2:
                    x = torch.randn(32, 256, device="cuda")
                self.assertEqual(compiled(x), model(x), atol=1e-3, rtol=1e-3)
        (stats,) = module.cuda_graph_stats()
        self.assertEqual((stats["replays"], stats["missed"]), (5, 0))

    def test_input_that_is_not_dense_is_copied_in_whole(self) -> None:
        # A transposed slice, and an expanded row, at a new address each call
        # (as an activation saved for a backward can be): copied from the
        # first element to the last, gaps and all, into a buffer of the same
        # layout.
        w = torch.nn.Parameter(torch.randn(32, 32, device="cuda"), requires_grad=False)
        layouts: list[Callable[[], torch.Tensor]] = [
            lambda: torch.randn(64, 48, device="cuda")[4:36, 8:40].t(),
            lambda: torch.randn(32, device="cuda").expand(16, 32),
        ]
        for offset, make in enumerate(layouts):

            def fn(x, w, offset=offset):
                return torch.relu(x @ w) @ w + offset

            torch._dynamo.reset()
            with torch.no_grad():
                compiled, module, _ = self.compile_module(fn, (make(), w))
                for _ in range(5):
                    x = make()
                    self.assertEqual(compiled(x, w), fn(x, w), atol=1e-3, rtol=1e-3)
            (stats,) = module.cuda_graph_stats()
            self.assertEqual((stats["replays"], stats["missed"]), (4, 0), offset)

    def test_input_at_a_storage_offset_read_through_a_view(self) -> None:
        # The view's offset counts from the input's own storage offset, in
        # every call: the warm-up, the capture and the replays.
        # Two matmuls and a reduction: enough launches to be replayed.  The
        # first call runs kernel by kernel; the second captures and replays.
        def fn(x, y):
            return (x.t() @ y) @ y, x.t().contiguous().sum(0) * 1.2

        y = torch.randn(16, 16, device="cuda")
        with torch.no_grad():
            for step in range(5):
                x = torch.randn(17 * 16, device="cuda")[16:].view(16, 16)
                if step == 0:
                    compiled, module, _ = self.compile_module(fn, (x, y))
                self.assertEqual(compiled(x, y), fn(x, y), atol=1e-3, rtol=1e-3)
        (stats,) = module.cuda_graph_stats()
        self.assertEqual((stats["replays"], stats["missed"]), (4, 0), stats)

    def test_replaced_parameters_get_a_graph_of_their_own(self) -> None:
        def fn(x, w1, w2):
            return torch.relu(x @ w1) @ w2 + 1

        # Parameters: read where they are, so a replay needs them there.
        def param(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.Parameter(t, requires_grad=False)

        args = [
            torch.randn(16, 32, device="cuda"),
            param(torch.randn(32, 32, device="cuda")),
            param(torch.randn(32, 8, device="cuda")),
        ]
        # Every CUDA graph made, and how many were alive at each capture: new
        # parameters get a graph of their own, and the old one stays for when
        # the old parameters come back (a model's identical blocks, compiled
        # apart, share one module).  Both captures use one stream (cuBLAS
        # keeps a workspace for every stream it ran on).
        made: list[weakref.ref[torch.cuda.CUDAGraph]] = []
        alive_at_capture: list[int] = []
        capture_streams: list[int] = []

        class CountedGraph(torch.cuda.CUDAGraph):
            def __init__(self, *a: Any, **kw: Any) -> None:
                super().__init__(*a, **kw)
                made.append(weakref.ref(self))

            def capture_begin(self, *a: Any, **kw: Any) -> None:
                capture_streams.append(torch.cuda.current_stream().cuda_stream)
                super().capture_begin(*a, **kw)

        real_capture = cuda_graphs.capture

        def counting_capture(*a: Any) -> Any:
            alive_at_capture.append(sum(g() is not None for g in made))
            return real_capture(*a)

        with (
            mock.patch.object(torch.cuda, "CUDAGraph", CountedGraph),
            mock.patch.object(cuda_graphs, "capture", counting_capture),
        ):
            compiled, module, _ = self.compile_module(fn, args)
            old = args
            new = [args[0], param(args[1].clone()), param(args[2].clone() * 2)]
            # Calls 2-3 capture and replay the old; 4-6 warm up, capture and
            # replay the new; then the two take turns, each replayed.
            for args in [old] * 2 + [new] * 3 + [old, new] * 2:
                self.assertEqual(compiled(*args), fn(*args), atol=1e-3, rtol=1e-3)
        stats = module.cuda_graph_stats()
        self.assertEqual(
            [(s["state"], s["replays"], s["missed"], s["recaptures"]) for s in stats],
            [("ready", 3, 0, 0), ("ready", 3, 0, 0)],
        )
        self.assertEqual(alive_at_capture, [0, 1])
        self.assertEqual(len(made), 2)
        self.assertEqual(len(capture_streams), 2)
        self.assertEqual(capture_streams[0], capture_streams[1])

    def test_a_recapture_leaves_the_other_graphs_replaying(self) -> None:
        # pytorch/pytorch#193402: destroying a CUDA graph drops its capture
        # stream's cuBLAS workspaces (torch 2.12 on), and another graph
        # captured on that stream that still uses one faults on replay.  All
        # our graphs of a device share one capture stream, and a recapture
        # destroys the graph it replaces: at one graph per module, new
        # parameters that come twice in a row are captured again.
        def first(x, w1, w2):
            return torch.relu(x @ w1) @ w2 + 1

        def second(x, w):
            return torch.tanh(x @ w) @ w

        def param(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.Parameter(t, requires_grad=False)

        def cuda(*size: int) -> torch.Tensor:
            return torch.randn(*size, device="cuda")

        old = [cuda(16, 32), param(cuda(32, 32)), param(cuda(32, 8))]
        new = [old[0], param(old[1] * 2), param(old[2].clone())]
        other = [cuda(16, 32), param(cuda(32, 32))]
        made: list[weakref.ref[torch.cuda.CUDAGraph]] = []

        class CountedGraph(torch.cuda.CUDAGraph):
            def __init__(self, *a: Any, **kw: Any) -> None:
                super().__init__(*a, **kw)
                made.append(weakref.ref(self))

        with (
            mock.patch.object(torch.cuda, "CUDAGraph", CountedGraph),
            mock.patch.object(CppWrapperGpu, "max_cuda_graphs", 1),
            torch.no_grad(),
        ):
            # Each compiled, captured and replayed before the other is called.
            run_first, module, _ = self.compile_module(first, old)
            for _ in range(3):
                run_first(*old)
            run_second, other_module, _ = self.compile_module(
                second, other, reset=False
            )
            for _ in range(3):
                run_second(*other)
            for mod in module, other_module:
                (stats,) = mod.cuda_graph_stats()
                self.assertEqual(stats["state"], "ready", stats)
            self.assertEqual(len(made), 2)
            # New parameters: two calls kernel by kernel, a recapture (the
            # first graph goes), a replay; the other graph replays after it.
            for _ in range(4):
                self.assertEqual(run_first(*new), first(*new), atol=1e-3, rtol=1e-3)
            for _ in range(3):
                self.assertEqual(
                    run_second(*other), second(*other), atol=1e-3, rtol=1e-3
                )
            torch.cuda.synchronize()
        self.assertEqual([g() is not None for g in made], [False, True, True])
        (stats,) = module.cuda_graph_stats()
        self.assertEqual((stats["state"], stats["recaptures"]), ("ready", 1), stats)
        (stats,) = other_module.cuda_graph_stats()
        self.assertEqual((stats["state"], stats["replays"]), ("ready", 5), stats)

    def test_graphs_frozen_with_other_weights_replay_their_own(self) -> None:
        # Under freezing the weights are constants: two models of one shape
        # make the same source, one library, loaded as two modules; each
        # binds its constants and captures its own replays, which read them
        # (cppwrap::ModuleState).
        # Four launches (two matmuls, two bias-and-relu kernels): a graph
        # of fewer is not worth capturing (min_launches_for_cuda_graph).
        def model() -> torch.nn.Module:
            layers = [torch.nn.Linear(32, 32), torch.nn.ReLU()] * 2
            return torch.nn.Sequential(*layers).cuda().eval()

        models = [model() for _ in range(2)]
        x = torch.randn(8, 32, device="cuda")
        # One config per pointwise kernel.  Once in two device runs the two
        # compiles built two libraries, presumably because each tuned the
        # pointwise kernels itself and noisy timings picked other configs.
        options = {"freezing": True, "triton.autotune_pointwise": False}
        with config.patch(options), torch.no_grad():
            compiled, modules = [], []
            for model in models:
                # reset=False: a reset would have Dynamo compile the first
                # model again on its next call, into a graph of its own.
                run, module, _ = self.compile_module(model, (x,), reset=False)
                for _ in range(3):
                    self.assertEqual(run(x), model(x), atol=1e-3, rtol=1e-3)
                compiled.append(run)
                modules.append(module)
            # One library (the sources differ only in their graph's id
            # comment), two modules.
            directories = {m.__cppwrap_source_dir__ for m in modules}
            self.assertEqual(len(directories), 1)
            self.assertIsNot(modules[0], modules[1])
            # Called in turn, each replays with its own weights.
            for _ in range(2):
                for run, model in zip(compiled, models, strict=True):
                    self.assertEqual(run(x), model(x), atol=1e-3, rtol=1e-3)
        for module in modules:
            (stats,) = module.cuda_graph_stats()
            self.assertEqual(stats["state"], "ready", stats)
            self.assertGreaterEqual(stats["replays"], 3, stats)

    def test_capture_runs_the_kernels_in_cpp_at_each_yield(self) -> None:
        # The capture coroutine never calls into the module: C++ runs the
        # kernels on what it yields and sends back their outputs, and throws
        # a failed run in.  Two stand-ins that give up instead of capturing.
        x, w = torch.randn(16, 32, device="cuda"), torch.randn(32, 32, device="cuda")
        sent: list[Any] = []
        thrown: list[BaseException] = []

        def sends_back(
            args: list[Any], first_ptrs: list[int], draws: bool, owner: int
        ) -> Any:
            self.assertEqual(len(first_ptrs), len(args))
            self.assertFalse(draws)
            sent.append((yield list(args)))
            return None

        def fails(
            args: list[Any], first_ptrs: list[int], draws: bool, owner: int
        ) -> Any:
            try:
                yield [None, *args[1:]]
            except Exception as e:
                thrown.append(e)
            return None

        # A graph of its own for each (the module, and its replay state,
        # would otherwise be the one loaded for the first).
        for offset, stand_in in enumerate((sends_back, fails), start=1):

            def fn(x, w, offset=offset):
                return torch.relu(x @ w) @ w + offset

            expected = fn(x, w)
            with mock.patch.object(cuda_graphs, "capture", stand_in):
                compiled, module, _ = self.compile_module(fn, (x, w))
                self.assertFalse(hasattr(module, "call_eager"))
                self.assertEqual(module.cuda_graph_state(), "capture")
                self.assertEqual(compiled(x, w), expected, atol=1e-3, rtol=1e-3)
                self.assertEqual(module.cuda_graph_state(), "off")
                self.assertEqual(compiled(x, w), expected, atol=1e-3, rtol=1e-3)
            if stand_in is sends_back:
                ((out,),) = sent
                self.assertEqual(out, expected, atol=1e-3, rtol=1e-3)
        (error,) = thrown
        self.assertIsInstance(error, TypeError)
        self.assertIn("expected a Tensor", str(error))

    def test_a_call_declined_for_its_inputs_warms_up_a_later_one(self) -> None:
        # warm_up returns False for a call whose inputs are not to be captured
        # (a CPU tensor where the graph was traced with a CUDA one): the call
        # runs kernel by kernel and a later one warms up, up to 8 calls.
        x, w = torch.randn(16, 32, device="cuda"), torch.randn(32, 32, device="cuda")
        real_warm_up = cuda_graphs.warm_up
        for offset, declines, states in (
            (1, 2, ["warmup"] * 2),
            (2, 99, ["warmup"] * 7),
        ):

            def fn(x, w, offset=offset):
                return torch.relu(x @ w) @ w + offset

            left = declines

            def declining(args: list[Any]) -> Any:
                nonlocal left
                if left > 0:
                    left -= 1
                    return False
                return (yield from real_warm_up(args))

            seen = []
            with mock.patch.object(cuda_graphs, "warm_up", declining):
                compiled, module, _ = self.compile_module(fn, (x, w))
                for _ in range(9):
                    seen.append(module.cuda_graph_state())
                    self.assertEqual(compiled(x, w), fn(x, w), atol=1e-3, rtol=1e-3)
            after = ["capture", "ready"] if declines < 8 else ["off"]
            self.assertEqual(seen[: len(states) + 1], [*states, after[0]])
            self.assertEqual(seen[-1], after[-1])

    def test_other_stream_and_threads(self) -> None:
        def fn(x, w):
            return torch.relu(x @ w) @ w + 1

        x, w = torch.randn(16, 32, device="cuda"), torch.randn(32, 32, device="cuda")
        expected = fn(x, w)
        compiled, module, _ = self.compile_module(fn, (x, w))
        for _ in range(3):
            compiled(x, w)
        self.assertEqual(module.cuda_graph_state(), "ready")
        # Another stream: launched kernel by kernel there, still right.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = compiled(x, w)
        torch.cuda.current_stream().wait_stream(side)
        self.assertEqual(out, expected, atol=1e-3, rtol=1e-3)
        # Two threads replaying the module's graph at once (the C++ entry
        # point itself, so that only the replay is shared).
        self.check_from_threads(lambda: module.call([x, w])[0], expected, calls=50)
        self.assertEqual(module.cuda_graph_state(), "ready")

    def test_compiled_model_called_from_threads(self) -> None:
        model = mlp(depth=2).cuda().eval()
        x = torch.randn(32, 256, device="cuda")
        with torch.no_grad():
            compiled, module, _ = self.compile_module(model, (x,))
            expected = model(x)

        def call() -> torch.Tensor:
            with torch.no_grad():  # grad mode is per thread
                return compiled(x)

        self.check_from_threads(call, expected, calls=20)
        self.assertEqual(module.cuda_graph_state(), "ready")

    def test_switched_off_by_the_environment(self) -> None:
        model = mlp(depth=2).cuda().eval()
        x = torch.randn(32, 256, device="cuda")
        counters.clear()
        with (
            torch.no_grad(),
            mock.patch.dict("os.environ", {"TORCH_CPPWRAP_CUDA_GRAPHS": "0"}),
            self.assertLogs(cuda_graphs.perf_hint_log, "INFO") as logs,
        ):
            compiled, module, _ = self.compile_module(model, (x,))
            for _ in range(3):
                self.assertEqual(compiled(x), model(x), atol=1e-3, rtol=1e-3)
            self.assertEqual(module.cuda_graph_state(), "off")
        # Said once, and counted.
        self.assertEqual(counters["inductor"]["cppwrap_cuda_graph_runtime_skips"], 1)
        (said,) = logs.output
        self.assertIn("TORCH_CPPWRAP_CUDA_GRAPHS is off", said)

    def test_buffers_skip_the_dispatcher(self) -> None:
        # Kernel by kernel, the wrapper's CUDA buffers come from the caching
        # allocator directly, as the Python wrapper's empty_strided_cuda
        # makes them; with deterministic algorithms filling new memory, from
        # ATen's operator, which fills them.
        model = mlp(depth=2).cuda().eval()
        x = torch.randn(32, 256, device="cuda")

        def empty_strided_ops() -> int:
            compiled(x)  # compiles again if Dynamo's guards ask for it
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]
            ) as prof:
                self.assertEqual(compiled(x), expected, atol=1e-3, rtol=1e-3)
            return sum(
                e.count for e in prof.key_averages() if e.key == "aten::empty_strided"
            )

        deterministic = torch.are_deterministic_algorithms_enabled()
        with (
            torch.no_grad(),
            mock.patch.dict("os.environ", {"TORCH_CPPWRAP_CUDA_GRAPHS": "0"}),
            config.patch(cpp_wrapper=True, fx_graph_cache=False),
        ):
            expected = model(x)
            compiled, module, _ = self.compile_module(model, (x,))
            self.assertEqual(empty_strided_ops(), 0)
            self.assertEqual(module.cuda_graph_state(), "off")
            torch.use_deterministic_algorithms(True, warn_only=True)
            try:
                self.assertGreater(empty_strided_ops(), 0)
            finally:
                torch.use_deterministic_algorithms(deterministic)

    def test_graphs_share_one_memory_pool_and_keep_their_results(self) -> None:
        # Two models of one architecture: one graph (one module) on two sets
        # of parameters, each captured apart, their replays interleaved.
        # Their intermediates share the pool's memory: neither may overwrite
        # what the other returned.
        first = mlp(depth=3).cuda().eval()
        second = copy.deepcopy(first)  # the same classes: no recompile
        for p in second.parameters():
            torch.nn.init.normal_(p, std=0.05)
        x = torch.randn(32, 256, device="cuda")
        before = len(PyCodeCache.modules)
        outs = []
        with torch.no_grad(), config.patch(cpp_wrapper=True, fx_graph_cache=False):
            run_first, run_second = torch.compile(first), torch.compile(second)
            for _ in range(5):  # warm-up, capture, 3 replays
                x.copy_(torch.randn(32, 256, device="cuda"))
                outs.append((run_first(x), first(x), run_second(x), second(x)))
        for actual, expected, actual2, expected2 in outs:
            self.assertEqual(actual, expected, atol=1e-3, rtol=1e-3)
            self.assertEqual(actual2, expected2, atol=1e-3, rtol=1e-3)
        # Graphs of the same code share one module (the code cache loads it
        # once), which keeps a graph for each set of parameters.
        (module,) = {
            id(m._module): m._module
            for m in PyCodeCache.modules[before:]
            if hasattr(m, "call")
        }.values()
        self.assertEqual(
            [
                (s["state"], s["replays"], s["missed"])
                for s in module.cuda_graph_stats()
            ],
            [("ready", 3, 0)] * 2,
        )
        stream = torch.cuda.current_stream().cuda_stream
        self.assertIn((x.device.index, stream), cuda_graphs._pools)

    def test_outputs_are_lent_and_keep_their_values_when_held(self) -> None:
        # A replay hands out its outputs in the graph's pool, on storages of
        # their own; the next replay moves the ones still held out of the
        # pool before writing there.  An output fed back as the next call's
        # input (a recurrent state) is copied in, never read in place.
        from torch_cppwrap._inductor import codecache

        def step(h, w):
            for _ in range(3):  # enough launches to be replayed
                h = torch.tanh(h @ w) + h * 0.5
            return h

        h = torch.randn(16, 64, device="cuda")
        w = torch.randn(64, 64, device="cuda") / 8
        runtime = codecache.RuntimeExtension.load()
        with torch.no_grad():
            compiled, module, _ = self.compile_module(step, (h, w))
            states, expected = [h], [h]
            for _ in range(6):
                states.append(compiled(states[-1], w))
                expected.append(step(expected[-1], w))
            self.assertEqual(module.cuda_graph_state(), "ready")
            self.assertNotEqual(runtime.pool_lender(states[-1]), 0)
            self.assertEqual(runtime.pool_lender(states[-2]), 0)  # moved out
        (stats,) = module.cuda_graph_stats()
        # The first call warmed up (compile_module), the second captured.
        self.assertEqual((stats["replays"], stats["missed"]), (5, 0), stats)
        for actual, wanted in zip(states, expected, strict=True):
            self.assertEqual(actual, wanted, atol=1e-4, rtol=1e-4)

    def test_the_first_two_calls_lend_their_outputs_too(self) -> None:
        # The warm-up and the capture hand out their outputs on the pool's
        # memory, as replays do, not copies in the default pool.  A held
        # warm-up output may lie in the scratch memory of a graph captured
        # before it (two graphs of one shape here): that graph's replays move
        # it out first, so it keeps its values.
        from torch_cppwrap._inductor import codecache

        first, second = mlp(depth=3).cuda().eval(), mlp(depth=3).cuda().eval()
        x = torch.randn(32, 256, device="cuda")
        runtime = codecache.RuntimeExtension.load()

        def in_pool(t: torch.Tensor) -> bool:
            pool = cuda_graphs._pools[
                (x.device.index, torch.cuda.current_stream().cuda_stream)
            ]
            return any(
                s["address"] <= t.data_ptr() < s["address"] + s["total_size"]
                for s in torch.cuda.memory_snapshot()
                if tuple(s["segment_pool_id"]) == tuple(pool.id)
            )

        with torch.no_grad():
            run_first, first_module, _ = self.compile_module(first, (x,))
            run_first(x)
            self.assertEqual(first_module.cuda_graph_state(), "ready")
            compiled = torch.compile(second)
            with config.patch(cpp_wrapper=True, fx_graph_cache=False):
                warm = compiled(x)
            self.assertTrue(in_pool(warm))
            self.assertEqual(runtime.pool_lender(warm), 0)  # no graph's
            captured = compiled(x)
            self.assertTrue(in_pool(captured))
            self.assertNotEqual(runtime.pool_lender(captured), 0)
            for _ in range(3):
                self.assertEqual(run_first(x), first(x), atol=1e-3, rtol=1e-3)
            expected = second(x)
        torch.cuda.synchronize()
        self.assertEqual(warm, expected, atol=1e-3, rtol=1e-3)
        self.assertEqual(captured, expected, atol=1e-3, rtol=1e-3)

    def test_capture_reuses_the_warm_up_memory(self) -> None:
        # The first call (the warm-up) runs in the graphs' memory pool, so
        # the second call's capture takes its intermediates from memory
        # already reserved, and the pool grows by next to nothing more.  A
        # first call in the default pool would have left its intermediates
        # cached there and the capture would have reserved as much again in
        # the pool (and more for its own warm-up run outside it).  What the
        # default pool reserves is not counted: the capture copies the
        # inputs (not parameters) into buffers there, which every replay
        # reads, as reduce-overhead copies them into its pool.
        n = 2048
        intermediate = n * n * 4  # bytes of each float32 n x n buffer

        def fn(x, w):
            y = torch.relu(x @ w)
            z = torch.sin(y @ w)
            return (torch.cos(z @ w) + z).sum(0)

        x = torch.randn(n, n, device="cuda")
        w = torch.randn(n, n, device="cuda") / n**0.5
        with torch.no_grad():
            compiled, module, _ = self.compile_module(fn, (x, w))
            self.assertEqual(module.cuda_graph_state(), "capture")
            torch.cuda.synchronize()
            # A graph's pool is never given back while the graph lives: what
            # it reserves at the end is the most it reserved.
            before = pool_bytes("total_size")
            for _ in range(3):
                out = compiled(x, w)
            torch.cuda.synchronize()
            rise = pool_bytes("total_size") - before
            self.assertEqual(module.cuda_graph_state(), "ready")
            self.assertEqual(out, fn(x, w), atol=1e-2, rtol=1e-2)
        self.assertLess(rise, intermediate, f"reserved {rise / 2**20:.0f} MiB more")

    def test_cublas_workspace_is_scratch_of_the_pool(self) -> None:
        # cuBLAS keeps a workspace for each stream a matmul ran on (32 MiB on
        # Hopper).  The capture stream's is made in the graphs' pool by the
        # warm-up and the capture, and where torch can drop one stream's
        # (2.12 on), dropped after each: once the graph is replayed, nothing
        # of this graph but its output stays allocated in the pool.  Torch
        # 2.11 keeps it allocated there, one workspace and no more.
        def fn(x, w):
            return torch.relu(x @ w) @ w

        x = torch.randn(64, 64, device="cuda")
        w = torch.randn(64, 64, device="cuda")
        # No workspace left from an earlier test: this graph's warm-up makes one.
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.synchronize()
        before = pool_bytes("allocated_size")
        with torch.no_grad():
            compiled, module, source = self.compile_module(fn, (x, w))
            self.assertIn("aoti_torch_cuda_mm_out", source)
            for _ in range(3):
                out = compiled(x, w)
            self.assertEqual(module.cuda_graph_state(), "ready")
            self.assertEqual(out, fn(x, w), atol=1e-2, rtol=1e-2)
            del out
        torch.cuda.synchronize()
        rise = pool_bytes("allocated_size") - before
        # What torch 2.11 keeps: cuBLAS's workspace, 32 MiB at most (Hopper's).
        drops = codecache.RuntimeExtension.load().DROPS_CUBLAS_WORKSPACES
        workspaces = 0 if drops else 32 * 2**20
        self.assertLess(
            rise, workspaces + 2**20, f"{rise / 2**20:.1f} MiB left in the pool"
        )

    def test_other_streams_cublas_workspaces_are_left_alone(self) -> None:
        # Another thread's matmul may have been handed its stream's workspace
        # and not yet launched: a warm-up or a capture that dropped every
        # stream's would free it under that matmul (an illegal address once
        # the cache is emptied).  Only the capture stream's are dropped.
        def fn(x, w):
            return torch.relu(x @ w) @ w

        x = torch.randn(64, 64, device="cuda")
        w = torch.randn(64, 64, device="cuda")
        runtime = codecache.RuntimeExtension.load()
        with (
            mock.patch.object(
                torch._C,
                "_cuda_clearCublasWorkspaces",
                side_effect=AssertionError("every stream's workspaces dropped"),
            ),
            mock.patch.object(
                runtime,
                "drop_cublas_workspaces",
                wraps=runtime.drop_cublas_workspaces,
            ) as drop,
            torch.no_grad(),
        ):
            compiled, module, _ = self.compile_module(fn, (x, w))
            for _ in range(3):
                out = compiled(x, w)
        self.assertEqual(module.cuda_graph_state(), "ready")
        self.assertEqual(out, fn(x, w), atol=1e-2, rtol=1e-2)
        dropped = [c.args[0] for c in drop.call_args_list]
        # Before and after the warm-up, and the capture: the capture stream's.
        self.assertEqual(len(dropped), 4)
        self.assertEqual(
            set(dropped), {cuda_graphs._capture_stream(x.device).cuda_stream}
        )

    def test_warm_up_releases_what_the_default_pool_caches(self) -> None:
        # Memory an eager run left cached in the default pool (here a 64 MiB
        # buffer, freed) is given back before the warm-up fills the graphs'
        # pool, so that the process never holds both; released only at the
        # capture (torch.cuda.graph empties the cache), the first call's
        # peak would hold the cached buffer and the warm-up's intermediates
        # at once.
        def cached_in_default_pool() -> int:
            return pool_bytes("total_size", default_pool=True) - pool_bytes(
                "allocated_size", default_pool=True
            )

        def fn(x, w):
            return torch.relu(x @ w) @ w + 1

        x, w = (torch.randn(256, 256, device="cuda") for _ in range(2))
        expected = fn(x, w)
        cached = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        del cached
        self.assertGreaterEqual(cached_in_default_pool(), 64 * 2**20)
        with torch.no_grad():
            # Compiles, and makes the first call: the warm-up.
            compiled, module, _ = self.compile_module(fn, (x, w))
            self.assertEqual(module.cuda_graph_state(), "capture")
            left = cached_in_default_pool()
            out = compiled(x, w)
        self.assertEqual(module.cuda_graph_state(), "ready")
        self.assertEqual(out, expected, atol=1e-2, rtol=1e-2)
        self.assertLess(left, 64 * 2**20, f"{left / 2**20:.0f} MiB left cached")

    def test_replays_on_one_thread_while_another_warms_up(self) -> None:
        # A warm-up runs eagerly in the memory pool where a replayed graph's
        # scratch memory lies free between replays.  While one holds the
        # pool, the other thread's calls run kernel by kernel, and are not
        # taken for calls whose inputs moved (which would have the graph
        # captured again).
        def fn(x, w):
            return torch.relu(x @ w) @ w + 1

        x, w = (torch.randn(256, 256, device="cuda") for _ in range(2))
        expected = fn(x, w)
        compiled, module, _ = self.compile_module(fn, (x, w))
        for _ in range(2):
            compiled(x, w)
        self.assertEqual(module.cuda_graph_state(), "ready")
        captured: list[int] = []
        real_capture = cuda_graphs.capture

        def counting_capture(*args: Any) -> Any:
            captured.append(len(args[0]))
            return real_capture(*args)

        # Three graphs of their own (three functions, not one recompiled),
        # each warmed up and captured while fn replays on the other thread.
        def g1(x, w):
            return torch.sin(x @ w).relu() @ w + 1

        def g2(x, w):
            return torch.cos(x @ w).relu() @ w + 2

        def g3(x, w):
            return torch.tanh(x @ w).relu() @ w + 3

        stop = threading.Event()
        replays = 0
        # Each result's distance from eager's, beyond the tolerance, kept on
        # the GPU: holding the results would have each replay copy its lent
        # output out of the pool, and thousands of them fill the GPU while
        # the other thread compiles.
        excess = torch.zeros((), device="cuda")
        tolerance = 1e-3 + 1e-3 * expected.abs()

        def replay_until_stopped() -> None:
            nonlocal replays, excess
            while not stop.is_set():
                result = module.call([x, w])[0]
                excess = torch.maximum(
                    excess, ((result - expected).abs() - tolerance).max()
                )
                replays += 1

        replayer = threading.Thread(target=replay_until_stopped)
        with mock.patch.object(cuda_graphs, "capture", counting_capture):
            replayer.start()
            try:
                for g in (g1, g2, g3):
                    compiled_g = torch.compile(g)
                    with config.patch(cpp_wrapper=True, fx_graph_cache=False):
                        for _ in range(3):  # warm-up, capture, replay
                            self.assertEqual(
                                compiled_g(x, w), g(x, w), atol=1e-3, rtol=1e-3
                            )
            finally:
                stop.set()
                replayer.join()
        torch.cuda.synchronize()
        self.assertGreater(replays, 0)
        self.assertLessEqual(excess.item(), 0.0)
        self.assertEqual(module.cuda_graph_state(), "ready")
        self.assertEqual(len(captured), 3)  # the new graphs', none of fn's

    def test_dynamic_shapes_are_replayed_once_per_size(self) -> None:
        # A graph compiled for dynamic shapes is captured once per size its
        # inputs come in (warm-up, capture, then replays), up to a bound;
        # sizes beyond it run kernel by kernel.
        def fn(x, w):
            return torch.relu(x @ w).sin() @ w + x.sum(0)

        w = torch.randn(64, 64, device="cuda")
        compiled = torch.compile(fn, dynamic=True)
        before = len(PyCodeCache.modules)
        bound = CppWrapperGpu.max_cuda_graphs
        with torch.no_grad(), config.patch(cpp_wrapper=True, fx_graph_cache=False):
            for rows in (8, 16, 8, 16, 8, 16, 24, 24, 24):
                x = torch.randn(rows, 64, device="cuda")
                self.assertEqual(compiled(x, w), fn(x, w), atol=1e-3, rtol=1e-3)
            (module,) = [m for m in PyCodeCache.modules[before:] if hasattr(m, "call")]
            self.assertIn("One graph per set of sizes of inputs [", module.wrapper_src)
            states = module._module.cuda_graph_states
            self.assertEqual(states(), ["ready"] * 3)
            for rows in range(32, 32 + bound):  # one size more than the bound
                x = torch.randn(rows, 64, device="cuda")
                for _ in range(3):
                    self.assertEqual(compiled(x, w), fn(x, w), atol=1e-3, rtol=1e-3)
            self.assertEqual(states(), ["ready"] * bound)

    def test_attention_without_dropout_is_replayed(self) -> None:
        def attend(q, k, v):
            return F.scaled_dot_product_attention(q.relu(), k * 2, v + 1).sin()

        # float16 takes flash attention, float32 the memory-efficient kernel:
        # both are tagged as seeded (for their dropout) but draw nothing here.
        for dtype, tol in ((torch.float16, 2e-2), (torch.float32, 1e-3)):
            torch._dynamo.reset()
            q, k, v = (
                torch.randn(2, 4, 128, 64, device="cuda", dtype=dtype) for _ in range(3)
            )
            with torch.no_grad():
                compiled, module, source = self.compile_module(attend, (q, k, v))
                self.assertIn("cuda_graph_blocker = None", source)
                for _ in range(3):
                    q.copy_(torch.randn_like(q))
                    out = compiled(q, k, v)
                self.assertEqual(module.cuda_graph_state(), "ready")
                self.assertEqual(out, attend(q, k, v), atol=tol, rtol=tol)

    def test_random_draws_replay_as_kernels_run_one_by_one_draw(self) -> None:
        # Dropout in attention (the op draws) and outside it (Inductor's own
        # random kernels): each replay advances the CUDA generator, so from
        # one seed the calls return what the Python wrapper's return, and
        # every replay a new mask.
        def fn(q, k, v):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
            return F.dropout(out.relu(), 0.3, training=True) * 2

        q, k, v = (torch.randn(2, 4, 128, 64, device="cuda") for _ in range(3))
        with torch.no_grad():
            compiled, module, source = self.compile_module(fn, (q, k, v))
            self.assertIn("cuda_graph_blocker = None", source)
            self.assertIn("/*draws_random=*/true);", source)
            torch.manual_seed(0)
            ours = [compiled(q, k, v) for _ in range(4)]  # capture, 3 replays
            self.assertEqual(module.cuda_graph_state(), "ready")
            torch._dynamo.reset()
            python = torch.compile(fn)
            with config.patch(cpp_wrapper=False, fx_graph_cache=False):
                python(q, k, v)  # compiles (autotuning draws too)
                torch.manual_seed(0)
                theirs = [python(q, k, v) for _ in range(4)]
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            self.assertEqual(a, b, atol=1e-4, rtol=1e-4, msg=f"call {step}")
        self.assertNotEqual((ours[2] == 0).sum(), 0)
        self.assertFalse(torch.equal(ours[2] == 0, ours[3] == 0))

    def test_training_step_is_replayed(self) -> None:
        # Its forward graph draws (dropout, attention's dropout) and returns
        # parameters and views of one buffer for the backward, which gets
        # attention's RNG state: CPU tensors until the forward replays.
        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inp = torch.nn.Linear(64, 64)
                self.out = torch.nn.Linear(64, 64)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = F.dropout(F.gelu(self.inp(x)), 0.1, self.training)
                q = h.view(2, 32, 4, 16).transpose(1, 2)
                a = F.scaled_dot_product_attention(q, q * 2, q, dropout_p=0.1)
                return self.out(a.transpose(1, 2).reshape(2, 32, 64))

        torch.manual_seed(0)
        model = Net().cuda().train()
        reference = copy.deepcopy(model)
        x = torch.randn(2, 32, 64, device="cuda")

        def steps(net: torch.nn.Module, n: int) -> list[list[torch.Tensor]]:
            compiled = torch.compile(net)
            results = []
            for i in range(n + 1):
                if i == 1:  # after the step that compiled
                    torch.manual_seed(1)
                loss = compiled(x).square().mean()
                loss.backward()
                results.append([loss.detach()] + [p.grad for p in net.parameters()])
                net.zero_grad(set_to_none=True)
            return results[1:]

        before = len(PyCodeCache.modules)
        with our_wrappers_created() as created:
            ours = steps(model, 7)
        modules = [m for m in PyCodeCache.modules[before:] if hasattr(m, "call")]
        self.assertEqual(len(created), 2)  # forward and backward
        self.assertEqual(len(modules), 2)
        forward, backward = sorted(
            (m._module.cuda_graph_stats()[0] for m in modules),
            key=lambda stats: stats["declines"],
        )
        for module in modules:
            self.assertIsNone(module.cuda_graph_blocker)
        # The forward: warm-up, capture, 6 replays, lending its outputs.  The
        # backward's first call declined (CPU RNG state); then warm-up, a
        # capture on the first lent activations, read where the forward lent
        # them, and 5 replays.  Each step's loss and gradients are held
        # (`results`), so each replay moves the last one's out of the pool.
        self.assertEqual(forward["state"], "ready", forward)
        self.assertEqual((forward["replays"], forward["recaptures"]), (6, 0), forward)
        self.assertEqual(backward["state"], "ready", backward)
        self.assertEqual(
            (backward["replays"], backward["recaptures"], backward["declines"]),
            (5, 0, 1),
            backward,
        )
        for stats in (forward, backward):
            self.assertEqual(stats["missed"], 0, stats)
        torch._dynamo.reset()
        with config.patch(cpp_wrapper=False, fx_graph_cache=False):
            theirs = steps(reference, 7)
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            self.assertEqual(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")

    def test_recomputed_random_ops_replay_their_rng_state(self) -> None:
        # As on the CPU, with the CUDA generator's state (kernel by kernel:
        # a generator's state is set on the host).
        self.check_recomputed_random_ops("cuda")

    def test_training_attention_with_dropout(self) -> None:
        # Its backward graph gets the forward's RNG state (philox seed and
        # offset): 0-d CPU tensors where the graph was traced with CUDA ones.
        # The gradients must be the Python wrapper's from the same seed.
        def loss(q, k, v):
            out = F.scaled_dot_product_attention(q, k * 2, v, dropout_p=0.1)
            return (out * out).sum()

        torch.manual_seed(0)
        inputs = [torch.randn(2, 4, 128, 64, device="cuda") for _ in range(3)]

        def grads(n: int) -> list[list[torch.Tensor]]:
            compiled = torch.compile(loss)
            results = []
            for i in range(n + 1):
                if i == 1:  # after the step that compiled
                    torch.manual_seed(1)
                q, k, v = (t.clone().requires_grad_() for t in inputs)
                compiled(q, k, v).backward()
                results.append([q.grad, k.grad, v.grad])
            return results[1:]

        with (
            config.patch(cpp_wrapper=True, fx_graph_cache=False),
            our_wrappers_created() as created,
        ):
            ours = grads(3)
        self.assertGreaterEqual(len(created), 2)  # forward and backward
        torch._dynamo.reset()
        with config.patch(cpp_wrapper=False, fx_graph_cache=False):
            theirs = grads(3)
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            self.assertEqual(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        # Each step drew its own dropout mask.
        self.assertFalse(torch.equal(ours[0][0], ours[1][0]))

    def test_graphs_that_cannot_be_replayed_launch_kernel_by_kernel(self) -> None:
        def mutates(x, y):
            x.add_(1)
            return (x @ y).relu() + y.sum()

        args = (torch.randn(8, 8, device="cuda"), torch.randn(8, 8, device="cuda"))
        counters.clear()
        (source,) = self.check(mutates, args, atol=1e-3, rtol=1e-3)
        self.assertEqual(counters["inductor"]["cppwrap_cuda_graph_skips"], 1)
        self.assertNotIn("GraphReplay", source)
        self.assertIn("cuda_graph_blocker = 'the graph mutates an input'", source)

    def test_compiled_autograd_hook_input_runs_kernel_by_kernel(self) -> None:
        # A hook registered inside the region gives the forward a
        # BackwardState input: an unused slot, which no replay can copy in.
        def build() -> torch.nn.Module:
            torch.manual_seed(0)
            return torch.nn.Sequential(
                torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)
            ).cuda()

        def step(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
            y = model(x)
            y.register_hook(lambda g: g * 3)
            y.square().sum().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            return grads

        model, reference = build(), build()
        x = torch.randn(16, 32, device="cuda")
        sources: list[str] = []
        with (
            torch._dynamo.config.patch(compiled_autograd=True),
            our_wrappers_created() as created,
            mock.patch.object(GraphLowering, "save_output_code", sources.append),
        ):
            compiled = torch.compile(functools.partial(step, model))
            ours = [compiled(x) for _ in range(3)]
        self.assertGreaterEqual(len(created), 2)
        self.assertRegex(
            "\n".join(sources), r"cuda_graph_blocker = 'input \w+ is not a tensor'"
        )
        expected = step(reference, x)
        for grads in ours:
            self.assertEqual(grads, expected, atol=1e-4, rtol=1e-4)


class TestDevices(CudaWrapperTestCase):
    def test_input_on_another_device_raises_naming_it(self) -> None:
        # A CPU tensor would reach a Triton kernel as a host pointer: an
        # illegal address, which poisons the CUDA context, so the calls run in
        # a child process.
        def fn(x, y):
            return x * y + 1

        args = (torch.randn(8, 8, device="cuda"), torch.randn(8, 8, device="cuda"))
        before = len(PyCodeCache.modules)
        self.check(fn, args)
        (module,) = [m for m in PyCodeCache.modules[before:] if hasattr(m, "call")]
        child = textwrap.dedent(
            """
            import importlib.util, sys
            import torch, torch_cppwrap
            spec = importlib.util.spec_from_file_location("graph", sys.argv[1])
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            y = torch.randn(8, 8, device="cuda")
            for label, x in (("cpu", torch.randn(8, 8)), ("meta", y.to("meta"))):
                try:
                    module.call([x, y])
                    print(label, "no error")
                except Exception as e:
                    print(label, type(e).__name__, str(e).splitlines()[0])
            (out,) = module.call([y, y])
            torch.cuda.synchronize()
            print("cuda", bool(torch.allclose(out, y * y + 1)))
            """
        )
        proc = subprocess.run(
            [sys.executable, "-c", child, module.__file__],
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        for label in ("cpu", "meta"):
            self.assertIn(
                f"{label} RuntimeError input arg0_1: expected a tensor on cuda:0 but "
                f"got one on {label}",
                proc.stdout,
            )
        self.assertIn("cuda True", proc.stdout)

    def test_cpu_and_cuda_in_one_graph(self) -> None:
        def fn(x, y):
            return (x.cuda() + y).relu(), (y.cpu() * 2)

        self.check(fn, (torch.randn(64), torch.randn(64, device="cuda")))

    @unittest.skipUnless(HAS_MULTI_GPU, "needs two CUDA devices")
    def test_second_device(self) -> None:
        def fn(x, y):
            return (x @ y).relu() + x.sum()

        args = (
            torch.randn(32, 32, device="cuda:1"),
            torch.randn(32, 32, device="cuda:1"),
        )
        (source,) = self.check(fn, args, atol=1e-2, rtol=1e-2)
        self.assertIn("cppwrap::cuda::DeviceGuard device_guard(1);", source)
        with torch.cuda.device(0):
            out = torch.compile(fn)(*args)
        self.assertEqual(out.device, torch.device("cuda:1"))


if HAS_CUDA:
    import triton
    import triton.language as tl

    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask)
        y = tl.load(y_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, x + y, mask=mask)


class TestUserDefinedTriton(CudaWrapperTestCase):
    def test_user_defined_kernel(self) -> None:
        def fn(x, y):
            out = torch.empty_like(x)
            n = x.numel()
            add_kernel[(triton.cdiv(n, 128),)](x, y, out, n, BLOCK=128)
            return out * 2

        self.check(
            fn, (torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda"))
        )


@requires_cuda
class TestRegistration(TestCase):
    def test_patch_registers_cuda_and_unpatch_restores(self) -> None:
        from torch._inductor.codegen import common

        from torch_cppwrap import _patching

        torch_cppwrap.patch()
        entry = common.device_codegens["cuda"]
        self.assertIs(entry.cpp_wrapper_codegen, _patching.CudaCppWrapperSelector)
        original = _patching._registry_originals["cuda"][0]
        self.assertIs(entry.scheduling, original.scheduling)
        self.assertIs(
            _patching.CudaCppWrapperSelector.displaced, original.cpp_wrapper_codegen
        )
        torch_cppwrap.unpatch()
        try:
            self.assertIs(common.device_codegens["cuda"], original)
        finally:
            torch_cppwrap.patch()


if __name__ == "__main__":
    run_tests()
