"""Graphs upstream's C++ wrapper compiles, found failing with ours by running
PyTorch's own Inductor tests against the package, and the fallback to the
Python wrapper that keeps any remaining gap from failing a user's compile."""

from __future__ import annotations

import contextlib
import io
import unittest
from collections.abc import Callable
from unittest import mock

import torch
from torch._dynamo.utils import counters
from torch._inductor import config, cpu_vec_isa
from torch._inductor.exc import CppWrapperCodegenError
from torch._inductor.test_case import TestCase, run_tests
from torch._inductor.utils import fresh_cache

import torch_cppwrap
from tests.common import CppWrapperTestCase, checkpoint_recomputing_all
from torch_cppwrap._inductor.codecache import CppWrapperCompileError
from torch_cppwrap._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu


class TestUpstreamParity(CppWrapperTestCase):
    def test_floor_division_in_symbolic_sizes(self) -> None:
        # max_pool2d's output size is a floor division of symbolic sizes,
        # printed as c10::div_floor_integer.
        def fn(x):
            return torch.ops.aten.max_pool2d_with_indices(
                x, [13, 13], [], dilation=[1, 1]
            )

        (source,) = self.check(fn, (torch.randn(2, 4, 20, 20),), dynamic=True)
        self.assertIn("c10::div_floor_integer(", source)

    def test_two_compiles_differ_only_in_the_aot_id_line(self) -> None:
        # PyTorch's buffer-reuse tests compare the wrappers of two compiles of
        # one function, dropping upstream's "# AOT ID: ..." line: the graph's
        # name must be on that line and nowhere else.
        def fn(x):
            return (x - x.mean(-1)).pow(2).mean(-1)

        x = torch.randn(8, 8)
        (first,) = self.check(fn, (x,))
        torch._dynamo.reset()
        with config.patch(allow_buffer_reuse=not config.allow_buffer_reuse):
            (second,) = self.check(fn, (x,))
        aot_ids = [
            [line for line in source.splitlines() if line.startswith("# AOT ID: ")]
            for source in (first, second)
        ]
        self.assertEqual([len(ids) for ids in aot_ids], [1, 1])
        self.assertNotEqual(aot_ids[0], aot_ids[1])  # two graphs, two names
        self.assertEqual(
            [line for line in first.splitlines() if not line.startswith("# AOT ID")],
            [line for line in second.splitlines() if not line.startswith("# AOT ID")],
        )

    def test_symbolic_int_passed_for_a_tensor_argument(self) -> None:
        # Complex add with alpha lowers to aten.mul.Tensor(x, alpha): the
        # symbolic alpha becomes a 0-d tensor.
        x = torch.tensor([1 + 1j, -1 + 1j, -2 + 2j, 3 - 3j, 0, 1j, 1, -1])

        def fn(a, b, alpha):
            return torch.add(a, b, alpha=alpha)

        sources = self.check(fn, (x, x, 2), dynamic=True)
        self.assertTrue(
            any("cppwrap::scalar_to_tensor(int64_t(s" in s for s in sources)
        )

    def test_symbolic_scalar_among_extern_kernel_arguments(self) -> None:
        # OpInfo's first baddbmm sample with dynamic shapes: Inductor passes a
        # sympy expression among the out-variant's spelled arguments.
        # (Upstream's C++ wrapper fails on this graph.)
        def fn(a, b, c, beta, alpha):
            return torch.baddbmm(a, b, c, beta=beta, alpha=alpha)

        args = (
            torch.randn(5, 5, 10),
            torch.randn(5, 5, 5),
            torch.randn(5, 5, 10),
            1,
            1,
        )
        (source,) = self.check(fn, args, dynamic=True, atol=1e-5, rtol=1e-5)
        self.assertIn("aoti_torch_cpu_baddbmm_out(", source)

    @torch._dynamo.config.patch(
        capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True
    )
    def test_unbacked_symbols(self) -> None:
        # A data-dependent size (nonzero) binds u0 from the op's output; an
        # .item() binds it from a 0-d tensor.
        def from_shape(x):
            n = x.nonzero()
            return n.sum(), n.shape[0] * 2

        def from_item(x, y):
            u = y.item()
            torch._check_is_size(u)
            return torch.cat([x, x[:u]])

        (source,) = self.check(from_shape, (torch.tensor([0.0, 1, 0, 3, 4]),))
        self.assertRegex(source, r"int64_t u0 = buf\d+\.size\(0\);")
        (source,) = self.check(from_item, (torch.randn(6), torch.tensor(3)))
        self.assertRegex(source, r"int64_t u\d+ = cppwrap::item_long\(arg\d+_1\);")

    def test_complex_numbers_as_arguments(self) -> None:
        # A complex number for a Tensor argument becomes a 0-d complex tensor;
        # for a Scalar argument, which the C shim spells double, the op runs
        # through the dispatcher.
        x = torch.randn(4, dtype=torch.complex64)
        sources = self.check(lambda x: x * (2.0 + 1.0j), (x,))
        self.assertIn("cppwrap::scalar_to_tensor_complex(2.0, 1.0)", sources[0])
        (source,) = self.check(
            lambda: torch.full([2], 2.5 + 1.0j, dtype=torch.complex64) * 2, ()
        )
        self.assertIn(".complex(5.0, 2.0)", source)  # folded: (2.5 + 1j) * 2

    def test_output_and_a_view_of_it(self) -> None:
        # Found by the backward OpInfo sweep on torch 2.11: an output buffer
        # was moved out before a later output, a view of it, read it.
        def fn(x):
            values, indices = torch.mode(x, -1)
            return values, indices, indices.view(5, 5, 1)

        (source,) = self.check(fn, (torch.randn(5, 5, 5),))
        body = source[source.index("static PyObject* call_impl") :]
        view = body.index("= cppwrap::reinterpret_view(")
        self.assertLess(view, body.index("= std::move("))

    @unittest.skipUnless(
        torch.backends.mkldnn.is_available() and cpu_vec_isa.valid_vec_isa_list(),
        "Inductor's CPP GEMM templates need mkldnn and a vector ISA",
    )
    def test_constant_the_gemm_template_drops(self) -> None:
        # Found by PyTorch's test_cpu_cpp_wrapper (grouped linear epilogue,
        # torch 2.11): under freezing, the CPP GEMM template packs each weight
        # into a new constant and drops the original from the graph after the
        # wrapper listed it; Inductor sets only the graph's constants on the
        # module, and the module looked for all it had listed.
        linear0 = torch.nn.Linear(52, 32)
        linear1 = torch.nn.Linear(52, 32, bias=False)

        def fn(x):
            return torch.relu(linear0(x)), linear1(x)

        options = {
            "freezing": True,
            "max_autotune": True,
            # The template alone: with ATen beside it, autotuning may pick
            # ATen's GEMM on one host and the template on another, and only
            # the template drops a constant.
            "max_autotune_gemm_backends": "CPP",
            "cpp.enable_grouped_gemm_template": True,
        }
        counters.clear()
        with config.patch(options), torch.no_grad():
            (source,) = self.check(fn, (torch.randn(16, 52),), atol=1e-4, rtol=1e-4)
        if not counters["inductor"]["select_algorithm_weight_prune"]:
            # A template that keeps the original weights leaves nothing to
            # check.  (The skip seen on torch 2.14 and under load was ATen's
            # GEMM winning the autotuning; offered alone, the template drops
            # a constant on 2.12 through 2.15.)
            self.skipTest("this torch's GEMM template dropped no constant")
        listed = source[source.index("constant_names[] = {") :].split("};")[0]
        self.assertIn('"constant', listed)  # the packed weights
        for line in source.splitlines():
            if line.startswith("// constant "):
                self.assertIn(f'"{line.split()[2].rstrip(":")}"', listed)

    @unittest.skipUnless(
        torch.backends.mkldnn.is_available(), "the fused conv needs mkldnn"
    )
    def test_list_of_optional_floats(self) -> None:
        # Found by PyTorch's test_cpu_cpp_wrapper (conv2d binary in-place
        # fusion, torch 2.11): mkldnn's fused conv takes `unary_scalars`, a
        # list of optional floats, which the C shim spells `const double**`.
        conv = torch.nn.Conv2d(3, 32, 3, padding=1).to(
            memory_format=torch.channels_last
        )

        def fn(x, other):
            return torch.add(conv(x), other.relu())

        x = torch.randn(1, 3, 28, 28).to(memory_format=torch.channels_last)
        other = torch.randn(1, 32, 28, 28).to(memory_format=torch.channels_last)
        with config.patch(freezing=True), torch.no_grad():
            (source,) = self.check(fn, (x, other), atol=1e-4, rtol=1e-4)
        self.assertIn("cppwrap::array_of<const double*>(", source)

    def test_optional_string_argument_spelling(self) -> None:
        # mkl's _linear_pointwise takes `str? algorithm`; `const char*("")`
        # is not C++ (test_cpu_cpp_wrapper's mkl_linear with dynamic shapes).
        from torch_cppwrap._inductor.codegen.shim_args import shim_argument

        optional_str = torch.OptionalType(torch.StringType.get())
        self.assertEqual(
            shim_argument(None, "", optional_str),  # type: ignore[arg-type]
            'cppwrap::address_of(static_cast<const char*>(""))',
        )

    @config.patch(fallback_random=True)
    def test_inplace_bernoulli_fallback(self) -> None:
        def fn(a):
            return torch.ops.aten.bernoulli_(a.clone(), 0.3)

        x = torch.ones(64, 64)
        torch.manual_seed(7)
        expected = fn(x)
        torch.manual_seed(7)
        actual, (source,) = self.compile_and_run(fn, (x,))
        self.assertEqual(actual, expected)
        # The shim's status is checked like every other call's.
        self.assertRegex(
            source, r"CPPWRAP_CHECK_SHIM\(\"\S+\", aoti_torch_cpu_bernoulli__float\("
        )

    @config.patch(profiler_mark_wrapper_call=True)
    def test_profiler_mark_wrapper_call(self) -> None:
        fn = torch.compile(lambda x: (x + 1).sin())
        x = torch.randn(16)
        result, (source,) = self.compile_and_run(lambda x: (x + 1).sin(), (x,))
        self.assertEqual(result, (x + 1).sin())
        self.assertIn("_inductor_wrapper_call", source)
        with config.patch(cpp_wrapper=True):
            self.assertEqual(fn(x), (x + 1).sin())
            with torch.profiler.profile() as prof:
                fn(x)
        names = [event.name for event in prof.events()]
        self.assertTrue(any(n.endswith("_inductor_wrapper_call") for n in names), names)

    @config.patch({"cpp.enable_kernel_profile": True})
    def test_kernel_profile_records_each_shim_call(self) -> None:
        def fn(a, b):
            return torch.topk(a @ b, 3).values.relu()

        args = (torch.randn(32, 32), torch.randn(32, 32))
        actual, (source,) = self.compile_and_run(fn, args)
        self.assertEqual(actual, fn(*args))
        self.assertIn(
            'cppwrap::RecordScope record_kernel("aoti_torch_cpu_mm_out");', source
        )
        compiled = torch.compile(fn)
        with config.patch(cpp_wrapper=True):
            compiled(*args)
            with torch.profiler.profile() as prof:
                compiled(*args)
        names = {event.name for event in prof.events()}
        # The C shim runs ATen's kernels without the dispatcher: these
        # ranges are the only record of them, as in upstream's cpp_wrapper.
        self.assertLessEqual({"aoti_torch_cpu_mm_out", "aoti_torch_cpu_topk"}, names)

    @config.patch({"triton.autotune_at_compile_time": True})
    def test_compile_time_tuning_on_a_cpu_graph(self) -> None:
        # torch 2.11 tunes at compile time whenever Triton is installed (every
        # CUDA build); a CPU graph has no Triton kernel and nothing to tune.
        self.check(lambda x: (x + 1).sin().sum(), (torch.randn(64),))


