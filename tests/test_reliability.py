"""Reliability of the CPU wrapper: calls that nest (a compiled graph inside a
custom op inside a compiled graph, on several threads), inputs checked at the
boundary, and failures that come back as the exception the Python wrapper
raises."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import unittest
import weakref
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._inductor import config
from torch._inductor.codecache import PyCodeCache
from torch._inductor.test_case import run_tests
from torch._inductor.utils import clear_caches

from tests.common import CppWrapperTestCase, our_wrappers_created
from torch_cppwrap import _compat


def _on_this_thread(fn: Any, *args: Any) -> Any:
    """Calls fn with cpp_wrapper on: Inductor's config is per thread."""
    with config.patch(cpp_wrapper=True, fx_graph_cache=False):
        return fn(*args)


def _nested_ops(tag: str, inner_threads: int = 0) -> Any:
    """f, which calls custom op `outer`, whose eager body calls g, compiled,
    which calls custom op `inner` (with `inner_threads`, `outer` calls g on
    that many other threads at the same time too)."""

    @torch.library.custom_op(f"cppwrap_test::{tag}_inner", mutates_args=())
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x * 100

    inner.register_fake(lambda x: torch.empty_like(x))
    g = torch.compile(lambda x: inner(x + 1) - 1)

    @torch.library.custom_op(f"cppwrap_test::{tag}_outer", mutates_args=())
    def outer(x: torch.Tensor) -> torch.Tensor:
        results: list[torch.Tensor] = []
        helpers = [
            threading.Thread(target=lambda: results.append(_on_this_thread(g, x)))
            for _ in range(inner_threads)
        ]
        for t in helpers:
            t.start()
        mine = g(x)
        for t in helpers:
            t.join()
        for other in results:
            torch.testing.assert_close(other, mine)
        return mine + 0.5

    outer.register_fake(lambda x: torch.empty_like(x))
    return lambda x: outer(x * 2) * 3


def _nested_expected(x: torch.Tensor) -> torch.Tensor:
    return (((x * 2) + 1) * 100 - 1 + 0.5) * 3


def _graph_modules(before: int) -> list[Any]:
    return [m for m in PyCodeCache.modules[before:] if hasattr(m, "call")]


# Loads a generated module from its file and runs `code` with it as `module`;
# prints what the call raised.  A crash shows as the child's exit status.
_CHILD = """
import importlib.util, sys
import torch, torch_cppwrap
spec = importlib.util.spec_from_file_location("graph", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
def attempt(label, thunk):
    try:
        thunk()
        print(label, "no error")
    except Exception as e:
        print(label, type(e).__name__, str(e).splitlines()[0])
"""


class TestReentrancy(CppWrapperTestCase):
    def test_compiled_graph_inside_custom_op_inside_compiled_graph(self) -> None:
        # The outer graph calls `outer` through the dispatcher; while it runs,
        # g (compiled too) calls `inner` the same way on the same thread.
        f = _nested_ops("nest")
        x = torch.randn(4, 4)
        result, sources = self.compile_and_run(f, (x,))
        self.assertEqual(len(sources), 2)  # f's graph and g's, both ours
        torch.testing.assert_close(result, _nested_expected(x))
        with config.patch(cpp_wrapper=True, fx_graph_cache=False):
            for _ in range(3):
                torch.testing.assert_close(torch.compile(f)(x), _nested_expected(x))

    @unittest.skipIf(
        _compat.torch_version_tuple() < (2, 13),
        "torch 2.11 and 2.12's Dynamo raise 'using FX to symbolically trace a "
        "dynamo-optimized function' in this test's threads whatever the wrapper: "
        "the Python wrapper and upstream's cpp_wrapper hit it too",
    )
    def test_nested_graphs_on_several_threads_with_the_gil_released(self) -> None:
        # Each call releases the GIL, so the nested calls of four threads (and
        # of the helper threads each `outer` starts) interleave in C++.  Every
        # thread sets cpp_wrapper itself: Inductor's config is per thread.
        f = _nested_ops("nest_threads", inner_threads=2)
        x = torch.randn(8, 8)
        compiled = torch.compile(f)
        with our_wrappers_created() as created:
            torch.testing.assert_close(compiled(x), _nested_expected(x))
        self.assertGreaterEqual(len(created), 2)  # f and g at least
        errors: list[BaseException] = []

        def work(seed: int) -> None:
            try:
                for i in range(20):
                    a = torch.full((8, 8), seed + i / 4)  # exact in float32
                    result = _on_this_thread(compiled, a)
                    torch.testing.assert_close(result, _nested_expected(a))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertFalse(errors, "\n".join(f"{type(e).__name__}: {e}" for e in errors))

    def test_dispatcher_results_are_not_kept_after_the_call(self) -> None:
        made: list[weakref.ref[torch.Tensor]] = []

        @torch.library.custom_op("cppwrap_test::produce", mutates_args=())
        def produce(x: torch.Tensor) -> torch.Tensor:
            out = x * 100
            made.append(weakref.ref(out))
            return out

        produce.register_fake(lambda x: torch.empty_like(x))

        def fn(x):
            return produce(x + 1).sum()

        x = torch.randn(16)
        result, _ = self.compile_and_run(fn, (x,))
        torch.testing.assert_close(result, ((x + 1) * 100).sum())
        # The op's result was consumed by the sum kernel and freed there.
        self.assertIsNone(made[-1]())


