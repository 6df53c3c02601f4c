"""Gradients as ORT 1.19.2's builder leaves them, made right: a broadcast ``Where`` input's (or
``Pow`` base's) gradient reduced to the input's shape, and every parameter's gradient
checked to exist and to have the parameter's shape."""

from __future__ import annotations

import logging
from typing import Sequence

import onnx
import onnx.numpy_helper

from ortpass.conventions import (
    MAX_ORT_OPSET,
    is_onnx_domain,
)
from ortpass.errors import TrainingGraphError
from ortpass.training.shapes import known_shapes

logger = logging.getLogger(__name__)


def check_gradient_outputs(proto: onnx.ModelProto, params: Sequence[str]) -> dict[str, str]:
    outputs = {o.name for o in proto.graph.output}
    gradients = {name: f"{name}_grad" for name in params}
    missing = [name for name, grad in gradients.items() if grad not in outputs]
    if missing:
        raise TrainingGraphError(
            f"the gradient builder produced no gradient for {missing}: the loss does not depend on them"
        )
    return gradients


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


def reduce_broadcast_gradients(proto: onnx.ModelProto, forward_names: set[str]) -> int:
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
    shapes = known_shapes(proto)
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


def check_gradient_shapes(proto: onnx.ModelProto, gradients: dict[str, str]) -> None:
    """Refuse, naming the parameter, a gradient whose static shape is not its parameter's
    (the shapes ORT's builder and onnx's inference give the gradient outputs)."""
    shapes = known_shapes(proto)
    for param, grad in gradients.items():
        want, got = shapes.get(param), shapes.get(grad)
        if want is None or got is None or any(not isinstance(d, int) for d in (*want, *got)):
            continue
        if list(want) != list(got):
            raise TrainingGraphError(
                f"the gradient of parameter {param!r} has shape {list(got)}, not the parameter's {list(want)}: "
                "ONNX Runtime's gradient builder got a broadcast wrong"
            )
