"""Sizes of the values the recompute analysis weighs: bytes kept alive and the size floor."""

from __future__ import annotations

import logging

import onnx_ir as ir
import sympy

from ortpass.analysis import memory
from ortpass.analysis.recomputable_ops import (
    recomputable_function_of,
)
from ortpass.conventions import is_onnx_domain

__all__ = ["ValueSizes"]

logger = logging.getLogger(__name__)


class ValueSizes:
    """What a value keeps alive, memoized for one analysis: its bytes (symbolic), its
    static element count, and whether it is under the size floor.  A registered
    recomputable PythonOp's ctx output is sized as the buffers it holds."""

    def __init__(self, buffers: memory.BufferMap, stashed_buffers: set[ir.Value], min_elements: int) -> None:
        self.buffers = buffers
        self.stashed_buffers = stashed_buffers
        self.min_elements = min_elements
        self._bytes_cache: dict[ir.Value, sympy.Expr | None] = {}
        self._numel_cache: dict[ir.Value, int | None] = {}

    def nbytes(self, value: ir.Value) -> sympy.Expr | None:
        """Bytes ``value`` keeps alive (for a PythonOp's ctx, the estimate of
        :meth:`context_buffers`), or None when unknown."""
        if value not in self._bytes_cache:
            held = self.context_buffers(value)
            if held is None:
                size = memory.symbolic_nbytes(value)
            else:
                sizes = [memory.symbolic_nbytes(v) for v in held]
                size = None if None in sizes else sympy.Add(*sizes)  # type: ignore[arg-type]
            self._bytes_cache[value] = size
        return self._bytes_cache[value]

    def context_buffers(self, value: ir.Value) -> list[ir.Value] | None:
        """What the ctx output of a registered recomputable PythonOp holds, else None.

        The ctx is an int64 handle; the memory is what the Function saved in it, which
        ONNX does not show.  Estimate (FlashAttention-like functions save their tensor
        inputs, ``q, k, v``): the buffers of the PythonOp's tensor inputs that nothing else
        keeps alive, i.e. not read by backward and not graph inputs, initializers or
        Constants.  Inputs backward reads anyway cost the ctx nothing.
        """
        node = value.producer()
        if node is None or value.index() != 0 or recomputable_function_of(node) is None:
            return None
        roots = dict.fromkeys(self.buffers.root(v) for v in node.inputs if v is not None)
        return [
            root for root in roots
            if root.producer() is not None and not is_constant(root.producer()) and root not in self.stashed_buffers
        ]

    def static_numel(self, value: ir.Value) -> int | None:
        """Element count when static (for a ctx, of what it holds), else None.  Memoized:
        growth asks about the same boundary values again and again (17k asks at 17.5k nodes)."""
        if value not in self._numel_cache:
            held = self.context_buffers(value)
            if held is None:
                self._numel_cache[value] = memory.static_numel(value)
            else:
                counts = [memory.static_numel(v) for v in held]
                self._numel_cache[value] = None if None in counts else sum(counts)  # type: ignore[arg-type]
        return self._numel_cache[value]

    def below_floor(self, value: ir.Value) -> bool:
        if self.min_elements <= 0:
            return False  # no element count is below a floor of 0: skip counting
        numel = self.static_numel(value)
        return numel is not None and numel < self.min_elements


def is_constant(node: ir.Node) -> bool:
    return node.op_type == "Constant" and is_onnx_domain(node.domain)
