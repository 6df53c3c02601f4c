"""What a gated MLP (``down(act(gate(x)) * up(x))``) looks like in a training graph, for the
passes that reorder its backward (``recompute-gate-activation``, ``recompute-silu-sigmoid``).

A *gated* value is one a forward ``Mul`` (or a recompute clone of one) multiplies by
another tensor of its own shape: the gate of a gated MLP, not a scale.  A *gradient node*
is a backward node that is not a recompute clone of a forward one.
"""

from __future__ import annotations

from typing import Sequence

import onnx_ir as ir

from ortpass.analysis.memory import is_alias_node
from ortpass.analysis.partition import is_backward
from ortpass.conventions import CREATED_BY_KEY, RECOMPUTE_OF_KEY, SIDE_KEY
from ortpass.graph.names import NameAllocator

__all__ = ["LATE_SUFFIX", "feeds", "gated_partner", "is_gradient_node", "late_copy", "readers_through_views", "same_shape"]

LATE_SUFFIX = "_late"


def same_shape(a: ir.Value, b: ir.Value) -> bool:
    """Equal shapes, every dim known: ints, or symbolic dims of one name."""
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return False
    # A symbolic dim equals another of the same name; an unnamed one equals nothing.
    return all(x == y and (isinstance(x, int) or getattr(x, "value", None) is not None) for x, y in zip(a.shape, b.shape))


def is_gradient_node(node: ir.Node) -> bool:
    """Backward, and not a recompute clone of a forward node."""
    return is_backward(node) and RECOMPUTE_OF_KEY not in node.metadata_props


def gated_partner(value: ir.Value) -> ir.Value | None:
    """The tensor a forward ``Mul`` (or its recompute clone) multiplies ``value`` by, where
    it has ``value``'s shape: the partner of a gated MLP's activation.  None if no such
    ``Mul`` reads ``value``."""
    for reader, index in value.uses():
        if reader.op_type != "Mul" or reader.domain != "" or is_gradient_node(reader):
            continue
        other = reader.inputs[1 - index]
        if other is not None and other is not value and same_shape(other, value):
            return other
    return None


def late_copy(node: ir.Node, names: NameAllocator, created_by: str) -> ir.Node:
    """A backward copy of one-output ``node`` on the same inputs, tagged as a recompute of
    it, for the caller to insert where its readers need it."""
    out = node.outputs[0]
    value = ir.Value(name=names.fresh(f"{out.name}{LATE_SUFFIX}"), type=out.type,
                     shape=out.shape.copy() if out.shape is not None else None)  # fmt: skip
    return ir.Node(
        node.domain,
        node.op_type,
        list(node.inputs),
        attributes=[ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()],
        outputs=[value],
        version=node.version,
        name=names.fresh(f"{node.name or node.op_type}{LATE_SUFFIX}"),
        metadata_props={SIDE_KEY: "backward", RECOMPUTE_OF_KEY: node.name or "", CREATED_BY_KEY: created_by},
    )


def readers_through_views(groups: Sequence[Sequence[ir.Node]]) -> dict[ir.Node, list[int]]:
    """For each node, the indices (ascending) of the ``groups`` with a member that reads one
    of its outputs, directly or through views: one walk over the groups' inputs, where
    asking group by group for each node would be quadratic in the graph's depth."""
    readers: dict[ir.Node, list[int]] = {}
    for index, group in enumerate(groups):
        for member in group:
            for value in member.inputs:
                producer = value.producer() if value is not None else None
                while producer is not None:
                    found = readers.setdefault(producer, [])
                    if not found or found[-1] != index:
                        found.append(index)
                    if not is_alias_node(producer):
                        break
                    value = producer.inputs[0]
                    producer = value.producer() if value is not None else None
    return readers


def feeds(node: ir.Node, target: ir.Node, position: dict[ir.Node, int]) -> bool:
    """``node``'s outputs reach ``target`` through backward nodes.  The graph is sorted, so
    only the nodes between the two in graph order need a look."""
    start = position[node]
    seen, stack = set(), [target]
    while stack:
        current = stack.pop()
        for value in current.inputs:
            producer = value.producer() if value is not None else None
            if producer is node:
                return True
            if (producer is not None and producer not in seen and is_backward(producer)
                    and position.get(producer, -1) > start):  # fmt: skip
                seen.add(producer)
                stack.append(producer)
    return False
