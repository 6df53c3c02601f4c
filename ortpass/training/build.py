"""Build the forward+backward graph with ONNX Runtime's gradient builder.

ORT's C++ gradient builder (``GradientGraphBuilder`` in the training build) knows the
gradient of every op ORT can train, including the com.microsoft ones (PythonOp included);
writing our own would duplicate thousands of lines of gradient definitions.  What ortpass
adds around it:

- the outputs the builder needs but torch 2.15 omits (LayerNormalization's Mean and
  InvStdDev, SoftmaxCrossEntropyLoss's log_prob, Dropout's mask);
- parameters made graph inputs, as the builder requires (their values stay initializers,
  so the model is self-contained and ORT treats them as overridable defaults);
- the IR version clamped to what ORT 1.19.2 loads;
- the gradient of a broadcast ``Where`` input (or ``Pow`` base) reduced to the input's
  shape, which ORT 1.19.2's builder forgets (:func:`reduce_broadcast_gradients`), and every
  parameter's gradient checked to have the parameter's shape;
- an explicit forward/backward partition recorded in the result
  (:mod:`ortpass.analysis.partition`), and shapes on the forward values analyses read.
"""

from __future__ import annotations

import logging
import re
from typing import Sequence

import onnx
import onnx.numpy_helper
import onnx_ir as ir

from ortpass.analysis.partition import TrainingInfo, set_training_info, tag
from ortpass.conventions import MAX_ORT_IR_VERSION, MAX_ORT_OPSET, MS_DOMAIN, SIDE_KEY, is_onnx_domain
from ortpass.errors import TrainingGraphError
from ortpass.graph.schemas import register_ort_schemas
from ortpass.graph.weightless import proto_with_placeholders
from ortpass.infra.metadata import get_export_info
from ortpass.infra.validate import check_for_gradient_build
from ortpass.training.backend import require_training_build
from ortpass.training.detached_weights import reattach, without_detached
from ortpass.training.forward_checks import (
    check_forward_model,
    check_recorded_params,
    check_static_dims,
    resolve_differentiated_inputs,
    resolve_loss_or_outputs,
    resolve_params,
)
from ortpass.training.inference_batch_norm import decompose_inference_batch_norms
from ortpass.training.gradients import (
    check_gradient_outputs,
    check_gradient_shapes,
    reduce_broadcast_gradients,
)
from ortpass.training.padding_rows import mask_padding_rows
from ortpass.training.shapes import (
    infer_forward_shapes,
    infer_shapes,
    ort_message,
    shape_concat_training_lengths,
)

__all__ = ["build_training_graph", "clamp_for_ort"]

logger = logging.getLogger(__name__)

# onnx's shape inference then gives SimplifiedLayerNormalization's InvStdDev a shape.
register_ort_schemas()

