"""Concurrent cold builds: N processes compile the same graph at once into one
empty Inductor cache, with torch_cppwrap's C++ wrapper and with upstream's.

python benchmarks/concurrent_cold.py [--processes 4]
    [--modes upstream,cppwrap[,cppwrap@/path/to/another/checkout]]

For each mode: a fresh TORCHINDUCTOR_CACHE_DIR (which holds everything
torch_cppwrap builds, the runtime extension and precompiled headers included)
and a fresh TMPDIR (upstream keeps its precompiled headers in Inductor's
default cache directory, under TMPDIR), N processes started together, each
timing its first call of the compiled function.  Prints the wall time until
the last process finished, each process's compile time, the CPU time of
their children (compilers, vector-ISA probes) and how many times each of
torch_cppwrap's once-per-cache artefacts was built (once, whatever N is).

With --primed, one process first compiles another graph in the same caches,
so that the N processes find each mode's once-per-cache work done (ours:
runtime extension and precompiled headers; upstream's: its precompiled
headers; both: the vector-ISA probe) and build only the graph.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

WORKER = """
import json, resource, sys, time
started = time.perf_counter()
import torch
if sys.argv[1] == "cppwrap":
    import torch_cppwrap
import torch._inductor.config as config
config.cpp_wrapper = True

def fn(x, w):
    return torch.relu(x @ w + 1.0).sum(dim=1)

def primer(x, w):
    return torch.tanh(x @ w * 2.0).amax(dim=0)

if sys.argv[2:] == ["prime"]:
    fn = primer
x, w = torch.randn(64, 32), torch.randn(32, 16)
imported = time.perf_counter()
out = torch.compile(fn)(x, w)
compiled = time.perf_counter()
torch.testing.assert_close(out, fn(x, w), rtol=1e-4, atol=1e-4)
children = resource.getrusage(resource.RUSAGE_CHILDREN)
print("RESULT " + json.dumps({
    "import_s": imported - started, "compile_s": compiled - imported,
    "compiler_cpu_s": children.ru_utime + children.ru_stime,
}))
"""

# torch_cppwrap's "building X (once per ...)..." lines, one per build.
BUILD_LINE = re.compile(r"^torch_cppwrap: building (.*?) \(", re.M)


def run_mode(spec: str, processes: int, root: Path, primed: bool) -> dict[str, object]:
    # "cppwrap@/path/to/checkout" runs the torch_cppwrap of another checkout
    # (an older one, to compare with).
    mode, _, checkout = spec.partition("@")
    cache = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=root))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
    # Upstream keeps its precompiled headers in Inductor's default cache
    # directory, under the temporary directory, whatever TORCHINDUCTOR_CACHE_DIR
    # says: a fresh TMPDIR empties that too.
    (cache / "tmp").mkdir()
    env["TMPDIR"] = str(cache / "tmp")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, (checkout or str(REPO), env.get("PYTHONPATH")))
    )
    # The torch_cppwrap of before its cache moved under Inductor's kept it here.
    env["TORCH_CPPWRAP_CACHE_DIR"] = str(cache / "cppwrap-old")
    if primed:
        subprocess.run(
            [sys.executable, "-c", WORKER, mode, "prime"],
            env=env,
            check=True,
            capture_output=True,
        )
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    results = []
    builds: dict[str, int] = {}
    for proc in procs:
        out, err = proc.communicate()
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(
                f"{mode} worker failed ({proc.returncode}):\n{err[-3000:]}"
            )
        results.append(json.loads(line[len("RESULT ") :]))
        for what in BUILD_LINE.findall(err):
            builds[what] = builds.get(what, 0) + 1
        if os.environ.get("CONCURRENT_COLD_VERBOSE"):
            print(err, file=sys.stderr)
    wall = time.perf_counter() - started
    return {
        "mode": spec,
        "wall_s": round(wall, 1),
        "compile_s": [round(r["compile_s"], 1) for r in results],
        # CPU time of each process's children: compilers, and Inductor's
        # vector-ISA probes.
        "child_cpu_s": round(sum(r["compiler_cpu_s"] for r in results), 1),
        "builds": builds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--modes", default="upstream,cppwrap")
    parser.add_argument("--primed", action="store_true")
    ns = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="cppwrap-concurrent-"))
    try:
        for mode in ns.modes.split(","):
            result = run_mode(mode, ns.processes, root, ns.primed)
            print(json.dumps({**result, "primed": ns.primed}), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
