"""Spelling an op argument for a call through the dispatcher.

Ops without a C shim (custom ops, a few aten ops) are called boxed: the
generated code pushes each argument onto a cppwrap::BoxedCall by schema type,
`.tensor(buf0).integer(2).run()`, and reads the results back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from torch_cppwrap._inductor.codegen import cpp_spellings as spell
from torch_cppwrap._inductor.codegen import shim_args

if TYPE_CHECKING:
    from torch_cppwrap._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu


def _list_push(wrapper: CppWrapperCpu, values: list[Any], element: Any) -> str:
    if isinstance(element, torch.OptionalType) and isinstance(
        element.getElementType(), torch.TensorType
    ):
        items = [
            "nullptr"
            if v is None
            else f"cppwrap::address_of({shim_args.tensor_ref(v)})"
            for v in values
        ]
        return f".tensor_list(cppwrap::array_of<const cppwrap::Tensor*>({', '.join(items)}), true)"
    if isinstance(element, torch.TensorType):
        items = [f"cppwrap::address_of({shim_args.tensor_ref(v)})" for v in values]
        return f".tensor_list(cppwrap::array_of<const cppwrap::Tensor*>({', '.join(items)}), false)"
    if isinstance(element, torch.FloatType):
        items = [
            shim_args.scalar(wrapper, float(v) if isinstance(v, int) else v)
            for v in values
        ]
        return f".real_list(cppwrap::array_of<double>({', '.join(items)}))"
    if isinstance(element, torch.BoolType):
        items = ["1" if v else "0" for v in values]
        return f".bool_list(cppwrap::array_of<int32_t>({', '.join(items)}))"
    if isinstance(element, (torch.IntType, torch.SymIntType)):
        items = [shim_args.scalar(wrapper, v) for v in values]
        return f".int_list(cppwrap::array_of<int64_t>({', '.join(items)}))"
    raise NotImplementedError(
        f"torch_cppwrap: list argument of {element} is not supported in a dispatcher call"
    )


# What an `Any` argument holds, by the Python type of its value (a
# collective's `Any group_name` holds the group's name, a str).
_ANY_VALUE_TYPE: dict[type, Any] = {
    str: torch.StringType.get(),
    bool: torch.BoolType.get(),
    int: torch.IntType.get(),
    float: torch.FloatType.get(),
}


def push_argument(wrapper: CppWrapperCpu, val: Any, type_: Any) -> str:
    if isinstance(type_, torch.AnyType) and type(val) in _ANY_VALUE_TYPE:
        type_ = _ANY_VALUE_TYPE[type(val)]
    if isinstance(type_, torch.OptionalType):
        if val is None:
            return ".none()"
        type_ = type_.getElementType()
    if val is None:
        if isinstance(type_, torch.TensorType):
            return ".tensor(cppwrap::undefined_tensor())"
        return ".none()"
    if isinstance(type_, (torch.ListType, torch.TupleType)):
        return _list_push(wrapper, list(val), type_.getElementType())
    if isinstance(type_, torch.TensorType):
        if shim_args.is_scalar_value(val):
            return f".tensor({shim_args.scalar_tensor(wrapper, val)})"
        return f".tensor({shim_args.tensor_ref(val)})"
    if isinstance(type_, (torch.BoolType, torch.SymBoolType)) or isinstance(val, bool):
        return f".boolean({spell.bool_literal(bool(val))})"
    if isinstance(type_, (torch.IntType, torch.SymIntType)):
        return f".integer({shim_args.scalar(wrapper, val)})"
    if isinstance(type_, torch.FloatType):
        return f".real({shim_args.scalar(wrapper, float(val) if isinstance(val, int) else val)})"
    if isinstance(type_, torch.NumberType):
        if isinstance(val, complex):
            real, imag = spell.float_literal(val.real), spell.float_literal(val.imag)
            return f".complex({real}, {imag})"
        if isinstance(val, float):
            return f".real({shim_args.scalar(wrapper, val)})"
        return f".integer({shim_args.scalar(wrapper, val)})"
    if isinstance(type_, torch.StringType):
        return f".string({spell.string_literal(val)})"
    if isinstance(val, torch.dtype):
        return f".dtype({spell.dtype_code(val)})"
    if isinstance(val, torch.layout):
        return f".layout({spell.LAYOUT_CODE[val]})"
    if isinstance(val, torch.memory_format):
        return f".memory_format({spell.MEMORY_FORMAT_CODE[val]})"
    if isinstance(val, torch.device):
        return f".device({spell.device_args(val)})"
    if isinstance(type_, torch.DeviceObjType) and isinstance(val, str):
        return f".device({spell.device_args(torch.device(val))})"
    raise NotImplementedError(
        f"torch_cppwrap: argument {val!r} ({type_}) is not supported in a dispatcher call"
    )
