"""Never worse than upstream: a JIT graph our C++ wrapper cannot generate or
build is compiled again with Inductor's Python wrapper.  A known gap says why
on the perf hints; any other error of the C++ wrapper's compile is a warning
that asks for a report.

Upstream's C++ wrapper compiles a graph or fails the whole ``torch.compile``;
ours steps aside for that one graph.  ``torch_cppwrap.config.strict`` raises
instead (our tests run strict, so a gap cannot hide behind the fallback).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor import ir, metrics
from torch._inductor.exc import CppWrapperCodegenError

from torch_cppwrap import config
from torch_cppwrap._inductor import codecache
from torch_cppwrap._inductor.codecache import CppWrapperCompileError
from torch_cppwrap._inductor.codegen.cpp_wrapper_cpu import operations_with_subgraphs

# Upstream's graph.py logs its performance hints here (TORCH_LOGS=perf_hints).
perf_hint_log = torch._logging.getArtifactLogger("torch._inductor.graph", "perf_hints")
log = logging.getLogger(__name__)

# What makes a graph fall back: a construct our generator does not handle,
# one that upstream's IR refuses every C++ wrapper, or generated C++ that does
# not build.
FALLBACK_ERRORS: tuple[type[BaseException], ...] = (
    NotImplementedError,
    CppWrapperCodegenError,
    CppWrapperCompileError,
)

# Counts the fallbacks that the graph's next compile may not need: a failed
# C++ build (a compiler killed for memory, a full disk) and any error we did
# not foresee.  Inductor's FX graph cache would serve the Python wrapper's
# module of such a graph to every later process; it is not saved there
# (``keep_retryable_fallbacks_uncached``).  A known gap's fallback is.
RETRYABLE_FALLBACK = "cppwrap_python_wrapper_fallback_not_cached"


def _uses_our_wrapper(graph: Any) -> bool:
    return bool(graph.cpp_wrapper) and not graph.aot_mode


def _wrapper_device_type(graph: Any) -> str:
    """The device type the graph's wrapper will be generated for, as
    ``init_wrapper_code`` picks it: ``graph.device_type`` itself reads "cpu"
    until the codegen starts."""
    device_types = set(graph.device_types) - {"cpu", "meta"}
    return device_types.pop() if len(device_types) == 1 else "cpu"


def _reset_for_codegen(graph: Any) -> None:
    """Forgets what one codegen pass decided, as upstream does between the
    two passes of an AOTInductor compile, so that another pass starts clean."""
    graph.removed_buffers.clear()
    graph.removed_operations.clear()
    graph.inplaced_to_remove.clear()
    graph.sizevars.precomputed_replacements.clear()
    graph.sizevars.inv_precomputed_replacements.clear()
    metrics.reset()
    # A fallback kernel decides at codegen whether a C++ wrapper must look
    # its op up at run time (and then skips its layout checks); the Python
    # wrapper's pass decides afresh, in the subgraphs too.
    for operation in operations_with_subgraphs(graph.operations):
        if isinstance(operation, ir.FallbackKernel):
            operation.use_runtime_dispatch = False


# Inductor's cpp_wrapper settings have each Triton kernel keep its binary on
# its launcher (triton.store_cubin) for upstream's wrapper, which rules out
# Inductor's static CUDA launcher: the tuning block would build a Triton
# launcher with the C compiler per kernel signature.  Ours reads the binary
# from the kernel's compile result (cpp_wrapper_gpu.tuned_kernel_from_autotuner),
# and the Python wrapper that stands in for ours after a fallback needs no
# binary either (with it, its module would also look for kernels to save in
# every call).
OUR_WRAPPER_CONFIG: dict[str, object] = {"triton.store_cubin": False}


@functools.cache
def _log_tuning_while_compiling() -> None:
    # Once a process: a compile reads the settings for each graph it lowers.
    log.info(
        "triton.autotune_at_compile_time=False: torch_cppwrap's C++ wrapper "
        "tunes Triton kernels while the graph compiles, in its first call"
    )


def tune_at_compile_time(
    original: Callable[..., dict[str, object]],
) -> Callable[..., dict[str, object]]:
    """Wraps ``compile_fx.get_cpp_wrapper_config``, the settings a
    cpp_wrapper compile runs under.

    Our CUDA wrapper tunes every Triton kernel while the graph compiles
    (``cpp_wrapper_gpu``), so a JIT graph compiles with
    ``triton.autotune_at_compile_time`` True wherever Triton is, settled here
    before lowering, which reads it too.  Upstream's wrapper reads False
    (torch 2.12 on: also the setting left unset) as "tune on the first call's
    inputs": torch 2.11 runs a Python-wrapper pass of the graph on them while
    compiling, 2.12 on compiles and tunes each kernel at its first launch,
    from Python.  A JIT graph compiles in its first call, so ours tunes in that
    call either way, on example inputs of the same sizes, and no call runs
    Python for it.  AOTInductor's graphs, and machines without Triton, keep
    upstream's reading.
    """

    @functools.wraps(original)
    def get_cpp_wrapper_config(*args: Any, **kwargs: Any) -> dict[str, object]:
        from torch._inductor.virtualized import V
        from torch.utils._triton import has_triton

        settings = original(*args, **kwargs)
        if not V.aot_compilation and has_triton():
            if inductor_config.triton.autotune_at_compile_time is False:
                _log_tuning_while_compiling()
            settings["triton.autotune_at_compile_time"] = True
            # Upstream pairs the two: cuBLASLt is tuned when Triton is not.
            settings["triton.autotune_cublasLt"] = False
        return settings

    return get_cpp_wrapper_config


def _real_script_objects(graph: Any) -> None:
    """Puts real TorchBind objects back where ``compile_fx`` swapped in fakes
    for the C++ wrapper's compile (``_fakify_script_objects``): the Python
    wrapper's module binds the graph's objects and calls ops with them.  A
    fake's real object is the copy ``compile_fx`` made of the user's, so an
    op that changes an object's state changes that copy."""
    from torch._library.fake_class_registry import FakeScriptObject

    for name, value in graph.torchbind_constants.items():
        if isinstance(value, FakeScriptObject):
            graph.torchbind_constants[name] = value.real_obj


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def compile_to_module_with_fallback(original: Callable[[Any], Any]) -> Any:
    """Wraps ``GraphLowering._compile_to_module``."""

    def _compile_to_module(graph: Any) -> Any:
        if not _uses_our_wrapper(graph):
            return original(graph)
        codecache.prefetch(_wrapper_device_type(graph))
        try:
            with inductor_config.patch(OUR_WRAPPER_CONFIG):
                return original(graph)
        except FALLBACK_ERRORS as error:
            if config.strict:
                raise
            perf_hint_log.info(
                "torch_cppwrap: graph %s is compiled with the Python wrapper "
                "instead of the C++ wrapper: %s: %s",
                graph.graph_id,
                type(error).__name__,
                _first_line(error),
            )
            counters["inductor"]["cppwrap_python_wrapper_fallback"] += 1
            if isinstance(error, CppWrapperCompileError):
                counters["inductor"][RETRYABLE_FALLBACK] += 1
        except Exception as error:
            # Not a known gap: a bug of ours, most likely (or an error of
            # Inductor's own, which the Python wrapper's compile raises
            # again).  The graph still compiles, and the user hears of it.
            if config.strict:
                raise
            log.warning(
                "torch_cppwrap: generating or building the C++ wrapper of "
                "graph %s failed unexpectedly (%s: %s); compiling it with the "
                "Python wrapper instead. Please report this to torch_cppwrap.",
                graph.graph_id,
                type(error).__name__,
                _first_line(error),
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            counters["inductor"]["cppwrap_python_wrapper_fallback"] += 1
            counters["inductor"]["cppwrap_unexpected_errors"] += 1
            counters["inductor"][RETRYABLE_FALLBACK] += 1
        _reset_for_codegen(graph)
        _real_script_objects(graph)
        graph.cpp_wrapper = False
        try:
            with inductor_config.patch({**OUR_WRAPPER_CONFIG, "cpp_wrapper": False}):
                return original(graph)
        finally:
            graph.cpp_wrapper = True

    return _compile_to_module


def keep_retryable_fallbacks_uncached(
    original: Callable[..., None],
) -> Callable[..., None]:
    """Wraps ``FxGraphCache._save_graph``: a graph compiled with the Python
    wrapper after a fallback its next compile may not need
    (``RETRYABLE_FALLBACK`` among the counters its compile moved, which the
    compiled graph carries) is not saved, so that a later compile, in this
    process or another, tries the C++ wrapper again."""

    @functools.wraps(original)
    def _save_graph(key: str, compiled_graph: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(compiled_graph, "counter_deltas", {}).get(RETRYABLE_FALLBACK):
            log.info(
                "torch_cppwrap: the FX graph cache does not keep the Python "
                "wrapper fallback of the graph with key %s; its next compile "
                "tries the C++ wrapper again",
                key,
            )
            return
        original(key, compiled_graph, *args, **kwargs)

    return _save_graph
