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
  shape, which ORT 1.19.2's builder forgets (:func:`_reduce_broadcast_gradients`), and every
  parameter's gradient checked to have the parameter's shape;
- an explicit forward/backward partition recorded in the result
  (:mod:`ortpass.analysis.partition`), and shapes on the forward values analyses read.
"""

from __future__ import annotations

import logging
import re
from typing import Iterable, Sequence

import onnx
import onnx.numpy_helper
import onnx_ir as ir

from ortpass.analysis.partition import TrainingInfo, set_training_info, tag
from ortpass.conventions import (
    MAX_ORT_IR_VERSION,
    MAX_ORT_OPSET,
    MS_DOMAIN,
    SIDE_KEY,
    is_onnx_domain,
)
from ortpass.errors import TrainingGraphError
from ortpass.graph.schemas import register_ort_schemas
from ortpass.infra.metadata import get_export_info
from ortpass.infra.validate import check_for_gradient_build

__all__ = ["build_training_graph", "check_forward_model", "clamp_for_ort"]

logger = logging.getLogger(__name__)

# What ORT 1.19.2 loads (measured; docs/design/ort-facts.md).

# onnx's shape inference then gives SimplifiedLayerNormalization's InvStdDev a shape.
register_ort_schemas()

_FLOAT_TYPES = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}


def build_training_graph(
    model: ir.Model,
    *,
    params: Sequence[str] | None = None,
    loss: str | None = None,
    ort_fusions: bool = True,
) -> ir.Model:
    """Return a new model computing the loss and ``<param>_grad`` for every parameter.

    Args:
        model: a forward+loss model (e.g. from ``ortpass.export.export``); not modified.
        params: names of the initializers (or inputs) to differentiate; default: the
            trainable parameters recorded at export, else every floating-point initializer
            that is not a scalar.
        loss: the scalar loss output; default: the one recorded at export, else ``loss``,
            else the only graph output.
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
    export_info = get_export_info(model)
    proto = ir.to_proto(model)
    loss = _resolve_loss(proto, loss or export_info.get("loss"))
    params = _resolve_params(proto, params if params is not None else export_info.get("params"))
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
    proto = _infer_forward_shapes(proto)
    if ort_fusions:
        proto = _run_pre_gradient_transformers(proto, params)
    _add_outputs_the_gradient_builder_needs(proto)
    forward_names = _ensure_unique_node_names(proto)
    _make_params_inputs(proto, params, loss)
    training_proto = _run_gradient_builder(proto, loss, params)
    _name_unread_pythonop_grad_outputs(training_proto)
    _reduce_broadcast_gradients(training_proto, forward_names)
    clamp_for_ort(training_proto)
    training_proto = _infer_shapes(training_proto)
    _shape_concat_training_lengths(training_proto)
    gradients = _check_gradient_outputs(training_proto, params)
    _check_gradient_shapes(training_proto, gradients)
    _order_outputs(training_proto, [loss, *gradients.values()])

    training = ir.from_proto(training_proto)
    _tag_sides(training, forward_names)
    training.metadata_props.update(model.metadata_props)
    set_training_info(training, TrainingInfo(loss=loss, params=tuple(params), gradients=gradients))
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


def check_forward_model(proto: onnx.ModelProto, loss: str) -> None:
    """Refuse, naming the node and value, a forward model ORT's gradient builder would
    reject with a message about its own C++ internals (or a crash).

    Checked in one walk over the graph: every value is produced once; every node input is
    a graph input, an initializer or a node output; the graph is acyclic; every graph
    output is produced; the loss is a scalar (when its shape is declared); the labels of a
    softmax cross-entropy loss are integer class indices (when their type is known).
    """
    graph = proto.graph
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    producer = _producers(graph, defined)
    for index, node in enumerate(graph.node):
        for name in node.input:
            if name and name not in defined and name not in producer:
                raise TrainingGraphError(
                    f"node {_node_label(node, index)} reads {name!r}, which no node, graph input or initializer defines"
                )
    for output in graph.output:
        if output.name not in defined and output.name not in producer:
            raise TrainingGraphError(f"graph output {output.name!r} is produced by no node")
    _check_acyclic(graph, producer)
    _check_loss_is_scalar(graph, loss)
    _check_label_types(graph)


