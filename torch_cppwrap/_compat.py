"""Every difference between the torch releases we support, in one place.

Each helper is named for what it provides, not for the version that needs it,
so the rest of the package reads the same on torch 2.11 through 2.15.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

# Inclusive lower bound, exclusive upper bound; mirrors pyproject.toml.
SUPPORTED_TORCH = ((2, 11), (2, 16))


def torch_version_tuple(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.13.0+cpu'."""
    match = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    if match is None:
        return (0, 0)
    return (int(match.group(1)), int(match.group(2)))


def torch_is_supported(version: str | None = None) -> bool:
    low, high = SUPPORTED_TORCH
    return low <= torch_version_tuple(version) < high


def supported_range_text() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TORCH
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


@functools.cache
def c_shim_fallback_ops() -> frozenset[str]:
    """Names ('aten.addmm.out', ...) of the ops that libtorch's generated C shim
    covers for every device."""
    try:
        from torchgen.aoti.fallback_ops import inductor_fallback_ops
    except ImportError:  # pragma: no cover - torchgen ships with every wheel
        return frozenset()
    return frozenset(inductor_fallback_ops)


def c_shim_function_name(op: torch._ops.OpOverload, device: str) -> str | None:
    """The generated C-shim function for `op`, or None if the shim lacks it."""
    name = str(op)
    if op.namespace != "aten" or name not in c_shim_fallback_ops():
        return None
    base = op.__name__.split(".")[0]
    overload = op._overloadname
    suffix = base if overload == "default" else f"{base}_{overload}"
    versioned = _versioned_c_shim_ops().get(name)
    if versioned:
        suffix = f"{suffix}_{versioned}"
    return f"aoti_torch_{device}_{suffix}"


@functools.cache
def _versioned_c_shim_ops() -> dict[str, str]:
    """Ops whose shim gained a newer signature ('_v2', ...) in this release."""
    try:
        from torchgen.aoti import fallback_ops
    except ImportError:  # pragma: no cover
        return {}
    table: Any = getattr(fallback_ops, "inductor_fallback_ops", {})
    if not isinstance(table, dict):
        return {}
    result: dict[str, str] = {}
    for name, info in table.items():
        versions = [k for k in (info or {}) if re.fullmatch(r"v\d+", str(k))]
        if versions:
            result[name] = max(versions, key=lambda v: int(v[1:]))
    return result


def build_options(**kwargs: Any) -> Any:
    """Inductor's cpp_builder options for a CPU build; the class and its keyword
    arguments have moved between releases."""
    from torch._inductor import cpp_builder

    options_cls = getattr(cpp_builder, "CppTorchDeviceOptions", None)
    if options_cls is None:  # pragma: no cover - older layouts
        options_cls = cpp_builder.CppTorchOptions
        kwargs.pop("device_type", None)
    return options_cls(**kwargs)


def pick_vec_isa() -> Any:
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa as pick
    except ImportError:  # pragma: no cover
        from torch._inductor.codecache import pick_vec_isa as pick  # type: ignore
    return pick()


def inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


@functools.cache
def object_input_types() -> tuple[type, ...]:
    """Inductor's IR classes for graph inputs that are Python objects rather
    than tensors (script objects; opaque values such as a process group, which
    only newer releases name apart)."""
    from torch._inductor import ir

    names = ("TorchBindObject", "OpaqueObjectState")
    return tuple(getattr(ir, name) for name in names if hasattr(ir, name))


class _DeviceOpsWithSync:
    """A graph's device op overrides whose ``synchronize()`` is a line of the
    C++ wrapper; everything else is theirs."""

    def __init__(self, ops: Any, sync_line: str) -> None:
        self._ops = ops
        self._sync_line = sync_line

    def synchronize(self) -> str:
        return self._sync_line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)


def route_debug_sync(graph: Any, sync_line: str) -> None:
    """Makes Inductor's debug synchronisation (``triton.debug_sync_graph``,
    ``triton.debug_sync_kernel``) write `sync_line` into `graph`'s wrapper.
    torch 2.15 asks the wrapper for it (``generate_debug_sync``); before it,
    Inductor writes the device op overrides' ``synchronize()``, a line of
    Python, into any wrapper."""
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    if not hasattr(PythonWrapperCodegen, "generate_debug_sync"):
        graph.device_ops = _DeviceOpsWithSync(graph.device_ops, sync_line)
