"""Give every PythonOp output a shape, then propagate shapes through the rest of the graph."""

from __future__ import annotations

import logging
from typing import Sequence

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from ortpass.conventions import MS_DOMAIN, SHAPES, is_onnx_domain
from ortpass.errors import OrtpassError
from ortpass.infra.base import OrtPass
from ortpass.infra.registry import register_pass
from ortpass.pythonop.propagation import infer_by_levels, levels_of
from ortpass.pythonop.shape_inference import get_shape_inferer

__all__ = ["PythonOpShapeInferencePass"]

logger = logging.getLogger(__name__)


_TypeAndShape = tuple["ir.TypeProtocol | None", "ir.Shape | None"]


@register_pass("pythonop-shape-inference")
class PythonOpShapeInferencePass(OrtPass):
    """Shape every ``com.microsoft::PythonOp`` / ``PythonOpGrad`` output, then re-infer downstream.

    Rules:

    - PythonOp output 0 (ctx) is an INT64 scalar ``[]``.
    - PythonOp outputs 1.. get, when an inferer is registered for the node's ``func_name``
      (``ortpass.export.register_shape_inferer``), exactly what it returns; it must return
      one shape and one dtype per tensor output.  Otherwise each gets the dtype from
      ``output_tensor_types`` and ``output_tensor_ranks[i]`` fresh named dims
      ``<value name>_d<k>`` (stable across runs, so re-running changes nothing).
    - PythonOpGrad output k (the gradient of the forward's k-th tensor input) gets that
      input's shape and dtype, the forward PythonOp found through the ctx input.
    - Then every value downstream of those outputs that an ai.onnx node produces loses
      its old shape and is re-inferred by ONNX shape inference (through onnx_ir's
      ShapeInferencePass), so dim names flow through; a value ONNX cannot infer keeps the
      shape it had.  PythonOps fed by other PythonOps are settled in one sweep, level by
      level in topological order (:mod:`ortpass.pythonop.propagation`): one whole-model
      inference, then each level's nodes alone, so the cost is linear in the graph (it
      was one whole-model round per chained PythonOp, quadratic in layers).  A graph the
      sweep cannot cut into levels (a subgraph) gets rounds over the whole model until
      nothing changes.

    If an inferer fails or returns the wrong number of entries the pass raises
    ``OrtpassError`` naming the node and func_name, and every shape is as it was.
    """

    phase = "any"
    provides_properties = frozenset({SHAPES})

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        nodes = [n for n in model.graph.all_nodes() if n.domain == MS_DOMAIN and n.op_type in ("PythonOp", "PythonOpGrad")]
        if not nodes:
            return ir.passes.PassResult(model, modified=False)
        before = _snapshot(model)
        levels = levels_of(model)
        try:
            if levels is not None:
                seeds = [v for node in nodes for v in node.outputs if v.name]
                original = {v: shape for v, (_, shape) in before.items()}
                cleared = set(_downstream_default_domain_values(seeds))
                infer_by_levels(model, levels, self._shape_outputs, cleared, original)
            else:  # a subgraph, or nodes out of order: rounds over the whole model until nothing changes
                self._until_settled(model, nodes)
        except Exception:
            _restore(before)
            raise
        modified = any(_type_and_shape(v) != saved for v, saved in before.items())
        for node in nodes:
            if node.op_type == "PythonOp":
                exact = get_shape_inferer(_string_attr(node, "func_name") or "?") is not None
                self.count("outputs exact (registered inferer)" if exact else "outputs rank-only", len(node.outputs) - 1)
        return ir.passes.PassResult(model, modified=modified)

    def _until_settled(self, model: ir.Model, nodes: list[ir.Node]) -> None:
        for _ in range(len(nodes) + 1):
            shaped = [v for node in nodes for v in self._shape_outputs(node)]
            if not _propagate(model, shaped):
                break

    # -- per node ---------------------------------------------------------------------------

    def _shape_outputs(self, node: ir.Node) -> list[ir.Value]:
        if node.op_type == "PythonOp":
            assigned = self._pythonop_outputs(node)
        else:
            assigned = _pythonop_grad_outputs(node)
        for value, (dtype, shape) in assigned.items():
            if dtype is not None:
                value.dtype = dtype
            if shape is not None:
                value.shape = shape
        return list(assigned)

    def _pythonop_outputs(self, node: ir.Node) -> dict[ir.Value, tuple[ir.DataType | None, ir.Shape | None]]:
        func_name = _string_attr(node, "func_name")
        assigned: dict[ir.Value, tuple[ir.DataType | None, ir.Shape | None]] = {}
        if node.outputs:
            assigned[node.outputs[0]] = (ir.DataType.INT64, ir.Shape([]))
        tensor_outputs = list(node.outputs[1:])
        inferer = get_shape_inferer(func_name) if func_name else None
        if inferer is not None:
            shapes, dtypes = _call_inferer(inferer, node, func_name, len(tensor_outputs))
        else:
            ranks = _ints_attr(node, "output_tensor_ranks")
            types = _ints_attr(node, "output_tensor_types")
            shapes = [
                ir.Shape([f"{v.name}_d{k}" for k in range(ranks[i])]) if i < len(ranks) else None
                for i, v in enumerate(tensor_outputs)
            ]
            dtypes = [ir.DataType(types[i]) if i < len(types) else None for i in range(len(tensor_outputs))]
        for value, shape, dtype in zip(tensor_outputs, shapes, dtypes):
            assigned[value] = (dtype, shape)
        return assigned


