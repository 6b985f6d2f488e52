"""Shared helpers for torch_cppwrap's upstream-style tests."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import torch
import torch.utils._pytree as pytree
from torch._inductor import config
from torch._inductor.test_case import TestCase
from torch._inductor.utils import run_and_get_code
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import torch_cppwrap  # the import patches Inductor
from torch_cppwrap._inductor import codecache
from torch_cppwrap._inductor.codegen import cpp_spellings as spell
from torch_cppwrap._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

REPO = Path(__file__).resolve().parent.parent

# transformers, for the real-model tests (test_models.py, test_model_sweep.py);
# benchmarks/models.py imports it when it builds a model.
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def load_script(relative_path: str) -> ModuleType:
    """A script of the repository that is not part of the package
    (tools/patches.py, benchmarks/bench.py), loaded by path as a module named
    after its file."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


# Where the suite keeps torch_cppwrap's once-per-cache artefacts between runs:
# the Inductor cache the suite was started with (conftest.py points it under
# the system's temporary directory unless TORCHINDUCTOR_CACHE_DIR is set),
# read before any test swaps in a fresh one.
SUITE_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
    tempfile.gettempdir(), f"torch_cppwrap-tests-{os.getuid()}", "inductor"
)


@functools.cache
def _suite_artefacts(device_type: str) -> tuple[Path, tuple[Path, ...]]:
    """The suite cache's runtime extension and precompiled headers for
    `device_type`, built there the first time (a minute or two)."""
    with mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": SUITE_CACHE}):
        tc = codecache.toolchain()
        directories = [
            codecache.RuntimeExtension.ensure_built().parent,
            codecache.wrapper_runtime_pch(tc, device_type),
        ]
        if device_type == "cpu":
            directories.append(codecache.kernel_prefix_pch(tc))
        return codecache.cache_root(), tuple(d for d in directories if d)


def seed_cache(device_type: str = "cpu", *, copies: Sequence[str] = ()) -> None:
    """Puts the suite's runtime extension and precompiled headers into the
    current Inductor cache, as hard links (copies for the file names listed
    in `copies`, which a test may damage).  Upstream's TestCase gives every
    test a fresh cache, and these depend only on torch, the compiler and its
    flags: building them for every test would take minutes each."""
    root, directories = _suite_artefacts(device_type)
    into = codecache.cache_root()
    for directory in directories:
        for path in directory.rglob("*"):
            destination = into / path.relative_to(root)
            if not path.is_file() or destination.exists():
                continue
            destination.parent.mkdir(parents=True, exist_ok=True)
            if path.name in copies:
                shutil.copy2(path, destination)
                continue
            try:
                os.link(path, destination)
            except OSError:  # another file system
                shutil.copy2(path, destination)


