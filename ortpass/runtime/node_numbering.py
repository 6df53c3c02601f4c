"""Number a graph's nodes for ONNX Runtime so that its priority sort keeps few nodes
waiting, and ORT runs them in the same order.

ORT numbers nodes in graph order (``Constant`` nodes become initializers and get no
number).  Each time a graph transformer runs, a ``GraphViewer`` builds two orders:

- the *default* order, the one the session runs: post-order, depth first, from the leaves
  (nodes no node reads), which start on a stack in number order; each node entered pushes
  the producers of its inputs not entered yet in number order, so the highest number is
  walked first;
- a *priority* order (Kahn's): ready nodes wait in a list sorted by priority (``Shape`` and
  ``Size`` first, then the lowest number), and each node that becomes ready is inserted by
  a walk over the list.  A node ready long before its number comes up waits there, so each
  insertion costs the number of such nodes.

In a training graph many nodes are ready long before their number: the weights'
``Transpose``s, and backward nodes that read only forward values.  On HF LLaMA training
graphs (ORT 1.19.2) the list held 370 nodes on average at 40 layers and 734 at 80: every
transformer's sort grew with the square of the depth.

Rule: the default order depends on the numbers only through the relative order of the
leaves and of each node's producers.  ORT's own rewrites change those sets: an eliminated
node (``Identity``, a ``Not`` before a ``Where``, a no-op ``Cast``) hands its readers its
producer, and a fused node reads the producers of the nodes it replaces (a node read only
by its reader).  So each such set is kept in order together with its members' *stand-ins*:
the producers up to ``STAND_INS`` steps upstream through nodes with one producer or one
reader.  Within those pairs each node is numbered by when its inputs are ready (in a
topological order that takes the earliest-ready node first), and a node that must precede
an earlier-ready one is pulled ahead with it (numbering a node before its inputs costs
nothing: the sort takes it once it is ready).  The list then holds 31 nodes on average at
40 layers and 56 at 80; the session opened in 3.85 s instead of 4.96 at 80 layers, and
ORT optimized both numberings into the same graph (``docs/design/ort-facts.md``).

The new order is checked by walking ORT's default order over both numberings; were they to
differ, the graph keeps its order.  Only the graph handed to the session carries it: its
nodes are no longer topologically sorted (ORT sorts for itself).
"""

from __future__ import annotations

import heapq
import logging

import onnx

__all__ = ["number_for_ort"]

logger = logging.getLogger(__name__)


def number_for_ort(graph: onnx.GraphProto) -> bool:
    """Reorder ``graph.node`` as the module docstring says; ``Constant`` nodes first, in
    their order (ORT makes initializers of them, in that order).  Returns whether the
    order changed."""
    constants = [node for node in graph.node if node.op_type == "Constant"]
    nodes = [node for node in graph.node if node.op_type != "Constant"]
    producers = _producers(nodes)
    order = _numbering(producers)
    constants_first = all(node.op_type == "Constant" for node in graph.node[: len(constants)])
    if order == list(range(len(nodes))) and constants_first:
        return False
    if [order[i] for i in _walk(_renumbered(producers, order))] != _walk(producers):
        logger.warning("renumbering the nodes would change ORT's execution order; the graph keeps its order")
        return False
    reordered = constants + [nodes[i] for i in order]
    del graph.node[:]
    graph.node.extend(reordered)
    return True


def _producers(nodes: list[onnx.NodeProto]) -> list[list[int]]:
    """For each node, the distinct nodes whose outputs it reads (a subgraph's reads of outer
    values included: ORT gives them edges too), ascending."""
    made_by = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    producers = []
    for node in nodes:
        names = [*node.input, *_outer_reads(node)]
        producers.append(sorted({made_by[name] for name in names if name in made_by}))
    return producers


