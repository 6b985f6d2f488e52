"""Behaviour of torch_cppwrap's CPU C++ wrapper, compared with eager."""

from __future__ import annotations

import re
import sys
import unittest
import weakref
from typing import Any
from unittest import mock

import torch
from torch._inductor import config
from torch._inductor.test_case import run_tests

from tests.common import CppWrapperTestCase, checking_identity_source
from torch_cppwrap import _compat
from torch_cppwrap._inductor import codecache
from torch_cppwrap._inductor.codecache import CppWrapperCodeCache
from torch_cppwrap._inductor.codegen.cpp_wrapper_cpu import HOST_READ, CppWrapperCpu


class TestSeedExample(CppWrapperTestCase):
    def test_seed_example_single_fused_kernel(self) -> None:
        def fn(x, y):
            return (x + y).sum()

        x, y = torch.randn(128, 128), torch.randn(128, 128)
        (source,) = self.check(fn, (x, y))
        # One fused add+sum kernel, compiled into the same module.
        self.assertEqual(len(re.findall(r'extern "C"\s+void\s+cpp_fused', source)), 2)
        self.assertIn("cpp_fused_add_sum_0(", source)
        # Inputs are released once dead, before the outputs are returned.
        body = source[source.index("static PyObject* call_impl") :]
        self.assertLess(body.index("arg0_1.reset();"), body.index("out0 = "))
        self.assertIn("cppwrap::GilRelease nogil;", body)

    def test_launchers_of_their_own_are_built_with_the_module(self) -> None:
        # The way a CUDA graph's Triton launchers take (defined once the
        # kernels are tuned, CppWrapperGpu.define_launchers), run on CPU: the
        # module hands launcher_src (one literal a launcher) to the code
        # cache, which builds it beside the wrapper.
        launchers = [
            '__attribute__((visibility("hidden"))) int cpu_probe_launcher() '
            "{ return 7; }\n"
        ]

        def fn(x):
            return x.sin() + 1

        with mock.patch.object(
            CppWrapperCpu, "define_launchers", lambda self: launchers
        ):
            (source,) = self.check(fn, (torch.randn(8),))
        self.assertIn("launchers=launcher_src", source)
        self.assertIn("cpu_probe_launcher", source)


