"""The wrapper's memory budget at a new batch's sizes.

A graph is planned (``recompute(budget=...)``) at the dims of the batch it is built for,
and runs at other sizes of the dims its export proved dynamic.  A larger batch makes its
step peak larger.  Rule: with a budget in bytes, a call runs a built graph only where that
graph's predicted step peak at the call's sizes (:func:`~ortpass.analysis.step_memory.predict_step_memory`
of the training graph, dims read off the call's tensors) is within the budget; otherwise the
wrapper builds a graph planned at the new sizes (or says that no recompute reaches the
budget there).  A fraction is relative to each graph's own peaks: a graph planned for one
keeps running at every size it accepts.  Each graph's answer is memoized per sizes.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import onnx_ir as ir
import torch

__all__ = ["BudgetFit"]

logger = logging.getLogger(__name__)


class BudgetFit:
    """``fits(graph, tensors)``: whether ``graph`` keeps a step at ``tensors``' sizes within
    ``budget_bytes``.  Graphs without a kept training model (forward-only) always fit."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes

    def __call__(self, graph: Any, tensors: Sequence[torch.Tensor]) -> bool:
        model = getattr(graph, "training_model", None)
        if model is None:
            return True
        sizes = tuple(tuple(t.shape) for t in tensors)
        known = graph.fits_budget  # memoized on the graph, which lives as long as its answers
        if sizes not in known:
            from ortpass.analysis.step_memory import predict_step_memory

            dims = dims_at(model, graph.tensor_inputs, tensors)
            step = predict_step_memory(model, dims)
            fits = step.peak_bytes <= self.budget_bytes or not step.exact
            if not fits:
                logger.info(
                    "ORTModule: the graph planned for the memory budget predicts %.1f MiB at sizes %s, over the "
                    "budget's %.1f MiB: planning again at these sizes",
                    step.peak_bytes / 2**20, list(sizes), self.budget_bytes / 2**20,
                )
            known[sizes] = fits
        return known[sizes]


def dims_at(model: ir.Model, tensor_inputs: Sequence[str | None], tensors: Sequence[torch.Tensor]) -> dict[str, int]:
    """The graph's dim params at ``tensors``' sizes (``tensor_inputs``: the graph input each
    tensor feeds, None where it feeds none)."""
    shapes = {v.name: v.shape for v in model.graph.inputs}
    dims: dict[str, int] = {}
    for name, tensor in zip(tensor_inputs, tensors):
        shape = shapes.get(name) if name is not None else None
        if shape is None:
            continue
        for axis, dim in enumerate(shape):
            if isinstance(dim, ir.SymbolicDim) and dim.value and axis < tensor.dim():
                dims[dim.value] = int(tensor.shape[axis])
    return dims
