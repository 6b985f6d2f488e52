"""Which C-shim functions the installed libtorch declares.

Generated code calls a shim function only after checking it here, so a kernel
name that the shim lacks becomes a dispatcher call instead of a C++ compile
error.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

# The headers declaring each device's shim functions; "cpu" also lists the
# device-generic ones, which every device has.
_SHIM_HEADERS: dict[str, tuple[str, ...]] = {
    "cpu": (
        "torch/csrc/inductor/aoti_torch/c/shim.h",
        "torch/csrc/inductor/aoti_torch/c/shim_cpu.h",
        "torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h",
    ),
    "cuda": ("torch/csrc/inductor/aoti_torch/generated/c_shim_cuda.h",),
}
_DECLARATION = re.compile(r"AOTITorchError\s+(aoti_torch_\w+)\s*\(")


@functools.cache
def declared_shim_functions(device: str = "cpu") -> frozenset[str]:
    include = Path(torch.__file__).resolve().parent / "include"
    names: set[str] = set()
    for header in _SHIM_HEADERS[device]:
        path = include / header
        if path.exists():
            names.update(_DECLARATION.findall(path.read_text()))
    return frozenset(names)


def shim_function_exists(name: str, device: str = "cpu") -> bool:
    """Whether `name` is a shim function that `device` can call: its own or a
    device-generic one."""
    return name in declared_shim_functions(device) or name in declared_shim_functions()
