"""Writing new nodes for a rewrite: named, tagged with their side of the training graph,
their outputs named, shaped and typed, constants and reductions written as the model's
opset wants them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import onnx_ir as ir

from ortpass.analysis.partition import tag
from ortpass.graph.names import NameAllocator

__all__ = ["NodeWriter"]

# ReduceSum, and the other reductions (ReduceMax, ReduceLogSumExp), take their axes as an input from these opsets on.
_REDUCE_SUM_AXES_INPUT_OPSET = 13
_REDUCE_AXES_INPUT_OPSET = 18


class NodeWriter:
    """Appends named nodes, tagged with the training graph's side, to that side's list in
    ``sides``; their outputs get fresh names and the shape and type given.  The caller
    puts the lists into a graph."""

    def __init__(self, names: NameAllocator, prefix: str, opset: int) -> None:
        self.names, self.prefix, self.opset = names, prefix, opset
        self.side: Literal["forward", "backward"] = "forward"
        self.sides: dict[str, list[ir.Node]] = {"forward": [], "backward": []}

    def op(
        self, op_type: str, inputs: Sequence[ir.Value | None], attributes: dict | None = None, *, name: str,
        shape: Sequence | None = None, dtype: ir.DataType | None = None,
    ) -> ir.Value:  # fmt: skip
        """One node; ``shape`` and ``dtype`` recorded on its output (the analyses that run
        later size stashed values from them)."""
        node = ir.node(op_type, list(inputs), attributes or {}, name=self.names.fresh(f"{self.prefix}/{name}"))
        out = node.outputs[0]
        out.name = self.names.fresh(f"{node.name}_output")
        if shape is not None:
            out.shape = ir.Shape(list(shape))
        out.dtype = dtype
        self.sides[self.side].append(tag(node, self.side))
        return out

    def const(self, array: np.ndarray, name: str) -> ir.Value:
        return self.op("Constant", [], {"value": ir.tensor(array)}, name=name, shape=array.shape, dtype=ir.DataType.from_numpy(array.dtype))

    def ints(self, values: Sequence[int], name: str) -> ir.Value:
        return self.const(np.array(values, dtype=np.int64), name)

    def reduce(self, op_type: str, x: ir.Value, axes: Sequence[int] | None, name: str) -> ir.Value:
        """``op_type`` over ``axes`` (kept, as size 1) or over every axis (None: a scalar),
        the axes given as the model's opset wants them."""
        if axes is None:
            return self.op(op_type, [x], {"keepdims": 0}, name=name, shape=[], dtype=x.dtype)
        shape = [1 if i in axes else d for i, d in enumerate(x.shape)]
        as_input_from = _REDUCE_SUM_AXES_INPUT_OPSET if op_type == "ReduceSum" else _REDUCE_AXES_INPUT_OPSET
        if self.opset >= as_input_from:
            return self.op(op_type, [x, self.ints(axes, f"{name}_axes")], {"keepdims": 1}, name=name, shape=shape, dtype=x.dtype)
        return self.op(op_type, [x], {"axes": list(axes), "keepdims": 1}, name=name, shape=shape, dtype=x.dtype)
