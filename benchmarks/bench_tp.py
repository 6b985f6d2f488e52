"""Per-step time of a tensor-parallel MLP block under each wrapper.

The block is DTensor tensor parallelism over all ranks: w1 ColwiseParallel,
w2 RowwiseParallel (one all-reduce per block in the forward, one in the
backward), compiled with torch.compile.  Each mode runs in its own group of
processes, spawned here (python and upstream never import torch_cppwrap):

  python     Inductor's Python wrapper
  upstream   Inductor's own cpp_wrapper (torch_cppwrap not imported)
  cppwrap    torch_cppwrap's C++ wrapper

Two GPUs (NCCL, NVLink multicast off):

    python benchmarks/bench_tp.py --out results/tp_h200.json

A quick check on the CPU (gloo, small sizes):

    python benchmarks/bench_tp.py --device cpu --out /tmp/tp_cpu.json

Prints a markdown table and writes every number to the JSON file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

MODES = ("python", "upstream", "cppwrap")
STEPS = ("forward", "train")


def build_model(ns: argparse.Namespace, device: Any) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = torch.nn.Linear(ns.dim, ns.ffn, bias=False)
            self.w2 = torch.nn.Linear(ns.ffn, ns.dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.w2(torch.nn.functional.gelu(self.w1(x)))

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block() for _ in range(ns.blocks))).to(device)
    mesh = init_device_mesh(device.type, (ns.world_size,))
    plan = {}
    for i in range(ns.blocks):
        plan[f"{i}.w1"] = ColwiseParallel()
        plan[f"{i}.w2"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def wrapper_kinds(modules: list[Any]) -> list[str]:
    """Which code generator wrote each wrapper module Inductor loaded."""
    kinds = []
    for module in modules:
        if hasattr(module, "wrapper_src"):
            kinds.append("torch_cppwrap")
        elif hasattr(module, "inductor_entry") or hasattr(module, "cpp_wrapper_src"):
            kinds.append("upstream-cpp")
        else:
            kinds.append("python")
    return kinds


def time_steps(step: Any, ns: argparse.Namespace, sync: Any) -> list[float]:
    """Milliseconds per step, one number per round; ranks start each round
    together."""
    import torch.distributed as dist

    per_step = []
    for _ in range(ns.rounds):
        dist.barrier()
        sync()
        start = time.perf_counter()
        for _ in range(ns.steps):
            step()
        sync()
        per_step.append((time.perf_counter() - start) / ns.steps * 1e3)
    return per_step


def run_mode(rank: int, ns: argparse.Namespace, workdir: str) -> dict[str, Any]:
    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor.codecache import PyCodeCache

    if ns.mode == "cppwrap":
        import torch_cppwrap  # noqa: F401  (patches Inductor)
    inductor_config.cpp_wrapper = ns.mode != "python"

    if ns.device == "cuda":
        device = torch.device("cuda", rank)
        sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    else:
        device = torch.device("cpu")
        sync = lambda: None  # noqa: E731
    model = build_model(ns, device)
    compiled = torch.compile(model)
    x = torch.randn(ns.batch, ns.dim, device=device)
    x_grad = x.clone().requires_grad_(True)

    @torch.no_grad()
    def forward() -> None:
        compiled(x)

    def train() -> None:
        compiled(x_grad).sum().backward()
        model.zero_grad(set_to_none=True)

    result: dict[str, Any] = {"mode": ns.mode, "steps": {}}
    for name, step in (("forward", forward), ("train", train)):
        if name not in ns.step_kinds:
            continue
        before = len(PyCodeCache.modules)
        entry: dict[str, Any] = {}
        try:
            start = time.perf_counter()
            step()  # compiles
            sync()
            entry["first_step_s"] = time.perf_counter() - start
            for _ in range(ns.warmup):
                step()
            entry["generated_by"] = sorted(
                set(wrapper_kinds(PyCodeCache.modules[before:]))
            )
            rounds = time_steps(step, ns, sync)
            entry.update(
                median_ms=statistics.median(rounds),
                min_ms=min(rounds),
                rounds_ms=rounds,
            )
        except Exception as e:  # both ranks fail alike: at compile time
            entry["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            entry["traceback"] = traceback.format_exc()[-3000:]
        result["steps"][name] = entry
    return result


def rank_main(rank: int, ns: argparse.Namespace, workdir: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(workdir, f"inductor-{rank}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    if ns.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ns.world_size))
    dist.init_process_group(
        "nccl" if ns.device == "cuda" else "gloo",
        init_method=f"file://{os.path.join(workdir, 'store')}",
        rank=rank,
        world_size=ns.world_size,
        timeout=datetime.timedelta(seconds=ns.timeout),
    )
    try:
        result = run_mode(rank, ns, workdir)
        gathered: list[Any] = [None] * ns.world_size
        dist.all_gather_object(gathered, result)
        if rank == 0:
            with open(os.path.join(workdir, "result.json"), "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


def run_spawned(ns: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix=f"bench-tp-{ns.mode}-") as workdir:
        context = mp.start_processes(
            rank_main,
            args=(ns, workdir),
            nprocs=ns.world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + ns.timeout
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"mode {ns.mode}: ranks ran past {ns.timeout} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        with open(os.path.join(workdir, "result.json")) as f:
            return json.load(f)


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per step kind: the slowest rank's median (the step is as slow
    as its slowest rank)."""
    mode = per_rank[0]["mode"]
    rows = {}
    for step in per_rank[0]["steps"]:
        entries = [r["steps"][step] for r in per_rank]
        errors = [e["error"] for e in entries if "error" in e]
        if errors:
            rows[step] = {"error": errors[0]}
            continue
        rows[step] = {
            "median_ms": max(e["median_ms"] for e in entries),
            "min_ms": max(e["min_ms"] for e in entries),
            "first_step_s": max(e["first_step_s"] for e in entries),
            "generated_by": entries[0]["generated_by"],
        }
    return {"mode": mode, "steps": rows, "per_rank": per_rank}


