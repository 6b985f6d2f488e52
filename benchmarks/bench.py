"""Benchmark: Inductor's Python wrapper, upstream's C++ wrapper and torch_cppwrap's
C++ wrapper, side by side.

    python benchmarks/bench.py [--workloads seed,mlp] [--modes python,cppwrap] [--quick]

Every (workload, mode) pair is compiled twice, each time in a fresh process
with its own TORCHINDUCTOR_CACHE_DIR: once cold (empty cache) and once warm
(the FX graph cache now hits).  The warm process also times the calls and
measures memory.  A worker (``python benchmarks/bench.py --worker ...``)
prints one JSON line; the parent collects them and writes bench.md,
bench.json and bench.png.

Importing torch_cppwrap patches Inductor, and the ``python`` and ``upstream``
modes must run without it, so this file imports torch_cppwrap only where the
``cppwrap`` mode needs it, inside functions.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import faulthandler
import functools
import gc
import json
import logging
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

RESULT_MARKER = "TORCH_CPPWRAP_BENCH_RESULT "


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Modes and workloads
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    label: str
    cpp_wrapper: bool
    imports_torch_cppwrap: bool
    compile_mode: str | None = None
    cuda_only: bool = False
    # Environment variables the worker runs with.
    environ: tuple[tuple[str, str], ...] = ()
    # A mode that compiles the same code as another (only the environment
    # differs at run time) skips its cold compile when both run, and times
    # on the cache that mode's cold compile left.
    cold_from: str | None = None


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode(
            "python", "Python wrapper", cpp_wrapper=False, imports_torch_cppwrap=False
        ),
        Mode(
            "upstream",
            "upstream cpp_wrapper",
            cpp_wrapper=True,
            imports_torch_cppwrap=False,
        ),
        Mode("cppwrap", "torch_cppwrap", cpp_wrapper=True, imports_torch_cppwrap=True),
        Mode(
            "cppwrap-no-replay",
            "torch_cppwrap, kernel by kernel (TORCH_CPPWRAP_CUDA_GRAPHS=0)",
            cpp_wrapper=True,
            imports_torch_cppwrap=True,
            cuda_only=True,
            environ=(("TORCH_CPPWRAP_CUDA_GRAPHS", "0"),),
            cold_from="cppwrap",
        ),
        Mode(
            "reduce-overhead",
            "CUDA graphs (reduce-overhead)",
            cpp_wrapper=False,
            imports_torch_cppwrap=False,
            compile_mode="reduce-overhead",
            cuda_only=True,
        ),
    )
}
DEFAULT_MODES = ("python", "upstream", "cppwrap")


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    description: str
    # (device) -> (callable, example inputs); the callable runs under no_grad.
    build: Callable[[str], tuple[Callable[..., Any], tuple[Any, ...]]]
    rtol: float = 1e-4
    atol: float = 1e-4
    # A training step: the callable returns a loss, each call runs backward().
    train: bool = False
    # Compiled with dynamic=True.
    dynamic: bool = False
    # Needs timm / transformers; run only when asked for by name (or `models`).
    real_model: bool = False


def _seed(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y).sum()

    return fn, (
        torch.randn(128, 128, device=device),
        torch.randn(128, 128, device=device),
    )


def _mlp(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)
            self.norm = nn.LayerNorm(width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x + nn.functional.gelu(self.linear(x)))

    model = nn.Sequential(*(Block(256) for _ in range(8))).to(device).eval()
    return model, (torch.randn(32, 256, device=device),)


def _transformer(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch
    from torch import nn

    # Eval + no_grad would otherwise take the fused fast path: one
    # aten._transformer_encoder_layer_fwd call, leaving Inductor nothing to
    # compile but that extern kernel.
    torch.backends.mha.set_fastpath_enabled(False)
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, batch_first=True)
    return layer.to(device).eval(), (torch.randn(8, 64, 256, device=device),)


def _convnet(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch
    from torch import nn

    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )
    return model.to(device).eval(), (torch.randn(8, 3, 32, 32, device=device),)


def _launches(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch

    # Softmaxes over alternate dimensions: no two can share a kernel, and
    # there is no extern kernel, so a call is the wrapper's launches alone.
    def fn(x: torch.Tensor) -> torch.Tensor:
        for i in range(32):
            x = torch.softmax(x * 1.5, dim=i % 2)
        return x

    return fn, (torch.randn(64, 64, device=device),)


def _model(
    name: str,
    description: str,
    *,
    train: bool = False,
    dynamic: bool = False,
    tol: float = 1e-2,
) -> Workload:
    return Workload(
        name,
        description,
        _real(name),
        rtol=tol,
        atol=tol,
        train=train,
        dynamic=dynamic,
        real_model=True,
    )


def _real(name: str) -> Callable[[str], tuple[Callable[..., Any], tuple[Any, ...]]]:
    def build(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # benchmarks/models.py, beside this script (the worker runs one build).
        here = str(Path(__file__).resolve().parent)
        if here not in sys.path:
            sys.path.insert(0, here)
        import models

        return getattr(models, name)(device)

    return build


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("seed", "(x + y).sum(), 128x128 float", _seed, rtol=1e-4, atol=1e-3),
        Workload(
            "mlp", "8 x (Linear 256->256, GELU, residual, LayerNorm), batch 32", _mlp
        ),
        Workload(
            "transformer",
            "TransformerEncoderLayer(d_model=256, nhead=4), batch 8, seq 64, MHA fast path off",
            _transformer,
            rtol=1e-3,
            atol=1e-3,
        ),
        Workload(
            "convnet",
            "3 x (Conv2d, ReLU) + pooling + Linear, batch 8, 3x32x32",
            _convnet,
        ),
        Workload(
            "launches",
            "32 softmaxes over alternate dimensions of a 64x64 tensor: a kernel "
            "each, no extern kernels",
            _launches,
            rtol=1e-4,
            atol=1e-5,
        ),
        _model("resnet18", "timm resnet18, batch 2, 224x224"),
        _model("vit_tiny", "timm vit_tiny_patch16_224, batch 2"),
        _model("mobilenetv3", "timm mobilenetv3_large_100, batch 2, 224x224"),
        _model("gpt2", "HF GPT-2 LM, 4 layers, 256 wide, batch 2, seq 64"),
        _model("bert", "HF BERT, 4 layers, 256 wide, batch 2, seq 128"),
        _model("t5", "HF T5, 2+2 layers, 256 wide, batch 2, seq 64/32"),
        _model(
            "gpt2_train_step",
            "HF GPT-2, 1 layer, train mode (dropout on): forward + backward of the loss",
            train=True,
            tol=5e-2,
        ),
        _model(
            "gpt2_dynamic",
            "the 4-layer GPT-2, compiled with dynamic=True",
            dynamic=True,
        ),
    )
}
DEFAULT_WORKLOADS = [w for w, spec in WORKLOADS.items() if not spec.real_model]
REAL_MODELS = [w for w, spec in WORKLOADS.items() if spec.real_model]


# --------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    median_us: float
    min_us: float
    calls_per_repeat: int
    repeats: int


def host_probe_us(budget: Budget) -> float:
    """µs per eager in-place add on a 0-d CPU tensor: Python, the
    dispatcher and nothing else, so it measures the host's speed at what
    the Python-heavy modes do per op.  Hosts lent for a run differ (on two
    leases of one GPU machine the Python wrapper's ResNet-18 took 1,480 and
    2,606 µs a call), and this says by how much."""
    import torch

    x = torch.zeros(())
    return time_per_call(
        lambda: x.add_(1), repeats=budget.repeats, target_s=budget.target_s / 5
    ).min_us


def time_per_call(
    fn: Callable[[], Any],
    *,
    repeats: int,
    target_s: float,
    sync: Callable[[], None] = lambda: None,
) -> Timing:
    """Microseconds per call of `fn`: warm up, size a repeat to take about
    `target_s`, then the median and min over `repeats` repeats."""

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return time.perf_counter() - start

    with gc_paused():
        # Not timed: the first calls may still load lazily, and a replayed
        # graph (ours, reduce-overhead's) is captured on its second call,
        # which takes milliseconds; sized from one of those, a repeat would
        # run a call or two (the calibration below stops at once).
        for _ in range(WARM_UP_CALLS):
            elapsed = run(1)
        n = 1
        # Calibrate (this is also the warm-up): grow n until a batch takes 1/5
        # of the target, then scale it up to the target.
        while elapsed < target_s / 5 and n < 10_000_000:
            n *= 4
            elapsed = run(n)
        n = max(1, round(n * target_s / max(elapsed, 1e-9)))
        per_call = [run(n) / n * 1e6 for _ in range(repeats)]
    return Timing(statistics.median(per_call), min(per_call), n, repeats)


def timed_first_call(
    step: Callable[[], Any], sync: Callable[[], None]
) -> tuple[Any, float]:
    """The compile: the first call of `step`, to its end on the device, and
    its seconds, from a collected heap.  Whether one of Python's full
    collections (some 0.2 s with torch and Inductor loaded) falls inside the
    compile otherwise turns on what the process allocated before it, which
    differs by mode: with torch_cppwrap imported, BERT's and ViT-Tiny's warm
    compiles on the device spent 0.2 s more in Dynamo's tracing, which runs
    none of our code, and a collection before the compile takes as much out
    of the same tracing on the development machine."""
    gc.collect()
    start = time.perf_counter()
    actual = step()
    sync()
    return actual, time.perf_counter() - start


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's garbage collector off while timing (a collection inside a
    timed call is the host's noise, not the wrapper's cost), as it was after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def step_spans(starts_ms: list[float], ends_ms: list[float]) -> dict[str, float]:
    """From the times of the CUDA events recorded before and after each step
    (ms, from the first), the median GPU span of a step (idle time inside it
    included) and the median idle time from one step's end to the next's
    start, in µs.  The first quarter of the steps is left out: the host is
    not ahead of the GPU yet while it issues them."""
    skip = len(starts_ms) // 4
    spans = [(e - s) * 1e3 for s, e in zip(starts_ms, ends_ms, strict=True)][skip:]
    between = [(s - e) * 1e3 for e, s in zip(ends_ms[:-1], starts_ms[1:], strict=True)][
        skip:
    ]
    return {
        "gpu_step_span_us": statistics.median(spans),
        "gpu_between_steps_us": statistics.median(between) if between else 0.0,
    }


def time_step_spans(step: Callable[[], Any], steps: int) -> dict[str, float]:
    """Records a CUDA event before and after each of `steps` steps issued
    back to back on the current stream, and reads step_spans from them."""
    import torch

    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(steps)
    ]
    with gc_paused():
        for before, after in events:
            before.record()
            step()
            after.record()
        torch.cuda.synchronize()
    first = events[0][0]
    return step_spans(
        [first.elapsed_time(before) for before, _ in events],
        [first.elapsed_time(after) for _, after in events],
    )


def call_times_us(
    f: Callable[[], Any], sync: Callable[[], None], calls: int
) -> tuple[list[float], list[float]]:
    """Each of `calls` calls of `f`, issued on an idle device (`sync`
    first), timed twice in µs: until `f` returns (the host's time, with
    nothing queued that a launch could wait behind), and until the device
    has finished it too (the call's latency, one by one: unlike a mean over
    calls, its median is not moved by a rare slow call)."""
    host, latency = [], []
    with gc_paused():
        for _ in range(calls):
            sync()
            start = time.perf_counter()
            f()
            returned = time.perf_counter()
            sync()
            host.append((returned - start) * 1e6)
            latency.append((time.perf_counter() - start) * 1e6)
    return host, latency


def host_times_us(
    f: Callable[[], Any], sync: Callable[[], None], calls: int
) -> list[float]:
    """The host time of each of `calls` calls of `f`, each issued on an idle
    device (call_times_us)."""
    return call_times_us(f, sync, calls)[0]


def new_compiled_modules(before: int) -> list[Any]:
    """Wrapper modules Inductor loaded since `PyCodeCache.modules` had `before`
    entries (one per compiled graph, on a cache miss or hit alike)."""
    from torch._inductor.codecache import PyCodeCache

    return [
        m for m in PyCodeCache.modules[before:] if callable(getattr(m, "call", None))
    ]


def compile_phases_s(min_s: float = 0.05) -> dict[str, float]:
    """Seconds per phase that Inductor and Dynamo time with dynamo_timed in
    this process so far (torch._dynamo.utils.compile_times()), the phases of
    at least `min_s`.  Phases nest (GraphLowering.codegen holds the tuning
    block), so they do not add up to the compile."""
    from torch._dynamo.utils import compilation_time_metrics

    totals = {key: sum(times) for key, times in compilation_time_metrics.items()}
    return {key: round(t, 3) for key, t in sorted(totals.items()) if t >= min_s}


def loaded_module_count() -> int:
    from torch._inductor.codecache import PyCodeCache

    return len(PyCodeCache.modules)


def wrapper_kind(module: Any) -> str:
    """Which code generator wrote an Inductor wrapper module."""
    cache = getattr(module, "CppWrapperCodeCache", None)
    if hasattr(module, "wrapper_src") or (
        cache is not None and cache.__module__.startswith("torch_cppwrap")
    ):
        return "torch_cppwrap"
    if hasattr(module, "inductor_entry") or hasattr(module, "cpp_wrapper_src"):
        return "upstream-cpp"
    return "python"


def replays_graphs(mode: Mode) -> bool:
    """Whether the mode runs ours with CUDA graph replay on (on a GPU)."""
    return (
        mode.imports_torch_cppwrap
        and ("TORCH_CPPWRAP_CUDA_GRAPHS", "0") not in mode.environ
    )


def module_call_runs(mode: Mode, device: str) -> bool:
    """Whether the compiled module's `call` on get_args()'s tensors is what
    the mode runs: not where CUDA graphs replay (reduce-overhead's, or ours
    on a GPU)."""
    return not (
        mode.compile_mode == "reduce-overhead"
        or (device == "cuda" and replays_graphs(mode))
    )


def time_module_call(
    module: Any, *, repeats: int, target_s: float, sync: Callable[[], None]
) -> Timing | None:
    """Times `module.call` alone on the module's own `get_args()` inputs
    (random values, the graph's shapes and strides).  `call` clears the list
    it gets, so each call gets a fresh one; that list copy is in the time."""
    get_args = getattr(module, "get_args", None)
    if get_args is None:
        return None
    try:
        args = get_args()
    except NameError as e:
        # A generated module whose get_args uses `torch` without importing it;
        # the module under test is `call`, so lend get_args the name.
        if e.name != "torch":
            raise
        import torch

        module.torch = torch
        args = get_args()
    call = module.call
    return time_per_call(
        lambda: call(list(args)), repeats=repeats, target_s=target_s, sync=sync
    )


class PeakMemory:
    """Peak memory above a baseline.  CPU: the process's peak RSS (VmHWM,
    reset through /proc/self/clear_refs where Linux allows, else
    getrusage's maxrss).  CUDA: torch.cuda.max_memory_reserved."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.base = 0.0
        self.source = ""

    def reset(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            # Reserved, not allocated: what CUDA graphs' private pools hold
            # (Inductor's and ours) is not in the allocated statistics.
            self.base = torch.cuda.memory_reserved() / 2**20
            self.source = "torch.cuda.max_memory_reserved"
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.base = _proc_status_mb("VmRSS")
            self.source = "peak RSS (VmHWM)"
        except OSError:
            self.base = _maxrss_mb()
            self.source = (
                "peak RSS (getrusage maxrss; a peak before the reset hides in it)"
            )

    def peak_mb(self) -> float:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            return torch.cuda.max_memory_reserved() / 2**20 - self.base
        if self.source.startswith("peak RSS (VmHWM)"):
            return _proc_status_mb("VmHWM") - self.base
        return _maxrss_mb() - self.base

    def segments_mb(self) -> dict[str, list[float]] | None:
        """CUDA: the caching allocator's segments, MB each, by memory pool
        ("0, 0" is the default pool; CUDA graphs' pools are the others), to
        tell what a peak is made of: the pools grow by whole segments (2 MB
        for small blocks, 20 MB for blocks of 1-10 MB, a cuBLAS workspace's
        size), not by the bytes their graphs use."""
        if self.device != "cuda":
            return None
        import torch

        pools: dict[str, list[float]] = {}
        for segment in torch.cuda.memory_snapshot():
            pool = ", ".join(str(i) for i in segment["segment_pool_id"])
            pools.setdefault(pool, []).append(segment["total_size"] / 2**20)
        return {pool: sorted(sizes, reverse=True) for pool, sizes in pools.items()}


def _proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise OSError(f"{field} not in /proc/self/status")


def _maxrss_mb() -> float:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 1024


def stop_compile_workers() -> None:
    """Ends Inductor's compile worker processes, which otherwise may still be
    starting up (importing torch) on other cores while we time."""
    from torch._inductor import async_compile

    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if shutdown is not None:
        shutdown()


def device_sync(device: str) -> Callable[[], None]:
    if device == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


def compare(
    actual: Any, expected: Any, *, rtol: float, atol: float
) -> tuple[bool, float]:
    """(allclose for every tensor, max absolute error) over nested outputs."""
    import torch
    import torch.utils._pytree as pytree

    got, want = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
    if len(got) != len(want):
        return False, float("inf")
    ok, max_err = True, 0.0
    for a, e in zip(got, want, strict=True):
        if not isinstance(e, torch.Tensor):
            ok = ok and a == e
            continue
        if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
            return False, float("inf")
        a, e = a.detach().float().cpu(), e.detach().float().cpu()
        if a.numel():
            max_err = max(max_err, (a - e).abs().max().item())
        ok = ok and torch.allclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    return ok, max_err


# --------------------------------------------------------------------------
# Worker: one compile in a fresh process
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Budget:
    """How long timing runs: repeats of about `target_s` seconds each."""

    repeats: int
    target_s: float


# torch_cppwrap's variable naming an installation of its runtime (see
# runtime_installation); spelt out here, since a worker that times the
# other wrappers must not import torch_cppwrap.
INSTALLED_RUNTIME_ENV = "TORCH_CPPWRAP_INSTALLED_RUNTIME_DIR"

# A lock file for warm workers running side by side (--warm-jobs); see
# TimingTurns.
TIMING_LOCK_ENV = "TORCH_CPPWRAP_BENCH_TIMING_LOCK"

# The CPU that warm workers time on (--timing-cpu); see pin_timing_thread.
TIMING_CPU_ENV = "TORCH_CPPWRAP_BENCH_TIMING_CPU"

# How long a warm worker may wait, before it times, for the host's other
# processes to fall quiet (--settle-s); see settle_host.
SETTLE_ENV = "TORCH_CPPWRAP_BENCH_SETTLE_S"
# Other processes' CPU use, in CPUs, under which the host counts as quiet,
# averaged over windows of SETTLE_WINDOW_S.
QUIET_CPUS = 0.5
SETTLE_WINDOW_S = 0.2

# Calls made before time_per_call sizes its repeats.
WARM_UP_CALLS = 3
# Steps issued back to back, between CUDA events, for a CUDA row's GPU time
# per step (time_step_spans).
SPAN_STEPS = 400
# Calls timed one by one on an idle GPU for a CUDA row's host time per call.
HOST_CALLS = 200

FULL = Budget(repeats=7, target_s=0.2)
QUICK = Budget(repeats=3, target_s=0.05)


class TimingTurns:
    """Turns on the timing lock file (TIMING_LOCK_ENV) of warm workers run
    side by side.  A worker holds it shared from its start (imports) to the
    end of its compile, then alone from its timing to its exit: none times
    while another imports, compiles, runs kernels or tears its CUDA context
    down.  Never released: the lock goes with the process's open file, after
    its CUDA context has gone."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a")  # noqa: SIM115 - held until the process ends

    def take(self, *, alone: bool) -> float:
        """Takes the lock, shared or alone (a shared one becomes exclusive);
        returns the seconds waited."""
        import fcntl  # --warm-jobs is for Linux machines (the device)

        started = time.perf_counter()
        fcntl.flock(self._file, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        return time.perf_counter() - started

    def close(self) -> None:
        self._file.close()


def _proc_stat(path: str) -> list[str] | None:
    """The fields of a Linux /proc/.../stat file after the command name
    (field 3 first), or None where it cannot be read.  The command name may
    hold spaces, so the fields are counted from its closing parenthesis."""
    try:
        return Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def current_cpu() -> int | None:
    """The CPU this thread runs on now (Linux), or None where unknown."""
    fields = _proc_stat("/proc/thread-self/stat")
    return int(fields[36]) if fields else None  # field 39


def pin_timing_thread() -> int | None:
    """Pins the calling thread (the one that times) to the CPU that
    TIMING_CPU_ENV names, if it names one, and returns the CPU it runs on.
    Pinned, every mode times on the same CPU and no timing moves between
    CPUs halfway.  It does not steady a host whose CPUs slow down in spells
    (the H200's: any CPU, for a while; scripts/gpu/host_cores.py shows
    them), which only more rounds do.  Only this thread moves: the
    driver's and torch's own threads stay where they were."""
    cpu = os.environ.get(TIMING_CPU_ENV)
    if cpu is not None:
        os.sched_setaffinity(0, {int(cpu)})
    return current_cpu()


@dataclasses.dataclass(frozen=True)
class CpuSample:
    """The host's CPU time so far (Linux's /proc/stat) and this process's
    own, in seconds."""

    at: float
    busy: float  # every CPU's time not idle, waiting on I/O or stolen
    steal: float  # time the hypervisor gave the CPUs to other machines
    own: float  # this process's, every thread's
    thread: float  # the sampling thread's (the one that times)


def cpu_sample() -> CpuSample | None:
    """Now's CpuSample, or None where /proc/stat is not there."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal [guest ...]; a
    # guest's time is in user and nice already.
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(v) for v in fields[1:9]
    )
    hz = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return CpuSample(
        at=time.monotonic(),
        busy=(user + nice + system + irq + softirq) / hz,
        steal=steal / hz,
        own=own.user + own.system,
        thread=time.thread_time(),
    )


