"""Compute each part of an accumulated weight gradient as soon as its inputs exist.

A weight used twice (GPT-2's token embedding is also its output projection) gets its
gradient as ``Sum(part_1, part_2)``: ORT's builder accumulates the parts in one node, a
backward leaf.  ORT's default order (``docs/design/ort-execution-order.md``) runs a node
when a walk from a leaf reaches it, and a part's chain has no reader but the ``Sum``.  The
``Sum`` can run only once its last part exists, at the end of backward, so the walk runs
every part there: the head's part, ``dlogits^T @ h``, kept the logits' gradient (32 MiB
at batch 8 x 512, vocab 2048; 128 MiB at seq 2048) and the final hidden state alive
through the whole backward.

ORT has no control edge, so the pass gives the early part a reader the walk reaches when
the part's inputs exist: ``Y' = Where(false, ReduceSum(part), Y)`` on the output ``Y`` of
another backward reader of the gradient the part reads, every reader of ``Y`` reading
``Y'`` instead.  ``Where`` with a false condition returns ``Y`` exactly, whatever the
part's values; the price is a reduction of the part (the weight's size) and one copy of
``Y``.  (ORT's transpose optimizer may read the part's last Transpose past the reduction;
then only that Transpose waits for the end, and the chain's reads of the big gradient
still run early.)  Measured (benchmarks/hf_memory.py, HF GPT-2, 4 layers, batch 8 x 512):
step peak 250 -> 216 MiB, with fused attention 230 -> 196.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from ortpass.analysis.partition import get_training_info, is_backward, tag
from ortpass.conventions import is_onnx_domain
from ortpass.graph.names import NameAllocator
from ortpass.infra.base import OrtPass
from ortpass.infra.registry import register_pass

__all__ = ["AccumulateGradientsEarlyPass"]

logger = logging.getLogger(__name__)

_ACCUMULATING_OPS = frozenset({"Sum", "Add"})


def _readers(value: ir.Value) -> list[ir.Node]:
    return [user for user, _ in value.uses()]


def _part_chain(part: ir.Value, accumulate: ir.Node) -> list[ir.Node]:
    """The backward nodes whose outputs reach only ``accumulate`` through ``part``."""
    chain: list[ir.Node] = []
    members = {accumulate}
    frontier = [part.producer()]
    while frontier:
        node = frontier.pop()
        if node is None or node in members or not is_backward(node):
            continue
        if any(out.is_graph_output() or any(r not in members for r in _readers(out)) for out in node.outputs):
            continue
        members.add(node)
        chain.append(node)
        frontier.extend(v.producer() for v in node.inputs if v is not None)
    return chain


class _Positions:
    def __init__(self, graph: ir.Graph) -> None:
        self.of = {node: i for i, node in enumerate(graph)}

    def produced(self, value: ir.Value) -> int:
        producer = value.producer()
        return -1 if producer is None else self.of[producer]


@register_pass("accumulate-gradients-early")
class AccumulateGradientsEarlyPass(OrtPass):
    """Give each early part of an accumulated weight gradient a reader on backward's path.

    Rule: for a backward ``Sum``/``Add`` that produces a gradient output from parts whose
    chains (the backward nodes that feed only that part) are ready at different times, each
    part but the last to become ready is read by ``Y' = Where(false, ReduceSum(part), Y)``,
    where ``Y`` is the first output of another backward reader of the gradient value the
    part's chain reads last (the logits' gradient, for a tied head); ``Y``'s readers read
    ``Y'``.  The part's chain moves to just after ``Y``'s producer.  A part whose chain
    reads a value made after that producer, whose dtype differs from ``Y``'s, or where that
    producer comes after the accumulation in graph order, is left alone.  Runs before ``recompute`` (whose execution order then takes it in).
    Statistics: ``parts computed early``.
    """

    phase = "post-grad"
    runs_before = frozenset({"recompute"})

    def __repr__(self) -> str:
        return "AccumulateGradientsEarlyPass()"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        gradients = set(get_training_info(model).gradients.values())
        accumulations = [
            node for node in graph
            if is_backward(node) and node.op_type in _ACCUMULATING_OPS and is_onnx_domain(node.domain)
            and node.outputs[0].name in gradients and len(node.inputs) >= 2
        ]  # fmt: skip
        modified = False
        for accumulate in accumulations:
            modified |= self._accumulate_early(graph, accumulate)
        return ir.passes.PassResult(model, modified=modified)

    def _accumulate_early(self, graph: ir.Graph, accumulate: ir.Node) -> bool:
        positions = _Positions(graph)
        parts = []
        for part in dict.fromkeys(v for v in accumulate.inputs if v is not None):
            chain = _part_chain(part, accumulate)
            outside = [v for n in chain for v in n.inputs if v is not None and v.producer() not in chain]
            if not chain or not outside:
                return False
            parts.append((part, chain, outside))
        parts.sort(key=lambda item: max(map(positions.produced, item[2])))
        modified = False
        for part, chain, outside in parts[:-1]:
            modified |= self._give_reader(graph, accumulate, part, chain, outside)
        return modified

    def _give_reader(self, graph: ir.Graph, accumulate: ir.Node, part: ir.Value, chain: list[ir.Node],
                     outside: list[ir.Value]) -> bool:  # fmt: skip
        """``outside``: the values ``chain`` reads from outside it."""
        positions = _Positions(graph)  # afresh: the part before this one moved nodes
        last_read = max(outside, key=positions.produced)
        others = [n for n in _readers(last_read) if n not in chain and is_backward(n) and n.outputs]
        if not others:
            return False
        anchor = min(others, key=positions.of.__getitem__)
        target = anchor.outputs[0]
        if target.is_graph_output() or target.dtype != part.dtype or part.dtype is None:
            return False
        if positions.produced(last_read) > positions.of[anchor]:
            return False
        if positions.of[anchor] > positions.of[accumulate]:
            return False
        names = NameAllocator.of_graph(graph)
        uses = list(target.uses())
        summed = ir.node("ReduceSum", [part], {"keepdims": 0}, name=names.fresh(f"{part.name}_sum"))
        never = ir.node("Constant", [], {"value": ir.tensor(np.array(False))}, name=names.fresh(f"{part.name}_never"))
        where = ir.node("Where", [never.outputs[0], summed.outputs[0], target], name=names.fresh(f"{target.name}_after_part"))
        for node in (summed, never, where):
            node.outputs[0].name = names.fresh(f"{node.name}_output")
            tag(node, "backward")
        where.outputs[0].dtype, where.outputs[0].shape = target.dtype, target.shape
        # Scalars, typed so that memory analyses downstream know every value's size.
        summed.outputs[0].dtype, summed.outputs[0].shape = part.dtype, ir.Shape([])
        never.outputs[0].dtype, never.outputs[0].shape = ir.DataType.BOOL, ir.Shape([])
        for reader, index in uses:
            reader.replace_input_with(index, where.outputs[0])
        ordered_chain = sorted(chain, key=positions.of.__getitem__)
        graph.remove(ordered_chain)
        graph.insert_after(anchor, [*ordered_chain, summed, never, where])
        self.count("parts computed early")
        logger.debug("%s: computed after %s, read by %s", part.name, anchor.name, where.name)
        return True
