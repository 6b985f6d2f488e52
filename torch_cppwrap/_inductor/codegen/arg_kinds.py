"""The kinds of op arguments, and what generated C++ needs to pass each.

An argument's kind follows from its schema type (``arg.real_type``) or, where
the schema says ``Scalar``, ``Any`` or nothing, from the value Inductor passes.
Each kind is one row of data: the C type a C-shim function takes one value as,
the ``cppwrap::BoxedCall`` methods that push one value or a list of values
onto a dispatcher call, and how a value is spelled for each.  ``shim_args``
(C-shim calls) and ``boxed_args`` (dispatcher calls) compose these rows for
optionals and lists; neither tests types itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import sympy
import torch
from torch._inductor import ir
from torch._inductor.codegen.cpp_utils import cexpr

from torch_cppwrap._inductor.codegen import cpp_spellings as spell

# How the wrapper spells a size expression (CppWrapperCpu.codegen_sizevar).
SizeVar = Callable[[sympy.Expr], str]
# A value as C++ arguments: one expression, or two for a Device.
Spelling = Callable[[SizeVar, Any], tuple[str, ...]]


class ShimHandle(str):
    """C++ text of an AtenTensorHandle (`buf0.get()`), as a tensor argument
    is spelled for the C shim: a hook given Inductor's spelled arguments tells
    a handle from a cppwrap::Tensor by this type."""


def literal(sizevar: SizeVar, val: Any) -> str:
    """A Python scalar, symbolic value or torch enum as a C++ literal."""
    if isinstance(val, bool):
        return "1" if val else "0"
    if isinstance(val, int):
        return spell.int_literal(val)
    if isinstance(val, float):
        return spell.float_literal(val)
    if isinstance(val, str):
        return spell.string_literal(val)
    if isinstance(val, torch.dtype):
        return spell.dtype_code(val)
    if isinstance(val, torch.device):
        return spell.device_args(val)
    if isinstance(val, torch.layout):
        return spell.LAYOUT_CODE[val]
    if isinstance(val, torch.memory_format):
        return spell.MEMORY_FORMAT_CODE[val]
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return cexpr(val.node.expr)
    if isinstance(val, sympy.Expr):
        return sizevar(val)
    raise NotImplementedError(
        f"torch_cppwrap: argument {val!r} of type {type(val).__name__} is not supported"
    )


def tensor_ref(val: Any) -> str:
    """The C++ expression of a cppwrap::Tensor for an IR tensor value."""
    if isinstance(val, ir.IRNode):
        return val.codegen_reference()
    return repr(val)  # a pre-rendered reference


def is_scalar_value(val: Any) -> bool:
    """A number (Python or symbolic) standing where the schema has a Tensor."""
    return isinstance(
        val, (bool, int, float, complex, sympy.Expr, torch.SymInt, torch.SymFloat)
    ) and not isinstance(val, ir.IRNode)


def scalar_tensor(sizevar: SizeVar, val: Any) -> str:
    """A 0-d tensor holding a number passed for a Tensor argument."""
    if isinstance(val, complex):
        real, imag = spell.float_literal(val.real), spell.float_literal(val.imag)
        return f"cppwrap::scalar_to_tensor_complex({real}, {imag})"
    if isinstance(val, (torch.SymInt, torch.SymFloat)):
        val = val.node.expr
    floating = isinstance(val, float) or (
        isinstance(val, sympy.Expr) and not val.is_integer
    )
    cast = "double" if floating else "int64_t"
    return f"cppwrap::scalar_to_tensor({cast}({literal(sizevar, val)}))"


def tensor_value(sizevar: SizeVar, val: Any) -> str:
    """The cppwrap::Tensor passed for a Tensor argument."""
    if is_scalar_value(val):
        return scalar_tensor(sizevar, val)
    return tensor_ref(val)


# ----------------------------------------------------------------------
# how a value of each kind is spelled
# ----------------------------------------------------------------------


def _literal(sizevar: SizeVar, val: Any) -> tuple[str, ...]:
    return (literal(sizevar, val),)


def _tensor(sizevar: SizeVar, val: Any) -> tuple[str, ...]:
    return (tensor_value(sizevar, val),)


def _tensor_handle(sizevar: SizeVar, val: Any) -> tuple[str, ...]:
    return (ShimHandle(f"{tensor_value(sizevar, val)}.get()"),)


def _real(sizevar: SizeVar, val: Any) -> tuple[str, ...]:
    return (literal(sizevar, float(val) if isinstance(val, int) else val),)


def _boolean(sizevar: SizeVar, val: Any) -> tuple[str, ...]:
    return (spell.bool_literal(bool(val)),)


def _complex(sizevar: SizeVar, val: Any) -> tuple[str, ...]:
    return (spell.float_literal(val.real), spell.float_literal(val.imag))


def _no_shim_complex(sizevar: SizeVar, val: Any) -> tuple[str, ...]:
    raise NotImplementedError(
        "torch_cppwrap: complex scalar arguments are not supported by the C shim"
    )


def _device(sizevar: SizeVar, val: Any) -> tuple[str, ...]:
    return spell.device_pair(torch.device(val))  # a Device may come as "cuda:0"


@dataclasses.dataclass(frozen=True)
class ArgKind:
    """One kind of op argument and what generated C++ needs to pass it."""

    name: str
    # The C type a C-shim function takes one value as, which is also a
    # list's element type; a Device's first value (its type) for a Device.
    ctype: str
    # The cppwrap::BoxedCall methods that push one value and a list of values
    # (None: a dispatcher call cannot take a list of this kind).
    push: str
    list_push: str | None = None
    # A value as the C shim's arguments, and as the push's.
    shim_args: Spelling = _literal
    push_args: Spelling = _literal


TENSOR = ArgKind(
    "Tensor",
    "AtenTensorHandle",
    "tensor",
    "tensor_list",
    shim_args=_tensor_handle,
    push_args=_tensor,
)
INT = ArgKind("int", "int64_t", "integer", "int_list")
FLOAT = ArgKind("float", "double", "real", "real_list", _real, _real)
BOOL = ArgKind("bool", "int32_t", "boolean", "bool_list", push_args=_boolean)
# A Scalar holding an integer: the dispatcher gets an int, the C shim (which
# takes every Scalar as a double) a double.
SCALAR = ArgKind("Scalar", "double", "integer")
COMPLEX = ArgKind("complex", "double", "complex", None, _no_shim_complex, _complex)
STRING = ArgKind("str", "const char*", "string")
DTYPE = ArgKind("ScalarType", "int32_t", "dtype")
LAYOUT = ArgKind("Layout", "int32_t", "layout")
MEMORY_FORMAT = ArgKind("MemoryFormat", "int32_t", "memory_format")
DEVICE = ArgKind("Device", "int32_t", "device", None, _device, _device)

# By schema type: the JIT's name for the type's kind (`type_.kind()`), which
# also names the enum types that have no Python class of their own.
BY_SCHEMA_TYPE: dict[str, ArgKind] = {
    "TensorType": TENSOR,
    "IntType": INT,
    "SymIntType": INT,
    "FloatType": FLOAT,
    "BoolType": BOOL,
    "SymBoolType": BOOL,
    "StringType": STRING,
    "ScalarTypeType": DTYPE,
    "LayoutType": LAYOUT,
    "MemoryFormatType": MEMORY_FORMAT,
    "DeviceObjType": DEVICE,
}

# By value, where the schema says Any or nothing (a collective's
# `Any group_name` holds the group's name, a str).
BY_VALUE_TYPE: dict[type, ArgKind] = {
    bool: BOOL,
    int: INT,
    float: FLOAT,
    complex: COMPLEX,
    str: STRING,
    torch.dtype: DTYPE,
    torch.layout: LAYOUT,
    torch.memory_format: MEMORY_FORMAT,
    torch.device: DEVICE,
    torch.SymInt: INT,
    torch.SymFloat: FLOAT,
    torch.SymBool: BOOL,
}

# A Scalar by its value; any other number is an integer.
_SCALAR_BY_VALUE_TYPE: dict[type, ArgKind] = {
    bool: BOOL,
    float: FLOAT,
    complex: COMPLEX,
}


def _by_class(table: dict[type, ArgKind], val: Any) -> ArgKind | None:
    # The most derived class first: a bool is also an int.
    return next((table[c] for c in type(val).__mro__ if c in table), None)


def schema_kind(type_: Any) -> ArgKind | None:
    """The kind a schema type settles by itself, if it does."""
    return None if type_ is None else BY_SCHEMA_TYPE.get(type_.kind())


def kind_of(type_: Any, val: Any) -> ArgKind | None:
    """The kind of an argument that is neither a list nor optional, or None
    when neither its schema type nor its value says."""
    if kind := schema_kind(type_):
        return kind
    if isinstance(val, ir.TorchBindObject) or (
        type_ is not None and type_.kind() == "ClassType"
    ):
        # A script object is not a tensor, though its IR node is an IRNode;
        # the graph falls back to the Python wrapper, which passes it.
        raise NotImplementedError(
            f"torch_cppwrap: TorchBind object arguments ({type_ or type(val).__name__}) "
            "are not supported"
        )
    if isinstance(type_, torch.NumberType):
        return _by_class(_SCALAR_BY_VALUE_TYPE, val) or SCALAR
    if isinstance(val, ir.IRNode):
        return TENSOR
    if isinstance(val, sympy.Expr):
        return INT
    return _by_class(BY_VALUE_TYPE, val)


def is_list_type(type_: Any) -> bool:
    return isinstance(type_, (torch.ListType, torch.TupleType))
