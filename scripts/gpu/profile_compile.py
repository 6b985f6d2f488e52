"""Where a cold compile's seconds go: one cold compile per workload and mode,
each alone in a fresh process with an empty Inductor cache, under cProfile.

    python scripts/gpu/profile_compile.py --out DIR --workloads vit_tiny \
        --modes python,cppwrap

Each (workload, mode) leaves DIR/<workload>_<mode>.prof (pstats, read it
with ``python -m pstats``) and DIR/<workload>_<mode>.txt: the compile's
seconds and the functions that took the most, by cumulative and by own time.
The bench's worker (``bench.run_worker``, cold phase) does the compile, so
what is profiled is the bench's cold step, in the environment the bench
gives it (``bench.worker_env``).  On Python 3.12 (the device's) the profile
holds every thread's calls, the code cache's build threads too; the compile
workers' processes show as the time waited for them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_call import load_bench

TOP = 60


def _child(workload: str, mode: str, out: Path, device: str) -> None:
    bench = load_bench()
    profiler = cProfile.Profile()
    result = profiler.runcall(bench.run_worker, workload, mode, "cold", device, True)
    stem = out / f"{workload}_{mode}"
    profiler.dump_stats(f"{stem}.prof")
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    text.write(f"compile_s {result.get('compile_s')}\n")
    for key in ("cumulative", "tottime"):
        stats.sort_stats(key).print_stats(TOP)
    Path(f"{stem}.txt").write_text(text.getvalue())
    print(json.dumps({k: result.get(k) for k in ("compile_s", "ok", "wrappers")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workloads", default="vit_tiny")
    parser.add_argument("--modes", default="python,cppwrap")
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "MODE"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        _child(*args.child, args.out, args.device)
        return
    bench = load_bench()
    for workload in args.workloads.split(","):
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory(prefix="cppwrap_prof_") as cache:
                cmd = [sys.executable, __file__, "--out", str(args.out)]
                cmd += ["--device", args.device, "--child", workload, mode]
                proc = subprocess.run(
                    cmd,
                    env=bench.worker_env(mode, cache),
                    capture_output=True,
                    text=True,
                )
                last = proc.stdout.strip().splitlines()[-1:] or [proc.stderr[-2000:]]
                print(f"{workload} {mode}: rc {proc.returncode} {last[0]}", flush=True)


if __name__ == "__main__":
    main()
