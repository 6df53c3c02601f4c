"""Running training graphs on ONNX Runtime (CPU here, CUDA where it exists)."""

from ortpass.runtime.dropout_masks import dropout_mask_names, with_dropout_masks
from ortpass.runtime.session import StepResult, TrainingSession
from ortpass.runtime.split_session import SplitTrainingSession
from ortpass.training.backend import (  # defined a stage earlier: the gradient build needs them too
    check_single_runtime,
    has_training_ops,
    installed_runtimes,
    require_training_build,
)

__all__ = [
    "SplitTrainingSession",
    "StepResult",
    "TrainingSession",
    "check_single_runtime",
    "dropout_mask_names",
    "has_training_ops",
    "installed_runtimes",
    "require_training_build",
    "with_dropout_masks",
]
