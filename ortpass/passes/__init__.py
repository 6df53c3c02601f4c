"""ortpass's built-in passes, one module per pass.  Importing this package registers them."""

from ortpass.infra.base import CREATED_BY_KEY, OrtFunctionalPass, OrtPass
from ortpass.passes.build_training_graph import BuildTrainingGraphPass
from ortpass.passes.fix_dropout_seed import FixDropoutSeedPass
from ortpass.passes.insert_gather_before_sce_loss import InsertGatherBeforeSceLossPass
from ortpass.passes.order_backward_joins import OrderBackwardJoinsPass
from ortpass.passes.pythonop_shape_inference import PythonOpShapeInferencePass
from ortpass.passes.recompute import RecomputePass
from ortpass.passes.replay_dropout_mask import ReplayDropoutMaskPass

__all__ = ["CREATED_BY_KEY", "BuildTrainingGraphPass", "FixDropoutSeedPass", "InsertGatherBeforeSceLossPass", "OrderBackwardJoinsPass", "OrtFunctionalPass", "OrtPass", "PythonOpShapeInferencePass", "RecomputePass", "ReplayDropoutMaskPass"]
