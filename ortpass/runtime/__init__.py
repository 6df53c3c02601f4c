"""Running training graphs on ONNX Runtime (CPU here, CUDA where it exists)."""

from ortpass.runtime.session import (
    StepResult,
    TrainingSession,
    dropout_mask_names,
    with_dropout_masks,
)
from ortpass.runtime.split_session import SplitTrainingSession

__all__ = ["SplitTrainingSession", "StepResult", "TrainingSession", "dropout_mask_names", "with_dropout_masks"]
