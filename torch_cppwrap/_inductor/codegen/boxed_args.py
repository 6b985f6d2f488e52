"""Spelling an op argument for a call through the dispatcher.

Ops without a C shim (custom ops, a few aten ops) are called boxed: the
generated code pushes each argument onto a cppwrap::BoxedCall by its kind
(arg_kinds.py), `.tensor(buf0).integer(2).run()`, and reads the results back.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_cppwrap._inductor.codegen import arg_kinds
from torch_cppwrap._inductor.codegen import cpp_spellings as spell
from torch_cppwrap._inductor.codegen.arg_kinds import SizeVar, is_list_type


def push_argument(sizevar: SizeVar, val: Any, type_: Any) -> str:
    if isinstance(type_, torch.OptionalType):
        if val is None:
            return ".none()"
        type_ = type_.getElementType()
    if val is None:
        if isinstance(type_, torch.TensorType):
            return ".tensor(cppwrap::undefined_tensor())"
        return ".none()"
    if is_list_type(type_):
        return _list_push(sizevar, list(val), type_.getElementType())
    kind = arg_kinds.kind_of(type_, val)
    if kind is None:
        raise NotImplementedError(
            f"torch_cppwrap: argument {val!r} ({type_}) is not supported in a "
            "dispatcher call"
        )
    return f".{kind.push}({', '.join(kind.push_args(sizevar, val))})"


def _list_push(sizevar: SizeVar, values: list[Any], element: Any) -> str:
    optional = isinstance(element, torch.OptionalType)
    inner = element.getElementType() if optional else element
    sample = next((v for v in values if v is not None), None)
    kind = arg_kinds.kind_of(inner, sample)
    if kind is arg_kinds.TENSOR:
        # Borrowed by address; a missing optional tensor is a null pointer.
        items = ", ".join(
            "nullptr"
            if v is None
            else f"cppwrap::address_of({arg_kinds.tensor_ref(v)})"
            for v in values
        )
        return (
            f".tensor_list(cppwrap::array_of<const cppwrap::Tensor*>({items}), "
            f"{spell.bool_literal(optional)})"
        )
    if kind is None or kind.list_push is None or optional:
        raise NotImplementedError(
            f"torch_cppwrap: list argument of {element} is not supported in a "
            "dispatcher call"
        )
    items = ", ".join(kind.shim_args(sizevar, v)[0] for v in values)
    return f".{kind.list_push}(cppwrap::array_of<{kind.ctype}>({items}))"
