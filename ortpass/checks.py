"""The checks ``PassManager`` runs on the input model and after every pass.

``"full"`` serializes the model and runs ``onnx.checker.check_model``; ``"incremental"``
applies the same rules on the IR, looking again only at what changed since the last
check (see :func:`incremental_check`); ``"none"`` checks nothing.  What a check accepted
(:data:`Checked`) is handed to the next check, and in the full mode the serialization is
also the manager's rollback point.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx
import onnx_ir as ir

__all__ = ["CHECK_MODES", "Checked", "CheckedState", "check_mode", "full_check", "incremental_check"]


#: The ``check`` modes of :class:`PassManager` (``True`` means ``"full"``, ``False`` ``"none"``).
CHECK_MODES = ("full", "incremental", "none")

_SUBGRAPH_ATTRIBUTES = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)


def check_mode(check: bool | str) -> str:
    """The mode named by ``PassManager``'s ``check`` argument."""
    if check is True:
        return "full"
    if check is False:
        return "none"
    if check in CHECK_MODES:
        return check  # type: ignore[return-value]
    raise ValueError(f"check must be True, False or one of {CHECK_MODES}, not {check!r}")


def full_check(model: ir.Model) -> onnx.ModelProto:
    """Serialize ``model`` and run the onnx checker on it; return the serialization."""
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    return proto


def _fingerprint(node: ir.Node) -> tuple:
    """What ``onnx.checker.check_node`` reads of ``node`` once serialized: op, domain,
    overload, input and output names, and the attributes (by identity: ``ir.Attr`` is
    immutable, so a changed attribute is a new object)."""
    return (
        node.op_type,
        node.domain,
        node.overload,
        tuple(None if v is None else v.name for v in node.inputs),
        tuple(v.name for v in node.outputs),
        tuple(map(id, node.attributes.values())),
    )


@dataclasses.dataclass
class CheckedState:
    """What an incremental check accepted, to tell later which nodes changed since."""

    ir_version: int
    opsets: dict[str, int]
    nodes: dict[ir.Node, tuple]
    tensors: dict[str, Any]  # initializer name -> the tensor object that was checked
    # The attributes whose ids are in the fingerprints, kept alive so no new attribute
    # can be given the id of a checked one.
    attributes: list[tuple[ir.Attr, ...]]

    @classmethod
    def of(cls, model: ir.Model) -> CheckedState:
        nodes = {}
        attributes = []
        for node in model.graph:
            nodes[node] = _fingerprint(node)
            attributes.append(tuple(node.attributes.values()))
        tensors = {name: value.const_value for name, value in model.graph.initializers.items()}
        return cls(model.ir_version, dict(model.opset_imports), nodes, tensors, attributes)


#: What a check accepted: the serialized model (full), the state of an incremental
#: check, or None (no check).
Checked = onnx.ModelProto | CheckedState | None


def incremental_check(model: ir.Model, previous: CheckedState | None) -> CheckedState:
    """Raise ``onnx.checker.ValidationError`` where ``onnx.checker.check_model`` would
    reject ``model``, looking again only at what changed since ``previous`` was accepted
    (everything when ``previous`` is None).

    Checked on the IR, without serializing the model: the checker's rules on names over
    the whole graph (see :func:`_check_names`), ``check_value_info`` on the graph inputs
    and outputs, ``check_tensor`` on initializers that are new, and ``check_node`` on
    nodes that are new or whose op, domain, overload, attributes, or input or output
    names changed.  ``check_node`` reads nothing else of a node but the model's IR
    version and opset imports, so a node it accepted is still accepted while those stay
    the same.  Falls back to :func:`_full_check` when the IR version or the opset imports
    changed, the model has functions, a checked node holds a subgraph (its check needs
    the enclosing scope, which onnx's Python API does not take), or the IR version is 3
    or older (initializers must then be graph inputs).
    """
    state = CheckedState.of(model)
    changed = [n for n, fp in state.nodes.items() if previous is None or previous.nodes.get(n) != fp]
    if _needsfull_check(model, state, previous, changed):
        full_check(model)
        return state
    ctx = onnx.checker.C.CheckerContext()
    ctx.ir_version = model.ir_version
    ctx.opset_imports = state.opsets
    _check_names(model.graph)
    for value in (*model.graph.inputs, *model.graph.outputs):
        onnx.checker.check_value_info(ir.serde.serialize_value(value), ctx)
    for name, tensor in state.tensors.items():
        if tensor is not None and (previous is None or previous.tensors.get(name) is not tensor):
            onnx.checker.check_tensor(ir.serde.serialize_tensor(tensor), ctx)
    for node in changed:
        _check_node(node, ctx)
    return state


def _needsfull_check(
    model: ir.Model, state: CheckedState, previous: CheckedState | None, changed: list[ir.Node]
) -> bool:
    if model.functions or model.ir_version <= 3:
        return True
    if previous is not None and (state.ir_version != previous.ir_version or state.opsets != previous.opsets):
        return True
    return any(attr.type in _SUBGRAPH_ATTRIBUTES for node in changed for attr in node.attributes.values())


def _check_node(node: ir.Node, ctx: Any) -> None:
    try:
        proto = ir.serde.serialize_node(node)
        onnx.checker.C.check_node(proto.SerializeToString(), ctx, onnx.checker.LEXICAL_SCOPE_CONTEXT)
    except Exception as exc:
        raise onnx.checker.ValidationError(
            f"Bad node spec for node. Name: {node.name} OpType: {node.op_type}: {exc}"
        ) from exc


def _check_names(graph: ir.Graph) -> None:
    """onnx.checker's rules on value names (``check_graph`` in onnx's checker.cc), on the
    IR: graph input names are unique, every non-empty input name of a node is a graph
    input, an initializer or an output of an earlier node (topological order), every
    non-empty output name is new (single static assignment), every graph output is
    defined.  Written here because onnx checks names only on a serialized graph, which
    is what this check avoids building; onnx_ir has no such check.  A value without a
    name cannot be serialized at all, so it is refused too.
    """
    defined: set[str] = set()
    for value in graph.inputs:
        if _serialized_name(value) in defined:
            raise onnx.checker.ValidationError(
                f"Graph must be in single static assignment (SSA) form, however '{value.name}' "
                "has been used as graph input names multiple times."
            )
        defined.add(value.name)  # type: ignore[arg-type]
    defined.update(graph.initializers)
    for node in graph:
        for value in node.inputs:
            if value is not None and _serialized_name(value) and value.name not in defined:
                raise onnx.checker.ValidationError(
                    f"Nodes in a graph must be topologically sorted, however input '{value.name}' of node: "
                    f"name: {node.name} OpType: {node.op_type} is not output of any previous nodes."
                )
        for value in node.outputs:
            name = _serialized_name(value)
            if not name:
                continue
            if name in defined:
                raise onnx.checker.ValidationError(
                    f"Graph must be in single static assignment (SSA) form, however '{name}' "
                    "has been used as output names multiple times."
                )
            defined.add(name)
    for value in graph.outputs:
        if _serialized_name(value) not in defined:
            raise onnx.checker.ValidationError(f"Graph output '{value.name}' is not an output of any node in graph.")


def _serialized_name(value: ir.Value) -> str:
    if value.name is None:
        raise onnx.checker.ValidationError(f"a value has no name, so the model cannot be serialized: {value!r}")
    return value.name
