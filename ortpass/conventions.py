"""Names every stage of ortpass agrees on, defined once.

Metadata keys, pass-ordering property names, analysis keys, op domains and the op-label
format, the limits of the ONNX Runtime build ortpass targets, environment variables, and
the func_names of ortpass's own autograd Functions.  Plain constants and two tiny helpers:
no torch, no ORT, no onnx_ir import, so any module may import this one.
"""

from __future__ import annotations

__all__ = [
    "BUILTIN_FUNCTIONS",
    "CREATED_BY_KEY",
    "DENSITY_FLAG",
    "DROPOUT_SEEDS_FIXED",
    "EXPORT_KEY",
    "FUSED_ATTENTION",
    "FUSED_MASKED_ATTENTION",
    "INDEX_CHECK_PREFIX",
    "MAX_ORT_IR_VERSION",
    "MAX_ORT_OPSET",
    "MS_DOMAIN",
    "ONNX_DOMAINS",
    "PADDING_IDX_KEY",
    "PASS_ENTRY_POINT_GROUP",
    "PRINT_DENSITY_ENV",
    "RECOMPUTED",
    "RECOMPUTE_CANDIDATES",
    "RECOMPUTE_OF_KEY",
    "REPLAY_OF_KEY",
    "SHAPES",
    "SIDE_KEY",
    "STEP_MEMORY_TARGET_KEY",
    "TRAINING_GRAPH",
    "TRAINING_KEY",
    "is_onnx_domain",
    "op_label",
]

# -- metadata keys (model or node ``metadata_props``) ----------------------------------
#: Model: the export record (JSON) written by ``ortpass.export``.
EXPORT_KEY = "pkg.ortpass.export"
#: Node: the name of the pass that created it.
CREATED_BY_KEY = "pkg.ortpass.created_by"
#: Node: ``forward`` or ``backward``, tagged by the gradient build.
SIDE_KEY = "pkg.ortpass.side"
#: Model: the partition record of a training graph (JSON), written by the gradient build.
TRAINING_KEY = "pkg.ortpass.training"
#: Model metadata naming the builder of a training graph built other than by ORT ("torch").
BUILDER_KEY = "pkg.ortpass.builder"
#: Node: the forward node a recompute clone copies.
RECOMPUTE_OF_KEY = "pkg.ortpass.recompute_of"
#: Node: the forward Dropout whose mask a replayed Dropout reproduces.
REPLAY_OF_KEY = "pkg.ortpass.replay_of"
#: Model: the step peak, in bytes, a memory budget's plan aims at (written by ``recompute``
#: with a budget): the passes that lower the peak further stop once it is met.
STEP_MEMORY_TARGET_KEY = "pkg.ortpass.step_memory_target"
#: Model: the padding row of each embedding ``Gather`` (JSON: output name -> row), written
#: by ``ortpass.export``; the gradient build keeps that row's lookup gradient out.
PADDING_IDX_KEY = "pkg.ortpass.padding_idx"
#: Model: the buffers a forward updates (JSON: graph output -> buffer name), written by the
#: torch builder, whose graph computes each new value (BatchNorm's running statistics).
BUFFER_UPDATES_KEY = "pkg.ortpass.buffer_updates"

#: Node name: a check-index-ranges node; the rest of the name says which indices it refuses.
INDEX_CHECK_PREFIX = "ortpass refuses "

# -- pass-ordering properties (``requires_properties`` / ``provides_properties``) -------
SHAPES = "shapes"
TRAINING_GRAPH = "training-graph"
DROPOUT_SEEDS_FIXED = "dropout-seeds-fixed"
RECOMPUTED = "recomputed"

# -- analysis cache keys -----------------------------------------------------------------
RECOMPUTE_CANDIDATES = "recompute-candidates"

# -- domains and op labels -----------------------------------------------------------------
MS_DOMAIN = "com.microsoft"
#: The two spellings of the default ONNX domain.
ONNX_DOMAINS = frozenset({"", "ai.onnx"})


def is_onnx_domain(domain: str) -> bool:
    """Whether ``domain`` names the default ONNX domain (``""`` or ``"ai.onnx"``)."""
    return domain in ONNX_DOMAINS


def op_label(domain: str, op_type: str) -> str:
    """How reports and errors name an op: ``Gemm``, or ``com.microsoft::PythonOp``."""
    return op_type if domain in ONNX_DOMAINS else f"{domain}::{op_type}"


# -- the ONNX Runtime build ortpass targets (1.19.2) ----------------------------------------
#: Highest ai.onnx opset ORT 1.19.2 loads.
MAX_ORT_OPSET = 21
#: Highest IR version ORT 1.19.2 loads.
MAX_ORT_IR_VERSION = 10

# -- environment variables and entry points ---------------------------------------------------
#: ``1``: keep the label-density flags in the graph and print each batch's density.
PRINT_DENSITY_ENV = "ORTPASS_PRINT_INPUT_DENSITY"
#: Python entry-point group under which installed packages register passes.
PASS_ENTRY_POINT_GROUP = "ortpass.passes"

# -- ortpass's own autograd Functions (func_names as exported) --------------------------------
DENSITY_FLAG = "ortpass.export.density.FlagAndPrintDensity"
FUSED_ATTENTION = "ortpass.export.fused_attention.FusedAttention"
FUSED_MASKED_ATTENTION = "ortpass.export.fused_attention.FusedMaskedAttention"

#: ortpass's own Functions: func_name -> ``module:QualName`` where ortpass defines it.  The
#: torch bridge runs a model naming one without any registration by the user: it is
#: ortpass's code, not something the model asks to import.
BUILTIN_FUNCTIONS = {
    DENSITY_FLAG: "ortpass.export.density:FlagAndPrintDensity",
    FUSED_ATTENTION: "ortpass.export.fused_attention:FusedAttention",
    FUSED_MASKED_ATTENTION: "ortpass.export.fused_attention:FusedMaskedAttention",
}
