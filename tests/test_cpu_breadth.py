"""Beyond the foundation: dynamic shapes, training, constants, random ops,
attention and friends, threads, the profiler, and clear errors for what is
not supported."""

from __future__ import annotations

import copy
import functools
import re
import threading
import unittest

import torch
import torch.nn.functional as F
from torch._inductor import config
from torch._inductor.test_case import run_tests
from torch._inductor.utils import run_and_get_code

from tests.common import CppWrapperTestCase, our_wrappers_created
from torch_cppwrap._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu


class TestDynamicShapes(CppWrapperTestCase):
    def test_dynamic_true_serves_several_sizes_without_recompiling(self) -> None:
        def fn(x, y):
            return (x * y).sum(1) + x.shape[0]

        x, y = torch.randn(4, 5), torch.randn(4, 5)
        (source,) = self.check(fn, (x, y), dynamic=True)
        self.assertIn("int64_t s", source)  # a size symbol read in C++
        compiled = torch.compile(fn, dynamic=True)
        with config.patch(cpp_wrapper=True, fx_graph_cache=False):
            compiled(x, y)
            frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            for n in (7, 13, 2):
                a, b = torch.randn(n, 5), torch.randn(n, 5)
                torch.testing.assert_close(compiled(a, b), fn(a, b))
            self.assertEqual(
                torch._dynamo.utils.counters["stats"]["unique_graphs"], frames_before
            )

    def test_mark_dynamic_with_extern_kernel(self) -> None:
        def fn(x):
            return F.relu(x @ x.t())

        x = torch.randn(9, 6)
        torch._dynamo.mark_dynamic(x, 0)
        (source,) = self.check(fn, (x,), atol=1e-4, rtol=1e-4)
        self.assertRegex(source, r"int64_t s\d+")

    def test_jagged_nested_tensor(self) -> None:
        # The graph takes the ragged size as a nested int, a symbol with no
        # value; the Python wrapper binds it and never reads it.
        weight = torch.randn(16, 8)

        def fn(t):
            return (F.linear(t, weight).relu() * 2).values()

        for lengths in ((3, 5), (2, 7, 4)):
            nt = torch.nested.nested_tensor(
                [torch.randn(n, 8) for n in lengths], layout=torch.jagged
            )
            result, (source,) = self.compile_and_run(fn, (nt,), dynamic=None)
            torch.testing.assert_close(result, fn(nt), atol=1e-4, rtol=1e-4)
            self.assertRegex(source, r"// args\[\d+\] \(\w+\): unused")

    def test_symbolic_int_output(self) -> None:
        def fn(x):
            return x * 2, x.shape[0] * 3

        x = torch.randn(5, 2)
        torch._dynamo.mark_dynamic(x, 0)
        (source,) = self.check(fn, (x,))
        self.assertRegex(source, r"int64_t s\d+")


