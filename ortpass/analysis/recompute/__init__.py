"""Recompute candidates of a training graph: which stashed activations can be recomputed in
backward instead of kept alive from forward, what that saves, and as which plans.

:func:`find_recompute_candidates` (:mod:`.candidates`) runs the search (:mod:`.search`,
sizes in :mod:`.cost`, dims in :mod:`.dims`) and returns a :class:`RecomputeReport`
(:mod:`.result`); :class:`RecomputeSelection` (:mod:`.selection`) turns plan options into
the occurrences a pass rewrites; :func:`find_applied_recompute` (:mod:`.applied`) reads
back what a recompute pass already did to a graph.  The analysis reads the model and never
changes it.  Its rules, and where they differ from ORT's:
``docs/design/recompute-analysis.md``.
"""

from ortpass.analysis.recompute.applied import (
    AppliedRecompute,
    RecomputedGroup,
    find_applied_recompute,
)
from ortpass.analysis.recompute.candidates import (
    DEFAULT_MAX_NODES,
    DEFAULT_MIN_ELEMENTS,
    find_recompute_candidates,
)
from ortpass.analysis.recompute.result import (
    Occurrence,
    PlanRecord,
    RecomputeReport,
    SkippedCandidate,
    StashedActivation,
)

__all__ = [
    "AppliedRecompute",
    "DEFAULT_MAX_NODES",
    "DEFAULT_MIN_ELEMENTS",
    "Occurrence",
    "PlanRecord",
    "RecomputedGroup",
    "RecomputeReport",
    "SkippedCandidate",
    "StashedActivation",
    "find_applied_recompute",
    "find_recompute_candidates",
]
