"""ortpass's built-in passes, one module per pass.  Importing this package registers them."""

from ortpass.conventions import CREATED_BY_KEY
from ortpass.infra.base import OrtFunctionalPass, OrtPass
from ortpass.passes.accumulate_gradients_early import AccumulateGradientsEarlyPass
from ortpass.passes.build_training_graph import BuildTrainingGraphPass
from ortpass.passes.check_index_ranges import CheckIndexRangesPass
from ortpass.passes.chunk_lm_head_loss import ChunkLmHeadLossPass
from ortpass.passes.expand_fast_gelu_grad import ExpandFastGeluGradPass
from ortpass.passes.fix_dropout_seed import FixDropoutSeedPass
from ortpass.passes.insert_gather_before_sce_loss import InsertGatherBeforeSceLossPass
from ortpass.passes.onnxscript_optimize import OnnxscriptOptimizePass
from ortpass.passes.order_backward_joins import OrderBackwardJoinsPass
from ortpass.passes.pythonop_shape_inference import PythonOpShapeInferencePass
from ortpass.passes.recompute import RecomputePass
from ortpass.passes.recompute_again_late import RecomputeAgainLatePass
from ortpass.passes.recompute_gate_activation import RecomputeGateActivationPass
from ortpass.passes.recompute_silu_sigmoid import RecomputeSiluSigmoidPass
from ortpass.passes.replay_dropout_mask import ReplayDropoutMaskPass
from ortpass.passes.scatter_embedding_gradient import ScatterEmbeddingGradientPass
from ortpass.passes.transposed_gemm_as_matmul import TransposedGemmAsMatmulPass

__all__ = ["CREATED_BY_KEY", "DEFAULT_PIPELINE", "AccumulateGradientsEarlyPass", "BuildTrainingGraphPass", "CheckIndexRangesPass", "ChunkLmHeadLossPass", "ExpandFastGeluGradPass", "FixDropoutSeedPass", "InsertGatherBeforeSceLossPass", "OnnxscriptOptimizePass", "OrderBackwardJoinsPass", "OrtFunctionalPass", "OrtPass", "PythonOpShapeInferencePass", "RecomputeAgainLatePass", "RecomputeGateActivationPass", "RecomputePass", "RecomputeSiluSigmoidPass", "ReplayDropoutMaskPass", "ScatterEmbeddingGradientPass", "TransposedGemmAsMatmulPass"]

#: What ``ortpass optimize``, ``ortpass.ORTModule`` and the golden suite run without ``--pipeline``: every built-in pass (the manager
#: orders them from their declarations), recompute at ORTModule's layer-wise level 1 with
#: the masks forward would still keep replayed and backward joins ordered for memory
#: (benchmarks/recompute_memory.py), the label gather above the vocabulary projection
#: (faster on CPU at every flagged density; benchmarks/sce_gather.py), the head and loss in
#: vocabulary slices where the logits outgrow one slice, and a tied embedding's gradient
#: rows scattered into the head's (benchmarks/hf_memory_real_width.py); labels and
#: embedding ids that torch refuses are refused on ORT too; ORT's slow ``FastGeluGrad``
#: kernel is written out in element-wise ops, and the torch builder's transposed-operand
#: ``Gemm``s (weight gradients) as ``Transpose`` and ``MatMul``, which ORT's CPU GEMM runs
#: faster (benchmarks/weight_gradient_gemm.py).
DEFAULT_PIPELINE = (
    "pythonop-shape-inference,insert-gather-before-sce-loss(move_above_projection=True),build-training-graph,"
    "expand-fast-gelu-grad,chunk-lm-head-loss,check-index-ranges,accumulate-gradients-early,scatter-embedding-gradient,fix-dropout-seed(level=1),recompute(level=1),"
    "replay-dropout-mask,recompute-gate-activation,recompute-silu-sigmoid,order-backward-joins,recompute-again-late,"
    "transposed-gemm-as-matmul"
)
