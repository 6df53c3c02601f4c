"""Refuse the class labels and embedding ids torch refuses, which ONNX Runtime's kernels accept.

torch raises ``IndexError`` for a cross-entropy label outside ``[0, C)`` that is not
``ignore_index``, and for a negative embedding id.  ONNX Runtime runs both and returns a
loss: its ``SoftmaxCrossEntropyLoss`` reads a label of 53 among 50 classes past the row
(measured on 1.19.2: a loss of 9.77, then 9.66 for -5), and ai.onnx ``Gather`` and
``GatherElements`` count a negative index from the end (the torch builder's loss took
-5 as class 45).  A wrong step with no error, and the common way to get there is ordinary:
a tokenizer grown by a few tokens whose model was not resized, or a collator that pads
``input_ids`` with -100.

Rule: in a training graph,

- each ``SoftmaxCrossEntropyLoss`` / ``...Internal`` / ``NegativeLogLikelihoodLoss`` with a
  static class count ``C`` reads its labels through ``Gather(Range(0, C), i)``, with ``i``
  the label sent to ``C`` when negative and to 0 when it is ``ignore_index``: an identity
  on every label torch accepts, and ORT's ``Gather`` refuses the others;
- so does each ``GatherElements`` over a ``LogSoftmax`` (the torch builder's loss; its
  ignored labels are already 0 there), with the gathered axis's size for ``C``, and each
  ``Gather`` of a 2-D parameter's rows by indices taken straight from a graph input (an
  embedding lookup; Reshape, Unsqueeze, Squeeze, Flatten and Cast in between).

Each check node's name starts with :data:`ortpass.conventions.INDEX_CHECK_PREFIX` and says
what it refuses; the runtime turns ORT's error there into that sentence.  Indexing a
parameter by a raw input with ``param[ids]`` (torch wraps negatives there) would be refused
too: no model of the suites does that.  Statistics: ``labels checked``, ``ids checked``.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from ortpass.analysis.partition import (
    get_training_info,
    is_backward,
    is_training_graph,
    tag,
)
from ortpass.conventions import INDEX_CHECK_PREFIX, is_onnx_domain
from ortpass.graph.names import NameAllocator
from ortpass.infra.base import OrtPass
from ortpass.infra.registry import register_pass
from ortpass.ops.sce_loss import LABEL_TYPES, is_sce_loss, sce_ignore_index

__all__ = ["CheckIndexRangesPass"]

logger = logging.getLogger(__name__)

# Ops that only move an index tensor's elements around (or widen them) on its way to a gather.
_PASS_THROUGH = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Cast", "Identity"})


@register_pass("check-index-ranges")
class CheckIndexRangesPass(OrtPass):
    """Make ORT refuse the loss labels and embedding ids that torch refuses (see the module
    docstring for the rule)."""

    phase = "post-grad"
    runs_after = frozenset({"chunk-lm-head-loss"})  # a chunked loss checks its own labels
    runs_before = frozenset({"recompute"})

    def __repr__(self) -> str:
        return "CheckIndexRangesPass()"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not is_training_graph(model):
            return ir.passes.PassResult(model, modified=False)
        params = set(get_training_info(model).params) | set(model.graph.initializers)
        writer = _CheckWriter(model.graph)
        for node in list(model.graph):
            if is_backward(node):
                continue
            if is_sce_loss(node, model) or _is_nll_loss(node):
                self._check_labels(writer, node)
            elif node.op_type == "GatherElements" and is_onnx_domain(node.domain) and _reads_log_softmax(node):
                self._check_gathered(writer, node, "labels checked", f"a class label of the loss ({node.name})")
            elif node.op_type == "Gather" and is_onnx_domain(node.domain) and _is_embedding_lookup(node, params, model.graph):
                self._check_gathered(writer, node, "ids checked", f"an id of the embedding {node.inputs[0].name}")
        return ir.passes.PassResult(model, modified=writer.written)

    def _check_labels(self, writer: _CheckWriter, loss: ir.Node) -> None:
        logits, labels = loss.inputs[0], loss.inputs[1]
        if _already_checked(labels):
            return
        classes = logits.shape[1] if logits is not None and logits.shape is not None and logits.shape.rank() >= 2 else None
        if not isinstance(classes, int) or labels is None or labels.dtype not in LABEL_TYPES:
            self.note("unchecked", {"node": loss.name, "reason": "no static class count or integer labels"})
            return
        ignore_index = _ignore_index(loss)
        refused = f"a label of {loss.name} outside [0, {classes})" + (f" that is not ignore_index {ignore_index}" if ignore_index is not None else "")
        loss.replace_input_with(1, writer.range_check(loss, labels, classes, ignore_index, refused))
        self.count("labels checked")
        logger.debug("%s: labels checked against %d classes", loss.name, classes)

    def _check_gathered(self, writer: _CheckWriter, gather: ir.Node, counter: str, what: str) -> None:
        data, indices = gather.inputs[0], gather.inputs[1]
        if _already_checked(indices):
            return
        axis = gather.attributes.get_int("axis", 0)
        size = data.shape[axis] if data is not None and data.shape is not None and data.shape.rank() > axis else None
        if not isinstance(size, int) or indices is None or indices.dtype not in LABEL_TYPES:
            self.note("unchecked", {"node": gather.name, "reason": "no static size on the gathered axis"})
            return
        gather.replace_input_with(1, writer.range_check(gather, indices, size, None, f"{what} outside [0, {size})"))
        self.count(counter)


def _already_checked(indices: ir.Value | None) -> bool:
    producer = indices.producer() if indices is not None else None
    return producer is not None and (producer.name or "").startswith(INDEX_CHECK_PREFIX)


def _is_nll_loss(node: ir.Node) -> bool:
    return node.op_type == "NegativeLogLikelihoodLoss" and is_onnx_domain(node.domain)


def _ignore_index(loss: ir.Node) -> int | None:
    if loss.op_type == "SoftmaxCrossEntropyLossInternal":
        return sce_ignore_index(loss)[0]
    attr = loss.attributes.get("ignore_index")
    return None if attr is None else int(attr.value)


def _reads_log_softmax(node: ir.Node) -> bool:
    producer = node.inputs[0].producer() if node.inputs[0] is not None else None
    return producer is not None and producer.op_type == "LogSoftmax"


def _is_embedding_lookup(node: ir.Node, params: set[str], graph: ir.Graph) -> bool:
    """``Gather(axis 0)`` of a 2-D parameter's rows, its indices a graph input moved around only."""
    data, indices = node.inputs[0], node.inputs[1]
    if node.attributes.get_int("axis", 0) != 0 or data is None or data.name not in params:
        return False
    if data.shape is None or data.shape.rank() != 2 or indices is None:
        return False
    while indices.producer() is not None and indices.producer().op_type in _PASS_THROUGH:
        indices = indices.producer().inputs[0]
    return indices.producer() is None and indices in graph.inputs and indices.name not in params


