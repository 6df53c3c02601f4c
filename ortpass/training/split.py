"""Split a training graph into a forward graph and a backward graph, to run apart.

Rule: the forward graph holds the nodes tagged ``forward`` (in graph order) and outputs
the training graph's forward outputs (the loss, or the differentiated outputs and the
others) followed by the *stashed* values, every forward value a backward node reads: the
activations kept between forward and backward.  The backward graph holds the nodes tagged
``backward`` (in graph order, so the execution order the post-grad passes arranged
stays); its inputs are the stashed values, the gradient seeds of a graph built from
outputs, and the graph inputs backward reads (parameters, labels); its outputs are the
gradients.  Run one after the other, the two compute what the training graph computes:
every node runs once, on the same inputs.

This is what lets a caller compute the loss outside the graph: forward returns the
outputs, the caller's code makes their gradients, backward takes them
(``ortpass.ORTModule`` with a loss computed in torch).  ORTModule split its graph with a
``YieldOp`` inside one session; two plain graphs run on any ONNX Runtime build.

One rewrite comes first.  In one graph, a backward Dropout that draws a forward
Dropout's mask again (a recompute clone, a ``replay-dropout-mask`` replay: the same
``seed``) draws the same mask because both kernels advance once per run.  Split, that
holds only while every forward run is followed by its own backward run: a forward whose
backward never comes, or two forwards whose backwards run in reverse order (summing two
micro-batches' losses before one ``backward()``), would give the backward another step's
mask, silently.  So each such backward Dropout becomes ``DropoutGrad(x, mask, ratio,
training_mode)`` reading the forward Dropout's mask, kept from forward to backward (one
byte per element): the same product ``x * mask / (1 - ratio)`` the Dropout kernel
computes, and no generator shared between the graphs.

Then each kept mask is packed to bits at the end of its forward and unpacked just before
its backward reader (:mod:`ortpass.training.packed_masks`): an eighth of the bytes; and a
weight's transpose is transposed again in backward instead of kept
(:mod:`ortpass.training.rederived_stash`).

And one cost: ORT frees a stashed value inside one graph once its last reader ran; fed to
the backward graph from outside, it stays alive until the backward run ends.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import numpy as np
import onnx
import onnx_ir as ir

from ortpass.analysis.partition import get_training_info, is_backward, tag
from ortpass.conventions import MS_DOMAIN, SIDE_KEY, is_onnx_domain
from ortpass.errors import TrainingGraphError
from ortpass.ops.dropout import is_dropout
from ortpass.training.packed_masks import pack_kept_masks
from ortpass.training.rederived_stash import rederive_layout_of_inputs

__all__ = ["MASK_PRODUCT_INFIX", "SplitGraphs", "as_run", "declare_types", "finished_as_run", "masks_read_where_redraws_differ", "read_forward_masks", "split_training_graph"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SplitGraphs:
    """The two graphs and the names that connect them."""

    forward: onnx.ModelProto
    backward: onnx.ModelProto
    outputs: list[str]  # the training graph's forward outputs, first among forward's outputs
    stashed: list[str]  # forward's values that backward reads (after the outputs, those not among them)
    gradients: list[str]  # backward's outputs, in the training graph's order


def split_training_graph(model: ir.Model) -> SplitGraphs:
    """Split ``model`` (a training graph, not modified) into forward and backward graphs."""
    info = get_training_info(model)
    model = model.clone()
    read_forward_masks(model)
    pack_kept_masks(model)
    rederive_layout_of_inputs(model)
    value_infos = {v.name: v for v in _named_values(model)}
    proto = ir.to_proto(model)
    graph = proto.graph
    forward_nodes, backward_nodes = _nodes_by_side(graph)
    produced_forward = {name for node in forward_nodes for name in node.output if name}
    read_backward = {name for node in backward_nodes for name in node.input if name}
    stashed = [name for node in forward_nodes for name in node.output if name and name in read_backward]
    gradient_names = set(info.gradients.values()) | set(info.input_gradients.values())
    gradients = [o.name for o in graph.output if o.name in gradient_names]
    outputs = [o.name for o in graph.output if o.name not in gradient_names]
    unproduced = [name for name in gradients if name in produced_forward]
    if unproduced:
        raise TrainingGraphError(f"gradients {unproduced} are computed by forward nodes; the graph cannot be split")

    forward = _subgraph_model(
        proto, "forward", forward_nodes, [*outputs, *(n for n in stashed if n not in outputs)], value_infos
    )
    backward = _subgraph_model(proto, "backward", backward_nodes, gradients, value_infos, extra_inputs=stashed)
    logger.info(
        "split the training graph: %d forward nodes, %d backward nodes, %d stashed values",
        len(forward_nodes), len(backward_nodes), len(stashed),
    )  # fmt: skip
    return SplitGraphs(forward, backward, outputs, stashed, gradients)


def _named_values(model: ir.Model):
    yield from model.graph.inputs
    for node in model.graph:
        yield from (v for v in node.outputs if v.name)


def _nodes_by_side(graph: onnx.GraphProto) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
    sides: dict[str, list[onnx.NodeProto]] = {"forward": [], "backward": []}
    for node in graph.node:
        side = next((entry.value for entry in node.metadata_props if entry.key == SIDE_KEY), None)
        if side not in sides:
            raise TrainingGraphError(f"node {node.name!r} ({node.op_type}) has no {SIDE_KEY!r} tag")
        sides[side].append(node)
    return sides["forward"], sides["backward"]


def _subgraph_model(
    proto: onnx.ModelProto,
    name: str,
    nodes: list[onnx.NodeProto],
    outputs: list[str],
    value_infos: dict[str, ir.Value],
    extra_inputs: list[str] = (),
) -> onnx.ModelProto:
    """A model with ``nodes`` of ``proto``, reading the graph inputs and initializers they
    need (and ``extra_inputs``, made graph inputs) and producing ``outputs``."""
    graph = proto.graph
    read = {name for node in nodes for name in node.input if name} | set(outputs)
    extra = set(extra_inputs)
    sub = onnx.GraphProto(name=f"{graph.name}_{name}")
    sub.node.extend(nodes)
    sub.input.extend(i for i in graph.input if i.name in read and i.name not in extra)
    sub.input.extend(_value_info(value_infos[n]) for n in extra_inputs)
    sub.initializer.extend(t for t in graph.initializer if t.name in read)
    declared = {o.name: o for o in graph.output}
    sub.output.extend(declared[n] if n in declared else _value_info(value_infos[n]) for n in outputs)
    sub.value_info.extend(v for v in graph.value_info if v.name in read)
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    model.graph.CopyFrom(sub)
    return model


def _value_info(value: ir.Value) -> onnx.ValueInfoProto:
    """The value's declaration; a value of unknown type (an ORT op without a shape
    function) is declared by name, and :func:`declare_types` completes it."""
    if value.type is None:
        return onnx.helper.make_empty_tensor_value_info(value.name)
    return ir.serde.serialize_value(value)


def declare_types(graph: onnx.GraphProto, elem_types: dict[str, int]) -> None:
    """Give the graph inputs declared without a type the element type in ``elem_types``
    (what the forward session reports for its outputs), with the shape unknown."""
    for value in graph.input:
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            continue
        if value.name not in elem_types:
            raise TrainingGraphError(f"value {value.name!r} crosses from forward to backward but has no known type")
        value.type.tensor_type.elem_type = elem_types[value.name]


#: In the names of the nodes that replace a backward Dropout reading a kept mask: after
#: the Dropout's own name.
MASK_PRODUCT_INFIX = "_kept_mask"


def read_forward_masks(model: ir.Model, standard_ops: bool | None = None) -> int:
    """Make every backward Dropout seeded like a forward Dropout read that Dropout's mask
    instead of drawing it again; returns how many were rewritten.  The product is
    ``DropoutGrad`` (the training build's kernel) or, with ``standard_ops`` (default: when
    the installed onnxruntime has no training ops), ``x * (1 / (1 - ratio)) * mask`` in
    ai.onnx ops, what ORT's Dropout kernel computes."""
    if standard_ops is None:
        from ortpass.training.backend import has_training_ops

        standard_ops = not has_training_ops()
    forward_by_seed: dict[int, ir.Node] = {}
    paired: list[tuple[ir.Node, ir.Node]] = []
    for node in model.graph:
        if not is_dropout(node) or "seed" not in node.attributes:
            continue
        seed = node.attributes["seed"].as_int()
        if not is_backward(node):
            if seed in forward_by_seed:
                raise TrainingGraphError(
                    f"forward dropouts {forward_by_seed[seed].name!r} and {node.name!r} share seed {seed}"
                )
            forward_by_seed[seed] = node
        elif seed in forward_by_seed:
            paired.append((node, forward_by_seed[seed]))
    for redraw, forward in paired:
        if not (_is_onnx_dropout(redraw) and _is_onnx_dropout(forward)):
            raise TrainingGraphError(
                f"backward {redraw.op_type} {redraw.name!r} draws the mask of forward {forward.op_type} "
                f"{forward.name!r} again; only ai.onnx Dropout can read a kept mask instead"
            )
        _read_mask(model.graph, redraw, _mask_of(model.graph, forward), standard_ops)
    model.graph.remove([redraw for redraw, _ in paired], safe=True)
    if paired:
        logger.info("%d backward dropout(s) read their forward mask instead of drawing it again", len(paired))
    return len(paired)