def _node_label(node: onnx.NodeProto, index: int) -> str:
    return f"{node.name!r} ({node.op_type})" if node.name else f"#{index} ({node.op_type}, unnamed)"


def _producers(graph: onnx.GraphProto, defined: set[str]) -> dict[str, int]:
    producer: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for name in node.output:
            if not name:
                continue
            if name in producer or name in defined:
                first = (
                    f"node {_node_label(graph.node[producer[name]], producer[name])}"
                    if name in producer
                    else "a graph input or initializer"
                )
                raise TrainingGraphError(
                    f"value {name!r} is defined twice: by {first} and by node {_node_label(node, index)}; "
                    "ONNX values have one producer"
                )
            producer[name] = index
    return producer


def _check_acyclic(graph: onnx.GraphProto, producer: dict[str, int]) -> None:
    """Kahn's algorithm over node indices; what it cannot order lies on or after a cycle."""
    nodes = graph.node
    consumers: dict[int, list[int]] = {}
    pending = [0] * len(nodes)
    for index, node in enumerate(nodes):
        sources = {producer[name] for name in node.input if name in producer}
        pending[index] = len(sources)
        for source in sources:
            consumers.setdefault(source, []).append(index)
    ready = [i for i, n in enumerate(pending) if n == 0]
    done = 0
    while ready:
        index = ready.pop()
        done += 1
        for consumer in consumers.get(index, ()):
            pending[consumer] -= 1
            if pending[consumer] == 0:
                ready.append(consumer)
    if done < len(nodes):
        stuck = [_node_label(nodes[i], i) for i, n in enumerate(pending) if n > 0]
        shown = ", ".join(stuck[:5]) + (f" and {len(stuck) - 5} more" if len(stuck) > 5 else "")
        raise TrainingGraphError(f"the graph has a cycle: nodes {shown} are on it or read from it")


def _check_loss_is_scalar(graph: onnx.GraphProto, loss: str) -> None:
    output = next(o for o in graph.output if o.name == loss)
    if not output.type.tensor_type.HasField("shape"):
        return  # undeclared: the gradient builder will tell
    dims = output.type.tensor_type.shape.dim
    if any(not (d.HasField("dim_value") and d.dim_value == 1) for d in dims):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
        raise TrainingGraphError(
            f"loss {loss!r} is not a scalar (declared shape {shape}); reduce it (e.g. ReduceMean) before "
            "building the gradient"
        )


_LOSS_OPS = {("", "SoftmaxCrossEntropyLoss"), (MS_DOMAIN, "SoftmaxCrossEntropyLossInternal")}
_LABEL_TYPES = {onnx.TensorProto.INT32, onnx.TensorProto.INT64}


def _check_label_types(graph: onnx.GraphProto) -> None:
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info)}
    types.update({t.name: t.data_type for t in graph.initializer})
    for index, node in enumerate(graph.node):
        domain = "" if node.domain == "ai.onnx" else node.domain
        if (domain, node.op_type) not in _LOSS_OPS or len(node.input) < 2:
            continue
        label_type = types.get(node.input[1], onnx.TensorProto.UNDEFINED)
        if label_type not in (onnx.TensorProto.UNDEFINED, *_LABEL_TYPES):
            raise TrainingGraphError(
                f"loss node {_node_label(node, index)} reads labels {node.input[1]!r} of type "
                f"{onnx.TensorProto.DataType.Name(label_type)}; labels must be int32 or int64 class indices"
            )


def _resolve_loss(proto: onnx.ModelProto, loss: str | None) -> str:
    outputs = [o.name for o in proto.graph.output]
    if loss is None:
        loss = "loss" if "loss" in outputs else (outputs[0] if len(outputs) == 1 else None)
        if loss is None:
            raise TrainingGraphError(f"cannot tell which output is the loss; pass loss=... (outputs: {outputs})")
    if loss not in outputs:
        raise TrainingGraphError(f"loss {loss!r} is not a graph output; outputs are {outputs}")
    return loss


