"""Give a fixed seed to every dropout that recompute will clone.

A Dropout without a ``seed`` attribute draws from ONNX Runtime's global generator, so its
clone in backward would draw a different mask than the forward node did, and the gradient
would be wrong.  With a seed, each Dropout kernel owns a generator seeded with it; the
forward node and its clone start alike and advance once per step, so they draw the same
mask at every step while masks still change from step to step (ORT PR #19715 made the
same fix).  Seeds already present are kept.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import onnx_ir as ir

from ortpass.analysis.plans import PlanSpec
from ortpass.analysis.recomputable_ops import ProbeLevel
from ortpass.analysis.recompute.selection import RecomputeSelection
from ortpass.conventions import DROPOUT_SEEDS_FIXED, RECOMPUTE_CANDIDATES
from ortpass.infra.base import OrtPass
from ortpass.infra.options import NonNegativeInt, ProbeLevelOption, RecomputeLevel
from ortpass.infra.registry import register_pass
from ortpass.ops.dropout import dropout_seed, is_dropout
from ortpass.training.split import finished_as_run

__all__ = ["FixDropoutSeedPass", "dropout_seed"]

logger = logging.getLogger(__name__)

# Dropout's seed is an int attribute; stay in the positive int32 range every kernel accepts.
@register_pass("fix-dropout-seed")
class FixDropoutSeedPass(OrtPass):
    """Seed each dropout that the recompute plans will clone and that has no seed.

    Rule: take the same plan options as ``RecomputePass`` (``plans``, ``level``,
    ``config_file``, ``probe_level``, ``min_elements``), find the nodes the plans would clone, and give every
    Dropout (opset 12/13) and com.microsoft BitmaskDropout / BiasDropout /
    BitmaskBiasDropout / BiasSoftmaxDropout among them without a ``seed`` attribute the seed
    :func:`dropout_seed` (derived from its output name, plus ``base_seed``).  Existing seeds
    are kept; dropouts that are not recomputed are left alone.

    Provides ``"dropout-seeds-fixed"``, which ``RecomputePass`` requires, so a pass manager
    runs this pass first.  Statistics: ``dropouts seeded``, ``seeds kept``.
    """

    phase = "post-grad"
    provides_properties = frozenset({DROPOUT_SEEDS_FIXED})
    runs_before = frozenset({"recompute"})
    # Seeds are attributes the recompute analysis does not read: RecomputePass reuses it.
    preserves_analyses = frozenset({RECOMPUTE_CANDIDATES})

    def __init__(
        self,
        plans: str | PlanSpec | Sequence[str | PlanSpec] | None = None,
        *,
        level: RecomputeLevel = 0,
        config_file: str | os.PathLike | None = None,
        probe_level: ProbeLevelOption = ProbeLevel.ADVANCED,
        min_elements: NonNegativeInt | None = None,
        budget: int | float | str | None = None,
        base_seed: int = 0,
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
        self.base_seed = int(base_seed)

    def __repr__(self) -> str:
        return f"FixDropoutSeedPass({self.selection!r}, base_seed={self.base_seed})"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.selection.empty:
            return ir.passes.PassResult(model, modified=False)
        _, _, occurrences = self.selection.select(model, self.analysis_cache, finished_as_run(self.step_memory_finish()))
        dropouts = {id(n): n for occ in occurrences for n in occ.nodes if is_dropout(n)}
        modified = False
        for node in dropouts.values():
            if "seed" in node.attributes:
                self.count("seeds kept")
                continue
            seed = dropout_seed(node, self.base_seed)
            node.attributes["seed"] = ir.AttrInt64("seed", seed)
            self.count("dropouts seeded")
            logger.debug("seeded %s with %d", node.name, seed)
            modified = True
        return ir.passes.PassResult(model, modified=modified)
