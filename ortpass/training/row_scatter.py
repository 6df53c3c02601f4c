"""Gradients whose last step adds rows: the session's caller adds them, in place.

A tied embedding's gradient ends in ``ScatterND(part, ids, rows, reduction="add")``
(``scatter-embedding-gradient``; torch's ``embedding_dense_backward`` too): the rows of
the embedding's gradient added into the head's part.  ONNX values are immutable and ORT
writes no kernel's output over its input here (ScatterND, Add: measured on 1.19.2 and
1.31.1, memory reuse on or off; docs/design/ort-facts.md), so the scatter allocates the
whole weight's gradient again while ``part`` is alive: two ``vocab x hidden`` tensors at
the very end of the step, when every other gradient exists too.  On HF GPT-2 at real width
(vocabulary 50257, hidden 768) that copy is 147 MiB, the step's peak.

Rule: a ScatterND with ``reduction="add"`` whose output is a graph output read by no node,
whose data is a node's output (not a graph input, initializer or output), and whose indices
pick whole rows (last dim 1), is removed from the graph an ortpass session runs.  Other
readers of the data may stay (``accumulate-gradients-early`` orders with one): the rows are
added after the run, so they read what they read before.  The data becomes the graph output
under the gradient's name, the indices and rows two more outputs, and the session adds the
rows into the returned gradient in place (:func:`ortpass.runtime.row_adds.add_rows`), in the
order of the updates as ORT's kernel does.  The saved graph keeps the ScatterND: only the
session's copy of it changes.
"""

from __future__ import annotations

import dataclasses
import logging

import onnx_ir as ir

from ortpass.conventions import SIDE_KEY, is_onnx_domain
from ortpass.graph.names import NameAllocator

__all__ = ["RowScatter", "defer_row_scatters"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RowScatter:
    """A graph output the caller completes: ``gradient[indices[..., 0]] += rows``."""

    gradient: str
    indices: str
    rows: str


def defer_row_scatters(model: ir.Model) -> tuple[ir.Model, list[RowScatter]]:
    """``model`` and no scatters where none qualifies (module docstring), else a copy with
    each qualifying ScatterND removed, and what the caller must add."""
    if not any(_deferrable(node) for node in model.graph):
        return model, []
    model = model.clone()
    graph = model.graph
    names = NameAllocator.of_graph(graph)
    deferred = []
    for node in [n for n in graph if _deferrable(n)]:
        deferred.append(_defer(graph, names, node))
    logger.debug("the caller adds the rows of %d gradients", len(deferred))
    return model, deferred


def _deferrable(node: ir.Node) -> bool:
    if node.op_type != "ScatterND" or not is_onnx_domain(node.domain) or len(node.inputs) != 3:
        return False
    if node.attributes.get_string("reduction", "none") != "add":
        return False
    result = node.outputs[0]
    data, indices, rows = node.inputs
    if not result.is_graph_output() or result.uses() or data is None or indices is None or rows is None:
        return False
    if data.producer() is None or data.is_graph_output() or data.is_initializer():
        return False
    shape = indices.shape
    return shape is not None and len(shape) >= 1 and shape[-1] == 1


def _defer(graph: ir.Graph, names: NameAllocator, scatter: ir.Node) -> RowScatter:
    data, indices, rows = scatter.inputs
    result = scatter.outputs[0]
    name = result.name
    position = next(i for i, v in enumerate(graph.outputs) if v is result)
    graph.outputs[position] = data
    graph.remove(scatter, safe=True)
    result.name = None
    data.name = name
    if data.shape is None:
        data.shape, data.dtype = result.shape, result.dtype
    extra = []
    for value in (indices, rows):
        if value.is_graph_output() or value.is_graph_input() or value.is_initializer():
            identity = ir.node("Identity", [value], name=names.fresh(f"{name}_rows_output"))
            identity.outputs[0].name = names.fresh(f"{value.name}_for_{name}")
            identity.outputs[0].shape, identity.outputs[0].dtype = value.shape, value.dtype
            identity.metadata_props[SIDE_KEY] = data.producer().metadata_props.get(SIDE_KEY, "backward")
            graph.append(identity)
            value = identity.outputs[0]
        graph.outputs.append(value)
        extra.append(value.name)
    return RowScatter(name, *extra)
