"""Compiled graphs with torch.distributed collectives, through torch_cppwrap's
C++ wrapper, on two processes.

Each test spawns two ranks (gloo on the CPU; NCCL on two GPUs, skipped
without them) that meet through a FileStore in a temporary directory, each
with its own Inductor cache there.  A rank compiles with cpp_wrapper=True,
compares with eager, and writes what our wrapper recorded (its classes, the
collectives it emitted, the generated source) to a JSON report; the test
asserts on the reports.  Select these tests with ``pytest tests/test_distributed.py``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import tempfile
import threading
import time
import unittest
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch._inductor import config
from torch._inductor.test_case import TestCase, run_tests
from torch._inductor.utils import run_and_get_code

import torch_cppwrap  # noqa: F401  (the import patches Inductor)
from torch_cppwrap._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

WORLD_SIZE = 2
# Seconds one test's ranks may take, compiles included (2 loaded cores).
RANK_TIMEOUT_S = 300
# How long rank 1 keeps rank 0 waiting in test_wait_releases_the_gil.
LATE_RANK_DELAY_S = 1.0

if dist.is_available():
    import torch.distributed._functional_collectives as funcol

    # The `*_single` names are the current ones; older torch has only the
    # `*_tensor` ones (same signatures).
    _all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    _reduce_scatter = (
        getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    )
    _all_gather_coalesced = (
        getattr(funcol, "all_gather_single_coalesced", None)
        or funcol.all_gather_into_tensor_coalesced
    )
    _reduce_scatter_coalesced = (
        getattr(funcol, "reduce_scatter_single_coalesced", None)
        or funcol.reduce_scatter_tensor_coalesced
    )


# ----------------------------------------------------------------------
# running a scenario on every rank
# ----------------------------------------------------------------------


@contextlib.contextmanager
def our_wrappers() -> Iterator[list[CppWrapperCpu]]:
    """Compiles with our C++ wrapper, caches off, and records every wrapper
    codegen it creates (CppWrapperGpu included, which inherits create)."""
    created: list[CppWrapperCpu] = []
    original = CppWrapperCpu.create.__func__  # type: ignore[attr-defined]

    def recording_create(cls: type, *args: Any, **kwargs: Any) -> CppWrapperCpu:
        wrapper = original(cls, *args, **kwargs)
        created.append(wrapper)
        return wrapper

    with (
        config.patch(cpp_wrapper=True, fx_graph_cache=False, compile_threads=1),
        mock.patch.object(CppWrapperCpu, "create", classmethod(recording_create)),
    ):
        yield created


def wrapper_facts(wrappers: list[CppWrapperCpu], sources: list[str]) -> dict[str, Any]:
    return {
        "classes": [type(w).__name__ for w in wrappers],
        "ours": all(isinstance(w, CppWrapperCpu) for w in wrappers),
        "collective_ops": [op for w in wrappers for op in w.collective_ops],
        "collective_ops_by_graph": [w.collective_ops for w in wrappers],
        # Why the CUDA wrapper launches kernel by kernel instead of replaying
        # a CUDA graph (CppWrapperGpu only).
        "cuda_graph_blockers": [
            w.cuda_graph_blocker
            for w in wrappers
            if hasattr(type(w), "cuda_graph_blocker")
        ],
        "sources": sources,
    }


def _rank_main(
    rank: int,
    scenario: Callable[[torch.device], dict[str, Any]],
    workdir: str,
    device_type: str,
) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(workdir, f"inductor-{rank}")
    torch.set_num_threads(1)
    if device_type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"file://{os.path.join(workdir, 'store')}",
        rank=rank,
        world_size=WORLD_SIZE,
    )
    try:
        torch._dynamo.reset()
        report = scenario(device)
        with open(os.path.join(workdir, f"report-{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()


class DistributedTestCase(TestCase):
    device_type = "cpu"

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        if not dist.is_available() or not dist.is_gloo_available():
            raise unittest.SkipTest("torch.distributed with gloo is not built")

    def run_ranks(
        self, scenario: Callable[[torch.device], dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Runs `scenario` on WORLD_SIZE spawned ranks; returns their reports.
        A rank's exception fails the test with its traceback; ranks still
        running after RANK_TIMEOUT_S are killed."""
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory(prefix="cppwrap-dist-") as workdir:
            context = mp.start_processes(
                _rank_main,
                args=(scenario, workdir, self.device_type),
                nprocs=WORLD_SIZE,
                join=False,
                start_method="spawn",
            )
            deadline = time.monotonic() + RANK_TIMEOUT_S
            try:
                while not context.join(timeout=5):
                    if time.monotonic() > deadline:
                        self.fail(f"ranks still running after {RANK_TIMEOUT_S} s")
            finally:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                    process.join()
            reports = []
            for rank in range(WORLD_SIZE):
                with open(os.path.join(workdir, f"report-{rank}.json")) as f:
                    reports.append(json.load(f))
        for report in reports:
            self.assertTrue(report["classes"], "torch_cppwrap generated no wrapper")
            self.assertTrue(report["ours"], report["classes"])
        return reports