def build_training_graph(
    model: ir.Model,
    *,
    params: Sequence[str] | None = None,
    loss: str | None = None,
    outputs_with_grad: Sequence[str] | None = None,
    inputs_with_grad: Sequence[str] | None = None,
    ort_fusions: bool = True,
) -> ir.Model:
    """Return a new model computing the loss and ``<param>_grad`` for every parameter.

    Two kinds of graph.  From a loss (the default), backward starts from the loss's
    gradient, ones, and the graph is a whole training step.  From outputs
    (``outputs_with_grad``, or recorded at export with no loss), the gradient of each of
    those outputs is a graph input ``<output>_grad`` that the caller computes (the loss is
    the caller's code, as when a training loop computes it in torch from the logits).

    Args:
        model: a forward+loss model (e.g. from ``ortpass.export.export``); not modified.
        params: names of the initializers (or inputs) to differentiate; default: the
            trainable parameters recorded at export, else every floating-point initializer
            that is not a scalar.
        loss: the scalar loss output; default: the one recorded at export, else ``loss``,
            else the only graph output.
        outputs_with_grad: build from these outputs instead of a loss (default: as
            recorded at export).
        inputs_with_grad: graph inputs that also get a gradient, ``<input>_grad`` (default:
            as recorded at export; none).
        ort_fusions: first run ORT's pre-gradient graph transformers, as ORTModule did:
            they fuse torch's decomposed ops (the exact GELU's Div/Erf/Add/Mul/Mul into
            one ``com.microsoft::Gelu``, whose gradient stashes one tensor instead of
            four) and fold shape arithmetic.  Measured on a 4-layer decoder
            (benchmarks/recompute_memory.py): step peak 784 -> 656 MiB without recompute,
            269 -> 237 MiB with layer-wise recompute.  Pass False to differentiate the
            graph exactly as exported.

    Raises:
        TrainingGraphError: the loss or a parameter cannot be found, the opset is newer
            than ORT 1.19.2 loads, or ORT's gradient builder refuses the graph.
        ModelLoadError: the model has no nodes, local functions, a subgraph reading a
            parameter, or malformed metadata (:func:`ortpass.infra.validate.check_for_gradient_build`).
    """
    # The declared shapes are checked on the pipeline's input (the pass's check_input);
    # here only what ORT would report as its own internals, or get wrong.
    check_for_gradient_build(model, params, shapes=False)
    if params is None:
        check_recorded_params(model)
    export_info = get_export_info(model)
    params = params if params is not None else export_info.get("params")
    proto, detached = proto_with_placeholders(model, params)  # weights that are graph inputs: placeholders to the end
    logger.debug("gradient build: %d parameters' values detached from the protos", len(detached))
    loss, outputs_with_grad = resolve_loss_or_outputs(proto, export_info, loss, outputs_with_grad)
    params = resolve_params(proto, params)
    inputs_with_grad = resolve_differentiated_inputs(
        proto, inputs_with_grad if inputs_with_grad is not None else export_info.get("inputs_with_grad", []), params
    )
    check_forward_model(proto, loss)
    if any(node.op_type == "PythonOp" for node in proto.graph.node):
        from ortpass.pythonop import (
            bridge,  # only models with PythonOps need torch here
        )

        # Before ORT sees the graph: ORT's symbolic shape inference and gradient builder
        # call back into the registered Functions, and a bad PythonOp gets named here.
        bridge.prepare(model)
    clamp_for_ort(proto)
    _remove_inference_dropouts(proto)
    # Shapes first: ORT keeps the shapes it is given through its fusions, but its symbolic
    # inference has no rule for the ConcatTraining those fusions emit.
    proto = without_detached(infer_forward_shapes, proto, detached)
    check_static_dims(proto)
    decompose_inference_batch_norms(proto)
    if ort_fusions:
        proto = _run_pre_gradient_transformers(proto, params)
    _add_outputs_the_gradient_builder_needs(proto)
    _isolate_differentiated_outputs(proto, outputs_with_grad)
    forward_names = _ensure_unique_node_names(proto)
    _make_params_inputs(proto, params, loss or outputs_with_grad)
    training_proto = _run_gradient_builder(proto, loss, [*params, *inputs_with_grad], outputs_with_grad)
    seeds = _make_seeds_inputs(training_proto, outputs_with_grad)
    _name_unread_pythonop_grad_outputs(training_proto)
    reduce_broadcast_gradients(training_proto, forward_names)
    mask_padding_rows(training_proto, model)
    clamp_for_ort(training_proto)
    training_proto = without_detached(infer_shapes, training_proto, detached)
    shape_concat_training_lengths(training_proto)
    gradients = check_gradient_outputs(training_proto, params)
    input_gradients = check_gradient_outputs(training_proto, inputs_with_grad)
    check_gradient_shapes(training_proto, gradients)
    _order_outputs(training_proto, [*([loss] if loss else outputs_with_grad), *gradients.values(), *input_gradients.values()])
    training = ir.from_proto(training_proto)
    del training_proto
    reattach(training, model, detached)
    _tag_sides(training, forward_names)
    training.metadata_props.update(model.metadata_props)
    set_training_info(training, TrainingInfo(loss, tuple(params), gradients, seeds, input_gradients))
    # Counted on the result: the builder turns Constant nodes into initializers.
    forward_count = sum(node.metadata_props[SIDE_KEY] == "forward" for node in training.graph)
    logger.info(
        "built training graph: %d forward + %d backward nodes, %d gradients",
        forward_count,
        len(training.graph) - forward_count,
        len(gradients),
    )
    return training


def clamp_for_ort(proto: onnx.ModelProto) -> None:
    """Clamp the IR version to ORT 1.19.2's maximum; refuse ai.onnx opsets it cannot load."""
    for opset in proto.opset_import:
        if is_onnx_domain(opset.domain) and opset.version > MAX_ORT_OPSET:
            raise TrainingGraphError(
                f"ai.onnx opset {opset.version} is newer than ONNX Runtime 1.19.2 loads (at most "
                f"{MAX_ORT_OPSET}); export with opset <= {MAX_ORT_OPSET}"
            )
    # onnx >= 1.17 writes IR versions ORT 1.19.2 rejects; nothing we emit needs more than 10.
    proto.ir_version = min(proto.ir_version or MAX_ORT_IR_VERSION, MAX_ORT_IR_VERSION)


