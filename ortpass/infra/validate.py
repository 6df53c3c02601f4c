"""Input validation: refuse, before any pass runs, a model that is malformed in a way the
passes would only stumble on later, with one line naming the node, value or key.

Two levels:

* :func:`check_model` - what every pipeline and ``ortpass report`` relies on: ortpass's
  own metadata is well formed (:func:`ortpass.infra.metadata.get_export_info`) and every
  ``com.microsoft::PythonOp``'s attributes have the types ORT's schema gives them.
* :func:`check_for_gradient_build` - what ORT's gradient builder cannot differentiate, or
  would differentiate wrongly: an empty graph, model-local functions, a control-flow
  subgraph that reads a parameter from the outer scope, and declared shapes that
  contradict each other (onnx's strict shape inference).  (Whether a PythonOp's Function
  is registered is asked by the build itself: pre-grad passes remove some PythonOps.)  The gradient-build pass runs
  it on the pipeline's input (:meth:`PassDeclarations.check_input`), so a bad model is bad
  input (exit 2), not a failed pass.

Every check raises :class:`~ortpass.errors.ModelLoadError`.
"""

from __future__ import annotations

import logging
import re
from typing import Sequence

import onnx
import onnx_ir as ir

from ortpass.conventions import MS_DOMAIN
from ortpass.errors import ModelLoadError, elide
from ortpass.infra.metadata import get_export_info

__all__ = [
    "REQUIRED_PYTHONOP_ATTRIBUTES",
    "check_declared_shapes",
    "check_for_gradient_build",
    "check_model",
    "params_of",
    "refuse_pythonop_missing_attributes",
]

logger = logging.getLogger(__name__)


# ORT's PythonOp / PythonOpGrad attribute schema (onnxruntime's contrib_defs.cc): the
# attributes ortpass and ORT read, by type.  Others are let through.
_PYTHONOP_ATTRIBUTE_TYPES = {
    **dict.fromkeys(("func_name", "input_convention", "output_convention", "comment"), ir.AttributeType.STRING),
    **dict.fromkeys(("training_mode", "safe_run_mode"), ir.AttributeType.INT),
    **dict.fromkeys(("input_float_scalars", "input_float_tuples"), ir.AttributeType.FLOATS),
    **dict.fromkeys(
        (
            "input_requires_grads", "input_tensor_types", "input_tensor_ranks", "output_tensor_types",
            "output_tensor_ranks", "output_tensor_requires_grads", "input_int_scalars", "input_int_scalar_positions",
            "input_float_scalar_positions", "input_int_tuples", "input_int_tuple_positions", "input_int_tuple_begins",
            "input_float_tuple_positions", "input_float_tuple_begins", "input_pointer_scalars",
            "input_pointer_scalar_positions",
        ),
        ir.AttributeType.INTS,
    ),
}


#: Attributes ORT's PythonOp kernel cannot run without (docs/design/ort-facts.md):
#: the Function to call, how its arguments map to inputs, and its outputs' types and ranks.
REQUIRED_PYTHONOP_ATTRIBUTES = ("func_name", "input_convention", "output_tensor_types", "output_tensor_ranks")


def _node_label(node: ir.Node) -> str:
    return f"{node.name!r} ({node.op_type})" if node.name else f"unnamed {node.op_type}"


def check_model(model: ir.Model) -> None:
    """Refuse malformed ortpass metadata, text attributes that are not UTF-8, and
    PythonOp attributes of the wrong type."""
    get_export_info(model)
    for node in model.graph.all_nodes():
        _check_text_attributes(node)
        if node.domain == MS_DOMAIN and node.op_type in ("PythonOp", "PythonOpGrad"):
            _check_pythonop_attributes(node)
        refuse_pythonop_missing_attributes(node)


