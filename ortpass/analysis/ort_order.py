"""ONNX Runtime's default execution order, written into the graph.

ORT 1.19.2's ``ExecutionOrder.DEFAULT`` walks post-order, depth first, from the leaves (the
nodes no node reads), taking leaves from the last in graph order down.  So the order of
the leaves in the graph decides when each runs: :func:`order_gradient_leaves` moves each
backward leaf, with the backward nodes only it reads, to the end of the graph, the one that
becomes computable first last.  What was measured: ``docs/design/ort-execution-order.md``.
"""

from __future__ import annotations

from typing import Sequence

import onnx_ir as ir

from ortpass.analysis.partition import is_backward

__all__ = ["gradient_leaf_order", "leaf_units", "ort_default_order", "order_gradient_leaves"]


def order_gradient_leaves(graph: ir.Graph, nodes: list[ir.Node]) -> dict[ir.Node, int]:
    """Move each backward leaf (a node no node reads: it produces gradient outputs), with
    the backward nodes that feed only it, to the end of the graph, the leaf that becomes
    computable first last, so that ORT's default order runs each one as soon as its inputs
    exist (ORT takes leaves from the last one in graph order); see :func:`gradient_leaf_order`.

    ``nodes``: the graph's nodes in order.  Returns a number for each, increasing in the
    new order.
    """
    kept, moved = _split_leaf_units(nodes)
    # One removal and one extension: Graph.remove copies the graph's outputs on every call.
    graph.remove(moved)
    graph.extend(moved)
    position = {node: i for i, node in enumerate(nodes)}
    # The others keep their numbers, in the same order still; the moved come after them.
    position.update((node, len(nodes) + i) for i, node in enumerate(moved))
    return position


def gradient_leaf_order(nodes: list[ir.Node]) -> list[ir.Node]:
    """The graph order :func:`order_gradient_leaves` writes, without writing it.

    A leaf's *unit* is the leaf and the nodes whose outputs only it reads, directly or
    through other nodes of the unit (a weight gradient's Reshape-Gemm-Transpose chain).
    Units are ranked by when the values they read from outside exist, not by where the
    leaf sits: ORT's pre-gradient fusions re-sort the graph and put weight-gradient chains
    after all of backward, and a rank by position then ran them (and the bias gradients
    ranked alike) at the end of the step, keeping an activation gradient per layer alive.
    A unit's outputs are read only inside it, so the order stays topologically sorted.
    """
    kept, moved = _split_leaf_units(nodes)
    return kept + moved


def _split_leaf_units(nodes: list[ir.Node]) -> tuple[list[ir.Node], list[ir.Node]]:
    """The nodes that stay, in order, and the leaf units moved after them, in their new order."""
    position = {node: i for i, node in enumerate(nodes)}
    units = leaf_units(nodes)
    produced_at = _ProducedAt(position)
    ready = {unit[-1]: _ready_position(unit, produced_at) for unit in units}
    units.sort(key=lambda unit: (ready[unit[-1]], position[unit[-1]]))
    moved = [node for unit in reversed(units) for node in unit]
    moved_set = set(moved)
    return [node for node in nodes if node not in moved_set], moved


def leaf_units(nodes: Sequence[ir.Node]) -> list[list[ir.Node]]:
    """Each backward leaf with the backward nodes only it reads, in graph order (the leaf
    last: every other member feeds it).  ``nodes``: the graph's nodes, in order."""
    owner: dict[ir.Node, ir.Node] = {}  # node -> the leaf whose unit holds it, consumers first
    for node in reversed(nodes):  # consumers before producers
        if not is_backward(node):
            continue
        users = [user for out in node.outputs for user, _ in out.uses()]
        if not users:
            owner[node] = node
            continue
        if any(out.is_graph_output() for out in node.outputs):
            continue
        leaves = {owner.get(user) for user in users}
        if len(leaves) == 1 and None not in leaves:
            owner[node] = leaves.pop()
    units: dict[ir.Node, list[ir.Node]] = {}
    for node in reversed(owner):  # graph order, without walking the graph again
        units.setdefault(owner[node], []).append(node)
    return list(units.values())


def _ready_position(unit: Sequence[ir.Node], produced_at: _ProducedAt) -> int:
    """The graph position after which every value ``unit`` reads from outside exists."""
    members = set(unit)
    producers = [
        value.producer()
        for node in unit
        for value in node.inputs
        if value is not None and value.producer() not in members
    ]
    return max(map(produced_at, producers), default=-1)


class _ProducedAt:
    """Where a producer runs in graph order; -1 for graph inputs and initializers.  A
    clone not placed yet runs once its own inputs exist: memoized, as units read clones
    of clones (43k recursive calls for 4.6k lookups at 17.5k nodes without it)."""

    def __init__(self, position: dict[ir.Node, int]) -> None:
        self.position = position
        self.ready: dict[ir.Node, int] = {}  # clones not placed yet

    def __call__(self, producer: ir.Node | None) -> int:
        if producer is None:
            return -1
        position = self.position.get(producer)
        if position is not None:
            return position
        if producer not in self.ready:
            inputs = [v.producer() for v in producer.inputs if v is not None]
            self.ready[producer] = max(map(self, inputs), default=-1)
        return self.ready[producer]


def ort_default_order(nodes: Sequence[ir.Node]) -> list[ir.Node]:
    """The order ORT's ``ExecutionOrder.DEFAULT`` runs ``nodes`` (a graph's nodes, in
    graph order) in: post-order, depth first, from the leaves (nodes whose outputs no node
    reads), the last leaf in graph order first, and at each node its inputs' producers from
    the last in graph order down, each one's whole subgraph before the next.

    Nodes ORT's own optimizers create get new, higher indices there; this order is the
    graph's as ortpass hands it over.  An explicit stack: a recursive walk would exceed
    Python's recursion limit on a deep model's backward chain.
    """
    position = {node: i for i, node in enumerate(nodes)}
    producers = {
        node: sorted(
            {v.producer() for v in node.inputs if v is not None and v.producer() in position},
            key=position.__getitem__,
            reverse=True,
        )
        for node in nodes
    }
    read = {p for node in nodes for p in producers[node]}
    leaves = [node for node in reversed(nodes) if node not in read]
    order: list[ir.Node] = []
    done: set[ir.Node] = set()
    for leaf in leaves:
        stack: list[tuple[ir.Node, int]] = [(leaf, 0)]
        while stack:
            node, next_input = stack[-1]
            if node in done:
                stack.pop()
                continue
            inputs = producers[node]
            while next_input < len(inputs) and inputs[next_input] in done:
                next_input += 1
            if next_input < len(inputs):
                stack[-1] = (node, next_input + 1)
                stack.append((inputs[next_input], 0))
                continue
            stack.pop()
            done.add(node)
            order.append(node)
    return order
