"""Capturing a CUDA wrapper module's graph as one CUDA graph.

A CUDA wrapper module that :class:`CppWrapperGpu` found replayable (all
inputs and outputs CUDA tensors of fixed shapes; no host synchronisation,
random numbers or input mutation) warms up on its first call and captures
its graph on its second.

Both are coroutines that ``cppwrap::cuda::GraphReplay`` drives from C++:
torch's side (the memory pool, the capture stream, the ``torch.cuda.CUDAGraph``)
is set up here, and at each ``yield`` C++ runs the graph's kernels itself on
the inputs yielded and sends back their outputs.  Nothing here calls into the
module.  :func:`warm_up` runs the kernels once on the capture stream,
allocating from the memory pool the capture will use, and notes each input's
address; :func:`capture` captures them.  Both lend what the call returns
instead of copying it out of the pool, as a replay does.  From then on
``GraphReplay`` replays the graph in C++ with no Python; see
``cppwrap_cuda_graph.h`` for what a replay does.

Parameters and buffers (and tensors marked with
torch._dynamo.mark_static_address) that kept their address between the two
calls are read where they are; a replay needs them there again.  So are
outputs another graph's replay lent out of its pool (a forward's activations,
saved for the backward).  The other inputs are copied into buffers the graph
owns, every call.

A replay lends its outputs: they are tensors on the pool's memory, on
storages of their own.  A later replay that writes that memory first moves
the ones still held to fresh memory (a copy), so what a call returned stays
the caller's; a training step's activations, dropped by the backward, are
never copied.

Set ``TORCH_CPPWRAP_CUDA_GRAPHS=0`` to run every call kernel by kernel.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Generator, Sequence
from typing import Any, Literal, cast

import torch
from torch._dynamo.utils import counters

log = logging.getLogger(__name__)
# Where a graph that will not be replayed says why (TORCH_LOGS=perf_hints), as
# CppWrapperGpu does for what it sees at compile time.
perf_hint_log = torch._logging.getArtifactLogger(__name__, "perf_hints")

ENV_SWITCH = "TORCH_CPPWRAP_CUDA_GRAPHS"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


# One capture stream per device, shared by every capture.  cuBLAS keeps a
# workspace (32 MiB on Hopper) for each stream it runs on, for the process's
# lifetime: a fresh stream per capture would add one per recapture.  No two
# warm-ups or captures run at once: GraphReplay::prepare holds the graphs'
# pool (a process-wide flag in the runtime) around each, which also guards
# this module's tables.
_capture_streams: dict[int, torch.cuda.Stream] = {}


# One memory pool per (device, stream) that graphs are replayed on, shared by
# every graph captured for it, as cudagraph trees share theirs: N graphs then
# hold their largest set of intermediates, not the sum of N.  Sharing is safe
# because a graph keeps nothing in the pool between replays but its outputs
# (which stay allocated, so no later capture is given them), and graphs of
# one pool replay on one stream (a replay on any other is refused), so never
# at the same time.  A graph captured earlier may have the memory of a later
# one's outputs as scratch: before it replays, the runtime takes back the
# outputs lent from captures since its own, moving those still held out of
# the pool (cppwrap_api.h, pool_reclaim).  An eager run in the pool (a
# warm-up) may be given a graph's scratch memory too: it holds the pool
# (GraphReplay::prepare) so that no replay is queued meanwhile, and what it
# returns is lent at an epoch of its own, later than every graph's so far,
# so that each of them moves what is still held out of the pool before it
# replays.
_pools: dict[tuple[int, int], torch.cuda.MemPool] = {}


def _memory_pool(device: torch.device, stream: torch.cuda.Stream) -> torch.cuda.MemPool:
    key = (device.index, stream.cuda_stream)
    pool = _pools.get(key)
    if pool is None:
        with torch.cuda.device(device):
            pool = _pools[key] = torch.cuda.MemPool()
    return pool


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _capture_streams.get(index)
    if stream is None:
        stream = _capture_streams[index] = torch.cuda.Stream(device)
    return stream


@contextlib.contextmanager
def _cublas_workspace_as_scratch(
    side: torch.cuda.Stream,
) -> Generator[None, None, None]:
    """Around a run in the pool on the capture stream `side`: cuBLAS drops
    that stream's workspaces before and after it.  cuBLAS keeps one per
    stream, allocated on first use and held for good; one the capture
    stream's first matmul allocated in the pool would stay allocated there
    (32 MiB on Hopper) and be read by every graph captured on that stream.
    Dropped after each run, it is the run's scratch memory like any other:
    free in the pool between runs, which graphs share as they share their
    other scratch.

    Only the capture stream's, which no other thread uses: dropping every
    stream's (as cudagraph trees do) frees workspaces that other threads'
    matmuls may have been handed and not yet launched with, and the next
    emptying of the cache unmaps them under those matmuls (an illegal
    address, seen on the H200 while a graph warmed up beside another
    thread's calls).  A torch without the per-stream drop (2.11) keeps the
    capture stream's workspace allocated in the pool."""
    drop = _runtime().drop_cublas_workspaces
    drop(side.cuda_stream)
    try:
        yield
    finally:
        drop(side.cuda_stream)


def _release_cached_memory() -> None:
    """Before a warm-up grows the graphs' pool: gives back to CUDA what the
    default pool holds cached but unused, as torch.cuda.graph does before
    each capture.  Released only then, at the capture, it would still be
    reserved while the warm-up fills the pool, and the process's peak would
    hold both.  Once per graph; blocks in use (cuBLAS's workspaces among
    them, see _cublas_workspace_as_scratch), and the pools of captured
    graphs, are not touched."""
    torch.cuda.empty_cache()


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill one block of memory exactly (any order of
    dimensions), so copying it is one memcpy of `_nbytes(t)` from data_ptr."""
    expected = 1
    for size, stride in sorted(
        zip(t.shape, t.stride(), strict=True), key=lambda p: p[1]
    ):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# What the capture coroutine yields (the inputs to run the kernels on), is
# sent (the kernels' outputs) and returns: this call's outputs, and the
# arguments of GraphReplay::install (the graph, its executable, device and
# stream, each input's buffer or None, the captured inputs' addresses (0 for
# an int) and bytes, where each tensor output comes from (_output_sources),
# the pool memory that outputs share, and the capture's epoch, which this
# call's loans carry).  Or None, or False: see capture.
Capture = Generator[
    list[torch.Tensor],
    Sequence[Any],
    "tuple[tuple[Any, ...], tuple[Any, ...]] | Literal[False] | None",
]


# What the warm-up coroutine returns: this call's outputs, the inputs'
# addresses and the index of the first parameter among them (-1: none), for
# C++ to note (or None, or False: see warm_up).
WarmUp = Generator[
    list[torch.Tensor],
    Sequence[Any],
    "tuple[tuple[Any, ...], list[int], int] | Literal[False] | None",
]


def _why_not_capture(args: list[Any]) -> tuple[str, bool] | None:
    """Why a graph is not to be captured on this call's `args`, and whether
    that lasts (no later call will do better) or is about these inputs only;
    None when it may be captured."""
    if not enabled():
        return f"{ENV_SWITCH} is off", True
    if torch.cuda.is_current_stream_capturing():
        # Someone else (mode="reduce-overhead") is capturing this call into
        # their CUDA graph; launching kernel by kernel is what they record.
        return "the call is being captured by another CUDA graph", True
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        return "this torch cannot hand a CUDA graph to C++", True
    tensors = _tensors(args)
    if len(tensors) + sum(type(a) is int for a in args) != len(args):
        return "an input is neither a tensor nor an int", True
    # A later call may bring CUDA tensors: attention's RNG state (philox seed
    # and offset) is a pair of CPU tensors outside a CUDA graph and CUDA ones
    # inside, so a backward graph gets CUDA ones once its forward replays.
    if not tensors or not all(t.is_cuda for t in tensors):
        return "an input is not a CUDA tensor", False
    if any(t.device != tensors[0].device for t in tensors):
        return "the inputs are on several devices", False
    return None


def _decline(reason: str, lasting: bool) -> Literal[False] | None:
    """What warm_up and capture return when they decline a call: None (no
    later call is captured either) or False (a later call may be)."""
    if not lasting:
        log.debug("torch_cppwrap: no CUDA graph for this call: %s", reason)
        return False
    _not_replayed(reason)
    return None


def _not_replayed(reason: str) -> None:
    """Says why a graph runs kernel by kernel from now on, and counts it."""
    counters["inductor"]["cppwrap_cuda_graph_runtime_skips"] += 1
    perf_hint_log.info(
        "torch_cppwrap: a graph launches its kernels one by one, not as a CUDA "
        "graph: %s",
        reason,
    )


def _static(arg: torch.Tensor) -> bool:
    """Whether an input keeps its address from call to call: a parameter or
    buffer (which Dynamo marks), or a tensor marked with
    torch._dynamo.mark_static_address.  A replay reads these where they are;
    it copies any other input into a buffer of its own, as cudagraph trees
    do: an activation the forward saved for the backward may come back at
    the same address for a few calls, and then not."""
    return (
        isinstance(arg, torch.nn.Parameter)
        or getattr(arg, "_dynamo_static_input_type", None) is not None
    )


def _runtime() -> Any:
    from torch_cppwrap._inductor import codecache

    return codecache.RuntimeExtension.load()


# Lends a tensor's pool memory on a storage of its own (_C.pool_lend).
Lend = Callable[[torch.Tensor], torch.Tensor]


def _lender(owner: int, stream: torch.cuda.Stream, epoch: int) -> Lend:
    """Lends pool memory as the graph `owner` (0: a warm-up, which no graph
    reads in place) captured at `epoch` does, for the pool of `stream`."""
    runtime = _runtime()
    handle = stream.cuda_stream
    return lambda t: runtime.pool_lend(t, owner, handle, epoch)


def _lent_by_another(arg: torch.Tensor, owner: int) -> bool:
    """Whether `arg` lies in memory another graph's replay lent out of its
    pool (GraphReplay::lend): an activation a replayed forward saved for
    this backward.  That graph keeps it there, call after call, until it
    replays again, so a replay can read it where it is.  Never a graph's own
    output fed back to it (a recurrent state): its replay writes there."""
    return _runtime().pool_lender(arg) not in (0, owner)


def _tensors(args: Sequence[Any]) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _address(arg: Any) -> int:
    """Where a tensor input lies; 0 for an int input (a size the graph was
    captured for)."""
    return arg.data_ptr() if isinstance(arg, torch.Tensor) else 0


def warm_up(args: list[Any]) -> WarmUp:
    """The first call of a module whose graph may be captured: runs its
    kernels on the capture stream, allocating from the memory pool that the
    capture (the next call) takes its memory from, so that the capture reuses
    this run's memory instead of adding its own.  Returns this call's outputs
    (lent out of the pool), the inputs' addresses and the first parameter's
    index; None when the graph is not to be captured: the module then runs
    this call, and every later one, kernel by kernel; False when not on these
    inputs: this call runs kernel by kernel, and the next warms up (a few
    times at most).  A failed run is thrown in at the `yield` and goes on
    up: the call fails as it would have, and the next warms up."""
    why = _why_not_capture(args)
    if why is not None:
        return _decline(*why)
    inputs = list(args)  # the module's call may clear the list it is given
    device = _tensors(inputs)[0].device
    stream = torch.cuda.current_stream(device)
    try:
        pool = _memory_pool(device, stream)
        side = _capture_stream(device)
    except Exception as e:
        log.warning(
            "torch_cppwrap: no memory pool for a CUDA graph; the graph runs "
            "kernel by kernel instead: %s",
            e,
        )
        return None
    with torch.cuda.device(device):
        _release_cached_memory()
        side.wait_stream(stream)
        try:
            with (
                torch.cuda.stream(side),
                torch.cuda.use_mem_pool(pool, device),
                _cublas_workspace_as_scratch(side),
            ):
                outputs = yield list(inputs)
        finally:
            stream.wait_stream(side)
    # Lent, not copied: held, they stay allocated, so no capture is given
    # their memory; a graph captured before may have it as scratch, and its
    # next replay moves them out first (their epoch is later than its).
    # Freed, their memory goes back to the pool on the capture stream, whose
    # next run waits for this stream first.
    results = _lent_out(
        outputs, _tensors(inputs), device, _lender(0, stream, _runtime().pool_epoch())
    )
    # What tells graphs of the same code apart (GraphReplay::fits).
    anchor = next(
        (i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor) and _static(a)),
        -1,
    )
    return results, [_address(a) for a in inputs], anchor


def _lent_out(
    outputs: Sequence[Any],
    inputs: Sequence[torch.Tensor],
    device: torch.device,
    lend: Lend,
) -> tuple[Any, ...]:
    """`outputs` with every tensor the kernels allocated on `device` (in the
    pool) lent, one loan per storage, so that views and outputs sharing
    memory keep their strides and aliasing.  Outputs that are views of inputs,
    and any on another device, stay as they are."""
    kept = {_storage(t) for t in inputs}
    loans: dict[int, torch.UntypedStorage] = {}
    results: list[Any] = []
    for t in outputs:
        if not isinstance(t, torch.Tensor) or t.device != device or _storage(t) in kept:
            results.append(t)
            continue
        storage = loans.get(_storage(t))
        if storage is None:
            storage = loans[_storage(t)] = lend(t).untyped_storage()
        results.append(
            torch.empty(0, dtype=t.dtype, device=t.device).set_(
                storage, t.storage_offset(), t.size(), t.stride()
            )
        )
    return tuple(results)


def capture(
    args: list[Any], first_ptrs: list[int], draws_random: bool = False, owner: int = 0
) -> Capture:
    """Captures a module's graph on this call's `args`, for C++ to install.
    Returns None when the graph is not to be captured: the module then runs
    this call, and every later one, kernel by kernel; False, as warm_up does,
    when not on these inputs.  A failed kernel run is thrown in at the
    `yield` it answers.  `draws_random`: the graph draws from the CUDA
    generator, which a replay advances (GraphReplay::replay_with_generator).
    `owner`: the GraphReplay capturing, which lent none of the inputs it
    reads in place (see _lent_by_another)."""
    why = _why_not_capture(args)
    if why is not None:
        return _decline(*why)
    try:
        return (yield from _capture(args, first_ptrs, draws_random, owner))
    except Exception as e:  # the module falls back to launching kernel by kernel
        log.warning(
            "torch_cppwrap: capturing the graph as a CUDA graph failed; it runs "
            "kernel by kernel instead: %s",
            e,
        )
        return None


def _input_buffer(arg: torch.Tensor) -> torch.Tensor:
    """The buffer a moving input is copied into before each replay, holding
    this call's value: of the input's sizes and strides, as the kernels read
    it.  A replay copies the bytes from the input's first element to its last
    (_extent), gaps and all, and so does this (an expanded input, whose
    elements share memory, could not be copied element by element).  The
    layout is the one the graph was compiled for, which the module's input
    checks assert (config.size_asserts)."""
    span = _extent(arg) // arg.element_size()
    flat = torch.empty(span, dtype=arg.dtype, device=arg.device)
    flat.copy_(arg.as_strided((span,), (1,)))
    return flat.as_strided(arg.size(), arg.stride())


def _capture(
    args: list[Any], first_ptrs: list[int], draws_random: bool, owner: int
) -> Capture:
    if len(args) != len(first_ptrs):
        return None
    device = _tensors(args)[0].device
    buffers: list[torch.Tensor | None] = []
    graph_inputs: list[Any] = []
    for arg, first in zip(args, first_ptrs, strict=True):
        if (
            not isinstance(arg, torch.Tensor)
            or (arg.data_ptr() == first and _static(arg))
            or _lent_by_another(arg, owner)
        ):
            buffers.append(None)
            graph_inputs.append(arg)
            continue
        buffer = _input_buffer(arg)
        buffers.append(buffer)
        graph_inputs.append(buffer)

    stream = torch.cuda.current_stream(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(device):
        side = _capture_stream(device)
        pool = _memory_pool(device, stream)
        # One run on the capture stream, from this thread, first: cuBLAS makes
        # its handle per thread, which may not happen while capturing (a
        # failed capture can leave the CUDA generator thinking it is still
        # capturing).  In the pool, where the warm-up's memory is cached for
        # it.  What it draws from the CUDA generator is drawn again by the
        # replay below, so that this call returns the numbers a call kernel by
        # kernel would have.
        generator = torch.cuda.default_generators[device.index]
        rng_state = generator.get_state() if draws_random else None
        side.wait_stream(stream)
        with torch.cuda.stream(side), torch.cuda.use_mem_pool(pool, device):
            yield list(graph_inputs)
        side.synchronize()
        if rng_state is not None:
            generator.set_state(rng_state)
        # thread_local: other threads keep running kernel by kernel meanwhile.
        # cuBLAS's workspace for the capture stream is made while capturing,
        # in the pool, and (torch 2.12 on) dropped after: the graph's scratch.
        with (
            _cublas_workspace_as_scratch(side),
            torch.cuda.graph(
                graph,
                pool=cast(Any, pool.id),  # a pool handle, as graph_pool_handle()'s
                stream=side,
                capture_error_mode="thread_local",
            ),
        ):
            outputs = tuple((yield list(graph_inputs)))

    sources = _output_sources(outputs, graph_inputs, device)
    if isinstance(sources, str):
        _not_replayed(sources)
        return None
    tensor_outputs, groups = sources

    epoch = _runtime().pool_epoch()
    with torch.cuda.stream(stream):
        graph.replay()  # advances the CUDA generator, as a replay from C++ does
    results = _replayed_outputs(
        outputs, tensor_outputs, groups, args, _lender(owner, stream, epoch)
    )
    log.debug(
        "torch_cppwrap: graph captured; %d input(s) copied per call",
        sum(b is not None for b in buffers),
    )
    return results, (
        graph,
        graph.raw_cuda_graph_exec(),
        device.index,
        stream.cuda_stream,
        buffers,
        [_address(a) for a in graph_inputs],
        [_extent(a) if isinstance(a, torch.Tensor) else 0 for a in graph_inputs],
        tensor_outputs,
        groups,
        epoch,
    )


# Where a replay's tensor output comes from: GraphReplay::Output::Source.
OWN, GROUP, INPUT_VIEW, INPUT = 0, 1, 2, 3

# One tensor output for GraphReplay::install: (source, the output as
# captured, the group's or input's index, an element offset, the bytes it spans).
OutputSource = tuple[int, torch.Tensor, int, int, int]


def _extent(t: torch.Tensor) -> int:
    """The bytes from `t`'s first element to just past its last."""
    if t.numel() == 0:
        return 0
    last = sum(
        (size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)
    )
    return (last + 1) * t.element_size()


def _output_sources(
    outputs: Sequence[Any], graph_inputs: Sequence[Any], device: torch.device
) -> tuple[list[OutputSource], list[tuple[torch.Tensor, int]]] | str:
    """Where a replay takes each tensor output of the captured `outputs` from
    (None outputs are left out), and the pool memory that several outputs
    share (a flat view of it, and its bytes), lent once per replay; or why
    the graph cannot be replayed.

    An output that is an input, or a view of one (AOTAutograd hands saved
    parameters to the backward this way), is the caller's input (or that
    view of it) on a replay.  Outputs that share pool memory (a view of an
    output is an output too), or one that does not fill its memory, are views
    of one loan of that memory, so they keep their aliasing."""
    inputs: dict[int, int] = {}
    for index, arg in enumerate(graph_inputs):
        if isinstance(arg, torch.Tensor):
            inputs.setdefault(_storage(arg), index)
    shared: dict[int, list[torch.Tensor]] = {}
    for t in outputs:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return "an output is not a tensor"
        if t.device != device:
            return f"an output is on {t.device}, not {device}"
        if t.numel() > 0 and _storage(t) not in inputs:
            shared.setdefault(_storage(t), []).append(t)

    groups: list[tuple[torch.Tensor, int]] = []
    group_of: dict[int, tuple[int, int]] = {}  # storage -> (group, its first byte)
    for storage, views in shared.items():
        if len(views) == 1 and _dense(views[0]):
            continue
        if len({v.dtype for v in views}) != 1:
            return "outputs share memory as different dtypes"
        first = min(v.data_ptr() for v in views)
        end = max(v.data_ptr() + _extent(v) for v in views)
        size = views[0].element_size()
        if (first - storage) % size or any(
            (v.data_ptr() - first) % size for v in views
        ):
            return "outputs share memory at unaligned offsets"
        flat = views[0].as_strided(
            ((end - first) // size,), (1,), (first - storage) // size
        )
        group_of[storage] = (len(groups), first)
        groups.append((flat, end - first))

    sources: list[OutputSource] = []
    for t in outputs:
        if t is None:
            continue
        storage = _storage(t)
        if t.numel() > 0 and storage in inputs:
            index = inputs[storage]
            arg = graph_inputs[index]
            delta = t.data_ptr() - arg.data_ptr()
            if t.dtype != arg.dtype or delta % t.element_size():
                return "an output views an input as another dtype"
            same = delta == 0 and t.shape == arg.shape and t.stride() == arg.stride()
            sources.append(
                (INPUT if same else INPUT_VIEW, t, index, delta // t.element_size(), 0)
            )
        elif storage in group_of:
            index, first = group_of[storage]
            sources.append(
                (GROUP, t, index, (t.data_ptr() - first) // t.element_size(), 0)
            )
        else:
            sources.append((OWN, t, 0, 0, _nbytes(t)))
    return sources, groups


def _replayed_outputs(
    outputs: Sequence[Any],
    sources: Sequence[OutputSource],
    groups: Sequence[tuple[torch.Tensor, int]],
    args: Sequence[Any],
    lend: Lend,
) -> tuple[Any, ...]:
    """What the capturing call returns: what a replay returns
    (GraphReplay::queue), loans of the pool's memory, and the caller's own
    `args` where an output is (a view of) an input."""
    loans = [lend(flat) for flat, _ in groups]
    pending = iter(sources)
    results: list[Any] = []
    for t in outputs:
        if t is None:
            results.append(None)
            continue
        source, _, index, offset, _ = next(pending)
        if source == OWN:
            results.append(lend(t))
        elif source == GROUP:
            lent = loans[index]
            results.append(
                lent.as_strided(t.shape, t.stride(), lent.storage_offset() + offset)
            )
        elif source == INPUT:
            results.append(args[index])
        else:
            arg = args[index]
            results.append(
                arg.as_strided(t.shape, t.stride(), arg.storage_offset() + offset)
            )
    return tuple(results)