class TestTrainingAndConstants(CppWrapperTestCase):
    def test_small_model_trains_like_eager(self) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1)
        )
        reference = copy.deepcopy(model)
        compiled = torch.compile(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        with our_wrappers_created() as created:
            for _ in range(3):
                x = torch.randn(4, 8)
                loss = compiled(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                ref_loss = reference(x).pow(2).mean()
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                torch.testing.assert_close(loss, ref_loss)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q)
        self.assertEqual(len(created), 2)  # the forward and the backward graph

    def test_compiled_autograd_with_hooks_in_the_region(self) -> None:
        # A hook registered inside the compiled region hands the forward graph
        # a BackwardState input, which Inductor keeps no value for.
        def build() -> torch.nn.Module:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)
            )
            model[0].weight.register_hook(lambda g: g * 2)
            return model

        def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            y = model(x)
            y.register_hook(lambda g: g + 1)
            loss = y.sum()
            loss.backward()
            return loss

        model, reference = build(), build()
        x = torch.randn(4, 8)
        for _ in range(2):  # the second accumulates into .grad
            step(reference, x)
        with (
            torch._dynamo.config.patch(compiled_autograd=True),
            our_wrappers_created() as created,
        ):
            # torch.compile reads the setting when it wraps the function.
            compiled = torch.compile(functools.partial(step, model))
            _, sources = run_and_get_code(compiled, x)
            compiled(x)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
        self.assertGreaterEqual(len(created), 2)  # the forward, compiled autograd's
        self.assertRegex("\n".join(sources), r"// args\[\d+\] \(\w+\): unused")

    def test_freezing_folds_constants(self) -> None:
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        ).eval()
        with torch.no_grad(), config.patch(freezing=True):
            (source,) = self.check(model, (torch.randn(2, 8),), atol=1e-4, rtol=1e-4)
        self.assertIn("cppwrap::load_constants", source)

    @unittest.skipUnless(torch.backends.mkldnn.is_available(), "needs oneDNN")
    def test_a_fused_convolution_is_spelled_alike_in_every_process(self) -> None:
        # Freezing fuses the convolution and its ReLU by a pattern, and
        # Inductor (torch 2.13 on) names the fused op in its size check by the
        # pattern's functools.partial, whose repr holds a function's address:
        # left in, each process would have its own source, and its own
        # library to build.
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
        with torch.no_grad(), config.patch(freezing=True):
            (source,) = self.check(
                model, (torch.randn(2, 3, 8, 8),), atol=1e-4, rtol=1e-4
            )
        self.assertIn("convolution_pointwise", source)
        self.assertEqual(re.findall(r" at 0x[0-9a-fA-F]+", source), [])

    def test_parameters_and_buffers_as_inputs(self) -> None:
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16)
        ).eval()
        with torch.no_grad():
            self.check(model, (torch.randn(3, 8),), atol=1e-5, rtol=1e-5)


class TestRandom(CppWrapperTestCase):
    def test_random_ops_follow_manual_seed(self) -> None:
        def fn(x):
            return (
                torch.rand_like(x)
                + torch.randn(x.shape[0])
                + F.dropout(x, 0.5, True)
                + torch.randint(0, 5, x.shape).float()
                + torch.bernoulli(torch.full_like(x, 0.3))
            )

        compiled = torch.compile(fn)
        with config.patch(cpp_wrapper=True, fx_graph_cache=False):
            torch.manual_seed(1)
            self.compile_and_run(fn, (torch.ones(10),))
            torch.manual_seed(7)
            a = compiled(torch.ones(10))
            torch.manual_seed(7)
            b = compiled(torch.ones(10))
            torch.manual_seed(8)
            c = compiled(torch.ones(10))
        torch.testing.assert_close(a, b)
        self.assertFalse(torch.equal(a, c))

    def test_recomputed_random_ops_replay_their_rng_state(self) -> None:
        self.check_recomputed_random_ops("cpu")


