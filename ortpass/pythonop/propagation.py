"""ONNX shape inference through a graph with PythonOps, in one sweep in topological order.

ONNX cannot infer a PythonOp's outputs, and a PythonOp's shape inferer needs its inputs'
inferred shapes: with one fused attention per layer, each PythonOp waits for the layer
before it.  Rerunning ONNX's whole-model inference until nothing changes settles one
PythonOp level a round, each round serializing the whole model: quadratic in layers.

The rule here: a value's *level* is the number of PythonOps on the longest path from the
graph's inputs to it (a PythonOp's outputs are one level above its inputs).  Level 0 is
settled by one whole-model inference (onnx_ir's ``ShapeInferencePass``, as a round of the
loop did).  Then, for each level from 1 up, the PythonOps whose outputs are at that level
get their shapes (their inputs are settled), and ONNX infers the nodes of that level alone,
in a model holding only them, their settled inputs as graph inputs, and the small integer
chains (``Shape`` -> ``Gather`` -> ``Concat``...) that feed them, so ONNX's data
propagation sees the same data as in the whole model.  Each node is inferred twice in all.

The result is what the loop's last round gave: every value the loop cleared is inferred
from what its inputs settled to (a value ONNX cannot infer is seen by its consumers as
ONNX saw it, shapeless, and keeps the shape it had before the pass), every other value
is merged as onnx_ir merges.  The one difference: dims ONNX invents for unknown sizes
(``unk__N``) are numbered once, fresh across the model, where each round of the loop
renumbered them.

A graph this cannot cut into levels (a node holding a subgraph, nodes out of topological
order) is left to the caller: :func:`levels_of` returns None.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Sequence

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import _c_api_utils

from ortpass.conventions import MS_DOMAIN

__all__ = ["infer_by_levels", "levels_of"]

logger = logging.getLogger(__name__)

#: Initializers up to this many bytes go to ONNX with their data, as onnx_ir's
#: ``call_onnx_api`` hands them (larger ones as typed inputs without data).
_SMALL_TENSOR_BYTES = 1000
_FRESH_PREFIX = "unk__"


def is_pythonop(node: ir.Node) -> bool:
    return node.domain == MS_DOMAIN and node.op_type in ("PythonOp", "PythonOpGrad")


def levels_of(model: ir.Model) -> dict[ir.Node, int] | None:
    """Each top-level node's level: the PythonOps on the longest path to its inputs (a
    PythonOp's own level is that of its outputs).  None if the graph holds a subgraph or
    is not in topological order."""
    level: dict[ir.Value, int] = {}
    produced: set[ir.Value] = {v for node in model.graph for v in node.outputs}
    nodes: dict[ir.Node, int] = {}
    for node in model.graph:
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            return None
        at = 0
        for value in node.inputs:
            if value is None:
                continue
            if value in produced and value not in level:
                return None  # used before it is produced
            at = max(at, level.get(value, 0))
        if is_pythonop(node):
            at += 1
        nodes[node] = at
        for value in node.outputs:
            level[value] = at
    return nodes


def infer_by_levels(
    model: ir.Model,
    levels: dict[ir.Node, int],
    assign: Callable[[ir.Node], Sequence[ir.Value]],
    cleared: set[ir.Value],
    original: dict[ir.Value, "ir.Shape | None"],
) -> None:
    """Settle every shape: see the module docstring.

    ``assign(node)`` gives a PythonOp's outputs their shapes from its inputs' current ones;
    ``cleared``: the values ONNX infers afresh (their old shape ignored), the others it
    merges with; ``original``: each value's shape before, kept where ONNX infers none.
    """
    shapeless: set[ir.Value] = set()  # cleared values ONNX could not infer: their consumers see none
    pythonops = [node for node in model.graph if is_pythonop(node)]
    for node in pythonops:
        assign(node)
    for value in cleared:
        value.shape = None
    _infer_whole_model(model)
    _keep_uninferred(cleared, original, shapeless)
    by_level: dict[int, list[ir.Node]] = {}
    for node, at in levels.items():
        by_level.setdefault(at, []).append(node)
    names = _Symbols(model)
    functions = [ir.serde.serialize_function(f) for f in model.functions.values()]
    position = {node: index for index, node in enumerate(model.graph)}
    for at in sorted(k for k in by_level if k > 0):
        nodes = by_level[at]
        for node in nodes:
            if is_pythonop(node):
                assign(node)
        inferred = [n for n in nodes if not is_pythonop(n)]
        if not inferred:
            continue
        values = [v for n in inferred for v in n.outputs if v.name]
        for value in values:
            if value in cleared:
                value.shape = None
        proto = _sub_model(model, inferred, shapeless, functions, position)
        given = _dim_names([*proto.graph.input, *proto.graph.value_info])
        try:
            result = _infer(proto)
        except Exception as exc:  # noqa: BLE001 - as onnx_ir's pass: the values keep what they had
            logger.warning("shape inference failed at PythonOp level %d: %s; its values are left unchanged", at, exc)
            result = None
        if result is not None:
            _merge(result, {v.name: v for v in values}, _Renaming(names, given))
        _keep_uninferred([v for v in values if v in cleared], original, shapeless)


def _keep_uninferred(values: Iterable[ir.Value], original: dict, shapeless: set[ir.Value]) -> None:
    for value in values:
        if value.shape is None:
            shapeless.add(value)
            if original.get(value) is not None:
                # ONNX could not infer it (e.g. a data-dependent Reshape): keep what it had.
                value.shape = original[value]
        else:
            shapeless.discard(value)


def _sub_model(
    model: ir.Model,
    nodes: list[ir.Node],
    shapeless: set[ir.Value],
    functions: list[onnx.FunctionProto],
    position: dict[ir.Node, int],
) -> onnx.ModelProto:
    """``nodes`` in a model of their own, after the integer chains feeding them."""
    chosen = set(nodes)
    context = _context(nodes, chosen)
    all_nodes = sorted([*context, *nodes], key=position.__getitem__)
    inside = {v for n in all_nodes for v in n.outputs}
    graph = onnx.GraphProto(name="level")
    seen: set[ir.Value] = set()
    for node in all_nodes:
        graph.node.append(ir.serde.serialize_node(node))
        for value in node.inputs:
            if value is None or value in inside or value in seen:
                continue
            seen.add(value)
            tensor = value.const_value if value.is_initializer() else None
            if tensor is not None and tensor.nbytes <= _SMALL_TENSOR_BYTES:
                proto = ir.serde.serialize_tensor(tensor)
                proto.name = value.name
                graph.initializer.append(proto)
            graph.input.append(_value_info(value, shapeless))
    for node in all_nodes:
        for value in node.outputs:
            if value.name and value.type is not None:
                graph.value_info.append(_value_info(value, shapeless))
    proto = onnx.ModelProto(ir_version=model.ir_version, graph=graph)
    for domain, version in model.opset_imports.items():
        proto.opset_import.append(onnx.OperatorSetIdProto(domain=domain, version=version))
    proto.functions.extend(functions)
    return proto


def _context(nodes: list[ir.Node], chosen: set[ir.Node]) -> set[ir.Node]:
    """The nodes outside ``chosen`` that ONNX's data propagation reads through to infer
    ``nodes``: the producers of small integer values (rank 0 or 1, or of unknown shape),
    and of theirs, back to the first value that carries no data (a graph input, a float
    tensor whose ``Shape`` is taken)."""
    found: set[ir.Node] = set()
    stack = [v for n in nodes for v in n.inputs if v is not None]
    while stack:
        value = stack.pop()
        producer = value.producer()
        if producer is None or producer in chosen or producer in found or not _may_carry_data(value):
            continue
        found.add(producer)
        stack.extend(v for v in producer.inputs if v is not None)
    return found


def _may_carry_data(value: ir.Value) -> bool:
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and not producer.inputs:
        return True
    if value.dtype not in (ir.DataType.INT64, ir.DataType.INT32, None):
        return False
    return value.shape is None or len(value.shape) <= 1


def _value_info(value: ir.Value, shapeless: set[ir.Value]) -> onnx.ValueInfoProto:
    info = ir.serde.serialize_value(value)
    if value in shapeless and info.type.HasField("tensor_type"):
        info.type.tensor_type.ClearField("shape")
    return info


def _infer(proto: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX's inference as onnx_ir's ``ShapeInferencePass(strict_mode=False)`` runs it."""
    return onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=False, data_prop=True)


