"""Which recompute occurrences a set of plan options selects: shared by the recompute pass
and the dropout-seeding pass, so the dropouts seeded are exactly those cloned."""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Sequence

import onnx_ir as ir

from ortpass.analysis.plans import PlanSpec, PlanType, load_plan_file, parse_plans
from ortpass.analysis.recomputable_ops import ProbeLevel
from ortpass.analysis.recompute.budget import BudgetPlan, parse_budget, plan_for_budget
from ortpass.analysis.recompute.rewrite import Finish
from ortpass.analysis.recompute.candidates import find_recompute_candidates
from ortpass.analysis.recompute.timing import CostModel
from ortpass.analysis.recompute.result import Occurrence, RecomputeReport
from ortpass.conventions import RECOMPUTE_CANDIDATES
from ortpass.errors import PlanError
from ortpass.infra.analysis_cache import AnalysisCache
from ortpass.infra.options import NonNegativeInt, ProbeLevelOption, RecomputeLevel

__all__ = ["LEVELS", "AppliedPlan", "RecomputeSelection"]


LEVELS = (0, 1, 2)


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
        budget: int | float | str | None = None,
        cost_model: CostModel | None = None,
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
        if budget is not None:
            parse_budget(budget)  # a bad budget fails here, before any model is touched
            if level > 0 or given:
                raise PlanError(
                    "a memory budget chooses the plans itself: give budget= without level= or plans "
                    f"(got level={level}, plans={', '.join(map(str, given)) or 'none'})"
                )
        if level > 0 and given:
            raise PlanError(
                f"level {level} selects every detected plan itself; give plans or a config file "
                f"only with level=0 (got {', '.join(map(str, given))})"
            )
        self.plans: list[PlanSpec] = given
        self.level = level
        self.probe_level = probe_level
        self.min_elements = min_elements
        self.budget = budget
        self.cost_model = cost_model
        self.budget_plan: BudgetPlan | None = None  # the last budget selection's, for its report

    @property
    def empty(self) -> bool:
        """True when these options can select nothing in any graph."""
        return self.level == 0 and self.budget is None and not any(p.type != PlanType.NONE for p in self.plans)

    def select(
        self, model: ir.Model, cache: AnalysisCache | None = None, finish: Finish | None = None
    ) -> tuple[RecomputeReport, list[PlanSpec], list[Occurrence]]:
        """Analyse ``model`` (read only); the plans in force and the occurrences they select.

        With a ``cache`` (a pass manager's), an analysis of the same model object with the
        same options is reused (``RECOMPUTE_CANDIDATES``).  ``finish``: what the pipeline
        does after the recompute rewrite that changes the step's memory, which the budget
        planner applies to each graph it tries (see :func:`plan_for_budget`).
        """
        limits = {} if self.min_elements is None else {"min_elements": self.min_elements}
        if self.budget is not None and self.min_elements is None:
            # ORT's size floor guesses what is worth recomputing; the budget planner weighs
            # every tensor's bytes against its time itself.
            limits = {"min_elements": 0}
        key = (RECOMPUTE_CANDIDATES, self.probe_level, self.level > 0, limits.get("min_elements"))

        def analyse() -> RecomputeReport:
            return find_recompute_candidates(model, probe_level=self.probe_level, layer_boundary=self.level > 0, **limits)

        report = analyse() if cache is None else cache.get(key, model, analyse)
        if self.budget is not None:
            return report, *self._select_for_budget(model, report, cache, finish)
        if self.level == 0:
            specs = self.plans
        else:
            types = (PlanType.RECOMPUTE,) if self.level == 1 else (PlanType.RECOMPUTE, PlanType.RECOMPUTE_WITH_COMPROMISE)
            specs = [record.spec for record in report.plans if record.type in types]
        return report, specs, report.select(specs)

    def _select_for_budget(
        self, model: ir.Model, report: RecomputeReport, cache: AnalysisCache | None, finish: Finish | None
    ) -> tuple[list[PlanSpec], list[Occurrence]]:
        """The budget planner's choice; with a ``cache``, made once per model object (the
        dropout-seeding pass and the recompute pass then clone the same subgraphs)."""
        cost_model = self.cost_model or CostModel.for_this_machine()
        key = (RECOMPUTE_CANDIDATES, "budget", self.probe_level, self.min_elements, str(self.budget), cost_model)

        def plan() -> BudgetPlan:
            return plan_for_budget(model, report, self.budget, cost_model, finish)  # type: ignore[arg-type]

        self.budget_plan = plan() if cache is None else cache.get(key, model, plan)
        counts = collections.Counter((o.cluster, o.type) for o in self.budget_plan.chosen)
        specs = [PlanSpec(cluster, plan_type, count) for (cluster, plan_type), count in counts.items()]
        return specs, list(self.budget_plan.chosen)

    def __repr__(self) -> str:
        plans = ",".join(map(str, self.plans))
        budget = "" if self.budget is None else f", budget={self.budget!r}"
        return f"RecomputeSelection(plans={plans!r}, level={self.level}{budget}, probe_level={self.probe_level})"