def masks_read_where_redraws_differ(model: ir.Model) -> ir.Model:
    """``model``, or where the installed onnxruntime has no training ops, a copy whose
    backward Dropouts read their forward Dropout's mask (:func:`read_forward_masks`): on
    stock onnxruntime (1.31.1, measured) a second Dropout with the same seed does not draw
    the same mask, even in one graph, so a recomputed Dropout would not match forward."""
    from ortpass.training.backend import has_training_ops

    if has_training_ops() or not any(is_dropout(n) and "seed" in n.attributes and is_backward(n) for n in model.graph):
        return model
    model = model.clone()
    read_forward_masks(model, standard_ops=True)
    return model


def as_run(model: ir.Model) -> ir.Model:
    """The graph an ortpass session runs for ``model`` on the installed onnxruntime:
    :func:`masks_read_where_redraws_differ`, and the gradients' final row scatters left to
    the session (:mod:`ortpass.training.row_scatter`).  ``model`` itself where neither applies."""
    from ortpass.training.row_scatter import defer_row_scatters

    return defer_row_scatters(masks_read_where_redraws_differ(model))[0]


def finished_as_run(finish: Callable[[ir.Model], ir.Model] | None) -> Callable[[ir.Model], ir.Model]:
    """``finish`` (what a memory planner runs on each graph it tries: the passes after it
    that shape the step's memory), then :func:`as_run`, so that a plan is judged on the
    graph that runs."""

    def finished(model: ir.Model) -> ir.Model:
        return as_run(finish(model) if finish is not None else model)

    return finished