class _CheckWriter:
    """Writes the check nodes, named for what they refuse, just before their reader."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph, self.names, self.written = graph, NameAllocator.of_graph(graph), False
        self._nodes: list[ir.Node] = []

    def _op(self, op_type: str, inputs: list[ir.Value], attributes: dict | None = None, *, name: str, like: ir.Value) -> ir.Value:
        node = ir.node(op_type, inputs, attributes or {}, name=self.names.fresh(name))
        node.outputs[0].name = self.names.fresh(f"{node.name}_output")
        # A copy: the checked value's Shape object is its own, and a pass that edits one in place edits one value.
        node.outputs[0].shape = like.shape.copy() if like.shape is not None else None
        node.outputs[0].dtype = like.dtype
        self._nodes.append(tag(node, "forward"))
        return node.outputs[0]

    def _scalar(self, value: int, dtype: ir.DataType, name: str) -> ir.Value:
        array = np.array(value, dtype=dtype.numpy())
        node = ir.node("Constant", [], {"value": ir.tensor(array)}, name=self.names.fresh(name))
        node.outputs[0].name = self.names.fresh(f"{node.name}_output")
        node.outputs[0].shape, node.outputs[0].dtype = ir.Shape([]), dtype
        self._nodes.append(tag(node, "forward"))
        return node.outputs[0]

    def _place(self, reader: ir.Node, result: ir.Value) -> ir.Value:
        """Insert the nodes written since the last call before ``reader``, which reads ``result``."""
        self.graph.insert_before(reader, self._nodes)
        self._nodes, self.written = [], True
        return result

    def range_check(self, reader: ir.Node, labels: ir.Value, classes: int, ignore_index: int | None, refused: str) -> ir.Value:
        """``labels`` read back through ``Gather(Range(0, classes), index)``: the same values,
        or ORT's refusal for a label outside ``[0, classes)`` that is not ``ignore_index``."""
        name = f"{INDEX_CHECK_PREFIX}{refused}"
        i64 = ir.DataType.INT64
        as_int64 = labels if labels.dtype == i64 else self._op("Cast", [labels], {"to": i64}, name=f"{name}/int64", like=labels)
        as_int64.dtype = i64
        zero, past_end = self._scalar(0, i64, f"{name}/zero"), self._scalar(classes, i64, f"{name}/classes")
        negative = self._op("Less", [as_int64, zero], name=f"{name}/negative", like=as_int64)
        negative.dtype = ir.DataType.BOOL
        index = self._op("Where", [negative, past_end, as_int64], name=f"{name}/index", like=as_int64)
        ignored = None
        if ignore_index is not None:
            ignored = self._op("Equal", [as_int64, self._scalar(ignore_index, i64, f"{name}/ignore_index")], name=f"{name}/ignored", like=as_int64)
            ignored.dtype = ir.DataType.BOOL
            index = self._op("Where", [ignored, zero, index], name=f"{name}/index_or_zero", like=as_int64)
        classes_range = self._op("Range", [zero, past_end, self._scalar(1, i64, f"{name}/one")], name=f"{name}/classes_range", like=as_int64)
        classes_range.shape = ir.Shape([classes])
        checked = self._op("Gather", [classes_range, index], {"axis": 0}, name=name, like=as_int64)
        if ignored is not None:
            checked = self._op("Where", [ignored, as_int64, checked], name=f"{name}/labels", like=as_int64)
        if labels.dtype != i64:
            checked = self._op("Cast", [checked], {"to": labels.dtype}, name=f"{name}/labels_back", like=labels)
        return self._place(reader, checked)
