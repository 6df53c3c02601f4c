"""Which nodes a pass created and removed, and the op counts reports print."""

from __future__ import annotations

import collections
from typing import Iterable

import onnx_ir as ir

from ortpass.conventions import op_label


def all_nodes(model: ir.Model) -> list[ir.Node]:
    """Every node of ``model``: its graph's, their subgraphs' and its functions'.  Faster
    than ``Graph.all_nodes`` on large graphs (docs/design/checks-and-rollback.md)."""
    nodes = []
    for node in model.graph:
        nodes.append(node)
        attributes = node.attributes.data  # a UserDict's dict: iterated at dict speed
        if attributes:
            for attr in attributes.values():
                kind = attr.type
                if kind == ir.AttributeType.GRAPH:
                    nodes.extend(ir.traversal.RecursiveGraphIterator(attr.value))
                elif kind == ir.AttributeType.GRAPHS:
                    for subgraph in attr.value:
                        nodes.extend(ir.traversal.RecursiveGraphIterator(subgraph))
    for function in model.functions.values():
        nodes.extend(ir.traversal.RecursiveGraphIterator(function))
    return nodes

__all__ = ["all_nodes", "count_ops", "diff_nodes"]



def _signature(node: ir.Node) -> tuple:
    return (node.domain, node.op_type, node.name, tuple(v.name for v in node.outputs))


def diff_nodes(before: list[ir.Node], after: list[ir.Node]) -> tuple[list[ir.Node], list[ir.Node]]:
    """Nodes created and nodes removed by a pass, by node identity.

    ``before`` must hold the node objects themselves (not their ids) so that a removed
    node cannot be freed and its id reused by a new one while we compare.  A pass that
    rebuilt the whole model (a functional pass that cloned it) shares no node objects
    with its input; then nodes are matched by (domain, op type, name, output names).
    """
    # Sets of the nodes themselves: ir.Node compares and hashes by identity, and building
    # them takes no Python call per node.
    before_set, after_set = set(before), set(after)
    if before and after and before_set.isdisjoint(after_set):
        return _multiset_minus(after, before), _multiset_minus(before, after)
    return [n for n in after if n not in before_set], [n for n in before if n not in after_set]


def _multiset_minus(nodes: list[ir.Node], others: list[ir.Node]) -> list[ir.Node]:
    remaining = collections.Counter(_signature(n) for n in others)
    extra = []
    for node in nodes:
        key = _signature(node)
        if remaining[key]:
            remaining[key] -= 1
        else:
            extra.append(node)
    return extra


def count_ops(nodes: Iterable[ir.Node]) -> dict[str, int]:
    return dict(sorted(collections.Counter(op_label(n.domain, n.op_type) for n in nodes).items()))
