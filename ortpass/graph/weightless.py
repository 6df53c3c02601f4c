"""A model serialized without its weights' values, for analyses that read only shapes.

An analysis that runs onnx's shape inference on a training graph
(:func:`ortpass.analysis.memory.bind_internal_dims`, run by every step-memory prediction)
serialized the whole model, weights included: on an 80-layer LLaMA 300 MiB of tensor
bytes, then copied again by ``SerializeToString``, by onnx's C++ parse and by the
inferred model it returns, several times per pass (issue 59: the host peak of
``recompute-again-late``, and half its time).  Shape inference reads a value's data only
to propagate shapes, which are integer tensors; a floating-point weight that is also a
graph input gets its type and shape from the input's declaration.  So
:func:`proto_without_weights` leaves out the initializers that are graph inputs of a
floating-point type: the proto has every node, input, output and value info, and the
small constants shapes are computed from.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

__all__ = ["proto_without_weights", "weights_left_out"]

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


class _ModelWithGraph:
    """``model`` with another graph (a view): what onnx_ir's serializer reads of a model."""

    def __init__(self, model: ir.Model, graph: ir.GraphView) -> None:
        self._model = model
        self.graph = graph

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def _is_weight(value: ir.Value) -> bool:
    return value.is_graph_input() and value.dtype in _FLOATS


def weights_left_out(model: ir.Model) -> list[ir.Value]:
    """The initializers :func:`proto_without_weights` leaves out."""
    return [value for value in model.graph.initializers.values() if _is_weight(value)]


def proto_without_weights(model: ir.Model) -> onnx.ModelProto:
    """``ir.to_proto(model)`` without the initializers that are floating-point graph
    inputs (their inputs stay, with their types and shapes)."""
    graph = model.graph
    kept = [value for value in graph.initializers.values() if not _is_weight(value)]
    if len(kept) == len(graph.initializers):
        return ir.to_proto(model)
    view = ir.GraphView(
        graph.inputs, graph.outputs, nodes=graph, initializers=kept, doc_string=graph.doc_string,
        opset_imports=graph.opset_imports, name=graph.name, metadata_props=graph.metadata_props,
    )  # fmt: skip
    return ir.serde.serialize_model_into(onnx.ModelProto(), _ModelWithGraph(model, view))