# ----------------------------------------------------------------------
# scenarios: each runs on every rank and returns its report
# ----------------------------------------------------------------------


def _compile_and_compare(
    fn: Callable[..., Any], args: list[Any], **config_changes: Any
) -> dict[str, Any]:
    """Compiles `fn` with our wrapper; outputs and mutated inputs must equal
    eager's."""
    eager_args = [a.clone() for a in args]
    expected = fn(*eager_args)
    torch._dynamo.reset()
    with our_wrappers() as wrappers, config.patch(config_changes):
        actual, sources = run_and_get_code(torch.compile(fn), *args)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(args, eager_args)
    return wrapper_facts(wrappers, sources)


def _functional_collectives(x, w, y, gathered):
    group = dist.group.WORLD
    h = x @ w
    reduced = funcol.all_reduce(h, "sum", group)
    all_gathered = _all_gather(h + 1, 0, group)
    scattered = _reduce_scatter(h * 2, "sum", 0, group)
    exchanged = funcol.all_to_all_single(x * 3, [2, 2], [2, 2], group)
    coalesced = funcol.all_reduce_coalesced([x + 1, w - 1], "max", group)
    gathered_list = _all_gather_coalesced([x, w * 2], group)
    scattered_list = _reduce_scatter_coalesced([x * 5, w], "sum", [0, 0], group)
    broadcast = funcol.broadcast(x.sin(), 1, group)
    # In place on graph inputs: lowered to all_reduce_ and an all-gather
    # copied into `gathered`.
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    dist.all_gather_into_tensor(gathered, x)
    return (
        reduced.relu(),
        all_gathered,
        scattered,
        exchanged,
        coalesced,
        gathered_list,
        scattered_list,
        broadcast,
    )


def _bucketed_all_gathers(x, y):
    group = dist.group.WORLD
    a = _all_gather(x, 0, group)
    b = _all_gather(y + 1, 0, group)
    return a * 2, b - 1


def scenario_functional_collectives(device: torch.device) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    args = [
        torch.randn(4, 4, device=device),
        torch.randn(4, 4, device=device),
        torch.randn(4, 4, device=device),
        torch.empty(8, 4, device=device),
    ]
    report = _compile_and_compare(_functional_collectives, args)
    # Bucketing all-gathers writes them into one buffer (the out= form).
    report["bucketed"] = (
        _compile_and_compare(
            _bucketed_all_gathers,
            [torch.randn(4, 4, device=device), torch.randn(4, 4, device=device)],
            bucket_all_gathers_fx="all",
        )
        if hasattr(config, "bucket_all_gathers_fx")
        else None  # a release without FX bucketing
    )
    return report


def _overlapped(x, w):
    reduced = funcol.all_reduce(x, "sum", dist.group.WORLD)
    independent = torch.relu(w @ w) * 2
    return reduced + independent