def _is_onnx_dropout(node: ir.Node) -> bool:
    return node.op_type == "Dropout" and is_onnx_domain(node.domain)


def _mask_of(graph: ir.Graph, dropout: ir.Node) -> ir.Value:
    """The forward Dropout's mask output, restored if a pass dropped it."""
    if len(dropout.outputs) < 2:
        dropout.resize_outputs(2)
    mask = dropout.outputs[1]
    if not mask.name:
        taken = {v.name for n in graph for v in n.outputs} | {v.name for v in graph.inputs}
        base, k = f"{dropout.outputs[0].name or dropout.name}_mask", 0
        mask.name = base
        while mask.name in taken:
            k += 1
            mask.name = f"{base}_{k}"
        mask.type, mask.shape = ir.TensorType(ir.DataType.BOOL), dropout.outputs[0].shape
    return mask


def _is_constant_true(value: ir.Value | None) -> bool:
    if value is None:
        return False
    tensor = value.const_value
    producer = value.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        tensor = producer.attributes["value"].as_tensor()
    return tensor is not None and bool(tensor.numpy().item())


def _read_mask(graph: ir.Graph, redraw: ir.Node, mask: ir.Value, standard_ops: bool) -> None:
    inputs = list(redraw.inputs) + [None] * (3 - len(redraw.inputs))
    ratio, mode = inputs[1], inputs[2]
    if not _is_constant_true(mode):
        # Without training mode the Dropout is the identity; the build removes such nodes.
        raise TrainingGraphError(f"backward Dropout {redraw.name!r} is not in training mode; cannot pair its mask")
    stem = f"{redraw.name}{MASK_PRODUCT_INFIX}"
    if standard_ops:
        nodes = _masked_product(inputs[0], mask, ratio, stem)
    else:
        nodes = [ir.Node(MS_DOMAIN, "DropoutGrad", [inputs[0], mask, ratio, mode], name=stem)]
    for node in nodes:
        tag(node, "backward")
    result = nodes[-1].outputs[0]
    product = redraw.outputs[0]
    result.name, result.type, result.shape = product.name, product.type, product.shape
    graph.insert_after(redraw, nodes)
    ir.convenience.replace_all_uses_with(product, result, replace_graph_outputs=True)
    if len(redraw.outputs) > 1:
        ir.convenience.replace_all_uses_with(redraw.outputs[1], mask, replace_graph_outputs=True)


