"""Where one call's time goes on the GPU, for each wrapper side by side.

For every mode (benchmarks/bench.py's MODES: python, upstream, cppwrap,
cppwrap-no-replay, reduce-overhead), in its own process (torch_cppwrap
patches Inductor on import), with the workloads of bench.py's WORKLOADS built
and run as bench.py's worker does (a training step under grad, with its
backward; the rest under no_grad):

- e2e_us, e2e_sync_each_us: end to end per call, without and with a
  synchronise after each call;
- call_us: the compiled modules' `call` alone (not for reduce-overhead or
  ours replayed, whose CUDA graphs are not what `call` on get_args()'s
  tensors runs);
- host_us (call_host_us for `call` alone): the host time of one call issued
  on an idle GPU (synchronise, then time the call; the median of 200).  The
  GPU then has nothing queued, so no launch waits on a full launch queue and
  the time is what the wrapper costs the host, not what the GPU does;
- kernels_per_call: GPU activities per call in the profiler (kernels, with
  the few memcpys and memsets, each one launch from the host;
  memcpy_memset_per_call says how many of them these are), and
  launch_api_calls_per_call: CPU-side launch calls per call
  (cudaLaunchKernel, cuLaunchKernel(Ex), cudaGraphLaunch...; one graph
  launch runs many kernels).  The profiler does not record the driver's
  cuGraphLaunch, so ours replayed, which launches its graph so, counts 0
  where it makes one launch a graph;
- host_us_per_launch: host_us / kernels_per_call, the host's cost per kernel
  launched: what torch_cppwrap's C++ wrapper, run kernel by kernel
  (cppwrap-no-replay), should cut to a third of the Python wrapper's;
- gpu_kernel_us: the GPU's busy time per call (kernel time from the
  profiler), the profiler's CPU table and its table of GPU kernels;
- with --split, where a call's host time goes by layer (median of 200
  calls, each issued on an idle GPU): host_in_graphs_us, inside Inductor's
  compiled graphs (CompiledFxGraph.__call__, summed over a step's graphs);
  host_in_callables_us, inside what those call (the wrapper module's `call`
  for ours and the Python wrapper, the CUDA-graph tree for
  reduce-overhead); host_outside_graphs_us, the rest of the step (Dynamo's
  guards, AOTAutograd's wrappers, a training step's backward machinery);
- with --kernel-ranges (torch_cppwrap's modes compiled with
  config.cpp.enable_kernel_profile, so that our wrapper opens a profiler
  range around each C-shim call and Triton launch, as the Python wrapper's
  Triton launcher and ATen's dispatcher do whenever a profiler is on; the
  Python wrapper is left as it is, since the flag makes it open a kernel
  context around each launch), the split of a call's host time between the
  extern kernels' own (ATen's host work for a cuBLAS matmul, a cuDNN
  convolution or attention, which no wrapper can cut) and the rest:
  triton_launches_per_call, extern_calls_per_call, extern_host_us_per_call
  (the profiled ranges of the outermost extern calls that launch GPU work),
  profiled_host_us (a call's host time under the profiler, which inflates
  every range), wrapper_us_per_triton_launch: host_us scaled by the
  share of the profiled host time outside the extern calls, per Triton
  launch, and wrapper_own_us_per_call: the wrapper's own code alone, under
  the profiler (the self time of Inductor's compiled-graph ranges and of
  the Triton launch ranges: what is left when the ATen ops, C-shim calls
  and driver launches inside them are taken out; the Python wrapper's
  buffer allocations are ATen ops, so they are taken out too);
- with --gpu-gaps, where the GPU idles in a run of GAP_STEPS steps issued
  back to back (no synchronise between them, as e2e_us times them), from
  the profiler's GPU activities (kernels, memcpys, memsets): per step, the
  GPU's busy and idle time (gpu_busy_us_per_step, gpu_idle_us_per_step),
  the idle time before a step's first activity (gpu_gap_between_steps_us:
  the GPU waiting for the host, or for the next replay to start) and inside
  a step (gpu_gaps_inside_step_us), and the largest gaps inside a step by
  the activities either side (gpu_largest_gaps).  The first step is left
  out (nothing runs before it).  Where the steps' activities differ (how
  the profiler records device-to-device copies varies, pytorch/pytorch
  issue 191284), only the busy and idle time over the whole run, and
  gpu_gaps_error says so.  A replayed step whose e2e_us exceeds its
  kernels' time spends the rest in one of those two places.  Under the
  profiler the host is slower (a cuGraphLaunch of 147 nodes takes some
  250 µs there), so the same is measured without it (bench.py's
  time_step_spans): CUDA events recorded around each of SPAN_STEPS steps
  issued back to back give the GPU's time from a step's start to its end
  (gpu_step_span_us, its median), idle time inside included, and its idle
  time from one step's end to the next's start (gpu_between_steps_us,
  median), where a host that keeps ahead of the GPU leaves none;
- with --eager-first, each child runs the model eagerly before compiling it
  and holds the output while it times, as bench.py's worker does (whose
  e2e for a replayed graph has differed from this script's: eager_first
  in the record); with --eager-first drop, it lets that output go and
  empties the caching allocator's cache before compiling, so that what the
  eager run leaves in memory is told apart from what it initialises
  (cuBLAS and cuDNN handles, lazily loaded kernels); with --eager-first
  libs, it runs one small convolution and one matmul eagerly instead of
  the model, making cuBLAS's and cuDNN's handles and workspaces and nothing
  of the model's (its kernels, cuDNN's plans for its shapes), and with
  --eager-first cudnn or cublas only the convolution or only the matmul,
  and with --eager-first cublas-side the matmul on a stream of its own;
  with --keep-cached-memory, ours' warm-up before a capture does not give back
  what the default pool caches (cuda_graphs._release_cached_memory, which
  keeps the process's peak down), so that its part in that is told apart;
- with --graph-dump, every CUDA graph a child captures (ours and
  reduce-overhead's alike: both capture through torch.cuda.graph) is
  written as Graphviz by CUDA's cudaGraphDebugDotPrint
  (graph_WORKLOAD_MODE_PID_N.dot; the graph is made with keep_graph=True,
  since debug mode alone leaves debug_dump nothing to write), and
  cuda_graph_dumps in the record summarises each: its nodes by kind,
  edges, the nodes where the graph forks into parallel branches, and a
  digest of the dump with addresses and graph ids left out, equal for two
  graphs of the same nodes, order, launch settings and dependencies.  A
  dump that fails, or that CUDA does not write, is recorded with its error
  and never fails the capture it watches (on torch 2.11 a failed dump made
  ours' capture fall back to launching kernel by kernel, and
  reduce-overhead's run fail).

--inductor-config KEY=VALUE (repeatable) sets an entry of
torch._inductor.config in every child: triton.autotune_pointwise=False gives
each pointwise kernel one launch configuration, so that two wrappers' graphs,
or two cold compiles, have the same (each cold compile otherwise times the
candidates afresh and draws its own mix: session 31's graph dumps).

torch_cppwrap's generated C++ is written next to the tables; profile.json
holds the records and profile.md a table of them (both rewritten after each
record).

    python scripts/gpu/profile_call.py --out DIR [--workloads mlp,seed] \\
        [--modes cppwrap,upstream,python] [--timeout 240] [--kernel-ranges] \\
        [--split] [--gpu-gaps] [--eager-first SETTING] \\
        [--graph-dump] [--keep-cached-memory] [--inductor-config KEY=VALUE] \\
        [--processes N [--cold-each]] [--timing-cpu CPU]

The first process of each workload and mode compiles cold, the others on
its Inductor cache; with --cold-each, every process compiles cold in a
cache of its own, so that each draws its own tuning picks (whose cost per
kernel gpu_kernels_us gives: the GPU's µs per call of each kernel, by
name).
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import gc
import hashlib
import importlib.util
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HOST_REPEATS = 200
PROFILED_CALLS = 50
GAP_STEPS = 50
TABLE_COLUMNS = (
    ("workload", "workload"),
    ("mode", "mode"),
    ("process", "process"),
    ("eager_first", "eager run first"),
    ("timing_cpu", "CPU"),
    ("e2e_us", "e2e µs"),
    ("e2e_sync_each_us", "e2e sync-each µs"),
    ("host_us", "host µs per call"),
    ("host_outside_graphs_us", "host µs outside the graphs"),
    ("host_in_graphs_us", "host µs in the graphs"),
    ("host_in_callables_us", "host µs in their callables"),
    ("kernels_per_call", "kernels per call"),
    ("host_us_per_launch", "host µs per kernel"),
    ("gpu_kernel_us", "GPU kernel µs per call"),
    ("triton_launches_per_call", "Triton launches per call"),
    ("extern_calls_per_call", "extern calls per call"),
    ("extern_host_us_per_call", "extern host µs per call (profiled)"),
    ("profiled_host_us", "host µs per call (profiled)"),
    ("wrapper_us_per_triton_launch", "host µs per Triton launch, externs excluded"),
    ("wrapper_own_us_per_call", "the wrapper's own host µs per call (profiled)"),
    ("gpu_busy_us_per_step", "GPU busy µs per step (back to back)"),
    ("gpu_gap_between_steps_us", "GPU idle µs between steps"),
    ("gpu_gaps_inside_step_us", "GPU idle µs inside a step"),
    ("gpu_step_span_us", "GPU µs per step, unprofiled (events)"),
    ("gpu_between_steps_us", "GPU idle µs between steps, unprofiled (events)"),
)
# Profiler events that launch work on the GPU (runtime and driver API calls).
LAUNCH_MARKERS = ("LaunchKernel", "GraphLaunch", "Memcpy", "Memset")
# The range Inductor opens around each call of a compiled graph.
GRAPH_RANGE = "## Call CompiledFxGraph"
# Issue 13's bound on ours' host cost against the Python wrapper's.
TARGET = " (target ≤ 0.33)"


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_bench() -> ModuleType:
    """benchmarks/bench.py, as a file: importing the package would patch
    Inductor in every mode.  It imports nothing but the standard library at
    the top, so loading it imports neither torch nor torch_cppwrap."""
    if "cppwrap_bench" in sys.modules:
        return sys.modules["cppwrap_bench"]
    spec = importlib.util.spec_from_file_location(
        "cppwrap_bench", ROOT / "benchmarks" / "bench.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


def host_times_us(
    f: Callable[[], Any], sync: Callable[[], None], calls: int
) -> list[float]:
    """The host time of each of `calls` calls of `f`, each issued on an idle
    GPU, in µs (bench.py's)."""
    return load_bench().host_times_us(f, sync, calls)


def host_time_us(f: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Median host time of one call of `f` issued on an idle GPU, in µs."""
    return statistics.median(host_times_us(f, sync, HOST_REPEATS))


def host_split_us(
    step: Callable[[], Any], sync: Callable[[], None], calls: int
) -> dict[str, float]:
    """Medians over `calls` calls of `step`, each issued on an idle GPU, of
    its host time (µs) outside Inductor's compiled graphs, inside them
    (CompiledFxGraph.__call__), and inside what they call
    (`current_callable`), each summed over the step's graphs.  The graphs
    are timed by patching CompiledFxGraph.__call__ on the class and each
    graph's current_callable; both are restored before this returns."""
    from torch._inductor.output_code import CompiledFxGraph

    spent = [0.0, 0.0]  # this call's seconds in graphs, in their callables
    original_call = CompiledFxGraph.__call__
    wrapped: dict[int, tuple[Any, Any]] = {}  # id -> (graph, its callable)

    def timed_callable(f: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(inputs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(inputs)
            finally:
                spent[1] += time.perf_counter() - t0

        return run

    def timed_call(self: Any, inputs: Any) -> Any:
        if id(self) not in wrapped and self.current_callable is not None:
            wrapped[id(self)] = (self, self.current_callable)
            self.current_callable = timed_callable(self.current_callable)
        t0 = time.perf_counter()
        try:
            return original_call(self, inputs)
        finally:
            spent[0] += time.perf_counter() - t0

    in_graphs: list[float] = []
    in_callables: list[float] = []

    def split_step() -> None:
        spent[0] = spent[1] = 0.0
        step()
        in_graphs.append(spent[0] * 1e6)
        in_callables.append(spent[1] * 1e6)

    CompiledFxGraph.__call__ = timed_call  # type: ignore[method-assign]
    try:
        step()  # wraps the graphs' callables, untimed
        total = host_times_us(split_step, sync, calls)
    finally:
        CompiledFxGraph.__call__ = original_call  # type: ignore[method-assign]
        for graph, f in wrapped.values():
            graph.current_callable = f
    median = statistics.median
    return {
        "host_split_step_us": median(total),
        "host_outside_graphs_us": median(
            t - g for t, g in zip(total, in_graphs, strict=True)
        ),
        "host_in_graphs_us": median(in_graphs),
        "host_in_callables_us": median(in_callables),
        "host_graph_calls_per_step": len(wrapped),
    }


def _launches_gpu_work(event: Any) -> bool:
    """Whether `event` or an event inside it launches work on the GPU."""
    stack = [event]
    while stack:
        e = stack.pop()
        if any(marker in e.name for marker in LAUNCH_MARKERS):
            return True
        stack.extend(e.cpu_children)
    return False


def launch_split(events: Any, calls: int) -> dict[str, float]:
    """Per call, from the profiler's events of `calls` calls: the Triton
    launches (ranges named ``triton_*``, opened by Inductor's Triton launcher
    in Python and by our wrapper under config.cpp.enable_kernel_profile) and
    the extern calls: the outermost ATen op (``aten::*``, the dispatcher's
    range) or C-shim call (``aoti_torch_*``, our wrapper's range) that
    launches GPU work, with their host time; and the wrapper's own host
    time: the self time of the compiled graphs' ranges (``## Call
    CompiledFxGraph ...``) and of the Triton launch ranges.  Only host events
    count: the GPU's own records of Triton kernels bear the same names."""
    events = [
        e for e in events if str(getattr(e, "device_type", "CPU")).endswith("CPU")
    ]
    triton = [e for e in events if e.name.startswith("triton_")]
    externs = []
    for e in events:
        if not e.name.startswith(("aten::", "aoti_torch_")):
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if parent.name.startswith(("aten::", "aoti_torch_", "triton_")):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested and _launches_gpu_work(e):
            externs.append(e)
    graphs = [e for e in events if e.name.startswith(GRAPH_RANGE)]
    return {
        "triton_launches_per_call": len(triton) / calls,
        "extern_calls_per_call": len(externs) / calls,
        "extern_host_us_per_call": sum(e.cpu_time_total for e in externs) / calls,
        "wrapper_own_us_per_call": sum(e.self_cpu_time_total for e in graphs + triton)
        / calls,
    }


def _on_gpu(event: Any) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def _idle_and_busy(
    acts: list[tuple[float, float, str]],
) -> tuple[list[float], list[float]]:
    """For each activity (start, end, name), sorted by start: the GPU's idle
    time before it, from the end of all before it (activities of other
    streams may overlap), and the busy time it adds."""
    idle, busy = [], []
    last_end = acts[0][0]
    for start, end, _ in acts:
        idle.append(max(0.0, start - last_end))
        busy.append(max(0.0, end - max(start, last_end)))
        last_end = max(last_end, end)
    return idle, busy


def gpu_gaps(events: Any, steps: int, largest: int = 5) -> dict[str, Any]:
    """Where the GPU idled in `steps` steps issued back to back, from the
    profiler's events (see --gpu-gaps).  The first step is left out.  Split
    between and inside steps only where each step ran the same GPU
    activities in the same order; else over the whole run, with the reason
    under "gpu_gaps_error"."""
    acts = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in events if _on_gpu(e)
    )
    if steps < 2 or len(acts) < steps:
        return {"gpu_gaps_error": f"{len(acts)} GPU activities for {steps} step(s)"}
    idle, busy = _idle_and_busy(acts)
    per_step = len(acts) // steps
    names = [name for _, _, name in acts[:per_step]]
    if len(acts) % steps or any(
        acts[i][2] != names[i % per_step] for i in range(len(acts))
    ):
        return {
            "gpu_gaps_error": "the steps ran different GPU activities "
            f"({len(acts)} in {steps} steps): idle and busy over the whole run",
            "gpu_activities_per_step": len(acts) / steps,
            "gpu_busy_us_per_step": sum(busy) / steps,
            "gpu_idle_us_per_step": sum(idle) / steps,
        }
    counted = steps - 1
    mean_idle = [
        sum(idle[step * per_step + position] for step in range(1, steps)) / counted
        for position in range(per_step)
    ]
    inside = sorted(range(1, per_step), key=lambda p: -mean_idle[p])[:largest]
    return {
        "gpu_activities_per_step": per_step,
        "gpu_busy_us_per_step": sum(busy[per_step:]) / counted,
        "gpu_idle_us_per_step": sum(mean_idle),
        "gpu_gap_between_steps_us": mean_idle[0],
        "gpu_gaps_inside_step_us": sum(mean_idle[1:]),
        "gpu_largest_gaps": [
            {
                "position": p,
                "after": names[p - 1],
                "before": names[p],
                "us": mean_idle[p],
            }
            for p in inside
        ],
    }


# cudaGraphDebugDotPrint names each node "graph_<graph id>_node_<n>"; what a
# label holds varies with the driver, so a summary reads only the names, the
# edges between them and the first word of each label (the node's kind).
_DOT_NODE = re.compile(r'"(graph_\d+_node_\d+)"\s*\[[^\]]*?label="\{?\s*([A-Za-z_]*)')
_DOT_EDGE = re.compile(r'"(graph_\d+_node_\d+)"\s*->\s*"(graph_\d+_node_\d+)"')
_DOT_VOLATILE = re.compile(r"0x[0-9a-fA-F]+|graph_\d+")


def graph_summary(dot: str) -> dict[str, Any]:
    """One cudaGraphDebugDotPrint dump: its nodes by kind, its edges, the
    nodes with more than one edge out (where branches run side by side),
    and a digest of the text with pointers and graph ids taken out."""
    kinds = dict(_DOT_NODE.findall(dot))
    edges = _DOT_EDGE.findall(dot)
    out_degree = collections.Counter(a for a, _ in edges)
    stable = _DOT_VOLATILE.sub("#", dot)
    return {
        "nodes": len(kinds),
        "kinds": dict(collections.Counter(k or "?" for k in kinds.values())),
        "edges": len(edges),
        "forks": sum(1 for n in out_degree.values() if n > 1),
        "digest": hashlib.sha256(stable.encode()).hexdigest()[:12],
    }


def dump_captured_graphs(out: Path, tag: str) -> list[dict[str, Any]]:
    """From now on in this process, every CUDA graph captured through
    torch.cuda.CUDAGraph (ours, cudagraph trees) is made with keep_graph=True
    and written to out/graph_<tag>_<n>.dot by debug_dump when its capture
    ends, then instantiated, as capture_end does for a graph that keeps
    nothing.  The list returned fills with the dumps' summaries.

    keep_graph, not enable_debug_mode: in torch 2.11 (and in upstream's
    source as of late 2026), capture_end marks a graph it instantiated as
    having no cudaGraph_t even in debug mode, so debug_dump then writes
    nothing."""
    import torch

    dumps: list[dict[str, Any]] = []
    graph_class = torch.cuda.CUDAGraph
    # keep_graph is the binding's __init__ argument: the class's __new__
    # takes it too, but what __init__ is called with decides.
    init, end = graph_class.__init__, graph_class.capture_end

    def keeping_init(self: Any, keep_graph: bool = False) -> None:
        init(self, True)

    def capture_end(self: Any) -> None:
        end(self)
        path = out / f"graph_{tag}_{len(dumps)}.dot"
        try:
            self.debug_dump(str(path))
            if not path.exists():
                raise FileNotFoundError("debug_dump wrote no file")
            dump = {"file": path.name, **graph_summary(path.read_text())}
        except Exception as e:  # the capture watched must not fail for it
            dump = {"file": path.name, "error": f"{type(e).__name__}: {e}"}
        try:
            self.instantiate()
        except Exception as e:  # a kept graph is instantiated by its replay
            dump["instantiate_error"] = f"{type(e).__name__}: {e}"
        dumps.append(dump)

    graph_class.__init__ = keeping_init  # type: ignore[method-assign]
    graph_class.capture_end = capture_end  # type: ignore[method-assign]
    return dumps


def config_setting(text: str) -> tuple[str, Any]:
    """--inductor-config's KEY=VALUE: an entry of torch._inductor.config
    and a Python literal of the entry's type."""
    from torch._inductor import config

    key, sep, value_text = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    entries = config.get_config_copy()
    if key not in entries:
        raise argparse.ArgumentTypeError(f"torch._inductor.config has no {key!r}")
    try:
        value = ast.literal_eval(value_text)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(
            f"{key}: {value_text!r} is not a Python literal"
        ) from None
    default = entries[key]
    if default is not None and not isinstance(value, type(default)):
        raise argparse.ArgumentTypeError(
            f"{key} takes a {type(default).__name__}, not {value_text!r}"
        )
    return key, value


# --eager-first's settings that run no part of the model: which libraries
# warm_libraries sets up.
LIBRARIES = {
    "libs": ("cudnn", "cublas"),
    "cudnn": ("cudnn",),
    "cublas": ("cublas",),
    "cublas-side": ("cublas", "side-stream"),
}


def warm_libraries(torch: Any, libraries: tuple[str, ...]) -> None:
    """What any eager run on the GPU makes and a model's own run adds
    nothing to: cuDNN's (one small convolution) and cuBLAS's (one matmul)
    handles and workspaces, on the current stream or, with "side-stream",
    on a stream of their own (cuBLAS keeps a workspace per stream)."""
    stream = torch.cuda.Stream() if "side-stream" in libraries else None
    with torch.no_grad(), torch.cuda.stream(stream):
        if "cudnn" in libraries:
            x = torch.randn(1, 8, 16, 16, device="cuda")
            torch.nn.functional.conv2d(x, torch.randn(8, 8, 3, 3, device="cuda"))
        if "cublas" in libraries:
            a = torch.randn(64, 64, device="cuda")
            torch.mm(a, a)
    torch.cuda.synchronize()


def child(
    workload: str,
    mode_name: str,
    out: Path,
    kernel_ranges: bool = False,
    split: bool = False,
    gaps: bool = False,
    eager_first: str | None = None,
    graph_dump: bool = False,
    keep_cached_memory: bool = False,
    inductor_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    bench = load_bench()
    mode, spec = bench.MODES[mode_name], bench.WORKLOADS[workload]
    if mode.imports_torch_cppwrap:
        import torch_cppwrap  # noqa: F401

        if keep_cached_memory:
            from torch_cppwrap._inductor.runtime import cuda_graphs

            cuda_graphs._release_cached_memory = lambda: None
    elif "torch_cppwrap" in sys.modules:
        raise RuntimeError(f"mode {mode_name!r} must run without torch_cppwrap")

    import torch
    from torch._inductor import config
    from torch.profiler import ProfilerActivity, profile

    config.cpp_wrapper = mode.cpp_wrapper
    config.load_config(inductor_config or {})  # --inductor-config's entries
    # Our wrapper's range around each kernel.  The Python wrapper's Triton
    # launcher and ATen's dispatcher open theirs whenever a profiler is on,
    # and the flag would make the Python wrapper add a kernel context around
    # each launch, costing it host time our wrapper does not pay.
    config.cpp.enable_kernel_profile = kernel_ranges and mode.imports_torch_cppwrap
    sync = torch.cuda.synchronize
    torch.manual_seed(0)
    fn, args = spec.build("cuda")
    # Inference under no_grad; a training step needs grad for its backward.
    grad_mode = torch.enable_grad if spec.train else torch.no_grad
    # bench.py's worker runs the model eagerly before it compiles it, and
    # holds that output while it times: with --eager-first, so does this.
    expected = None
    if eager_first in LIBRARIES:
        warm_libraries(torch, LIBRARIES[eager_first])
    elif eager_first:
        with grad_mode():
            expected = fn(*args)
        if eager_first == "drop":
            expected = None
            gc.collect()
            sync()
            torch.cuda.empty_cache()
    dumps = (
        dump_captured_graphs(out, f"{workload}_{mode_name}_{os.getpid()}")
        if graph_dump
        else None
    )
    before = bench.loaded_module_count()
    compiled = torch.compile(
        fn, mode=mode.compile_mode, dynamic=True if spec.dynamic else None
    )
    # bench.py's step: a new step for Inductor's CUDA graphs, a training
    # step's zero_grad and backward.
    step = bench.make_step(fn, compiled, args, mode, spec)

    record: dict[str, Any] = {
        "workload": workload,
        "mode": mode_name,
        "torch": torch.__version__,
        "torch_cppwrap_imported": "torch_cppwrap" in sys.modules,
        "cuda_graphs_env": os.environ.get("TORCH_CPPWRAP_CUDA_GRAPHS"),
        "train": spec.train,
        "kernel_ranges": kernel_ranges,
        "eager_first": eager_first,
        "eager_output_held": expected is not None,
        "keep_cached_memory": keep_cached_memory,
        "inductor_config": inductor_config or {},
    }
    with grad_mode():
        step()
        sync()
        modules = bench.new_compiled_modules(before)
        record["graphs"] = len(modules)
        record["wrappers"] = sorted({bench.wrapper_kind(m) for m in modules})
        for _ in range(3):  # past the CUDA graph capture, where there is one
            step()
        sync()
        record["cuda_graph_states"] = [
            m._module.cuda_graph_state()
            for m in modules
            if hasattr(getattr(m, "_module", None), "cuda_graph_state")
        ]
        if dumps is not None:
            record["cuda_graph_dumps"] = dumps

        def timed(f: Callable[[], Any], per_call_sync: bool) -> float:
            def once() -> None:
                f()
                if per_call_sync:
                    sync()

            t = bench.time_per_call(once, repeats=5, target_s=0.3, sync=sync)
            return t.median_us

        record["timing_cpu"] = bench.pin_timing_thread()
        record["e2e_us"] = timed(step, False)
        record["e2e_sync_each_us"] = timed(step, True)
        record["host_us"] = host_time_us(step, sync)
        if split:
            record.update(host_split_us(step, sync, HOST_REPEATS))
        # CUDA graphs replay the whole graph; its module's `call` alone is not
        # what runs, so there is nothing honest to time (as in bench.py).
        if bench.module_call_runs(mode, "cuda") and modules:
            calls = [
                bench.time_module_call(m, repeats=5, target_s=0.3, sync=sync)
                for m in modules
            ]
            if all(c is not None for c in calls):
                record["call_us"] = sum(c.median_us for c in calls)
                # time_module_call has lent get_args `torch` where it lacked it.
                call_host_us = 0.0
                for m in modules:
                    call_args = m.get_args()
                    call_host_us += host_time_us(
                        lambda m=m, a=call_args: m.call(list(a)), sync
                    )
                record["call_host_us"] = call_host_us

        sync()
        if gaps:
            record.update(bench.time_step_spans(step, bench.SPAN_STEPS))
            # Both activities, as the profile below records them.
            with profile(
                activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]
            ) as gap_prof:
                for _ in range(GAP_STEPS):
                    step()
                sync()
            record.update(gpu_gaps(gap_prof.events(), GAP_STEPS))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            profiled_host_us = host_times_us(step, sync, PROFILED_CALLS)
    events = prof.key_averages()
    on_gpu, on_cpu = [], []
    for e in events:
        is_gpu = str(getattr(e, "device_type", "")).endswith("CUDA")
        (on_gpu if is_gpu else on_cpu).append(e)
    record["gpu_kernel_us"] = (
        sum(getattr(e, "self_device_time_total", 0) for e in on_gpu) / PROFILED_CALLS
    )
    kernels = sum(e.count for e in on_gpu) / PROFILED_CALLS
    record["kernels_per_call"] = kernels
    # By name, so that two modes' or two compiles' picks can be set side by
    # side (a graph's kernels are named alike in every mode).
    record["gpu_kernels_us"] = {
        e.key: round(getattr(e, "self_device_time_total", 0) / PROFILED_CALLS, 3)
        for e in sorted(on_gpu, key=lambda e: -getattr(e, "self_device_time_total", 0))
    }
    record["memcpy_memset_per_call"] = (
        sum(e.count for e in on_gpu if e.key.startswith(("Memcpy", "Memset")))
        / PROFILED_CALLS
    )
    record["launch_api_calls_per_call"] = (
        sum(
            e.count for e in on_cpu if "LaunchKernel" in e.key or "GraphLaunch" in e.key
        )
        / PROFILED_CALLS
    )
    record["host_us_per_launch"] = record["host_us"] / kernels if kernels else None
    if kernel_ranges:
        launches = launch_split(prof.events(), PROFILED_CALLS)
        record.update(launches)
        record["profiled_host_us"] = statistics.fmean(profiled_host_us)
        # Both sides of the share are taken under the profiler.
        outside = 1.0 - launches["extern_host_us_per_call"] / record["profiled_host_us"]
        triton_launches = launches["triton_launches_per_call"]
        record["wrapper_us_per_triton_launch"] = (
            record["host_us"] * outside / triton_launches if triton_launches else None
        )
    table = events.table(sort_by="self_cpu_time_total", row_limit=40)
    (out / f"profile_{workload}_{mode_name}.txt").write_text(table)
    # The GPU's side, kernel by kernel: where two modes' GPU times differ.
    gpu_table = events.table(sort_by="self_device_time_total", row_limit=60)
    (out / f"gpu_{workload}_{mode_name}.txt").write_text(gpu_table)
    for m in modules:
        src = getattr(m, "wrapper_src", None) or getattr(m, "cpp_wrapper_src", None)
        if src:
            (out / f"wrapper_{workload}_{mode_name}.cpp").write_text(src)
    return record


def _text(output: bytes | str | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def run_child(
    workload: str,
    mode: str,
    out: Path,
    timeout_s: float,
    extra_env: dict[str, str],
    kernel_ranges: bool = False,
    split: bool = False,
    cache_dir: str | None = None,
    gaps: bool = False,
    eager_first: str | None = None,
    graph_dump: bool = False,
    keep_cached_memory: bool = False,
    inductor_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One child's record.  It compiles into `cache_dir` (a fresh directory,
    removed afterwards, if None): a later process of the same workload and
    mode given the same one compiles warm."""
    fresh = cache_dir is None
    if cache_dir is None:
        cache_dir = tempfile.mkdtemp(prefix="profile-call-inductor-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, **extra_env)
    # The torch_cppwrap of this checkout, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, (str(ROOT), env.get("PYTHONPATH")))
    )
    env.update(load_bench().MODES[mode].environ)  # TORCH_CPPWRAP_CUDA_GRAPHS=0
    cmd = [sys.executable, __file__, "--out", str(out), "--child", workload, mode]
    if kernel_ranges:
        cmd.append("--kernel-ranges")
    if split:
        cmd.append("--split")
    if gaps:
        cmd.append("--gpu-gaps")
    if eager_first:
        cmd += ["--eager-first", eager_first]
    if graph_dump:
        cmd.append("--graph-dump")
    if keep_cached_memory:
        cmd.append("--keep-cached-memory")
    for key, value in (inductor_config or {}).items():
        cmd += ["--inductor-config", f"{key}={value!r}"]
    error: dict[str, Any] = {"workload": workload, "mode": mode}
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as e:
        error["error"] = (
            f"timed out after {timeout_s:.0f} s: " + _text(e.stderr)[-3000:]
        )
        return error
    finally:
        if fresh:
            shutil.rmtree(cache_dir, ignore_errors=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][len("RESULT ") :])
    error["error"] = f"exit status {proc.returncode}: " + proc.stderr[-3000:]
    return error


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def markdown(records: list[dict[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(title for _, title in TABLE_COLUMNS) + " |",
        "| --- | --- |" + " --: |" * (len(TABLE_COLUMNS) - 2),
    ]
    lines += [
        "| " + " | ".join(_cell(r.get(key)) for key, _ in TABLE_COLUMNS) + " |"
        for r in records
    ]
    lines.append("")
    by_mode = {(r["workload"], r["mode"]): r for r in records}
    for workload in dict.fromkeys(r["workload"] for r in records):
        ours = by_mode.get((workload, "cppwrap-no-replay"), {})
        python = by_mode.get((workload, "python"), {})
        externs = (
            "; extern calls' profiled host µs per call "
            f"{ours.get('extern_host_us_per_call', 0):.0f} / "
            f"{python.get('extern_host_us_per_call', 0):.0f}"
        )
        for key, what, spec, note in (
            ("host_us_per_launch", "host µs per kernel", ".2f", TARGET),
            (
                "wrapper_us_per_triton_launch",
                "host µs per Triton launch with the extern calls' own host time "
                "left out",
                ".2f",
                externs,
            ),
            (
                "wrapper_own_us_per_call",
                "the wrapper's own host µs per call (profiled)",
                ".0f",
                TARGET,
            ),
        ):
            a, b = ours.get(key), python.get(key)
            if a is not None and b:
                lines.append(
                    f"- {workload}: {what}, cppwrap-no-replay / python = "
                    f"{a:{spec}} / {b:{spec}} = {a / b:.2f}{note}"
                )
    for r in records:
        for n, dump in enumerate(r.get("cuda_graph_dumps") or ()):
            if "error" in dump:
                lines.append(
                    f"- {r['workload']} / {r['mode']} (process {r.get('process')}): "
                    f"CUDA graph {n}: no dump ({dump['error']})"
                )
                continue
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(dump["kinds"].items()))
            lines.append(
                f"- {r['workload']} / {r['mode']} (process {r.get('process')}): "
                f"CUDA graph {n}: {dump['nodes']} nodes ({kinds}), "
                f"{dump['edges']} edges, {dump['forks']} forks, "
                f"digest {dump['digest']} ({dump['file']})"
            )
        for gap in r.get("gpu_largest_gaps") or ():
            lines.append(
                f"- {r['workload']} / {r['mode']}: {gap['us']:.1f} µs idle after "
                f"{gap['after']} and before {gap['before']} (activity "
                f"{gap['position']} of {r['gpu_activities_per_step']} a step)"
            )
        if r.get("gpu_gaps_error"):
            lines.append(f"- {r['workload']} / {r['mode']}: {r['gpu_gaps_error']}")
    errors = [r for r in records if r.get("error")]
    if errors:
        lines.append("")
        lines += [
            f"- {r['workload']} / {r['mode']} failed: "
            + (r["error"].strip().splitlines() or [""])[-1]
            for r in errors
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workloads", default="mlp,seed")
    parser.add_argument("--modes", default="cppwrap,upstream,python")
    parser.add_argument(
        "--timeout", type=float, default=240.0, help="seconds per child process"
    )
    parser.add_argument(
        "--kernel-ranges",
        action="store_true",
        help="compile torch_cppwrap's modes with config.cpp.enable_kernel_profile "
        "and split each call's host time between extern calls and Triton launches",
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="split each call's host time between Dynamo and AOTAutograd, "
        "Inductor's compiled graphs and what those call",
    )
    parser.add_argument(
        "--gpu-gaps",
        action="store_true",
        help=f"profile {GAP_STEPS} steps issued back to back and report where "
        "the GPU idles between and inside them",
    )
    parser.add_argument(
        "--eager-first",
        nargs="?",
        const="hold",
        choices=("hold", "drop", *LIBRARIES),
        help="run the model eagerly before compiling it and hold its output, "
        "as bench.py's worker does; `drop`: let the output go and empty the "
        "allocator's cache before compiling; `libs`: instead of the model, "
        "one small convolution and one matmul (cuDNN's and cuBLAS's "
        "handles); `cudnn`, `cublas`: only the one; `cublas-side`: the "
        "matmul on a stream of its own",
    )
    parser.add_argument(
        "--graph-dump",
        action="store_true",
        help="write every CUDA graph captured as Graphviz "
        "(cudaGraphDebugDotPrint) and summarise each in the record",
    )
    parser.add_argument(
        "--keep-cached-memory",
        action="store_true",
        help="ours' warm-up before a capture leaves the default pool's cache "
        "alone (it gives it back to keep the peak down)",
    )
    parser.add_argument(
        "--inductor-config",
        action="append",
        default=[],
        type=config_setting,
        metavar="KEY=VALUE",
        help="set an Inductor config entry in every child, e.g. "
        "triton.autotune_pointwise=False (one launch configuration per "
        "pointwise kernel, the same in every compile); repeatable",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="child processes per workload and mode, the modes taking turns: "
        "hosts differ between processes of one machine",
    )
    parser.add_argument(
        "--timing-cpu",
        type=int,
        default=None,
        metavar="CPU",
        help="pin each child's timing thread to this CPU, as bench.py's "
        "--timing-cpu does (default: unpinned)",
    )
    parser.add_argument(
        "--cold-each",
        action="store_true",
        help="every process compiles cold in a cache of its own (default: "
        "the first of a workload and mode cold, the others on its cache)",
    )
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "MODE"))
    ns = parser.parse_args()
    inductor_config = dict(ns.inductor_config)
    ns.out.mkdir(parents=True, exist_ok=True)
    if ns.child:
        workload, mode = ns.child
        record = child(
            workload,
            mode,
            ns.out,
            kernel_ranges=ns.kernel_ranges,
            split=ns.split,
            gaps=ns.gpu_gaps,
            eager_first=ns.eager_first,
            graph_dump=ns.graph_dump,
            keep_cached_memory=ns.keep_cached_memory,
            inductor_config=inductor_config,
        )
        print("RESULT " + json.dumps(record), flush=True)
        return 0
    bench = load_bench()
    workloads, modes = ns.workloads.split(","), ns.modes.split(",")
    for name in workloads:
        if name not in bench.WORKLOADS:
            parser.error(f"unknown workload {name!r}; one of {sorted(bench.WORKLOADS)}")
    for name in modes:
        if name not in bench.MODES:
            parser.error(f"unknown mode {name!r}; one of {sorted(bench.MODES)}")

    # As bench.py: torch_cppwrap's runtime extension built once for the run,
    # not in each child's fresh Inductor cache.
    installation: contextlib.AbstractContextManager[dict[str, str]] = (
        bench.runtime_installation("cuda", "profile-call-installed-")
        if any(bench.MODES[m].imports_torch_cppwrap for m in modes)
        else contextlib.nullcontext({})
    )
    records: list[dict[str, Any]] = []
    with (
        installation as extra_env,
        tempfile.TemporaryDirectory(prefix="profile-call-inductor-") as caches,
    ):
        if ns.timing_cpu is not None:
            extra_env[bench.TIMING_CPU_ENV] = str(ns.timing_cpu)
        for workload in workloads:
            for process, mode in itertools.product(range(ns.processes), modes):
                progress(f"== {workload} / {mode} (process {process + 1})")
                # The first process of a workload and mode compiles cold, the
                # others on its cache (or each cold in a fresh one).
                record = run_child(
                    workload,
                    mode,
                    ns.out,
                    ns.timeout,
                    extra_env,
                    ns.kernel_ranges,
                    ns.split,
                    cache_dir=(
                        None
                        if ns.cold_each
                        else os.path.join(caches, f"{workload}-{mode}")
                    ),
                    gaps=ns.gpu_gaps,
                    eager_first=ns.eager_first,
                    graph_dump=ns.graph_dump,
                    keep_cached_memory=ns.keep_cached_memory,
                    inductor_config=inductor_config,
                )
                record["process"] = process + 1
                print(json.dumps(record), flush=True)
                records.append(record)
                # After each record, so that an interrupted run keeps its rows.
                (ns.out / "profile.json").write_text(json.dumps(records, indent=1))
                (ns.out / "profile.md").write_text(markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