def _outer_reads(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read but do not define."""
    reads: set[str] = set()
    for attr in node.attribute:
        for subgraph in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
            defined = {v.name for v in subgraph.input} | {t.name for t in subgraph.initializer}
            defined |= {name for inner in subgraph.node for name in inner.output}
            for inner in subgraph.node:
                reads |= {name for name in [*inner.input, *_outer_reads(inner)] if name and name not in defined}
    return reads


def _walk(producers: list[list[int]]) -> list[int]:
    """ORT's default walk: the order it leaves the nodes in (the execution order).  The
    leaves start on the stack in number order; a node entered pushes its producers not
    entered yet in number order (the last pushed is walked first)."""
    readers = _successors(producers)
    stack = [(node, False) for node, read_by in enumerate(readers) if not read_by]
    entered, order = [False] * len(producers), []
    while stack:
        node, leaving = stack.pop()
        if leaving:
            order.append(node)
        elif not entered[node]:
            entered[node] = True
            stack.append((node, True))
            stack.extend((p, False) for p in producers[node] if not entered[p])
    return order


#: How far upstream a producer's stand-ins reach (module docstring): far enough for ORT's
#: eliminations and fusions met in random graphs (``tests/test_node_numbering.py``).
STAND_INS = 3


def _stand_ins(node: int, producers: list[list[int]], readers: list[list[int]]) -> set[int]:
    """``node`` and the nodes an ORT rewrite could put in its place as a reader's producer:
    upstream through nodes with one producer (eliminated) or one reader (fused)."""
    found, level = {node}, [node]
    for _ in range(STAND_INS):
        level = [p for n in level if len(producers[n]) == 1 or len(readers[n]) == 1 for p in producers[n] if p not in found]
        found.update(level)
    return found


def _kept_pairs(producers: list[list[int]]) -> list[list[int]]:
    """For each node, the nodes that must keep a lower number than it: within each node's
    producers, and within the leaves, with their stand-ins, each next to the one before it
    in the old numbers."""
    readers = _successors(producers)
    before: list[set[int]] = [set() for _ in producers]

    def keep(group: list[int]) -> None:
        if len(group) < 2:  # a single producer's stand-ins take its place, never stand beside it
            return
        members = sorted(set().union(*(_stand_ins(node, producers, readers) for node in group)))
        for first, second in zip(members, members[1:]):
            before[second].add(first)

    for inputs in producers:
        keep(inputs)
    keep([node for node, read_by in enumerate(readers) if not read_by])
    return [sorted(b) for b in before]


def _numbering(producers: list[list[int]]) -> list[int]:
    """The nodes (old numbers) in their new number order."""
    before = _kept_pairs(producers)
    reference = _earliest_ready_order(producers, before)
    if len(reference) < len(producers):  # a graph out of topological order: a cycle with the pairs
        return list(range(len(producers)))
    position = [0] * len(producers)
    for at, node in enumerate(reference):
        position[node] = at
    ready = [max((position[p] for p in inputs), default=-1) for inputs in producers]
    return _pulled_ahead_order(before, ready)


def _successors(lists: list[list[int]]) -> list[list[int]]:
    successors: list[list[int]] = [[] for _ in lists]
    for node, predecessors in enumerate(lists):
        for p in predecessors:
            successors[p].append(node)
    return successors


def _earliest_ready_order(producers: list[list[int]], before: list[list[int]]) -> list[int]:
    """A topological order of data edges and kept pairs together, taking next the node
    whose inputs were ready first (then the lower old number)."""
    waits = [sorted(set(inputs) | set(first)) for inputs, first in zip(producers, before)]
    successors = _successors(waits)
    left = [len(w) for w in waits]
    ready = [-1] * len(producers)
    readers = _successors(producers)
    heap = [(-1, node) for node, count in enumerate(left) if count == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, node = heapq.heappop(heap)
        for reader in readers[node]:
            ready[reader] = len(order)
        order.append(node)
        for successor in successors[node]:
            left[successor] -= 1
            if left[successor] == 0:
                heapq.heappush(heap, (ready[successor], successor))
    return order


def _pulled_ahead_order(before: list[list[int]], ready: list[int]) -> list[int]:
    """A topological order of the kept pairs alone, by when each node is ready; a node that
    must precede an earlier-ready one takes that one's time (it costs nothing to number a
    node before its inputs: ORT's sort takes it once it is ready)."""
    successors = _successors(before)
    left = [len(first) for first in before]
    topological, stack = [], [node for node, count in enumerate(left) if count == 0]
    pending = left[:]
    while stack:
        node = stack.pop()
        topological.append(node)
        for successor in successors[node]:
            pending[successor] -= 1
            if pending[successor] == 0:
                stack.append(successor)
    due = ready[:]
    for node in reversed(topological):
        for successor in successors[node]:
            due[node] = min(due[node], due[successor])
    heap = [(due[node], ready[node], node) for node, count in enumerate(left) if count == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        *_, node = heapq.heappop(heap)
        order.append(node)
        for successor in successors[node]:
            left[successor] -= 1
            if left[successor] == 0:
                heapq.heappush(heap, (due[successor], ready[successor], successor))
    return order


def _renumbered(producers: list[list[int]], order: list[int]) -> list[list[int]]:
    """``producers`` in the new numbers (``order[new] = old``)."""
    new = [0] * len(order)
    for number, node in enumerate(order):
        new[node] = number
    return [sorted(new[p] for p in producers[node]) for node in order]
