"""Exceptions from the OpenMP-parallel regions of Inductor's C++ kernels.

A C++ exception must not leave a ``#pragma omp parallel`` region, nor an
iteration of a worksharing loop: OpenMP requires the thread that threw it to
catch it in the same iteration, and one that escapes ends the process in
``std::terminate``.  Inductor's kernels throw from two statements, an index
check (``check_bounds``, e.g. an index out of bounds in ``x[idx]``) and
``device_assert_async``; a serial kernel's exception reaches the wrapper,
which raises it as a Python exception, a parallel kernel's aborts.

With torch_cppwrap's wrapper, a kernel body that can throw and runs in a
parallel region is wrapped, at its innermost loop, in a try/catch that keeps
the first exception (an atomic flag decides which, so threads never race)
and skips the body once one is kept; the exception is rethrown after the
region, on the calling thread, as the serial kernel would have thrown it::

    std::atomic<bool> parallel_failed{false};
    std::exception_ptr parallel_error;
    #pragma omp parallel num_threads(2)
    {
        ...
            for(int64_t x1=...)
            {
                if (!parallel_failed.load(std::memory_order_relaxed)) try
                {
                    <the body: checks, loads, compute, stores>
                }
                catch (...)
                {
                    if (!parallel_failed.exchange(true)) parallel_error = std::current_exception();
                }
            }
    }
    if (parallel_error) std::rethrow_exception(parallel_error);

The check runs before the access it guards, and a throw leaves the body, so
no out-of-bounds access follows a failed check.  Kernels that cannot throw,
and every kernel generated for another wrapper (the Python one, AOTInductor),
are generated exactly as Inductor generates them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch._inductor.codegen import cpp
from torch._inductor.utils import DeferredLineBase
from torch._inductor.virtualized import V

FLAG = "parallel_failed"
ERROR = "parallel_error"
DECLARATIONS = (
    f"std::atomic<bool> {FLAG}{{false}};",
    f"std::exception_ptr {ERROR};",
)
BODY_GUARD = f"if (!{FLAG}.load(std::memory_order_relaxed)) try"
CATCH = "catch (...)"
KEEP_FIRST = f"if (!{FLAG}.exchange(true)) {ERROR} = std::current_exception();"
RETHROW = f"if ({ERROR}) std::rethrow_exception({ERROR});"

# Kernels (CppKernel and subclasses) that emitted a statement that can throw.
_throwing_kernels: weakref.WeakSet[Any] = weakref.WeakSet()
# id(code buffer) -> the CatchingWorkSharing that writes its parallel regions.
_worksharing_of: weakref.WeakValueDictionary[int, CatchingWorkSharing] = (
    weakref.WeakValueDictionary()
)


def catches_here() -> bool:
    """Whether the kernels being generated serve torch_cppwrap's wrapper."""
    from torch_cppwrap._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    return isinstance(getattr(V.graph, "wrapper_code", None), CppWrapperCpu)


class _IfCatching(DeferredLineBase):
    """A line of a kernel function that is written only if one of its
    parallel regions catches: known once all its loops are generated."""

    def __init__(self, worksharing: CatchingWorkSharing, line: str) -> None:
        super().__init__(line)
        self.worksharing = worksharing

    def __call__(self) -> str | None:
        return self.line if self.worksharing.catches else None

    def _new_line(self, line: str) -> _IfCatching:
        return _IfCatching(self.worksharing, line)


class CatchingWorkSharing(cpp.WorkSharing):
    """Inductor's WorkSharing (which opens and closes the parallel regions of
    one kernel function), with the error state of the function declared
    before its first region and a rethrow after each region that catches."""

    def __init__(self, code: Any) -> None:
        super().__init__(code)
        self.catches = False  # some region of this function catches
        self.region_catches = False  # the open region catches
        _worksharing_of[id(code)] = self
        # The buffer is empty: these head the kernel function's loops.
        for line in DECLARATIONS:
            code.writeline(_IfCatching(self, line))

    def parallel(self, threads: int) -> None:
        if self.in_parallel and threads == self.num_threads:
            return  # the open region goes on
        if self.in_parallel:
            self.close()
        # Runs as the region closes, after its closing brace.
        self.stack.callback(self._after_region)
        super().parallel(threads)

    def _after_region(self) -> None:
        if self.region_catches:
            self.code.writeline(RETHROW)
        self.region_catches = False

    def catch_in_region(self) -> None:
        self.catches = self.region_catches = True


def open_region(code: Any) -> CatchingWorkSharing | None:
    """The WorkSharing whose parallel region is open in `code`, if any."""
    worksharing = _worksharing_of.get(id(code))
    if worksharing is None or worksharing.code is not code:
        return None
    return worksharing if worksharing.in_parallel else None


def catching_gen_body(original: Callable[..., None]) -> Callable[..., None]:
    """CppKernelProxy.gen_body, which writes a loop nest's innermost body,
    inside a try/catch where that body can throw in a parallel region."""

    def gen_body(self: Any, code: Any = None) -> None:
        region = open_region(code)
        if (
            region is None
            or not any(k in _throwing_kernels for k in self.kernels)
            or not catches_here()
        ):
            original(self, code)
            return
        region.catch_in_region()
        code.writeline(BODY_GUARD)
        with code.indent():
            original(self, code)
        code.writeline(CATCH)
        with code.indent():
            code.writeline(KEEP_FIRST)

    return gen_body


def recording_check_bounds(original: Callable[..., None]) -> Callable[..., None]:
    """CppKernel.check_bounds, recording the kernel when it emits a check."""

    def check_bounds(self: Any, expr: Any, size: Any, lower: bool, upper: bool) -> None:
        original(self, expr, size, lower, upper)
        if lower or upper:
            _throwing_kernels.add(self)

    return check_bounds


def recording_device_assert(original: Callable[..., None]) -> Callable[..., None]:
    """CppKernel.device_assert_async (a throw), recording the kernel."""

    def device_assert_async(self: Any, cond: Any, msg: str) -> None:
        original(self, cond, msg)
        _throwing_kernels.add(self)

    return device_assert_async
