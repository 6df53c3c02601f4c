"""Read-only analyses of ONNX training graphs.  None of them changes the model."""

from ortpass.analysis.partition import Partition, TrainingInfo, get_partition, get_training_info

__all__ = ["Partition", "TrainingInfo", "get_partition", "get_training_info"]