def _unsupported(self: CppWrapperCpu, *args: object, **kwargs: object) -> None:
    raise NotImplementedError("torch_cppwrap: a construct this test pretends is new")


def _unforeseen(self: CppWrapperCpu, *args: object, **kwargs: object) -> None:
    # A bug of ours (session 51's KeyError on compiled autograd's unused
    # input was one).
    raise KeyError("primals_6")


@config.patch(cpp_wrapper=True, fx_graph_cache=False)
class TestPythonWrapperFallback(CppWrapperTestCase):
    def fn(self, x: torch.Tensor) -> torch.Tensor:
        return (x + 1).sin() * 2

    def fall_back(self, failing: Callable[..., None]) -> str:
        """Compiles `fn` outside strict mode with our write_prefix raising as
        `failing` does: the graph must fall back to the Python wrapper and
        match eager.  Returns the module's source."""
        x = torch.randn(32)
        counters.clear()
        with (
            torch_cppwrap.config.patch(strict=False),
            mock.patch.object(CppWrapperCpu, "write_prefix", failing),
        ):
            result, (source,) = torch._inductor.utils.run_and_get_code(
                torch.compile(self.fn), x
            )
        self.assertEqual(result, self.fn(x))
        self.assertEqual(counters["inductor"]["cppwrap_python_wrapper_fallback"], 1)
        # The Python wrapper's module, not ours.
        self.assertNotIn("CppWrapperCodeCache", source)
        self.assertIn("def call(", source)
        # As a plain Python wrapper's: no cpp_wrapper setting keeps its
        # kernels' binaries (triton.store_cubin), which would have every call
        # look for kernels to save where Triton does not tune while compiling.
        self.assertNotIn("kernel_saved", source)
        return source

    def test_unsupported_graph_falls_back_to_the_python_wrapper(self) -> None:
        with self.assertLogs("torch._inductor.graph.__perf_hints", "INFO") as logs:
            self.fall_back(_unsupported)
        (line,) = [m for m in logs.output if "torch_cppwrap" in m]
        self.assertIn("a construct this test pretends is new", line)

    def test_an_unexpected_error_falls_back_with_a_warning(self) -> None:
        # A bug of ours costs the graph its C++ wrapper, not the compile.
        with self.assertLogs("torch_cppwrap._inductor.graph", "WARNING") as logs:
            self.fall_back(_unforeseen)
        self.assertEqual(counters["inductor"]["cppwrap_unexpected_errors"], 1)
        (line,) = logs.output
        self.assertIn("KeyError: 'primals_6'", line)
        self.assertIn("Please report", line)
        with (
            torch_cppwrap.config.patch(strict=True),
            mock.patch.object(CppWrapperCpu, "write_prefix", _unforeseen),
            self.assertRaisesRegex(Exception, "primals_6"),
        ):
            torch.compile(lambda x: x.cos() * 3)(torch.randn(32))

    def test_a_fallback_that_may_not_recur_is_not_cached(self) -> None:
        # A failed build (a compiler killed for memory, a full disk) or an
        # error we did not foresee may not recur: Inductor's FX graph cache
        # must not serve the Python wrapper's module to every later compile.
        # A known gap recurs, and its fallback is kept.
        def build_failed(self: CppWrapperCpu, *args: object, **kwargs: object) -> None:
            raise CppWrapperCompileError(["c++"], "c++: fatal error: Killed", "x.cpp")

        x = torch.randn(32)
        for failing, kept in (
            (build_failed, False),
            (_unforeseen, False),
            (_unsupported, True),
        ):
            with (
                self.subTest(failing.__name__),
                fresh_cache(),
                config.patch(fx_graph_cache=True),
            ):
                torch._dynamo.reset()
                self.fall_back(failing)
                torch._dynamo.reset()
                counters.clear()
                with torch_cppwrap.config.patch(strict=False):
                    result, (source,) = torch._inductor.utils.run_and_get_code(
                        torch.compile(self.fn), x
                    )
                self.assertEqual(result, self.fn(x))
                self.assertEqual(counters["inductor"]["fxgraph_cache_hit"], int(kept))
                self.assertEqual(
                    "CppWrapperCodeCache" in source, not kept, "ours compiled it"
                )

    def test_a_strict_compile_is_never_served_a_fallback(self) -> None:
        # Strict mode is how a test learns of a gap; the FX graph cache keeps
        # a known gap's fallback, which a strict compile must not be given.
        with fresh_cache(), config.patch(fx_graph_cache=True):
            self.fall_back(_unsupported)
            torch._dynamo.reset()
            with (
                torch_cppwrap.config.patch(strict=True),
                mock.patch.object(CppWrapperCpu, "write_prefix", _unsupported),
                self.assertRaisesRegex(Exception, "a construct this test pretends"),
            ):
                torch.compile(self.fn)(torch.randn(32))

    def test_graph_upstream_refuses_cpp_wrappers_falls_back(self) -> None:
        # Upstream's IR refuses some constructs to every C++ wrapper
        # (CppWrapperCodegenError: torch.cuda.use_mem_pool, ...); the graph
        # then compiles with the Python wrapper instead of failing.
        def refused(self: CppWrapperCpu, *args: object, **kwargs: object) -> None:
            raise CppWrapperCodegenError("a construct upstream refuses C++ wrappers")

        self.fall_back(refused)

    def test_torchbind_object_arguments_fall_back(self) -> None:
        # A TorchBind object lifted into the graph is an IR node like a
        # tensor's; passed to an op as a tensor, the call failed with a
        # TypeError.  Upstream's C++ wrapper fails the compile; ours steps
        # aside for the Python wrapper, which passes the object.
        from torch._higher_order_ops.torchbind import enable_torchbind_tracing
        from torch.testing._internal.torchbind_impls import (
            init_torchbind_implementations,
        )

        try:
            init_torchbind_implementations()
        except Exception as error:  # the test library is not in every build
            self.skipTest(f"torch's TorchBind test classes: {error}")

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.attr = torch.classes._TorchScriptTesting._Foo(10, 20)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x + torch.ops._TorchScriptTesting.takes_foo(self.attr, x + 1)

        x = torch.ones(2, 3)
        with enable_torchbind_tracing():
            module = torch.export.export(Model(), (x,), strict=False).module()
        expected = Model()(x)
        counters.clear()
        with torch_cppwrap.config.patch(strict=False):
            result, (source,) = torch._inductor.utils.run_and_get_code(
                torch._inductor.compile, module, (x,)
            )
        self.assertEqual(result(x), expected)
        self.assertEqual(counters["inductor"]["cppwrap_python_wrapper_fallback"], 1)
        self.assertIn("def call(", source)
        with (
            torch_cppwrap.config.patch(strict=True),
            self.assertRaisesRegex(Exception, "TorchBind object arguments"),
        ):
            torch._inductor.compile(module, (x,))

    @config.patch(fallback_random=True)
    def test_random_op_without_tensors_is_a_known_gap(self) -> None:
        # A random op without tensor arguments that a checkpoint recomputes
        # (torch.randn(n) in the region) fails in Inductor's own export for
        # C++ wrappers.  Ours refuses it, naming the op (strict raises); the
        # forward then keeps the Python wrapper as a known gap: no
        # "unexpected error" warning, and the compile does not fail.
        def fn(x):
            return checkpoint_recomputing_all(
                lambda x: x.relu() * torch.randn(x.shape[-1]), x
            )

        def step(f):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
            x.requires_grad_()
            torch.manual_seed(0)
            out = f(x)
            out.sum().backward()
            return out, x.grad

        expected = step(fn)
        with self.assertRaisesRegex(
            Exception, "around aten.randn.default, a random op without tensor"
        ):
            step(torch.compile(fn))
        torch._dynamo.reset()
        counters.clear()
        with (
            torch_cppwrap.config.patch(strict=False),
            self.assertNoLogs("torch_cppwrap._inductor.graph", "WARNING"),
        ):
            actual = step(torch.compile(fn))
        self.assertEqual(actual, expected)
        self.assertEqual(counters["inductor"]["cppwrap_python_wrapper_fallback"], 1)
        self.assertEqual(counters["inductor"]["cppwrap_unexpected_errors"], 0)

    def test_higher_order_fallbacks_are_known_gaps(self) -> None:
        # torch._higher_order_ops.print is a fallback kernel our wrapper does
        # not run.  Without tensor arguments, Inductor's own export of it
        # asserts for every C++ wrapper (upstream's fails the compile); in a
        # nested compile region that failure reached the fallback's Python
        # pass too, and the compile failed.  Ours refuses it before codegen,
        # in the main graph and in subgraphs: a known gap, kept in the cache.
        @torch.compiler.nested_compile_region
        def region(x: torch.Tensor) -> torch.Tensor:
            torch._higher_order_ops.print("in the region")
            return x.sin()

        def in_graph(x: torch.Tensor) -> torch.Tensor:
            torch._higher_order_ops.print("in the graph")
            return x.sin() + 1

        def in_region(x: torch.Tensor) -> torch.Tensor:
            return region(region(x) + 1)

        x = torch.randn(8)
        for fn, printed in ((in_graph, "in the graph"), (in_region, "in the region")):
            with self.subTest(fn.__name__):
                torch._dynamo.reset()
                with (
                    torch_cppwrap.config.patch(strict=True),
                    self.assertRaisesRegex(
                        Exception,
                        "torch.ops.higher_order.print is not supported by the C\\+\\+ wrapper",
                    ),
                ):
                    torch.compile(fn)(x)
                torch._dynamo.reset()
                counters.clear()
                stdout = io.StringIO()
                with (
                    torch_cppwrap.config.patch(strict=False),
                    self.assertNoLogs("torch_cppwrap._inductor.graph", "WARNING"),
                    contextlib.redirect_stdout(stdout),
                ):
                    result = torch.compile(fn)(x)
                self.assertEqual(result, fn(x))
                self.assertIn(printed, stdout.getvalue())
                inductor = counters["inductor"]
                self.assertEqual(inductor["cppwrap_python_wrapper_fallback"], 1)
                self.assertEqual(inductor["cppwrap_unexpected_errors"], 0)
                self.assertEqual(
                    inductor["cppwrap_python_wrapper_fallback_not_cached"], 0
                )

    def test_strict_mode_raises(self) -> None:
        with (
            torch_cppwrap.config.patch(strict=True),
            mock.patch.object(CppWrapperCpu, "write_prefix", _unsupported),
            self.assertRaisesRegex(Exception, "a construct this test pretends is new"),
        ):
            torch.compile(self.fn)(torch.randn(32))


class TestSuiteSettings(TestCase):
    def test_tests_run_strict(self) -> None:
        # Outside CppWrapperTestCase, which patches strict on for itself: the
        # suite's own default (conftest.py sets TORCH_CPPWRAP_STRICT).
        self.assertTrue(torch_cppwrap.config.strict)


if __name__ == "__main__":
    run_tests()
