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
import contextlib
import contextvars
import logging
import os
from typing import Iterable, Sequence

import onnx_ir as ir

from ortpass.analysis.plans import PlanSpec
from ortpass.analysis.recomputable_ops import ProbeLevel
from ortpass.analysis.recompute import (
    DEFAULT_MIN_ELEMENTS,
    Occurrence,
    RecomputeReport,
)
from ortpass.analysis.recompute.rewrite import RECOMPUTE_SUFFIX, apply_occurrences, nodes_to_clone
from ortpass.analysis.recompute.selection import AppliedPlan, RecomputeSelection
from ortpass.conventions import DROPOUT_SEEDS_FIXED, RECOMPUTED, STEP_MEMORY_TARGET_KEY
from ortpass.infra.base import OrtPass
from ortpass.infra.options import NonNegativeInt, ProbeLevelOption, RecomputeLevel
from ortpass.infra.registry import register_pass
from ortpass.ops.dropout import is_dropout
from ortpass.pythonop import rng_replay
from ortpass.training.split import finished_as_run

__all__ = ["RECOMPUTE_SUFFIX", "RecomputePass", "layerwise_notices_at"]

logger = logging.getLogger(__name__)

#: The level "layer-wise recompute recomputes nothing" is logged at: WARNING where the user
#: asked for the level; a caller that picked it for them (a default pipeline, which then
#: says it at every graph without transformer layers) lowers it with layerwise_notices_at.
_NOTHING_LEVEL = contextvars.ContextVar("ortpass_recompute_nothing_level", default=logging.WARNING)


@contextlib.contextmanager
def layerwise_notices_at(level: int):
    """Within the block, "recompute(level=N) recomputes nothing" is logged at ``level``
    (``logging.INFO`` for a pipeline whose recompute level the user did not choose)."""
    token = _NOTHING_LEVEL.set(level)
    try:
        yield
    finally:
        _NOTHING_LEVEL.reset(token)


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

    With ``budget``, the memory-budget planner chooses the occurrences, judging each choice
    on a copy rewritten by this pass and then by the passes after it in the pipeline that
    declare ``shapes_step_memory`` (:attr:`OrtPass.following`).

    Statistics: ``plans applied``, ``occurrences recomputed``, ``nodes cloned``,
    ``expected saving bytes`` counters; an ``applied`` note per plan (:class:`AppliedPlan`);
    also kept in :attr:`applied` after a run.  With a budget: ``predicted peak bytes`` (of
    the graph the pipeline ends with), ``budget target bytes``, a ``budget`` note.
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
        budget: int | float | str | None = None,
    ) -> None:
        super().__init__()
        self.selection = RecomputeSelection(
            plans,
            level=level,
            config_file=config_file,
            probe_level=probe_level,
            min_elements=min_elements,
            budget=budget,
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
        report, specs, occurrences = self.selection.select(model, cache, finished_as_run(self.step_memory_finish()))
        if cache is not None and cache.hits > hits:
            self.count("analysis reused")
        nodes = nodes_to_clone(occurrences, report.positions)
        _check_dropouts_seeded(nodes)
        rng_replay.check_pythonops(nodes)
        if not nodes:
            if self.selection.budget_plan is not None:
                self._record_budget()
                logger.info("recompute: %s", self.selection.budget_plan.summary())
            elif self.selection.level > 0:
                _warn_nothing_layerwise(self.selection.level, report)
            else:
                logger.info("recompute: no occurrence of %s in this graph", ",".join(map(str, specs)) or "any plan")
            return ir.passes.PassResult(model, modified=False)

        clones = apply_occurrences(model, nodes, report.positions, created_by=self.name)
        self._record(specs, occurrences, report, len(clones))
        if self.selection.budget_plan is not None:
            self._record_budget()
            # The passes after this one that lower the peak further stop at the target.
            model.metadata_props[STEP_MEMORY_TARGET_KEY] = str(self.selection.budget_plan.target_bytes)
        return ir.passes.PassResult(model, modified=True)

    def _record_budget(self) -> None:
        """Note the budget planner's choice; its predicted peak is a walk of the graph the
        pipeline ends with (this rewrite, then the passes after it that shape the step's
        memory, made on a copy)."""
        plan = self.selection.budget_plan
        assert plan is not None
        self.note("budget", plan.to_dict())
        self.count("predicted peak bytes", plan.predicted_peak)
        self.count("budget target bytes", plan.target_bytes)

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
    to do instead: the user asked for memory savings and gets none (at the level
    :func:`layerwise_notices_at` sets, where the user did not ask)."""
    severity = _NOTHING_LEVEL.get()
    if not report.layer_boundaries:
        logger.log(
            severity,
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
    logger.log(
        severity,
        "recompute(level=%d) recomputes nothing: %d layer boundaries found, but no candidate inside them "
        "qualifies (most common reasons: %s); %s",
        level,
        len(report.layer_boundaries),
        "; ".join(f"{reason} (x{count})" for reason, count in reasons.most_common(3)) or "none",
        way_out,
    )


def _check_dropouts_seeded(nodes: Iterable[ir.Node]) -> None:
    unseeded = [n.name for n in nodes if is_dropout(n) and "seed" not in n.attributes]
    if unseeded:
        raise ir.passes.PreconditionError(
            f"recompute would clone dropout node(s) {unseeded} that have no 'seed' attribute, so "
            "the clone would draw a different mask than forward; run FixDropoutSeedPass "
            "('fix-dropout-seed') with the same plan options first"
        )