def markdown(ns: argparse.Namespace, summaries: list[dict[str, Any]]) -> str:
    lines = [
        f"TP MLP on {ns.world_size} ranks ({ns.device}): {ns.blocks} block(s), "
        f"dim {ns.dim}, ffn {ns.ffn}, batch {ns.batch}; {ns.rounds} rounds of "
        f"{ns.steps} steps, slowest rank's median",
        "",
        "| step | mode | ms/step (median) | min | vs python | first step (s) | wrapper |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {
        step: row.get("median_ms")
        for s in summaries
        if s["mode"] == "python"
        for step, row in s["steps"].items()
    }
    for step in STEPS:
        for s in summaries:
            row = s["steps"].get(step)
            if row is None:
                continue
            if "error" in row:
                lines.append(
                    f"| {step} | {s['mode']} | failed: {row['error']} | | | | |"
                )
                continue
            ratio = f"{row['median_ms'] / base[step]:.2f}x" if base.get(step) else "n/a"
            lines.append(
                f"| {step} | {s['mode']} | {row['median_ms']:.3f} | {row['min_ms']:.3f} "
                f"| {ratio} | {row['first_step_s']:.1f} | {', '.join(row['generated_by'])} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--step-kinds", default=",".join(STEPS))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--dim", type=int, help="default 4096 (cuda), 256 (cpu)")
    parser.add_argument("--ffn", type=int, help="default 4 * dim")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, help="steps per round (100 cuda, 20 cpu)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mode")
    ns = parser.parse_args(argv)
    ns.dim = ns.dim or (4096 if ns.device == "cuda" else 256)
    ns.ffn = ns.ffn or 4 * ns.dim
    ns.steps = ns.steps or (100 if ns.device == "cuda" else 20)
    ns.modes = [m for m in ns.modes.split(",") if m]
    ns.step_kinds = [s for s in ns.step_kinds.split(",") if s]
    unknown = [m for m in ns.modes if m not in MODES]
    unknown += [s for s in ns.step_kinds if s not in STEPS]
    if unknown:
        parser.error(f"unknown mode or step kind: {', '.join(unknown)}")
    return ns


def main(argv: list[str]) -> int:
    ns = parse_args(argv)
    if ns.device == "cuda":
        import torch

        if torch.cuda.device_count() < ns.world_size:
            print(f"needs {ns.world_size} GPUs", file=sys.stderr)
            return 2
    summaries = []
    for mode in ns.modes:
        print(f"bench_tp: {mode}...", file=sys.stderr, flush=True)
        ns.mode = mode
        summaries.append(summarize(run_spawned(ns)))
    import torch

    report = {
        "benchmark": "tensor-parallel MLP per-step time",
        "torch": torch.__version__,
        "device": ns.device,
        "config": {k: v for k, v in vars(ns).items() if k not in ("out", "mode")},
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE", "0 (set here)"),
        "results": summaries,
    }
    table = markdown(ns, summaries)
    print(table)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    report["markdown"] = table
    ns.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {ns.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
