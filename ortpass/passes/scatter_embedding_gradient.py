"""Add a tied embedding's gradient rows into the other part of the weight's gradient, without
a dense copy of the embedding's gradient.

A weight used by an embedding and by something else (GPT-2's token embedding is also its
LM head) gets its gradient as ``Sum(part, GatherGrad(shape, ids, dY))``: ORT's
``GatherGrad`` writes a dense ``vocab x hidden`` tensor, zero but for the rows the batch
read, and the ``Sum`` a third one.  At the end of the step the weight's gradient is alive
three times over: on HF GPT-2 at real width (vocabulary 50257, hidden 768) 3 x 147 MiB,
the step's peak.

Rule: a backward ``Sum`` of exactly two inputs, one of them the only use of a
``com.microsoft::GatherGrad`` with ``axis`` 0, the other of the Sum's own shape, becomes
``ScatterND(part, Unsqueeze(ids, -1), dY, reduction="add")`` (ai.onnx opset 16+).  Same
values: the scatter adds each read row's gradient to ``part``, repeated ids added
repeatedly, as ``GatherGrad`` sums them.  Two copies of the weight's gradient instead of
three.  Runs after ``accumulate-gradients-early``, which still sees the ``Sum`` and computes
the other part early.

torch's builder writes the same gradient as ``Add(part, ScatterND(zeros, ids, dY, "add"))``
with ``zeros`` an ``Expand`` of a scalar 0 (``aten.full``): the same three tensors.  Rule: a
backward two-input ``Add`` or ``Sum`` whose other input is the only use of such a
ScatterND becomes ``ScatterND(part, ids, dY, "add")``; the zeros go once nothing reads them.
Same values up to rounding where ids repeat (the rows are added into ``part`` one by one
instead of summed first), as for GatherGrad.

The ScatterND that remains still copies ``part``; an ortpass session removes it and adds
the rows in place (:mod:`ortpass.training.row_scatter`).  Statistics: ``embedding
gradients scattered``.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from ortpass.analysis.partition import is_backward, tag
from ortpass.conventions import MS_DOMAIN, is_onnx_domain
from ortpass.graph.names import NameAllocator
from ortpass.infra.base import OrtPass
from ortpass.infra.registry import register_pass

__all__ = ["ScatterEmbeddingGradientPass"]

logger = logging.getLogger(__name__)

# ScatterND takes reduction="add" from ai.onnx opset 16 on.
_SCATTER_REDUCTION_OPSET = 16


@register_pass("scatter-embedding-gradient")
class ScatterEmbeddingGradientPass(OrtPass):
    """Replace ``Sum(part, GatherGrad(shape, ids, dY))`` by a ScatterND that adds ``dY``'s rows
    into ``part`` (see the module docstring for the rule)."""

    phase = "post-grad"
    runs_after = frozenset({"accumulate-gradients-early"})
    runs_before = frozenset({"recompute"})

    def __repr__(self) -> str:
        return "ScatterEmbeddingGradientPass()"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if model.opset_imports.get("", 0) < _SCATTER_REDUCTION_OPSET:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        names = NameAllocator.of_graph(graph)
        found = [(node, parts) for node in graph if (parts := _embedding_sum(node)) is not None]
        for accumulate, (part, gather_grad) in found:
            self._scatter(graph, names, accumulate, part, gather_grad)
        into_zeros = [node for node in graph if _sum_of_scatter_into_zeros(node) is not None]
        for accumulate in into_zeros:  # matched again: an earlier rewrite may have fed this sum
            self._scatter_into_part(graph, accumulate, *_sum_of_scatter_into_zeros(accumulate))
        return ir.passes.PassResult(model, modified=bool(found or into_zeros))

    def _scatter_into_part(self, graph: ir.Graph, accumulate: ir.Node, part: ir.Value, scatter: ir.Node) -> None:
        zeros = scatter.inputs[0]
        scatter.replace_input_with(0, part)
        if not zeros.uses():  # an Expand, or an initializer (_only_zeros)
            if zeros.producer() is not None:
                graph.remove(zeros.producer(), safe=True)
            else:
                graph.initializers.pop(zeros.name)
        graph.remove(scatter)  # moved to the sum's place: ``part`` may come later than the zeros did
        graph.insert_before(accumulate, scatter)
        result = accumulate.outputs[0]
        name = result.name
        ir.convenience.replace_all_uses_with(result, scatter.outputs[0], replace_graph_outputs=True)
        graph.remove(accumulate, safe=True)
        scatter.outputs[0].name = name
        self.count("embedding gradients scattered")
        logger.debug("%s: embedding rows scattered into %s instead of zeros", name, part.name)

    def _scatter(self, graph: ir.Graph, names: NameAllocator, accumulate: ir.Node, part: ir.Value, gather_grad: ir.Node) -> None:
        _, ids, rows_grad = gather_grad.inputs
        axes = ir.node("Constant", [], {"value": ir.tensor(np.array([-1], dtype=np.int64))}, name=names.fresh(f"{accumulate.name}_ids_axis"))
        column = ir.node("Unsqueeze", [ids, axes.outputs[0]], name=names.fresh(f"{accumulate.name}_ids_column"))
        scatter = ir.node("ScatterND", [part, column.outputs[0], rows_grad], {"reduction": "add"}, name=names.fresh(f"{accumulate.name}_scatter"))
        for node in (axes, column, scatter):
            node.outputs[0].name = names.fresh(f"{node.name}_output")
            tag(node, "backward")
        axes.outputs[0].shape, axes.outputs[0].dtype = ir.Shape([1]), ir.DataType.INT64
        if ids.shape is not None:
            column.outputs[0].shape, column.outputs[0].dtype = ir.Shape([*ids.shape, 1]), ids.dtype
        result = accumulate.outputs[0]
        scatter.outputs[0].shape, scatter.outputs[0].dtype = result.shape, result.dtype
        graph.insert_before(accumulate, [axes, column, scatter])
        name, was_output = result.name, result.is_graph_output()
        ir.convenience.replace_all_uses_with(result, scatter.outputs[0], replace_graph_outputs=True)
        graph.remove([accumulate, gather_grad], safe=True)
        if was_output:
            scatter.outputs[0].name = name
        self.count("embedding gradients scattered")
        logger.debug("%s: embedding rows scattered into %s", name, part.name)


def _sum_parts(node: ir.Node) -> list[tuple[ir.Value, ir.Value]]:
    """``(other, part)`` both ways round when ``node`` is a backward two-input Sum or Add
    whose ``part`` has the result's shape and type; else none."""
    if node.op_type not in ("Sum", "Add") or not is_onnx_domain(node.domain) or not is_backward(node):
        return []
    if len(node.inputs) != 2 or any(v is None for v in node.inputs) or node.inputs[0] is node.inputs[1]:
        return []
    result = node.outputs[0]
    if result.shape is None:
        return []
    return [
        (other, part)
        for other, part in (node.inputs, tuple(reversed(node.inputs)))
        if part.shape is not None and list(part.shape) == list(result.shape) and part.dtype == result.dtype
        and len(other.uses()) == 1 and not other.is_graph_output()
    ]  # fmt: skip


