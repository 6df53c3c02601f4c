"""Running training graphs on ONNX Runtime (CPU here, CUDA where it exists)."""

from ortpass.runtime.session import (
    StepResult,
    TrainingSession,
    dropout_mask_names,
    with_dropout_masks,
)

__all__ = ["StepResult", "TrainingSession", "dropout_mask_names", "with_dropout_masks"]
