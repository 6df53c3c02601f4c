"""ortpass's built-in passes, one module per pass.  Importing this package registers them."""

from ortpass.passes.base import CREATED_BY_KEY, OrtFunctionalPass, OrtPass
from ortpass.passes.build_training_graph import BuildTrainingGraphPass
from ortpass.passes.fix_dropout_seed import FixDropoutSeedPass
from ortpass.passes.insert_gather_before_sce_loss import InsertGatherBeforeSceLossPass
from ortpass.passes.pythonop_shape_inference import PythonOpShapeInferencePass
from ortpass.passes.recompute import RecomputePass
from ortpass.passes.replay_dropout_mask import ReplayDropoutMaskPass

__all__ = ["BuildTrainingGraphPass", "FixDropoutSeedPass", "RecomputePass", "ReplayDropoutMaskPass", "InsertGatherBeforeSceLossPass", "PythonOpShapeInferencePass", "CREATED_BY_KEY", "OrtFunctionalPass", "OrtPass"]