def refuse_pythonop_missing_attributes(node: ir.Node) -> None:
    """A PythonOp without an attribute ORT needs, named with the attribute (otherwise it
    would surface as a call to an unregistered Function named '')."""
    if node.domain != MS_DOMAIN or node.op_type != "PythonOp":
        return
    missing = [name for name in REQUIRED_PYTHONOP_ATTRIBUTES if name not in node.attributes]
    if missing:
        raise ModelLoadError(
            f"PythonOp node {node.name or '<unnamed>'!r} lacks the required attribute(s) {missing}; "
            "export it with ortpass.export.export, which writes every attribute ORT's kernel reads"
        )


def _check_text_attributes(node: ir.Node) -> None:
    """onnx_ir keeps a STRING attribute that is not UTF-8 as bytes and then cannot write
    the model back; ONNX requires UTF-8."""
    for name, attr in node.attributes.items():
        if attr.type == ir.AttributeType.STRING and not isinstance(attr.value, str):
            raise ModelLoadError(
                f"node {_node_label(node)}: attribute {name!r} is not UTF-8 text ({elide(repr(attr.value), 80)})"
            )
        if attr.type == ir.AttributeType.STRINGS and not all(isinstance(v, str) for v in attr.value):
            raise ModelLoadError(f"node {_node_label(node)}: attribute {name!r} holds text that is not UTF-8")


def _check_pythonop_attributes(node: ir.Node) -> None:
    for name, attr in node.attributes.items():
        expected = _PYTHONOP_ATTRIBUTE_TYPES.get(name)
        if expected is None:
            continue
        if attr.type != expected:
            raise ModelLoadError(
                f"{node.op_type} node {_node_label(node)}: attribute {name!r} must be {expected.name}, not {attr.type.name}"
            )
        if expected == ir.AttributeType.STRING and not isinstance(attr.value, str):
            # onnx_ir keeps a STRING that is not UTF-8 as bytes.
            raise ModelLoadError(
                f"{node.op_type} node {_node_label(node)}: attribute {name!r} is not UTF-8 text "
                f"({elide(repr(attr.value), 80)})"
            )
    func_name = node.attributes.get("func_name")
    if func_name is not None and not func_name.value:
        raise ModelLoadError(f"{node.op_type} node {_node_label(node)}: attribute 'func_name' is empty")


def check_for_gradient_build(
    model: ir.Model, params: Sequence[str] | None = None, *, shapes: bool = True, proto: onnx.ModelProto | None = None
) -> None:
    """Refuse what ORT's gradient builder cannot differentiate (see the module docstring).

    ``params``: the parameters to differentiate; None: those the gradient build would pick
    (recorded at export, else every floating-point initializer that is not a scalar).
    ``shapes``: also run :func:`check_declared_shapes` on ``proto``, ``model`` serialized
    (serialized here if not given).
    """
    check_model(model)
    graph = model.graph
    if len(graph) == 0:
        raise ModelLoadError("the graph has no nodes: there is no loss to differentiate")
    if model.functions:
        names = ", ".join(f"{d}::{n}" for d, n, _ in list(model.functions)[:5])
        raise ModelLoadError(
            f"the model defines {len(model.functions)} local function(s) ({names}), which ORT's gradient "
            "builder cannot differentiate; inline them first (onnx.inliner.inline_local_functions)"
        )
    _refuse_subgraphs_reading(graph, set(params_of(model, params)))
    if shapes:
        check_declared_shapes(proto if proto is not None else ir.to_proto(model))


def params_of(model: ir.Model, params: Sequence[str] | None = None) -> list[str]:
    """The parameters the gradient build differentiates: ``params`` when given, else those
    recorded at export, else every floating-point initializer that is not a scalar."""
    if params is not None:
        return list(params)
    recorded = get_export_info(model).get("params")
    if recorded is not None:
        return recorded
    return [
        name
        for name, value in model.graph.initializers.items()
        if value.dtype is not None and value.dtype.is_floating_point() and value.shape is not None and value.shape.rank() > 0
    ]


