"""Recompute: clone the cheap subgraphs behind stashed activations into backward.

A training step keeps every forward value that backward reads (a *stashed activation*)
alive from the moment forward computes it until backward last reads it.  When the value is
cheap to compute again from values that stay alive anyway, backward can read a copy
computed on the spot instead, and the forward value dies as soon as forward is done with
it.  :func:`ortpass.analysis.find_recompute_candidates` finds those subgraphs and names
them in plans (``<cluster>:<type>:<count>``, ORTModule's format); this pass applies plans.

Which plans, as ORTModule's ``ORTMODULE_MEMORY_OPT_LEVEL``:

- level 0: the plans given (strings, a list, or a JSON file holding a list of strings);
- level 1: every type-1 plan of the layer-wise analysis (``layer_boundary=True``: only
  subgraphs inside detected transformer layers, each layer's input kept);
- level 2: level 1 plus the compromise (type-2) plans.

Execution order.  ONNX Runtime picks its own order; what 1.19.2 does was measured (ORT
profiling, decoders of 2 and 4 layers):

- ``ExecutionOrder.DEFAULT`` (what every session uses unless told otherwise) is a
  post-order depth-first walk from the *leaves* (nodes no node reads: the producers of
  the gradient outputs), taking leaves from the highest node index down and, at each
  node, visiting its inputs' producers from the highest index down too.  Node indices
  follow graph order, except that nodes ORT's optimizers create get new, higher ones
  (the profiler reports them as ``node_index``: on the 8-layer benchmark graph a
  split-gradient Concat ran its inputs from indices 342, 341, 330 in that order);
- so the leaf walked first pulls in everything it depends on.  In a training graph as
  built, the last leaf (an early layer's gradient, or a fused weight-gradient Gemm) pulls
  in the whole backward, and the other leaves -- every bias gradient's ReduceSum -- run
  at the very end of the step, keeping their inputs (an activation gradient per bias,
  36 MiB per layer at hidden 256, batch 8 x 512) alive until then.  Recompute moves the
  step's peak into backward, where this dominated;
- ``PRIORITY_BASED`` is Kahn's algorithm on ``Node::Priority()`` then node index.  The
  priority ORT's own optimizer gives its clones exists only inside ORT (no ONNX field
  carries it), and any node ORT creates in backward (a fused MatMul) waits behind every
  ready node with a lower index: clones then run during forward and recompute saves
  nothing.  Do not use it with this pass.  (``MEMORY_EFFICIENT``, ORTModule's, needs the
  YieldOp graph; on a plain training graph it gives DEFAULT's order.)

So the pass writes the order into the graph for DEFAULT's walk: each backward leaf, with
the backward nodes that only it reads (a weight gradient's Reshape-Gemm-Transpose chain),
goes to the end of the graph, ranked by when the values it reads from the rest of the graph
exist (the first to become computable gets the highest index, so each leaf runs as soon as
its inputs exist), and each clone is placed right before its first backward consumer.
A consequence measured but left alone: a clone then has a higher index than the consumer's
other inputs, so a layer's recompute runs before the gradient that consumer also needs is
computed (4 layers: the head's 32 MiB logits gradient stays alive through the last
layer's recompute).  Placing every clone right after forward instead left the 8-layer
peak where it was (199 MiB both ways), so the simpler placement stays.
Ranking by the leaf's own position is not enough: ORT's pre-gradient fusions
(``build_training_graph(ort_fusions=True)``) re-sort the graph and put every
weight-gradient chain after all of backward, and the walk then deferred them, with the
bias gradients, to the end of the step (4 layers, level 1: 416 MiB step peak instead of
237).  This holds only while ORT creates no leaf of its own, so sessions disable
GemmTransposeFusion (it replaces the weight-gradient Gemms).
``benchmarks/recompute_memory.py`` measures the resulting peak memory.

ORT's own optimizers can undo the rewrite: common subexpression elimination merges a clone
and its original into one node, SkipLayerNormFusion fuses an ``Add`` whose only remaining
consumer is a LayerNormalization and drops that LayerNorm's mean and inverse-std outputs
that backward reads, GeluFusion fuses the forward's Erf-based Gelu (read by forward only
once backward reads clones) into a kernel that rounds differently from the clones, and
GemmTransposeFusion breaks the order above.  ``TrainingSession`` disables all four
(:data:`ortpass.runtime.session.DISABLED_ORT_OPTIMIZERS`).

Dropout: the clone of a Dropout must draw the forward's mask, which holds only when the
Dropout has a ``seed`` attribute (each kernel then owns a generator seeded alike and both
advance once per step; ORT runs every node of the graph on every run, whatever is
fetched, so they stay in step).  :class:`~ortpass.passes.fix_dropout_seed.FixDropoutSeedPass`
seeds them; this pass requires ``"dropout-seeds-fixed"`` and refuses to clone an unseeded
Dropout.

PythonOps whose Function is registered as recomputable are cloned with their RNG state
replayed (:mod:`ortpass.passes.recompute_pythonop`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from typing import Iterable, Sequence

import onnx_ir as ir

from ortpass.analysis.partition import is_backward
from ortpass.analysis.plans import PlanSpec, PlanType, load_plan_file, parse_plans
from ortpass.analysis.recomputable_ops import OptionalOutputs, ProbeLevel
from ortpass.analysis.recompute import (
    DEFAULT_MIN_ELEMENTS,
    Occurrence,
    RecomputeReport,
    find_recompute_candidates,
)
from ortpass.conventions import CREATED_BY_KEY, MS_DOMAIN, RECOMPUTE_OF_KEY, SIDE_KEY
from ortpass.errors import PlanError
from ortpass.infra.analysis_cache import AnalysisCache
from ortpass.infra.base import OrtPass
from ortpass.infra.options import NonNegativeInt, ProbeLevelOption, RecomputeLevel
from ortpass.infra.registry import register_pass
from ortpass.passes import recompute_pythonop

__all__ = [
    "ANALYSIS",
    "AppliedPlan",
    "DROPOUT_OPS",
    "LEVELS",
    "RECOMPUTE_SUFFIX",
    "RecomputePass",
    "RecomputeSelection",
    "is_dropout",
]

logger = logging.getLogger(__name__)

#: The name of the recompute analysis in a pass manager's analysis cache.
ANALYSIS = "recompute-candidates"
RECOMPUTE_SUFFIX = "_recompute"

LEVELS = (0, 1, 2)

#: (domain, op type) of the dropouts whose clone must replay the forward's mask.
DROPOUT_OPS = frozenset(
    {
        ("", "Dropout"),
        (MS_DOMAIN, "BitmaskDropout"),
        (MS_DOMAIN, "BiasDropout"),
        (MS_DOMAIN, "BitmaskBiasDropout"),
        (MS_DOMAIN, "BiasSoftmaxDropout"),
    }
)


def is_dropout(node: ir.Node) -> bool:
    domain = "" if node.domain == "ai.onnx" else node.domain
    return (domain, node.op_type) in DROPOUT_OPS


@dataclasses.dataclass(frozen=True)
class AppliedPlan:
    """One plan as applied: how many occurrences were asked for and rewritten, and the
    saving the analysis expects (bytes at the analysis dims, and symbolically)."""

    plan: str
    requested: int  # -1: every occurrence
    applied: int
    saving_bytes: int | None
    symbolic_saving: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class RecomputeSelection:
    """Which recompute occurrences a set of plan options selects in a training graph.

    Shared by :class:`RecomputePass` and ``FixDropoutSeedPass`` so that the dropouts seeded
    are exactly those that will be cloned.  Options are validated here, at construction:
    a bad plan string, a missing plan file or bad JSON raises
    :class:`~ortpass.errors.PlanError` before any model is touched.
    """

    def __init__(
        self,
        plans: str | PlanSpec | Sequence[str | PlanSpec] | None = None,
        *,
        level: RecomputeLevel = 0,
        config_file: str | os.PathLike | None = None,
        probe_level: ProbeLevelOption = ProbeLevel.ADVANCED,
        min_elements: NonNegativeInt | None = None,
    ) -> None:
        if level not in LEVELS:
            raise ValueError(f"recompute level must be one of {LEVELS}, not {level!r}")
        # Checked here, not only by the analysis: it runs after the gradient build.
        if probe_level not in (ProbeLevel.BASIC, ProbeLevel.ADVANCED) or isinstance(probe_level, bool):
            raise ValueError(f"probe_level must be 0 (basic) or 1 (advanced), not {probe_level!r}")
        if min_elements is not None and (type(min_elements) is not int or min_elements < 0):
            raise ValueError(f"min_elements must be an int >= 0 or None, not {min_elements!r}")
        given = parse_plans(plans)
        if config_file is not None:
            given += load_plan_file(config_file)
        if level > 0 and given:
            raise PlanError(
                f"level {level} selects every detected plan itself; give plans or a config file "
                f"only with level=0 (got {', '.join(map(str, given))})"
            )
        self.plans: list[PlanSpec] = given
        self.level = level
        self.probe_level = probe_level
        self.min_elements = min_elements

    @property
    def empty(self) -> bool:
        """True when these options can select nothing in any graph."""
        return self.level == 0 and not any(p.type != PlanType.NONE for p in self.plans)

    def select(
        self, model: ir.Model, cache: AnalysisCache | None = None
    ) -> tuple[RecomputeReport, list[PlanSpec], list[Occurrence]]:
        """Analyse ``model`` (read only); the plans in force and the occurrences they select.

        With a ``cache`` (a pass manager's), an analysis of the same model object with the
        same options is reused (``ANALYSIS``).
        """
        limits = {} if self.min_elements is None else {"min_elements": self.min_elements}
        key = (ANALYSIS, self.probe_level, self.level > 0, self.min_elements)

        def analyse() -> RecomputeReport:
            return find_recompute_candidates(model, probe_level=self.probe_level, layer_boundary=self.level > 0, **limits)

        report = analyse() if cache is None else cache.get(key, model, analyse)
        if self.level == 0:
            specs = self.plans
        else:
            types = (PlanType.RECOMPUTE,) if self.level == 1 else (PlanType.RECOMPUTE, PlanType.RECOMPUTE_WITH_COMPROMISE)
            specs = [record.spec for record in report.plans if record.type in types]
        return report, specs, report.select(specs)

    def __repr__(self) -> str:
        plans = ",".join(map(str, self.plans))
        return f"RecomputeSelection(plans={plans!r}, level={self.level}, probe_level={self.probe_level})"


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
    requires_properties = frozenset({"dropout-seeds-fixed"})
    provides_properties = frozenset({"recomputed"})

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
        recompute_pythonop.check_pythonops(nodes)
        if not nodes:
            if self.selection.level > 0:
                _warn_nothing_layerwise(self.selection.level, report)
            else:
                logger.info("recompute: no occurrence of %s in this graph", ",".join(map(str, specs)) or "any plan")
            return ir.passes.PassResult(model, modified=False)

        clones = _Cloner(model, report.positions).clone(nodes)
        _drop_what_nobody_reads(model, [n for n in nodes if n.graph is model.graph], clones)
        # One walk of the rewritten graph (clones not in it yet) serves both orderings.
        position = _order_gradient_leaves(model.graph, list(model.graph))
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
    the analysis's, of the graph as it is now)."""
    wanted = {node for occ in occurrences for node in occ.nodes}
    return sorted(wanted, key=positions.__getitem__)


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
            if recompute_pythonop.is_pythonop(node):
                original, clone = recompute_pythonop.clone_with_rng_replay(self.model.graph, node, inputs, self)
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


def _order_gradient_leaves(graph: ir.Graph, nodes: list[ir.Node]) -> dict[ir.Node, int]:
    """Move each backward leaf (a node no node reads: it produces gradient outputs), with
    the backward nodes that feed only it, to the end of the graph, the leaf that becomes
    computable first last, so that ORT's default order runs each one as soon as its inputs
    exist (see the module docstring: ORT takes leaves from the last one in graph order).

    A leaf's *unit* is the leaf and the nodes whose outputs only it reads, directly or
    through other nodes of the unit (a weight gradient's Reshape-Gemm-Transpose chain).
    Units are ranked by when the values they read from outside exist, not by where the
    leaf sits: ORT's pre-gradient fusions re-sort the graph and put weight-gradient chains
    after all of backward, and a rank by position then ran them (and the bias gradients
    ranked alike) at the end of the step, keeping an activation gradient per layer alive.
    A unit's outputs are read only inside it, so the graph stays topologically sorted.

    ``nodes``: the graph's nodes in order.  Returns a number for each, increasing in the
    new order.
    """
    position = {node: i for i, node in enumerate(nodes)}
    units = _leaf_units(nodes)
    produced_at = _ProducedAt(position)
    ready = {unit[-1]: _ready_position(unit, produced_at) for unit in units}
    units.sort(key=lambda unit: (ready[unit[-1]], position[unit[-1]]))
    moved = [node for unit in reversed(units) for node in unit]
    # One removal and one extension: Graph.remove copies the graph's outputs on every call.
    graph.remove(moved)
    graph.extend(moved)
    # The others keep their numbers, in the same order still; the moved come after them.
    position.update((node, len(nodes) + i) for i, node in enumerate(moved))
    return position


def _leaf_units(nodes: Sequence[ir.Node]) -> list[list[ir.Node]]:
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