def scenario_wait_overlaps_and_releases_gil(device: torch.device) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    x, w = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)
    expected = _overlapped(x, w)
    # sink_waits moves each wait to just before its result is used, so the
    # matmul runs while the all-reduce communicates.
    with (
        our_wrappers() as wrappers,
        config.patch(
            reorder_for_compute_comm_overlap=True,
            reorder_for_compute_comm_overlap_passes=["sink_waits"],
        ),
    ):
        compiled = torch.compile(_overlapped)
        result, sources = run_and_get_code(compiled, x, w)
        torch.testing.assert_close(result, expected)
        dist.barrier()
        # Rank 1 comes late, so rank 0 waits in the graph's wait_tensor; a
        # Python thread on rank 0 counts how often it ran meanwhile.
        ticks = 0
        stop = threading.Event()

        def tick() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                time.sleep(0.005)

        if rank == 1:
            time.sleep(LATE_RANK_DELAY_S)
        ticker = threading.Thread(target=tick)
        ticker.start()
        # Which Python functions the call runs on this thread: the collectives'
        # autograd kernels (torch.library, in Python) must not be among them.
        python_kernels: list[str] = []
        kernel_file = os.path.join("torch", "_library", "autograd.py")

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code.co_filename.endswith(kernel_file):
                python_kernels.append(frame.f_code.co_name)

        try:
            time.sleep(0.05)  # the ticker is running
            start, ticks_before = time.monotonic(), ticks
            sys.setprofile(profile)
            try:
                result = compiled(x, w)
            finally:
                sys.setprofile(None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            call_s, ticks_during_call = time.monotonic() - start, ticks - ticks_before
        finally:
            stop.set()
            ticker.join()
    torch.testing.assert_close(result, expected)
    report = wrapper_facts(wrappers, sources)
    report["call_s"], report["ticks_during_call"] = call_s, ticks_during_call
    report["python_kernels"] = python_kernels
    return report


class Mlp(torch.nn.Module):
    """An input layer, then the block that tensor parallelism splits (w1
    column-wise, w2 row-wise); the input layer's gradient needs the block's
    input gradient, which tensor parallelism all-reduces in the backward."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.w0 = torch.nn.Linear(dim, dim)
        self.w1 = torch.nn.Linear(dim, hidden)
        self.w2 = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(torch.tanh(self.w0(x)))))


def _train(
    model: torch.nn.Module, inputs: list[torch.Tensor], lr: float = 0.05
) -> list[torch.Tensor]:
    # One tensor at a time: on CUDA, torch 2.11's foreach step meets a
    # replicated DTensor's grad as a plain tensor (eager fails too).
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
    losses = []
    for x in inputs:
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _compare_training(
    make_parallel: Callable[[torch.nn.Module], torch.nn.Module],
    device: torch.device,
    inputs: list[torch.Tensor],
    steps_compiled: bool = True,
) -> dict[str, Any]:
    """Trains the same parallelised Mlp eagerly and compiled (parallelised
    first, compiled last); losses and parameters must agree."""
    torch.manual_seed(0)
    reference = Mlp().to(device)
    model = copy.deepcopy(reference)
    eager_losses = _train(make_parallel(reference), inputs)
    torch._dynamo.reset()
    with our_wrappers() as wrappers:
        compiled = torch.compile(make_parallel(model))
        losses, sources = run_and_get_code(_train, compiled, inputs)
    torch.testing.assert_close(losses, eager_losses)
    for (name, p), q in zip(
        model.named_parameters(), reference.parameters(), strict=True
    ):
        torch.testing.assert_close(_full(p), _full(q), msg=name)
    return wrapper_facts(wrappers, sources)


def scenario_tensor_parallel(device: torch.device) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(device.type, (WORLD_SIZE,))
    plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    # Tensor parallel: every rank sees the same batch.
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(8, 16, generator=gen).to(device) for _ in range(3)]
    return _compare_training(
        lambda m: parallelize_module(m, mesh, plan), device, inputs
    )


def _rank_inputs(device: torch.device, steps: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    return [torch.randn(8, 16, generator=gen).to(device) for _ in range(steps)]


def scenario_ddp(device: torch.device) -> dict[str, Any]:
    """torch.compile(DDP(model)) (graphs split at DDP's buckets) and
    DDP(torch.compile(model)); DDP's all-reduces run in its hooks, outside
    the graphs, in both."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    inputs = _rank_inputs(device)
    compiled_ddp = _compare_training(lambda m: DDP(m, device_ids=ids), device, inputs)

    torch.manual_seed(0)
    reference = Mlp().to(device)
    model = copy.deepcopy(reference)
    eager_losses = _train(DDP(reference, device_ids=ids), inputs)
    torch._dynamo.reset()
    with our_wrappers() as wrappers:
        ddp_of_compiled = DDP(torch.compile(model), device_ids=ids)
        losses, sources = run_and_get_code(_train, ddp_of_compiled, inputs)
    torch.testing.assert_close(losses, eager_losses)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    report = wrapper_facts(wrappers, sources)
    report["compiled_ddp"] = compiled_ddp
    return report


def scenario_fsdp2(device: torch.device) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (WORLD_SIZE,))

    def shard(model: torch.nn.Module) -> torch.nn.Module:
        fully_shard(model.w1, mesh=mesh)
        fully_shard(model.w2, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    return _compare_training(shard, device, _rank_inputs(device))


# ----------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------

COLLECTIVES = [
    "_c10d_functional.all_reduce_.default",
    "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
    "_c10d_functional.all_reduce_coalesced_.default",
    "_c10d_functional.all_gather_into_tensor_coalesced.default",
    "_c10d_functional.reduce_scatter_tensor_coalesced.default",
    "_c10d_functional.broadcast_.default",
]
WAIT = "_c10d_functional.wait_tensor.default"
# torch 2.15 waits for a coalesced collective's results with one call.
WAITS = (WAIT, "_c10d_functional.wait_tensors.default")


def _body(source: str) -> str:
    return source[source.index("call_impl(") :]


class TestCollectivesInGraphs(DistributedTestCase):
    def test_functional_collectives(self) -> None:
        for report in self.run_ranks(scenario_functional_collectives):
            ops = report["collective_ops"]
            for op in COLLECTIVES:
                self.assertIn(op, ops)
            # At least one wait for each collective issued (one per result,
            # or one for all results of a coalesced one).
            issued = [op for op in ops if op not in WAITS]
            waits = [op for op in ops if op in WAITS]
            self.assertGreaterEqual(len(waits), len(issued), ops)
            (source,) = report["sources"]
            # Through the dispatcher (as the Python wrapper), not the C shim.
            self.assertIn('find_op("_c10d_functional::all_reduce_", "")', source)
            self.assertIn('.string("sum")', source)
            self.assertNotIn("aoti_torch_cpu__c10d_functional", source)
            # On CUDA, a graph that communicates is never replayed as a CUDA graph.
            for blocker in report["cuda_graph_blockers"]:
                self.assertIn("collectives", blocker)
            bucketed = report["bucketed"]
            if bucketed is None:
                continue
            self.assertIn(
                "_c10d_functional.all_gather_into_tensor_out.default",
                bucketed["collective_ops"],
            )

    def test_wait_overlaps_kernels_and_releases_gil(self) -> None:
        reports = self.run_ranks(scenario_wait_overlaps_and_releases_gil)
        for report in reports:
            self.assertEqual(
                report["collective_ops"],
                ["_c10d_functional.all_reduce_.default", WAIT],
            )
            body = _body(report["sources"][0])
            issue = body.index("op__c10d_functional_all_reduce__default()")
            wait = body.index("op__c10d_functional_wait_tensor_default()")
            matmul = body.index("mm_out(")
            self.assertLess(issue, matmul)
            self.assertLess(matmul, wait)
            # Both run below autograd: no Python autograd kernel in between.
            self.assertIn(".run_below_autograd();", body)
            self.assertEqual(report["python_kernels"], [])
        # Rank 0 waited for late rank 1 inside the graph, and a Python thread
        # kept running meanwhile: the wait does not hold the GIL.  (NCCL's
        # wait only orders streams; the host never blocks in it.)
        if self.device_type != "cpu":
            return
        first = reports[0]
        self.assertGreater(first["call_s"], LATE_RANK_DELAY_S / 2)
        self.assertGreater(first["ticks_during_call"], 10)


class TestParallelTraining(DistributedTestCase):
    def test_tensor_parallel_mlp(self) -> None:
        for report in self.run_ranks(scenario_tensor_parallel):
            # RowwiseParallel's output all-reduce runs inside the forward
            # graph, the all-reduce of the block's input gradient inside the
            # backward graph.
            communicating = [ops for ops in report["collective_ops_by_graph"] if ops]
            self.assertEqual(
                communicating, [["_c10d_functional.all_reduce_.default", WAIT]] * 2
            )
            for blocker in report["cuda_graph_blockers"]:
                self.assertIn("collectives", blocker)

    def test_ddp(self) -> None:
        for report in self.run_ranks(scenario_ddp):
            # Forward and backward of each, all generated by our wrapper.
            self.assertGreaterEqual(len(report["classes"]), 2)
            self.assertGreaterEqual(len(report["compiled_ddp"]["classes"]), 2)
            self.assertTrue(report["compiled_ddp"]["ours"])

    def test_fsdp2_compiled_model(self) -> None:
        for report in self.run_ranks(scenario_fsdp2):
            self.assertGreaterEqual(len(report["classes"]), 2)  # forward, backward


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


class GpuMixin:
    device_type = "cuda"

    @classmethod
    def setUpClass(cls) -> None:
        if not _two_gpus() or not dist.is_nccl_available():
            raise unittest.SkipTest("needs 2 CUDA GPUs and NCCL")
        super().setUpClass()  # type: ignore[misc]


class TestCollectivesInGraphsCuda(GpuMixin, TestCollectivesInGraphs):
    pass


class TestParallelTrainingCuda(GpuMixin, TestParallelTraining):
    pass


if __name__ == "__main__":
    run_tests()