def host_load(
    before: CpuSample | None, after: CpuSample | None
) -> dict[str, float] | None:
    """What else the host did between two samples, in CPUs: other
    processes' time ("others_cpus"), the time the hypervisor took away
    ("steal_cpus"), and this process's threads other than the sampling one
    ("own_threads_cpus": the driver's, torch's, a busy Python thread's).  A
    timing that shares the host with any of them may run slower for it."""
    if before is None or after is None or after.at <= before.at:
        return None
    span = after.at - before.at
    others = (after.busy - before.busy) - (after.own - before.own)
    return {
        "others_cpus": round(max(others, 0.0) / span, 3),
        "steal_cpus": round((after.steal - before.steal) / span, 3),
        "own_threads_cpus": round(
            max((after.own - after.thread) - (before.own - before.thread), 0.0) / span,
            3,
        ),
    }


def settle_host(max_wait_s: float) -> dict[str, Any]:
    """Waits, up to `max_wait_s`, until the host's other processes use fewer
    than QUIET_CPUS over a window of SETTLE_WINDOW_S (the compile workers of
    a process that just compiled may still be starting up or exiting);
    returns the seconds waited and the last window's host_load."""
    started = time.monotonic()
    while True:
        before = cpu_sample()
        time.sleep(SETTLE_WINDOW_S)
        load = host_load(before, cpu_sample())
        waited = time.monotonic() - started
        if load is None or load["others_cpus"] < QUIET_CPUS or waited >= max_wait_s:
            return {"settle_waited_s": round(waited, 3), "load_before_timing": load}


