"""Recompute a value again for its late readers, where holding it from its early ones sets the peak.

``recompute`` clones each recomputed subgraph once, right before its first backward reader,
and every backward reader of a cloned value reads that clone.  When the readers are far
apart the clone stays alive in between.  In the torch builder's graphs the recomputation a
layer's MLP gradient needs (its input, the residual after attention) runs the layer's
attention again, and the attention probabilities it computes on the way (and their
dropout, each batch x heads x seq x seq) stay alive through the whole MLP backward, until
the attention's own gradient reads them: GPT-2's and LLaMA's step peaked there, in the
last layer's MLP backward, 64 and 32 MiB above what the MLP alone needs
(``benchmarks/hf_memory.py``, batch 8 x 512).

Rule: at the predicted step peak (:func:`~ortpass.analysis.step_memory.predict_step_memory`
of the graph as the installed onnxruntime runs it, in ORT's execution order; on stock
onnxruntime recomputed Dropouts read the forward masks), take each buffer a recompute
clone produced that is alive there and read after the peak, through any of its views.
Its *late readers* are those after the peak; the nodes to run again are the producers of
the buffer and of its views read late, and, through their inputs, every recompute clone
whose value would not be alive any more before the first late reader (at most
:data:`MAX_CHAIN` nodes; no PythonOp, no node with a subgraph).  Those nodes are copied,
in order, as early in graph order as their inputs allow (not before backward's first node),
so that ORT's walk computes them right before the late reader that needs them first, after
its other inputs; every reader after the peak of a value they produce reads the copy's
value instead.  The buffers are tried largest first, and the first copy that lowers the
predicted peak is kept (without a memory budget, only where it lowers the peak by at least
:data:`MIN_SAVED_PER_ADDED` times the share of the step's time it adds, both priced by
:class:`~ortpass.analysis.recompute.timing.CostModel`: a MatMul run a third time for a
hundredth of a percent of the peak is not worth its time); the search starts again at the
new peak, until no copy lowers it or the peak meets the target a memory budget recorded (``STEP_MEMORY_TARGET_KEY``,
written by ``recompute(budget=)``: copies past it would cost time for memory nobody asked
for).  A clone with no reader left is then removed.  Each copy costs the time of its
nodes, once a step; a copy that does not lower the peak is never made.

Copies are exact: they run the same nodes on the same inputs (a recomputed Dropout keeps
its fixed seed, or reads the forward mask where ``replay-dropout-mask`` made it so).
Sizes come from the export's dims; where some size is unknown there, or a data-dependent
dim has to be taken at a bound, the pass changes nothing.  Runs last: after ``recompute``,
``replay-dropout-mask`` and the ordering passes, whose order the prediction then includes.
The memory-budget planner runs it on each graph it tries (``shapes_step_memory``).
Statistics: ``values recomputed again``, ``nodes copied``, ``predicted peak bytes``.

Measured (``benchmarks/hf_memory.py``, 4 layers, hidden 256, batch 8 x 512, step peak):
the torch builder on stock onnxruntime, GPT-2 257 -> 227 MiB and LLaMA 220 -> 176; ORT's
builder, GPT-2 216 -> 204 and LLaMA without fused attention 249 -> 237.  The copies cost
time: GPT-2's on stock run each layer's LayerNorm and QKV projection again (its query and
key are not alive there), 1.38 -> 1.67 s a step measured back to back (torch with
checkpointing: 1.79).  Placing the copies as early as their inputs allow, rather than
right before their first reader, lowered ``ORTModule``'s LLaMA graph on stock from 152 to
143 MiB run alone (``docs/design/ort-execution-order.md``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Mapping, Sequence

import onnx_ir as ir

from ortpass.analysis import memory
from ortpass.analysis.partition import is_backward, is_training_graph
from ortpass.analysis.recompute.timing import CostModel
from ortpass.analysis.ort_order import ort_default_order
from ortpass.analysis.step_memory import StepMemory, last_reads, predict_step_memory
from ortpass.conventions import CREATED_BY_KEY, RECOMPUTE_OF_KEY, STEP_MEMORY_TARGET_KEY
from ortpass.graph.names import NameAllocator
from ortpass.infra.base import OrtPass
from ortpass.infra.metadata import get_export_info
from ortpass.infra.registry import register_pass
from ortpass.training.split import MASK_PRODUCT_INFIX, as_run

__all__ = ["MAX_CHAIN", "RecomputeAgainLatePass"]

logger = logging.getLogger(__name__)

#: Most nodes one late copy runs again: an attention's probabilities from its query and
#: key take six to nine (scores, scale, mask, softmax, dropout, views).
MAX_CHAIN = 16
LATE_SUFFIX = "_again"
#: Without a memory budget, a copy must lower the predicted peak by at least this share of
#: the share it adds to the step's time.  On HF LLaMA (stock onnxruntime, 4 layers, batch
#: 8 x 512) the copies that mattered lowered the peak by 0.9-6% each for 1.1-1.3% more
#: time, and seven of them by 0.01-0.07% each for 1.2-1.3% (a MatMul run a third time).
MIN_SAVED_PER_ADDED = 0.25


@register_pass("recompute-again-late")
class RecomputeAgainLatePass(OrtPass):
    """Copy a recomputation for its late readers, computed right before them, where that
    lowers the predicted step peak (see the module docstring for the rule)."""

    phase = "post-grad"
    shapes_step_memory = True
    runs_after = frozenset({"recompute", "replay-dropout-mask", "recompute-gate-activation", "order-backward-joins"})

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not is_training_graph(model):
            return ir.passes.PassResult(model, modified=False)
        dims = get_export_info(model).get("dims") or {}
        step = _predict_as_run(model, dims)
        if not step.exact or step.bounded:
            # A copy is judged by the peak it predicts: not on sizes guessed or left out.
            logger.info("recompute-again-late: skipped, sizes unknown at the export's dims (%s)",
                        (step.unknown or step.bounded)[0])
            return ir.passes.PassResult(model, modified=False)
        names = NameAllocator.of_graph(model.graph)
        target = _target(model)
        # Without a budget, a copy has to be worth its time (module docstring).
        prices = _Prices(CostModel.for_this_machine(), dims) if not target else None
        # The graph-internal dims the first prediction bound (by shape inference) hold for
        # every trial, whose copies keep their originals' shapes: bound once, not per trial.
        trial_dims = step.dims
        modified = False
        while step.peak_bytes > target:
            accepted = None
            step_seconds = prices.seconds(model.graph) if prices else 0.0
            for copy in _candidates(model, step, dims):
                copy.apply(model.graph, NameAllocator(names.taken))  # names taken for good below
                trial = _predict_as_run(model, trial_dims)
                copy.undo(model.graph)
                if trial.peak_bytes < step.peak_bytes and (
                    prices is None or _worth_its_time(copy, step, trial, prices, step_seconds)
                ):
                    accepted = copy
                    break
            if accepted is None:
                break
            accepted.apply(model.graph, names)
            accepted.drop_unread_originals(model.graph)
            logger.debug("%s computed again before %s: peak %d -> %d bytes", accepted.value.name,
                         accepted.place.name, step.peak_bytes, trial.peak_bytes)
            step = trial
            self.count("values recomputed again")
            self.count("nodes copied", len(accepted.nodes))
            modified = True
        if modified:
            self.count("predicted peak bytes", step.peak_bytes)
        return ir.passes.PassResult(model, modified=modified)


@dataclasses.dataclass
class _LateCopy:
    """The recompute clones ``nodes`` (graph order) producing ``value``, to be run again
    for ``readers`` (node, input index, original value), of which ``place`` comes first in
    graph order; the copies go right before ``before``."""

    value: ir.Value
    nodes: list[ir.Node]
    place: ir.Node
    before: ir.Node
    readers: list[tuple[ir.Node, int, ir.Value]]
    copies: list[ir.Node] = dataclasses.field(default_factory=list)

    def apply(self, graph: ir.Graph, names: NameAllocator) -> None:
        copy_of: dict[ir.Value, ir.Value] = {}
        self.copies = [_copy(node, copy_of, names) for node in self.nodes]
        graph.insert_before(self.before, self.copies)
        for reader, index, original in self.readers:
            reader.replace_input_with(index, copy_of[original])

    def undo(self, graph: ir.Graph) -> None:
        for reader, index, original in self.readers:
            reader.replace_input_with(index, original)
        for node in reversed(self.copies):
            for i in range(len(node.inputs)):
                node.replace_input_with(i, None)
        graph.remove(self.copies)
        self.copies = []

    def drop_unread_originals(self, graph: ir.Graph) -> None:
        """Remove the originals nobody reads any more (consumers first)."""
        for node in reversed(self.nodes):
            if all(not out.uses() and not out.is_graph_output() for out in node.outputs):
                for i in range(len(node.inputs)):
                    node.replace_input_with(i, None)
                graph.remove(node)


class _Prices:
    """The cost model's seconds for nodes at ``dims``, each node priced once per run of the
    pass: the pass changes no node's shapes or attributes, and pricing the whole graph
    every round took 16 of the pass's 91 s on HF LLaMA's stock graph (4 layers, batch 8 x
    512, under cProfile)."""

    def __init__(self, cost_model: CostModel, dims: Mapping[str, int]) -> None:
        self._cost_model, self._dims = cost_model, dims
        self._seconds: dict[ir.Node, float] = {}

    def seconds(self, nodes: Iterable[ir.Node]) -> float:
        total = 0.0
        for node in nodes:
            seconds = self._seconds.get(node)
            if seconds is None:
                seconds = self._seconds[node] = self._cost_model.node_seconds(node, self._dims)
            total += seconds
        return total


def _worth_its_time(copy: _LateCopy, step: StepMemory, trial: StepMemory, prices: _Prices, step_seconds: float) -> bool:
    """Whether ``copy`` lowers the peak by at least :data:`MIN_SAVED_PER_ADDED` times the
    share it adds to the step's time (the step's time as the cost model prices every node)."""
    if step_seconds <= 0:
        return True
    added = prices.seconds(copy.nodes) / step_seconds
    saved = (step.peak_bytes - trial.peak_bytes) / step.peak_bytes
    if saved < MIN_SAVED_PER_ADDED * added:
        logger.debug("%s: not computed again, it would lower the peak by %.2f%% for %.2f%% more time",
                     copy.value.name, 100 * saved, 100 * added)
        return False
    return True


def _target(model: ir.Model) -> int:
    """The step peak a memory budget aims at (``recompute(budget=)`` records it), else 0:
    as low as copies take it."""
    text = model.metadata_props.get(STEP_MEMORY_TARGET_KEY)
    return int(text) if text else 0


def _predict_as_run(model: ir.Model, dims: Mapping[str, int]) -> StepMemory:
    """The step memory of ``model`` as the installed onnxruntime will run it: on stock
    onnxruntime, recomputed Dropouts read the forward masks (a copy is predicted)."""
    return predict_step_memory(as_run(model), dims)


def _peak_in(order: Sequence[ir.Node], step: StepMemory) -> int:
    """The position in ``order`` (the graph's ORT order) of ``step``'s peak, which may be
    a copy's: found by node name, a recomputed Dropout's mask product by the Dropout's."""
    if not len(step.live):
        return 0
    name = step.peak_node.name or ""
    name = name.split(MASK_PRODUCT_INFIX)[0]
    position = next((i for i, node in enumerate(order) if node.name == name), None)
    return position if position is not None else int(step.live.argmax())


def _candidates(model: ir.Model, step: StepMemory, dims: Mapping[str, int]) -> list[_LateCopy]:
    """A late copy for each buffer a recompute clone produced that is alive at the peak
    and read after it (through any of its views)."""
    order = ort_default_order(list(model.graph))
    peak = _peak_in(order, step)
    ort_position = {node: i for i, node in enumerate(order)}
    graph_nodes = list(model.graph)
    graph_position = {node: i for i, node in enumerate(graph_nodes)}
    first_backward = next((i for i, node in enumerate(graph_nodes) if is_backward(node)), 0)
    buffers = memory.BufferMap()
    last_read = last_reads(order, ort_position, buffers, len(order) - 1)
    views: dict[ir.Value, list[ir.Value]] = {}
    for node in order:
        for value in node.outputs:
            views.setdefault(buffers.root(value), []).append(value)
    found = []
    for node in order[: peak + 1]:
        for root in node.outputs:
            if not _is_clone(node) or buffers.root(root) is not root or last_read.get(root, -1) <= peak:
                continue
            read_late = [v for v in views[root] if any(ort_position.get(u, -1) > peak for u, _ in v.uses())]
            copy = _late_copy(root, read_late, peak, ort_position, graph_position, buffers, last_read)
            if copy is not None:
                earliest = max(_inputs_ready_at(copy.nodes, graph_position) + 1, first_backward)
                found.append(dataclasses.replace(copy, before=graph_nodes[earliest]))
    # The largest first: the search keeps the first copy that lowers the peak.
    found.sort(key=lambda c: -(memory.nbytes_at(c.value, dims) or 0))
    return found


def _late_copy(root, read_late, peak, ort_position, graph_position, buffers, last_read) -> _LateCopy | None:
    """The copy of the recomputation of ``root``'s buffer (``read_late``: it and its views
    that are read after ``peak``) for the readers after the peak, or None."""
    late_users = [u for v in read_late for u, _ in v.uses() if ort_position.get(u, -1) > peak]
    if not late_users:
        return None
    place = min(late_users, key=graph_position.__getitem__)
    at = ort_position[place]
    chain: set[ir.Node] = set()
    stack = [v.producer() for v in read_late]
    while stack:
        node = stack.pop()
        if node in chain:
            continue
        if not _copyable(node):
            return None
        if len(chain) >= MAX_CHAIN:
            # Said, not silent: a longer chain is a peak this pass could have lowered.
            logger.debug("%s: not computed again, its recomputation is longer than MAX_CHAIN (%d nodes)",
                         root.name, MAX_CHAIN)
            return None
        chain.add(node)
        for source in node.inputs:
            producer = source.producer() if source is not None else None
            if producer is None or producer.graph is None:
                continue  # a graph input or an initializer: alive through the step
            # The buffer being copied dies early once its late readers move: never "alive".
            owner = buffers.root(source)
            alive_there = owner is not root and last_read.get(owner, -1) >= at
            if not alive_there and _is_clone(producer):
                stack.append(producer)
    nodes = sorted(chain, key=graph_position.__getitem__)
    if graph_position[nodes[-1]] >= graph_position[place]:
        return None
    produced = {out for node in chain for out in node.outputs}
    readers = [
        (user, index, source)
        for source in produced
        for user, index in source.uses()
        if user not in chain and ort_position.get(user, -1) > peak
        and graph_position.get(user, -1) >= graph_position[place]
    ]  # fmt: skip
    return _LateCopy(root, nodes, place, before=place, readers=readers)


def _inputs_ready_at(chain: Sequence[ir.Node], graph_position: Mapping[ir.Node, int]) -> int:
    """The graph position of the last producer of a value ``chain`` reads from outside.

    The copies go right after it, not right before their first late reader: ORT's walk
    visits a node's inputs' producers from the last in graph order down, so a copy placed
    last is computed first, and held while the reader's other inputs (a gradient chain
    through the rest of the layer, when a weight gradient reads ``Gemm(x, dY)``) are
    computed.  Placed as early as its inputs allow, it is computed last, right before its
    reader.
    """
    members = set(chain)
    producers = {value.producer() for node in chain for value in node.inputs if value is not None}
    return max((graph_position[p] for p in producers if p is not None and p not in members and p in graph_position),
               default=-1)


def _is_clone(node: ir.Node) -> bool:
    return is_backward(node) and RECOMPUTE_OF_KEY in node.metadata_props


def _copyable(node: ir.Node | None) -> bool:
    """A recompute clone that can run a second time: no PythonOp (its ctx is one
    Function call's), no subgraph."""
    return (node is not None and _is_clone(node) and node.op_type != "PythonOp"
            and not any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()))


def _copy(node: ir.Node, copy_of: dict[ir.Value, ir.Value], names: NameAllocator) -> ir.Node:
    outputs = [
        ir.Value(name=names.fresh(f"{out.name}{LATE_SUFFIX}"), type=out.type,
                 shape=out.shape.copy() if out.shape is not None else None)
        if out.name else ir.Value()
        for out in node.outputs
    ]  # fmt: skip
    copy = ir.Node(
        node.domain,
        node.op_type,
        [copy_of.get(v, v) if v is not None else None for v in node.inputs],
        attributes=[ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()],
        overload=node.overload,
        outputs=outputs,
        version=node.version,
        name=names.fresh(f"{node.name or node.op_type}{LATE_SUFFIX}"),
        metadata_props={**node.metadata_props, CREATED_BY_KEY: "recompute-again-late"},
    )
    copy_of.update(zip(node.outputs, outputs))
    return copy
