"""Write a ``Gemm`` that reads its first operand transposed as a ``Transpose`` and a
``MatMul``, which ONNX Runtime's CPU GEMM runs 1.2-1.8x as fast.

A linear layer's weight gradient is ``dY^T x`` over the batch's rows; the torch builder
writes it ``Gemm(dY, x, transA=1)`` (docs/design/torch-builder.md), and ORT's CPU GEMM
(MLAS) runs that transposed-A product at 45-86 GFLOP/s on 2 cores of an AMD EPYC, where a
``MatMul`` after a ``Transpose`` runs at 80-106 and torch's at 101-114
(``benchmarks/results/weight_gradient_gemm_1.32.0.md``, HF LLaMA's products at batch
8 x 512; the training build's MLAS is no faster).  HF LLaMA's step on stock onnxruntime,
one process, the graph without and with the pass alternating: 2.62 -> 2.55 s fastest,
2.80 -> 2.62 s median, loss and gradients bit for bit the same.

Rule.  A ``Gemm(A, B, transA=1)`` with no ``C``, ``alpha`` 1 and no ``transB``, float or
double, becomes

    MatMul(Transpose(A), B)                 where A has no more columns than B,
    Transpose(MatMul(Transpose(B), A))      otherwise,

so that the copy a ``Transpose`` makes is of the narrower operand (and of the product,
which has the size of a weight).  The product keeps its name.  Columns unknown at export
(a symbolic dim) count as more.  Statistics: ``gemms written as matmuls``.

Only on graphs the torch builder made.  ortpass's sessions over those run with ORT's
``MatmulTransposeFusion`` off (``runtime.session.disabled_optimizers``), so the two nodes
stay two.  Elsewhere that fusion would put the ``Transpose`` back into a ``FusedMatMul``
with ``transA``, the same slow path, under a new node index that reorders ORT's walk.

Order and memory.  The pass runs last, after the recompute passes planned the step in
ORT's order, and keeps that order: ORT walks a node's producers from the highest number
(graph position) down, so the ``Transpose`` goes right after the node that makes its
operand, where it takes that node's place against the other operand's producer, and ORT
runs it when it reaches the ``MatMul`` (the ``MatMul`` and a product's ``Transpose`` take
the ``Gemm``'s place).  Placed before the ``MatMul`` instead, it had the highest number
and ORT walked the narrower operand's chain first: HF LLaMA's predicted peak 142.5 ->
144.4 MiB.  It adds one temporary, the narrower operand's copy (HF LLaMA: 4 MiB at batch
8 x 512 x hidden 256), which the step-memory prediction counts as a view, as it does every
``Transpose`` that only ``MatMul``s read.

Written for ORT's CPU provider: cuBLAS reads a transposed operand as it is, so
``ORTModule`` leaves the pass out of its default pipeline when its providers name CUDA.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from ortpass.analysis.partition import is_backward
from ortpass.conventions import BUILDER_KEY, is_onnx_domain
from ortpass.graph.names import NameAllocator
from ortpass.infra.base import OrtPass
from ortpass.infra.registry import register_pass
from ortpass.ops.node_writer import NodeWriter

__all__ = ["TransposedGemmAsMatmulPass"]

logger = logging.getLogger(__name__)

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE)


@register_pass("transposed-gemm-as-matmul")
class TransposedGemmAsMatmulPass(OrtPass):
    """Replace ``Gemm(A, B, transA=1)`` by ``Transpose`` and ``MatMul`` on the torch
    builder's graphs (module docstring)."""

    phase = "post-grad"
    runs_after = frozenset({"build-training-graph", "recompute", "recompute-again-late", "order-backward-joins"})

    def __repr__(self) -> str:
        return "TransposedGemmAsMatmulPass()"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if model.metadata_props.get(BUILDER_KEY) != "torch":
            logger.debug("not a graph of the torch builder: ORT's MatmulTransposeFusion would undo the rewrite")
            return ir.passes.PassResult(model, modified=False)
        found = [node for node in model.graph if _rewritable(node)]
        if found:
            names = NameAllocator.of_graph(model.graph)
            for node in found:
                _rewrite(model.graph, names, node, model.opset_imports.get("", 0))
                self.count("gemms written as matmuls")
        return ir.passes.PassResult(model, modified=bool(found))


def _rewritable(node: ir.Node) -> bool:
    if node.op_type != "Gemm" or not is_onnx_domain(node.domain) or len(node.inputs) != 2 or None in node.inputs:
        return False
    attributes = node.attributes
    if attributes.get_int("transA", 0) != 1 or attributes.get_int("transB", 0) != 0 or attributes.get_float("alpha", 1.0) != 1.0:
        return False
    a, b = node.inputs
    return a.dtype in _FLOATS and b.dtype == a.dtype and _rank(a) == _rank(b) == 2


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def _static_columns(value: ir.Value) -> int | None:
    dim = value.shape[1]
    return dim if isinstance(dim, int) else None


def _rewrite(graph: ir.Graph, names: NameAllocator, node: ir.Node, opset: int) -> None:
    """Write the Transpose right after its operand's producer and the MatMul before ``node``,
    and give ``node``'s readers their product."""
    a, b = node.inputs
    (rows, a_cols), (_, b_cols) = a.shape, b.shape  # the product is [A's columns, B's columns]
    w = NodeWriter(names, node.name, opset)
    w.side = "backward" if is_backward(node) else "forward"

    def op(op_type: str, inputs: list[ir.Value], shape: list, name: str, **attributes) -> ir.Value:
        return w.op(op_type, inputs, attributes, name=name, shape=shape, dtype=a.dtype)

    a_width, b_width = _static_columns(a), _static_columns(b)
    if a_width is not None and (b_width is None or a_width <= b_width):
        copied = op("Transpose", [a], [a_cols, rows], "a_transposed", perm=[1, 0])
        result = op("MatMul", [copied, b], [a_cols, b_cols], "product")
    else:
        copied = op("Transpose", [b], [b_cols, rows], "b_transposed", perm=[1, 0])
        product_t = op("MatMul", [copied, a], [b_cols, a_cols], "product_transposed")
        result = op("Transpose", [product_t], [a_cols, b_cols], "product", perm=[1, 0])
    transpose, *product_nodes = w.sides[w.side]
    _insert_after_producer(graph, transpose)
    graph.insert_before(node, product_nodes)
    product = node.outputs[0]
    name = product.name
    ir.convenience.replace_all_uses_with(product, result, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    result.name = name
    logger.debug("%s: Gemm(transA=1) written as Transpose and MatMul", name)


def _insert_after_producer(graph: ir.Graph, transpose: ir.Node) -> None:
    """Right after the node that makes the operand (first, for a graph input): ORT's order
    walks a node's producers from the highest number (graph position) down, so the
    operand's chain keeps its place against the other operand's (module docstring)."""
    producer = transpose.inputs[0].producer()
    if producer is None:
        graph.insert_before(next(iter(graph)), transpose)
    else:
        graph.insert_after(producer, transpose)
