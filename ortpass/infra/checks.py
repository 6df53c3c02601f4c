"""The checks ``PassManager`` runs on the input model and after every pass.

``"full"`` serializes the model and runs ``onnx.checker.check_model``; ``"incremental"``
applies the same rules on the IR, to the whole input (:func:`input_check`), then looking
again only at what changed since the last check (:func:`incremental_check`); ``"none"``
checks nothing.  What a check accepted is handed to the next check
(:mod:`ortpass.infra.checkers`).

Both modes know ONNX Runtime's own ops in the ONNX domain (``SimplifiedLayerNormalization``
and others, :mod:`ortpass.graph.schemas`), which ORT's fusions and gradient builder emit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx
import onnx_ir as ir

from ortpass.graph.schemas import register_ort_schemas
from ortpass.graph.weightless import proto_without_weights, weights_left_out

__all__ = ["CHECK_MODES", "CheckedState", "full_check", "full_check_weight_by_weight", "incremental_check", "input_check"]


#: The ``check`` modes of :class:`PassManager` (``True`` means ``"full"``, ``False`` ``"none"``).
CHECK_MODES = ("full", "incremental", "none")

_SUBGRAPH_ATTRIBUTES = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)

register_ort_schemas()


def full_check(model: ir.Model) -> onnx.ModelProto:
    """Serialize ``model`` and run the onnx checker on it; return the serialization."""
    return _checked_serialization(model)


def _checked_serialization(model: ir.Model) -> onnx.ModelProto:
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    return proto


def full_check_weight_by_weight(model: ir.Model) -> onnx.ModelProto | None:
    """The onnx checker on ``model`` as :func:`full_check` runs it, with the weights (the
    floating-point initializers that are graph inputs, as ORTModule's graphs have them)
    checked one tensor at a time and the rest of the model without them; returns the
    serialization where it is the whole model (no such weight), else None.
    ``check_model`` copies a model's bytes three times over (``ir.to_proto``,
    ``SerializeToString``, onnx's C++ parse): on an 80-layer LLaMA the host peak of
    ORTModule's first call was there; this holds one weight's.  The checker decides on a
    weight alone (``check_tensor``) and, in the graph, on its input's declared type and
    shape, which the proto without weights keeps."""
    weights = weights_left_out(model)
    if not weights:
        return _checked_serialization(model)
    for value in weights:
        if value.const_value is not None:
            onnx.checker.check_tensor(ir.serde.serialize_tensor(value.const_value))
    onnx.checker.check_model(proto_without_weights(model))
    return None


def _fingerprint(node: ir.Node, attributes: tuple[ir.Attr, ...]) -> tuple:
    """What ``onnx.checker.check_node`` reads of ``node`` once serialized, held so that a
    change shows: op, domain, overload, the input and output values, and the attributes
    (by identity: ``ir.Attr`` is immutable, so a changed attribute is a new object).

    The values are held by identity, not by name: ``check_node`` reads of a name only
    whether it is empty (an absent input), and :func:`_check_names`, which runs over the
    whole graph every time, hands back every node with an empty name to be checked.
    Reading every name made this the costliest part of an incremental check.
    """
    return (
        node.op_type,
        node.domain,
        node.overload,
        node.inputs,  # tuples, replaced (not changed) when the node is rewired or resized
        node.outputs,
        tuple(map(id, attributes)),
    )


def _signature(node: ir.Node, opsets: dict[str, int], keep_alive: list) -> tuple:
    """Everything of ``node`` that ``check_node`` decides on: op, domain and the opset
    version imported for it, overload, which inputs and outputs are present, and the
    attributes by value.  ``check_node`` reads nothing else (a node's name appears only in
    its messages), so a node whose signature it accepted once is accepted again, while
    the IR version stays the same.  Recompute clones and the layers of a deep model
    share signatures: on a 17.5k-node training graph the recompute pass adds 5.6k nodes
    and rewires more, 9.6k nodes to check, and they have 403 signatures (a Dropout's seed
    makes each its own).
    """
    return (
        node.op_type,
        node.domain,
        opsets.get(node.domain),
        node.overload,
        tuple(v is not None and v.name != "" for v in node.inputs),
        tuple(v.name != "" for v in node.outputs),
        tuple(_attribute_key(attr, keep_alive) for attr in node.attributes.data.values()),
    )


_PLAIN_ATTRIBUTES = (ir.AttributeType.INT, ir.AttributeType.FLOAT, ir.AttributeType.STRING)
_PLAIN_LIST_ATTRIBUTES = (ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS)


def _attribute_key(attr: ir.Attr, keep_alive: list) -> tuple:
    """An attribute by value where the value is a number, a string or a list of them; by
    identity otherwise (a tensor: comparing it would cost as much as checking it), the
    object kept alive in ``keep_alive`` so that no other can take its id."""
    if not attr.is_ref():
        if attr.type in _PLAIN_ATTRIBUTES:
            return (attr.name, attr.type, attr.value)
        if attr.type in _PLAIN_LIST_ATTRIBUTES:
            return (attr.name, attr.type, tuple(attr.value))
    keep_alive.append(attr)
    return (attr.name, attr.type, id(attr))


def _io_fingerprint(value: ir.Value) -> tuple:
    """What ``check_value_info`` reads of a graph input or output: its name and type, and
    its shape's dims (an ``ir.Shape`` can change in place)."""
    shape = value.shape
    return (value.name, value.type, None if shape is None else tuple(shape.dims))


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
    # Graph inputs and outputs -> what check_value_info accepted of them.
    io: dict[ir.Value, tuple] = dataclasses.field(default_factory=dict)
    # The node signatures check_node accepted under this IR version (each signature holds
    # its domain's opset version), and the attributes their keys name by id.
    signatures: set[tuple] = dataclasses.field(default_factory=set)
    signature_attributes: list[ir.Attr] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, model: ir.Model) -> CheckedState:
        nodes = {}
        attributes = []
        for node in model.graph:
            # onnx_ir's Attributes is a collections.UserDict: its ``data`` dict iterates
            # without the Mapping machinery's calls per item, in half the time.
            attrs = tuple(node.attributes.data.values())
            nodes[node] = _fingerprint(node, attrs)
            if attrs:
                attributes.append(attrs)
        tensors = {name: value.const_value for name, value in model.graph.initializers.items()}
        io = {value: _io_fingerprint(value) for value in (*model.graph.inputs, *model.graph.outputs)}
        return cls(model.ir_version, dict(model.opset_imports), nodes, tensors, attributes, io)

    def rebased(self, model: ir.Model) -> CheckedState:
        """The state of ``model``, a copy of the model this state was taken of: the copy's
        nodes count as checked, and the signatures accepted stay accepted."""
        state = CheckedState.of(model)
        state.signatures = self.signatures
        state.signature_attributes = self.signature_attributes
        return state


