"""The C++ launcher that CppWrapperGpu writes for a tuned Triton kernel: its
text, and that it compiles (with the cubin embedded) against our headers.
Needs no GPU: the cubin here is a stand-in file."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import sympy
import torch
from torch._inductor.test_case import TestCase, run_tests
from torch._inductor.virtualized import V

from tests.common import seed_cache
from torch_cppwrap._inductor import codecache
from torch_cppwrap._inductor.codegen import cpp_wrapper_gpu as gpu
from torch_cppwrap._inductor.graph import _wrapper_device_type
from torch_cppwrap._inductor.runtime import cuda_graphs

FAKE_CUBIN = b"\x7fELF stand-in for a cubin \x00\x01\x02"


def tuned_kernel(cubin_path: str, **overrides: object) -> gpu.TunedKernel:
    fields: dict = dict(
        name="triton_poi_fused_add_0",
        entry="triton_poi_fused_add_0",
        cubin_path=cubin_path,
        shared_bytes=0,
        num_warps=4,
        launcher_args=("in_ptr0", "in_ptr1", "out_ptr0", "scale", "xnumel"),
        params=(
            gpu.KernelParam("in_ptr0", "*fp32"),
            gpu.KernelParam("in_ptr1", "*fp32"),
            gpu.KernelParam("out_ptr0", "*fp32"),
            gpu.KernelParam("scale", "fp32"),
            gpu.KernelParam("xnumel", "i32"),
        ),
        grid_prefix=(),
        grid=("((xnumel + (1024 - 1)) / (1024))", "1", "1"),
        global_scratch=0,
        profile_scratch=0,
        description="XBLOCK=1024, num_warps=4",
    )
    fields.update(overrides)
    return gpu.TunedKernel(**fields)


SIGNATURE = gpu.LaunchSignature(
    "triton_poi_fused_add_0",
    ("tensor", "tensor", "tensor", "float", "int"),
    "# kernel path: /tmp/x.py\n# Source Nodes: [add]",
)


class TestLauncherText(TestCase):
    def test_parameters_in_cubin_order_then_scratch(self) -> None:
        text = gpu.render_launcher(tuned_kernel("/k.cubin"), SIGNATURE)
        self.assertIn("// kernel path: /tmp/x.py", text)
        self.assertIn(
            'CPPWRAP_CUDA_EMBED_CUBIN(cubin_triton_poi_fused_add_0, "/k.cubin");', text
        )
        self.assertIn(
            "CPPWRAP_CUDA_LAUNCHER void launch_triton_poi_fused_add_0("
            "int32_t device, void* stream, "
            "const cppwrap::Tensor& in_ptr0, const cppwrap::Tensor& in_ptr1, "
            "const cppwrap::Tensor& out_ptr0, double scale, int64_t xnumel)",
            text,
        )
        self.assertIn("float scale_arg = static_cast<float>(scale);", text)
        self.assertIn("int32_t xnumel_arg = static_cast<int32_t>(xnumel);", text)
        self.assertIn(
            "void* params[] = {&in_ptr0_arg, &in_ptr1_arg, &out_ptr0_arg, &scale_arg, "
            "&xnumel_arg, &global_scratch, &profile_scratch};",
            text,
        )
        # 4 warps of 32 threads.
        self.assertIn('"triton_poi_fused_add_0", 0, 128);', text)

    def test_the_wrapper_declares_what_the_launchers_define(self) -> None:
        # The wrapper compiles before the kernels are tuned: it declares each
        # launcher from the call's argument kinds alone.
        self.assertEqual(
            gpu.launcher_prototype("triton_poi_fused_add_0", SIGNATURE),
            "CPPWRAP_CUDA_LAUNCHER void launch_triton_poi_fused_add_0(int32_t, void*, "
            "const cppwrap::Tensor&, const cppwrap::Tensor&, const cppwrap::Tensor&, "
            "double, int64_t)",
        )

    def test_a_kernel_without_arguments_still_names_device_and_stream(self) -> None:
        bare = gpu.LaunchSignature("triton_poi_fused_add_0", ())
        self.assertEqual(
            gpu.launcher_prototype("triton_poi_fused_add_0", bare, ()),
            "CPPWRAP_CUDA_LAUNCHER void launch_triton_poi_fused_add_0("
            "int32_t device, void* stream)",
        )

    def test_scratch_is_allocated_per_program(self) -> None:
        text = gpu.render_launcher(
            tuned_kernel("/k.cubin", global_scratch=64), SIGNATURE
        )
        self.assertIn(
            "cppwrap::cuda::scratch(device, uint64_t(grid_x) * grid_y * grid_z, 64)",
            text,
        )
        self.assertIn("void* profile_scratch = nullptr;", text)

    def test_no_scratch_parameters_when_the_kernel_takes_none(self) -> None:
        text = gpu.render_launcher(
            tuned_kernel("/k.cubin", global_scratch=None, profile_scratch=None),
            SIGNATURE,
        )
        self.assertNotIn("scratch", text)

    def test_argument_count_mismatch_is_reported(self) -> None:
        short = gpu.LaunchSignature("triton_poi_fused_add_0", ("tensor",))
        with self.assertRaisesRegex(NotImplementedError, "called with 1 arguments"):
            gpu.render_launcher(tuned_kernel("/k.cubin"), short)


def autotuner_of(result: Any, launcher: Any) -> SimpleNamespace:
    """A CachingAutotuner after tuning, as far as the wrapper reads one."""
    return SimpleNamespace(
        fn=SimpleNamespace(__name__="triton_poi_fused_add_0"),
        launchers=[launcher],
        compile_results=[result],
        triton_meta={"signature": dict(SIGNATURE_TYPES), "constants": {}},
        inductor_meta={"grid_type": "Grid1D"},
    )


ARG_NAMES = ["in_ptr0", "in_ptr1", "out_ptr0", "scale", "xnumel", "XBLOCK"]
SIGNATURE_TYPES = {
    "in_ptr0": "*fp32",
    "in_ptr1": "*fp32",
    "out_ptr0": "*fp32",
    "scale": "fp32",
    "xnumel": "i32",
    "XBLOCK": "constexpr",
}


def tuned_config() -> Any:
    """Triton's Config where Triton is installed; Inductor's stand-in for it
    (object) takes anything with the same fields."""
    from torch._inductor.runtime.triton_compat import Config

    if Config is object:
        return SimpleNamespace(kwargs={"XBLOCK": 1024}, num_warps=4, num_stages=1)
    return Config({"XBLOCK": 1024}, num_warps=4, num_stages=1)


class TestTunedKernel(TestCase):
    """What the wrapper reads of a kernel the tuning block ran, from Inductor's
    compile results (no store_cubin), on stand-ins for Triton's objects."""

    def test_a_statically_launched_kernel_takes_the_cubin_in_tritons_cache(
        self,
    ) -> None:
        from torch._inductor.runtime.triton_heuristics import (
            StaticTritonCompileResult,
        )

        cfg = tuned_config()
        kernel = SimpleNamespace(
            name="triton_poi_fused_add_0",
            arg_names=ARG_NAMES,
            declared_constexprs=[5],
            full_constexprs=[5],
            shared=16,
            num_warps=4,
            has_global_scratch=True,
            has_profile_scratch=False,
        )
        result = StaticTritonCompileResult(
            kernel,
            cfg,
            {"device": 0, "constants": {}, "signature": dict(SIGNATURE_TYPES)},
            {"grid_type": "Grid1D"},
        )
        launcher = SimpleNamespace(config=cfg, cache_hash="ab12", _is_static=True)
        with tempfile.TemporaryDirectory() as triton_cache:
            cubin = Path(triton_cache, "ab12", "triton_poi_fused_add_0.cubin")
            cubin.parent.mkdir()
            cubin.write_bytes(FAKE_CUBIN)
            with mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": triton_cache}):
                tuned = gpu.tuned_kernel_from_autotuner(
                    "triton_poi_fused_add_0", autotuner_of(result, launcher)
                )
                # The graph's own copy, named by content: Triton's cache may go.
                self.assertNotEqual(tuned.cubin_path, str(cubin))
                self.assertEqual(Path(tuned.cubin_path).read_bytes(), FAKE_CUBIN)
            cubin.unlink()
            with (
                mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": triton_cache}),
                self.assertRaisesRegex(RuntimeError, "its cubin is not at"),
            ):
                gpu.tuned_kernel_from_autotuner(
                    "triton_poi_fused_add_0", autotuner_of(result, launcher)
                )
        self.assertEqual(tuned.entry, "triton_poi_fused_add_0")
        self.assertEqual((tuned.shared_bytes, tuned.num_warps), (16, 4))
        self.assertEqual(tuned.launcher_args, tuple(ARG_NAMES[:5]))
        self.assertEqual(
            [p.name for p in tuned.params],
            ["in_ptr0", "in_ptr1", "out_ptr0", "scale", "xnumel"],
        )
        self.assertEqual((tuned.global_scratch, tuned.profile_scratch), (0, None))
        self.assertEqual(tuned.grid[0], "((xnumel + (1024 - 1)) / (1024))")
        text = gpu.render_launcher(tuned, SIGNATURE)
        self.assertIn("void* global_scratch = nullptr;", text)

    def test_a_kernel_launched_by_triton_is_read_from_its_binary(self) -> None:
        # Without store_cubin its launcher keeps no binary: one is made again
        # from the compile result, with store_cubin, and nothing else changes.
        cfg = tuned_config()
        binary = SimpleNamespace(
            metadata=SimpleNamespace(
                name="triton_poi_fused_add_0", shared=0, num_warps=4, num_stages=1
            ),
            asm={"cubin": FAKE_CUBIN},
        )
        made: list[dict[str, Any]] = []

        class CompileResult:
            def __init__(self) -> None:
                self.config = cfg
                self.inductor_meta = {"store_cubin": False}

            def make_launcher(self) -> SimpleNamespace:
                made.append(self.inductor_meta)
                keeps = self.inductor_meta["store_cubin"]
                return SimpleNamespace(
                    config=cfg,
                    bin=binary if keeps else None,
                    def_args=ARG_NAMES[:5],
                    call_args=ARG_NAMES[:5],
                )

        result = CompileResult()
        launcher = result.make_launcher()
        tuned = gpu.tuned_kernel_from_autotuner(
            "triton_poi_fused_add_0", autotuner_of(result, launcher)
        )
        self.assertEqual(Path(tuned.cubin_path).read_bytes(), FAKE_CUBIN)
        self.assertEqual(tuned.launcher_args, tuple(ARG_NAMES[:5]))
        self.assertEqual([m["store_cubin"] for m in made], [False, True])
        self.assertEqual(result.inductor_meta, {"store_cubin": False})


