"""Where an LM head's logits come from: the ``MatMul``/``Gemm`` (with or without a bias
``Add``) and the ``Reshape`` views between it and a loss's rows, and which of them the graph
returns.  Read by ``chunk-lm-head-loss``; a head it cannot take raises
:class:`~ortpass.ops.loss_side.UnsupportedLoss` naming why.
"""

from __future__ import annotations

import onnx_ir as ir

from ortpass.analysis.partition import is_backward
from ortpass.conventions import is_onnx_domain
from ortpass.ops.loss_side import UnsupportedLoss

__all__ = ["head_of", "is_weight_like", "only_returned", "reshapes_above", "returned_logits", "returned_shape_source"]


def reshapes_above(logits_rows: ir.Value) -> tuple[list[ir.Node], list[ir.Value]]:
    """The Reshapes between the head and the loss's rows (in graph order; the torch builder
    writes two, to batch x sequence and back), and the values along them, rows first."""
    reshapes, chain = [], [logits_rows]
    node = logits_rows.producer()
    while node is not None and node.op_type == "Reshape" and is_onnx_domain(node.domain):
        reshapes.insert(0, node)
        chain.append(node.inputs[0])
        node = node.inputs[0].producer()
    return reshapes, chain


def returned_logits(region: list[ir.Node], chain: list[ir.Value]) -> frozenset[ir.Value]:
    """The logits (as the head wrote them, reshaped, and as rows) when the graph returns
    them or a forward node outside the region reads them: they are computed whole anyway,
    and the chunked loss slices them instead of computing them again."""
    outside = [v for v in chain if v.is_graph_output() or any(
        user not in region and not is_backward(user) for user, _ in v.uses())]  # fmt: skip
    return frozenset(chain) if outside else frozenset()


def only_returned(kept: frozenset[ir.Value], region: list[ir.Node], hidden: ir.Value, vocab: int, biased: bool) -> bool:
    """Whether the head can run again alone, after backward, for the logits the graph
    returns (``logits_last``): no forward node outside the region reads them (the loss's
    backward is replaced), and each returned one is rows x vocabulary, or (without a bias)
    a ``Reshape`` of rows x vocabulary or the head's input's leading dims x vocabulary."""
    members = set(region)
    if any(user not in members and not is_backward(user) for v in kept for user, _ in v.uses()):
        return False
    sources = [returned_shape_source(v, hidden, vocab) for v in kept if v.is_graph_output()]
    return all(source == "rows" or (source is not None and not biased) for source in sources)


def returned_shape_source(value: ir.Value, hidden: ir.Value, vocab: int) -> str | None:
    """How logits of ``value``'s shape are made from the hidden states by one product, with
    no view after it: ORT copies a view that is a graph output (a ``Reshape`` of rows x
    vocabulary into batch x sequence x vocabulary held both, measured on 1.19.2 and 1.32.0).  "rows":
    they are rows x vocabulary; "reshape": ``value`` is a Reshape of rows x vocabulary, so
    the hidden rows take its leading dims first; "hidden": ``hidden`` has its leading dims;
    else None."""
    if value.shape is None or value.shape[-1] != vocab:
        return None
    if value.shape.rank() == 2:
        return "rows"
    producer = value.producer()
    if (producer is not None and producer.op_type == "Reshape" and is_onnx_domain(producer.domain)
            and producer.inputs[0].shape is not None and producer.inputs[0].shape.rank() == 2):
        return "reshape"
    if hidden.shape is not None and hidden.shape.rank() == value.shape.rank():
        return "hidden"
    return None


def head_of(logits: ir.Value | None) -> tuple[ir.Node, ir.Node | None, ir.Value | None, list[ir.Node]]:
    """The MatMul or Gemm the logits come from, the Add of its bias, the bias, and the
    Reshapes between the head and that Add (the torch builder adds BART's
    ``final_logits_bias`` to batch x sequence logits)."""
    node = logits.producer() if logits is not None else None
    if node is not None and node.op_type == "Add" and is_onnx_domain(node.domain):
        for product, bias in (node.inputs, reversed(node.inputs)):
            if product is None or not is_weight_like(bias):
                continue
            inner, chain = reshapes_above(product)
            head = chain[-1].producer()
            if head is None or head.op_type not in ("MatMul", "Gemm") or not is_onnx_domain(head.domain):
                continue
            readers = [*inner, node]
            if all([n for n, _ in v.uses() if not is_backward(n)] == [readers[i]] and not v.is_graph_output()
                   for i, v in enumerate(reversed(chain))):  # fmt: skip
                return _checked_head(head), node, bias, inner
    if node is None or node.op_type not in ("MatMul", "Gemm") or not is_onnx_domain(node.domain):
        found = "a graph input" if node is None else node.op_type
        raise UnsupportedLoss(f"the logits come from {found}, not a MatMul or Gemm (with or without an Add of a bias)")
    gemm_bias = node.inputs[2] if node.op_type == "Gemm" and len(node.inputs) > 2 else None
    return _checked_head(node), None, gemm_bias, []


def _checked_head(head: ir.Node) -> ir.Node:
    if head.op_type == "Gemm":
        a = head.attributes
        if a.get_int("transA", 0) or a.get_float("alpha", 1.0) != 1.0 or a.get_float("beta", 1.0) != 1.0:
            raise UnsupportedLoss("the head Gemm transposes or scales its input or bias")
        if len(head.inputs) > 2 and head.inputs[2] is not None and not is_weight_like(head.inputs[2]):
            raise UnsupportedLoss("the head Gemm adds a computed tensor")
    return head


def is_weight_like(value: ir.Value | None) -> bool:
    """A parameter, buffer or constant: no node but a Constant computes it."""
    if value is None:
        return False
    producer = value.producer()
    return producer is None or producer.op_type == "Constant"