def _refuse_subgraphs_reading(graph: ir.Graph, params: set[str]) -> None:
    """A Loop/If/Scan body that reads a parameter from the outer scope: ORT's gradient
    builder does not follow it, and would call the parameter unused (or drop its share)."""
    for node in graph:
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                subgraphs = [attr.value]
            elif attr.type == ir.AttributeType.GRAPHS:
                subgraphs = list(attr.value)
            else:
                continue
            for subgraph in subgraphs:
                read = _outer_reads(subgraph) & params
                if read:
                    raise ModelLoadError(
                        f"node {_node_label(node)}: its subgraph {attr.name!r} reads the parameter(s) "
                        f"{sorted(read)[:5]} from the outer scope, which ORT's gradient builder does not "
                        "differentiate through; pass the parameter as an explicit input, or leave it out of params"
                    )


def _outer_reads(subgraph: ir.Graph) -> set[str]:
    """Names of the outer-scope values read anywhere inside ``subgraph`` (nested too)."""
    nodes = list(ir.traversal.RecursiveGraphIterator(subgraph))
    inner = {id(subgraph)} | {id(node.graph) for node in nodes}
    return {
        value.name
        for node in nodes
        for value in node.inputs
        if value is not None and value.graph is not None and id(value.graph) not in inner
    }


_INFERENCE_ERROR = re.compile(r"\(op_type:(?P<op>[^,]+), node name: (?P<node>[^)]*)\): (?P<what>.*)")


def check_declared_shapes(proto: onnx.ModelProto) -> None:
    """Refuse declared shapes and types that contradict each other (an input dim that
    disagrees with a weight, a value_info that contradicts what its node computes), by
    onnx's strict shape inference.  It costs ~1 ms on the golden models and 0.25 s on a
    20k-node forward graph (192 decoder layers, plus 0.15 s to serialize it) measured
    alone; on a loaded machine the gradient build's whole up-front check took 1.6 s of
    the default pipeline's 25 s there."""
    try:
        onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except onnx.shape_inference.InferenceError as exc:
        where = _initializer_declared_otherwise(proto) or _first_inference_error(str(exc))
        if "node " not in where and "initializer " not in where:
            where = _without_value_info(proto) or where
        raise ModelLoadError(f"the model's declared shapes are inconsistent: {where}") from None
    except (ValueError, onnx.checker.ValidationError) as exc:  # > 2 GiB, or a model the checker refuses
        logger.debug("shape consistency not checked: %s", exc)


def _initializer_declared_otherwise(proto: onnx.ModelProto) -> str | None:
    """An initializer whose dims contradict the shape declared for it (value_info or graph
    input): onnx's message then says only "dimension 0: (16) vs (32)"."""
    graph = proto.graph
    declared = {v.name: v for v in [*graph.value_info, *graph.input] if v.type.HasField("tensor_type")}
    for init in graph.initializer:
        info = declared.get(init.name)
        if info is None or not info.type.tensor_type.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in info.type.tensor_type.shape.dim]
        if len(dims) != len(init.dims) or any(d is not None and d != n for d, n in zip(dims, init.dims)):
            shown = [d if d is not None else "?" for d in dims]
            return f"initializer {init.name!r} holds a tensor of shape {list(init.dims)}, but its shape is declared {shown}"
    return None


def _without_value_info(proto: onnx.ModelProto) -> str | None:
    """The node strict inference refuses once the declared intermediate shapes are set
    aside: a message that names it, where the first did not."""
    bare = onnx.ModelProto()
    bare.CopyFrom(proto)
    del bare.graph.value_info[:]
    try:
        onnx.shape_inference.infer_shapes(bare, check_type=True, strict_mode=True)
    except onnx.shape_inference.InferenceError as exc:
        found = _first_inference_error(str(exc))
        return found if found.startswith("node ") else None
    return None


def _first_inference_error(text: str) -> str:
    """onnx lists every node downstream of the first bad one; the first names the cause."""
    for line in text.splitlines():
        match = _INFERENCE_ERROR.search(line)
        if match:
            what = match["what"].removeprefix("[ShapeInferenceError] ").removeprefix("[TypeInferenceError] ")
            return elide(f"node {match['node']!r} ({match['op']}): {what}", 400)
    return elide(" ".join(text.split()).removeprefix("[ShapeInferenceError] "), 400)
