"""GPU benchmark: cold compile time and per-call time of one model under
torch_cppwrap's C++ wrapper, Inductor's Python wrapper, upstream's
cpp_wrapper and mode="reduce-overhead" (CUDA graphs), plus eager.

Each (mode, model) compiles in its own subprocess with a fresh
TORCHINDUCTOR_CACHE_DIR, so every compile is cold.  torch_cppwrap's runtime
extension is built once per torch version into TORCH_CPPWRAP_CACHE_DIR; the
parent builds it first and reports that time on its own.

    python scripts/gpu/bench.py --out results.json [--models seed mlp] [--modes ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("ours", "python", "eager", "reduce_overhead", "upstream_cpp")
MODELS = ("seed", "mlp")
ROOT = Path(__file__).resolve().parents[2]


def build_model(name: str):
    import torch
    import torch.nn.functional as F

    if name == "seed":

        def fn(x, y):
            return (x + y).sum()

        args = (
            torch.randn(128, 128, device="cuda"),
            torch.randn(128, 128, device="cuda"),
        )
        return fn, args

    if name == "mlp":

        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = torch.nn.Linear(256, 256)
                self.norm = torch.nn.LayerNorm(256)

            def forward(self, x):
                return self.norm(x + F.gelu(self.linear(x)))

        torch.manual_seed(0)
        model = torch.nn.Sequential(*[Block() for _ in range(8)]).cuda().eval()
        return model, (torch.randn(32, 256, device="cuda"),)

    raise ValueError(name)


def time_per_call(
    fn, args, *, warmup: int = 50, calls: int = 300, reps: int = 7
) -> float:
    """Median over `reps` of the wall time per call of `calls` back-to-back
    calls, the GPU synchronised at both ends (microseconds)."""
    import torch

    for _ in range(warmup):
        fn(*args)
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def run_one(mode: str, model_name: str, dump_dir: str | None) -> dict:
    """Runs in the child: compile, check against eager, time."""
    import torch
    from torch._inductor import config

    used_ours: list[str] = []
    if mode == "ours":
        import logging

        import torch_cppwrap  # noqa: F401

        # "built ... in N s" for each C++ build, to see where a cold compile goes.
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
        logging.getLogger("torch_cppwrap").setLevel(logging.INFO)
        from torch_cppwrap._inductor.codegen import cpp_wrapper_gpu
        original_create = cpp_wrapper_gpu.CppWrapperGpu.create

        def counting_create(*a, **k):
            used_ours.append("CppWrapperGpu")
            return original_create(*a, **k)

        cpp_wrapper_gpu.CppWrapperGpu.create = staticmethod(counting_create)
    if mode in ("ours", "upstream_cpp"):
        config.cpp_wrapper = True

    fn, args = build_model(model_name)
    result: dict = {"mode": mode, "model": model_name, "torch": torch.__version__}
    with torch.no_grad():
        expected = fn(*args)
        torch.cuda.synchronize()
        if mode == "eager":
            compiled = fn
            result["cold_s"] = 0.0
        else:
            kwargs = {"mode": "reduce-overhead"} if mode == "reduce_overhead" else {}
            compiled = torch.compile(fn, **kwargs)
            start = time.perf_counter()
            out = compiled(*args)
            torch.cuda.synchronize()
            result["cold_s"] = time.perf_counter() - start
            if mode == "reduce_overhead":
                # CUDA graphs record on the following calls; count them as
                # part of getting ready.
                start = time.perf_counter()
                for _ in range(3):
                    out = compiled(*args)
                torch.cuda.synchronize()
                result["cudagraph_record_s"] = time.perf_counter() - start
            result["max_abs_err"] = float((out - expected).abs().max())
        result["per_call_us"] = time_per_call(compiled, args)
    if mode == "ours":
        result["used_torch_cppwrap"] = bool(used_ours)
        if not used_ours:
            result["error"] = "CppWrapperGpu generated no code"
    if dump_dir and mode == "ours":
        cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        for path in sorted(cache.rglob("*.py")):
            text = path.read_text(errors="replace")
            if "torch_cppwrap._inductor.codecache import CppWrapperCodeCache" in text and "wrapper_src" in text:
                shutil.copy(path, Path(dump_dir) / f"generated_{model_name}.py")
    return result


def child_main(args: argparse.Namespace) -> None:
    try:
        result = run_one(args.mode, args.model, args.dump_dir)
    except Exception as e:  # reported, not raised: the parent keeps going
        import traceback

        traceback.print_exc()
        result = {
            "mode": args.mode,
            "model": args.model,
            "error": f"{type(e).__name__}: {e}",
        }
    Path(args.result).write_text(json.dumps(result))


def build_runtime_extension() -> dict:
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from torch_cppwrap._inductor.codecache import RuntimeExtension; "
            "RuntimeExtension.load()",
        ],
        cwd=ROOT,
    )
    return {
        "runtime_extension_build_s": time.perf_counter() - start,
        "rc": proc.returncode,
    }


def parent_main(args: argparse.Namespace) -> None:
    results: dict = {"runs": []}
    runs = (
        [tuple(r.split(":")) for r in args.runs]
        if args.runs
        else [(mode, model) for mode in args.modes for model in args.models]
    )
    if any(mode == "ours" for mode, _ in runs):
        results["runtime_extension"] = build_runtime_extension()
        print(f"runtime extension: {results['runtime_extension']}", flush=True)
    for mode, model in runs:
        with tempfile.TemporaryDirectory(prefix=f"inductor-{mode}-") as cache_dir:
            result_file = Path(cache_dir) / "result.json"
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
            if mode == "ours" and model in args.log_code_for:
                env["TORCH_LOGS"] = "output_code"
            cmd = [
                sys.executable,
                "-X",
                "faulthandler",
                __file__,
                "--child",
                "--mode",
                mode,
                "--model",
                model,
                "--result",
                str(result_file),
            ]
            if args.dump_dir:
                cmd += ["--dump-dir", args.dump_dir]
            start = time.perf_counter()
            try:
                rc = subprocess.run(
                    cmd, env=env, cwd=ROOT, timeout=args.timeout
                ).returncode
                run = (
                    json.loads(result_file.read_text())
                    if result_file.exists()
                    else {
                        "mode": mode,
                        "model": model,
                        "error": f"child exited with {rc}",
                    }
                )
            except subprocess.TimeoutExpired:
                run = {"mode": mode, "model": model, "error": "timeout"}
            except (OSError, ValueError) as e:
                run = {"mode": mode, "model": model, "error": f"no result: {e}"}
            run["process_s"] = time.perf_counter() - start
        results["runs"].append(run)
        print(json.dumps(run), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    print_table(results)


def print_table(results: dict) -> None:
    print(
        f"\n{'model':6} {'mode':16} {'cold compile s':>15} {'per call us':>12} {'max err':>10}"
    )
    for run in results["runs"]:
        if "error" in run:
            print(f"{run['model']:6} {run['mode']:16} ERROR {run['error'][:80]}")
            continue
        print(
            f"{run['model']:6} {run['mode']:16} {run.get('cold_s', 0):15.2f} "
            f"{run['per_call_us']:12.1f} {run.get('max_abs_err', 0):10.2e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--model", choices=MODELS)
    parser.add_argument("--result")
    parser.add_argument("--out", default="bench_gpu.json")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument(
        "--runs",
        nargs="*",
        help="MODE:MODEL pairs, in order (default: every mode for every model)",
    )
    parser.add_argument("--dump-dir")
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument(
        "--log-code-for",
        nargs="*",
        default=[],
        help="models whose generated code our runs print (TORCH_LOGS=output_code)",
    )
    args = parser.parse_args()
    if args.child:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