def _infer_whole_model(model: ir.Model) -> None:
    """onnx_ir's ``ShapeInferencePass(strict_mode=False)`` on ``model``, but reading the
    result's value infos alone where the pass parses the whole inferred model back into IR
    (two thirds of its time on a 32-layer LLaMA)."""
    try:
        result = _c_api_utils.call_onnx_api(_infer, model)
    except Exception as exc:  # noqa: BLE001 - as onnx_ir's pass: the model is left unchanged
        logger.warning("shape inference failed: %s; the model is left unchanged", exc)
        return
    values: dict[str, ir.Value] = dict(model.graph.initializers)
    values.update((v.name, v) for v in model.graph.inputs if v.name)
    values.update((v.name, v) for node in model.graph for v in node.outputs if v.name)
    _merge(result, values, None)


def _merge(result: onnx.ModelProto, values: dict[str, ir.Value], renaming: "_Renaming | None") -> None:
    """As onnx_ir's ``ShapeInferencePass`` merges: a value takes the shape and dtype ONNX
    inferred where it inferred one; ``renaming`` names the dims ONNX invented in a sub-model."""
    infos = {info.name: info for info in result.graph.input}
    infos.update((info.name, info) for info in result.graph.value_info)
    infos.update((info.name, info) for info in result.graph.output)
    for name, value in values.items():
        info = infos.get(name)
        if info is None:
            continue
        inferred = ir.serde.deserialize_value_info_proto(info, None)
        shape = inferred.shape
        if shape is not None and renaming is not None:
            shape = ir.Shape([renaming(d.value) if isinstance(d, ir.SymbolicDim) and d.value else d for d in shape.dims])
        if shape is not None and value.shape != shape:
            value.shape = shape
        if inferred.dtype is not None and value.dtype != inferred.dtype:
            value.dtype = inferred.dtype


