"""Recompute: clone the cheap subgraphs behind stashed activations into backward.

A training step keeps every forward value that backward reads (a *stashed activation*)
alive until backward last reads it.  Where the value is cheap to compute again from values
that stay alive anyway, backward reads a copy computed on the spot instead, and the forward
value dies as soon as forward is done with it.  The analysis
(:mod:`ortpass.analysis.recompute`) finds those subgraphs and names them in plans; this pass
applies the plans a :class:`~ortpass.analysis.recompute.selection.RecomputeSelection` picks
(ORTModule's levels 0, 1 and 2), and writes an execution order ONNX Runtime's default walk
follows (:mod:`ortpass.analysis.ort_order`).  Why, and what was measured:
``docs/design/recompute-scheduling.md``.
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Iterable, Sequence

import onnx_ir as ir

from ortpass.analysis.memory import is_alias_node
from ortpass.analysis.ort_order import order_gradient_leaves
from ortpass.analysis.partition import is_backward
from ortpass.analysis.plans import PlanSpec
from ortpass.analysis.recomputable_ops import OptionalOutputs, ProbeLevel
from ortpass.analysis.recompute import (
    DEFAULT_MIN_ELEMENTS,
    Occurrence,
    RecomputeReport,
)
from ortpass.analysis.recompute.selection import AppliedPlan, RecomputeSelection
from ortpass.conventions import (
    CREATED_BY_KEY,
    DROPOUT_SEEDS_FIXED,
    RECOMPUTE_OF_KEY,
    RECOMPUTED,
    SIDE_KEY,
)
from ortpass.infra.base import OrtPass
from ortpass.infra.options import NonNegativeInt, ProbeLevelOption, RecomputeLevel
from ortpass.infra.registry import register_pass
from ortpass.ops.dropout import is_dropout
from ortpass.pythonop import rng_replay

__all__ = ["RECOMPUTE_SUFFIX", "RecomputePass"]

logger = logging.getLogger(__name__)

RECOMPUTE_SUFFIX = "_recompute"


@register_pass("recompute")
class RecomputePass(OrtPass):
    """Clone the subgraph behind each selected stashed activation into backward.

    Rule: for every occurrence the plans select (see :class:`RecomputeSelection`), each node
    of its subgraph is cloned once, in topological order, as ``<name>_recompute`` with
    outputs ``<output>_recompute``.  A clone reads the clone of an input's producer where
    that producer is cloned too, else the forward value itself.  Then every *backward*
    consumer of a cloned node's output reads the clone's output instead; forward consumers
    and graph outputs keep the original.  Clones are tagged ``backward``.  Execution-order
    hint (see the module docstring): backward nodes no node reads, each with the backward
    nodes only it reads, move to the end of the graph, the first to become computable
    last, and each clone is placed right before its first backward consumer.  Subgraphs
    of several occurrences that share nodes share clones.

    Refuses (model unchanged) to clone a Dropout without a ``seed`` attribute: run
    ``FixDropoutSeedPass`` with the same options first (the pass manager does, from the
    ``"dropout-seeds-fixed"`` requirement).

    Statistics: ``plans applied``, ``occurrences recomputed``, ``nodes cloned``,
    ``expected saving bytes`` counters; an ``applied`` note per plan (:class:`AppliedPlan`);
    also kept in :attr:`applied` after a run.
    """

    phase = "post-grad"
    requires_properties = frozenset({DROPOUT_SEEDS_FIXED})
    provides_properties = frozenset({RECOMPUTED})

    def __init__(
        self,
        plans: str | PlanSpec | Sequence[str | PlanSpec] | None = None,
        *,
        level: RecomputeLevel = 0,
        config_file: str | os.PathLike | None = None,
        probe_level: ProbeLevelOption = ProbeLevel.ADVANCED,
        min_elements: NonNegativeInt | None = None,
    ) -> None:
        super().__init__()
        self.selection = RecomputeSelection(
            plans, level=level, config_file=config_file, probe_level=probe_level, min_elements=min_elements
        )
        self.applied: list[AppliedPlan] = []

    def __repr__(self) -> str:
        return f"RecomputePass({self.selection!r})"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.applied = []
        if self.selection.empty:
            return ir.passes.PassResult(model, modified=False)
        cache = self.analysis_cache
        hits = cache.hits if cache is not None else 0
        report, specs, occurrences = self.selection.select(model, cache)
        if cache is not None and cache.hits > hits:
            self.count("analysis reused")
        nodes = _nodes_to_clone(occurrences, report.positions)
        _check_dropouts_seeded(nodes)
        rng_replay.check_pythonops(nodes)
        if not nodes:
            if self.selection.level > 0:
                _warn_nothing_layerwise(self.selection.level, report)
            else:
                logger.info("recompute: no occurrence of %s in this graph", ",".join(map(str, specs)) or "any plan")
            return ir.passes.PassResult(model, modified=False)

        clones = _Cloner(model, report.positions).clone(nodes)
        _drop_what_nobody_reads(model, [n for n in nodes if n.graph is model.graph], clones)
        # One walk of the rewritten graph (clones not in it yet) serves both orderings.
        position = order_gradient_leaves(model.graph, list(model.graph))
        _place_clones(model.graph, clones, position)
        self._record(specs, occurrences, report, len(clones))
        return ir.passes.PassResult(model, modified=True)

    def _record(self, specs: Sequence[PlanSpec], occurrences: Sequence[Occurrence], report, cloned: int) -> None:
        by_plan: dict[tuple[str, int], list[Occurrence]] = {}
        for occ in occurrences:
            by_plan.setdefault((occ.cluster, int(occ.type)), []).append(occ)
        for spec in specs:
            applied = by_plan.get((spec.cluster, int(spec.type)), [])
            savings = [o.saving_bytes for o in applied]
            record = AppliedPlan(
                plan=str(spec),
                requested=spec.count,
                applied=len(applied),
                saving_bytes=None if None in savings else sum(savings),  # type: ignore[arg-type]
                symbolic_saving=str(sum((o.symbolic_saving for o in applied), start=0)),
            )
            self.applied.append(record)
            self.note("applied", record.to_dict())
            if applied:
                self.count("plans applied")
                self.count("occurrences recomputed", len(applied))
        self.count("nodes cloned", cloned)
        known = [a.saving_bytes for a in self.applied if a.saving_bytes is not None]
        self.count("expected saving bytes", sum(known))
        logger.info("recompute: %s", "; ".join(f"{a.plan} x{a.applied}" for a in self.applied))


def _warn_nothing_layerwise(level: int, report: RecomputeReport) -> None:
    """Say at WARNING why layer-wise recompute (level 1 or 2) recomputes nothing, and what
    to do instead: the user asked for memory savings and gets none."""
    if not report.layer_boundaries:
        logger.warning(
            "recompute(level=%d) recomputes nothing: it recomputes inside transformer layers only, and found "
            "no layer boundary (a LayerNorm whose block reaches an attention op -- Softmax, Attention, a "
            "registered attention PythonOp -- before its residual Add, pre-LN or post-LN); list the plans the "
            "whole graph offers with `ortpass report` (without --layer-boundary) and apply them with "
            "recompute(plans=...)",
            level,
        )
        return
    reasons = collections.Counter(skipped.reason for skipped in report.skipped)
    way_out = "list the candidates and why each was skipped with `ortpass report --layer-boundary`"
    if any("smaller than" in reason for reason in reasons):
        way_out = (
            f"all-static tensors under the size floor are not worth recomputing (ORT's floor, "
            f"{DEFAULT_MIN_ELEMENTS} elements): export with dynamic axes (batch, sequence) as ORTModule did, "
            f"or lower the floor with recompute(level={level}, min_elements=N)"
        )
    logger.warning(
        "recompute(level=%d) recomputes nothing: %d layer boundaries found, but no candidate inside them "
        "qualifies (most common reasons: %s); %s",
        level,
        len(report.layer_boundaries),
        "; ".join(f"{reason} (x{count})" for reason, count in reasons.most_common(3)) or "none",
        way_out,
    )


def _nodes_to_clone(occurrences: Iterable[Occurrence], positions: dict[ir.Node, int]) -> list[ir.Node]:
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


def _check_dropouts_seeded(nodes: Iterable[ir.Node]) -> None:
    unseeded = [n.name for n in nodes if is_dropout(n) and "seed" not in n.attributes]
    if unseeded:
        raise ir.passes.PreconditionError(
            f"recompute would clone dropout node(s) {unseeded} that have no 'seed' attribute, so "
            "the clone would draw a different mask than forward; run FixDropoutSeedPass "
            "('fix-dropout-seed') with the same plan options first"
        )


class _Cloner:
    """Creates the clones and moves backward consumers onto them."""

    def __init__(self, model: ir.Model, nodes: Iterable[ir.Node]) -> None:
        """``nodes``: every node of ``model``'s graph (their names and their outputs' are taken)."""
        self.model = model
        self.taken = _value_names(model.graph, nodes)

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
                CREATED_BY_KEY: RecomputePass.name,
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