class TestFallbacks(CppWrapperTestCase):
    def test_fallback_with_c_shim(self) -> None:
        def fn(x):
            # topk and sort are Inductor fallbacks with a C shim.
            values, indices = torch.topk(x, 3)
            return values * 2, indices

        (source,) = self.check(fn, (torch.randn(8, 10),))
        self.assertIn("aoti_torch_cpu_topk", source)

    def test_custom_op_without_shim(self) -> None:
        @torch.library.custom_op("cppwrap_test::scale_add", mutates_args=())
        def scale_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
            return x + alpha * y

        @scale_add.register_fake
        def _(x, y, alpha):
            return torch.empty_like(x)

        def fn(x, y):
            return scale_add(x.sin(), y, 0.5).cos()

        (source,) = self.check(fn, (torch.randn(5, 5), torch.randn(5, 5)))
        self.assertIn('cppwrap::find_op("cppwrap_test::scale_add"', source)
        self.assertIn(".real(0.5)", source)

    def test_custom_op_multiple_outputs(self) -> None:
        @torch.library.custom_op("cppwrap_test::split_two", mutates_args=())
        def split_two(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return x[:n].clone(), x[n:].clone()

        @split_two.register_fake
        def _(x, n):
            return x.new_empty(n, *x.shape[1:]), x.new_empty(
                x.shape[0] - n, *x.shape[1:]
            )

        def fn(x):
            a, b = split_two(x * 2, 3)
            return a + 1, b - 1

        self.check(fn, (torch.randn(7, 4),))

    @unittest.skipIf(
        _compat.torch_version_tuple() < (2, 15),
        "torch 2.15 is the first release to ask C++ wrappers for alignment checks",
    )
    def test_op_output_alignment_is_checked(self) -> None:
        # Inductor's kernels assume that what an ATen fallback returns is
        # aligned; with config.alignment_asserts (the default) the wrapper
        # checks it, as the Python wrapper does.
        mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()

        def fn(x):
            return mha(x, x, x)[0]

        x = torch.randn(2, 5, 16)
        with torch.no_grad():
            (source,) = self.check(fn, (x,), atol=1e-5, rtol=1e-5)
            self.assertRegex(
                source,
                r'cppwrap::assert_alignment\(buf\d+, 16, "torch\.ops\.aten\.'
                r'_scaled_dot_product_flash_attention_for_cpu\.default"\);',
            )
            torch._dynamo.reset()
            with config.patch(alignment_asserts=False):
                (source,) = self.check(fn, (x,), atol=1e-5, rtol=1e-5)
        self.assertNotIn("cppwrap::assert_alignment(", source)

    def test_alignment_check_names_op_and_offset(self) -> None:
        # The check behind that line, on a tensor one float past an aligned
        # address and on an aligned one.
        module = CppWrapperCodeCache.load(
            checking_identity_source(
                "alignment", 'cppwrap::assert_alignment(x, 16, "aten.op");'
            )
        )
        x = torch.randn(8)
        self.assertIs(module.call([x])[0], x)
        with self.assertRaisesRegex(
            RuntimeError,
            "^aten.op: expected a tensor whose data is 16-byte aligned, "
            "got one at offset 4$",
        ):
            module.call([x[1:]])

    def test_optional_op_output_left_undefined(self) -> None:
        # Found by PyTorch's test_cpu_cpp_wrapper on torch 2.15: multi-head
        # attention without need_weights returns no weights (None), and torch
        # 2.14 and later ask for that output's layout and dtype all the same
        # (2.11 to 2.13 skip empty outputs).
        def fn(q, w, b, pw, pb):
            return torch._native_multi_head_attention(
                q, q, q, 6, 2, w, b, pw, pb, None, False
            )

        args = (
            torch.randn(1, 3, 6),
            torch.randn(18, 6),
            torch.randn(18),
            torch.randn(6, 6),
            torch.randn(6),
        )
        self.assertIsNone(fn(*args)[1])
        (source,) = self.check(fn, args, atol=1e-5, rtol=1e-5)
        if _compat.torch_version_tuple() >= (2, 14):
            self.assertEqual(
                source.count(
                    "cppwrap::assert_size_stride(buf2, {0L}, {1L}, "
                    '"torch.ops.aten._native_multi_head_attention.default"'
                ),
                1,
            )

    def test_layout_check_of_undefined_and_empty_outputs(self) -> None:
        # The check behind those lines: an undefined tensor has no layout to
        # check, and no element of an empty one is read through its strides.
        check = (
            "cppwrap::Tensor none = cppwrap::undefined_tensor();\n"
            '        cppwrap::assert_size_stride(none, {0L}, {1L}, "aten.op", '
            "cppwrap::dtype::kFloat32);\n"
            '        cppwrap::assert_size_stride(x, {0L, 5L}, {1L, 0L}, "aten.op");'
        )
        module = CppWrapperCodeCache.load(checking_identity_source("layout", check))
        empty = torch.empty(0, 5)
        self.assertIs(module.call([empty])[0], empty)
        with self.assertRaisesRegex(
            RuntimeError,
            r"^output of aten\.op: expected size \[0, 5\] and stride \[1, 0\] "
            r"but got size \[0, 6\]",
        ):
            module.call([torch.empty(0, 6)])

    def test_custom_op_mutating_input(self) -> None:
        @torch.library.custom_op("cppwrap_test::add_one_", mutates_args=("x",))
        def add_one_(x: torch.Tensor) -> None:
            x.add_(1)

        def fn(x):
            y = x * 3
            add_one_(y)
            return y

        self.check(fn, (torch.randn(6),))


class TestViewsAndMutation(CppWrapperTestCase):
    def test_views_and_reinterpret(self) -> None:
        def fn(x):
            y = x.t().contiguous()
            return y.view(-1)[3:20], x[:, 1::2], x.unsqueeze(0).expand(3, -1, -1)

        self.check(fn, (torch.randn(6, 8),))

    def test_inputs_at_a_storage_offset(self) -> None:
        # A ReinterpretView's offset counts from the buffer's own storage
        # offset: a slice of a larger tensor read through a transposed view.
        def fn(x, y):
            return x.t() @ y, x.t().contiguous().sum(0), x[1:].t()

        base = torch.randn(17 * 16)
        x = base[16:].view(16, 16)
        self.assertEqual(x.storage_offset(), 16)
        self.check(fn, (x, torch.randn(16, 16)), atol=1e-4, rtol=1e-4)

    def test_as_strided_output_of_extern(self) -> None:
        def fn(a, b):
            return (a @ b).view(4, 2, 8).transpose(0, 1)

        self.check(fn, (torch.randn(4, 16), torch.randn(16, 16)), atol=1e-4, rtol=1e-4)

    def test_inplace_mutation_of_inputs(self) -> None:
        def fn(x, y):
            x.add_(y)
            y.mul_(2)
            return x.sum()

        self.check(fn, (torch.randn(10), torch.randn(10)))

    def test_index_put_accumulate(self) -> None:
        def fn(x, idx, v):
            return x.index_put((idx,), v, accumulate=True)

        x = torch.zeros(10)
        idx = torch.tensor([0, 2, 2, 9])
        self.check(fn, (x, idx, torch.ones(4)))


class TestOutputsAndInputs(CppWrapperTestCase):
    def test_several_outputs_aliasing_and_0d(self) -> None:
        def fn(x, y):
            s = x.sum()  # 0-d output
            return x, s, x.view(-1), y + 1, s

        x, y = torch.randn(3, 4), torch.randn(5)
        self.check(fn, (x, y))

    def test_tensors_made_on_the_meta_device(self) -> None:
        # PyTorch's test_cpu_repro.py test_meta_device: a graph may make
        # tensors that hold no data; the op that makes them names the device.
        def fn():
            x = torch.ops.aten.empty.memory_format(
                [64, 8], dtype=torch.float16, device="meta", pin_memory=False
            )
            return x.sin() + 1

        out, (source,) = self.compile_and_run(fn, ())
        self.assertEqual(
            (out.shape, out.dtype, out.device),
            (torch.Size([64, 8]), torch.float16, torch.device("meta")),
        )
        self.assertIn("cppwrap::device::kMeta", source)

    def test_output_is_input_identity(self) -> None:
        def fn(x):
            return x, x * 2

        x = torch.randn(4)
        out, _ = self.compile_and_run(fn, (x,))
        self.assertIs(out[0], x)
        self.assertEqual(out[1], x * 2)

    @torch._dynamo.config.patch(specialize_float=False)
    def test_python_scalar_inputs(self) -> None:
        def fn(x, a: int, b: float):
            return x * a + b

        # With dynamic shapes and unspecialized floats, Dynamo passes the int
        # and the float as graph inputs.
        compiled_args = (torch.randn(4), 3, 0.25)
        sources = self.check(fn, compiled_args, dynamic=True)
        # Both scalars reach the C++ entry point as graph inputs: the int as
        # an int64_t, the float as a 0-d double tensor (as in the Python
        # wrapper).
        (source,) = sources
        self.assertIn("cppwrap::unpack_int(", source)
        self.assertIn("const double* in_ptr", source)

    def test_dtypes(self) -> None:
        def fn(i64, i32, b, f64, bf16):
            return (
                i64 * 3 + 1,
                (i32 // 2).to(torch.int64),
                b & (i32 > 0),
                f64.sqrt(),
                (bf16 * 2).float().sum(),
            )

        args = (
            torch.arange(10, dtype=torch.int64),
            torch.arange(-5, 5, dtype=torch.int32),
            torch.rand(10) > 0.5,
            torch.rand(10, dtype=torch.float64),
            torch.randn(10, dtype=torch.bfloat16),
        )
        self.check(fn, args)

    def test_unsigned_dtypes_beyond_uint8(self) -> None:
        # PyTorch's test_cpu_repro.py test_uint32_pointwise_vec and its kin.
        def fn(u32, u64):
            return u32 * u32, u32.sum(dim=1), u64 * u64, u64.sum(dim=0)

        args = (
            torch.randint(0, 100, (8, 8), dtype=torch.uint32),
            torch.randint(0, 100, (8, 8), dtype=torch.uint64),
        )
        (source,) = self.check(fn, args)
        self.assertIn("cppwrap::dtype::kUInt32", source)
        self.assertIn("cppwrap::dtype::kUInt64", source)

    def test_buffer_reuse(self) -> None:
        def fn(a, b):
            x = a @ b
            y = (x.relu() @ b).sigmoid()
            z = (y @ b).tanh()
            return z @ b

        a, b = torch.randn(16, 16), torch.randn(16, 16)
        (source,) = self.check(fn, (a, b), atol=1e-4, rtol=1e-4)
        self.assertIn("// reuse", source)

    def test_wrong_input_raises_python_exception(self) -> None:
        def fn(x):
            return x + 1

        x = torch.randn(4)
        with config.patch(cpp_wrapper=True, fx_graph_cache=False):
            from torch._inductor.utils import run_and_get_code

            captured = {}
            from torch._inductor.graph import GraphLowering

            original = GraphLowering.compile_to_module

            def capture(graph):
                module = original(graph)
                captured["module"] = module
                return module

            from unittest import mock

            with mock.patch.object(GraphLowering, "compile_to_module", capture):
                run_and_get_code(torch.compile(fn), x)
        call = captured["module"].call
        with self.assertRaisesRegex(TypeError, "expects 1 inputs, got 2"):
            call([x, x])
        with self.assertRaisesRegex(TypeError, "expected a Tensor for arg0_1"):
            call([3])
        with self.assertRaisesRegex(RuntimeError, r"input arg0_1: expected size \[4\]"):
            call([torch.randn(5)])
        with self.assertRaisesRegex(RuntimeError, "expected dtype Float"):
            call([torch.zeros(4, dtype=torch.int64)])
        with self.assertRaisesRegex(TypeError, "list of inputs"):
            call((x,))

    def test_inputs_are_borrowed_or_freed_never_leaked(self) -> None:
        from torch._inductor.codecache import PyCodeCache

        def fn(x, y):
            return x + y, (x * y).sum()

        x, y = torch.randn(8, 8), torch.randn(8, 8)
        before = len(PyCodeCache.modules)
        self.compile_and_run(fn, (x, y))
        (module,) = [m for m in PyCodeCache.modules[before:] if hasattr(m, "call")]
        # The caller holds x and y too, so the call borrows them: no reference
        # is left behind, whatever the number of calls.
        refs = sys.getrefcount(x), sys.getrefcount(y)
        for _ in range(200):
            added, product = module.call([x, y])
        self.assertEqual((sys.getrefcount(x), sys.getrefcount(y)), refs)
        self.assertEqual(added, x + y)
        self.assertEqual(product, (x * y).sum())
        # An input that only the argument list holds is taken (and freed at its
        # last use), not kept alive by the call.
        t = torch.randn(8, 8)
        expected = t + y
        dead = weakref.ref(t)
        args = [t, y]
        del t
        added, _ = module.call(args)
        self.assertEqual(args, [])
        self.assertIsNone(dead())
        self.assertEqual(added, expected)

    def test_small_outputs_behave_like_any_cpu_tensor(self) -> None:
        # Buffers up to 64 KiB skip the default CPU allocator's bookkeeping;
        # what a caller can observe must not change.
        from torch._inductor.codecache import PyCodeCache

        def fn(x):
            return x.sum(), x * 2, (x + 1).repeat(200, 1)

        x = torch.randn(4, 40)
        before = len(PyCodeCache.modules)
        self.compile_and_run(fn, (x,))
        (module,) = [m for m in PyCodeCache.modules[before:] if hasattr(m, "call")]
        total, doubled, big = module.call([x])
        self.assertEqual(total, x.sum())
        self.assertEqual(doubled, x * 2)
        self.assertEqual(big, (x + 1).repeat(200, 1))  # 128 KB: the default path
        for out in (total, doubled, big):
            self.assertEqual(out.untyped_storage().data_ptr() % 64, 0)
            self.assertTrue(out.untyped_storage().resizable())
        # Storage resizes through the default allocator and keeps the data.
        expected = doubled.clone()
        doubled.resize_(64, 64)
        self.assertEqual(doubled.flatten()[:160], expected.flatten())
        # The memory profiler sees the small outputs too (the fast path steps
        # aside while it records memory).
        with torch.profiler.profile(profile_memory=True) as prof:
            module.call([x])
        sizes = {
            event.cpu_memory_usage
            for event in prof.events()
            if event.name == "[memory]"
        }
        self.assertIn(4, sizes)  # the 0-d sum
        self.assertIn(4 * 160, sizes)  # x * 2


class TestVectorIsa(CppWrapperTestCase):
    def test_kernels_build_for_the_isa_their_code_was_generated_for(self) -> None:
        # config.cpp.simdlen picks the vector ISA that Inductor generates a
        # graph's kernels for, compile by compile.  The kernels' translation
        # unit must be built for that ISA: built for the first ISA the
        # process saw (512-bit vectors under code stepping 256 bits), a
        # transpose read and wrote past its buffers.
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        by_width = {isa.bit_width(): isa for isa in reversed(valid_vec_isa_list())}
        if len(by_width) < 2:
            self.skipTest("the machine has fewer than two vector widths")

        def fn(a: torch.Tensor) -> torch.Tensor:
            return a.t().contiguous()

        x = torch.randn(33, 33)
        for width in sorted(by_width, reverse=True):
            with self.subTest(width=width), config.patch({"cpp.simdlen": width}):
                torch._dynamo.reset()
                (source,) = self.check(fn, (x,))
                self.assertIn("at::vec::", source)
                command = codecache.toolchain().kernel_compile("k.cpp").fingerprint()
                for macro in by_width[width].build_macro():
                    self.assertRegex(command, rf"-D\s*{macro}\b")


class TestRecordedFacts(CppWrapperTestCase):
    """What the generator records as it emits the body, for whoever must know
    what the body does (the CUDA wrapper, to decide on a CUDA-graph replay)."""

    def compile_recording(self, fn: Any, *args: Any) -> CppWrapperCpu:
        """Compiles and runs `fn` against eager; returns its one wrapper."""
        expected = fn(*args)
        created: list[CppWrapperCpu] = []
        original = CppWrapperCpu.create.__func__  # type: ignore[attr-defined]

        def recording_create(cls: type, *a: Any, **k: Any) -> CppWrapperCpu:
            created.append(original(cls, *a, **k))
            return created[-1]

        with (
            config.patch(cpp_wrapper=True, fx_graph_cache=False),
            mock.patch.object(CppWrapperCpu, "create", classmethod(recording_create)),
        ):
            actual = torch.compile(fn)(*args)
        self.assertEqual(actual, expected)
        (wrapper,) = created
        return wrapper

    def test_kernels_only_block_nothing(self) -> None:
        wrapper = self.compile_recording(lambda x: (x.sin() + 1).sum(), torch.randn(8))
        self.assertEqual(wrapper.replay_blockers, [])
        self.assertTrue(wrapper.launches)
        self.assertEqual({device for device, _ in wrapper.launches}, {"cpu"})

    def test_dispatcher_call_and_host_read_are_recorded(self) -> None:
        @torch.library.custom_op("cppwrap_test::twice", mutates_args=())
        def twice(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @twice.register_fake
        def _(x):
            return torch.empty_like(x)

        def fn(p, x):
            y = twice(x.sin())
            return torch.cond(p, lambda y: y + 1, lambda y: y - 1, (y,))

        wrapper = self.compile_recording(fn, torch.tensor(True), torch.randn(8))
        self.assertEqual(
            wrapper.replay_blockers,
            ["cppwrap_test.twice.default runs through the dispatcher", HOST_READ],
        )


if __name__ == "__main__":
    run_tests()
