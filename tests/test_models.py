"""Real models from HF transformers, compiled with torch_cppwrap's wrapper.

The graphs of a real model mix what the small tests take one at a time:
attention with grouped key/value heads and rotary embeddings, a key/value
cache that the graph writes in place, convolutions ahead of an encoder and
decoder, and a backward graph with an optimizer step between calls.  Each
model is tiny (two layers, 128 wide) and built from its config with random
weights, so nothing is downloaded.  Every graph must come from our wrapper
(strict: no fallback) and match eager.
"""

from __future__ import annotations

import copy
import unittest
from typing import Any

import torch
from torch._inductor.test_case import run_tests
from torch._inductor.utils import run_and_get_code

from tests.common import (
    HAS_TRANSFORMERS,
    CppWrapperTestCase,
    load_script,
    our_wrappers_created,
    seed_cache,
)
from torch_cppwrap._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

HAS_CUDA = torch.cuda.is_available()

# benchmarks/models.py's tiny families (two layers, 128 wide), which
# benchmarks/model_sweep.py runs over every architecture.
_models = load_script("benchmarks/models.py")


def tiny_llama(device: str) -> Any:
    """Llama with grouped-query attention (4 query heads over 2 key/value
    heads), rotary embeddings and RMSNorm."""
    run, _ = _models.FAMILIES["llama"](device)
    return run.module


class ModelTests(CppWrapperTestCase):
    device = "cpu"

    def setUp(self) -> None:
        super().setUp()
        torch.manual_seed(0)

    def assert_ours_made_every_graph(self, created: list[type], at_least: int) -> None:
        self.assertGreaterEqual(len(created), at_least)
        self.assertTrue(all(issubclass(c, CppWrapperCpu) for c in created), created)

    def test_llama_generate_with_static_cache(self) -> None:
        # How transformers' docs compile decoding: forward compiled, the key
        # and value cache preallocated and written in place by each step.
        model = tiny_llama(self.device).eval()
        prompt = torch.randint(1, 999, (1, 12), device=self.device)
        options = {
            "max_new_tokens": 12,
            "do_sample": False,
            "cache_implementation": "static",
            # generate() compiles decoding itself on a GPU: the reference must
            # stay eager, and the compiled forward below be the only compile.
            "disable_compile": True,
        }
        expected = model.generate(prompt, **options)
        model.forward = torch.compile(model.forward)
        with our_wrappers_created() as created:
            first, sources = run_and_get_code(model.generate, prompt, **options)
            # A second generation starts from a reset cache, in the same graphs.
            second = model.generate(prompt, **options)
        # The prompt's prefill and the one-token decoding step.
        self.assert_ours_made_every_graph(created, at_least=2)
        self.assertEqual(first.tolist(), expected.tolist())
        self.assertEqual(second.tolist(), expected.tolist())
        for source in sources:
            # The kernels write the cache where it lies (an input mutated in
            # place), with no copy back into it.  (On CUDA, the position held
            # in a CPU scalar is copied to the GPU, into a buffer.)
            self.assertNotRegex(source, r"aoti_torch_copy_\(arg\d+_1\b")

    def test_whisper_encoder_decoder(self) -> None:
        # Convolutions over the audio features, then an encoder-decoder.
        logits, args = _models.FAMILIES["whisper"](self.device)
        with torch.no_grad():
            self.check(logits, args, atol=1e-4, rtol=1e-4)

    def test_llama_training_steps(self) -> None:
        # Forward and backward compiled, AdamW between the steps: the second
        # and third steps run the graphs on parameters the optimizer changed,
        # so their losses match eager's only if the graphs read the new ones.
        eager = tiny_llama(self.device).train()
        compiled_model = copy.deepcopy(eager)
        eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
        compiled_opt = torch.optim.AdamW(compiled_model.parameters(), lr=1e-3)
        compiled = torch.compile(compiled_model)
        ids = torch.randint(1, 999, (2, 16), device=self.device)
        losses: dict[str, list[float]] = {"eager": [], "compiled": []}
        with our_wrappers_created() as created:
            for _ in range(3):
                for name, model, opt in (
                    ("eager", eager, eager_opt),
                    ("compiled", compiled, compiled_opt),
                ):
                    loss = model(ids, labels=ids).loss
                    loss.backward()
                    losses[name].append(loss.item())
                    opt.step()
                    opt.zero_grad()
        self.assert_ours_made_every_graph(created, at_least=2)  # forward, backward
        self.assertEqual(losses["compiled"], losses["eager"], atol=1e-4, rtol=1e-4)
        if self.device == "cuda":
            # On CUDA the embedding's gradient is summed with atomic adds, in
            # another order than eager's, and AdamW's first steps move each
            # weight by lr times the sign of its gradient: a gradient near
            # zero may take the other sign.  The losses above are the check.
            return
        for (name, p), q in zip(
            eager.named_parameters(), compiled_model.parameters(), strict=True
        ):
            torch.testing.assert_close(
                q, p, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
            )


@unittest.skipUnless(HAS_TRANSFORMERS, "needs transformers")
class TestModelsCpu(ModelTests):
    device = "cpu"


@unittest.skipUnless(HAS_TRANSFORMERS and HAS_CUDA, "needs transformers and CUDA")
class TestModelsCuda(ModelTests):
    device = "cuda"

    def setUp(self) -> None:
        super().setUp()
        seed_cache("cuda")


# Only the device classes run (unittest would collect the base class too).
del ModelTests

if __name__ == "__main__":
    run_tests()
