"""PT2E int8 models through torch_cppwrap's CPU wrapper, against Inductor's
Python wrapper and upstream's cpp_wrapper.

    pip install --no-deps torchao==0.18.0
    python benchmarks/int8_sweep.py --out int8_results

The recipe of PyTorch's "PT2E quantization with X86 backend through Inductor"
tutorial: each model is exported, annotated by torchao's
``X86InductorQuantizer`` (static or dynamic quantization), calibrated on its
example inputs, converted, and compiled with ``freezing`` on, so that
Inductor lowers the quantize/dequantize pairs to oneDNN's qconv and qlinear
(with their unary and binary post-ops), in fp32 and under a bfloat16
autocast (int8-mixed-bf16), with static and dynamic shapes.  Each case runs
through the three wrappers in one process, ours strict (a fallback fails
the case), every call on fresh copies of the inputs (a qlinear whose ``sum``
post-op accumulates into a graph input writes into it, with every wrapper),
and compares ours and upstream's results with the Python wrapper's.  Writes
``int8_sweep.md`` and ``int8_sweep.json`` under ``--out``.  Not part of the
package; needs torchao.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import pathlib
import time
from collections.abc import Callable

import torch
import torch._inductor.config as inductor_config
from torch._inductor.utils import run_and_get_code

import torch_cppwrap

MODES = ("python", "ours", "upstream")


class SmallCnn(torch.nn.Module):
    """Convolutions with BatchNorm, a residual add before ReLU (qconv's binary
    post-op), hardtanh, max-pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.conv2 = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.conv3 = torch.nn.Conv2d(16, 16, 1)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv1(x)))
        y = torch.relu(self.conv2(y) + y)
        y = torch.nn.functional.hardtanh(self.conv3(y), 0.0, 6.0)
        y = torch.nn.functional.max_pool2d(y, 2)
        return self.head(y.mean((2, 3)))


class SmallMlp(torch.nn.Module):
    """Linears with GELU, an add of another input (qlinear's binary post-op),
    a linear without bias, and two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64)
        self.out = torch.nn.Linear(64, 64, bias=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.down(torch.nn.functional.gelu(self.up(x))) + residual
        return torch.relu(self.out(y)), y.sum(-1)


def _channels_last_cnn() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    model = SmallCnn().to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return model, (x,)


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]] = {
    "cnn": lambda: (SmallCnn(), (torch.randn(2, 3, 32, 32),)),
    "cnn_channels_last": _channels_last_cnn,
    "mlp_3d": lambda: (SmallMlp(), (torch.randn(4, 8, 64), torch.randn(4, 8, 64))),
    "mlp_2d": lambda: (SmallMlp(), (torch.randn(16, 64), torch.randn(16, 64))),
}


def quantize(
    model: torch.nn.Module, args: tuple[torch.Tensor, ...], dynamic: bool
) -> torch.nn.Module:
    from torchao.quantization.pt2e import quantize_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(
        xiq.get_default_x86_inductor_quantization_config(is_dynamic=dynamic)
    )
    with torch.no_grad():
        exported = torch.export.export(model.eval(), args).module()
        prepared = quantize_pt2e.prepare_pt2e(exported, quantizer)
        prepared(*args)
        return quantize_pt2e.convert_pt2e(prepared)


def _fresh(args: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [a.clone() for a in args]


def _flat(result: object) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]  # type: ignore[list-item]


def compile_and_run(
    mode: str,
    model: torch.nn.Module,
    args: tuple[torch.Tensor, ...],
    bf16: bool,
    dynamic_shapes: bool,
) -> tuple[list[torch.Tensor], str, float]:
    """The first call's outputs, the wrapper's module source, seconds to compile."""
    torch._dynamo.reset()
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if bf16
        else contextlib.nullcontext()
    )
    upstream = mode == "upstream"
    if upstream:
        torch_cppwrap.unpatch()
    try:
        with (
            torch.no_grad(),
            autocast,
            inductor_config.patch(
                freezing=True, cpp_wrapper=mode != "python", fx_graph_cache=False
            ),
            torch_cppwrap.config.patch(strict=True),
        ):
            compiled = torch.compile(model, dynamic=dynamic_shapes)
            start = time.perf_counter()
            result, sources = run_and_get_code(compiled, *_fresh(args))
            seconds = time.perf_counter() - start
    finally:
        if upstream:
            torch_cppwrap.patch()
    return [t.float() for t in _flat(result)], "\n".join(sources), seconds


def run_case(
    name: str, dynamic_quant: bool, bf16: bool, dynamic_shapes: bool
) -> dict[str, object]:
    torch.manual_seed(0)
    model, args = MODELS[name]()
    row: dict[str, object] = {
        "model": name,
        "quantization": "dynamic" if dynamic_quant else "static",
        "dtype": "int8-mixed-bf16" if bf16 else "int8-mixed-fp32",
        "shapes": "dynamic" if dynamic_shapes else "static",
    }
    try:
        quantized = quantize(model, args, dynamic_quant)
    except Exception as error:
        row["error"] = f"quantizing: {type(error).__name__}: {error}"
        return row
    reference: list[torch.Tensor] | None = None
    for mode in MODES:
        try:
            outputs, source, seconds = compile_and_run(
                mode, quantized, args, bf16, dynamic_shapes
            )
        except Exception as error:
            row[mode] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            if mode == "python":
                break
            continue
        entry: dict[str, object] = {"compile_s": round(seconds, 2)}
        if reference is None:
            reference = outputs
        else:
            entry["max_diff_vs_python"] = max(
                (a - b).abs().max().item()
                for a, b in zip(outputs, reference, strict=True)
            )
        if mode == "ours":
            entry["our_wrapper"] = "torch_cppwrap" in source
            entry["onednn_ops"] = sorted(
                {op for op in ("qconv", "qlinear") if f"aoti_torch_cpu__{op}" in source}
            )
        row[mode] = entry
    return row


def _cell(entry: object) -> str:
    if not isinstance(entry, dict):
        return "-"
    if "error" in entry:
        return f"error: {entry['error'][:80]}"
    diff = entry.get("max_diff_vs_python")
    text = f"{entry['compile_s']} s" + ("" if diff is None else f", diff {diff:.1e}")
    if "our_wrapper" in entry:
        ops = "+".join(entry["onednn_ops"]) or "no oneDNN op"
        text += f", {'ours' if entry['our_wrapper'] else 'NOT ours'}, {ops}"
    return text


def write_report(rows: list[dict[str, object]], out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "int8_sweep.json").write_text(json.dumps(rows, indent=1))
    lines = [
        f"torch {torch.__version__}; compile seconds (first call) and the largest "
        "difference from the Python wrapper's outputs",
        "",
        "| model | quantization | dtype | shapes | Python | ours (strict) | upstream |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            cells = [str(row["error"])[:100], "", ""]
        else:
            cells = [_cell(row.get(mode)) for mode in MODES]
        lines.append(
            f"| {row['model']} | {row['quantization']} | {row['dtype']} | "
            f"{row['shapes']} | " + " | ".join(cells) + " |"
        )
    (out / "int8_sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("int8_results")
    )
    options = parser.parse_args()
    rows = []
    for name, dynamic_quant, bf16, dynamic_shapes in itertools.product(
        options.models.split(","), (False, True), (False, True), (False, True)
    ):
        row = run_case(name, dynamic_quant, bf16, dynamic_shapes)
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_report(rows, options.out)


if __name__ == "__main__":
    main()