def _same_layout_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` with its sizes, strides and storage offset, on a
    storage of its own as large as its storage: a test that passes a slice or
    a transposed view gives the compiled graph one (clone() would give it a
    dense tensor at offset 0)."""
    base = tensor.detach()
    if base.layout != torch.strided or base.is_quantized:
        return base.clone()
    nbytes, itemsize = base.untyped_storage().nbytes(), base.element_size()
    if nbytes % itemsize:
        return base.clone()
    storage = torch.empty(nbytes // itemsize, dtype=base.dtype, device=base.device)
    copy = storage.as_strided(base.size(), base.stride(), base.storage_offset())
    return copy.copy_(base)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        clone = _same_layout_copy(value).requires_grad_(value.requires_grad)
        # torch._dynamo.mark_dynamic's marks, which a clone does not carry.
        for dim in getattr(value, "_dynamo_dynamic_indices", ()):
            torch._dynamo.mark_dynamic(clone, dim)
        return clone
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return copy.copy(value)


def checkpoint_recomputing_all(fn: Callable[..., Any], *args: Any) -> Any:
    """torch.utils.checkpoint with a policy that recomputes every op,
    random ones included (AOTAutograd then wraps those in
    run_and_save_rng_state and run_with_rng_state)."""

    def recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_RECOMPUTE

    context = functools.partial(create_selective_checkpoint_contexts, recompute)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context)


@contextlib.contextmanager
def our_wrappers_created() -> Iterator[list[type]]:
    """Records the class of every wrapper codegen torch_cppwrap creates, with
    caches off so that every graph is generated anew."""
    created: list[type] = []
    original_create = CppWrapperCpu.create.__func__  # type: ignore[attr-defined]

    # A class method still, so that CppWrapperGpu.create makes a CppWrapperGpu.
    def counting_create(cls: type, *a: Any, **k: Any) -> CppWrapperCpu:
        wrapper = original_create(cls, *a, **k)
        created.append(type(wrapper))
        return wrapper

    with (
        config.patch(cpp_wrapper=True, fx_graph_cache=False),
        mock.patch.object(CppWrapperCpu, "create", classmethod(counting_create)),
    ):
        yield created


class CppWrapperTestCase(TestCase):
    """Compiles functions with cpp_wrapper=True and checks that torch_cppwrap
    generated the code and that the results match eager."""

    def setUp(self) -> None:
        super().setUp()
        seed_cache()
        torch._dynamo.reset()
        # A gap in our wrapper must fail the test, not fall back silently.
        strict = torch_cppwrap.config.patch(strict=True)
        strict.__enter__()
        self.addCleanup(strict.__exit__, None, None, None)

    def compile_and_run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        *,
        dynamic: bool | None = False,
        compile_kwargs: dict[str, Any] | None = None,
    ) -> tuple[Any, list[str]]:
        """Returns (result, generated sources) and asserts our wrapper made them."""
        compiled = torch.compile(fn, dynamic=dynamic, **(compile_kwargs or {}))
        with our_wrappers_created() as created:
            result, sources = run_and_get_code(compiled, *args)
        self.assertTrue(created, "torch_cppwrap's CppWrapperCpu generated no code")
        self.assertTrue(all(issubclass(c, CppWrapperCpu) for c in created))
        self.assertTrue(sources)
        on_cuda = any(
            isinstance(a, torch.Tensor) and a.is_cuda for a in pytree.tree_leaves(args)
        )
        # Each device's wrapper includes the one runtime header that is
        # precompiled for it (the CUDA one includes the CPU one).
        header = codecache.WRAPPER_HEADERS["cuda" if on_cuda else "cpu"]
        for source in sources:
            self.assertIn("from torch_cppwrap._inductor.codecache import", source)
            self.assertIn(f'#include "{header}"', source)
            if on_cuda:
                # Inductor heads the module with the tuning block, a docstring;
                # after it, every Triton kernel is a cubin launched from C++.
                module = source[source.index("import CppWrapperCodeCache") :]
                self.assertNotIn("async_compile", module)
                self.assertNotIn(".run(", module)
        return result, sources

    def check(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        *,
        atol: float | None = None,
        rtol: float | None = None,
        dynamic: bool | None = False,
        compile_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """Compiles `fn` with our wrapper, compares outputs and mutated inputs
        with eager, and returns the generated sources."""
        eager_args = _clone(args)
        expected = fn(*eager_args)
        actual_args = _clone(args)
        actual, sources = self.compile_and_run(
            fn, actual_args, dynamic=dynamic, compile_kwargs=compile_kwargs
        )
        kwargs = {} if atol is None else {"atol": atol, "rtol": rtol}
        torch.testing.assert_close(actual, expected, **kwargs)
        # Inputs mutated in place must match too.
        torch.testing.assert_close(actual_args, eager_args, **kwargs)
        return sources

    def check_recomputed_random_ops(self, device: str) -> None:
        """A checkpoint policy that recomputes random ops makes AOTAutograd
        wrap each (with config.fallback_random): the forward saves the
        generator's state before the op (run_and_save_rng_state) and the
        backward runs the op again from it (run_with_rng_state), so both draw
        the same numbers.  Upstream's C++ wrapper refuses both."""

        # Dropout keeps its tensor argument on every release (torch 2.11
        # decomposes rand_like into rand, which has none: README says what
        # happens then).
        def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            dropout = torch.nn.functional.dropout
            y = dropout((x @ w).relu(), p=0.5, training=True)
            return dropout(y.sin(), p=0.25, training=True)

        def fn(x: torch.Tensor, w: torch.Tensor) -> Any:
            return checkpoint_recomputing_all(block, x, w)

        def step(f: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
            x, w = (
                torch.randn(*size, generator=torch.Generator().manual_seed(seed))
                .to(device)
                .requires_grad_()
                for size, seed in (((8, 16), 1), ((16, 16), 2))
            )
            torch.manual_seed(0)
            out = f(x, w)
            out.backward(torch.ones_like(out))
            # The generator goes on from where eager leaves it.
            return out, x.grad, w.grad, torch.rand(4, device=device)

        with config.patch(fallback_random=True):
            expected = step(fn)
            compiled = torch.compile(fn)
            with our_wrappers_created() as created:
                actual, sources = run_and_get_code(step, compiled)
                again = step(compiled)
        self.assertEqual(len(created), 2)  # the forward and the backward graph
        for result in (actual, again):
            self.assertEqual(result[:3], expected[:3])
            self.assertTrue(torch.equal(result[3], expected[3]))
        code = "\n".join(sources)
        # Two random ops saved in the forward, replayed in the backward.
        kind = spell.DEVICE_TYPE[device]
        self.assertEqual(code.count(f"= cppwrap::get_rng_state({kind}"), 4)
        self.assertEqual(code.count(f"cppwrap::set_rng_state({kind}"), 4)


# A wrapper module that returns its one input: the smallest thing the code
# cache builds.
IDENTITY_SOURCE = """
#include "cppwrap_runtime.h"

static PyObject* call_impl(PyObject* /*module*/, PyObject* args) {
    if (!cppwrap::check_args(args, 1)) return nullptr;
    cppwrap::Tensor x;
    if (!cppwrap::unpack_tensor(args, 0, x, "x")) return nullptr;
    cppwrap::clear_args(args);
    return cppwrap::pack_outputs<1>({cppwrap::output(x)});
}

CPPWRAP_DEFINE_MODULE("test module %(tag)s")
"""


def checking_identity_source(tag: str, check: str) -> str:
    """IDENTITY_SOURCE whose call first runs the C++ statement `check` on its
    input `x`; what the statement throws is raised in Python."""
    unpacked = "    cppwrap::clear_args(args);\n"
    return (IDENTITY_SOURCE % {"tag": tag}).replace(
        unpacked,
        f"{unpacked}    try {{\n        {check}\n    }} catch (...) {{\n"
        "        return cppwrap::raise_current();\n    }\n",
    )
