"""Spelling an op argument for a C-shim call.

The C shim flattens the schema: a list becomes (pointer, length), an optional
becomes a pointer (null for None), a bool an int32_t, a Device the pair
(device_type, device_index).  Inductor asks for each argument through
``wrapper.val_to_arg_str(value, type)``; this module answers, from the
argument's kind (arg_kinds.py).
"""

from __future__ import annotations

from typing import Any

import torch

from torch_cppwrap._inductor.codegen import arg_kinds
from torch_cppwrap._inductor.codegen.arg_kinds import ShimHandle, SizeVar, is_list_type


def shim_argument(sizevar: SizeVar, val: Any, type_: Any = None) -> str:
    values = shim_values(sizevar, val, type_)
    # One value is returned as it is: a tensor's stays a ShimHandle.
    return values[0] if len(values) == 1 else ", ".join(values)


def shim_values(sizevar: SizeVar, val: Any, type_: Any = None) -> tuple[str, ...]:
    """The C arguments one op argument becomes."""
    if isinstance(type_, torch.OptionalType):
        return _optional(sizevar, val, type_.getElementType())
    if val is None:
        if isinstance(type_, torch.TensorType):
            return (ShimHandle("cppwrap::undefined_tensor().get()"),)
        return ("nullptr",)
    if is_list_type(type_):
        if not isinstance(val, (list, tuple)):
            raise NotImplementedError(
                f"torch_cppwrap: {val!r} is not a list for {type_}"
            )
        return _array(sizevar, list(val), type_.getElementType())
    if type_ is None and isinstance(val, (list, tuple)):
        # Untyped lists (no schema): lists of ints.
        return _array(sizevar, list(val), torch.IntType.get())
    return _kind(type_, val).shim_args(sizevar, val)


def element_ctype(type_: Any, sample: Any = None) -> str:
    """The C type of one element of a shim list argument."""
    if isinstance(type_, torch.OptionalType):
        inner = _kind(type_.getElementType(), sample)
        # The C shim takes a list of optionals as pointers to const values:
        # `const AtenTensorHandle**`, `const double**` (mkldnn's
        # unary_scalars).
        const = "" if inner.ctype.startswith("const ") else "const "
        return f"{const}{inner.ctype}*"
    return _kind(type_, sample).ctype


def _kind(type_: Any, val: Any) -> arg_kinds.ArgKind:
    kind = arg_kinds.kind_of(type_, val)
    if kind is None:
        raise NotImplementedError(
            f"torch_cppwrap: argument {val!r} ({type_}) is not supported by the C shim"
        )
    return kind


def _array(sizevar: SizeVar, values: list[Any], element: Any) -> tuple[str, str]:
    if not values:
        return ("nullptr", "0")
    items = ", ".join(shim_argument(sizevar, v, element) for v in values)
    ctype = element_ctype(element, values[0])
    return f"cppwrap::array_of<{ctype}>({items}).data()", str(len(values))


def _optional(sizevar: SizeVar, val: Any, inner: Any) -> tuple[str, ...]:
    """A pointer to the value (null for None), and the length or device index
    that follows it where the C shim takes one."""
    if val is None:
        if is_list_type(inner) or arg_kinds.schema_kind(inner) is arg_kinds.DEVICE:
            return ("nullptr", "0")
        return ("nullptr",)
    first, *rest = shim_values(sizevar, val, inner)
    if is_list_type(inner) or _kind(inner, val) is arg_kinds.TENSOR:
        return (f"cppwrap::address_of({first})", *rest)
    # static_cast: a functional cast cannot name `const char*`.
    ctype = element_ctype(inner, val)
    return (f"cppwrap::address_of(static_cast<{ctype}>({first}))", *rest)