class TestOps(CppWrapperTestCase):
    def test_complex_views(self) -> None:
        def fn(x):
            return torch.view_as_real(torch.view_as_complex(x) * 2)

        self.check(fn, (torch.randn(4, 2),))

    def test_scatter_and_index_put_accumulate(self) -> None:
        def fn(x, i, v):
            return x.scatter_add(0, i, v), x.index_put((i,), v, accumulate=True)

        self.check(fn, (torch.zeros(5), torch.tensor([0, 1, 1, 4]), torch.ones(4)))

    def test_sort_cumsum_embedding_bag(self) -> None:
        bag = torch.nn.EmbeddingBag(10, 3, mode="sum")

        def fn(x, idx, off):
            return torch.sort(x, 1)[0], x.cumsum(0), bag(idx, off)

        with torch.no_grad():
            self.check(
                fn,
                (
                    torch.randn(5, 6),
                    torch.tensor([1, 2, 4, 5, 4, 3]),
                    torch.tensor([0, 3]),
                ),
            )

    def test_fft_of_real_input(self) -> None:
        # fft2 of a real tensor first copies it into a complex intermediate
        # buffer: a device copy whose destination is a buffer, not an output.
        def fn(x):
            return torch.fft.fft2(x), torch.fft.irfft(torch.fft.rfft(x), n=6)

        sources = self.check(fn, (torch.randn(4, 6),), atol=1e-5, rtol=1e-5)
        self.assertIn("aoti_torch_copy_(buf", "".join(sources))

    def test_tensor_list_result(self) -> None:
        def fn(x):
            hist, edges = torch.histogramdd(x, bins=[3, 4])
            return hist, edges[0] + 1, edges[1]

        self.check(fn, (torch.rand(20, 2),))

    def test_attention(self) -> None:
        mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()

        def fn(q, x):
            return F.scaled_dot_product_attention(q, q, q), mha(x, x, x)[0]

        with torch.no_grad():
            self.check(
                fn,
                (torch.randn(2, 4, 8, 16), torch.randn(2, 5, 16)),
                atol=1e-5,
                rtol=1e-5,
            )

    def test_transformer_and_conv_blocks(self) -> None:
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
        conv = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
        ).eval()

        def fn(x, img):
            return layer(x), conv(img)

        with torch.no_grad():
            self.check(
                fn,
                (torch.randn(2, 6, 32), torch.randn(2, 3, 16, 16)),
                atol=1e-4,
                rtol=1e-4,
            )


