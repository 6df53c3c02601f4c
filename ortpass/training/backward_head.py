"""Cut a split step's backward graph in two: the *head*, which reads the outputs' gradients,
and the *body*, which reads what the head hands it.

Rule: the head holds every backward node that reads a gradient seed (the gradient of a
forward output, fed from torch) or a view of one (:data:`~ortpass.analysis.memory.ALIAS_OPS`:
ORT's Reshape of a tensor shares its buffer), together with the backward nodes those read,
so that it runs alone; the body holds the rest.  The head's outputs are the gradients it
completes and the *cut*: each value of the head that the body reads.  Run one after the
other, the two compute what the backward graph computes, every node once, on the same
inputs.

Why: torch's autograd engine holds the gradients it hands a ``backward()`` until that call
returns (measured: deleting the argument inside ``backward`` frees nothing), and an
onnxruntime run holds its feeds until it ends.  Fed to one backward run, a language model's
logits gradient (batch x seq x vocab: 32 MiB for batch 8 x 512 x 2048 in float) stays alive
through every layer's backward.  The head consumes it in its own autograd node
(:class:`~ortpass.runtime.module.steps.SplitStep`), after which torch frees it; the body
then gets the small gradient of the hidden states instead.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable

import onnx

from ortpass.analysis.memory import ALIAS_OPS

__all__ = ["BackwardHalves", "cut_backward_head", "subgraph_model"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class BackwardHalves:
    """The two graphs, and the values that pass from the head to the body."""

    head: onnx.ModelProto
    body: onnx.ModelProto
    cut: list[str]  # head values the body reads (each among the head's outputs)
    head_outputs: list[str]  # the backward graph's outputs the head produces (gradients)


def cut_backward_head(backward: onnx.ModelProto, seeds: Iterable[str]) -> BackwardHalves | None:
    """Cut ``backward`` (a split step's backward graph, not modified) after the nodes that
    read the gradient ``seeds``; ``None`` when no node reads one, or when every node would
    fall in the head (nothing would be freed earlier)."""
    graph = backward.graph
    nodes = list(graph.node)
    head = _head_nodes(nodes, set(seeds))
    if not head or len(head) == len(nodes):
        return None
    in_head = [node for k, node in enumerate(nodes) if k in head]
    in_body = [node for k, node in enumerate(nodes) if k not in head]
    produced_by_head = {name for node in in_head for name in node.output if name}
    read_by_body = {name for node in in_body for name in node.input if name}
    outputs = [o.name for o in graph.output]
    head_outputs = [name for name in outputs if name in produced_by_head]
    cut = [name for node in in_head for name in node.output if name in read_by_body]
    declared = {v.name: v for v in [*graph.value_info, *graph.output]}
    untyped = [name for name in cut if name not in declared]
    if untyped:  # the body could not declare its input; keep the one graph
        logger.info("backward head not cut: values %s have no declared type", untyped[:3])
        return None
    fetched = [*head_outputs, *(name for name in cut if name not in head_outputs)]
    head_model = subgraph_model(backward, "head", in_head, fetched, declared, extra_inputs=())
    body_model = subgraph_model(
        backward, "body", in_body, [name for name in outputs if name not in produced_by_head], declared,
        extra_inputs=cut,
    )  # fmt: skip
    logger.info(
        "backward cut after its head: %d of %d nodes read the outputs' gradients; %d values cross",
        len(in_head), len(nodes), len(cut),
    )  # fmt: skip
    return BackwardHalves(head_model, body_model, cut, head_outputs)


def _head_nodes(nodes: list[onnx.NodeProto], seeds: set[str]) -> set[int]:
    """Indices of the nodes reading a seed or a view of one, and of every node they need."""
    views = set(seeds)
    readers: set[int] = set()
    for k, node in enumerate(nodes):  # graph order is topological: a view's producer comes first
        if any(name in views for name in node.input):
            readers.add(k)
            if (node.domain or "", node.op_type) in ALIAS_OPS and node.input[0] in views:
                views.add(node.output[0])
    producer = {name: k for k, node in enumerate(nodes) for name in node.output if name}
    head, pending = set(), list(readers)
    while pending:
        k = pending.pop()
        if k in head:
            continue
        head.add(k)
        pending.extend(producer[name] for name in nodes[k].input if name in producer)
    return head


def subgraph_model(
    proto: onnx.ModelProto, name: str, nodes: list[onnx.NodeProto], outputs: list[str],
    declared: dict[str, onnx.ValueInfoProto], extra_inputs: list[str] | tuple,
) -> onnx.ModelProto:  # fmt: skip
    """A model with ``nodes`` of ``proto``, reading the graph inputs and initializers they
    need and ``extra_inputs`` (declared in ``declared``), producing ``outputs``."""
    graph = proto.graph
    read = {n for node in nodes for n in node.input if n} | set(outputs)
    sub = onnx.GraphProto(name=f"{graph.name}_{name}")
    sub.node.extend(nodes)
    sub.input.extend(i for i in graph.input if i.name in read)
    sub.input.extend(declared[n] for n in extra_inputs)
    sub.initializer.extend(t for t in graph.initializer if t.name in read)
    sub.output.extend(declared[n] for n in outputs)
    sub.value_info.extend(v for v in graph.value_info if v.name in read and v.name not in extra_inputs)
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    model.graph.CopyFrom(sub)
    return model