def _resolve_params(proto: onnx.ModelProto, params: Iterable[str] | None) -> list[str]:
    initializers = {init.name: init for init in proto.graph.initializer}
    inputs = {i.name: i for i in proto.graph.input}
    if params is None:
        params = [
            name
            for name, init in initializers.items()
            if len(init.dims) > 0 and init.data_type in _float_proto_types()
        ]
    params = list(params)
    if not params:
        raise TrainingGraphError("no parameters to differentiate")
    for name in params:
        if name in initializers:
            data_type = initializers[name].data_type
        elif name in inputs:
            data_type = inputs[name].type.tensor_type.elem_type
        else:
            raise TrainingGraphError(f"parameter {name!r} is neither an initializer nor a graph input of the model")
        if data_type not in _float_proto_types():
            raise TrainingGraphError(f"parameter {name!r} is not floating point (type {onnx.TensorProto.DataType.Name(data_type)})")
    if len(set(params)) != len(params):
        raise TrainingGraphError(f"duplicate parameter names in {params}")
    return params


def _float_proto_types() -> set[int]:
    return {int(t) for t in _FLOAT_TYPES}


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


def _make_params_inputs(proto: onnx.ModelProto, params: Sequence[str], loss: str) -> None:
    existing = {i.name for i in proto.graph.input}
    initializers = {init.name: init for init in proto.graph.initializer}
    read = {name for node in proto.graph.node for name in node.input}
    for name in params:
        # ORT's transformers drop initializers nothing reads; its gradient builder fails on
        # one with "couldn't find the consumer node".
        if name not in read:
            raise TrainingGraphError(f"parameter {name!r} does not affect the loss {loss!r}: nothing reads it")
        if name in existing:
            continue
        init = initializers[name]
        proto.graph.input.append(onnx.helper.make_tensor_value_info(name, init.data_type, list(init.dims)))


def _run_pre_gradient_transformers(proto: onnx.ModelProto, params: Sequence[str]) -> onnx.ModelProto:
    from onnxruntime.capi import _pybind_state as C

    options = C.SessionOptions()
    options.log_severity_level = 3
    try:
        # The parameters are named so that constant folding leaves them alone.
        return onnx.load_from_string(C.get_optimized_model(proto.SerializeToString(), set(params), options))
    except Exception as exc:
        raise TrainingGraphError(f"ONNX Runtime's pre-gradient transformers failed: {_ort_message(exc)}") from exc


def _run_gradient_builder(proto: onnx.ModelProto, loss: str, params: Sequence[str]) -> onnx.ModelProto:
    from onnxruntime.capi import _pybind_state as C

    options = C.SessionOptions()
    options.log_severity_level = 3
    try:
        builder = C.GradientGraphBuilder(proto.SerializeToString(), {loss}, set(params), loss, options)
        builder.build()
        return onnx.load_from_string(builder.get_model())
    except Exception as exc:  # ORT raises RuntimeError/Fail/InvalidGraph with its message
        raise TrainingGraphError(f"ONNX Runtime's gradient builder failed: {_ort_message(exc)}") from exc


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


_ORT_ERROR = re.compile(r"\[ONNXRuntimeError\] : \d+ : (\w+) : (.*)", re.DOTALL)


def _ort_message(exc: Exception) -> str:
    """ORT's own words without the C++ source location and signature in front of them."""
    match = _ORT_ERROR.search(str(exc))
    return f"{match.group(1)}: {match.group(2).strip()}" if match else f"{type(exc).__name__}: {exc}"