class _Renaming:
    """The fresh name of each dim ONNX invented in one sub-model (one it was not given)."""

    def __init__(self, symbols: "_Symbols", given: set[str]) -> None:
        self.symbols, self.given, self.renamed = symbols, given, {}

    def __call__(self, name: str) -> str:
        return self.symbols.fresh(name, self.given, self.renamed)


class _Symbols:
    """The dim names in use in the model, and fresh ones for those ONNX invents in a
    sub-model (numbered per call, so its ``unk__0`` is not the whole model's)."""

    def __init__(self, model: ir.Model) -> None:
        self.used: set[str] = set()
        for value in [*model.graph.inputs, *(v for n in model.graph for v in n.outputs)]:
            if value.shape is not None:
                self.used.update(d.value for d in value.shape.dims if isinstance(d, ir.SymbolicDim) and d.value)
        self.counter = 0

    def fresh(self, name: str, given: set[str], renamed: dict[str, str]) -> str:
        """``name`` if the sub-model was ``given`` it, else the fresh name it stands for."""
        if name in given:
            return name
        if name not in renamed:
            while f"{_FRESH_PREFIX}{self.counter}" in self.used:
                self.counter += 1
            renamed[name] = f"{_FRESH_PREFIX}{self.counter}"
            self.used.add(renamed[name])
        return renamed[name]


def _dim_names(infos: Iterable[onnx.ValueInfoProto]) -> set[str]:
    return {
        dim.dim_param
        for info in infos
        if info.type.HasField("tensor_type")
        for dim in info.type.tensor_type.shape.dim
        if dim.HasField("dim_param")
    }