def _embedding_sum(node: ir.Node) -> tuple[ir.Value, ir.Node] | None:
    """``(part, gather_grad)`` when ``node`` sums a part and the only use of an axis-0
    GatherGrad, else None."""
    for gathered, part in _sum_parts(node):
        producer = gathered.producer()
        if producer is None or producer.op_type != "GatherGrad" or producer.domain != MS_DOMAIN:
            continue
        if producer.attributes.get_int("axis", 0) == 0:
            return part, producer
    return None


def _sum_of_scatter_into_zeros(node: ir.Node) -> tuple[ir.Value, ir.Node] | None:
    """``(part, scatter)`` when ``node`` sums a part and the only use of a
    ``ScatterND(zeros, ids, dY, reduction="add")`` of the part's shape, else None."""
    for scattered, part in _sum_parts(node):
        scatter = scattered.producer()
        if scatter is None or scatter.op_type != "ScatterND" or not is_onnx_domain(scatter.domain):
            continue
        if scatter.attributes.get_string("reduction", "none") != "add" or not _only_zeros(scatter.inputs[0]):
            continue
        if scattered.shape is not None and list(scattered.shape) == list(part.shape):
            return part, scatter
    return None


def _only_zeros(value: ir.Value | None) -> bool:
    """``value`` is zeros: ``Expand`` of a constant scalar 0, or an initializer of zeros
    (torch.onnx folds the Expand at static sizes, and shares one between scatters)."""
    if value is None or value.is_graph_output() or value.is_graph_input():
        return False
    producer = value.producer()
    if producer is None:
        return value.is_initializer() and _all_zero(value)
    return producer.op_type == "Expand" and is_onnx_domain(producer.domain) and _all_zero(producer.inputs[0], size=1)


def _all_zero(value: ir.Value | None, size: int | None = None) -> bool:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is None or (size is not None and tensor.size != size):
        return False
    return not np.any(tensor.numpy())
