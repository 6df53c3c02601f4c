"""Per-Function shape inferers for ``com.microsoft::PythonOp`` outputs.

ONNX knows nothing about a PythonOp, so by default its outputs get only their rank (from
``output_tensor_ranks``) with fresh dims.  A function registered here computes the exact
output shapes instead -- e.g. a pass-through Function keeps ``[batch, seq, hidden]`` -- so
dims stay connected across the PythonOp for later passes and analyses (ORT PR #17093).

An inferer is called as ``fn(node, input_shapes, input_dtypes)`` with one entry per tensor
input of the node (``onnx_ir.Shape``, possibly holding symbolic dims, or None when unknown;
``onnx_ir.DataType`` or None) and returns ``(output_shapes, output_dtypes)`` with one entry
per *tensor output* (the ctx output 0 excluded).  A shape may be an ``onnx_ir.Shape`` or a
sequence of ints, dim names and None.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import onnx_ir as ir

from ortpass.conventions import FUSED_ATTENTION, FUSED_MASKED_ATTENTION
from ortpass.infra.named_registry import NamedRegistry

__all__ = ["ShapeInferer", "get_shape_inferer", "register_shape_inferer", "unregister_shape_inferer"]

logger = logging.getLogger(__name__)

ShapeInferer = Callable[
    [ir.Node, Sequence["ir.Shape | None"], Sequence["ir.DataType | None"]],
    "tuple[Sequence[ir.Shape | Sequence[int | str | None] | None], Sequence[ir.DataType | int | None]]",
]

_inferers: NamedRegistry[ShapeInferer] = NamedRegistry("a shape inferer")


def _func_name(function: type | str) -> str:
    # Same key as the PythonOp func_name attribute; no torch import needed for a class.
    if isinstance(function, str):
        if not function:
            raise ValueError("a func_name cannot be empty")
        return function
    if isinstance(function, type):
        return f"{function.__module__}.{function.__qualname__}"
    raise TypeError(f"expected a Function class or its qualified name, got {function!r}")


def register_shape_inferer(function: type | str, *, replace: bool = False) -> Callable[[ShapeInferer], ShapeInferer]:
    """Decorator registering the shape inferer for PythonOps whose func_name is ``function``.

    ``function`` is the Function class or its qualified name (``module.QualName``).
    """
    name = _func_name(function)

    def decorator(inferer: ShapeInferer) -> ShapeInferer:
        if not callable(inferer):
            raise TypeError(f"shape inferer for {name} must be callable, got {inferer!r}")
        return _inferers.add(name, inferer, replace=replace)

    return decorator


def unregister_shape_inferer(function: type | str) -> None:
    """Remove the inferer registered for ``function`` (no error if there is none)."""
    _inferers.remove(_func_name(function))


def get_shape_inferer(function: type | str) -> ShapeInferer | None:
    """The inferer registered for ``function``, or None."""
    return _inferers.get(_func_name(function))


def _attention_shapes(node, input_shapes, input_dtypes):
    """SDPA's output: the query's shape with the value's last dim, in the query's dtype."""
    query, value = input_shapes[0], input_shapes[2]
    if query is None or value is None:
        return [None], [input_dtypes[0]]
    return [[*query.dims[:-1], value.dims[-1]]], [input_dtypes[0]]


for _name in (FUSED_ATTENTION, FUSED_MASKED_ATTENTION):
    register_shape_inferer(_name)(_attention_shapes)
