"""Test-helper names newer PyTorch test files import and an older torch lacks.

The stored copies of PyTorch's test files track PyTorch's main branch, so
they import a few helpers from ``torch.testing._internal`` that the release
being measured (torch 2.11 on the GPU machine, for one) does not have yet.
Every one of them is a small skip decorator or a lookup; this module defines
the missing ones, each only where the installed torch lacks it, so the same
test files can be collected on every release the package claims.

Nothing here changes what a test does with a compiled graph; a helper whose
meaning is unclear on an older torch is defined to skip, never to pass.
``conformance_plugin`` calls :func:`install` at configure time, before the
test files are imported.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import unittest
from collections.abc import Callable
from typing import Any


def _gcc_major() -> int | None:
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    try:
        version = subprocess.run(
            [gcc, "-dumpversion"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    head = version.strip().split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _widest_float(device: Any) -> Any:
    import torch

    # MPS has no float64; every other device the tests run on does.
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def _widest_complex(device: Any) -> Any:
    import torch

    return torch.complex64 if torch.device(device).type == "mps" else torch.complex128


def _requires_mkl() -> Callable[[Any], Any]:
    import torch

    return unittest.skipUnless(torch.backends.mkl.is_available(), "requires MKL")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cpu_has_sve() -> bool:
    import torch

    # Only an AArch64 CPU has SVE; the flag gates ARM-only expectations.
    return torch.backends.cpu.get_cpu_capability().startswith("SVE")


def _xpu_and_triton() -> Callable[[Any], Any]:
    import torch
    from torch.utils._triton import has_triton

    present = hasattr(torch, "xpu") and torch.xpu.is_available() and has_triton()
    return unittest.skipUnless(present, "requires xpu and triton")


# module -> name -> a thunk that builds the missing helper.
_BACKFILL: dict[str, dict[str, Callable[[], Any]]] = {
    "torch.testing._internal.common_utils": {
        "get_gcc_major_version": lambda: _gcc_major,
        "IS_CPU_EXT_SVE_SUPPORTED": _cpu_has_sve,
        "requires_mkl": _requires_mkl,
    },
    "torch.testing._internal.common_dtype": {
        "highest_precision_float": lambda: _widest_float,
        "highest_precision_complex": lambda: _widest_complex,
    },
    "torch.testing._internal.inductor_utils": {
        "HAS_CUDA": _has_cuda,
    },
    "torch.testing._internal.triton_utils": {
        "requires_xpu_and_triton": _xpu_and_triton,
    },
}


def install() -> list[str]:
    """Define each missing helper; return the names defined."""
    added = []
    for module_name, names in _BACKFILL.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, build in names.items():
            if not hasattr(module, name):
                setattr(module, name, build())
                added.append(f"{module_name}.{name}")
    return added
