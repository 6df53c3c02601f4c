"""Read-only analyses of ONNX training graphs.  None of them changes the model."""

from ortpass.analysis.layers import LayerBoundaries, find_layer_boundaries
from ortpass.analysis.partition import (
    Partition,
    TrainingInfo,
    get_partition,
    get_training_info,
)
from ortpass.analysis.plans import (
    PlanSpec,
    PlanType,
    format_plans,
    load_plan_file,
    parse_plan,
    parse_plans,
)
from ortpass.analysis.recomputable_ops import (
    ProbeLevel,
    is_recomputable,
    register_recomputable_function,
    register_recomputable_op,
)
from ortpass.analysis.recompute import (
    Occurrence,
    PlanRecord,
    RecomputeReport,
    SkippedCandidate,
    StashedActivation,
    find_recompute_candidates,
)

__all__ = [
    "LayerBoundaries",
    "Occurrence",
    "Partition",
    "PlanRecord",
    "PlanSpec",
    "PlanType",
    "ProbeLevel",
    "RecomputeReport",
    "SkippedCandidate",
    "StashedActivation",
    "TrainingInfo",
    "find_layer_boundaries",
    "find_recompute_candidates",
    "format_plans",
    "get_partition",
    "get_training_info",
    "is_recomputable",
    "load_plan_file",
    "parse_plan",
    "parse_plans",
    "register_recomputable_function",
    "register_recomputable_op",
]