def incremental_check(model: ir.Model, previous: CheckedState | None) -> CheckedState:
    """Raise ``onnx.checker.ValidationError`` where ``onnx.checker.check_model`` would
    reject ``model``, looking again only at what changed since ``previous`` was accepted
    (everything when ``previous`` is None).

    Checked on the IR, without serializing the model: the checker's rules on names over
    the whole graph (see :func:`_check_names`), ``check_value_info`` on the graph inputs
    and outputs that are new or changed, ``check_tensor`` on initializers that are new,
    and ``check_node`` on nodes that are new or whose op, domain, overload, attributes,
    or inputs or outputs changed, unless it accepted a node of the same signature before
    (see :func:`_signature`).  ``check_node`` reads nothing else of a node but the
    model's IR version and opset imports, so a node it accepted is still accepted while
    those stay the same.  Falls back to :func:`full_check` when the IR version changed,
    an opset import changed or went away (domains only added are checked incrementally),
    the model has functions, a checked node holds a subgraph (its
    check needs the enclosing scope, which onnx's Python API does not take), or the IR
    version is 3 or older (initializers must then be graph inputs).
    """
    state = CheckedState.of(model)
    changed = [n for n, fp in state.nodes.items() if previous is None or previous.nodes.get(n) != fp]
    if _needs_full_check(model, state, previous, changed):
        full_check(model)
        return state
    if previous is not None:
        state.signatures = previous.signatures
        state.signature_attributes = previous.signature_attributes
    ctx = onnx.checker.C.CheckerContext()
    ctx.ir_version = model.ir_version
    ctx.opset_imports = state.opsets
    if not model.graph.name:  # check_graph's first rule
        raise onnx.checker.ValidationError("Field 'name' of 'graph' is required to be non-empty.")
    changed.extend(_check_names(model.graph))
    for value, fingerprint in state.io.items():
        if previous is None or previous.io.get(value) != fingerprint:
            onnx.checker.check_value_info(ir.serde.serialize_value(value), ctx)
    for name, tensor in state.tensors.items():
        if tensor is not None and (previous is None or previous.tensors.get(name) is not tensor):
            onnx.checker.check_tensor(ir.serde.serialize_tensor(tensor), ctx)
    for node in changed:
        signature = _signature(node, state.opsets, state.signature_attributes)
        if signature not in state.signatures:
            _check_node(node, ctx)
            state.signatures.add(signature)
    return state


