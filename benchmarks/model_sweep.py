"""Real models through torch_cppwrap's wrapper: does each compile with ours
(no fallback) and match eager, under the settings users compile with?

    python benchmarks/model_sweep.py --device cpu --out sweep_results
    python benchmarks/model_sweep.py --device cuda --models llama,whisper \
        --settings default,backward

Every model of ``models.FAMILIES`` (tiny transformers models, one per
architecture) and, where timm is installed, the benchmark's timm models, in
each setting:

- ``default``: eval mode under ``torch.no_grad()``, three calls (on CUDA,
  the third replays ours' CUDA graph);
- ``dynamic``: ``dynamic=True``, called again on shorter token ids;
- ``memory_planning``, ``freezing``: that Inductor setting on;
- ``backward``: eval mode (no dropout) with gradients: the loss and every
  parameter's gradient against eager's, relative to the largest gradient;
- ``compiled_autograd``: the same, the loss's ``backward()`` called inside
  the compiled function with Dynamo's compiled autograd on, which compiles
  the backward as a graph of its own.

One process runs every case (``torch._dynamo.reset()`` between them);
torch_cppwrap runs strict, so a graph ours cannot handle fails its case
with the reason instead of falling back.  A case that does not match eager
runs again through Inductor's Python wrapper, and its row gives that error
too: a mismatch both wrappers share is the kernels' rounding (TF32 in
cuDNN, reductions in another order), not ours.  Writes ``sweep.md`` and
``sweep.json`` under ``--out``.  Not part of the package.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (beside this script)
import models  # noqa: E402

SETTINGS = (
    "default",
    "dynamic",
    "memory_planning",
    "freezing",
    "backward",
    "compiled_autograd",
)
BACKWARD_SETTINGS = ("backward", "compiled_autograd")
TIMM_MODELS = ("resnet18", "vit_tiny", "mobilenetv3")
# float32 throughout; gradients are compared relative to their largest.
TOL = 1e-3
# Calls of a compiled inference model on each set of inputs: on CUDA, ours
# warms a graph up on its first call, captures it on the second and replays
# it from the third.
CALLS = 3


@dataclasses.dataclass
class Case:
    model: str
    setting: str
    status: str = "ok"  # ok, mismatch, error
    graphs: int = 0  # wrapper modules of ours the case loaded
    max_err: float = 0.0
    compile_s: float = 0.0
    message: str = ""
    # A mismatch's max error with Inductor's Python wrapper instead of ours.
    python_max_err: float | None = None


def builders(names: list[str] | None) -> dict[str, Callable[[str], models.Built]]:
    available: dict[str, Callable[[str], models.Built]] = dict(models.FAMILIES)
    try:
        import timm  # noqa: F401
    except ImportError:
        pass
    else:
        available.update({name: getattr(models, name) for name in TIMM_MODELS})
    if not names:
        return available
    unknown = sorted(set(names) - set(available))
    if unknown:
        raise SystemExit(
            f"unknown or unavailable models: {', '.join(unknown)} "
            f"(have: {', '.join(available)})"
        )
    return {name: available[name] for name in names}


def fresh(build: Callable[[str], models.Built], device: str) -> models.Built:
    """The model and inputs from seed 0: two calls give the same weights."""
    import torch

    torch.manual_seed(0)
    return build(device)


def shorter(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The inputs with token ids cut to three quarters of their length."""
    import torch

    return tuple(
        a[..., : a.shape[-1] * 3 // 4]
        if isinstance(a, torch.Tensor) and not a.is_floating_point() and a.dim() == 2
        else a
        for a in args
    )


def module_of(fn: Any) -> Any:
    return getattr(fn, "module", fn)


@contextlib.contextmanager
def setting_config(setting: str, cpp_wrapper: bool = True) -> Iterator[None]:
    import torch._dynamo
    from torch._inductor import config

    patches: dict[str, Any] = {"cpp_wrapper": cpp_wrapper, "fx_graph_cache": False}
    if setting in ("memory_planning", "freezing"):
        patches[setting] = True
    compiled_autograd = setting == "compiled_autograd"
    with (
        config.patch(patches),
        torch._dynamo.config.patch(compiled_autograd=compiled_autograd),
    ):
        yield


def loss_and_backward(fn: Callable[..., Any], *args: Any) -> Any:
    loss = fn(*args).float().square().mean()
    loss.backward()
    return loss


def run_case(
    name: str,
    build: Callable[[str], models.Built],
    setting: str,
    device: str,
    cpp_wrapper: bool = True,
) -> Case:
    import torch

    case = Case(name, setting)
    torch._dynamo.reset()
    eager_fn, args = fresh(build, device)
    compiled_fn, compiled_args = fresh(build, device)
    before = bench.loaded_module_count()
    errors: list[float] = []
    ok = True
    with setting_config(setting, cpp_wrapper):
        # torch.compile reads compiled_autograd when it wraps the function,
        # which applies it to a backward() called inside.
        inside = setting == "compiled_autograd"
        compiled = torch.compile(
            functools.partial(loss_and_backward, compiled_fn)
            if inside
            else compiled_fn,
            dynamic=True if setting == "dynamic" else None,
        )
        if setting in BACKWARD_SETTINGS:
            loss = loss_and_backward(eager_fn, *args)
            started = time.perf_counter()
            compiled_loss = (
                compiled(*compiled_args)
                if inside
                else loss_and_backward(compiled, *compiled_args)
            )
            case.compile_s = time.perf_counter() - started
            same, err = bench.compare(compiled_loss, loss, rtol=TOL, atol=TOL)
            ok, errors = ok and same, [err]
            pairs = list(
                zip(
                    module_of(eager_fn).parameters(),
                    module_of(compiled_fn).parameters(),
                    strict=True,
                )
            )
            if any((p.grad is None) != (q.grad is None) for p, q in pairs):
                ok = False
            grads = [(q.grad, p.grad) for p, q in pairs if p.grad is not None]
            # Relative to the model's largest gradient: one that is zero in
            # exact arithmetic (a key projection's bias, which softmax
            # cancels) is rounding noise on both sides.
            scale = max((g.abs().max().item() for _, g in grads), default=1.0)
            for actual, expected in grads:
                same, err = bench.compare(
                    actual / scale, expected / scale, rtol=TOL, atol=TOL
                )
                ok, errors = ok and same, [*errors, err]
        else:
            calls = [(args, compiled_args)]
            if setting == "dynamic":
                calls.append((shorter(args), shorter(compiled_args)))
            with torch.no_grad():
                for eager_args, their_args in calls:
                    expected = eager_fn(*eager_args)
                    for _ in range(CALLS):
                        started = time.perf_counter()
                        actual = compiled(*their_args)
                        case.compile_s = case.compile_s or time.perf_counter() - started
                        same, err = bench.compare(actual, expected, rtol=TOL, atol=TOL)
                        ok, errors = ok and same, [*errors, err]
    kinds = [bench.wrapper_kind(m) for m in bench.new_compiled_modules(before)]
    case.graphs = kinds.count("torch_cppwrap")
    case.max_err = max(errors, default=0.0)
    if not ok:
        case.status, case.message = "mismatch", f"max error {case.max_err:.3g}"
    elif cpp_wrapper and (case.graphs == 0 or case.graphs != len(kinds)):
        case.status = "error"
        case.message = f"wrappers: {', '.join(kinds) or 'none'}"
    return case


def sweep(
    chosen: dict[str, Callable[[str], models.Built]],
    settings: list[str],
    device: str,
    done: Callable[[list[Case]], None],
) -> list[Case]:
    """Runs every case; `done` gets the cases so far after each, so that a run
    cut short (SIGINT: the device script's time limit) keeps what it did, and
    the case it was cut in is a row that says where."""
    import torch_cppwrap

    cases: list[Case] = []
    total = len(chosen) * len(settings)
    with torch_cppwrap.config.patch(strict=True):
        for name, build in chosen.items():
            for setting in settings:
                started = time.perf_counter()
                try:
                    case = run_case(name, build, setting, device)
                    if case.status == "mismatch":
                        python = run_case(
                            name, build, setting, device, cpp_wrapper=False
                        )
                        case.python_max_err = python.max_err
                        case.message += (
                            f"; the Python wrapper's {python.max_err:.3g}"
                            + (" (also a mismatch)" if python.status != "ok" else "")
                        )
                except KeyboardInterrupt:
                    where = traceback.format_exc(limit=-3).replace("\n", " ")
                    cases.append(
                        Case(name, setting, "error", message=f"cut: {where[-300:]}")
                    )
                    done(cases)
                    raise
                except Exception as e:  # one case's failure is its row
                    last = traceback.format_exception_only(e)[-1].strip()
                    case = Case(name, setting, "error", message=last[:300])
                cases.append(case)
                done(cases)
                bench.progress(
                    f"[{len(cases)}/{total}] {name} / {setting}: {case.status}"
                    f" ({case.graphs} graphs, max error {case.max_err:.2g},"
                    f" {time.perf_counter() - started:.0f} s)"
                    + (f": {case.message}" if case.message else "")
                )
    return cases


def report(cases: list[Case], device: str) -> str:
    import torch

    passed = sum(c.status == "ok" for c in cases)
    lines = [
        "# torch_cppwrap on real models",
        "",
        f"torch {torch.__version__}, device {device}; {passed} of {len(cases)} cases "
        f"compiled with our wrapper only and matched eager (tolerance {TOL}).",
        "",
        "| model | setting | result | our graphs | max error | first call s | note |",
        "|---|---|---|--:|--:|--:|---|",
    ]
    for c in cases:
        note = c.message.replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {c.model} | {c.setting} | {c.status} | {c.graphs} | {c.max_err:.2g} "
            f"| {c.compile_s:.1f} | {note} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--models", help="comma-separated (default: every one available)"
    )
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"comma-separated, from {','.join(SETTINGS)} (default: all)",
    )
    parser.add_argument("--out", type=Path, default=Path("sweep_results"))
    ns = parser.parse_args(argv)
    settings = ns.settings.split(",")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        parser.error(f"unknown settings: {', '.join(unknown)}")
    chosen = builders(ns.models.split(",") if ns.models else None)

    import torch_cppwrap  # noqa: F401  (patches Inductor)

    ns.out.mkdir(parents=True, exist_ok=True)

    def write(cases: list[Case]) -> None:
        (ns.out / "sweep.md").write_text(report(cases, ns.device))
        (ns.out / "sweep.json").write_text(
            json.dumps([dataclasses.asdict(c) for c in cases], indent=1)
        )

    cases = sweep(chosen, settings, ns.device, write)
    print(report(cases, ns.device))
    return 0 if all(c.status == "ok" for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
