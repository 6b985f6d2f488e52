"""Spelling an op argument for a C-shim call, by its schema type.

The C shim flattens the schema: a list becomes (pointer, length), an optional
becomes a pointer (null for None), a bool an int32_t, a Device the pair
(device_type, device_index).  Inductor asks for each argument through
``wrapper.val_to_arg_str(value, type)``; this module answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import sympy
import torch
from torch._inductor import ir
from torch._inductor.codegen.cpp_utils import cexpr

from torch_cppwrap._inductor.codegen import cpp_spellings as spell

if TYPE_CHECKING:
    from torch_cppwrap._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu


def _is_tensor_value(val: Any) -> bool:
    return isinstance(val, ir.IRNode) or type(val).__name__ == "Shim"


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


def scalar_tensor(wrapper: CppWrapperCpu, val: Any) -> str:
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
    return f"cppwrap::scalar_to_tensor({cast}({scalar(wrapper, val)}))"


def element_ctype(type_: Any, sample: Any = None) -> str:
    """The C type of one element of a shim list argument."""
    if isinstance(type_, torch.OptionalType):
        inner = type_.getElementType()
        if isinstance(inner, torch.TensorType):
            return "const AtenTensorHandle*"
        return f"{element_ctype(inner, sample)}*"
    if isinstance(type_, torch.TensorType):
        return "AtenTensorHandle"
    if isinstance(type_, (torch.IntType, torch.SymIntType)):
        return "int64_t"
    if isinstance(type_, torch.FloatType):
        return "double"
    if isinstance(type_, (torch.BoolType, torch.SymBoolType)):
        return "int32_t"
    if isinstance(type_, torch.NumberType):
        return "int32_t" if isinstance(sample, bool) else "double"
    if isinstance(type_, torch.StringType):
        return "const char*"
    if repr(type_) in ("ScalarType", "Layout", "MemoryFormat"):
        return "int32_t"
    if sample is not None:
        if isinstance(sample, bool):
            return "int32_t"
        if isinstance(sample, (int, sympy.Expr)):
            return "int64_t"
        if isinstance(sample, float):
            return "double"
    raise NotImplementedError(f"torch_cppwrap: no C type for schema type {type_}")


def scalar(wrapper: CppWrapperCpu, val: Any) -> str:
    """A Python scalar, sympy expression or torch enum as a C++ literal."""
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
        return wrapper.codegen_sizevar(val)
    if isinstance(val, complex):
        raise NotImplementedError(
            "torch_cppwrap: complex scalar arguments are not supported by the C shim"
        )
    raise NotImplementedError(
        f"torch_cppwrap: argument {val!r} of type {type(val).__name__} is not supported"
    )


def shim_argument(wrapper: CppWrapperCpu, val: Any, type_: Any = None) -> str:
    if val is None:
        if isinstance(type_, torch.TensorType):
            return "cppwrap::undefined_tensor().get()"
        inner = (
            type_.getElementType() if isinstance(type_, torch.OptionalType) else None
        )
        if isinstance(inner, (torch.DeviceObjType, torch.ListType, torch.TupleType)):
            return "nullptr, 0"
        return "nullptr"

    if isinstance(type_, torch.OptionalType):
        inner = type_.getElementType()
        text = shim_argument(wrapper, val, inner)
        if isinstance(inner, (torch.ListType, torch.TupleType, torch.DeviceObjType)):
            main, length = text.rsplit(", ", maxsplit=1)
            if isinstance(inner, torch.DeviceObjType):
                main = f"int32_t({main})"
            return f"cppwrap::address_of({main}), {length}"
        if isinstance(inner, torch.TensorType):
            return f"cppwrap::address_of({text})"
        # static_cast: a functional cast cannot name `const char*`.
        return f"cppwrap::address_of(static_cast<{element_ctype(inner, val)}>({text}))"

    if isinstance(type_, (torch.ListType, torch.TupleType)):
        if not isinstance(val, (list, tuple)):
            raise NotImplementedError(
                f"torch_cppwrap: {val!r} is not a list for {type_}"
            )
        if len(val) == 0:
            return "nullptr, 0"
        element = type_.getElementType()
        items = [shim_argument(wrapper, v, element) for v in val]
        ctype = element_ctype(element, val[0])
        return f"cppwrap::array_of<{ctype}>({', '.join(items)}).data(), {len(val)}"

    if isinstance(type_, torch.TensorType) or (type_ is None and _is_tensor_value(val)):
        if is_scalar_value(val):
            return f"{scalar_tensor(wrapper, val)}.get()"
        return f"{tensor_ref(val)}.get()"

    if isinstance(val, (list, tuple)):
        # Untyped lists (no schema): lists of ints.
        items = [scalar(wrapper, v) for v in val]
        if not items:
            return "nullptr, 0"
        return f"cppwrap::array_of<int64_t>({', '.join(items)}).data(), {len(items)}"
    return scalar(wrapper, val)
