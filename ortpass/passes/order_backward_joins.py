"""Order the backward chains that meet at a node: the gradient first, then the one that frees the most.

ORT's default order walks a join's input chains from the highest node index down
(:mod:`ortpass.analysis.ort_order`), so the chain walked first runs while everything the
later chains read is still alive; ``docs/design/ort-execution-order.md`` has the attention
example and the measurement.

Rule: at a backward node that reads values from two or more *exclusive chains* (the
backward nodes that feed only that input: their outputs are read inside the chain or by
the join alone), the bytes a chain frees are those of the values it reads from outside
whose other backward readers all come before the join's chains in graph order (their last
reader is in the chain; graph order stands for ORT's here, as recompute places each clone
right before its first reader, where ORT's walk runs it); a value the chain reads only
through views (a Reshape's output is its input's buffer) is not freed before the join.
If the chain that frees the most is not the one ORT walks first, it moves, in its own
order, to just before the join: its last node then has the highest index among the join's
producers, and the walk takes it first.  A chain's outputs are read only inside it or by
the join, so the graph stays topologically sorted, and no node changes: only the order.
Sizes come from static shapes, or from the export's dims for symbolic ones; a join whose
chains read a value of unknown size is left alone.

The gradient goes first.  Where ORT would walk first an input that does not carry the
loss's gradient (a recompute clone's chain, a shape) while another input's exclusive chain
does, that chain moves to just before the join instead, whatever the sizes: the walk
otherwise runs the recomputation, and keeps what it recomputes alive, before the gradient
it meets exists.  The gradient's chain can hold a lot still to run: with a LoRA model's
base frozen, the first gradient leaf ORT walks (an adapter's ``B``, reading the
recomputed ``x A`` and the incoming gradient) recomputed the whole last layer before the
loss was even computed, and the step peaked at 260 MiB against 239 with every weight
trainable; with the gradient first, 208 (``benchmarks/results/train_wrapper.md``).  For the same
reason a chain that frees the most is not moved ahead of a gradient.
"""

from __future__ import annotations

import collections
import heapq
import logging

import onnx_ir as ir

from ortpass.analysis.memory import is_alias_node, nbytes_at
from ortpass.analysis.partition import get_training_info, is_backward
from ortpass.infra.base import OrtPass
from ortpass.infra.metadata import get_export_info
from ortpass.infra.registry import register_pass

__all__ = ["OrderBackwardJoinsPass"]

logger = logging.getLogger(__name__)


class _ValueBytes:
    """Bytes of a value: static shapes directly, symbolic ones at the export's dims."""

    def __init__(self, model: ir.Model) -> None:
        self.dims = get_export_info(model).get("dims") or {}
        self.known: dict[ir.Value, int | None] = {}

    def __call__(self, value: ir.Value) -> int | None:
        if value not in self.known:
            self.known[value] = nbytes_at(value, self.dims)
        return self.known[value]


class _BackwardNodes:
    """The backward nodes of a graph, read in one walk: the graph position of each (and of
    no other node), the nodes that read its outputs, and whether it carries the loss's
    gradient (reads one of ``sources``, the loss's gradient or the outputs', or a value
    computed from them).

    Readers are gathered once per node and shared by the search for joins and the chain
    walks, which before asked each producer again at every join that reads it.
    """

    def __init__(self, graph: ir.Graph, sources: frozenset[str]) -> None:
        self.nodes = list(graph)  # every node, in order: the reordering starts from it
        self.position: dict[ir.Node, int] = {}
        self.readers: dict[ir.Node, set[ir.Node]] = {}
        self.carries_gradient: set[ir.Node] = set()
        for i, node in enumerate(self.nodes):
            if is_backward(node):
                self.position[node] = i
                self.readers[node] = {user for out in node.outputs for user, _ in out.uses()}
                if any(v is not None and (v.name in sources or v.producer() in self.carries_gradient)
                       for v in node.inputs):  # fmt: skip
                    self.carries_gradient.add(node)

    def joins(self) -> list[ir.Node]:
        """The backward nodes that alone read the outputs of two or more backward nodes, in
        graph order: only there can two exclusive chains meet (an exclusive chain starts at
        a producer whose every reader is the join).  At 17.5k nodes, 1.4k of 16.5k."""
        sole_reader_of = collections.Counter(
            next(iter(readers)) for readers in self.readers.values() if len(readers) == 1
        )
        return [node for node in self.position if sole_reader_of[node] >= 2]


def exclusive_chain(value: ir.Value, join: ir.Node, backward: _BackwardNodes) -> list[ir.Node]:
    """The backward nodes whose outputs reach only ``join``'s input ``value``, in graph order.

    Nodes are taken consumers before producers (highest position first), so when a node
    is looked at, every chain node that reads it has been taken already.
    """
    position, readers = backward.position, backward.readers
    chain: set[ir.Node] = set()
    start = value.producer()
    if start not in position or readers[start] != {join}:
        return []  # the join is not the producer's only reader: no chain (most inputs)
    heap = [(-position[start], id(start), start)]
    seen = {start}
    while heap:
        _, _, node = heapq.heappop(heap)
        if any(user is not join and user not in chain for user in readers[node]):
            continue
        chain.add(node)
        for inp in node.inputs:
            producer = inp.producer() if inp is not None else None
            if producer in position and producer not in seen:
                seen.add(producer)
                heapq.heappush(heap, (-position[producer], id(producer), producer))
    return sorted(chain, key=position.__getitem__)