def _add_outputs_the_gradient_builder_needs(proto: onnx.ModelProto) -> None:
    """Add optional outputs torch omits but ORT's gradient builder reads."""
    needed = {
        ("", "LayerNormalization"): 3,  # Y, Mean, InvStdDev
        ("", "SoftmaxCrossEntropyLoss"): 2,  # loss, log_prob
        (MS_DOMAIN, "SoftmaxCrossEntropyLossInternal"): 2,
        ("", "Dropout"): 2,  # output, mask
    }
    for index, node in enumerate(proto.graph.node):
        count = needed.get((node.domain if node.domain != "ai.onnx" else "", node.op_type))
        if count is None:
            continue
        stem = node.output[0] or f"{node.op_type}_{index}"
        while len(node.output) < count:
            node.output.append(f"{stem}_ortpass_out{len(node.output)}")
        for position in range(count):
            if not node.output[position]:
                node.output[position] = f"{stem}_ortpass_out{position}"


def _remove_inference_dropouts(proto: onnx.ModelProto) -> int:
    """Replace every Dropout whose ``training_mode`` is omitted or a constant false by what
    it computes, the identity (and an all-true mask); returns how many.

    ORT's ``DropoutGrad`` ignores ``training_mode``: it always multiplies by the mask and
    scales by ``1 / (1 - ratio)`` (measured on 1.19.2; docs/design/ort-facts.md), so the
    gradient of an inference-mode Dropout, the identity in forward, came out scaled in
    backward, and differently again once a pass replaced that DropoutGrad.  torch's
    export of SDPA with dropout wrote such Dropouts (issue #21).
    """
    constants = {t.name: t for t in proto.graph.initializer}
    constants.update(
        (node.output[0], node.attribute[0].t)
        for node in proto.graph.node
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value"
    )
    nodes, removed = [], 0
    for node in proto.graph.node:
        if node.op_type != "Dropout" or not is_onnx_domain(node.domain) or not _is_inference_mode(node, constants):
            nodes.append(node)
            continue
        stem = node.name or node.output[0]
        nodes.append(onnx.helper.make_node("Identity", [node.input[0]], [node.output[0]], name=f"{stem}_inference_identity"))
        if len(node.output) > 1 and node.output[1]:
            shape = f"{stem}_inference_shape"
            nodes.append(onnx.helper.make_node("Shape", [node.input[0]], [shape], name=shape))
            nodes.append(onnx.helper.make_node(
                "ConstantOfShape", [shape], [node.output[1]], name=f"{stem}_inference_mask",
                value=onnx.helper.make_tensor("true", onnx.TensorProto.BOOL, [1], [True]),
            ))
        removed += 1
    if removed:
        del proto.graph.node[:]
        proto.graph.node.extend(nodes)
        logger.info("replaced %d inference-mode Dropout(s) by Identity", removed)
    return removed


def _is_inference_mode(dropout: onnx.NodeProto, constants: dict[str, onnx.TensorProto]) -> bool:
    if len(dropout.input) < 3 or not dropout.input[2]:
        return True
    mode = constants.get(dropout.input[2])
    return mode is not None and not bool(onnx.numpy_helper.to_array(mode).item())


