"""onnxscript's optimizer as a pre-grad pass, with what training needs kept out of its reach.

Rule: run ``onnxscript.optimizer.optimize`` (constant folding, its default rewrite rules,
dead-code removal, constants lifted to initializers, equal initializers merged, common
subexpressions eliminated) on the forward+loss graph, while every trainable parameter is
a graph input without a value and every Dropout carries a distinct ``seed``; afterwards
the parameters are initializers again and the temporary seeds are gone.

Run on an exported model as it is, the optimizer treats the parameters as constants and
Dropout as a pure function, which a training graph cannot afford (measured with
onnxscript 0.7.2 on ``GPTDecoder``: 239 -> 112 nodes, 17 of its 30 parameters gone):

- constant folding folds ``Transpose(weight)``, how torch exports ``nn.Linear`` as a
  MatMul, into a new initializer (``/head/Transpose_output_0``): the weight is gone;
- ``DeduplicateInitializersPass`` merges initializers of equal value: every LayerNorm's
  weight (ones) and bias (zeros) became the first LayerNorm's, which would tie them;
- the rewrite rule ``RemoveOptionalBiasFromGemm`` drops a Gemm's all-zero bias (a bias
  initialized to zeros), which then never trains;
- ``CommonSubexpressionEliminationPass`` merges two Dropouts of the same input (its
  non-deterministic ops are the Random* ones): one mask where torch draws two.

What keeps them: the constant folder leaves a node that reads a graph input alone, the
deduplication skips graph inputs, and no rule can read a value that is not there.
Common-subexpression elimination compares attributes, and ``seed`` is one ONNX shape
inference knows (an unknown attribute stopped shape inference from that node on).
Dropouts seeded before keep their seed: two of them with the same seed and input draw
the same mask, and merging them changes nothing.  PythonOps are not folded (no schema),
but two calls of one Function on the same inputs are merged like any pure op.

What it buys: ORT's pre-gradient transformers, which ``build-training-graph`` runs by
default (``ort_fusions=True``), fold the same shape arithmetic, so on ``GPTDecoder`` the
training graph and the step come out the same with or without this pass (232 nodes either
way; 322 -> 280 with ``ort_fusions=False``; benchmarks/results/onnxscript_optimize.md).  About
60% of the nodes it removes from the export are Constants lifted into initializers.

Without this pass, :func:`ortpass.training.build_training_graph` refuses a model whose
recorded parameters an optimizer took (:func:`ortpass.training.forward_checks.check_recorded_params`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Annotated

import onnx_ir as ir

from ortpass.analysis.partition import is_training_graph
from ortpass.errors import TrainingGraphError
from ortpass.infra.base import OrtPass
from ortpass.infra.options import AtLeast, NonNegativeInt
from ortpass.infra.registry import register_pass
from ortpass.infra.validate import params_of
from ortpass.ops.optimizer import optimize_keeping_training_values
from ortpass.training.forward_checks import check_recorded_params

__all__ = ["OnnxscriptOptimizePass"]

logger = logging.getLogger(__name__)


@register_pass("onnxscript-optimize")
class OnnxscriptOptimizePass(OrtPass):
    """``onnxscript.optimizer.optimize`` on the forward+loss graph, parameters and Dropouts kept.

    Options: ``params``, the names to keep as parameters (default: those recorded at
    export, else every floating-point initializer that is not a scalar, as the gradient
    build picks them; name any you will pass to ``build-training-graph(params=...)``);
    ``num_iterations``, ``input_size_limit``, ``output_size_limit`` and
    ``onnx_shape_inference``, passed to onnxscript's ``optimize`` (same defaults).

    Statistics: counts ``nodes removed`` (net), ``parameters kept`` and ``dropouts kept
    apart`` (those given a temporary seed).
    """

    phase = "pre-grad"
    # First among the pre-grad passes: shapes recorded and losses rewritten stay as made.
    runs_before = frozenset({"pythonop-shape-inference", "insert-gather-before-sce-loss"})

    def __init__(
        self,
        params: Sequence[str] | None = None,
        *,
        num_iterations: Annotated[int, AtLeast(1)] = 2,
        input_size_limit: NonNegativeInt = 8192,
        output_size_limit: NonNegativeInt = 512 * 512,
        onnx_shape_inference: bool = True,
    ) -> None:
        super().__init__()
        self.params = list(params) if params is not None else None
        self.num_iterations = num_iterations
        self.input_size_limit = input_size_limit
        self.output_size_limit = output_size_limit
        self.onnx_shape_inference = onnx_shape_inference

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(params={self.params}, num_iterations={self.num_iterations}, "
            f"input_size_limit={self.input_size_limit}, output_size_limit={self.output_size_limit}, "
            f"onnx_shape_inference={self.onnx_shape_inference})"
        )

    def check_input(self, model: ir.Model) -> None:
        """Refuse parameters to keep that the model does not have (an optimizer ran before?)."""
        if is_training_graph(model):
            return  # requires() refuses it, naming why
        if self.params is None:
            check_recorded_params(model)
        known = {*model.graph.initializers, *(v.name for v in model.graph.inputs)}
        unknown = [name for name in self.params or () if name not in known]
        if unknown:
            raise TrainingGraphError(f"parameters {unknown} to keep are neither initializers nor graph inputs of the model")

    def requires(self, model: ir.Model) -> None:
        if is_training_graph(model):
            raise ir.passes.PreconditionError(
                "the model is already a training graph; run onnxscript-optimize before build-training-graph"
            )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        before, fingerprint = len(graph), _fingerprint(model)
        kept = optimize_keeping_training_values(
            model, params_of(model, self.params), num_iterations=self.num_iterations,
            onnx_shape_inference=self.onnx_shape_inference, input_size_limit=self.input_size_limit,
            output_size_limit=self.output_size_limit,
        )  # fmt: skip
        modified = _fingerprint(model) != fingerprint
        if modified:
            self.count("nodes removed", before - len(graph))
            self.count("parameters kept", kept.parameters)
            self.count("dropouts kept apart", kept.dropouts)
        logger.info("onnxscript's optimizer: %d -> %d nodes, %d parameters kept", before, len(graph), kept.parameters)
        return ir.passes.PassResult(model, modified=modified)


def _fingerprint(model: ir.Model) -> tuple:
    """What a serialized model would show, tensors by identity: the optimizer reports no
    changes of its own, and comparing serialized bytes would copy every weight twice."""
    graph = model.graph
    values = _values_key
    nodes = tuple(
        (node.name, node.domain, node.op_type, node.overload, tuple(id(v) for v in node.inputs), values(node.outputs),
         tuple((name, _attribute_key(attr)) for name, attr in node.attributes.items()), tuple(node.metadata_props.items()))
        for node in graph
    )  # fmt: skip
    initializers = tuple((name, id(value), id(value.const_value)) for name, value in graph.initializers.items())
    return (nodes, values(graph.inputs), values(graph.outputs), values(graph.initializers.values()), initializers,
            tuple(model.opset_imports.items()), tuple(model.metadata_props.items()))  # fmt: skip


def _values_key(values) -> tuple:
    return tuple((id(v), v.name, v.dtype, str(v.shape), tuple(v.metadata_props.items())) for v in values)


def _attribute_key(attr: ir.Attr) -> object:
    if attr.type in (ir.AttributeType.TENSOR, ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS, ir.AttributeType.TENSORS):
        return attr.type, id(attr.value)
    value = attr.value
    return attr.type, tuple(value) if isinstance(value, (list, tuple)) else value