# Compiles a graph whose module calls a scoped library's op through the
# dispatcher, lets the library go, and then defines the op again, once with
# another schema and once with the same; prints what each step gave.  A crash
# shows as the child's exit status.
_REDEFINED_OP_CHILD = """
import gc, torch, torch_cppwrap
from torch._inductor import config
from torch._inductor.codecache import PyCodeCache
from torch._inductor.utils import run_and_get_code
config.cpp_wrapper = True
x, out = torch.randn(3), torch.zeros(3)
def attempt(label, thunk):
    try:
        print(label, thunk())
    except Exception as e:
        print(label, type(e).__name__, str(e).splitlines()[0])
def fn(x, out):
    torch.ops.cppwrap_again.copy_into(x, out)
def copy_into(x, out):
    out.copy_(x)
def copy_twice_into(x, out):
    out.copy_(x * 2)
def zero(x):
    x.zero_()
with torch.library._scoped_library("cppwrap_again", "FRAGMENT") as lib:
    lib.define("copy_into(Tensor x, Tensor(a!) out) -> ()")
    lib.impl("copy_into", copy_into, "CompositeExplicitAutograd")
    _, (source,) = run_and_get_code(torch.compile(fn), x, out)
    print("ours:", "torch_cppwrap" in source, 'find_op("cppwrap_again::copy_into"' in source)
    (module,) = [m for m in PyCodeCache.modules if hasattr(m, "call")]
torch._dynamo.reset()
gc.collect()
attempt("gone:", lambda: module.call([x, out]))
with torch.library._scoped_library("cppwrap_again", "FRAGMENT") as lib:
    lib.define("copy_into(Tensor(a!) x) -> ()")
    lib.impl("copy_into", zero, "CompositeExplicitAutograd")
    def zero_a_copy(y):
        y = y.clone()
        torch.ops.cppwrap_again.copy_into(y[:])
        return y
    traced = torch.compile(zero_a_copy, backend="aot_eager", fullgraph=True)
    attempt("traced again:", lambda: traced(torch.ones(3)).sum().item())
    attempt("other schema:", lambda: module.call([x, out]))
with torch.library._scoped_library("cppwrap_again", "FRAGMENT") as lib:
    lib.define("copy_into(Tensor x, Tensor(a!) out) -> ()")
    lib.impl("copy_into", copy_twice_into, "CompositeExplicitAutograd")
    attempt("same schema:", lambda: (module.call([x, out]), torch.equal(out, x * 2))[1])
"""