def input_check(model: ir.Model) -> CheckedState:
    """Raise ``onnx.checker.ValidationError`` where ``onnx.checker.check_model`` would
    reject ``model``, without serializing its graph: the model-level rules (IR version,
    opset imports, metadata) by the checker itself on the model with an empty graph, the
    graph's rules by :func:`incremental_check` with nothing accepted before.

    Serializing is most of a full check's cost (``ir.to_proto`` took 0.65 of 0.85 s on a
    17.5k-node training graph); this check took 0.18-0.3 s there.
    """
    state = incremental_check(model, None)
    onnx.checker.check_model(_header(model))
    return state


def _header(model: ir.Model) -> onnx.ModelProto:
    """``model`` serialized without its graph's contents (the graph keeps its name,
    which the checker requires): what ``check_model`` reads outside ``check_graph``."""
    graph = ir.Graph([], [], nodes=[], name=model.graph.name, opset_imports=model.opset_imports)
    header = ir.Model(
        graph,
        ir_version=model.ir_version,
        producer_name=model.producer_name,
        producer_version=model.producer_version,
        domain=model.domain,
        model_version=model.model_version,
        metadata_props=dict(model.metadata_props),
    )
    return ir.to_proto(header)


def _needs_full_check(
    model: ir.Model, state: CheckedState, previous: CheckedState | None, changed: list[ir.Node]
) -> bool:
    if model.functions or model.ir_version <= 3:
        return True
    if previous is not None and (state.ir_version != previous.ir_version or _opsets_changed(previous.opsets, state.opsets)):
        return True
    return any(attr.type in _SUBGRAPH_ATTRIBUTES for node in changed for attr in node.attributes.data.values())


def _opsets_changed(before: dict[str, int], after: dict[str, int]) -> bool:
    """A domain imported before is imported at another version now, or not at all: the
    verdict on nodes already accepted may change.  A domain only added changes none (a
    node's check reads the version of its own domain); the gradient build adds six, and
    checking its 50k-node output in full took 2.6 s where an incremental check, with
    every node new, takes a fraction of that."""
    return any(after.get(domain) != version for domain, version in before.items())


def _check_node(node: ir.Node, ctx: Any) -> None:
    try:
        proto = ir.serde.serialize_node(node)
        onnx.checker.C.check_node(proto.SerializeToString(), ctx, onnx.checker.LEXICAL_SCOPE_CONTEXT)
    except Exception as exc:
        # Worded as check_model words it, so both modes name a bad node alike.
        raise onnx.checker.ValidationError(
            f"{exc}\n\n==> Context: Bad node spec for node. Name: {node.name} OpType: {node.op_type}"
        ) from exc


def _check_names(graph: ir.Graph) -> list[ir.Node]:
    """onnx.checker's rules on value names (``check_graph`` in onnx's checker.cc), on the
    IR: graph input names are unique, every non-empty input name of a node is a graph
    input, an initializer or an output of an earlier node (topological order), every
    non-empty output name is new (single static assignment), every graph output is
    defined.  Written here because onnx checks names only on a serialized graph, which
    is what this check avoids building; onnx_ir has no such check.  A value without a
    name cannot be serialized at all, so it is refused too.

    Returns the nodes with a value named "" (read by the checker as an absent input or
    output, which ``check_node`` refuses where the op requires one), for ``check_node``
    to see whatever their fingerprint says.
    """
    defined: set[str] = set()
    unnamed: list[ir.Node] = []
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
            if value is None:
                continue
            name = value.name
            if not name:
                _serialized_name(value)  # refuses None
                unnamed.append(node)
            elif name not in defined:
                raise onnx.checker.ValidationError(
                    f"Nodes in a graph must be topologically sorted, however input '{value.name}' of node: "
                    f"name: {node.name} OpType: {node.op_type} is not output of any previous nodes."
                )
        for value in node.outputs:
            name = value.name
            if not name:
                _serialized_name(value)  # refuses None
                unnamed.append(node)
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
    return unnamed


def _serialized_name(value: ir.Value) -> str:
    if value.name is None:
        raise onnx.checker.ValidationError(f"a value has no name, so the model cannot be serialized: {value!r}")
    return value.name
