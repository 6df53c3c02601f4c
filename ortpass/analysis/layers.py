"""Transformer layer boundaries in the forward part of a training graph.

Rule (ORT's, ``transformer_specific.cc``, restated): a LayerNorm node (LayerNormalization,
SimplifiedLayerNormalization, SkipLayerNormalization, SkipSimplifiedLayerNormalization) is
the boundary that opens a layer when

1. its input 0 (the residual stream) has forward consumers that include an ``Add`` placed
   after the LayerNorm (the residual add that closes the attention block), and
2. a walk over forward consumers starting at the LayerNorm, visiting only nodes placed
   before that ``Add``, reaches an attention op: Softmax, com.microsoft BiasSoftmax,
   com.microsoft (Multi)Attention, or a PythonOp whose ``func_name`` is registered as a
   recomputable attention function (``register_recomputable_function(name,
   attention=True)``; flash_attn's functions are, as in ORT).

The MLP's LayerNorm fails (2): its sub-block reaches no attention op before its residual
add; a final LayerNorm fails (1): nothing adds to its input.  So a pre-LN decoder with N
layers has N boundaries.  Restricting the walk to nodes placed before the ``Add`` bounds
each walk by its block, so detection is linear in the graph size.

Layer ``k`` spans the forward nodes from boundary ``k`` (inclusive) up to boundary ``k+1``
(exclusive).  The last layer ends with the last residual ``Add`` of its stream (follow the
residual stream from its input through each ``Add`` that reads it); what follows (the
final LayerNorm, the head, the loss) lies outside every layer.

A layer's *checkpoints* are the values a layer-wise plan keeps: each layer's input (input
0 of its boundary) and the last layer's output.  Without the latter, the head's backward
would read a final residual recomputed from the last layer's input, and the whole last
layer would be recomputed (and held) before the loss's backward could start.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
from typing import Sequence

import onnx_ir as ir

from ortpass.analysis.recomputable_ops import attention_functions, recomputable_function_of

__all__ = ["LAYER_NORM_OPS", "LayerBoundaries", "find_layer_boundaries"]

logger = logging.getLogger(__name__)

LAYER_NORM_OPS = frozenset(
    {"LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"}
)
_ATTENTION_OPS = frozenset({"Softmax", "BiasSoftmax", "BiasSoftmaxDropout", "Attention", "MultiHeadAttention"})


@dataclasses.dataclass
class LayerBoundaries:
    """The boundary LayerNorm of each detected layer, and which layer a node lies in."""

    nodes: list[ir.Node]
    _starts: list[int]  # position of each boundary in the forward order
    _end: int  # one past the last node of the last layer
    last_output: ir.Value | None = None  # the residual stream leaving the last layer

    def __post_init__(self) -> None:
        self._node_set = frozenset(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def layer_of(self, position: int) -> int | None:
        """The layer containing the forward node at ``position``, or None (before layer 0)."""
        if not self._starts or position < self._starts[0] or position >= self._end:
            return None
        return bisect.bisect_right(self._starts, position) - 1

    def is_layer_input(self, value: ir.Value) -> bool:
        """True when ``value`` is input 0 of a boundary LayerNorm (the residual entering a layer)."""
        return any(use.idx == 0 and use.node in self._node_set for use in value.uses())

    def is_checkpoint(self, value: ir.Value) -> bool:
        """True when a layer-wise plan keeps ``value``: a layer's input or the last layer's output."""
        return value is self.last_output or self.is_layer_input(value)


def _is_attention(node: ir.Node) -> bool:
    if node.op_type in _ATTENTION_OPS:
        return True
    func_name = recomputable_function_of(node)
    return func_name is not None and func_name in attention_functions()


def _residual_add(ln: ir.Node, position: dict[ir.Node, int]) -> ir.Node | None:
    """The first forward Add after ``ln`` that also reads ``ln``'s input 0."""
    x = ln.inputs[0] if ln.inputs else None
    return None if x is None else _next_add(x, position[ln], position)


def _next_add(value: ir.Value, after: int, position: dict[ir.Node, int]) -> ir.Node | None:
    """The first forward Add placed after position ``after`` that reads ``value``."""
    adds = [use.node for use in value.uses() if use.node.op_type == "Add" and position.get(use.node, -1) > after]
    return min(adds, key=position.__getitem__) if adds else None


def _last_residual_add(ln: ir.Node, position: dict[ir.Node, int]) -> ir.Node | None:
    """Follow the residual stream entering boundary ``ln`` through each Add that reads it;
    the last such Add closes the layer."""
    add = _residual_add(ln, position)
    last = None
    while add is not None:
        last = add
        add = _next_add(add.outputs[0], position[add], position)
    return last


def _reaches_attention_before(ln: ir.Node, stop: int, position: dict[ir.Node, int]) -> bool:
    queue = collections.deque([ln])
    seen = {ln}
    while queue:
        node = queue.popleft()
        for out in node.outputs:
            for use in out.uses():
                consumer = use.node
                pos = position.get(consumer)  # None: a backward node
                if pos is None or pos >= stop or consumer in seen:
                    continue
                if _is_attention(consumer):
                    return True
                seen.add(consumer)
                queue.append(consumer)
    return False


def find_layer_boundaries(forward: Sequence[ir.Node]) -> LayerBoundaries:
    """Detect layer boundaries among ``forward`` (the forward nodes in execution order)."""
    position = {node: i for i, node in enumerate(forward)}
    boundaries = []
    for node in forward:
        if node.op_type not in LAYER_NORM_OPS:
            continue
        add = _residual_add(node, position)
        if add is None:
            continue
        if _reaches_attention_before(node, position[add], position):
            boundaries.append(node)
    logger.debug("layer boundaries: %s", [n.name for n in boundaries])
    end, last_output = len(forward), None
    if boundaries:
        closing = _last_residual_add(boundaries[-1], position)
        if closing is not None:
            end, last_output = position[closing] + 1, closing.outputs[0]
    return LayerBoundaries(boundaries, [position[n] for n in boundaries], end, last_output)