def child_processes() -> int | None:
    """How many processes this one started are still there (Linux), or None
    where unknown: compile workers that outlive their compile time beside
    the timing."""
    me = str(os.getpid())
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    # Field 4 is the parent's pid; a process gone since the listing reads
    # None and is not counted.
    stats = (_proc_stat(f"/proc/{pid}/stat") for pid in entries)
    return sum(1 for fields in stats if fields and fields[1] == me)


@functools.cache
def worker_turns() -> TimingTurns | None:
    """This worker's turns, kept for the process's life; None when the bench
    runs warm workers one at a time."""
    path = os.environ.get(TIMING_LOCK_ENV)
    return TimingTurns(path) if path else None


def run_worker(
    workload: str, mode_name: str, phase: str, device: str, quick: bool
) -> dict[str, Any]:
    """Compiles `workload` in `mode`; the `warm` phase also times it.  The
    caller sets TORCHINDUCTOR_CACHE_DIR."""
    mode, spec = MODES[mode_name], WORKLOADS[workload]
    budget = QUICK if quick else FULL
    result: dict[str, Any] = {
        "workload": workload,
        "mode": mode_name,
        "phase": phase,
        "device": device,
    }
    # Shared with other warm workers' imports and compiles, before any import.
    turns = worker_turns() if phase == "warm" else None
    if turns is not None:
        result["waited_to_compile_s"] = turns.take(alone=False)

    if mode.imports_torch_cppwrap:
        import torch_cppwrap

        result["torch_cppwrap_patched"] = torch_cppwrap.is_patched()
    elif "torch_cppwrap" in sys.modules:
        raise RuntimeError(
            f"mode {mode_name!r} must run without torch_cppwrap, but it is imported"
        )
    result["torch_cppwrap_imported"] = "torch_cppwrap" in sys.modules

    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch._inductor import config

    result["torch"] = torch.__version__
    result["torch_threads"] = torch.get_num_threads()
    config.cpp_wrapper = mode.cpp_wrapper
    config.fx_graph_cache = True
    sync = device_sync(device)

    torch.manual_seed(0)
    fn, args = spec.build(device)
    # Inference runs under no_grad; a training step calls backward() on the
    # loss it returns, so its backward graph is compiled and timed too.
    grad_mode = torch.enable_grad if spec.train else torch.no_grad
    with grad_mode():
        expected = fn(*args)
    if device == "cuda":
        # The eager run left a cuBLAS workspace per thread it ran matmuls on
        # (forward and backward; 32 MiB each on Hopper).  reduce-overhead
        # drops every stream's before it captures and empties the cache, so
        # left in the baseline they would leave from under its peak, and
        # not from under the other modes'.  Dropped now, while no other
        # thread runs a matmul, each mode's peak counts the ones it makes.
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
    compiled = torch.compile(
        fn, mode=mode.compile_mode, dynamic=True if spec.dynamic else None
    )

    step = make_step(fn, compiled, args, mode, spec)
    perf_hints = _PerfHints() if mode.imports_torch_cppwrap else None
    counters.clear()
    before = loaded_module_count()
    # The host's speed as this process found it before compiling: one
    # process of a machine can run everything up to 2x slower than the next
    # (with nothing else running), so a compile time, cold or warm, says as
    # much about its process as about the wrapper.
    result["compile_host_probe_us"] = host_probe_us(budget)
    memory = PeakMemory(device)
    memory.reset()
    with grad_mode():
        actual, result["compile_s"] = timed_first_call(step, sync)
    result["compile_phases_s"] = compile_phases_s()
    result["fx_cache_hit"] = counters["inductor"]["fxgraph_cache_hit"]
    result["fx_cache_counters"] = {
        k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph")
    }
    result["compile_mem_peak_mb"] = memory.peak_mb()
    result["ok"], result["max_abs_err"] = compare(
        actual, expected, rtol=spec.rtol, atol=spec.atol
    )
    # Dropped before the timed calls, as a serving loop drops each result:
    # held, the first call's outputs would keep their memory in a replayed
    # graph's pool (reduce-overhead's are freed by its next replay anyway,
    # and may no longer be read).
    del actual

    modules = new_compiled_modules(before)
    result["graphs"] = len(modules)
    result["wrappers"] = sorted({wrapper_kind(m) for m in modules})
    if perf_hints is not None:
        result["python_wrapper_fallbacks"] = counters["inductor"][
            "cppwrap_python_wrapper_fallback"
        ]
        result["perf_hints"] = perf_hints.messages

    if phase == "warm":
        stop_compile_workers()
        if turns is not None:
            result["waited_for_timing_s"] = turns.take(alone=True)
        _time_calls(result, step, modules, mode, spec, budget, memory, grad_mode)
    return result


