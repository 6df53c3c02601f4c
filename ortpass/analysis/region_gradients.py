"""The backward nodes that compute the gradients of a forward region, and the gradients they
hand to the rest of a training graph: what a pass must replace when it rewrites a region
(a loss and its head, say) together with its gradient."""

from __future__ import annotations

import onnx_ir as ir

from ortpass.analysis.partition import is_backward

__all__ = ["RegionGradientError", "gradients_handed_on", "region_backward"]


class RegionGradientError(Exception):
    """The region's backward is not one a rewrite can replace; the message says why."""


def _is_constant(value: ir.Value, graph: ir.Graph) -> bool:
    producer = value.producer()
    if producer is not None:
        return producer.op_type == "Constant"
    return value.name in graph.initializers and value not in graph.inputs


def region_backward(
    graph: ir.Graph, region: list[ir.Node], seed: ir.Value, boundary: set[ir.Value], operands: list[ir.Value]
) -> list[ir.Node]:
    """The backward nodes that compute the loss's gradients: each reads the seed, a value
    of ``region`` or of an earlier such node, and otherwise only ``boundary`` values,
    constants and values computed from those alone.

    A value computed from the head's ``operands`` (its input, its weight) and shaped like
    one of them is a gradient the loss hands on, and its readers are not members: T5
    scales its hidden state before the head, and that scale's gradient belongs to the rest
    of the graph.  (Shape alone would not do: at rows == hidden the logits' gradient is
    shaped like a hidden x vocabulary weight.)  So is a value shaped like the bias (the
    third operand, if any), whose gradient sums the logits' gradient over the rows.  Only
    values computed from the seed are gradients: the torch builder's backward transposes
    the head's transposed weight back, a weight-shaped value that stays a member's."""
    members: list[ir.Node] = []
    own = {out for node in region for out in node.outputs} | {seed}
    seeded = {seed}  # values computed from the seed: only those can be gradients
    derived: set[ir.Value] = set()
    from_operands = set(operands) | {out for node in region if node.op_type == "Transpose" for out in node.outputs}
    for node in graph:
        if node in region or seed in node.outputs:  # the torch builder computes the seed from the loss
            continue
        inputs = [v for v in node.inputs if v is not None]
        plain = [v for v in inputs if v not in own]
        if is_backward(node) and len(plain) < len(inputs):
            if all(v in boundary or v in derived or _is_constant(v, graph) for v in plain):
                members.append(node)
                if any(v in from_operands for v in inputs):
                    from_operands.update(node.outputs)
                if any(v in seeded for v in inputs):
                    seeded.update(node.outputs)
                own.update(v for v in node.outputs if v not in seeded or not _hands_on(v, operands, from_operands))
        elif (node.op_type == "Shape" and len(plain) == len(inputs)) or (
            inputs and all(v in boundary or v in derived or _is_constant(v, graph) for v in inputs)
        ):
            # A Shape of a value outside the region reads no data: the torch builder's label
            # gather scatters the rows' gradient into zeros sized from the ids' Shape
            # (ortpass.training.label_gather).
            derived.update(node.outputs)
            if any(v in from_operands for v in inputs):
                from_operands.update(node.outputs)
    if not members:
        raise RegionGradientError("no backward node reads the loss's gradient")
    return members


def gradients_handed_on(
    region: list[ir.Node], backward: list[ir.Node], operands: list[ir.Value], kept: frozenset[ir.Value] = frozenset()
) -> tuple[ir.Value, ir.Value | None, ir.Value | None]:
    """The gradients of the head's input, weight and bias among the values the loss's nodes
    hand to the rest of the graph (a frozen weight or bias has none); anything else handed
    on stops the rewrite, as does a forward value of the region read elsewhere, but the
    loss and the ``kept`` values (logits the graph returns)."""
    inside = set(region) | set(backward)
    loss_value = region[-1].outputs[0]
    for node in region:
        for out in node.outputs:
            if out is loss_value or out in kept:
                continue
            if out.is_graph_output() or any(user not in inside for user, _ in out.uses()):
                raise RegionGradientError(f"{out.name} is read outside the loss and its gradient")
    handed = [out for node in backward for out in node.outputs if out.is_graph_output() or any(u not in inside for u, _ in out.uses())]
    found: list[ir.Value | None] = []
    for operand in operands:
        like = [v for v in handed if _same_shape(v, operand) and v not in found]
        if len(like) > 1:
            raise RegionGradientError(f"the loss's backward hands on {[v.name for v in like]}, all shaped like {operand.name}")
        found.append(like[0] if like else None)
    if found[0] is None or len(handed) != sum(v is not None for v in found):
        raise RegionGradientError(f"the loss's backward hands on {[v.name for v in handed]}, not the gradients of the head's inputs")
    hidden_grad, weight_grad, *rest = found
    return hidden_grad, weight_grad, (rest[0] if rest else None)


def _hands_on(value: ir.Value, operands: list[ir.Value], from_operands: set[ir.Value]) -> bool:
    hidden_and_weight, bias = operands[:2], operands[2:]
    if value in from_operands and any(_same_shape(value, x) for x in hidden_and_weight):
        return True
    return any(_same_shape(value, b) for b in bias)


def _same_shape(value: ir.Value, like: ir.Value) -> bool:
    return value.dtype == like.dtype and value.shape is not None and like.shape is not None and list(value.shape) == list(like.shape)