class TestRandomDraws(TestCase):
    """Which FX nodes block a replay because they draw random numbers."""

    def node(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        return graph.call_function(target, (x, x, x, *args), kwargs)

    def test_attention_without_dropout_draws_nothing(self) -> None:
        aten = torch.ops.aten
        for node in (
            self.node(
                aten._scaled_dot_product_efficient_attention.default, None, False
            ),
            self.node(aten._scaled_dot_product_flash_attention.default, 0.0, True),
            self.node(
                aten._scaled_dot_product_cudnn_attention.default,
                None,
                False,
                dropout_p=0.0,
            ),
        ):
            self.assertFalse(gpu._draws_random_numbers(node), node.target)

    def test_attention_with_dropout_and_random_ops_draw(self) -> None:
        aten = torch.ops.aten
        graph = torch.fx.Graph()
        p = graph.placeholder("p")  # a dropout probability only known at run time
        for node in (
            self.node(aten._scaled_dot_product_flash_attention.default, 0.1),
            self.node(
                aten._scaled_dot_product_efficient_attention.default,
                None,
                False,
                dropout_p=0.5,
            ),
            self.node(aten._scaled_dot_product_flash_attention.default, p),
            self.node(aten.native_dropout.default),
            self.node(aten.bernoulli.p),
        ):
            self.assertTrue(gpu._draws_random_numbers(node), node.target)
        self.assertFalse(gpu._draws_random_numbers(self.node(aten.add.Tensor)))

    def test_attention_backward_draws_nothing_of_its_own(self) -> None:
        # Tagged as seeded, with a dropout: it redraws its forward's mask from
        # the RNG state it is given (philox seed and offset).
        aten = torch.ops.aten
        backward = aten._scaled_dot_product_efficient_attention_backward.default
        self.assertIn(torch.Tag.nondeterministic_seeded, backward.tags)
        node = self.node(backward, *[None] * 6, 0.1, [True] * 4)
        self.assertFalse(gpu._draws_random_numbers(node))


class TestRngStateInputs(TestCase):
    def test_attention_backward_names_its_rng_state_inputs(self) -> None:
        aten = torch.ops.aten
        graph = torch.fx.Graph()
        grad, q, k, v, out, lse, seed, offset = (
            graph.placeholder(n)
            for n in ("grad", "q", "k", "v", "out", "lse", "seed", "offset")
        )
        graph.call_function(aten.add.Tensor, (q, k))
        graph.call_function(
            aten._scaled_dot_product_efficient_attention_backward.default,
            (grad, q, k, v, None, out, lse, seed, offset, 0.1, [True] * 4),
        )
        wrapper = object.__new__(gpu.CppWrapperGpu)
        names = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
        wrapper.get_graph_input_names = lambda: names  # type: ignore[method-assign]
        with V.set_graph_handler(SimpleNamespace(graph=graph)):  # type: ignore[arg-type]
            self.assertEqual(wrapper.rng_state_inputs, ["seed", "offset"])
            self.assertIn(
                "cppwrap::cuda::host_rng_state(offset);", wrapper.body_prologue()
            )


class TestReplayOutputs(TestCase):
    """Where a replay takes each output from (cuda_graphs._output_sources),
    and that the capturing call returns what a replay would.  Plain tensors
    stand in for the graph's pool."""

    def test_each_kind_of_output(self) -> None:
        cpu = torch.device("cpu")
        weight, moved = torch.randn(4, 4), torch.randn(8)
        pool_a, pool_b = torch.randn(6, 4), torch.randn(3, 5)
        outputs = (
            pool_b,  # memory of its own: copied as it is
            None,  # a gradient nobody asked for
            weight,  # an input handed on (a saved parameter)
            moved[2:6],  # a view of an input
            pool_a,
            pool_a.view(24)[4:12].view(2, 4),  # shares pool_a's memory
            pool_b.t()[1:3],  # not dense, and shares pool_b's memory
        )
        found = cuda_graphs._output_sources(outputs, [weight, 3, moved], cpu)
        assert not isinstance(found, str), found
        sources, groups = found
        kinds = [(s[0], s[2], s[3]) for s in sources]
        self.assertEqual(
            kinds,
            [
                (cuda_graphs.GROUP, 0, 0),
                (cuda_graphs.INPUT, 0, 0),
                (cuda_graphs.INPUT_VIEW, 2, 2),
                (cuda_graphs.GROUP, 1, 0),
                (cuda_graphs.GROUP, 1, 4),
                (cuda_graphs.GROUP, 0, 1),
            ],
        )
        self.assertEqual([nbytes for _, nbytes in groups], [60, 96])

        # The caller's inputs, at new addresses: aliases follow them.
        caller = [weight.clone(), 3, moved.clone()]
        runtime = codecache.RuntimeExtension.load()
        owner = 7  # stands in for the GraphReplay
        epoch = runtime.pool_epoch()
        results = cuda_graphs._replayed_outputs(
            outputs,
            sources,
            groups,
            caller,
            lambda t: runtime.pool_lend(t, owner, 0, epoch),
        )
        self.assertIsNone(results[1])
        self.assertIs(results[2], caller[0])
        self.assertEqual(results[3].data_ptr(), caller[2][2:].data_ptr())
        for got, want in zip(results, outputs, strict=True):
            if want is not None:
                self.assertEqual(got, want)
                self.assertEqual(got.stride(), want.stride())
        # Loans of the pool, not copies, as a replay hands out: where outputs
        # shared the pool's memory, views of one loan.
        for i in (0, 4, 5, 6):
            self.assertEqual(runtime.pool_lender(results[i]), owner)
            self.assertEqual(results[i].data_ptr(), outputs[i].data_ptr())
        self.assertEqual(results[4].untyped_storage().nbytes(), 96)
        for view, whole in ((5, 4), (6, 0)):
            self.assertEqual(
                results[view].untyped_storage()._cdata,
                results[whole].untyped_storage()._cdata,
            )

    def test_a_warm_up_lends_each_storage_once(self) -> None:
        cpu = torch.device("cpu")
        weight, pool = torch.randn(4), torch.randn(3, 4)
        outputs = (pool, weight[1:], pool[1], None, 5, pool.t())
        lent: list[torch.Tensor] = []

        def lend(t: torch.Tensor) -> torch.Tensor:
            lent.append(t)
            return t.detach().clone()  # stands in for a loan: other memory

        results = cuda_graphs._lent_out(outputs, [weight], cpu, lend)
        self.assertEqual(len(lent), 1)  # pool's storage, once
        self.assertIs(results[1], outputs[1])  # a view of an input, as it is
        self.assertEqual(results[3:5], (None, 5))
        for i in (0, 2, 5):
            self.assertEqual(results[i], outputs[i])
            self.assertEqual(results[i].stride(), outputs[i].stride())
            self.assertNotEqual(results[i].data_ptr(), outputs[i].data_ptr())
        # Aliases of one loan, as the pool's outputs were of one block.
        self.assertEqual(results[2].data_ptr(), results[0].data_ptr() + 16)
        self.assertEqual(results[5].data_ptr(), results[0].data_ptr())
        # Outputs on another device than the graph's are not the pool's.
        self.assertIs(
            cuda_graphs._lent_out([pool], [], torch.device("meta"), lend)[0], pool
        )

    def test_a_lone_dense_output_is_copied_whole(self) -> None:
        out = torch.randn(2, 3).t()  # dense in another order of dimensions
        found = cuda_graphs._output_sources([out], [], torch.device("cpu"))
        assert not isinstance(found, str), found
        sources, groups = found
        ((source, tensor, _, _, nbytes),) = sources
        self.assertEqual((source, nbytes, groups), (cuda_graphs.OWN, 24, []))
        self.assertIs(tensor, out)

    def test_a_copy_spans_first_to_last_element(self) -> None:
        # What a replay copies of an input that moved: gaps and all.
        base = torch.randn(4, 6)
        for t, nbytes in (
            (base, 96),
            (base.t(), 96),
            (base[:, 1:3], 80),  # elements 0 to 19 of its view
            (torch.randn(6).expand(4, 6), 24),
            (base[:0], 0),
        ):
            self.assertEqual(cuda_graphs._extent(t), nbytes, t.stride())

    def test_a_moving_input_is_buffered_with_its_layout(self) -> None:
        base = torch.randn(6, 8)
        for arg in (
            base[1:5, 2:7].t(),  # strided, with gaps
            torch.randn(8).expand(5, 8),  # elements sharing memory
            base[2:2],  # empty
        ):
            buffer = cuda_graphs._input_buffer(arg)
            self.assertEqual(buffer, arg)
            self.assertEqual(buffer.stride(), arg.stride())
            self.assertEqual(buffer.storage_offset(), 0)
            # What a replay copies (from data_ptr, _extent bytes) fits in it.
            self.assertEqual(
                buffer.untyped_storage().nbytes(), cuda_graphs._extent(arg)
            )

    def test_what_cannot_be_replayed_says_why(self) -> None:
        cpu = torch.device("cpu")
        x = torch.randn(4)
        base = torch.randn(4)
        for outputs, inputs, why in (
            ([3], [], "an output is not a tensor"),
            ([x.to("meta")], [], "an output is on meta"),
            ([base, base.view(torch.int32)], [], "as different dtypes"),
            ([x.view(torch.int32)], [x], "views an input as another dtype"),
        ):
            result = cuda_graphs._output_sources(outputs, inputs, cpu)
            self.assertIsInstance(result, str)
            self.assertIn(why, result)


class TestPrefetch(TestCase):
    def test_prefetch_is_for_the_device_the_wrapper_is_for(self) -> None:
        # A CUDA graph's compile prefetches the CUDA wrapper's header, not
        # the CPU one's and Inductor's kernel header (GraphLowering says
        # "cpu" until its codegen starts).
        for device_types, expected in (
            ({"cuda"}, "cuda"),
            ({"cpu", "cuda"}, "cuda"),
            ({"cpu"}, "cpu"),
            ({"meta"}, "cpu"),
            (set(), "cpu"),
        ):
            graph = SimpleNamespace(device_types=device_types, device_type="cpu")
            self.assertEqual(_wrapper_device_type(graph), expected, device_types)


# A module that lends input 0 as a replayed graph lends an output (mode 0),
# takes loans back as a replay does before it runs (mode 1: those of a later
# capture than this lender's; mode 2: this lender's), and says how many held
# loans it moved (copied out, here with memcpy: these are CPU tensors).
LOAN_SOURCE = """
#include <cstring>
#include "cppwrap_runtime.h"

static int64_t copies = 0;
static int stream = 0;  // stands in for the stream the pool serves

static int host_copy(void*, void* to, const void* from, size_t bytes) {
    std::memcpy(to, from, bytes);
    ++copies;
    return 0;
}

static PyObject* call_impl(PyObject* /*module*/, PyObject* args) {
    if (!cppwrap::check_args(args, 2)) return nullptr;
    cppwrap::Tensor pool;
    if (!cppwrap::unpack_tensor(args, 0, pool, "pool")) return nullptr;
    const long mode = PyLong_AsLong(PyList_GET_ITEM(args, 1));
    cppwrap::clear_args(args);
    static const int64_t epoch = cppwrap::api->pool_epoch();
    cppwrap::Tensor out;
    if (mode == 0) {
        if (cppwrap::api->pool_lend(pool.slot(), &stream, &stream, epoch, out.slot()) != 0) {
            PyErr_SetString(PyExc_RuntimeError, cppwrap::api->last_error());
            return nullptr;
        }
        return cppwrap::pack_outputs<1>({cppwrap::output(out)});
    }
    // A CPU tensor's device has index -1.
    const int64_t since = epoch + (mode == 1 ? 1 : 0);
    if (cppwrap::api->pool_reclaim(-1, &stream, since, host_copy, nullptr) != 0) {
        PyErr_SetString(PyExc_RuntimeError, cppwrap::api->last_error());
        return nullptr;
    }
    return cppwrap::pack_outputs<1>({cppwrap::output(copies)});
}

CPPWRAP_DEFINE_MODULE("loan test")
"""


class TestPoolLoans(TestCase):
    """The runtime's loans of pool memory (cppwrap_api.h: pool_lend,
    pool_reclaim, pool_lender), on CPU tensors: what a replay hands out, and
    that a held output keeps its values when the pool is written again."""

    def test_a_held_loan_moves_out_and_a_dropped_one_does_not(self) -> None:
        seed_cache()
        module = codecache.CppWrapperCodeCache.load(LOAN_SOURCE)
        runtime = codecache.RuntimeExtension.load()
        pool = torch.arange(6.0)
        (lent,) = module.call([pool, 0])
        lender = runtime.pool_lender(lent)
        self.assertNotEqual(lender, 0)
        self.assertEqual(runtime.pool_lender(pool), 0)
        self.assertEqual(lent.data_ptr(), pool.data_ptr())
        view = lent[2:]
        self.assertEqual(runtime.pool_lender(view), lender)
        # A graph captured after the lender leaves the loan alone.
        self.assertEqual(module.call([pool, 1]), (0,))
        self.assertEqual(lent.data_ptr(), pool.data_ptr())
        # The lender's next replay: the held loan moves to memory of its own,
        # with its values, before the pool is written again.
        self.assertEqual(module.call([pool, 2]), (1,))
        self.assertNotEqual(lent.data_ptr(), pool.data_ptr())
        self.assertEqual(runtime.pool_lender(view), 0)
        pool.fill_(-1.0)
        self.assertEqual(view, torch.arange(2.0, 6.0))
        self.assertEqual(lent, torch.arange(6.0))
        # A loan nobody holds any more is taken back without a copy; one
        # resized has memory of its own already.
        (again,) = module.call([pool, 0])
        del again
        (resized,) = module.call([pool, 0])
        resized.resize_(12)
        self.assertEqual(runtime.pool_lender(resized), 0)
        self.assertEqual(resized[:6], pool)
        self.assertEqual(module.call([pool, 2]), (1,))


class TestLauncherCompiles(TestCase):
    def test_module_with_launcher_compiles_and_embeds_the_cubin(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "kernel.cubin"
            cubin.write_bytes(FAKE_CUBIN)
            # Both translation units include every runtime header, as the
            # generated ones do: nothing they define may clash at the link.
            includes = [f'#include "{codecache.WRAPPER_HEADERS["cuda"]}"']
            launchers = "\n".join(
                [
                    *includes,
                    gpu.render_launcher(
                        tuned_kernel(
                            str(cubin), shared_bytes=80 * 1024, global_scratch=32
                        ),
                        SIGNATURE,
                    ),
                ]
            )
            source = "\n".join(
                [
                    *includes,
                    gpu.launcher_prototype("triton_poi_fused_add_0", SIGNATURE) + ";",
                    "static PyObject* call_impl(PyObject*, PyObject*) {",
                    "  cppwrap::Tensor a, b, c;",
                    "  try {",
                    "    cppwrap::GilRelease nogil;",
                    "    cppwrap::cuda::DeviceGuard device_guard(0);",
                    "    void* stream0 = cppwrap::cuda::current_stream(0);",
                    "    launch_triton_poi_fused_add_0(0, stream0, a, b, c, 0.5, 1000);",
                    "  } catch (...) {",
                    "    return cppwrap::raise_current();",
                    "  }",
                    "  Py_RETURN_NONE;",
                    "}",
                    'CPPWRAP_DEFINE_MODULE("launcher test")',
                ]
            )
            (Path(tmp) / "wrapper.cpp").write_text(source)
            (Path(tmp) / "launchers.cpp").write_text(launchers)
            tc = codecache.toolchain()
            wrapper = tc.wrapper_compile("cuda", "wrapper.cpp")
            self.assertIn("-D USE_CUDA", wrapper.command())
            link = tc.link(["wrapper.o", "launchers.o"])
            # libtorch_cuda comes in through libtorch.so (see _Toolchain.link).
            self.assertNotIn("-ltorch_cuda", link.command())
            obj = wrapper.run(Path(tmp), Path(tmp) / "wrapper.cpp")
            self.assertNotIn(FAKE_CUBIN, obj.read_bytes())
            launcher_obj = tc.wrapper_compile(
                "cuda", "launchers.cpp", name="launchers"
            ).run(Path(tmp), Path(tmp) / "launchers.cpp")
            self.assertIn(FAKE_CUBIN, launcher_obj.read_bytes())
            module = link.run(Path(tmp), Path(tmp) / "wrapper.cpp")

            # The wrapper's call reached the launcher's definition, which
            # stays inside the module.
            def defined(*flags: str) -> str:
                return subprocess.run(
                    ["nm", "--defined-only", *flags, str(module)],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout

            self.assertIn("launch_triton_poi_fused_add_0", defined())
            exported = defined("-D")
            self.assertIn("PyInit_cppwrap_graph", exported)
            self.assertNotIn("launch_triton_poi_fused_add_0", exported)

    def test_module_replayed_as_a_cuda_graph_compiles(self) -> None:
        # The entry point CppWrapperGpu writes for a graph it may replay as one
        # CUDA graph, around a stand-in body, built against our headers: for
        # fixed shapes, and for dynamic ones (one graph per value of input 2,
        # an int, and per size of input 0) that draw random numbers.  Its
        # second output is None, which a replay leaves alone.
        graph = torch.fx.Graph()
        dropout = graph.call_function(
            torch.ops.aten.native_dropout.default, (graph.placeholder("x"), 0.5, True)
        )
        # Up to 8 graphs either way: one per set of parameters too.
        for keys, n_graphs, random_nodes in (
            ([], 8, []),
            ([0, 2], 8, [dropout]),
        ):
            wrapper = object.__new__(gpu.CppWrapperGpu)
            wrapper.__dict__["cuda_graph_blocker"] = None
            wrapper.__dict__["_random_nodes"] = random_nodes
            # Input 1 is attention's RNG state where the graph draws.
            wrapper.__dict__["rng_state_inputs"] = ["arg1_1"] if random_nodes else []
            wrapper.output_kinds = ["tensor", "none"]
            wrapper.get_graph_input_names = lambda: ["arg0_1", "arg1_1", "s0"]  # type: ignore[method-assign]
            wrapper.get_graph_inputs = lambda: {  # type: ignore[method-assign]
                "arg0_1": None,
                "arg1_1": None,
                "s0": sympy.Symbol("s0", integer=True),
            }
            wrapper.cuda_graph_key_inputs = lambda keys=keys: keys  # type: ignore[method-assign]
            opening = wrapper.call_opening()
            body_opening = wrapper.body_opening()
            prologue = wrapper.body_prologue()
            self.assertEqual(
                "cppwrap::cuda::host_rng_state(arg1_1);" in prologue, bool(random_nodes)
            )
            draws = "true" if random_nodes else "false"
            self.assertIn(
                "    return new cppwrap::cuda::GraphReplays(3, 1, "
                f"{{{', '.join(map(str, keys))}}}, {n_graphs}, /*draws_random=*/{draws});",
                opening,
            )
            self.assertEqual(
                any("aten.native_dropout.default" in line for line in opening),
                bool(random_nodes),
            )
            self.assertIn(
                "cppwrap::Tensor* const graph_outputs[] = {&out0};", body_opening
            )
            if keys:
                self.assertIn(
                    f"// One graph per set of sizes of inputs {keys} "
                    f"({n_graphs} graphs at most).",
                    opening,
                )
            # The first two calls go through cuda_graphs (warm-up, capture).
            self.assertIn(
                "        PyObject* outputs = cuda_graph->prepare(graph_module, args, run_kernels);",
                opening,
            )
            self.assertIn(
                "const cppwrap::Tensor* const graph_inputs[] = {&arg0_1, &arg1_1, nullptr};",
                body_opening,
            )
            self.assertIn(
                "if (replayed != cppwrap::cuda::GraphReplay::kReplayed) {", body_opening
            )
            source = "\n".join(
                [
                    f'#include "{codecache.WRAPPER_HEADERS["cuda"]}"',
                    *opening,
                    "  if (!cppwrap::check_args(args, 3)) return nullptr;",
                    "  cppwrap::Tensor arg0_1;",
                    "  cppwrap::Input arg1_1;",
                    "  int64_t s0 = 0;",
                    '  if (!cppwrap::unpack_tensor(args, 0, arg0_1, "arg0_1") ||',
                    '      !cppwrap::unpack_tensor(args, 1, arg1_1, "arg1_1") ||',
                    '      !cppwrap::unpack_int(args, 2, s0, "s0")) return nullptr;',
                    "  cppwrap::clear_args(args);",
                    "  cppwrap::Tensor out0;",
                    "  try {",
                    "    cppwrap::GilRelease nogil;",
                    *body_opening,
                    *prologue,
                    "      cppwrap::cuda::DeviceGuard device_guard(0);",
                    "      out0 = std::move(arg0_1);",
                    "    }",
                    "  } catch (...) {",
                    "    return cppwrap::raise_current();",
                    "  }",
                    "  return cppwrap::pack_outputs<2>(",
                    "      {cppwrap::output(out0), cppwrap::output_none()});",
                    "}",
                    *wrapper.module_definition(),
                ]
            )
            with tempfile.TemporaryDirectory() as tmp:
                (Path(tmp) / "wrapper.cpp").write_text(source)
                build = codecache.toolchain().wrapper_compile("cuda", "wrapper.cpp")
                self.assertTrue(
                    build.run(Path(tmp), Path(tmp) / "wrapper.cpp").is_file()
                )


if __name__ == "__main__":
    run_tests()