def make_step(
    fn: Callable[..., Any],
    compiled: Callable[..., Any],
    args: tuple[Any, ...],
    mode: Mode,
    spec: Workload,
) -> Callable[[], Any]:
    """One step as every mode times it: `compiled` on `args`, with what a
    loop around it does in that mode."""
    # A training step's zero_grad (models.py).  Only there: an inference
    # model built as an nn.Module (timm's) has one too, and setting each of
    # its parameters' grad to None in Python costs ~400 µs a call on
    # ViT-Tiny, which no inference loop pays.
    zero_grad = getattr(fn, "zero_grad", None) if spec.train else None
    # A new step for reduce-overhead: Inductor's CUDA graphs may reuse the
    # last one's outputs (a training step's backward needs it said).
    mark_step = None
    if mode.compile_mode == "reduce-overhead":
        import torch

        mark_step = torch.compiler.cudagraph_mark_step_begin

    def step() -> Any:
        if mark_step is not None:
            mark_step()
        if zero_grad is not None:
            # Gradients set to None, as a training loop's zero_grad() does:
            # accumulating into the last step's would read reduce-overhead's
            # outputs after its next replay overwrote them.
            zero_grad()
        out = compiled(*args)
        if spec.train:
            out.backward()
        return out

    return step


def _time_calls(
    result: dict[str, Any],
    step: Callable[[], Any],
    modules: list[Any],
    mode: Mode,
    spec: Workload,
    budget: Budget,
    memory: PeakMemory,
    grad_mode: Callable[[], contextlib.AbstractContextManager[Any]],
) -> None:
    """Times `step` and each compiled module's `call` into `result`."""
    device = result["device"]
    sync = device_sync(device)
    result["loadavg_before_timing"] = (
        os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    )
    result["timing_cpu"] = pin_timing_thread()
    result["timing_cpu_pinned"] = TIMING_CPU_ENV in os.environ
    result["children_at_timing"] = child_processes()
    result.update(settle_host(float(os.environ.get(SETTLE_ENV, "0"))))
    before = cpu_sample()
    result["host_probe_us"] = host_probe_us(budget)
    with grad_mode():
        e2e = time_per_call(
            step,
            repeats=budget.repeats,
            target_s=budget.target_s,
            sync=sync,
        )
        result["e2e_us_median"], result["e2e_us"] = e2e.median_us, e2e.min_us
        # Taken before anything else is timed: the module's `call` runs on
        # get_args()'s inputs, another set of tensors than the step's.
        result["mem_peak_mb"] = memory.peak_mb()
        result["mem_source"] = memory.source
        result["mem_segments_mb"] = memory.segments_mb()
        if device == "cuda":
            # Latency: each call waits for the GPU before the next one is
            # issued, as a batch-1 server's requests do.  In e2e the host runs
            # ahead, so a graph the GPU is slower at than the host takes the
            # GPU's time per call whichever wrapper launched it.
            def step_and_wait() -> None:
                step()
                sync()

            latency = time_per_call(
                step_and_wait, repeats=budget.repeats, target_s=budget.target_s
            )
            result["e2e_sync_us_median"] = latency.median_us
            result["e2e_sync_us"] = latency.min_us
            # Host time: a call issued on an idle GPU, the median of
            # HOST_CALLS.  What the wrapper costs the host per call, which
            # e2e hides where the GPU is the slower of the two, and to which
            # latency adds the GPU's time.  The same calls' median latency
            # sets a rare slow call apart from a slow call.
            host, latency_each = call_times_us(step, sync, HOST_CALLS)
            result["host_us"] = statistics.median(host)
            result["latency_p50_us"] = statistics.median(latency_each)
            # The GPU's own time per step, from CUDA events: e2e above it is
            # time the GPU waited for the host.
            result.update(time_step_spans(step, SPAN_STEPS))
        # CUDA graphs replay the whole graph; its module's `call` alone is
        # not what runs, so there is nothing honest to time: reduce-overhead
        # does not run `call` at all, and ours, given get_args()'s plain
        # tensors for parameters, captures a graph that copies every one of
        # them in before each replay, which a compiled model's calls never
        # do.  A training step's graphs take indices (token ids, labels, the
        # philox seed and offset of attention's dropout) that get_args()
        # fills with random values, on which its kernels read out of bounds.
        calls = [
            None
            if spec.train or not module_call_runs(mode, device)
            else time_module_call(
                m, repeats=budget.repeats, target_s=budget.target_s, sync=sync
            )
            for m in modules
        ]
    timed = [c for c in calls if c is not None]
    if timed and len(timed) == len(calls):
        result["call_us_median"] = sum(c.median_us for c in timed)
        result["call_us"] = sum(c.min_us for c in timed)
    # What else ran on the host while this process timed.
    result["load_during_timing"] = host_load(before, cpu_sample())
    if mode.imports_torch_cppwrap and device == "cuda":
        result["replay"] = [_replay_state(m) for m in modules]


class _PerfHints(logging.Handler):
    """Collects what torch_cppwrap says on the perf_hints log (a graph that
    fell back to the Python wrapper, or is not replayed, and why)."""

    def __init__(self) -> None:
        super().__init__()
        import torch

        self.messages: list[str] = []
        torch._logging.set_logs(perf_hints=True)
        for name in ("torch._inductor", "torch_cppwrap"):
            logging.getLogger(name).addHandler(self)
        # What the code cache built, and in how long.
        logging.getLogger("torch_cppwrap._inductor.codecache").setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "torch_cppwrap" in message:
            self.messages.append(message)


def _replay_state(module: Any) -> dict[str, Any]:
    """Whether one CUDA graph module of ours replays, and if not, why."""
    if wrapper_kind(module) != "torch_cppwrap":
        return {"wrapper": wrapper_kind(module)}
    state = getattr(module._module, "cuda_graph_state", None)
    stats = getattr(module._module, "cuda_graph_stats", None)
    return {
        "state": state() if state is not None else "kernel by kernel",
        "blocker": getattr(module, "cuda_graph_blocker", None),
        # Per graph (one per set of sizes): calls replayed, missed, ...
        "stats": stats() if stats is not None else None,
    }


