"""OpInfo conformance: a fixed slice of PyTorch's OpInfo database compiled with
torch_cppwrap's C++ wrapper and compared with eager.

One test per op, ``test_<op>`` (dots become underscores): the op's first
float32 sample input on the CPU, compiled with ``cpp_wrapper=True`` and the FX
graph cache off; the test asserts that torch_cppwrap generated the wrapper and
that outputs, and inputs mutated in place, match eager.  The whole database
runs through ``benchmarks/opinfo_sweep.py`` (see docs/opinfo.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._inductor.test_case import run_tests
from torch.testing._internal.common_methods_invocations import op_db

from tests.common import CppWrapperTestCase

# op_db entries, as ``name`` or ``name.variant_test_name``, that must pass.
FIXED_SLICE = (
    # pointwise, unary
    "abs",
    "exp",
    "log",
    "rsqrt",
    "tanh",
    "nn.functional.relu",
    "nn.functional.gelu",
    # pointwise, binary and ternary
    "add",
    "mul",
    "div.no_rounding_mode",
    "pow",
    "clamp",
    "where",
    "masked_fill",
    # reductions and scans
    "sum",
    "argmax",
    "var",
    "max.reduction_with_dim",
    "cumsum",
    # matmul family
    "mm",
    "bmm",
    "addmm",
    "matmul",
    "nn.functional.linear",
    # indexing, joining, views
    "index_select",
    "gather",
    "index_add",
    "cat",
    "stack",
    "transpose",
    "reshape",
    # normalisation
    "softmax",
    "log_softmax",
    "nn.functional.layer_norm",
)

_OPS = {
    (f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name): op
    for op in op_db
}


class TestOpInfoConformance(CppWrapperTestCase):
    def check_opinfo(self, key: str) -> None:
        op = _OPS[key]
        dtype = torch.float32
        self.assertIn(dtype, op.supported_dtypes("cpu"))
        torch.manual_seed(0)
        sample = next(iter(op.sample_inputs("cpu", dtype, requires_grad=False)))
        kwargs = dict(sample.kwargs)
        call = op.op

        def fn(*args: Any) -> Any:
            return call(*args, **kwargs)

        self.check(fn, (sample.input, *sample.args))


def _make_test(key: str) -> Callable[[TestOpInfoConformance], None]:
    def test(self: TestOpInfoConformance) -> None:
        self.check_opinfo(key)

    test.__name__ = "test_" + key.replace(".", "_")
    test.__doc__ = f"op_db entry {key!r}: compiled with our wrapper, same as eager."
    return test


for _key in FIXED_SLICE:
    _test = _make_test(_key)
    setattr(TestOpInfoConformance, _test.__name__, _test)
del _key, _test


if __name__ == "__main__":
    run_tests()
