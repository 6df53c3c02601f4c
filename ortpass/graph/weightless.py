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

What checks a weight's name, type or dims (the gradient build and its up-front checks)
gets :func:`proto_with_placeholders` instead: every initializer in its place, the weights
with their type and dims but their data a reference to external data that does not exist
(:data:`PLACEHOLDER`), so that a tool that did read one fails rather than computes with
wrong values.  Neither copies a weight's bytes.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

__all__ = ["PLACEHOLDER", "proto_with_placeholders", "proto_without_weights", "weights_left_out"]

#: The external-data location of a weight :func:`proto_with_placeholders` left out: a
#: relative path no tool is meant to open.
PLACEHOLDER = "__ortpass_detached_weight__/never-read"

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
    return _proto_without(model, {id(value) for value in weights_left_out(model)})


def proto_with_placeholders(model: ir.Model, names=None) -> tuple[onnx.ModelProto, set[str]]:
    """``ir.to_proto(model)`` with the floating-point initializers that are graph inputs
    and hold their data in memory (of those named in ``names``, if given) as placeholders
    (see the module docstring), in their places; returns the proto and the placeholders'
    names."""
    wanted = None if names is None else set(names)
    left_out = [
        value
        for value in weights_left_out(model)
        if (wanted is None or value.name in wanted)
        and value.const_value is not None
        and not isinstance(value.const_value, ir.ExternalTensor)  # a file's reference is serialized as is
    ]
    proto = _proto_without(model, {id(value) for value in left_out})
    if left_out:
        serialized = {init.name: init for init in proto.graph.initializer}
        placeholders = {value.name: _placeholder(value) for value in left_out}
        ordered = [placeholders[name] if name in placeholders else serialized[name] for name in model.graph.initializers]
        copies = [onnx.TensorProto() for _ in ordered]
        for copy, init in zip(copies, ordered):
            copy.CopyFrom(init)  # the constants left (small) and the placeholders (no data)
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(copies)
    return proto, {value.name for value in left_out}


def _placeholder(value: ir.Value) -> onnx.TensorProto:
    tensor = value.const_value
    init = onnx.TensorProto(name=value.name, data_type=int(tensor.dtype), dims=[int(d) for d in tensor.shape])
    init.data_location = onnx.TensorProto.EXTERNAL
    entry = init.external_data.add()
    entry.key, entry.value = "location", PLACEHOLDER
    return init


def _proto_without(model: ir.Model, left_out: set[int]) -> onnx.ModelProto:
    """``ir.to_proto(model)`` without the initializers whose ids are in ``left_out``."""
    graph = model.graph
    kept = [value for value in graph.initializers.values() if id(value) not in left_out]
    if len(kept) == len(graph.initializers):
        return ir.to_proto(model)
    view = ir.GraphView(
        graph.inputs, graph.outputs, nodes=graph, initializers=kept, doc_string=graph.doc_string,
        opset_imports=graph.opset_imports, name=graph.name, metadata_props=graph.metadata_props,
    )  # fmt: skip
    return ir.serde.serialize_model_into(onnx.ModelProto(), _ModelWithGraph(model, view))