def _worker_main(argv: Sequence[str]) -> int:
    faulthandler.enable()  # a crash in compiled code still leaves a traceback
    parser = argparse.ArgumentParser(prog="bench.py --worker")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--mode", required=True, choices=sorted(MODES))
    parser.add_argument("--phase", required=True, choices=("cold", "warm"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    ns = parser.parse_args(argv)
    try:
        result = run_worker(ns.workload, ns.mode, ns.phase, ns.device, ns.quick)
    except Exception as e:
        result = {
            "workload": ns.workload,
            "mode": ns.mode,
            "phase": ns.phase,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def worker_env(
    mode: str, cache_dir: str, extra_env: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of a worker process that compiles in `mode` on the
    Inductor cache `cache_dir`."""
    env = dict(
        os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_FX_GRAPH_CACHE="1"
    )
    env.update(extra_env or {})
    # The cppwrap mode imports the torch_cppwrap of this checkout, installed
    # or not.
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, (package_root, env.get("PYTHONPATH")))
    )
    env.update(MODES[mode].environ)
    return env


def worker_command(
    workload: str, mode: str, phase: str, device: str, quick: bool
) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    cmd += [
        "--workload",
        workload,
        "--mode",
        mode,
        "--phase",
        phase,
        "--device",
        device,
    ]
    return [*cmd, "--quick"] if quick else cmd


def spawn_worker(
    workload: str,
    mode: str,
    phase: str,
    *,
    device: str,
    quick: bool,
    cache_dir: str,
    timeout_s: float,
    threads: int | None = None,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    env = worker_env(mode, cache_dir, extra_env)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = worker_command(workload, mode, phase, device, quick)
    try:
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s", "command": " ".join(cmd)}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    output = proc.stdout + proc.stderr
    # A crash's traceback (faulthandler's) comes first, then a list of
    # extension modules that can fill the tail on its own.
    crash = output.find("Fatal Python error")
    tail = output[crash : crash + 3000] if crash >= 0 else output[-3000:]
    status = str(proc.returncode)
    if proc.returncode < 0:
        with contextlib.suppress(ValueError):
            status += f" ({signal.Signals(-proc.returncode).name})"
    return {
        "error": f"worker exited with status {status} and printed no result (its output is in bench.json)",
        "output_tail": tail,
        "command": " ".join(cmd),
    }


def prepare_torch_cppwrap(installed_dir: str, device: str = "cpu") -> None:
    """Installs torch_cppwrap's runtime extension and precompiled headers
    into `installed_dir`, as ``python -m torch_cppwrap build`` does, so that
    no mode's first cold compile pays for them: upstream's precompiled
    headers, kept in Inductor's default cache directory whatever
    TORCHINDUCTOR_CACHE_DIR says, are not billed to its either."""
    try:
        import torch_cppwrap  # noqa: F401
        from torch_cppwrap._inductor import codecache
    except ImportError as e:  # pragma: no cover - broken install
        progress(f"note: could not prepare torch_cppwrap's runtime ({e})")
        return
    env = {codecache.INSTALLED_RUNTIME_ENV: installed_dir}
    try:
        with mock.patch.dict(os.environ, env):
            codecache.prepare_runtime(device, install=True)
    except Exception as e:  # the workers then build it into their caches
        progress(
            f"note: could not install torch_cppwrap's runtime ({type(e).__name__}: "
            f"{e}); each cold compile of ours includes building it"
        )


@contextlib.contextmanager
def runtime_installation(device: str, prefix: str) -> Iterator[dict[str, str]]:
    """The environment that points a run's workers at torch_cppwrap's runtime,
    installed once for the run: into the directory that
    TORCH_CPPWRAP_INSTALLED_RUNTIME_DIR names (installed into if need be, and
    kept), else into a temporary one, removed when the run ends."""
    given = os.environ.get(INSTALLED_RUNTIME_ENV)
    installed = given or tempfile.mkdtemp(prefix=prefix)
    try:
        progress("installing torch_cppwrap's runtime for this run...")
        prepare_torch_cppwrap(installed, device)
        yield {INSTALLED_RUNTIME_ENV: installed}
    finally:
        if given is None:
            shutil.rmtree(installed, ignore_errors=True)


def _merge(
    workload: str, mode: str, cold: dict[str, Any], warm: dict[str, Any]
) -> dict[str, Any]:
    record: dict[str, Any] = {"workload": workload, "mode": mode}
    errors = [
        f"{phase}: {r['error'].strip().splitlines()[0]}"
        for phase, r in (("cold", cold), ("warm", warm))
        if "error" in r
    ]
    record["error"] = "; ".join(errors) or None
    # `warm` is empty until the mode's first warm process (timing) is done:
    # a run stopped before then keeps its cold compile.
    record["timed"] = bool(warm)
    record["ok"] = (
        None if errors else bool(cold.get("ok") and (warm.get("ok") if warm else True))
    )
    record["cold_compile_s"] = cold.get("compile_s")
    record["warm_compile_s"] = warm.get("compile_s")
    record["cold_phases_s"] = cold.get("compile_phases_s")
    record["warm_phases_s"] = warm.get("compile_phases_s")
    # The warm process's times (its compile is warm_compile_s, above).
    for key in (
        *(key for key in TIMED if key != "compile_s"),
        "mem_peak_mb",
        "mem_segments_mb",
        "graphs",
        "wrappers",
    ):
        record[key] = warm.get(key)
    record["max_abs_err"] = max(
        cold.get("max_abs_err") or 0.0, warm.get("max_abs_err") or 0.0
    )
    record["warm_fx_cache_hit"] = bool(warm.get("fx_cache_hit"))
    record["cold"], record["warm"] = cold, warm
    return record


def run_bench(
    workloads: Sequence[str],
    modes: Sequence[str],
    *,
    device: str,
    quick: bool,
    timeout_s: float,
    threads: int | None = None,
    on_record: Callable[[dict[str, Any]], object] | None = None,
    rounds: int = 1,
    jobs: int = 1,
    warm_jobs: int = 1,
    timing_cpu: int | None = None,
    settle_s: float = 0.0,
    cold_rounds: int = 1,
) -> dict[str, Any]:
    """Runs every workload in every mode: `cold_rounds` rounds of cold
    compile per mode (each in a fresh cache, the modes in alternating order;
    the warm processes read the last round's cache), then `rounds` rounds of
    warm compile + timing per mode.  `on_record` gets the
    report so far after each round, so an interrupted run keeps its rows.
    A mode whose code another mode compiles (Mode.cold_from) times on that
    mode's cache, with no cold compile of its own.

    With `jobs` > 1, the cold compiles of that many workloads run side by
    side first; the warm processes (which time) then run one at a time, with
    nothing else running beside them.  With `warm_jobs` > 1, the warm
    processes of that many workloads run side by side, and take turns to
    time (a lock file, TIMING_LOCK_ENV): no two time at once, but one may
    time while another starts up and loads its compiled code.  With
    `timing_cpu`, each warm process times pinned to that CPU.  Each waits up
    to `settle_s` before it times for the host's other processes to fall
    quiet (settle_host)."""
    by_workload: dict[str, list[dict[str, Any]]] = {}
    steps = len(workloads) * sum(
        rounds + cold_rounds * (MODES[m].cold_from not in modes) for m in modes
    )
    step = 0
    lock = threading.Lock()  # the counters, the records and on_record

    def run(
        workload: str, mode: str, phase: str, cache_dir: str, round_: int = 0
    ) -> dict[str, Any]:
        nonlocal step
        with lock:
            step += 1
            what = "cold compile" if phase == "cold" else "warm compile + timing"
            of = cold_rounds if phase == "cold" else rounds
            if of > 1:
                what += f" (round {round_ + 1}/{of})"
            progress(f"[{step}/{steps}] {workload} / {mode}: {what}...")
        started = time.perf_counter()
        r = spawn_worker(
            workload,
            mode,
            phase,
            device=device,
            quick=quick,
            cache_dir=cache_dir,
            timeout_s=timeout_s,
            threads=threads,
            extra_env=extra_env,
        )
        # The whole step (process start, imports, model build, compile,
        # timing): what a run's time limit has to fit.
        r["worker_s"] = time.perf_counter() - started
        progress(f"    {workload} / {mode} {phase}: " + _summary(r))
        return r

    def records_so_far() -> list[dict[str, Any]]:
        return [r for w in workloads for r in by_workload.get(w, [])]

    cache_dirs: dict[str, dict[str, str]] = {}
    cleanups: list[str] = []

    def record(
        workload: str,
        cold: dict[str, list[dict[str, Any]]],
        warm: dict[str, list[dict[str, Any]]],
    ) -> None:
        """The workload's rows so far (a mode not timed yet has its cold
        compiles only), handed to on_record: a run stopped by a time limit
        keeps every step it finished."""
        with lock:
            by_workload[workload] = [
                {
                    **_merge(
                        workload,
                        mode,
                        _best_round(cold[mode]),
                        _best_round(warm[mode]) if warm[mode] else {},
                    ),
                    "cold_rounds": list(cold[mode]),
                    "warm_rounds": list(warm[mode]),
                }
                for mode in modes
                if cold.get(mode)
            ]
            if on_record is not None:
                on_record(_report(device, quick, workloads, modes, records_so_far()))

    def shares_cold(mode: str) -> str | None:
        source = MODES[mode].cold_from
        return source if source in modes else None

    def cold_workload(workload: str) -> dict[str, list[dict[str, Any]]]:
        dirs = cache_dirs[workload] = {}
        cold: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        # Like the timing rounds, cold rounds alternate the order of the modes.
        for round_ in range(cold_rounds):
            for mode in modes if round_ % 2 == 0 else list(reversed(modes)):
                if shares_cold(mode) is not None:
                    continue
                if mode in dirs:  # an earlier round's cache: a cold one again
                    shutil.rmtree(dirs[mode], ignore_errors=True)
                dirs[mode] = tempfile.mkdtemp(
                    prefix=f"cppwrap-bench-{workload}-{mode}-"
                )
                cold[mode].append(run(workload, mode, "cold", dirs[mode], round_))
                record(workload, cold, {m: [] for m in modes})
        for mode in modes:
            source = shares_cold(mode)
            if source is not None:
                dirs[mode] = dirs[source]
                cold[mode] = [{"ok": True, "cold_from": source}]
        record(workload, cold, {m: [] for m in modes})
        return cold

    def warm_workload(workload: str, cold: dict[str, list[dict[str, Any]]]) -> None:
        warm: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        # Timing rounds alternate the order of the modes, so that a slow
        # spell of the machine does not land on one mode only.
        for round_ in range(rounds):
            for mode in modes if round_ % 2 == 0 else list(reversed(modes)):
                warm[mode].append(
                    run(workload, mode, "warm", cache_dirs[workload][mode], round_)
                )
                record(workload, cold, warm)

    installation: contextlib.AbstractContextManager[dict[str, str]] = (
        runtime_installation(device, "cppwrap-bench-installed-")
        if any(MODES[mode].imports_torch_cppwrap for mode in modes)
        else contextlib.nullcontext({})
    )
    with installation as extra_env:
        if timing_cpu is not None:
            extra_env[TIMING_CPU_ENV] = str(timing_cpu)
        if settle_s > 0:
            extra_env[SETTLE_ENV] = str(settle_s)
        try:
            if jobs > 1 or warm_jobs > 1:
                with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
                    colds = dict(
                        zip(workloads, pool.map(cold_workload, workloads), strict=True)
                    )
                if warm_jobs > 1:
                    lock_dir = tempfile.mkdtemp(prefix="cppwrap-bench-timing-")
                    cleanups.append(lock_dir)
                    extra_env[TIMING_LOCK_ENV] = os.path.join(lock_dir, "timing.lock")
                with concurrent.futures.ThreadPoolExecutor(warm_jobs) as pool:
                    list(pool.map(lambda w: warm_workload(w, colds[w]), workloads))
            else:
                for workload in workloads:
                    warm_workload(workload, cold_workload(workload))
        finally:
            for dirs in cache_dirs.values():
                for cache_dir in set(dirs.values()):
                    shutil.rmtree(cache_dir, ignore_errors=True)
            for path in cleanups:
                shutil.rmtree(path, ignore_errors=True)
    return _report(device, quick, workloads, modes, records_so_far())


TIMED = (
    "compile_s",
    "e2e_us",
    "e2e_us_median",
    "e2e_sync_us",
    "e2e_sync_us_median",
    "host_us",
    "latency_p50_us",
    "call_us",
    "call_us_median",
)


# What a worker records of one of its times, kept from the round whose time
# is reported.
TIMED_DETAILS = {
    "compile_s": ("compile_phases_s",),
    "e2e_us": ("gpu_step_span_us", "gpu_between_steps_us"),
}


def _probe_of(result: dict[str, Any], key: str) -> float | None:
    """The host probe that goes with a worker's time `key`: the one taken
    before its compile for compile_s, the one before its timing else."""
    if key == "compile_s":
        return result.get("compile_host_probe_us")
    return result.get("host_probe_us")


def _best_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from a mode's rounds of one phase (cold or warm): the first
    round's, with each time the fastest any round measured (an error in any
    round is kept), the compile's phases from the round of the fastest
    compile, and under "probe_of" the host probe of the round each time came
    from."""
    best = dict(rounds[0])
    best["probe_of"] = {
        key: _probe_of(best, key) for key in TIMED if best.get(key) is not None
    }
    for r in rounds[1:]:
        if "error" in r and "error" not in best:
            best["error"] = r["error"]
        for key in TIMED:
            if r.get(key) is not None and (best.get(key) is None or r[key] < best[key]):
                best[key] = r[key]
                best["probe_of"][key] = _probe_of(r, key)
                for detail in TIMED_DETAILS.get(key, ()):
                    best[detail] = r.get(detail)
    best["ok"] = all(r.get("ok") for r in rounds)
    best["rounds"] = len(rounds)
    return best


def _report(
    device: str,
    quick: bool,
    workloads: Sequence[str],
    modes: Sequence[str],
    records: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "meta": _meta(device, quick, workloads, modes, records),
        "results": list(records),
        "ratios": ratios(records),
    }


def _summary(r: dict[str, Any]) -> str:
    if "error" in r:
        return "FAILED: " + r["error"].splitlines()[0][:300]
    parts = [
        f"compile {r['compile_s']:.2f} s",
        "matches eager" if r["ok"] else "MISMATCH vs eager",
    ]
    if r.get("e2e_us") is not None:
        parts.append(f"e2e {r['e2e_us']:.1f} us")
    if r.get("call_us") is not None:
        parts.append(f"call {r['call_us']:.1f} us")
    if r.get("mem_peak_mb") is not None:
        parts.append(f"peak {r['mem_peak_mb']:.0f} MB")
    if r.get("wrappers"):
        parts.append("wrapper: " + ",".join(r["wrappers"]))
    if r.get("worker_s") is not None:
        parts.append(f"step {r['worker_s']:.0f} s")
    return ", ".join(parts)


def _meta(
    device: str,
    quick: bool,
    workloads: Sequence[str],
    modes: Sequence[str],
    records: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    import torch

    budget = QUICK if quick else FULL
    # Every warm process (one per row and round).
    warm = [w for r in records for w in _warm_rounds(r)]
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "device_name": torch.cuda.get_device_name()
        if device == "cuda"
        else platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        # what the workers ran with (OMP_NUM_THREADS / --threads)
        "torch_threads": next(
            (
                r["warm"].get("torch_threads")
                for r in records
                if "torch_threads" in r["warm"]
            ),
            None,
        ),
        "quick": quick,
        "rounds": max((r["warm"].get("rounds", 1) for r in records), default=1),
        "cold_rounds": max(
            (len(r.get("cold_rounds") or [1]) for r in records), default=1
        ),
        "repeats": budget.repeats,
        "repeat_target_s": budget.target_s,
        "workloads": {w: WORKLOADS[w].description for w in workloads},
        "modes": {m: MODES[m].label for m in modes},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        # Warm processes ran side by side (--warm-jobs), timing in turns.
        "timed_in_turns": any(
            r["warm"].get("waited_for_timing_s") is not None for r in records
        ),
        "max_loadavg_before_timing": max(
            (r["warm"].get("loadavg_before_timing") or 0.0 for r in records),
            default=None,
        ),
        # The host's speed before each timing (host_probe_us), fastest and
        # slowest over the warm processes.
        "host_probe_us": _spread(w.get("host_probe_us") for w in warm),
        # The same before each compile, over the cold and warm processes.
        "compile_host_probe_us": _spread(
            p.get("compile_host_probe_us")
            for p in (*(c for r in records for c in _cold_rounds(r)), *warm)
        ),
        # The CPUs the warm processes timed on, and whether they were pinned
        # there (--timing-cpu).
        "timing_cpus": sorted(
            {w["timing_cpu"] for w in warm if w.get("timing_cpu") is not None}
        ),
        "timing_cpu_pinned": any(w.get("timing_cpu_pinned") for w in warm),
        # What else the host ran while the warm processes timed (host_load),
        # fewest and most CPUs over them, and the longest wait for it to fall
        # quiet first (--settle-s).
        **{
            f"{key}_during_timing": _spread(
                (w.get("load_during_timing") or {}).get(key) for w in warm
            )
            for key in ("others_cpus", "steal_cpus", "own_threads_cpus")
        },
        "max_settle_waited_s": max(
            (
                w["settle_waited_s"]
                for w in warm
                if w.get("settle_waited_s") is not None
            ),
            default=None,
        ),
    }


def _warm_rounds(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every warm process of a row (one per round)."""
    return record.get("warm_rounds") or [record["warm"]]


def _cold_rounds(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every cold process of a row (one per cold round)."""
    return record.get("cold_rounds") or [record.get("cold") or {}]


def _spread(values: Iterable[float | None]) -> list[float] | None:
    """[min, max] of the values that are there, or None."""
    present = [v for v in values if v is not None]
    return [min(present), max(present)] if present else None


RATIO_METRICS = (
    ("call_us", "call"),
    ("e2e_us", "e2e"),
    ("cold_compile_s", "cold compile"),
    ("warm_compile_s", "warm compile"),
)


# What the GPU targets compare (metric, mode, against mode, label): ours
# replayed against CUDA graphs, ours kernel by kernel against the Python
# wrapper.  Keys of a ratios() row: "{metric}:{mode}/{against}".
CUDA_RATIOS = (
    ("e2e_us", "cppwrap", "reduce-overhead", "e2e ours/reduce-overhead"),
    ("e2e_sync_us", "cppwrap", "reduce-overhead", "latency ours/reduce-overhead"),
    (
        "latency_p50_us",
        "cppwrap",
        "reduce-overhead",
        "median latency ours/reduce-overhead",
    ),
    ("host_us", "cppwrap", "reduce-overhead", "host ours/reduce-overhead"),
    ("mem_peak_mb", "cppwrap", "reduce-overhead", "peak ours/reduce-overhead"),
    ("e2e_us", "cppwrap-no-replay", "python", "e2e kernel by kernel/python"),
    ("host_us", "cppwrap-no-replay", "python", "host kernel by kernel/python"),
    ("call_us", "cppwrap-no-replay", "python", "call kernel by kernel/python"),
)


# Times per call, which move with the host's speed (compile times and memory
# move less, or not at all).
PER_CALL_METRICS = frozenset(
    {"call_us", "e2e_us", "e2e_sync_us", "latency_p50_us", "host_us"}
)
# Compile times, and the process whose host probe goes with each.
COMPILE_METRICS = {"cold_compile_s": "cold", "warm_compile_s": "warm"}
# A ratio of times whose two rows' processes found the host more than this
# much faster or slower than each other (host_probe_us before timing,
# compile_host_probe_us before compiling) is marked in the report: it
# measures the host as much as the wrappers.
HOST_PROBE_SPREAD = 1.5


def ratios(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch_cppwrap's metric divided by the Python wrapper's and upstream's,
    per workload (below 1: torch_cppwrap is faster), and the comparisons of
    CUDA_RATIOS where both modes ran; for each ratio of times per call, that
    of the host probes of the warm processes its two times came from
    ("host_probe:{key}"), and under "host_apart" the keys of those whose two
    probes are more than HOST_PROBE_SPREAD apart."""
    by_key = {(r["workload"], r["mode"]): r for r in records}

    def value(mode: str, metric: str) -> float | None:
        return (by_key.get((workload, mode)) or {}).get(metric)

    def probe(mode: str, metric: str) -> float | None:
        """The host probe of the process that timed `metric`."""
        record = by_key.get((workload, mode)) or {}
        phase = COMPILE_METRICS.get(metric, "warm")
        result = record.get(phase) or {}
        key = "compile_s" if metric in COMPILE_METRICS else metric
        return (result.get("probe_of") or {}).get(key, _probe_of(result, key))

    def ratio(
        metric: str,
        mode: str,
        base: str,
        of: Callable[[str, str], float | None] = value,
    ) -> float | None:
        a, b = of(mode, metric), of(base, metric)
        return a / b if a is not None and b else None

    # (key in a row, metric, mode, against mode) of every ratio.
    compared = [
        (f"{metric}/{base}", metric, "cppwrap", base)
        for base in ("python", "upstream")
        for metric, _ in RATIO_METRICS
    ]
    compared += [
        (f"{metric}:{mode}/{base}", metric, mode, base)
        for metric, mode, base, _ in CUDA_RATIOS
    ]
    rows = []
    for workload in dict.fromkeys(r["workload"] for r in records):
        if (workload, "cppwrap") not in by_key:
            continue
        row: dict[str, Any] = {"workload": workload, "host_apart": []}
        for key, metric, mode, base in compared:
            row[key] = ratio(metric, mode, base)
            if metric not in PER_CALL_METRICS and metric not in COMPILE_METRICS:
                continue
            probes = row[f"host_probe:{key}"] = ratio(metric, mode, base, of=probe)
            if (
                row[key] is not None
                and probes is not None
                and not 1 / HOST_PROBE_SPREAD <= probes <= HOST_PROBE_SPREAD
            ):
                row["host_apart"].append(key)
        rows.append(row)
    return rows


def _ratio_cell(row: dict[str, Any], key: str) -> str:
    """A ratio's cell, "†" after one whose rows ran on hosts of speeds
    apart (ratios()' "host_apart")."""
    return _fmt(row.get(key), 2) + (" †" if key in row.get("host_apart", ()) else "")


def replay_summary(record: dict[str, Any]) -> str | None:
    """Which of a CUDA row's graphs of ours were replayed, and why the others
    were not, in a line; None for a row without them."""
    modules = (record.get("warm") or {}).get("replay")
    if not modules:
        return None
    parts = []
    for module in modules:
        if "wrapper" in module:  # a graph another wrapper compiled
            parts.append(f"{module['wrapper']} wrapper")
            continue
        graphs = module.get("stats") or []
        if module.get("state") == "ready" or any(
            g.get("state") == "ready" for g in graphs
        ):
            replays = ", ".join(str(g.get("replays", 0)) for g in graphs)
            missed = sum(g.get("missed", 0) for g in graphs)
            parts.append(
                f"replayed: {len(graphs)} graph(s), {replays} replays, {missed} missed"
            )
        else:
            why = module.get("blocker") or module.get("state") or "kernel by kernel"
            parts.append(f"kernel by kernel: {why}")
    return "; ".join(parts)


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def markdown(report: dict[str, Any]) -> str:
    meta, records = report["meta"], report["results"]
    cuda = meta["device"] == "cuda"
    memory = "CUDA max_memory_reserved" if cuda else "peak RSS"
    lines = [
        "# torch_cppwrap benchmark",
        "",
        f"torch {meta['torch']}, Python {meta['python']}, device {meta['device']} "
        f"({meta['device_name']}, {meta['cpu_count']} CPUs, {meta['torch_threads']} torch threads), "
        f"{meta['date']}{', --quick' if meta['quick'] else ''}"
        f"{'; warm processes side by side, timing in turns' if meta.get('timed_in_turns') else ''}.",
        "",
        "| workload | mode | matches eager | cold compile s | warm compile s | e2e µs/call "
        + ("| latency µs/call | host µs/call " if cuda else "")
        + "| `call` µs/call | peak MB |",
        "|---|---|---|--:|--:|--:|" + ("--:|--:|" if cuda else "") + "--:|--:|",
    ]
    for r in records:
        ok = "FAIL" if r["error"] else ("yes" if r["ok"] else "**NO**")
        latency = (
            f"| {_fmt(r.get('e2e_sync_us'))} | {_fmt(r.get('host_us'))} "
            if cuda
            else ""
        )
        lines.append(
            f"| {r['workload']} | {r['mode']} | {ok} | {_fmt(r['cold_compile_s'], 2)} "
            f"| {_fmt(r['warm_compile_s'], 2)} | {_fmt(r['e2e_us'])} {latency}"
            f"| {_fmt(r['call_us'])} | {_fmt(r['mem_peak_mb'])} |"
        )
    if any(
        v is not None
        for row in report["ratios"]
        for k, v in row.items()
        if k not in ("workload", "host_apart") and not k.startswith("host_probe:")
    ):
        header = " | ".join(
            f"{label} ours/{base}"
            for base in ("python", "upstream")
            for _, label in RATIO_METRICS
        )
        lines += [
            "",
            "Ratios, torch_cppwrap / other (below 1: torch_cppwrap is faster):",
            "",
            f"| workload | {header} |",
            "|---|" + "--:|" * (2 * len(RATIO_METRICS)),
        ]
        for row in report["ratios"]:
            cells = " | ".join(
                _ratio_cell(row, f"{metric}/{base}")
                for base in ("python", "upstream")
                for metric, _ in RATIO_METRICS
            )
            lines.append(f"| {row['workload']} | {cells} |")
    lines += _cuda_tables(report)
    lines += _compile_phase_lines(records, "cold")
    lines += _compile_phase_lines(records, "warm")
    lines += [
        "",
        "- modes: " + "; ".join(f"`{k}` = {v}" for k, v in meta["modes"].items()) + ".",
        "- cold compile: the first call in a fresh process with an empty TORCHINDUCTOR_CACHE_DIR "
        "(torch_cppwrap's runtime extension and precompiled headers are installed "
        "beforehand, as `python -m torch_cppwrap build` does, into a directory of the run's; "
        "upstream keeps its precompiled headers in Inductor's default cache "
        "directory; every mode probes the vector ISA in its fresh cache, as Inductor does); "
        "warm compile: the "
        "same in another fresh process on that cache (FX graph cache hit); each "
        "compile starts after a full garbage collection.",
        f"- e2e: one call of the torch.compile'd function; `call`: the compiled Inductor module's "
        f"`call(list(args))` alone, on its `get_args()` inputs, summed over graphs. The fastest of "
        f"{meta['repeats']} repeats of ~{meta['repeat_target_s']} s each, after warm-up (medians in "
        "bench.json); inference under torch.no_grad()"
        + (
            "; latency: the same with a synchronize after each call, so that no call "
            "is issued before the GPU has finished the last (what a batch-1 server's "
            "request costs; in e2e the host runs ahead, and a graph that keeps the GPU "
            "busier than the host takes the GPU's time whichever wrapper launched it); "
            f"host: the host's time for one call issued on an idle GPU, the median "
            f"of {HOST_CALLS} (what the wrapper costs the host per call); "
            "median latency: those calls' latencies, each until the GPU had "
            "finished it, their median (a rare slow call moves latency, the "
            "mean, and not this); "
            "`call` is not timed for reduce-overhead or for ours replayed, whose "
            "replays are not the module's `call` on get_args()'s plain tensors."
            if cuda
            else "."
        ),
        f"- rounds: {meta.get('rounds', 1)} (warm processes per mode, the modes in alternating "
        "order); each warm time above is the fastest round's, every round is in bench.json"
        + (
            f"; cold rounds: {meta['cold_rounds']} (cold processes per mode, each in a "
            "fresh cache, the modes in alternating order), the cold compile above is the "
            "fastest, its phases that round's."
            if meta.get("cold_rounds", 1) > 1
            else "."
        ),
        f"- peak MB: rise of the warm process's {memory} from just before its first call "
        "(loading the cached graph included) to the end of the e2e timing (what is "
        "timed after it, on the same inputs or on the module's own, is left out)"
        + (
            "; the eager reference run's cuBLAS workspaces are dropped before the "
            "baseline, so that each mode counts those it makes; bench.json's "
            "`mem_segments_mb` lists each row's allocator segments by memory pool "
            "at the end of the e2e timing."
            if cuda
            else "."
        ),
    ]
    probe = meta.get("host_probe_us")
    if probe:
        lines.append(
            f"- host speed: an eager in-place add on a 0-d CPU tensor took "
            f"{probe[0]:.2f}-{probe[1]:.2f} µs in the warm processes before "
            "timing; compare tables of other runs only with this in mind."
        )
    compile_probe = meta.get("compile_host_probe_us")
    if compile_probe:
        lines.append(
            f"- the same before each compile: {compile_probe[0]:.2f}-"
            f"{compile_probe[1]:.2f} µs in the cold and warm processes."
        )
    others, steal, own = (
        meta.get("others_cpus_during_timing"),
        meta.get("steal_cpus_during_timing"),
        meta.get("own_threads_cpus_during_timing"),
    )

    def cpus_range(spread: list[float] | None) -> str:
        return f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "?"

    if others or steal:
        lines.append(
            "- the host while the warm processes timed: other processes used "
            f"{cpus_range(others)} CPUs, the hypervisor took {cpus_range(steal)}, "
            f"the timing process's other threads {cpus_range(own)} "
            "(each row's in bench.json, `load_during_timing`)"
            + (
                f"; each waited up to {meta['max_settle_waited_s']:.1f} s for the "
                f"others to fall under {QUIET_CPUS} CPUs first (`--settle-s`)."
                # Beyond the one window that measures the host, a wait.
                if (meta.get("max_settle_waited_s") or 0.0) > 2 * SETTLE_WINDOW_S
                else "."
            )
        )
    cpus = ", ".join(map(str, meta.get("timing_cpus") or ()))
    if cpus:
        lines.append(
            f"- timed on CPU {cpus}"
            + (" (pinned, `--timing-cpu`)." if meta.get("timing_cpu_pinned") else ".")
        )
    if any(row.get("host_apart") for row in report["ratios"]):
        lines.append(
            f"- †: the two rows' processes (the warm ones, or for a cold compile "
            f"the cold ones) found the host more than {HOST_PROBE_SPREAD}x faster "
            "or slower than each other (their host probes, in bench.json): the "
            "ratio measures the host as much as the wrappers; time again, or "
            "with more `--rounds`."
        )
    load = meta.get("max_loadavg_before_timing")
    if load and meta["cpu_count"] and load > meta["cpu_count"]:
        lines.append(
            f"- the machine was busy (1-minute load average up to {load:.1f} on "
            f"{meta['cpu_count']} CPUs before timing): expect noisy times"
            + (
                "; `--threads 1` steadies them."
                if (meta["torch_threads"] or 1) > 1
                else "."
            )
        )
    failures = [
        r
        for r in records
        if r["error"]
        or r["ok"] is False
        or (r["error"] is None and r.get("timed", True) and not r["warm_fx_cache_hit"])
    ]
    if failures:
        lines += ["", "## Problems", ""]
        for r in failures:
            if r["error"]:
                lines.append(f"- {r['workload']} / {r['mode']}: {r['error']}")
            elif r["ok"] is False:
                lines.append(
                    f"- {r['workload']} / {r['mode']}: output differs from eager (max abs err {r['max_abs_err']:.3g})"
                )
            else:
                lines.append(
                    f"- {r['workload']} / {r['mode']}: the warm compile did not hit the FX graph cache"
                )
    return "\n".join(lines) + "\n"


def compile_phase_gaps(
    ours: dict[str, float], python: dict[str, float], *, min_gap_s: float = 0.2
) -> list[tuple[str, float, float]]:
    """The phases whose cold-compile seconds differ by at least `min_gap_s`
    between ours and the Python wrapper: (phase, ours, python), the widest
    gap first."""
    gaps = [
        (key, ours.get(key, 0.0), python.get(key, 0.0))
        for key in sorted(ours.keys() | python.keys())
    ]
    gaps = [g for g in gaps if abs(g[1] - g[2]) >= min_gap_s]
    return sorted(gaps, key=lambda g: -abs(g[1] - g[2]))


def _compile_phase_lines(records: Sequence[dict[str, Any]], phase: str) -> list[str]:
    """Where ours' `phase` ("cold" or "warm") compile differs from the Python
    wrapper's, by dynamo_timed phase."""
    key = f"{phase}_phases_s"
    by_key = {(r["workload"], r["mode"]): r for r in records}
    lines: list[str] = []
    for r in records:
        if r["mode"] != "cppwrap":
            continue
        python = by_key.get((r["workload"], "python"))
        if not (r.get(key) and python and python.get(key)):
            continue
        gaps = compile_phase_gaps(r[key], python[key])
        if gaps:
            cells = "; ".join(f"{k} {o:.2f} / {p:.2f}" for k, o, p in gaps[:8])
            lines.append(f"- {r['workload']}: {cells}")
    if lines:
        lines = [
            "",
            f"{phase.capitalize()} compile by phase, ours / Python wrapper in seconds "
            "(dynamo_timed phases that differ by 0.2 s or more; phases nest"
            + (
                "; Dynamo's tracing runs no code of ours, and a warm process's "
                "host speed moves it"
                if phase == "warm"
                else ""
            )
            + "):",
            "",
            *lines,
        ]
    return lines


def _cuda_tables(report: dict[str, Any]) -> list[str]:
    """The GPU targets' comparisons (CUDA_RATIOS) that ran, and for each CUDA
    row of ours, which graphs were replayed and why the others were not."""
    lines: list[str] = []
    shown = [
        c
        for c in CUDA_RATIOS
        if any(row.get(f"{c[0]}:{c[1]}/{c[2]}") is not None for row in report["ratios"])
    ]
    if shown:
        lines += [
            "",
            "Against CUDA graphs, and kernel by kernel against the Python wrapper "
            "(below 1: torch_cppwrap is faster or smaller):",
            "",
            "| workload | " + " | ".join(label for *_, label in shown) + " |",
            "|---|" + "--:|" * len(shown),
        ]
        for row in report["ratios"]:
            cells = " | ".join(
                _ratio_cell(row, f"{metric}:{mode}/{base}")
                for metric, mode, base, _ in shown
            )
            lines.append(f"| {row['workload']} | {cells} |")
    replays = [
        (r, summary)
        for r in report["results"]
        if r["mode"] == "cppwrap" and (summary := replay_summary(r)) is not None
    ]
    if replays:
        lines += ["", "Replay (torch_cppwrap, one entry per compiled graph):", ""]
        lines += [f"- {r['workload']}: {summary}" for r, summary in replays]
    spans = [r for r in report["results"] if r.get("gpu_step_span_us") is not None]
    if spans:
        lines += [
            "",
            f"The GPU's time per step (CUDA events around {SPAN_STEPS} steps issued "
            "back to back, medians; e2e above it is time the GPU waited for the "
            "host), µs, with the GPU's idle time between steps:",
            "",
        ]
        lines += [
            f"- {r['workload']} / {r['mode']}: {r['gpu_step_span_us']:,.1f} "
            f"({r['gpu_between_steps_us']:.1f} between)"
            for r in spans
        ]
    return lines


def plot(report: dict[str, Any], path: Path) -> bool:
    """Writes a bar chart per metric; False (with a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress(
            "note: matplotlib is not installed, so no plot was written (pip install matplotlib)"
        )
        return False
    records = report["results"]
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    modes = list(dict.fromkeys(r["mode"] for r in records))
    by_key = {(r["workload"], r["mode"]): r for r in records}
    metrics = [
        ("call_us", "`call` µs/call (log)", True),
        ("e2e_us", "end-to-end µs/call (log)", True),
        ("cold_compile_s", "cold compile s", False),
        ("warm_compile_s", "warm compile s", False),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    width = 0.8 / max(len(modes), 1)
    for ax, (metric, title, log) in zip(axes.flat, metrics, strict=True):
        for i, mode in enumerate(modes):
            values = [by_key.get((w, mode), {}).get(metric) for w in workloads]
            xs = [x + (i - (len(modes) - 1) / 2) * width for x in range(len(workloads))]
            bars = ax.bar(xs, [v or 0.0 for v in values], width, label=mode)
            for bar, value in zip(bars, values, strict=True):
                if value is None:  # failed, or not measured in this mode
                    ax.annotate(
                        "n/a",
                        (bar.get_x() + width / 2, 0),
                        xycoords=("data", "axes fraction"),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        rotation=90,
                    )
        ax.set_title(title)
        ax.set_xticks(range(len(workloads)), workloads)
        if log:
            ax.set_yscale("log")
    axes.flat[0].legend()
    meta = report["meta"]
    fig.suptitle(f"torch_cppwrap benchmark: torch {meta['torch']}, {meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(report: dict[str, Any], out: Path, *, final: bool = True) -> str:
    """Writes bench.md and bench.json (and, when `final`, the plot)."""
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(report)
    (out / "bench.md").write_text(text)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    if not final:
        return text
    if plot(report, out / "bench.png"):
        progress(f"wrote {out / 'bench.png'}")
    progress(f"wrote {out / 'bench.md'} and {out / 'bench.json'}")
    return text


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workloads",
        type=_csv,
        default=list(DEFAULT_WORKLOADS),
        help=f"comma-separated, from {','.join(WORKLOADS)}, or `models` for "
        f"every real model (needs timm and transformers; default: "
        f"{','.join(DEFAULT_WORKLOADS)})",
    )
    parser.add_argument(
        "--modes",
        type=_csv,
        default=None,
        help=f"comma-separated, from {','.join(MODES)} (default: {','.join(DEFAULT_MODES)}, "
        "plus reduce-overhead on cuda)",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench_results"),
        help="default: ./bench_results",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer, shorter timing repeats"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="warm compile + timing processes per mode, in alternating order; "
        "each time reported is the fastest round's (default: 2)",
    )
    parser.add_argument(
        "--cold-rounds",
        type=int,
        default=1,
        help="cold compiles per mode, each in a fresh cache, in alternating "
        "order; the cold compile reported is the fastest round's (on the "
        "device, one mode's cold compiles differed by up to a fifth within a "
        "lease; default: 1)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per worker process"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="workloads whose cold compiles run side by side, before any "
        "timing (which runs one at a time, alone); default 1",
    )
    parser.add_argument(
        "--warm-jobs",
        type=int,
        default=1,
        help="workloads whose warm processes run side by side, taking turns "
        "(a lock file) so that none times while another imports, compiles or "
        "times; faster, but less steady than the default 1 (each alone): "
        "for a quick table, not a final one",
    )
    parser.add_argument(
        "--timing-cpu",
        type=int,
        default=None,
        metavar="CPU",
        help="pin the thread that times, in every warm process, to this CPU "
        "(Linux), so that every mode times on the same one; it does not steady "
        "CPUs that slow down in spells, as the device's do: use --rounds "
        "(scripts/gpu/host_cores.py probes each CPU); default: unpinned",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=0.0,
        metavar="S",
        help="before it times, each warm process waits up to S seconds for "
        f"the host's other processes to use fewer than {QUIET_CPUS} CPUs "
        "(compile workers still starting or exiting, Linux); every row "
        "records what else ran while it timed either way; default 0",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for the workers (default: torch's choice)",
    )


def run_from_args(ns: argparse.Namespace) -> int:
    ns.workloads = [
        w
        for item in ns.workloads
        for w in (REAL_MODELS if item == "models" else [item])
    ]
    unknown = [w for w in ns.workloads if w not in WORKLOADS] + [
        m for m in ns.modes or () if m not in MODES
    ]
    if unknown:
        progress(f"error: unknown workload or mode: {', '.join(unknown)}")
        return 2
    for flag, value in (("--rounds", ns.rounds), ("--cold-rounds", ns.cold_rounds)):
        if value < 1:
            progress(f"error: {flag} must be at least 1, got {value}")
            return 2
    if ns.timing_cpu is not None and (
        not hasattr(os, "sched_getaffinity")
        or ns.timing_cpu not in os.sched_getaffinity(0)
    ):
        progress(
            f"error: --timing-cpu {ns.timing_cpu} is not a CPU this process may run on"
        )
        return 2
    if ns.settle_s < 0:
        progress(f"error: --settle-s must not be negative, got {ns.settle_s}")
        return 2
    if ns.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            progress("error: --device cuda, but CUDA is not available")
            return 2
    modes = ns.modes or [
        *DEFAULT_MODES,
        *(["reduce-overhead"] if ns.device == "cuda" else []),
    ]
    skipped = [m for m in modes if MODES[m].cuda_only and ns.device != "cuda"]
    if skipped:
        progress(f"note: skipping {', '.join(skipped)} (CUDA only) on {ns.device}")
    modes = [m for m in modes if m not in skipped]
    started = time.perf_counter()
    report = run_bench(
        ns.workloads,
        modes,
        device=ns.device,
        quick=ns.quick,
        timeout_s=ns.timeout,
        threads=ns.threads,
        rounds=ns.rounds,
        jobs=ns.jobs,
        warm_jobs=ns.warm_jobs,
        timing_cpu=ns.timing_cpu,
        settle_s=ns.settle_s,
        cold_rounds=ns.cold_rounds,
        # Rows so far, rewritten after each one: a run stopped by a time limit
        # still leaves its table behind.
        on_record=lambda partial: write_report(partial, ns.out, final=False),
    )
    report["meta"]["total_s"] = time.perf_counter() - started
    print(write_report(report, ns.out))
    progress(f"done in {report['meta']['total_s']:.0f} s")
    failed = [r for r in report["results"] if r["error"] or r["ok"] is False]
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        return _worker_main(argv)
    parser = argparse.ArgumentParser(
        prog="python benchmarks/bench.py",
        description="Python wrapper vs upstream cpp_wrapper vs torch_cppwrap, side by side.",
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
