"""Concurrent cold builds: N processes compile the same graph at once into one
empty Inductor cache, with torch_cppwrap's C++ wrapper and with upstream's.

python benchmarks/concurrent_cold.py [--processes 4] [--modes upstream,cppwrap]

For each mode: a fresh TORCHINDUCTOR_CACHE_DIR (which holds everything
torch_cppwrap builds, the runtime extension and precompiled headers included)
and a fresh TMPDIR (upstream keeps its precompiled headers in Inductor's
default cache directory, under TMPDIR), N processes started together, each timing its first call of the compiled
function.  Prints the wall time until the last process finished, each
process's compile time, and for torch_cppwrap how many times each
once-per-cache artefact was built (it should be once, whatever N is).
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


def run_mode(mode: str, processes: int, root: Path) -> dict[str, object]:
    cache = root / mode
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
    # Upstream keeps its precompiled headers in Inductor's default cache
    # directory, under the temporary directory, whatever TORCHINDUCTOR_CACHE_DIR
    # says: a fresh TMPDIR empties that too.
    (cache / "tmp").mkdir(parents=True)
    env["TMPDIR"] = str(cache / "tmp")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, (str(REPO), env.get("PYTHONPATH")))
    )
    # The torch_cppwrap of before its cache moved under Inductor's kept it here.
    env["TORCH_CPPWRAP_CACHE_DIR"] = str(cache / "cppwrap-old")
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
        "mode": mode,
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
    ns = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="cppwrap-concurrent-"))
    try:
        for mode in ns.modes.split(","):
            print(json.dumps(run_mode(mode, ns.processes, root)), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
