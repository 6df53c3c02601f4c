"""Cross-entropy as the torch builder writes it: ``LogSoftmax`` and a label gather, not
``SoftmaxCrossEntropyLoss``.

AOTAutograd decomposes ``F.cross_entropy(logits, labels, ignore_index=i)`` and torch.onnx
writes it, for ``N x C`` logits and ``N`` labels, as::

    valid   = Not(Equal(labels, i))
    picked  = Squeeze(GatherElements(LogSoftmax(logits, axis=1), Unsqueeze(Where(valid, labels, 0), 1)), 1)
    total   = ReduceSum(Where(valid, Neg(picked), 0))
    loss    = Div(total, Cast(ReduceSum(Cast(valid))))          # mean; sum is ``total``

(Casts around the count may be absent.)  :func:`match_torch_nll` recognizes that chain
from its loss value, so a pass can treat it as the one loss op it stands for.  A ``Div`` by
anything but the count of that same ``valid`` (Hugging Face's ``num_items_in_batch``, say)
is not a mean and does not match.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import onnx_ir as ir

from ortpass.conventions import is_onnx_domain

__all__ = ["TorchNllLoss", "match_torch_nll"]


@dataclasses.dataclass(frozen=True)
class TorchNllLoss:
    """One matched loss: its forward ``nodes`` in graph order (the LogSoftmax first, the
    node writing the loss last; the label-only nodes are not among them), the ``logits``
    (``N x C``), ``labels`` (rank 1), ``ignore_index`` and ``reduction``."""

    nodes: list[ir.Node]
    logits: ir.Value
    labels: ir.Value
    ignore_index: int
    reduction: Literal["mean", "sum"]


def match_torch_nll(loss: ir.Value) -> TorchNllLoss | None:
    """The cross-entropy chain that computes ``loss``, or None when ``loss`` is not one."""
    final = _producer(loss, "Div", "ReduceSum")
    if final is None:
        return None
    total = final.inputs[0] if final.op_type == "Div" else loss
    summed = _producer(total, "ReduceSum")
    masked = _producer(summed.inputs[0], "Where") if summed is not None and _sums_everything(summed) else None
    negated = _producer(masked.inputs[1], "Neg") if masked is not None else None
    if negated is None or not _is_zero(masked.inputs[2]):
        return None
    squeezed = _producer(negated.inputs[0], "Squeeze")
    picked = _producer(squeezed.inputs[0], "GatherElements") if squeezed is not None else None
    log_softmax = _producer(picked.inputs[0], "LogSoftmax") if picked is not None else None
    if log_softmax is None or not _last_of_two(log_softmax, "axis", -1) or not _last_of_two(picked, "axis", 0):
        return None
    index = _producer(picked.inputs[1], "Unsqueeze")
    chosen = _producer(index.inputs[0], "Where") if index is not None else None
    valid = masked.inputs[0]
    if chosen is None or chosen.inputs[0] is not valid or not _is_zero(chosen.inputs[2]):
        return None
    labels = chosen.inputs[1]
    ignore_index = _ignore_index(valid, labels)
    if ignore_index is None or labels is None or labels.shape is None or labels.shape.rank() != 1:
        return None
    if final.op_type == "Div" and not _counts(final.inputs[1], valid):
        return None
    nodes = [log_softmax, picked, squeezed, negated, masked, summed] + ([final] if final.op_type == "Div" else [])
    reduction: Literal["mean", "sum"] = "mean" if final.op_type == "Div" else "sum"
    return TorchNllLoss(nodes, log_softmax.inputs[0], labels, ignore_index, reduction)


def _producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type not in op_types or not is_onnx_domain(node.domain):
        return None
    return node


def _constant(value: ir.Value | None) -> np.ndarray | None:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None else tensor.numpy()


def _is_zero(value: ir.Value | None) -> bool:
    array = _constant(value)
    return array is not None and array.size == 1 and float(array.reshape(())) == 0.0


def _last_of_two(node: ir.Node, attribute: str, default: int) -> bool:
    """``node`` works along axis 1 (or -1) of a rank-2 input: the class axis."""
    axis = node.attributes.get_int(attribute, default)
    data = node.inputs[0]
    return data is not None and data.shape is not None and data.shape.rank() == 2 and axis in (1, -1)


def _ignore_index(valid: ir.Value, labels: ir.Value | None) -> int | None:
    """``i`` of ``valid = Not(Equal(labels, i))``."""
    negation = _producer(valid, "Not")
    equal = _producer(negation.inputs[0], "Equal") if negation is not None else None
    if equal is None or labels not in equal.inputs:
        return None
    other = equal.inputs[1] if equal.inputs[0] is labels else equal.inputs[0]
    array = _constant(other)
    return None if array is None or array.size != 1 else int(array.reshape(()))


def _sums_everything(node: ir.Node) -> bool:
    """A ReduceSum of a rank-1 tensor to a scalar."""
    if node.attributes.get_int("keepdims", 1) != 0 or node.attributes.get_int("noop_with_empty_axes", 0):
        return False
    axes = node.inputs[1] if len(node.inputs) > 1 else None
    if axes is None:
        return True
    array = _constant(axes)
    return array is not None and array.reshape(-1).tolist() in ([], [0], [-1])  # [] with noop 0: every axis


def _counts(value: ir.Value | None, valid: ir.Value) -> bool:
    """``value`` is the number of true entries of ``valid``: ReduceSum over every axis of
    ``valid`` cast to a number, with or without Casts around."""
    node = _producer(value, "Cast")
    value = node.inputs[0] if node is not None else value
    summed = _producer(value, "ReduceSum")
    if summed is None or not _sums_everything(summed):
        return False
    cast = _producer(summed.inputs[0], "Cast")
    return (cast.inputs[0] if cast is not None else summed.inputs[0]) is valid