class TestRuntime(CppWrapperTestCase):
    def test_two_threads_share_one_compiled_function(self) -> None:
        def fn(x):
            return (x.sin() @ x.cos()).sum()

        x = torch.randn(64, 64)
        expected = fn(x)
        compiled = torch.compile(fn)
        errors: list[torch.Tensor] = []
        with config.patch(cpp_wrapper=True, fx_graph_cache=False):
            self.compile_and_run(fn, (x,))
            compiled(x)

            def work() -> None:
                for _ in range(50):
                    r = compiled(x)
                    if not torch.allclose(r, expected, atol=1e-3, rtol=1e-4):
                        errors.append(r)

            threads = [threading.Thread(target=work) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        self.assertEqual(errors, [])

    def test_wrapper_call_shows_in_profiler(self) -> None:
        def fn(x):
            return x.relu() + 1

        x = torch.randn(8)
        compiled = torch.compile(fn)
        with config.patch(cpp_wrapper=True, fx_graph_cache=False):
            self.check(fn, (x,))
            self.assertEqual(compiled(x), fn(x))
            with torch.profiler.profile() as prof:
                compiled(x)
        names = [e.name for e in prof.events()]
        self.assertTrue(any("Call CompiledFxGraph" in n for n in names), names[:20])


class TestInductorSettings(CppWrapperTestCase):
    """Inductor settings that change what goes into the wrapper (debugging,
    memory planning); our tests run strict, so a fallback to the Python
    wrapper fails them."""

    @config.patch({"triton.debug_sync_graph": True, "triton.debug_sync_kernel": True})
    def test_debug_sync_flags(self) -> None:
        # Inductor writes the device's synchronize() for these, a line of
        # Python ("pass" on the CPU) that upstream's wrapper puts into its
        # C++, which then fails to build.  Ours writes its own.
        (source,) = self.check(lambda x: (x.sin() + 1).sum(0), (torch.randn(8, 8),))
        self.assertIn(CppWrapperCpu.debug_sync_line(), source)

    @config.patch(nan_asserts=True)
    def test_nan_asserts_check_inputs_and_outputs(self) -> None:
        def fn(x, y):
            return x.log() + y, y * 2

        x, y = torch.rand(8) + 0.5, torch.randn(8)
        (source,) = self.check(fn, (x, y))
        self.assertEqual(source.count("aoti_torch_check_inf_and_nan("), 4)
        compiled = torch.compile(fn)
        with config.patch(cpp_wrapper=True, fx_graph_cache=False):
            with self.assertRaisesRegex(RuntimeError, "input arg1_1, which holds NaN"):
                compiled(x, torch.full((8,), float("nan")))
            with self.assertRaisesRegex(RuntimeError, "output 0, which holds NaN"):
                compiled(-x, y)

    @config.patch(memory_planning=True)
    def test_memory_planning_pools(self) -> None:
        # Buffers placed in a few pools, at offsets that the dynamic graph
        # computes from its sizes with align() (64 bytes in the runtime).
        from torch._inductor.utils import ALIGN_BYTES

        self.assertEqual(ALIGN_BYTES, 64)

        def fn(x, y):
            a = x @ y
            b = a.softmax(-1)
            c = torch.cat([b, a.relu()], 1)
            return c.sum(0), b.t().contiguous(), c[:, ::2]

        args = (torch.randn(16, 16), torch.randn(16, 16))
        (source,) = self.check(fn, args, atol=1e-5, rtol=1e-5)
        self.assertIn("cppwrap::alloc_from_pool(pool", source)

        def views_of_pool_buffers(x, w1, w2, w3):
            # Three buffers of one pool, two at offsets, each read through a
            # view, as attention's projections are.
            q, k, v = x @ w1, x @ w2, x @ w3
            heads = [t.view(16, 2, 8).transpose(0, 1) for t in (q, k, v)]
            return torch.nn.functional.scaled_dot_product_attention(*heads)

        weights = (torch.randn(16, 16), torch.randn(16, 16), torch.randn(16, 16))
        self.check(views_of_pool_buffers, (args[0], *weights), atol=1e-4, rtol=1e-4)
        (source,) = self.check(fn, args, atol=1e-5, rtol=1e-5, dynamic=True)
        self.assertIn("align(", source)
        compiled = torch.compile(fn, dynamic=True)
        other = (torch.randn(20, 20), torch.randn(20, 20))
        with config.patch(cpp_wrapper=True, fx_graph_cache=False):
            for sized in (args, other):  # one graph, two sizes
                torch.testing.assert_close(compiled(*sized), fn(*sized))

    @config.patch(profile_bandwidth=True)
    def test_profile_bandwidth(self) -> None:
        # It measures Triton kernels through their Python launchers; a CPU
        # graph has none, and upstream's C++ wrapper ignores it too.
        self.check(lambda x: x.cos().sum(0), (torch.randn(8, 8),))


class TestControlFlow(CppWrapperTestCase):
    """torch.cond and torch.while_loop: their subgraphs are inlined into the
    C++ as blocks (if/else, while), as upstream's C++ wrapper does."""

    def test_cond_takes_either_branch(self) -> None:
        def fn(p, x):
            return torch.cond(p, lambda x: (x + 1).sin(), lambda x: x.cos() - 1, (x,))

        for predicate in (True, False):
            torch._dynamo.reset()
            (source,) = self.check(fn, (torch.tensor(predicate), torch.randn(8)))
            self.assertIn("// subgraph true_graph_0", source)
            self.assertIn("} else {", source)

    def test_cond_with_extern_kernels_and_several_outputs(self) -> None:
        def fn(p, x, w):
            def yes(x, w):
                return x @ w, (x * 2).sum()

            def no(x, w):
                return x @ w.t(), x.sum()

            return torch.cond(p, yes, no, (x, w))

        for predicate in (True, False):
            torch._dynamo.reset()
            self.check(
                fn,
                (torch.tensor(predicate), torch.randn(4, 4), torch.randn(4, 4)),
                atol=1e-5,
                rtol=1e-5,
            )

    @torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
    def test_cond_branches_bind_one_unbacked_symbol_each(self) -> None:
        # Both branches size a buffer by nonzero's count, one unbacked symbol
        # whose declaration ends with the block that made it: the else
        # branch must declare it again.
        def fn(p, x):
            def branch(op):
                def run(x):
                    count = torch.nonzero(x).size(0)
                    return op(torch.ones(count, 8))

                return run

            return torch.cond(p, branch(torch.cos), branch(torch.sin), (x.sin(),))

        x = torch.randn(2, 3, 3)
        for predicate in (True, False):
            torch._dynamo.reset()
            (source,) = self.check(fn, (torch.tensor(predicate), x))
            self.assertIn("} else {", source)

    def test_nested_compile_region_is_one_lambda_called_at_each_call(self) -> None:
        # Upstream's C++ wrapper refuses invoke_subgraph; ours defines the
        # subgraph once, as a lambda, and calls it twice.
        @torch.compiler.nested_compile_region
        def block(x, w):
            y = x @ w
            return torch.relu(y) + x.sum(), y.sin()

        def fn(x, w):
            a, b = block(x, w)
            c, d = block(a, w)
            return c + b, d

        for dynamic in (False, True):
            torch._dynamo.reset()
            args = (torch.randn(8, 8), torch.randn(8, 8))
            (source,) = self.check(fn, args, atol=1e-4, rtol=1e-4, dynamic=dynamic)
            defined = re.findall(r"auto (\w+)_fn = \[&\]\(", source)
            called = re.findall(r"= (\w+)_fn\(", source)
            # Each subgraph one lambda; both calls through one.
            self.assertEqual(len(called), 2, source)
            self.assertEqual(sorted(set(called)), sorted(defined), source)
            if not dynamic:
                # With dynamic sizes torch 2.11's Dynamo may trace the
                # region once per call: a lambda each.
                self.assertEqual(defined, ["repeated_subgraph0"], source)

    def test_nested_compile_region_through_backward(self) -> None:
        linear = torch.nn.Linear(8, 8)

        @torch.compiler.nested_compile_region
        def layer(x):
            return F.gelu(linear(x))

        def step(x):
            return layer(layer(x)).sum()

        x = torch.randn(4, 8, requires_grad=True)
        step(x).backward()
        expected = (x.grad, linear.weight.grad)
        x.grad, linear.weight.grad = None, None
        compiled = torch.compile(step, fullgraph=True)
        with our_wrappers_created() as created:
            _, sources = run_and_get_code(lambda: compiled(x).backward())
        # Forward and backward, each with the region's subgraph as a lambda.
        self.assertEqual(created, [CppWrapperCpu, CppWrapperCpu])
        for source in sources:
            self.assertIn("_fn = [&](", source)
        torch.testing.assert_close((x.grad, linear.weight.grad), expected)

    def test_nested_compile_region_returning_sizes(self) -> None:
        # The region returns a size, and with dynamic shapes its partitioned
        # forward returns sizes for the backward: the lambda returns only the
        # tensors, and the caller spells the sizes in its own symbols.
        @torch.compiler.nested_compile_region
        def layer(x):
            return torch.sin(x) * 2, x.shape[0]

        def step(x):
            a, n = layer(x)
            b, _ = layer(a)
            return (b * n).sum()

        x = torch.randn(6, 8, requires_grad=True)
        expected_loss = step(x)
        expected_loss.backward()
        expected_grad, x.grad = x.grad, None
        torch._dynamo.mark_dynamic(x, 0)
        compiled = torch.compile(step, fullgraph=True)
        with our_wrappers_created() as created:
            (loss, _), sources = run_and_get_code(
                lambda: (loss := compiled(x), loss.backward())
            )
        self.assertEqual(created, [CppWrapperCpu, CppWrapperCpu])
        for source in sources:
            self.assertIn("_fn = [&](", source)
        torch.testing.assert_close(loss, expected_loss)
        torch.testing.assert_close(x.grad, expected_grad)

    def test_while_loop(self) -> None:
        from torch._higher_order_ops.while_loop import while_loop

        def fn(i, x):
            return while_loop(
                lambda i, x: i < 5, lambda i, x: (i + 1, x * 2 + 1), (i, x)
            )

        (source,) = self.check(fn, (torch.tensor(0), torch.randn(6)))
        self.assertIn("while (true) {", source)


if __name__ == "__main__":
    run_tests()
