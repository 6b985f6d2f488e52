"""Where a replayed model's memory lies, call by call: the MB reserved and
allocated in each memory pool ((0, 0) is the caching allocator's default
pool; the others are CUDA graphs' pools).  Each call's result is dropped
before the next, as bench.py does; --hold-first holds the first call's, as
bench.py did up to 4178fe5.  --eager-first runs the model eagerly before it
is compiled, as bench.py does (which leaves cached segments, and the default
stream's cuBLAS workspace, in the default pool).

Usage, from the repository root on a GPU machine:

    python scripts/gpu/memory_by_pool.py cppwrap [MODEL] [--hold-first]
        [--eager-first]
    python scripts/gpu/memory_by_pool.py reduce-overhead [MODEL] [--hold-first]
        [--eager-first]

MODEL is a model of benchmarks/models.py (default: gpt2).
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import torch


def by_pool() -> dict[tuple[int, int], tuple[float, float]]:
    """(reserved MB, allocated MB) per memory pool."""
    reserved: collections.Counter[tuple[int, int]] = collections.Counter()
    allocated: collections.Counter[tuple[int, int]] = collections.Counter()
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment["segment_pool_id"])
        reserved[pool] += segment["total_size"]
        allocated[pool] += segment["allocated_size"]
    return {
        pool: (round(reserved[pool] / 2**20, 1), round(allocated[pool] / 2**20, 1))
        for pool in reserved
    }


def main(
    mode: str,
    model: str,
    hold_first: bool,
    eager_first: bool = False,
    calls: int = 6,
) -> None:
    if mode == "cppwrap":
        import torch_cppwrap  # noqa: F401

        torch._inductor.config.cpp_wrapper = True
    sys.path.insert(0, "benchmarks")
    import models  # type: ignore[import-not-found]

    torch.manual_seed(0)
    fn, args = getattr(models, model)("cuda")
    if eager_first:
        with torch.no_grad():
            fn(*args)
    compiled = torch.compile(fn, mode=None if mode == "cppwrap" else mode)
    held: Any = None
    with torch.no_grad():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_reserved() / 2**20
        print(mode, "base reserved MB", round(base, 1), by_pool())
        for i in range(calls):
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            out = compiled(*args)
            if i == 0 and hold_first:
                held = out
            torch.cuda.synchronize()
            rise = torch.cuda.max_memory_reserved() / 2**20 - base
            print(
                mode,
                model,
                "call",
                i + 1,
                "peak rise MB",
                round(rise, 1),
                "(reserved, allocated) MB by pool",
                by_pool(),
            )
            del out
    del held


if __name__ == "__main__":
    positional = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(
        positional[0],
        (positional[1:] or ["gpt2"])[0],
        "--hold-first" in sys.argv,
        eager_first="--eager-first" in sys.argv,
    )
