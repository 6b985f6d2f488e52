"""Whether dropping every stream's cuBLAS workspaces on one thread, then
emptying the cache (what a CUDA graph's warm-up did before 2026-12-04, and
what cudagraph trees do around theirs), breaks matmuls that another thread
runs meanwhile.  Plain torch, nothing compiled; the matmuls run in a child
process, whose CUDA context an illegal address would leave unusable.

    python scripts/gpu/cublas_workspace_race.py --seconds 15
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time


def child(seconds: float) -> None:
    import torch

    a, b = (torch.randn(256, 256, device="cuda") for _ in range(2))
    stop = threading.Event()
    counts = {"matmuls": 0, "drops": 0}

    def matmuls() -> None:
        while not stop.is_set():
            torch.mm(a, b)
            counts["matmuls"] += 1

    worker = threading.Thread(target=matmuls)
    worker.start()
    deadline = time.monotonic() + seconds
    error = None
    try:
        while time.monotonic() < deadline:
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
            counts["drops"] += 1
        torch.cuda.synchronize()
    except Exception as e:  # a CUDA error surfaces on either thread
        error = repr(e)[:300]
    finally:
        stop.set()
        worker.join()
    print(json.dumps({**counts, "error": error}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.seconds)
        return
    run = subprocess.run(
        [sys.executable, __file__, "--child", "--seconds", str(args.seconds)],
        capture_output=True,
        text=True,
        timeout=args.seconds + 120,
    )
    lines = run.stdout.strip().splitlines()
    print(lines[-1] if lines else f"no result; exit {run.returncode}")
    if run.returncode != 0:
        print(run.stderr[-2000:])


if __name__ == "__main__":
    main()
