"""Derive again in backward what forward derives from a graph input in one layout op,
instead of keeping it between a split step's halves.

Rule: a value a forward node produces and a backward node reads, where that node is a
Transpose, Cast, Reshape, Squeeze, Unsqueeze or Identity whose inputs are all graph inputs,
initializers or constants, is computed again by a clone of that node in backward, next to
its first backward reader; backward reads the clone.  The forward node stays for forward's
own readers.

Why: ORT's gradient builder writes a linear layer's backward as a MatMul with the transposed
weight that forward computed, ``Transpose(W)``, so a split step would keep a copy of every
weight from forward until the backward half ends (16 of the 42 MiB a 4-layer LLaMA at hidden
256 kept).  The weight itself is fed to backward anyway; transposing it again costs one pass
over it.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from ortpass.analysis.partition import is_backward, tag

__all__ = ["rederive_layout_of_inputs"]

logger = logging.getLogger(__name__)

_LAYOUT_OPS = frozenset({"Transpose", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Identity"})


def rederive_layout_of_inputs(model: ir.Model) -> int:
    """Clone into backward each forward layout op over graph inputs whose output backward
    reads (the module docstring); returns how many were cloned."""
    graph = model.graph
    sources = {id(v) for v in graph.inputs} | {id(v) for v in graph.initializers.values()}
    position = {node: k for k, node in enumerate(graph)}
    graph_outputs = {id(v) for v in graph.outputs}
    cloned = 0
    for node in list(graph):
        if is_backward(node) or node.domain not in ("", "ai.onnx") or node.op_type not in _LAYOUT_OPS:
            continue
        if not all(v is None or id(v) in sources or v.const_value is not None for v in node.inputs):
            continue
        output = node.outputs[0]
        readers = sorted({user for user, _ in output.uses() if is_backward(user)}, key=position.__getitem__)
        if not readers or id(output) in graph_outputs:
            continue
        clone = ir.Node(
            node.domain, node.op_type, list(node.inputs), attributes=list(node.attributes.values()),
            num_outputs=1, name=f"{node.name}_in_backward",
        )  # fmt: skip
        tag(clone, "backward")
        again = clone.outputs[0]
        again.name, again.type = f"{output.name}_in_backward", output.type
        again.shape = output.shape.copy() if output.shape is not None else None
        graph.insert_before(readers[0], clone)
        for user, index in list(output.uses()):
            if is_backward(user):
                user.replace_input_with(index, again)
        cloned += 1
    if cloned:
        logger.info("%d value(s) derived from graph inputs derived again in backward instead of kept", cloned)
    return cloned
