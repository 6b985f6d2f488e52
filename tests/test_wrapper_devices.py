"""Cases that hold for torch_cppwrap's wrapper on every device it covers,
around Inductor's C++ kernels on CPU and Triton kernels on CUDA, compared
with eager.  instantiate_device_type_tests makes TestWrapperCPU (run
everywhere) and TestWrapperCUDA (where CUDA is)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch._inductor import config
from torch.testing._internal.common_device_type import instantiate_device_type_tests

from tests.common import CppWrapperTestCase, seed_cache

# Matmuls and convolutions on CUDA may use TF32.
TOLERANCE = {
    "cpu": {"atol": 1e-4, "rtol": 1e-4},
    "cuda": {"atol": 1e-2, "rtol": 1e-2},
}


class TestWrapper(CppWrapperTestCase):
    device_type: str

    def setUp(self) -> None:
        super().setUp()  # seeds the CPU artefacts
        if self.device_type != "cpu":
            seed_cache(self.device_type)

    def tol(self, device: str) -> dict[str, Any]:
        return TOLERANCE[torch.device(device).type]

    def test_pointwise_broadcast_multiple_outputs(self, device: str) -> None:
        def fn(a, b, c):
            t = torch.sigmoid(a) * b + c.exp()
            return t - 1.5, t.relu()

        shapes = [(4, 1, 8), (1, 6, 8), (8,)]
        self.check(fn, [torch.randn(s, device=device) for s in shapes])

    def test_reductions(self, device: str) -> None:
        def fn(x):
            return x.sum(0), x.amax(1), x.mean(), torch.var(x, dim=1), x.argmax(1)

        x = torch.randn(333, 171, device=device)
        self.check(fn, (x,), atol=1e-3, rtol=1e-3)

    def test_softmax_and_layer_norm(self, device: str) -> None:
        ln = torch.nn.LayerNorm(64).to(device)

        def fn(x):
            return ln(torch.softmax(x, -1))

        with torch.no_grad():
            self.check(fn, (torch.randn(8, 64, device=device),), atol=1e-4, rtol=1e-4)

    def test_one_kernel_launched_twice(self, device: str) -> None:
        def fn(x, y):
            return (x * 2 + 1).sin(), (y * 2 + 1).sin()

        self.check(
            fn, (torch.randn(1024, device=device), torch.randn(1024, device=device))
        )

    def test_input_mutation(self, device: str) -> None:
        def fn(x, y):
            x.add_(y)
            return x * 2

        self.check(
            fn, (torch.randn(64, 64, device=device), torch.randn(64, 64, device=device))
        )

    def test_half_and_int(self, device: str) -> None:
        def fn(x, i):
            return (x.float() * 3).half(), i * 2 + 1, (i > 3).sum()

        x = torch.randn(37, 19, device=device, dtype=torch.float16)
        i = torch.randint(0, 10, (37, 19), device=device)
        self.check(fn, (x, i))

    def test_mm_addmm_bmm(self, device: str) -> None:
        def fn(a, b, bias, c, d):
            return a @ b, torch.addmm(bias, a, b), torch.bmm(c, d)

        shapes = [(16, 32), (32, 8), (8,), (3, 4, 5), (3, 5, 6)]
        args = [torch.randn(s, device=device) for s in shapes]
        (source,) = self.check(fn, args, **self.tol(device))
        shim_device = torch.device(device).type
        self.assertRegex(source, rf"aoti_torch_{shim_device}_(mm|addmm|bmm)_out")

    def test_convolution(self, device: str) -> None:
        conv = torch.nn.Conv2d(3, 8, 3, padding=1).to(device)

        def fn(x):
            return F.relu(conv(x))

        with torch.no_grad():
            x = torch.randn(2, 3, 16, 16, device=device)
            (source,) = self.check(fn, (x,), **self.tol(device))
        self.assertIn("convolution", source)

    def test_sort_values_and_indices(self, device: str) -> None:
        # A C-shim fallback on CPU; a Triton kernel on CUDA.
        def fn(x):
            values, indices = torch.sort(x, dim=-1)
            return values * 2, indices

        self.check(fn, (torch.randn(16, 50, device=device),))

    def test_dynamic_pointwise_and_reduction(self, device: str) -> None:
        def fn(x):
            return torch.softmax(x * 2, dim=-1), x.sum(0)

        x = torch.randn(8, 33, device=device)
        (source,) = self.check(fn, (x,), dynamic=True, atol=1e-4, rtol=1e-4)
        # Sizes (and, on CUDA, launch grids) are computed in C++ from each
        # call's inputs.
        self.assertRegex(source, r"int64_t s\d+ = ")
        compiled = torch.compile(fn, dynamic=True)
        with config.patch(cpp_wrapper=True, fx_graph_cache=False):
            for shape in [(5, 1000), (64, 7)]:
                x = torch.randn(*shape, device=device)
                self.assertEqual(compiled(x), fn(x), atol=1e-4, rtol=1e-4)


instantiate_device_type_tests(TestWrapper, globals(), only_for=("cpu", "cuda"))


if __name__ == "__main__":
    from torch._inductor.test_case import run_tests

    run_tests()