class TestRedefinedOps(CppWrapperTestCase):
    def test_ops_redefined_between_two_compiles_of_one_graph(self) -> None:
        # PyTorch's tests define ops in a scoped library and may run a test's
        # body twice (tf32 off, then on): the second compile finds the first's
        # module in the FX graph cache, loaded already, whose ops must be the
        # ones defined now, not the first library's, long freed.
        def compile_with_ops(scale: float) -> list[Any]:
            with torch.library._scoped_library("cppwrap_redef", "DEF") as lib:
                lib.define("scale(Tensor x, bool flag) -> Tensor")
                lib.impl(
                    "scale", lambda x, flag: x * scale, "CompositeExplicitAutograd"
                )
                lib.impl("scale", lambda x, flag: torch.empty_like(x), "Meta")
                lib.define("add_one(Tensor(a!) x) -> ()")

                def add_one(x: torch.Tensor) -> None:
                    x.add_(1)

                lib.impl("add_one", add_one, "CompositeExplicitAutograd")
                lib.impl("add_one", lambda x: None, "Meta")

                def fn(x):
                    y = torch.ops.cppwrap_redef.scale(x + 1, True)
                    torch.ops.cppwrap_redef.add_one(y)
                    return y * 2

                x = torch.randn(8)
                torch._dynamo.reset()
                before = len(PyCodeCache.modules)
                with config.patch(cpp_wrapper=True, fx_graph_cache=True):
                    result = torch.compile(fn)(x)
                torch.testing.assert_close(result, ((x + 1) * scale + 1) * 2)
                return _graph_modules(before)

        counters.clear()
        (module,) = compile_with_ops(3.0)
        with open(module.__file__) as f:
            self.assertIn("from torch_cppwrap._inductor.codecache import", f.read())
        self.assertEqual(counters["inductor"]["fxgraph_cache_miss"], 1)
        (again,) = compile_with_ops(5.0)
        self.assertIs(
            again._module, module._module
        )  # one extension, its ops found once
        self.assertEqual(counters["inductor"]["fxgraph_cache_hit"], 1)

    def test_an_op_defined_again_after_its_library_went(self) -> None:
        # PyTorch's test_auto_functionalize.py defines mylib::foo in one test
        # and again, with another schema, in the next.  Our graph modules
        # once pinned each op's dispatcher entry to keep their handles valid;
        # the pinned entry kept its pointer to the first op's Python object,
        # freed with the library, and tracing the op defined anew (the
        # Python dispatcher reads that pointer) crashed the process or
        # called the freed object with the new op's arguments.  The handles
        # now follow the dispatcher, and a module whose op is gone, or
        # defined with another schema, says so when called.
        proc = subprocess.run(
            [sys.executable, "-c", _REDEFINED_OP_CHILD],
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(proc.returncode, 0, f"child died\n{proc.stderr[-3000:]}")
        lines = proc.stdout.splitlines()
        self.assertIn("ours: True True", lines)
        self.assertIn("traced again: 0.0", lines)
        self.assertIn(
            "gone: RuntimeError cppwrap_again::copy_into is no longer defined "
            "(its library went away after this graph was compiled)",
            lines,
        )
        (other,) = [line for line in lines if line.startswith("other schema:")]
        self.assertRegex(
            other,
            r"RuntimeError cppwrap_again::copy_into was defined again as "
            r"`cppwrap_again::copy_into\(Tensor\(a!\) x\) -> \(\)`, not as "
            r"`cppwrap_again::copy_into\(Tensor x, Tensor\(a!\) out\) -> \(\)`",
        )
        self.assertIn("same schema: True", lines)


class _Scale(torch.nn.Module):
    """A weight and a pointwise product: under freezing, one constant and no
    matmul (whose weight mkldnn may pack, and packed weights do not pickle
    for the FX graph cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class TestFrozenConstants(CppWrapperTestCase):
    def test_one_graph_frozen_with_other_weights_keeps_its_own(self) -> None:
        # Under freezing, weights are the graph's constants.  Two models of
        # one shape make one graph: the second compile is an FX graph cache
        # hit whose module binds other constants.  Kept in the library's
        # statics (before 9066113), they were the first model's (PyTorch's
        # test_codecache.py, test_freezing, cpp_wrapper on), even with the
        # in-process caches cleared in between; each module keeps its own
        # now (cppwrap::ModuleState).
        first, second = _Scale().eval(), _Scale().eval()
        x = torch.rand(8, 8)
        counters.clear()
        # A pointwise graph (_Scale) rather than packing turned off: that
        # would keep it off for the process (freezing_patterns.lazy_init
        # runs once).
        with (
            config.patch(cpp_wrapper=True, freezing=True, fx_graph_cache=True),
            torch.no_grad(),
        ):
            compiled_first = torch.compile(first)
            torch.testing.assert_close(compiled_first(x), first(x))
            torch._dynamo.reset()
            clear_caches()
            compiled_second = torch.compile(second)
            torch.testing.assert_close(compiled_second(x), second(x))
            # Each keeps its own weights, called in turn.
            torch.testing.assert_close(compiled_first(x), first(x))
            torch.testing.assert_close(compiled_second(x), second(x))
        self.assertGreaterEqual(counters["inductor"]["fxgraph_cache_hit"], 1)

    def test_models_of_one_shape_build_one_library(self) -> None:
        # Compiled anew (no FX graph cache), two models of one shape make
        # the same C++ source, hence one library.  The source once described
        # each constant with Inductor's repr, which ends with the tensor's
        # id: on the device, each frozen model built a library of its own.
        x = torch.rand(8, 8)
        wrappers = []
        with config.patch(freezing=True, fx_graph_cache=False), torch.no_grad():
            for _ in range(2):
                torch._dynamo.reset()
                (source,) = self.check(_Scale().eval(), (x,))
                self.assertIn("// constant ", source)
                wrappers.append(source[source.index("wrapper_src = r") :])
        self.assertEqual(wrappers[0], wrappers[1])


class TestClearedCodeCache(CppWrapperTestCase):
    def test_a_graph_compiled_again_runs_its_own_code(self) -> None:
        # Inductor clears the in-process caches (clear_caches()) in
        # fresh_cache(), under torch.compiler.config.force_disable_caches and
        # around standalone_compile's cache directories; graphs compiled
        # afterwards load their built modules a second time.  Each load must
        # give the graph's own module: once, the second load of `add`'s
        # refilled `double`'s module object with `add`'s functions and the
        # second load of `double`'s refilled it back, so that a third
        # compile of `add`, served that object from the code cache's memo,
        # ran `double`'s code.
        def add(x: torch.Tensor) -> torch.Tensor:
            return x + 1

        def double(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        def add_again(x: torch.Tensor) -> torch.Tensor:
            return x + 1

        def double_again(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        def add_third(x: torch.Tensor) -> torch.Tensor:
            return x + 1

        x = torch.randn(8)
        self.check(add, (x,))
        self.check(double, (x,))
        clear_caches()
        for fn in (add_again, double_again, add_third):
            self.check(fn, (x,))


class TestInputChecks(CppWrapperTestCase):
    def _module_file(self, fn: Any, args: tuple[Any, ...]) -> str:
        before = len(PyCodeCache.modules)
        self.compile_and_run(fn, args)
        (module,) = _graph_modules(before)
        return module.__file__

    def _run_child(self, module_file: str, code: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD + textwrap.dedent(code), module_file],
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(proc.returncode, 0, f"child died\n{proc.stderr[-3000:]}")
        return proc.stdout

    def test_input_on_another_device_raises_naming_it(self) -> None:
        def fn(x, y):
            return x * y + 1

        x, y = torch.randn(4, 4), torch.randn(4, 4)
        checked = self._module_file(fn, (x, y))
        torch._dynamo.reset()
        with config.patch(size_asserts=False):
            unchecked = self._module_file(fn, (x, y))
        # A meta tensor has sizes, strides and a dtype, but no data: the graph
        # must refuse it before any kernel reads it, whatever size_asserts says.
        for module_file in (checked, unchecked):
            out = self._run_child(
                module_file,
                """
                x = torch.randn(4, 4)
                attempt("meta", lambda: module.call([x, torch.empty(4, 4, device="meta")]))
                attempt("cpu", lambda: module.call([x, x]))
                """,
            )
            self.assertIn(
                "meta RuntimeError input arg1_1: expected a tensor on cpu but got one on meta",
                out,
            )
            self.assertIn("cpu no error", out)


# Compiles a gather with Inductor's C++ kernels on `threads` threads, says
# whether its kernel runs in a parallel region and checks its index as a
# vector, then gives it an index out of bounds and prints what the call raised.
# "rows" (x[idx]) checks one index per row in a vectorized loop, "columns"
# (x[:, idx]) checks a vector of indices.
_INDEX_ERROR_CHILD = """
import sys, torch, torch_cppwrap
from torch._inductor import config
from torch._inductor.utils import run_and_get_code
config.cpp_wrapper = True
config.cpp.threads = int(sys.argv[1])
gathers = {"rows": lambda x, idx: x[idx] * 2, "columns": lambda x, idx: x[:, idx] * 2}
f = torch.compile(gathers[sys.argv[2]])
x, idx = torch.randn(64, 512), torch.randint(0, 64, (4096,))
_, (source,) = run_and_get_code(f, x, idx)
print("parallel:", "#pragma omp parallel" in source)
print("vector check:", "all_masked()" in source)
idx[100] = 1000
try:
    f(x, idx)
    print("no error")
except Exception as e:
    print(type(e).__name__, str(e).splitlines()[0])
"""


class TestKernelErrors(CppWrapperTestCase):
    def index_error_outcome(
        self, threads: int, gather: str = "rows"
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", _INDEX_ERROR_CHILD, str(threads), gather],
            capture_output=True,
            text=True,
            timeout=600,
        )

    def test_index_error_in_serial_kernel_raises(self) -> None:
        proc = self.index_error_outcome(threads=1)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertIn("parallel: False", proc.stdout)
        self.assertRegex(proc.stdout, "RuntimeError .*index out of bounds")

    # An exception must not leave an OpenMP parallel region (std::terminate):
    # the kernel catches it in the loop, skips what is left, and rethrows it
    # after the region (_inductor/codegen/cpp_parallel_errors.py).
    def test_index_error_in_parallel_kernel_raises(self) -> None:
        proc = self.index_error_outcome(threads=2)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertIn("parallel: True", proc.stdout)
        self.assertRegex(proc.stdout, "RuntimeError .*index out of bounds")

    def test_vectorized_index_error_in_parallel_kernel_raises(self) -> None:
        proc = self.index_error_outcome(threads=2, gather="columns")
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertIn("parallel: True", proc.stdout)
        self.assertIn("vector check: True", proc.stdout)
        self.assertRegex(proc.stdout, "RuntimeError .*index out of bounds")

    def test_only_kernels_that_can_throw_catch(self) -> None:
        def fn(x, idx):
            return x[idx] * 2, x.sin().sum(dim=1)

        x, idx = torch.randn(64, 512), torch.randint(0, 64, (4096,))
        with config.patch({"cpp.threads": 2}):
            (source,) = self.check(fn, (x, idx))
        kernels = source.split("kernel_src = ")[1]
        # One guarded body, in the gather; the sum's kernel is Inductor's own.
        self.assertEqual(kernels.count("catch (...)"), 1)
        self.assertEqual(kernels.count("std::rethrow_exception(parallel_error)"), 1)

    def test_python_wrapper_kernels_are_unchanged(self) -> None:
        from torch._inductor.utils import run_and_get_code

        x, idx = torch.randn(64, 512), torch.randint(0, 64, (4096,))
        torch._dynamo.reset()
        with config.patch(
            {"cpp_wrapper": False, "fx_graph_cache": False, "cpp.threads": 2}
        ):
            result, (source,) = run_and_get_code(
                torch.compile(lambda x, idx: x[idx] * 2), x, idx
            )
        self.assertEqual(result, x[idx] * 2)
        self.assertIn("#pragma omp parallel", source)
        self.assertNotIn("parallel_error", source)


class TestExceptionTypes(CppWrapperTestCase):
    def test_custom_op_exception_keeps_its_type_and_message(self) -> None:
        @torch.library.custom_op("cppwrap_test::picky", mutates_args=())
        def picky(x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                raise ValueError("picky: the sum is positive")
            return x.clone()

        picky.register_fake(lambda x: torch.empty_like(x))

        def fn(x):
            return picky(x * 2) + 1

        self.check(fn, (-torch.ones(3),))
        with (
            config.patch(cpp_wrapper=True, fx_graph_cache=False),
            self.assertRaisesRegex(ValueError, "^picky: the sum is positive$"),
        ):
            torch.compile(fn)(torch.ones(3))

    def test_linalg_error_keeps_its_type(self) -> None:
        def fn(x):
            return torch.linalg.inv(x * 2) + 1

        self.check(fn, (torch.eye(3),))
        # torch 2.11's compiled inv checks nothing (the Python wrapper returns
        # NaN too): ours must raise exactly where the Python wrapper raises.
        torch._dynamo.reset()
        with config.patch(cpp_wrapper=False, fx_graph_cache=False):
            try:
                torch.compile(fn)(torch.zeros(3, 3))
            except torch.linalg.LinAlgError:
                pass
            else:
                self.skipTest("the Python wrapper raises no LinAlgError here")
        torch._dynamo.reset()
        with (
            config.patch(cpp_wrapper=True, fx_graph_cache=False),
            self.assertRaisesRegex(torch.linalg.LinAlgError, "linalg.inv: .* singular"),
        ):
            torch.compile(fn)(torch.zeros(3, 3))

    def test_exception_from_nested_graph_keeps_its_type(self) -> None:
        @torch.library.custom_op("cppwrap_test::deep_picky", mutates_args=())
        def deep_picky(x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                raise IndexError("deep_picky: the sum is positive")
            return x.clone()

        deep_picky.register_fake(lambda x: torch.empty_like(x))
        g = torch.compile(lambda x: deep_picky(x + 1) - 1)

        @torch.library.custom_op("cppwrap_test::calls_g", mutates_args=())
        def calls_g(x: torch.Tensor) -> torch.Tensor:
            return g(x) + 0.5

        calls_g.register_fake(lambda x: torch.empty_like(x))

        def fn(x):
            return calls_g(x * 2) * 3

        with our_wrappers_created() as created:
            # ((x * 2 + 1) - 1 + 0.5) * 3, worked out: running fn eagerly
            # here would compile g once more.
            expected = torch.full((3,), -28.5)
            self.assertEqual(torch.compile(fn)(-torch.ones(3) * 5), expected)
            self.assertEqual(len(created), 2)
            with self.assertRaisesRegex(
                IndexError, "^deep_picky: the sum is positive$"
            ):
                torch.compile(fn)(torch.ones(3))

    def test_failed_shim_call_carries_libtorch_message(self) -> None:
        def fn(x):
            return torch.histc(x * 2, bins=4) + 1

        self.check(fn, (torch.arange(8.0),))
        # The message names the op and the shim function (as upstream's does,
        # which PyTorch's tests check).  Where the shim keeps its last error
        # (torch 2.13 on), it says why; before that, libtorch logs the reason
        # to stderr, and ours says so.
        include = os.path.join(os.path.dirname(torch.__file__), "include")
        keeps = os.path.isfile(
            os.path.join(include, "torch/csrc/shim_exception_state.h")
        )
        reason = (
            r"range of \[.*\] is not finite"
            if keeps
            else r"\(libtorch logged the reason to stderr\)"
        )
        with (
            config.patch(cpp_wrapper=True, fx_graph_cache=False),
            self.assertRaisesRegex(
                RuntimeError,
                # at the op (a fallback) or at its output buffer (an extern
                # kernel, as torch 2.14 has it)
                rf"aoti_torch_cpu_histc\(\.\.\.\) API call failed at \S+: .*{reason}",
            ),
        ):
            torch.compile(fn)(torch.full((8,), float("inf")))

    def test_failed_shim_call_through_python_keeps_the_ops_message(self) -> None:
        # On a graph's first call AOTAutograd holds a dispatch mode (torch
        # 2.13), so the convolution runs through Python and fails there: the
        # C shim catches an empty C++ error and records no reason.  Ours takes
        # the op's own exception, which Python still holds, into its message
        # and raises from it.  Later calls go straight to the op, whose reason
        # the shim records (torch 2.13 on) or logs to stderr.
        conv = torch.nn.ConvTranspose2d(3, 6, 3, padding=1, output_padding=1)
        try:  # torch 2.15's meta kernel rejects it: Dynamo fails while tracing
            torch.nn.functional.conv_transpose2d(
                torch.empty(1, 3, 8, 8, device="meta"),
                conv.weight.to("meta"),
                padding=1,
                output_padding=1,
            )
        except RuntimeError:
            self.skipTest(f"torch {torch.__version__} rejects the op while tracing")

        def fn(x):
            return torch.tanh(conv(x))

        reason = "output padding must be smaller than either stride or dilation"
        compiled = torch.compile(fn)
        with (
            torch.no_grad(),
            config.patch(cpp_wrapper=True, fx_graph_cache=False),
            our_wrappers_created() as created,
        ):
            for _ in range(2):
                with self.assertRaisesRegex(
                    RuntimeError,
                    r"aoti_torch_cpu_convolution\(\.\.\.\) API call failed at \S+: "
                    r"(?!\(libtorch gave no reason\))",
                ) as caught:
                    compiled(torch.randn(1, 3, 8, 8))
                message = str(caught.exception)
                if "logged the reason to stderr" not in message:
                    self.assertIn(reason, message)
        self.assertEqual(len(created), 1)


if __name__ == "__main__":
    run_tests()
