"""The loss a cross-entropy pass rewrites, whichever op writes it: ai.onnx
``SoftmaxCrossEntropyLoss`` or ORT's ``...Internal`` (ORT's builder; the valid label rows
possibly gathered before it by ``insert-gather-before-sce-loss``), or the torch builder's
``LogSoftmax`` chain (:mod:`ortpass.ops.torch_nll_loss`)."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from ortpass.conventions import MS_DOMAIN, is_onnx_domain
from ortpass.ops.sce_loss import is_sce_loss, sce_ignore_index, sce_reduction
from ortpass.ops.torch_nll_loss import match_torch_nll

__all__ = ["LossSide", "UnsupportedLoss", "loss_side"]


class UnsupportedLoss(Exception):
    """A loss a pass cannot take, and why."""


@dataclasses.dataclass(frozen=True)
class LossSide:
    """What a pass needs of a loss, whichever op writes it: the forward ``nodes`` from the
    logits' first reader to the node writing the loss (in graph order), the ``logits``
    rows (``N x V``), the ``labels`` the loss reads and, for gathered rows, their indices."""

    loss: ir.Node
    nodes: list[ir.Node]
    logits: ir.Value
    labels: ir.Value
    ignore_index: int | None
    reduction: str
    row_indices: ir.Value | None = None


def loss_side(node: ir.Node, model: ir.Model, loss_name: str | None) -> LossSide | None:
    """The loss ``node`` writes (``loss_name``: the training loss), if it is one of these: ``SoftmaxCrossEntropyLoss``
    (ORT's builder), or the torch builder's ``LogSoftmax`` chain ending in ``node``."""
    if is_sce_loss(node, model):
        reduction, ignore_index = _loss_settings(node, loss_name)
        logits, labels = node.inputs[0], node.inputs[1]
        row_gather, row_indices = _row_gather_of(logits)
        if row_gather is None:
            return LossSide(node, [node], logits, labels, ignore_index, reduction)
        return LossSide(node, [row_gather, node], row_gather.inputs[0], labels, ignore_index, reduction, row_indices)
    if not node.outputs or node.outputs[0].name != loss_name or node.op_type not in ("Div", "ReduceSum"):
        return None
    torch_loss = match_torch_nll(node.outputs[0])
    if torch_loss is None:
        return None
    row_gather, row_indices = _torch_row_gather_of(torch_loss.logits)
    if row_gather is not None:  # the torch builder's label gather (ortpass.training.label_gather)
        return LossSide(node, [row_gather, *torch_loss.nodes], row_gather.inputs[0], torch_loss.labels,
                        torch_loss.ignore_index, torch_loss.reduction, row_indices)  # fmt: skip
    return LossSide(node, torch_loss.nodes, torch_loss.logits, torch_loss.labels, torch_loss.ignore_index, torch_loss.reduction)


def _loss_settings(loss: ir.Node, loss_name: str | None) -> tuple[str, int | None]:
    """The loss's reduction and ignore_index, when the pass can rewrite it."""
    reduction = sce_reduction(loss)
    if reduction not in ("mean", "sum"):
        raise UnsupportedLoss(f"reduction {reduction!r}: only mean and sum keep the loss a scalar")
    if loss_name is None or loss.outputs[0].name != loss_name:
        raise UnsupportedLoss("not the training graph's loss")
    if len(loss.inputs) > 2 and loss.inputs[2] is not None:
        raise UnsupportedLoss("class weights")
    if loss.op_type == "SoftmaxCrossEntropyLoss":
        return reduction, loss.attributes.get_int("ignore_index", None)
    ignore_index, reason = sce_ignore_index(loss)
    if ignore_index is None:
        raise UnsupportedLoss(reason)
    return reduction, ignore_index


def _row_gather_of(logits: ir.Value) -> tuple[ir.Node | None, ir.Value | None]:
    """The ``ShrunkenGather`` of the valid label rows between the logits and the loss (see
    ``insert-gather-before-sce-loss``), and its row indices, if there is one."""
    gather = logits.producer()
    if gather is None or gather.op_type != "ShrunkenGather" or gather.domain != MS_DOMAIN:
        return None, None
    indices = gather.inputs[1]
    if indices is None or indices.shape is None or indices.shape.rank() != 1 or indices.dtype != ir.DataType.INT64:
        raise UnsupportedLoss("the rows gathered before the loss are not a rank-1 int64 index")
    return gather, indices


def _torch_row_gather_of(logits: ir.Value) -> tuple[ir.Node | None, ir.Value | None]:
    """The torch builder's gather of the valid label rows (``index_select``, written as
    ``Gather(axis 0)`` of ``N x V`` logits by a rank-1 int64 index), and its indices."""
    gather = logits.producer()
    if gather is None or gather.op_type != "Gather" or not is_onnx_domain(gather.domain):
        return None, None
    source, indices = gather.inputs[0], gather.inputs[1]
    if gather.attributes.get_int("axis", 0) != 0 or source is None or source.shape is None or source.shape.rank() != 2:
        return None, None
    if indices is None or indices.shape is None or indices.shape.rank() != 1 or indices.dtype != ir.DataType.INT64:
        return None, None
    # torch.onnx reshapes index_select's index to rank 1; its backward scatters by the
    # index before that Reshape, which must then be the one the pass takes as given.
    reshape = indices.producer()
    if reshape is not None and reshape.op_type == "Reshape" and is_onnx_domain(reshape.domain):
        flat = reshape.inputs[0]
        if flat is not None and flat.shape is not None and flat.shape.rank() == 1 and flat.dtype == ir.DataType.INT64:
            indices = flat
    return gather, indices