def _infer_forward_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Shapes of forward values in terms of the graph's dim params (``batch``, ``seq``).

    onnx's own inference invents a fresh ``unk__N`` for every dim computed at run time
    (a Reshape's target from Shape/Div, a Range's length), which leaves the recompute
    analysis's savings unknowable.  ORT's symbolic shape inference (shipped with ORT,
    sympy-based) carries them as expressions of the input dims.  It reads only the graph
    and ORT's in-process shape-inferer registry: nothing a model names is imported.  The
    gradient builder keeps these value infos in the training graph.

    Where onnx's inference leaves every value fully static there is no dim to name, and
    its result is used instead (see :func:`_infer_static_shapes`).
    """
    static = _infer_static_shapes(proto)
    if static is not None:
        return static
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    _give_ort_the_pythonop_inferers(proto)

    # Driven step by step rather than through SymbolicShapeInference.infer_shapes: when
    # some value stays unknown (NonZero's data-dependent length, say) that wrapper saves
    # the model as sym_shape_infer_temp.onnx in the current directory and raises, dropping
    # everything it did infer.  A partial result is still worth keeping.
    inference = SymbolicShapeInference(int_max=2**31 - 1, auto_merge=True, guess_output_rank=False, verbose=0)
    try:
        inference._preprocess(proto)
        complete = False
        while inference.run_:
            complete = inference._infer_impl()
        inference._update_output_from_vi()
    except Exception as exc:  # an op it has no rule for; onnx's inference still runs later
        logger.warning("symbolic shape inference failed (%s: %s); dims may stay unknown", type(exc).__name__, exc)
        return proto
    if not complete:
        logger.debug("symbolic shape inference left some values unknown; keeping what it inferred")
    return _keep_given_shapes(proto, inference.out_mp_)


def _keep_given_shapes(given: onnx.ModelProto, inferred: onnx.ModelProto) -> onnx.ModelProto:
    """Put back the shapes and dim names the model came with where the symbolic inference
    lost them.

    It has no rule for some contrib ops on some types: the labels' ``ShrunkenGather`` from
    ``insert-gather-before-sce-loss`` came out shapeless, so the recompute analysis could
    not size that stashed tensor.  And it names a data-dependent dim after the node that
    makes it (``NonZero_308_o0__d1``), where the pass had named it ``valid_label_count_0``,
    the name a user binds with ``dims=``.
    """
    given_infos = [info for info in given.graph.value_info if info.type.tensor_type.HasField("shape")]
    inferred_infos = [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    renames = _dim_renames([*given_infos, *given.graph.input, *given.graph.output], inferred_infos)
    if renames:
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, renames)) + r")\b")
        for info in inferred_infos:
            for dim in info.type.tensor_type.shape.dim:
                if dim.HasField("dim_param"):
                    dim.dim_param = pattern.sub(lambda match: renames[match.group(1)], dim.dim_param)
    known = {
        info.name
        for info in inferred_infos
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape")
    }
    inferred.graph.value_info.extend(info for info in given_infos if info.name not in known)
    return inferred


def _dim_renames(given: Sequence[onnx.ValueInfoProto], inferred: Sequence[onnx.ValueInfoProto]) -> dict[str, str]:
    """``inferred name -> given name`` for the plain dim names the inference made up in
    place of a name the model gave, where every value agrees on the pair."""
    shapes = {info.name: info.type.tensor_type.shape.dim for info in inferred if info.type.tensor_type.HasField("shape")}
    pairs: dict[str, set[str]] = {}
    for info in given:
        dims = shapes.get(info.name)
        if dims is None or len(dims) != len(info.type.tensor_type.shape.dim):
            continue
        for before, after in zip(info.type.tensor_type.shape.dim, dims):
            if before.HasField("dim_param") and after.HasField("dim_param") and before.dim_param != after.dim_param:
                if before.dim_param.isidentifier() and after.dim_param.isidentifier():
                    pairs.setdefault(after.dim_param, set()).add(before.dim_param)
    # Only names the inference made up: never one the model itself uses (batch, seq).
    used = {dim.dim_param for info in given for dim in info.type.tensor_type.shape.dim if dim.HasField("dim_param")}
    return {
        after: befores.pop()
        for after, befores in pairs.items()
        if len(befores) == 1 and after not in used and not next(iter(befores)).startswith("unk__")
    }


def _give_ort_the_pythonop_inferers(proto: onnx.ModelProto) -> None:
    """Register with ORT's in-process registry the ortpass shape inferer of every PythonOp
    ``func_name`` in ``proto`` (``ortpass.export.register_shape_inferer``).

    Without them ORT's symbolic inference gives a PythonOp's outputs fresh dims, and every
    size after them (a fused attention's output, its projections) becomes an expression
    the recompute analysis cannot bind to the export's dims.
    """
    from onnxruntime.capi import _pybind_state as C

    from ortpass.pythonop.shape_inference import get_shape_inferer

    for node in proto.graph.node:
        if node.op_type == "PythonOp" and node.domain == MS_DOMAIN:
            func_name = next((a.s.decode() for a in node.attribute if a.name == "func_name"), "")
            if func_name and get_shape_inferer(func_name) is not None:
                C.register_shape_inference_function(func_name, _OrtShapeInferer(func_name))


class _OrtShapeInferer:
    """An ortpass shape inferer called the way ORT's symbolic inference calls one:
    ``(NodeProto, [[int | str | None]], [onnx dtype]) -> ([[int | str | None]], [onnx dtype])``."""

    def __init__(self, func_name: str) -> None:
        self.func_name = func_name

    def __call__(self, node: onnx.NodeProto, input_shapes, input_dtypes):
        from ortpass.pythonop.shape_inference import get_shape_inferer

        ir_node = ir.Node(
            node.domain, node.op_type, [ir.Value(name=name) for name in node.input],
            [ir.serde.deserialize_attribute(a) for a in node.attribute], num_outputs=len(node.output), name=node.name,
        )
        shapes = [None if s is None else ir.Shape([d if isinstance(d, (int, str)) else None for d in s]) for s in input_shapes]
        dtypes = [ir.DataType(d) if d else None for d in input_dtypes]
        out_shapes, out_dtypes = get_shape_inferer(self.func_name)(ir_node, shapes, dtypes)
        return [_plain_dims(s) for s in out_shapes], [int(d) if d is not None else 0 for d in out_dtypes]


def _plain_dims(shape) -> list[int | str | None] | None:
    """An inferer's shape (``ir.Shape``, or a sequence of ints, names and None) as ORT's
    inference takes it."""
    if shape is None:
        return None
    dims = shape.dims if isinstance(shape, ir.Shape) else shape
    return [d.value if isinstance(d, ir.SymbolicDim) else d for d in dims]


def _infer_static_shapes(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """onnx's own shape inference (C++, with data propagation, so that a Reshape's target
    computed from Shape is known) if it gives every node output a tensor shape of known
    ints; None otherwise, and for graphs with subgraphs, whose values it does not list.

    On a static 17.5k-node forward it took 0.33 s where ORT's symbolic inference, which
    runs onnx's per node from Python, took 2.7 s, and gave all 18.5k values the same
    shapes; on a 52k-node forward the symbolic inference took 7.5 s of a 35 s build.
    """
    if any(attr.type in _SUBGRAPH_ATTRIBUTES for node in proto.graph.node for attr in node.attribute):
        return None
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - the symbolic inference is the fallback
        return None
    graph = inferred.graph
    types = {info.name: info.type for info in (*graph.input, *graph.value_info, *graph.output)}
    for node in graph.node:
        for name in node.output:
            if name and not _is_static_tensor(types.get(name)):
                return None
    return inferred


_SUBGRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _is_static_tensor(type_proto: onnx.TypeProto | None) -> bool:
    if type_proto is None or not type_proto.HasField("tensor_type"):
        return False
    tensor = type_proto.tensor_type
    return tensor.HasField("shape") and all(dim.HasField("dim_value") for dim in tensor.shape.dim)


def _infer_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    # onnx's inference skips ops of domains it does not know (com.microsoft *Grad), which is
    # fine: analyses read the shapes of forward values, which are known by now.
    try:
        return onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception as exc:
        logger.warning("shape inference on the training graph failed (%s); continuing without it", exc)
        return proto


def _shape_concat_training_lengths(proto: onnx.ModelProto) -> None:
    """Give ``com.microsoft::ConcatTraining``'s second output (the length of each input
    along the axis, int64, one per input: ORT's schema) its shape, which onnx's inference
    cannot (it knows no com.microsoft op).  ORT's fusions turn every Concat into one; the
    recompute analysis skipped each candidate that would stash or clone such a value
    ("the size of 'per_input_length_token_8' is unknown")."""
    known = {info.name for info in (*proto.graph.value_info, *proto.graph.output, *proto.graph.input)}
    for node in proto.graph.node:
        if node.domain == MS_DOMAIN and node.op_type == "ConcatTraining" and len(node.output) > 1:
            lengths = node.output[1]
            if lengths and lengths not in known:
                proto.graph.value_info.append(
                    onnx.helper.make_tensor_value_info(lengths, onnx.TensorProto.INT64, [len(node.input)])
                )


def _check_gradient_outputs(proto: onnx.ModelProto, params: Sequence[str]) -> dict[str, str]:
    outputs = {o.name for o in proto.graph.output}
    gradients = {name: f"{name}_grad" for name in params}
    missing = [name for name, grad in gradients.items() if grad not in outputs]
    if missing:
        raise TrainingGraphError(
            f"the gradient builder produced no gradient for {missing}: the loss does not depend on them"
        )
    return gradients


def _known_shapes(proto: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    """Known shapes by value name: each dim an int, a dim param, or None (unknown)."""
    shapes: dict[str, list[int | str | None]] = {}
    for info in (*proto.graph.input, *proto.graph.value_info, *proto.graph.output):
        tensor = info.type.tensor_type
        if info.type.HasField("tensor_type") and tensor.HasField("shape"):
            shapes[info.name] = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
            ]
    for init in proto.graph.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def _broadcast_axes(source: list, result: list) -> list[int] | None:
    """The axes of ``result`` along which ``source`` was broadcast (numpy rules): the
    leading axes ``source`` lacks and those where it has 1 and ``result`` has not; None
    when a dim needed to tell is unknown."""
    lead = len(result) - len(source)
    if lead < 0:
        return None
    axes = list(range(lead))
    for j, dim in enumerate(source):
        out = result[lead + j]
        if dim is None or out is None:
            return None
        if dim == 1 and out != 1:
            axes.append(lead + j)
    return axes


# Ops whose gradient ORT 1.19.2's builder leaves in the output's shape for a broadcast
# input, and those inputs (measured, docs/design/ort-facts.md; Add, Sub, Mul, Div, Min and
# Max reduce theirs).
_UNREDUCED_BROADCAST_GRADIENTS = {"Where": (1, 2), "Pow": (0,)}


def _reduce_broadcast_gradients(proto: onnx.ModelProto, forward_names: set[str]) -> int:
    """Reduce the gradient of each broadcast input of a forward ``Where`` or ``Pow`` (base)
    to that input's shape; returns how many gradients were repaired.

    ORT 1.19.2 differentiates ``Where(c, x, y)`` as ``Where(c, dY, 0)`` for ``x`` and
    ``Where(c, 0, dY)`` for ``y``, and ``Pow``'s base as ``dY * b * a^(b-1)``, in the
    output's shape, without the reduction its other broadcasting ops get (measured: a
    (1,4,8,8) parameter read by a Where with a (2,4,8,8) output got a (2,4,8,8) gradient,
    silently; T5's relative-attention bias made the step fail at the Squeeze its
    Unsqueeze's gradient applies).  The repair sums over the broadcast axes
    (``ReduceSum(keepdims=1)``) and drops the leading axes the input lacks (``Squeeze``),
    as numpy's broadcasting rule dictates for a gradient.  The builder names the nodes it
    emits for node ``F`` ``<F>_Grad/...``, and the gradient of value ``v`` ``v_grad``
    (``v_grad_<k>`` for one of several contributions, summed later).
    """
    shapes = _known_shapes(proto)
    opset = next((o.version for o in proto.opset_import if is_onnx_domain(o.domain)), MAX_ORT_OPSET)
    wanted: dict[str, tuple[onnx.NodeProto, dict[str, int]]] = {}  # grad-node prefix -> forward node, input by name
    for node in proto.graph.node:
        indices = _UNREDUCED_BROADCAST_GRADIENTS.get(node.op_type)
        if indices and is_onnx_domain(node.domain) and node.name in forward_names:
            inputs = {node.input[i]: i for i in indices if i < len(node.input) and node.input[i]}
            wanted[f"{node.name}_Grad/"] = (node, inputs)
    repaired = 0
    position = 0
    while position < len(proto.graph.node):
        node = proto.graph.node[position]
        position += 1
        prefix = node.name.split("_Grad/", 1)[0] + "_Grad/" if "_Grad/" in node.name else None
        if prefix not in wanted or len(node.output) != 1:
            continue
        owner, inputs = wanted[prefix]
        index = next((i for name, i in inputs.items() if _is_gradient_name(node.output[0], name)), None)
        if index is None:
            continue
        source, result = shapes.get(owner.input[index]), shapes.get(owner.output[0])
        axes = None if source is None or result is None else _broadcast_axes(source, result)
        if axes is None:
            logger.warning(
                "cannot tell whether %s %r broadcast its input %r (shapes unknown); its gradient is left as "
                "ONNX Runtime built it", owner.op_type, owner.name, owner.input[index]
            )
            continue
        if not axes:
            continue
        new_nodes = _reduce_to_input_shape(proto, node, axes, len(result) - len(source), opset)
        for offset, new in enumerate(new_nodes):
            proto.graph.node.insert(position + offset, new)
        position += len(new_nodes)
        repaired += 1
        logger.info(
            "reduced the gradient of %s %r's input %r over broadcast axes %s (ONNX Runtime's builder left it "
            "in the output's shape)", owner.op_type, owner.name, owner.input[index], axes
        )
    return repaired


def _is_gradient_name(name: str, value: str) -> bool:
    """True when ``name`` is what ORT's builder calls (a contribution to) ``value``'s gradient."""
    if not name.startswith(f"{value}_grad"):
        return False
    rest = name[len(value) + len("_grad"):]
    return rest == "" or (rest[0] == "_" and rest[1:].isdigit())


def _reduce_to_input_shape(
    proto: onnx.ModelProto, node: onnx.NodeProto, axes: list[int], lead: int, opset: int
) -> list[onnx.NodeProto]:
    """Rename ``node``'s output and compute the original name from it, reduced over
    ``axes`` and without its first ``lead`` axes."""
    grad = node.output[0]
    unreduced = f"{grad}_ortpass_unreduced"
    node.output[0] = unreduced
    stem = f"{node.name}/ortpass_broadcast"
    reduced = f"{grad}_ortpass_reduced" if lead else grad
    nodes = [_axes_node("ReduceSum", unreduced, reduced, axes, f"{stem}/ReduceSum", proto, opset, keepdims=1)]
    if lead:
        nodes.append(_axes_node("Squeeze", reduced, grad, list(range(lead)), f"{stem}/Squeeze", proto, opset))
    return nodes


def _axes_node(
    op: str, x: str, y: str, axes: list[int], name: str, proto: onnx.ModelProto, opset: int, **attrs: int
) -> onnx.NodeProto:
    """``op`` over ``axes``: an int64 initializer input from opset 13, an attribute before."""
    if opset < 13:
        return onnx.helper.make_node(op, [x], [y], name=name, axes=axes, **attrs)
    axes_name = f"{name}/axes"
    proto.graph.initializer.append(onnx.helper.make_tensor(axes_name, onnx.TensorProto.INT64, [len(axes)], axes))
    return onnx.helper.make_node(op, [x, axes_name], [y], name=name, **attrs)


def _check_gradient_shapes(proto: onnx.ModelProto, gradients: dict[str, str]) -> None:
    """Refuse, naming the parameter, a gradient whose static shape is not its parameter's
    (the shapes ORT's builder and onnx's inference give the gradient outputs)."""
    shapes = _known_shapes(proto)
    for param, grad in gradients.items():
        want, got = shapes.get(param), shapes.get(grad)
        if want is None or got is None or any(not isinstance(d, int) for d in (*want, *got)):
            continue
        if list(want) != list(got):
            raise TrainingGraphError(
                f"the gradient of parameter {param!r} has shape {list(got)}, not the parameter's {list(want)}: "
                "ONNX Runtime's gradient builder got a broadcast wrong"
            )


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
