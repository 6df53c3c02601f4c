"""The gradient build as a pass: the boundary between pre-grad and post-grad passes.

Rule: replace a forward+loss model by its forward+backward training graph (ORT's gradient
builder, see :func:`ortpass.training.build_training_graph`).  Every pre-grad pass in a
pipeline runs before it and every post-grad pass after it; a model that already is a
training graph is refused.
"""

from __future__ import annotations

import logging
from typing import Sequence

import onnx_ir as ir

from ortpass.analysis.partition import get_partition, is_training_graph
from ortpass.conventions import TRAINING_GRAPH
from ortpass.graph.weightless import proto_with_placeholders
from ortpass.infra.base import OrtFunctionalPass
from ortpass.infra.metadata import get_export_info
from ortpass.infra.registry import register_pass
from ortpass.infra.validate import check_for_gradient_build
from ortpass.training.build import build_training_graph
from ortpass.training.forward_checks import (
    check_forward_model,
    check_recorded_params,
    resolve_differentiated_inputs,
    resolve_loss_or_outputs,
    resolve_params,
)

__all__ = ["BuildTrainingGraphPass"]

logger = logging.getLogger(__name__)


@register_pass("build-training-graph")
class BuildTrainingGraphPass(OrtFunctionalPass):
    """Build the forward+backward graph; provides ``training-graph``."""

    provides_properties = frozenset({TRAINING_GRAPH})

    def __init__(
        self,
        params: Sequence[str] | None = None,
        loss: str | None = None,
        ort_fusions: bool = True,
        outputs_with_grad: Sequence[str] | None = None,
        inputs_with_grad: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self.params = list(params) if params is not None else None
        self.loss = loss
        self.ort_fusions = ort_fusions
        self.outputs_with_grad = list(outputs_with_grad) if outputs_with_grad is not None else None
        self.inputs_with_grad = list(inputs_with_grad) if inputs_with_grad is not None else None

    def check_input(self, model: ir.Model) -> None:
        """What the build would refuse only after the pre-grad passes ran: the model
        (:func:`ortpass.infra.validate.check_for_gradient_build`), its loss and parameters (given,
        or recorded at export), and its graph structure."""
        if is_training_graph(model):
            return  # requires() refuses it, naming why
        proto, _ = proto_with_placeholders(model)  # checks read a weight's type and dims, not its bytes
        check_for_gradient_build(model, self.params, proto=proto)
        if self.params is None:
            check_recorded_params(model)
        export_info = get_export_info(model)
        loss, _ = resolve_loss_or_outputs(proto, export_info, self.loss, self.outputs_with_grad)
        params = resolve_params(proto, self.params if self.params is not None else export_info.get("params"))
        inputs = self.inputs_with_grad if self.inputs_with_grad is not None else export_info.get("inputs_with_grad", [])
        resolve_differentiated_inputs(proto, inputs, params)
        check_forward_model(proto, loss)

    def requires(self, model: ir.Model) -> None:
        if is_training_graph(model):
            raise ir.passes.PreconditionError("the model is already a training graph")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        training = build_training_graph(
            model, params=self.params, loss=self.loss, outputs_with_grad=self.outputs_with_grad,
            inputs_with_grad=self.inputs_with_grad, ort_fusions=self.ort_fusions,
        )  # fmt: skip
        partition = get_partition(training)
        self.count("forward nodes", len(partition.forward))
        self.count("backward nodes", len(partition.backward))
        self.count("stashed activations", len(partition.stashed))
        return ir.passes.PassResult(training, modified=True)