def _ensure_unique_node_names(proto: onnx.ModelProto) -> set[str]:
    seen: set[str] = set()
    for index, node in enumerate(proto.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_ortpass_{index}"
        seen.add(node.name)
    return seen


def _make_params_inputs(proto: onnx.ModelProto, params: Sequence[str], differentiated: str | Sequence[str]) -> None:
    existing = {i.name for i in proto.graph.input}
    initializers = {init.name: init for init in proto.graph.initializer}
    read = {name for node in proto.graph.node for name in node.input}
    for name in params:
        # ORT's transformers drop initializers nothing reads; its gradient builder fails on
        # one with "couldn't find the consumer node".
        if name not in read:
            raise TrainingGraphError(f"parameter {name!r} does not affect {_described(differentiated)}: nothing reads it")
        if name in existing:
            continue
        init = initializers[name]
        proto.graph.input.append(onnx.helper.make_tensor_value_info(name, init.data_type, list(init.dims)))


def _run_pre_gradient_transformers(proto: onnx.ModelProto, params: Sequence[str]) -> onnx.ModelProto:
    require_training_build("ortpass.training.build_training_graph (ORT's pre-gradient transformers, ort_fusions=True)")
    from onnxruntime.capi import _pybind_state as C

    options = C.SessionOptions()
    options.log_severity_level = 3
    try:
        # The parameters are named so that constant folding leaves them alone.
        return onnx.load_from_string(C.get_optimized_model(proto.SerializeToString(), set(params), options))
    except Exception as exc:
        raise TrainingGraphError(f"ONNX Runtime's pre-gradient transformers failed: {ort_message(exc)}") from exc


def _described(differentiated: str | Sequence[str]) -> str:
    if isinstance(differentiated, str):
        return f"the loss {differentiated!r}"
    return f"the outputs {list(differentiated)}"


def _run_gradient_builder(
    proto: onnx.ModelProto, loss: str | None, xs: Sequence[str], outputs: Sequence[str]
) -> onnx.ModelProto:
    """ORT's builder differentiates ``loss`` (seeded with ones) or, without one, ``outputs``
    (their gradients left as names the graph does not define, ``<output>_grad``)."""
    require_training_build("ortpass.training.build_training_graph (ORT's gradient builder)")
    from onnxruntime.capi import _pybind_state as C

    options = C.SessionOptions()
    options.log_severity_level = 3
    ys = {loss} if loss else set(outputs)
    try:
        builder = C.GradientGraphBuilder(proto.SerializeToString(), ys, set(xs), loss or "", options)
        builder.build()
        return onnx.load_from_string(builder.get_model())
    except Exception as exc:  # ORT raises RuntimeError/Fail/InvalidGraph with its message
        message = ort_message(exc)
        missing = _NO_GRADIENT.search(message)
        if missing:
            raise TrainingGraphError(
                f"ONNX Runtime has no gradient for {missing.group(1)} (node {missing.group(2)!r}): ORT's gradient "
                "builder cannot differentiate this model; replace that op, or run the module in torch "
                "(ORTModule(..., fallback='torch'))"
            ) from exc
        raise TrainingGraphError(f"ONNX Runtime's gradient builder failed: {message}") from exc


def _isolate_differentiated_outputs(proto: onnx.ModelProto, outputs: Sequence[str]) -> None:
    """Give each differentiated output that a node also reads its own ``Identity``.

    ORT's builder names the gradient of value ``v`` ``v_grad``: for an output that the
    graph reads too (logits returned and fed to an in-graph loss), the gradient from
    those readers would take the name of the caller's gradient input.  Behind an
    Identity, the output's gradient is the caller's alone, and the builder sums it with
    the readers' into the value's.
    """
    read = {name for node in proto.graph.node for name in node.input}
    for name in outputs:
        if name not in read:
            continue
        inner = f"{name}_ortpass_value"
        for node in proto.graph.node:
            node.input[:] = [inner if i == name else i for i in node.input]
            node.output[:] = [inner if o == name else o for o in node.output]
        proto.graph.node.append(onnx.helper.make_node("Identity", [inner], [name], name=f"{name}_ortpass_output"))


def _make_seeds_inputs(proto: onnx.ModelProto, outputs: Sequence[str]) -> dict[str, str]:
    """Make the gradient of each differentiated output a graph input typed like the output."""
    declared = {o.name: o for o in proto.graph.output}
    read = {name for node in proto.graph.node for name in node.input}
    seeds = {}
    for name in outputs:
        seed = f"{name}_grad"
        if seed not in read:
            raise TrainingGraphError(f"the gradient builder left output {name!r} without gradient: no parameter affects it")
        seed_input = onnx.ValueInfoProto()
        seed_input.CopyFrom(declared[name])
        seed_input.name = seed
        proto.graph.input.append(seed_input)
        seeds[name] = seed
    return seeds


_NO_GRADIENT = re.compile(r"gradient builder has not been registered: (\S+) for node (\S+)")


def _name_unread_pythonop_grad_outputs(proto: onnx.ModelProto) -> None:
    """Give every PythonOpGrad one named output per ``output_tensor_types`` entry.

    ORT's builder leaves the gradient of a non-differentiable input (an attention mask)
    unnamed.  An unnamed *trailing* output is dropped when the model is serialized, and
    ORT 1.19.2 then refuses its own node: "PythonOpGrad's output list and
    "output_tensor_types" attribute should have the same length".
    """
    for node in proto.graph.node:
        if node.op_type != "PythonOpGrad" or node.domain != MS_DOMAIN:
            continue
        types = next((list(a.ints) for a in node.attribute if a.name == "output_tensor_types"), [])
        while len(node.output) < len(types):
            node.output.append("")
        for index, name in enumerate(node.output):
            if not name:
                node.output[index] = f"{node.name}_unread_output_{index}"


def _order_outputs(proto: onnx.ModelProto, first: Sequence[str]) -> None:
    """Put the graph outputs named in ``first`` first, in that order (the rest after them,
    as they were).  ORT's gradient builder takes the parameters as a set and emits their
    gradients in its iteration order, which follows Python's string hashing: without this,
    the same model built twice came out in different bytes."""
    rank = {name: i for i, name in enumerate(first)}
    ordered = sorted(proto.graph.output, key=lambda o: rank.get(o.name, len(rank)))
    del proto.graph.output[:]
    proto.graph.output.extend(ordered)


def _tag_sides(training: ir.Model, forward_names: set[str]) -> None:
    produced_by_backward: set[int] = set()
    for node in training.graph:
        side = "forward" if node.name in forward_names else "backward"
        if side == "forward" and any(id(v) in produced_by_backward for v in node.inputs if v is not None):
            raise TrainingGraphError(f"forward node {node.name!r} reads a backward value; the partition is unsound")
        if side == "backward":
            produced_by_backward.update(id(v) for v in node.outputs)
        tag(node, side)