def _masked_product(x: ir.Value, mask: ir.Value, ratio: ir.Value | None, stem: str) -> list[ir.Node]:
    """``x * (1 / (1 - ratio)) * Cast(mask)`` in ai.onnx ops (ratio 0.5 when absent, as
    Dropout's default), the scale computed in ``x``'s type as the kernel does."""
    dtype = x.dtype or ir.DataType.FLOAT
    one = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(1.0, dtype=dtype.numpy()))}, name=f"{stem}_one")
    nodes = [one]
    if ratio is None:
        half = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(0.5, dtype=dtype.numpy()))}, name=f"{stem}_ratio")
        nodes.append(half)
        ratio = half.outputs[0]
    else:
        nodes.append(ir.node("CastLike", [ratio, x], name=f"{stem}_ratio"))
        ratio = nodes[-1].outputs[0]
    keep = ir.node("Sub", [one.outputs[0], ratio], name=f"{stem}_keep")
    scale = ir.node("Div", [one.outputs[0], keep.outputs[0]], name=f"{stem}_scale")
    scaled = ir.node("Mul", [x, scale.outputs[0]], name=f"{stem}_scaled")
    weights = ir.node("CastLike", [mask, x], name=f"{stem}_cast")
    product = ir.node("Mul", [scaled.outputs[0], weights.outputs[0]], name=stem)
    # Typed and shaped: the step-memory prediction counts what it can size, and the mask's
    # cast and the scaled input are each as large as the input (32 MiB a layer for GPT-2's
    # attention dropout at batch 8 x 512), which it missed.
    scalar = ir.Shape([])  # Dropout's ratio is a scalar
    for value, shape in ((one.outputs[0], scalar), (ratio, scalar), (keep.outputs[0], scalar), (scale.outputs[0], scalar),
                         (scaled.outputs[0], x.shape), (weights.outputs[0], mask.shape)):
        value.type, value.shape = ir.TensorType(dtype), shape.copy() if shape is not None else None
    return [*nodes, keep, scale, scaled, weights, product]