def freed_bytes(chain: list[ir.Node], sizes: _ValueBytes, position: dict[ir.Node, int], start: int) -> int | None:
    """Bytes of the values ``chain`` reads last: every other backward reader of them comes
    before ``start`` (the position of the join's first chain node) in graph order
    (``position``: the graph position of every backward node, and of no other)."""
    members = set(chain)
    total = 0
    read: set[ir.Value] = set()
    for node in chain:
        for value in node.inputs:
            if value is None or value in read or value.producer() in members:
                continue
            read.add(value)
            if value.is_graph_output() or value.is_graph_input() or value.is_initializer():
                continue  # held for the whole step anyway
            users = [user for user, _ in value.uses()]
            if any(user in position and user not in members and position[user] >= start for user in users):
                continue
            if all(is_alias_node(user) for user in users if user in members):
                continue  # a Reshape's output is the same buffer: it lives on to the join
            size = sizes(value)
            if size is None:
                return None
            total += size
    return total


@register_pass("order-backward-joins")
class OrderBackwardJoinsPass(OrtPass):
    """At each backward join, move to just before the join the exclusive chain that carries
    the loss's gradient where ORT would walk another input first, else the chain that frees
    the most bytes, so ORT's default order runs it first (see the module docstring).

    Runs last among the post-grad passes that move or add backward nodes (after
    ``recompute``, ``replay-dropout-mask`` and ``recompute-gate-activation``).  Statistics: ``joins reordered``,
    ``nodes moved``, ``gradients walked first`` (joins reordered for the gradient),
    ``joins of unknown size`` (left alone).
    """

    phase = "post-grad"
    shapes_step_memory = True
    runs_after = frozenset({"recompute", "replay-dropout-mask", "recompute-gate-activation"})

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        sizes = _ValueBytes(model)
        moves: list[tuple[ir.Node, list[ir.Node]]] = []
        backward = _BackwardNodes(graph, get_training_info(model).gradient_sources)
        for join in backward.joins():
            chain = self._chain_to_run_first(join, backward, sizes)
            if chain:
                moves.append((join, chain))
        for join, chain in moves:
            self.count("joins reordered")
            self.count("nodes moved", len(chain))
            logger.debug("%s: runs first the chain ending in %s", join.name, chain[-1].name)
        if moves:
            _reorder(graph, backward.nodes, moves)
        return ir.passes.PassResult(model, modified=bool(moves))

    def _chain_to_run_first(self, join: ir.Node, backward: _BackwardNodes, sizes: _ValueBytes) -> list[ir.Node] | None:
        """The chain to move before ``join``, or None when ORT already walks the best one first."""
        position = backward.position
        values = list(dict.fromkeys(v for v in join.inputs if v is not None and v.producer() in position))
        chains = [chain for v in values if (chain := exclusive_chain(v, join, backward))]
        if len({id(n) for c in chains for n in c}) < sum(map(len, chains)):
            return None  # chains sharing a node (it feeds the join twice)
        walked_first = max(values, key=lambda v: position[v.producer()]).producer()
        gradients = [chain for chain in chains if backward.carries_gradient.intersection(chain)]
        if gradients and walked_first not in backward.carries_gradient:
            self.count("gradients walked first")
            return max(gradients, key=lambda chain: position[chain[-1]])
        if len(chains) < 2:
            return None
        start = min(position[chain[0]] for chain in chains)
        freed = [freed_bytes(chain, sizes, position, start) for chain in chains]
        if None in freed:
            self.count("joins of unknown size")
            return None
        ranked = sorted(range(len(chains)), key=freed.__getitem__, reverse=True)
        best, runner_up = chains[ranked[0]], freed[ranked[1]]
        if freed[ranked[0]] <= runner_up or best[-1] is walked_first:
            return None  # no chain frees the most, or ORT walks it first already
        if gradients and not backward.carries_gradient.intersection(best):
            return None  # the gradient goes first
        return best


def _reorder(graph: ir.Graph, nodes: list[ir.Node], moves: list[tuple[ir.Node, list[ir.Node]]]) -> None:
    """Move each chain to just before its join, with one ``Graph.remove`` in all (it copies
    the graph's outputs on every call: one per join took 0.2 s of 0.3 at 17.5k nodes).
    ``nodes``: the graph's nodes, in order."""
    order = _moved_order(nodes, moves)
    moved = {node for _, chain in moves for node in chain}
    graph.remove(moved)
    run: list[ir.Node] = []  # moved nodes waiting for the next node that stays
    for node in order:
        if node in moved:
            run.append(node)
        elif run:
            graph.insert_before(node, run)
            run = []
    graph.extend(run)


def _moved_order(nodes: list[ir.Node], moves: list[tuple[ir.Node, list[ir.Node]]]) -> list[ir.Node]:
    """``nodes`` with each chain moved before its join, on a linked list.  Joins inside
    another join's chain come before it: moving the outer chain first (it keeps its own
    order) and the inner one after leaves both as wanted."""
    head, tail = object(), object()  # sentinels around the nodes
    after = dict(zip([head, *nodes], [*nodes, tail]))
    before = dict(zip([*nodes, tail], [head, *nodes]))
    for join, chain in reversed(moves):
        for node in chain:
            after[before[node]], before[after[node]] = after[node], before[node]
        for node in chain:
            prev = before[join]
            after[prev], before[node], after[node], before[join] = node, prev, join, node
    order = []
    node = after[head]
    while node is not tail:
        order.append(node)
        node = after[node]
    return order
