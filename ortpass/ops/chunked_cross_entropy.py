"""Softmax cross-entropy over a vocabulary projection, written in ai.onnx ops, one slice of
the vocabulary at a time: no node ever holds more than ``rows x chunk`` logits.

For hidden rows ``h`` (``N x H``), a head weight ``W`` (``V x H``, or ``H x V``) and labels
``y``, with ``valid = y != ignore_index``:

    loss = reduce_{valid rows}( logsumexp_j(h W_j) - h . W_y )        (mean or sum)

Forward computes ``lse_c = logsumexp(h W_c^T)`` for each slice ``c`` of the vocabulary and
combines them with one more logsumexp; the target logit ``h . W_y`` comes from the label's
own row of ``W``.  Backward recomputes each slice's logits and forms its part of the
gradient of the logits, ``g * (exp(l_c - lse) - onehot_c)`` with ``g`` the loss's gradient
(divided by the valid count for a mean, zero on ignored rows), then ``dh += p_c W_c`` and
``dW_c = p_c^T h``; ``dW`` is the concatenation of the slices.

ORT runs a node when its depth-first walk from the graph's leaves reaches it
(``docs/design/ort-execution-order.md``), and ONNX has no control edge.  So each backward
slice starts from a token of the slice before (``Where(false, token, start)`` on its
``Slice`` start), and the token reads both that slice's weight gradient and the running
``dh``: whichever output ORT needs first, it computes the slices in order, each slice's
``N x chunk`` tensors freed before the next begins.

With ``row_indices`` the loss reads only those rows of ``h`` (the rows whose label is not
``ignore_index``, gathered before the loss); their gradient is scattered back into the
others' zeros.

A label that is neither ``ignore_index`` nor in ``[0, V)`` fails in ``Gather`` with the
index named, as ``SoftmaxCrossEntropyLoss`` fails on it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import onnx_ir as ir

from ortpass.conventions import INDEX_CHECK_PREFIX
from ortpass.graph.names import NameAllocator
from ortpass.ops.node_writer import NodeWriter

__all__ = ["ChunkedLossValues", "HeadLoss", "vocab_slices", "write_chunked_loss"]

# ScatterND sums repeated indices (reduction="add") from this opset on.
_SCATTER_ADD_OPSET = 16


def vocab_slices(vocab: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each slice of ``range(vocab)``, ``chunk`` wide (the last one narrower)."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    return [(start, min(start + chunk, vocab)) for start in range(0, vocab, chunk)]


@dataclasses.dataclass(frozen=True)
class HeadLoss:
    """What the chunked loss reads: ``hidden`` rows (rank 2, ``rows x H``), the head weight
    ``weight`` (``V x H`` when ``weight_rows_are_vocab``, else ``H x V``), int64 or int32
    ``labels`` (rank 1), the loss's gradient ``loss_grad`` (a scalar), and the head's
    ``bias`` (``V``) if it has one.  With ``logits`` (the rows' full logits, which the graph
    computes anyway when it returns them), each slice's logits are sliced from them
    instead of computed again.  With ``row_indices`` (rank 1), the loss reads those rows
    of ``hidden`` and ``logits`` only, and ``labels`` are theirs."""

    hidden: ir.Value
    rows: int | ir.SymbolicDim
    weight: ir.Value
    weight_rows_are_vocab: bool
    vocab: int
    labels: ir.Value
    ignore_index: int | None
    reduction: Literal["mean", "sum"]
    loss_grad: ir.Value
    dtype: ir.DataType
    bias: ir.Value | None = None  # the head's bias, rank 1 (vocabulary)
    bias_trains: bool = False  # whether to compute the bias's gradient
    logits: ir.Value | None = None  # rows x vocabulary logits the graph computes anyway (an output)
    row_indices: ir.Value | None = None  # the rows the loss reads (labels not ignore_index), if not all


@dataclasses.dataclass
class ChunkedLossValues:
    """The nodes written (forward, then backward, each in execution order) and the values
    that replace the old ones: ``loss``, ``hidden_grad`` (``N x H``), ``weight_grad``
    (the weight's layout) and ``bias_grad`` (``1 x V``, None without a bias)."""

    forward: list[ir.Node]
    backward: list[ir.Node]
    loss: ir.Value
    hidden_grad: ir.Value
    weight_grad: ir.Value
    bias_grad: ir.Value | None = None


def write_chunked_loss(head: HeadLoss, chunk: int, names: NameAllocator, *, prefix: str, opset: int) -> ChunkedLossValues:
    """Write the forward and backward of the chunked loss (see the module docstring)."""
    w = NodeWriter(names, prefix, opset)
    f, i64, b = head.dtype, ir.DataType.INT64, ir.DataType.BOOL
    n = head.rows if head.row_indices is None else head.labels.shape[0]
    hidden_size = head.weight.shape[1 if head.weight_rows_are_vocab else 0]
    column, rows_by_hidden = [n, 1], [n, hidden_size]
    zero = w.const(np.array(0, dtype=f.numpy()), "zero")
    hidden = head.hidden
    if head.row_indices is not None:
        hidden = w.op("Gather", [head.hidden, head.row_indices], {"axis": 0}, name="loss_rows", shape=rows_by_hidden, dtype=f)
    labels = head.labels
    if labels.dtype != i64:
        labels = w.op("Cast", [labels], {"to": i64}, name="labels_int64", shape=[n], dtype=i64)
    label_column = w.op("Unsqueeze", [labels, w.ints([1], "column_axis")], name="label_column", shape=column, dtype=i64)
    if head.ignore_index is None:
        valid = w.op("Equal", [label_column, label_column], name="valid", shape=column, dtype=b)
    else:
        ignored = w.op("Equal", [label_column, w.ints([head.ignore_index], "ignore_index")], name="ignored", shape=column, dtype=b)
        valid = w.op("Not", [ignored], name="valid", shape=column, dtype=b)
    target = w.op("Where", [valid, label_column, w.ints([0], "row_zero")], name="target", shape=column, dtype=i64)
    # A negative label left here would index from the end: send it past the end, where Gather refuses it.
    negative = w.op("Less", [target, w.ints([0], "index_zero")], name="negative_label", shape=column, dtype=b)
    checked = w.op("Where", [negative, w.ints([head.vocab], "vocab_size"), target], name="checked_label", shape=column, dtype=i64)
    flat_checked = w.op("Squeeze", [checked, w.ints([1], "squeeze_axis")], name="checked_label_flat", shape=[n], dtype=i64)
    vocab_axis = 0 if head.weight_rows_are_vocab else 1
    # Named for what they refuse: the runtime turns ORT's error in them into IndexRangeError.
    refused = f"{INDEX_CHECK_PREFIX}a label outside [0, {head.vocab})"
    if head.ignore_index is not None:
        refused += f" that is not ignore_index {head.ignore_index}"
    if head.weight_rows_are_vocab:
        target_rows = w.op("Gather", [head.weight, flat_checked], {"axis": 0}, name=refused, shape=rows_by_hidden, dtype=f)
    else:
        gathered = w.op("Gather", [head.weight, flat_checked], {"axis": 1}, name=refused, shape=[hidden_size, n], dtype=f)
        target_rows = w.op("Transpose", [gathered], {"perm": [1, 0]}, name="target_weights_rows", shape=rows_by_hidden, dtype=f)
    products = w.op("Mul", [hidden, target_rows], name="target_products", shape=rows_by_hidden, dtype=f)
    target_logit = w.reduce("ReduceSum", products, [1], "target_logit")
    if head.bias is not None:
        target_bias = w.op("Gather", [head.bias, checked], {"axis": 0}, name=f"{refused} (bias)", shape=column, dtype=f)
        target_logit = w.op("Add", [target_logit, target_bias], name="target_logit_biased", shape=column, dtype=f)
    trans_b = int(head.weight_rows_are_vocab)

    def weight_slice(begin: ir.Value, start: int, stop: int, index: int) -> ir.Value:
        shape = [stop - start, hidden_size] if head.weight_rows_are_vocab else [hidden_size, stop - start]
        inputs = [head.weight, begin, w.ints([stop], f"stop{index}"), w.ints([vocab_axis], f"slice_axis{index}")]
        return w.op("Slice", inputs, name=f"weight{index}", shape=shape, dtype=f)

    def bias_slice(begin: ir.Value, start: int, stop: int, index: int) -> ir.Value | None:
        if head.bias is None:
            return None
        inputs = [head.bias, begin, w.ints([stop], f"bias_stop{index}"), w.ints([0], f"bias_axis{index}")]
        return w.op("Slice", inputs, name=f"bias{index}", shape=[stop - start], dtype=f)

    def logits_of(begin: ir.Value, start: int, stop: int, index: int, name: str, weight: ir.Value | None = None) -> ir.Value:
        """Slice ``index``'s logits: from the given logits, else ``hidden @ weight slice + bias slice``."""
        if head.logits is not None:
            inputs = [head.logits, begin, w.ints([stop], f"{name}_stop"), w.ints([1], f"{name}_axis")]
            if head.row_indices is None:
                return w.op("Slice", inputs, name=name, shape=[n, stop - start], dtype=f)
            every_row = w.op("Slice", inputs, name=f"{name}_every_row", shape=[head.rows, stop - start], dtype=f)
            return w.op("Gather", [every_row, head.row_indices], {"axis": 0}, name=name, shape=[n, stop - start], dtype=f)
        bias = bias_slice(begin, start, stop, index)
        weight = weight if weight is not None else weight_slice(begin, start, stop, index)
        inputs = [hidden, weight] if bias is None else [hidden, weight, bias]
        return w.op("Gemm", inputs, {"transB": trans_b}, name=name, shape=[n, stop - start], dtype=f)

    slices = vocab_slices(head.vocab, chunk)
    pieces = []
    for i, (start, stop) in enumerate(slices):
        logits = logits_of(w.ints([start], f"start{i}"), start, stop, i, f"logits{i}")
        pieces.append(_logsumexp(w, logits, f"logsumexp{i}"))
    lse = pieces[0]
    if len(pieces) > 1:
        joined = w.op("Concat", pieces, {"axis": 1}, name="slice_logsumexps", shape=[n, len(pieces)], dtype=f)
        lse = w.reduce("ReduceLogSumExp", joined, [1], "logsumexp")
    row_nll = w.op("Sub", [lse, target_logit], name="row_nll", shape=column, dtype=f)
    row_losses = w.op("Where", [valid, row_nll, zero], name="row_losses", shape=column, dtype=f)
    total = w.reduce("ReduceSum", row_losses, None, "total")
    valid_rows = w.op("Cast", [valid], {"to": f}, name="valid_rows", shape=column, dtype=f)
    count = w.reduce("ReduceSum", valid_rows, None, "valid_count")
    loss = w.op("Div", [total, count], name="mean", shape=[], dtype=f) if head.reduction == "mean" else total

    w.side = "backward"
    scale = head.loss_grad
    if head.reduction == "mean":
        scale = w.op("Div", [head.loss_grad, count], name="row_scale", shape=[], dtype=f)
    row_grad = w.op("Where", [valid, scale, zero], name="row_grad", shape=column, dtype=f)
    never = w.const(np.array(False), "never")
    hidden_grad: ir.Value | None = None
    token: ir.Value | None = None
    weight_grads, bias_grads = [], []
    for i, (start, stop) in enumerate(slices):
        width, wide = stop - start, [n, stop - start]
        begin = w.ints([start], f"grad_start{i}")
        if token is not None:  # this slice starts after the one before: see the module docstring
            as_index = w.op("Cast", [token], {"to": i64}, name=f"token{i}", shape=[], dtype=i64)
            begin = w.op("Where", [never, as_index, begin], name=f"after_slice{i}", shape=[1], dtype=i64)
        weight = weight_slice(begin, start, stop, i)
        logits = logits_of(begin, start, stop, i, f"logits_again{i}", weight)
        shifted = w.op("Sub", [logits, lse], name=f"shifted{i}", shape=wide, dtype=f)
        probs = w.op("Exp", [shifted], name=f"probs{i}", shape=wide, dtype=f)
        scaled = w.op("Mul", [probs, row_grad], name=f"scaled{i}", shape=wide, dtype=f)
        logits_grad = _minus_onehot(w, scaled, target, row_grad, start, width, i)
        part = w.op("Gemm", [logits_grad, weight], {"transB": 1 - trans_b}, name=f"hidden_grad_part{i}", shape=rows_by_hidden, dtype=f)
        if hidden_grad is not None:
            part = w.op("Add", [hidden_grad, part], name=f"hidden_grad{i}", shape=rows_by_hidden, dtype=f)
        hidden_grad = part
        if head.weight_rows_are_vocab:
            piece = w.op("Gemm", [logits_grad, hidden], {"transA": 1}, name=f"weight_grad{i}", shape=[width, hidden_size], dtype=f)
        else:
            piece = w.op("Gemm", [hidden, logits_grad], {"transA": 1}, name=f"weight_grad{i}", shape=[hidden_size, width], dtype=f)
        weight_grads.append(piece)
        sums = [w.reduce("ReduceSum", piece, None, f"weight_grad_sum{i}"), w.reduce("ReduceSum", hidden_grad, None, f"hidden_grad_sum{i}")]
        if head.bias is not None and head.bias_trains:
            bias_grads.append(w.reduce("ReduceSum", logits_grad, [0], f"bias_grad{i}"))  # 1 x width
            sums.append(w.reduce("ReduceSum", bias_grads[-1], None, f"bias_grad_sum{i}"))
        token = sums[0]
        for j, more in enumerate(sums[1:]):
            token = w.op("Add", [token, more], name=f"slice_done{i}_{j}", shape=[], dtype=f)
    assert hidden_grad is not None and token is not None  # vocab_slices gives at least one slice
    hidden_grad = w.op("Where", [never, token, hidden_grad], name="hidden_grad", shape=rows_by_hidden, dtype=f)
    if head.row_indices is not None:
        hidden_grad = _scatter_rows(w, hidden_grad, head)
    weight_grad = weight_grads[0]
    if len(weight_grads) > 1:
        weight_grad = w.op("Concat", weight_grads, {"axis": vocab_axis}, name="weight_grad", shape=list(head.weight.shape), dtype=f)
    bias_grad = None
    if bias_grads:
        bias_grad = bias_grads[0] if len(bias_grads) == 1 else w.op("Concat", bias_grads, {"axis": 1}, name="bias_grad", shape=[1, head.vocab], dtype=f)
    return ChunkedLossValues(w.sides["forward"], w.sides["backward"], loss, hidden_grad, weight_grad, bias_grad)


def _logsumexp(w: NodeWriter, x: ir.Value, name: str) -> ir.Value:
    """``log(sum(exp(x)))`` over axis 1, kept: ``max + log(sum(exp(x - max)))``.  Written
    out because ORT's ``ReduceLogSumExp`` took 2.6x as long as these five nodes on a
    slice of logits (0.26 s against 0.10 s over 1024 x 128256; ORT 1.19.2, 2 cores)."""
    top = w.reduce("ReduceMax", x, [1], f"{name}_max")
    shifted = w.op("Sub", [x, top], name=f"{name}_shifted", shape=list(x.shape), dtype=x.dtype)
    exps = w.op("Exp", [shifted], name=f"{name}_exp", shape=list(x.shape), dtype=x.dtype)
    sums = w.reduce("ReduceSum", exps, [1], f"{name}_sum")
    logs = w.op("Log", [sums], name=f"{name}_log", shape=list(sums.shape), dtype=x.dtype)
    return w.op("Add", [logs, top], name=name, shape=list(sums.shape), dtype=x.dtype)


def _minus_onehot(w: NodeWriter, scaled: ir.Value, target: ir.Value, row_grad: ir.Value, start: int, width: int, i: int) -> ir.Value:
    """``scaled - row_grad * onehot(target)`` on the slice ``[start, start + width)``.

    Only the label's own column changes, so it is read, changed and written back per row
    (``GatherElements``, ``ScatterElements``: rows x 1) instead of comparing every column
    with the label: a ``Where`` over rows x width took 0.29 s of the 2.26 s loss at GPT-2's
    size (1024 rows, vocabulary 50257; ORT 1.19.2 on 2 cores), these take milliseconds.  A
    row whose label lies in another slice writes its first column back unchanged."""
    f, i64, column = scaled.dtype, ir.DataType.INT64, list(target.shape)
    local = w.op("Sub", [target, w.ints([start], f"offset{i}")], name=f"local_label{i}", shape=column, dtype=i64)
    above = w.op("GreaterOrEqual", [local, w.ints([0], f"slice_first{i}")], name=f"label_from{i}", shape=column, dtype=ir.DataType.BOOL)
    below = w.op("Less", [local, w.ints([width], f"slice_width{i}")], name=f"label_below{i}", shape=column, dtype=ir.DataType.BOOL)
    inside = w.op("And", [above, below], name=f"label_here{i}", shape=column, dtype=ir.DataType.BOOL)
    index = w.op("Where", [inside, local, w.ints([0], f"first_column{i}")], name=f"label_column{i}", shape=column, dtype=i64)
    at_label = w.op("GatherElements", [scaled, index], {"axis": 1}, name=f"at_label{i}", shape=column, dtype=f)
    minus_one = w.op("Sub", [at_label, row_grad], name=f"minus_one{i}", shape=column, dtype=f)
    written = w.op("Where", [inside, minus_one, at_label], name=f"label_value{i}", shape=column, dtype=f)
    return w.op("ScatterElements", [scaled, index, written], {"axis": 1}, name=f"logits_grad{i}", shape=list(scaled.shape), dtype=f)


def _scatter_rows(w: NodeWriter, grad: ir.Value, head: HeadLoss) -> ir.Value:
    """The gradient of every row of ``head.hidden``: ``grad`` (the loss rows') in its
    ``row_indices`` rows, zeros in the others (the gradient of the rows' Gather)."""
    every_row = list(head.hidden.shape)
    shape = w.op("Shape", [head.hidden], name="every_row_shape", shape=[2], dtype=ir.DataType.INT64)
    zeros = w.op("ConstantOfShape", [shape], {"value": ir.tensor(np.zeros(1, dtype=head.dtype.numpy()))}, name="every_row_zeros", shape=every_row, dtype=head.dtype)
    index_column = w.op("Unsqueeze", [head.row_indices, w.ints([1], "row_index_axis")], name="row_index_column", shape=[grad.shape[0], 1], dtype=ir.DataType.INT64)
    # Repeated indices would overwrite each other without "add"; the row gather's own are unique.
    attributes = {"reduction": "add"} if w.opset >= _SCATTER_ADD_OPSET else {}
    return w.op("ScatterND", [zeros, index_column, grad], attributes, name="hidden_grad_every_row", shape=every_row, dtype=head.dtype)
