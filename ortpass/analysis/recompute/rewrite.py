"""Applying recompute occurrences to a graph: the rewrite :class:`ortpass.passes.RecomputePass`
makes, and the same rewrite on a copy, which the memory-budget planner runs to predict the
step peak of a choice (:func:`rewritten_peak`).

Rule: the union of the occurrences' subgraphs (with the views joining them, see
:func:`nodes_to_clone`) is cloned once, in topological order, as ``<name>_recompute``;
every backward consumer of a cloned output reads the clone instead; forward nodes that
only backward read are removed, and optional outputs nobody reads are dropped; backward
leaves are reordered for ORT's walk (:func:`~ortpass.analysis.ort_order.order_gradient_leaves`)
and each clone is placed right before its first backward consumer.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping, Sequence

import onnx_ir as ir

from ortpass.analysis.memory import is_alias_node
from ortpass.analysis.ort_order import order_gradient_leaves
from ortpass.analysis.partition import is_backward
from ortpass.analysis.recomputable_ops import OptionalOutputs
from ortpass.analysis.recompute.result import Occurrence
from ortpass.analysis.step_memory import predict_step_memory
from ortpass.conventions import CREATED_BY_KEY, RECOMPUTE_OF_KEY, SIDE_KEY, STEP_MEMORY_TARGET_KEY
from ortpass.pythonop import rng_replay

__all__ = ["RECOMPUTE_SUFFIX", "Finish", "apply_occurrences", "nodes_to_clone", "rewritten_peak"]

logger = logging.getLogger(__name__)

RECOMPUTE_SUFFIX = "_recompute"


def apply_occurrences(
    model: ir.Model, nodes: Sequence[ir.Node], positions: Mapping[ir.Node, int], created_by: str = "recompute"
) -> list[ir.Node]:
    """Clone ``nodes`` (:func:`nodes_to_clone` of the occurrences; ``positions``: the
    analysis's graph order) into backward; returns the clones."""
    clones = _Cloner(model, positions, created_by).clone(nodes)
    _drop_what_nobody_reads(model, [n for n in nodes if n.graph is model.graph], clones)
    # One walk of the rewritten graph (clones not in it yet) serves both orderings.
    position = order_gradient_leaves(model.graph, list(model.graph))
    _place_clones(model.graph, clones, position)
    return clones


#: What a pipeline does to a graph after the recompute rewrite that changes the step's
#: memory (the passes declaring ``shapes_step_memory``): takes a copy, returns the result.
Finish = Callable[[ir.Model], ir.Model]


def rewritten_peak(
    model: ir.Model,
    occurrences: Sequence[Occurrence],
    positions: Mapping[ir.Node, int],
    dims: Mapping[str, int] | None,
    finish: Finish | None = None,
    target: int | None = None,
) -> int:
    """The predicted step peak of ``model`` with ``occurrences`` recomputed, from the
    rewrite made on a copy, then ``finish`` (``model`` is not changed).  ``target``: the
    peak a budget aims at, recorded on the copy for ``finish``'s passes
    (``STEP_MEMORY_TARGET_KEY``)."""
    if not occurrences and finish is None:
        return predict_step_memory(model, dims).peak_bytes
    copy = model.clone()
    if target is not None:
        copy.metadata_props[STEP_MEMORY_TARGET_KEY] = str(target)
    if occurrences:
        counterpart = dict(zip(model.graph, copy.graph))
        copy_positions = {counterpart[n]: p for n, p in positions.items() if n in counterpart}
        nodes = nodes_to_clone([_Moved(counterpart, occ) for occ in occurrences], copy_positions)
        apply_occurrences(copy, nodes, copy_positions)
    if finish is not None:
        copy = finish(copy)
    return predict_step_memory(copy, dims).peak_bytes


class _Moved:
    """An occurrence's nodes in a copy of its graph (what :func:`nodes_to_clone` reads)."""

    def __init__(self, counterpart: Mapping[ir.Node, ir.Node], occ: Occurrence) -> None:
        self.nodes = tuple(counterpart[n] for n in occ.nodes)


def nodes_to_clone(occurrences: Iterable[Occurrence], positions: dict[ir.Node, int]) -> list[ir.Node]:
    """The union of the occurrences' subgraphs, in graph (topological) order (``positions``:
    the analysis's, of the graph as it is now), with the views joining them.

    Rule: where a cloned node reads a view (Reshape, Squeeze, ...) of a value another
    occurrence recomputes, the view is cloned too, so the clone reads the recomputed buffer;
    reading the forward view would keep the forward buffer alive through backward and undo
    that occurrence's saving (a frozen linear layer's recomputed Gemm reading the forward
    view of a recomputed Gelu output).
    """
    wanted = {node for occ in occurrences for node in occ.nodes}
    for node in sorted(wanted, key=positions.__getitem__, reverse=True):  # consumers first
        wanted.update(_views_of_cloned(node, wanted))
    return sorted(wanted, key=positions.__getitem__)


def _views_of_cloned(node: ir.Node, cloned: set[ir.Node]) -> list[ir.Node]:
    """The chains of view nodes between ``node``'s inputs and a node in ``cloned``."""
    found = []
    for value in node.inputs:
        chain, producer = [], value.producer() if value is not None else None
        while producer is not None and producer not in cloned and not is_backward(producer) and is_alias_node(producer):
            chain.append(producer)
            producer = producer.inputs[0].producer()
        if chain and producer in cloned:
            found.extend(chain)
    return found


class _Cloner:
    """Creates the clones and moves backward consumers onto them."""

    def __init__(self, model: ir.Model, nodes: Iterable[ir.Node], created_by: str) -> None:
        """``nodes``: every node of ``model``'s graph (their names and their outputs' are taken)."""
        self.model = model
        self.taken = _value_names(model.graph, nodes)
        self.created_by = created_by

    def unique(self, name: str) -> str:
        candidate, k = name, 1
        while candidate in self.taken:
            candidate, k = f"{name}_{k}", k + 1
        self.taken.add(candidate)
        return candidate

    def clone(self, nodes: Sequence[ir.Node]) -> list[ir.Node]:
        """Clone ``nodes`` (topological order); returns the clones in the same order."""
        clone_of: dict[ir.Value, ir.Value] = {}  # forward value -> the value of its clone
        clones: list[ir.Node] = []
        for node in nodes:
            inputs = [clone_of.get(v, v) if v is not None else None for v in node.inputs]
            if rng_replay.is_pythonop(node):
                original, clone = rng_replay.clone_with_rng_replay(self.model.graph, node, inputs, self)
            else:
                original, clone = node, self.new_clone(node, inputs)
            clones.append(clone)
            for old, new in zip(original.outputs, clone.outputs):
                clone_of[old] = new
        clone_ids = {id(c) for c in clones}
        for old, new in clone_of.items():
            for user, index in old.uses():  # a snapshot: rewiring does not change it
                if is_backward(user) and id(user) not in clone_ids:
                    user.replace_input_with(index, new)
        return clones

    def new_clone(self, node: ir.Node, inputs: Sequence[ir.Value | None], *, num_outputs: int | None = None,
                  attributes: Iterable[ir.Attr] | None = None) -> ir.Node:
        """A backward-tagged copy of ``node`` reading ``inputs``, outputs renamed."""
        attrs = node.attributes.values() if attributes is None else attributes
        name = self.unique(f"{node.name or node.op_type}{RECOMPUTE_SUFFIX}")
        # Outputs and metadata are handed to the constructor whole, not set one property
        # at a time on the node it made: a sixth of a clone's cost (5.6k clones at 17.5k nodes).
        count = len(node.outputs) if num_outputs is None else num_outputs
        outputs = [self.clone_value(old) for old in node.outputs[:count]]
        outputs += [ir.Value() for _ in range(count - len(outputs))]
        return ir.Node(
            node.domain,
            node.op_type,
            inputs,
            attributes=[_copy_attr(a) for a in attrs],
            overload=node.overload,
            outputs=outputs,
            version=node.version,
            name=name,
            metadata_props={
                SIDE_KEY: "backward",
                RECOMPUTE_OF_KEY: node.name or "",
                CREATED_BY_KEY: self.created_by,
            },
        )

    def clone_value(self, old: ir.Value) -> ir.Value:
        """A value like ``old`` (type, a copy of its shape), renamed for the clone."""
        return ir.Value(
            name=self.unique(f"{old.name}{RECOMPUTE_SUFFIX}") if old.name else None,
            type=old.type,
            shape=old.shape.copy() if old.shape is not None else None,
        )


def _drop_what_nobody_reads(model: ir.Model, originals: Sequence[ir.Node], clones: Sequence[ir.Node]) -> None:
    """Remove the forward nodes that only backward read, now that it reads their clones,
    and drop the optional outputs nobody reads any more (a forward Dropout's mask, a
    LayerNorm's Mean and InvStdDev, the same outputs of clones).

    Not cosmetic: ORT 1.19.2 frees a value after its last reader and never frees one that
    has none, so an unread output stays allocated until the step ends.  Before this, the
    forward Dropouts' masks held 10 MiB per layer through backward (GPT decoder, hidden
    256, batch 8 x 512).  The analysis (``_Analysis.left_unread``) assumes this runs.
    """
    graph, optional_outputs = model.graph, OptionalOutputs(model.opset_imports)

    def unread(value: ir.Value, dead: set[ir.Node]) -> bool:
        return not value.is_graph_output() and all(user in dead for user, _ in value.uses())

    dead: set[ir.Node] = set()
    for node in reversed(originals):  # consumers before producers
        if all(unread(out, dead) for out in node.outputs):
            dead.add(node)
    if dead:
        graph.remove([n for n in originals if n in dead], safe=True)
    for node in [*originals, *clones]:
        if node in dead:
            continue
        # Asked per node first: most ops have no optional output, and readers cost more.
        outputs = node.outputs
        for index in optional_outputs(node):
            out = outputs[index] if index < len(outputs) else None
            if out is not None and out.name and unread(out, dead):
                out.name = ""  # an omitted optional output
        if len(outputs) > 1 and not outputs[-1].name:  # most nodes: nothing to trim
            kept = len(outputs)
            while kept > 1 and not outputs[kept - 1].name:
                kept -= 1
            node.resize_outputs(kept)


def _copy_attr(attr: ir.Attr) -> ir.Attr:
    if attr.is_ref():  # a function's attribute reference: nothing of its own to copy
        return attr
    return ir.Attr(attr.name, attr.type, attr.value, doc_string=attr.doc_string)


def _value_names(graph: ir.Graph, nodes: Iterable[ir.Node]) -> set[str]:
    """The names of the graph's inputs and initializers and of ``nodes`` and their outputs."""
    names = {v.name for v in graph.inputs}
    # Plain adds, the empty names discarded once after: a generator per node took twice
    # as long (17.5k nodes).
    for node in nodes:
        names.add(node.name)
        for value in node.outputs:
            names.add(value.name)
    names.discard(None)
    names.discard("")
    names.update(graph.initializers)
    return names  # type: ignore[return-value]


def _place_clones(graph: ir.Graph, clones: list[ir.Node], position: dict[ir.Node, int]) -> None:
    """Insert each clone right before the first node (in graph order) that needs it.

    A clone's *anchor* is its first backward consumer in graph order, or the earliest
    anchor among the clones reading it.  Inserting clones in topological order before their
    anchors keeps the graph topologically sorted: a producer's anchor is never later than
    its consumers'.  ``position``: a number for each node of the graph, increasing in graph order.
    """
    members = set(clones)
    anchor: dict[ir.Node, ir.Node] = {}
    for clone in reversed(clones):
        users = [user for out in clone.outputs for user, _ in out.uses()]
        candidates = [anchor[u] if u in members else u for u in users]
        if not candidates:
            raise AssertionError(f"clone {clone.name} has no consumer; the rewiring missed it")
        anchor[clone] = min(candidates, key=position.__getitem__)
    # One insertion per anchor: each onnx_ir insertion call costs time in the graph's size.
    groups: dict[ir.Node, list[ir.Node]] = {}
    for clone in clones:
        groups.setdefault(anchor[clone], []).append(clone)
    for target, group in groups.items():
        graph.insert_before(target, group)


