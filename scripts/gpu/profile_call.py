"""Where one call's time goes on the GPU, for each wrapper side by side.

For every mode, in its own process (torch_cppwrap patches Inductor on import):
end to end per call without and with a synchronise after each call, the
compiled module's `call` alone, the GPU's busy time per call (kernel time
from the profiler), and the profiler's CPU table.  torch_cppwrap's generated
C++ is written next to the tables.

    python scripts/gpu/profile_call.py --out DIR [--workloads mlp,seed] [--modes cppwrap,upstream,python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def child(workload: str, mode: str, out: Path) -> dict[str, Any]:
    if mode == "cppwrap":
        import torch_cppwrap  # noqa: F401
    import importlib.util

    import torch
    from torch._inductor import config
    from torch.profiler import ProfilerActivity, profile

    # As a file: importing the package would patch Inductor in every mode.
    spec = importlib.util.spec_from_file_location(
        "cppwrap_bench", ROOT / "benchmarks" / "bench.py"
    )
    assert spec is not None and spec.loader is not None
    _bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = _bench  # dataclasses look their module up
    spec.loader.exec_module(_bench)

    config.cpp_wrapper = mode in ("cppwrap", "upstream")
    sync = torch.cuda.synchronize
    torch.manual_seed(0)
    fn, args = _bench.WORKLOADS[workload].build("cuda")
    before = _bench.loaded_module_count()
    compiled = torch.compile(fn)
    record: dict[str, Any] = {
        "workload": workload,
        "mode": mode,
        "torch_cppwrap_imported": "torch_cppwrap" in sys.modules,
    }
    with torch.no_grad():
        compiled(*args)
        sync()
        modules = _bench.new_compiled_modules(before)
        record["wrappers"] = sorted({_bench.wrapper_kind(m) for m in modules})
        for _ in range(3):  # past the CUDA graph capture, where there is one
            compiled(*args)
        record["cuda_graph_states"] = [
            m._module.cuda_graph_state()
            for m in modules
            if hasattr(getattr(m, "_module", None), "cuda_graph_state")
        ]

        def timed(f: Any, per_call_sync: bool) -> float:
            def once() -> None:
                f()
                if per_call_sync:
                    sync()

            t = _bench.time_per_call(once, repeats=5, target_s=0.3, sync=sync)
            return t.median_us

        record["e2e_us"] = timed(lambda: compiled(*args), False)
        record["e2e_sync_each_us"] = timed(lambda: compiled(*args), True)
        call_args = [m.get_args() for m in modules if hasattr(m, "get_args")]
        if len(call_args) == len(modules):
            record["call_us"] = sum(
                timed(lambda m=m, a=a: m.call(list(a)), False)
                for m, a in zip(modules, call_args, strict=True)
            )
        calls = 50
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                compiled(*args)
            sync()
        events = prof.key_averages()
        kernel_us = sum(
            getattr(e, "self_device_time_total", 0)
            for e in events
            if str(getattr(e, "device_type", "")).endswith("CUDA")
        )
        record["gpu_kernel_us"] = kernel_us / calls
        table = events.table(sort_by="self_cpu_time_total", row_limit=40)
        (out / f"profile_{workload}_{mode}.txt").write_text(table)
    for m in modules:
        src = getattr(m, "wrapper_src", None) or getattr(m, "cpp_wrapper_src", None)
        if src:
            (out / f"wrapper_{workload}_{mode}.cpp").write_text(src)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workloads", default="mlp,seed")
    parser.add_argument("--modes", default="cppwrap,upstream,python")
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "MODE"))
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    if ns.child:
        print("RESULT " + json.dumps(child(*ns.child, ns.out)), flush=True)
        return 0
    records = []
    for workload in ns.workloads.split(","):
        for mode in ns.modes.split(","):
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp())
            cmd = [
                sys.executable,
                __file__,
                "--out",
                str(ns.out),
                "--child",
                workload,
                mode,
            ]
            proc = subprocess.run(
                cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240
            )
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            record = (
                json.loads(lines[-1][7:])
                if lines
                else {
                    "workload": workload,
                    "mode": mode,
                    "error": proc.stderr[-3000:],
                }
            )
            print(json.dumps(record), flush=True)
            records.append(record)
    (ns.out / "profile.json").write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
