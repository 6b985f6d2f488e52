"""scripts/gpu/profile_call.py: the parts that need no GPU."""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.output_code import CompiledFxGraph
from torch._inductor.test_case import run_tests

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
                compiled(*args)
            finally:
                CompiledFxGraph.__call__ = original_call  # type: ignore[method-assign]
            self.assertTrue(created, "torch_cppwrap generated no code")
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


if __name__ == "__main__":
    run_tests()
