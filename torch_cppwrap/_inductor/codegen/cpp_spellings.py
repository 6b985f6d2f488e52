"""How values are spelled in the C++ that torch_cppwrap generates.

Data, not logic: each table maps a torch value to the C++ text that names it,
and each helper turns one Python value into one C++ literal.  The wrapper
codegen (cpp_wrapper_cpu.py) composes these; a device backend that spells
something differently overrides only that entry.
"""

from __future__ import annotations

import json
import math
import re

import torch

DTYPE_CODE: dict[torch.dtype, str] = {
    torch.uint8: "cppwrap::dtype::kUInt8",
    torch.int8: "cppwrap::dtype::kInt8",
    torch.int16: "cppwrap::dtype::kInt16",
    torch.int32: "cppwrap::dtype::kInt32",
    torch.int64: "cppwrap::dtype::kInt64",
    torch.float16: "cppwrap::dtype::kFloat16",
    torch.float32: "cppwrap::dtype::kFloat32",
    torch.float64: "cppwrap::dtype::kFloat64",
    torch.complex32: "cppwrap::dtype::kComplex32",
    torch.complex64: "cppwrap::dtype::kComplex64",
    torch.complex128: "cppwrap::dtype::kComplex128",
    torch.bool: "cppwrap::dtype::kBool",
    torch.bfloat16: "cppwrap::dtype::kBFloat16",
    torch.float8_e5m2: "cppwrap::dtype::kFloat8_e5m2",
    torch.float8_e4m3fn: "cppwrap::dtype::kFloat8_e4m3fn",
    torch.float8_e5m2fnuz: "cppwrap::dtype::kFloat8_e5m2fnuz",
    torch.float8_e4m3fnuz: "cppwrap::dtype::kFloat8_e4m3fnuz",
    torch.uint16: "cppwrap::dtype::kUInt16",
    torch.uint32: "cppwrap::dtype::kUInt32",
    torch.uint64: "cppwrap::dtype::kUInt64",
}

DEVICE_TYPE: dict[str, str] = {
    "cpu": "cppwrap::device::kCPU",
    "cuda": "cppwrap::device::kCUDA",
    "meta": "cppwrap::device::kMeta",
}

LAYOUT_CODE: dict[torch.layout, str] = {
    torch.strided: "cppwrap::layout::kStrided",
}

MEMORY_FORMAT_CODE: dict[torch.memory_format, str] = {
    torch.contiguous_format: "cppwrap::memory_format::kContiguous",
    torch.preserve_format: "cppwrap::memory_format::kPreserve",
    torch.channels_last: "cppwrap::memory_format::kChannelsLast",
    torch.channels_last_3d: "cppwrap::memory_format::kChannelsLast3d",
}


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return DTYPE_CODE[dtype]
    except KeyError:
        raise NotImplementedError(
            f"torch_cppwrap: dtype {dtype} is not supported by the C++ wrapper"
        ) from None


def device_pair(device: torch.device) -> tuple[str, str]:
    """The (device_type, device_index) arguments of a shim or runtime call."""
    try:
        kind = DEVICE_TYPE[device.type]
    except KeyError:
        raise NotImplementedError(
            f"torch_cppwrap: device type {device.type!r} is not supported"
        ) from None
    return kind, str(device.index or 0)


def device_args(device: torch.device) -> str:
    return ", ".join(device_pair(device))


def int_literal(value: int) -> str:
    if value == -(2**63):
        return "INT64_MIN"
    if -(2**31) <= value < 2**31:
        return str(value)
    return f"{value}LL"


def float_literal(value: float) -> str:
    if math.isnan(value):
        return "std::numeric_limits<double>::quiet_NaN()"
    if math.isinf(value):
        sign = "-" if value < 0 else ""
        return f"{sign}std::numeric_limits<double>::infinity()"
    text = repr(float(value))
    return text if ("." in text or "e" in text) else f"{text}.0"


def bool_literal(value: bool) -> str:
    return "true" if value else "false"


def string_literal(value: str) -> str:
    # JSON string escapes are valid C++ escapes for the characters it emits.
    return json.dumps(value)


# Inductor names an op in its checks' messages by the op's FX target, and the
# target of an op a pattern put in (freezing's fused convolutions,
# quantization's qconv and qlinear) is a functools.partial whose repr holds
# its function's address: spelled as is, the source, and so the key of the
# library built from it, would differ from one process to the next.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def op_label(op_name: str) -> str:
    """The literal naming an op in a check's message, alike in every process."""
    return string_literal(_ADDRESS.sub("", op_name))


def initializer_list(items: list[str]) -> str:
    return "{" + ", ".join(items) + "}"