def _pythonop_grad_outputs(node: ir.Node) -> dict[ir.Value, tuple[ir.DataType | None, ir.Shape | None]]:
    ctx = node.inputs[0] if node.inputs else None
    forward = ctx.producer() if ctx is not None else None
    if forward is None or forward.op_type != "PythonOp":
        return {}
    forward_inputs = [v for v in forward.inputs]
    assigned: dict[ir.Value, tuple[ir.DataType | None, ir.Shape | None]] = {}
    for value, source in zip(node.outputs, forward_inputs):
        if value.name and source is not None and source.shape is not None:
            assigned[value] = (source.dtype, ir.Shape(list(source.shape.dims)))
    return assigned


def _call_inferer(inferer, node: ir.Node, func_name: str, count: int):
    input_shapes = [v.shape if v is not None else None for v in node.inputs]
    input_dtypes = [v.dtype if v is not None else None for v in node.inputs]
    try:
        shapes, dtypes = inferer(node, input_shapes, input_dtypes)
        shapes, dtypes = list(shapes), list(dtypes)
    except Exception as exc:
        raise OrtpassError(
            f"shape inferer for {func_name!r} failed on node {node.name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if len(shapes) != count or len(dtypes) != count:
        raise OrtpassError(
            f"shape inferer for {func_name!r} returned {len(shapes)} shapes and {len(dtypes)} dtypes "
            f"for node {node.name!r}, which has {count} tensor outputs (ctx excluded)"
        )
    return (
        [None if s is None else (s if isinstance(s, ir.Shape) else ir.Shape(list(s))) for s in shapes],
        [None if d is None else ir.DataType(d) for d in dtypes],
    )


# -- propagation ----------------------------------------------------------------------------------


def _propagate(model: ir.Model, shaped: Sequence[ir.Value]) -> bool:
    """Re-infer every ai.onnx value downstream of ``shaped``; True if any shape changed."""
    downstream = _downstream_default_domain_values(shaped)
    before = {v: _type_and_shape(v) for v in [*shaped, *downstream]}
    for value in downstream:
        value.shape = None
    common_passes.ShapeInferencePass(strict_mode=False)(model)
    for value in downstream:
        if value.shape is None and before[value][1] is not None:
            # ONNX could not infer it (e.g. a data-dependent Reshape): keep what it had.
            value.shape = before[value][1]
    return any(_type_and_shape(v) != saved for v, saved in before.items())


def _downstream_default_domain_values(sources: Sequence[ir.Value]) -> list[ir.Value]:
    seen: set[ir.Value] = set()
    order: list[ir.Value] = []
    stack = list(sources)
    while stack:
        value = stack.pop()
        for consumer in {use.node for use in value.uses()}:
            if not is_onnx_domain(consumer.domain):
                continue
            for output in consumer.outputs:
                if output not in seen:
                    seen.add(output)
                    order.append(output)
                    stack.append(output)
    return order


# -- small helpers --------------------------------------------------------------------------------


def _type_and_shape(value: ir.Value) -> _TypeAndShape:
    shape = value.shape
    return value.type, (ir.Shape(list(shape.dims)) if shape is not None else None)


def _snapshot(model: ir.Model) -> dict[ir.Value, _TypeAndShape]:
    values = list(model.graph.inputs)
    values.extend(v for node in model.graph.all_nodes() for v in node.outputs)
    return {v: _type_and_shape(v) for v in values}


def _restore(snapshot: dict[ir.Value, _TypeAndShape]) -> None:
    for value, (type_, shape) in snapshot.items():
        value.type = type_
        value.shape = shape


def _string_attr(node: ir.Node, name: str) -> str:
    attr = node.attributes.get(name)
    return attr.as_string() if attr is not None else ""


def _ints_attr(node: ir.Node, name: str) -> list[int]:
    attr = node.attributes.get(name)
    return list(attr.as_ints()) if attr is not None else []
