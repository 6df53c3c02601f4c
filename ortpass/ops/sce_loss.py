"""Softmax cross-entropy losses: ai.onnx ``SoftmaxCrossEntropyLoss`` (opset 12+) and ORT's
``com.microsoft::SoftmaxCrossEntropyLossInternal``, their label types, reduction and
``ignore_index``."""

from __future__ import annotations

import onnx_ir as ir

from ortpass.conventions import MS_DOMAIN, is_onnx_domain

__all__ = ["LABEL_TYPES", "SCE_MIN_OPSET", "is_sce_loss", "sce_ignore_index", "sce_reduction"]


# SoftmaxCrossEntropyLoss takes class indices of these types (both ai.onnx and the contrib op).
LABEL_TYPES = frozenset({ir.DataType.INT32, ir.DataType.INT64})

# SoftmaxCrossEntropyLoss first exists in ai.onnx opset 12.
SCE_MIN_OPSET = 12




def is_sce_loss(node: ir.Node, model: ir.Model) -> bool:
    if node.op_type == "SoftmaxCrossEntropyLossInternal":
        return node.domain == MS_DOMAIN
    if node.op_type == "SoftmaxCrossEntropyLoss" and is_onnx_domain(node.domain):
        return model.opset_imports.get("", 0) >= SCE_MIN_OPSET
    return False



def sce_reduction(loss: ir.Node) -> str:
    # Both ops default to "mean" when the attribute is absent.
    return loss.attributes.get_string("reduction", "mean")


def sce_ignore_index(loss: ir.Node) -> tuple[int | None, str]:
    """The loss's ignore_index, or None and why it is not known."""
    if loss.op_type == "SoftmaxCrossEntropyLoss":
        attr = loss.attributes.get("ignore_index")
        if attr is None:
            return None, "ignore_index attribute is missing"
        return int(attr.value), ""
    operand = loss.inputs[3] if len(loss.inputs) > 3 else None
    if operand is None:
        return None, "ignore_index input (input 3) is missing"
    tensor = ir.convenience.get_const_tensor(operand)
    if tensor is None:
        return None, f"ignore_index input {operand.name!r} is not a constant"
    array = tensor.numpy()
    if array.size != 1:
        return None, f"ignore_index input {operand.name!r} has {array.size} elements; needs a scalar"
    return int(array.reshape(())), ""
