"""Transformer layer boundaries in the forward part of a training graph.

Rule (ORT's, ``transformer_specific.cc``, restated): a LayerNorm node (LayerNormalization,
SimplifiedLayerNormalization, SkipLayerNormalization, SkipSimplifiedLayerNormalization, or
the ``Pow(x, 2)`` opening an RMSNorm written out in plain ops, as the torch builder's
graphs have it) is the boundary that opens a layer when

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

Post-LN blocks (BERT: ``x = LN(x + Attention(x)); x = LN(x + MLP(x))``) fail rule (1):
their LayerNorm closes a block, and nothing adds to its input.  The residual stream is
the LayerNorm's *output* there, so ours (not ORT's) adds the mirror rule: a LayerNorm
whose output, passed on through Dropout or Identity nodes (BERT's embedding LayerNorm is
followed by a Dropout), is read by an ``Add`` placed after it, and whose walk reaches an
attention op before that ``Add``, opens a layer.  The LayerNorm after attention fails it
(its sub-block, the MLP, has no attention), the last one of the last layer too (nothing
adds to its output: the head follows), and the embedding LayerNorm and the one closing
each block but the last pass it: one boundary per block.  In a pre-LN block no
LayerNorm output is read by an ``Add``, so the mirror rule finds nothing there.

Layer ``k`` spans the forward nodes from boundary ``k`` (inclusive) up to boundary ``k+1``
(exclusive).  The last layer ends with the last residual ``Add`` of its stream (follow the
residual stream from its input through each ``Add`` that reads it; post-LN: through each
``Add`` and the LayerNorm that normalizes its sum); what follows (the final LayerNorm,
the head, the loss) lies outside every layer.

A layer's *checkpoints* are the values a layer-wise plan keeps: each layer's input (input
0 of its boundary; post-LN: the boundary's output, past its Dropout) and the last layer's
output.  Without the latter, the head's backward
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

from ortpass.analysis.recomputable_ops import (
    attention_functions,
    recomputable_function_of,
)

__all__ = ["LAYER_NORM_OPS", "LayerBoundaries", "find_layer_boundaries"]

logger = logging.getLogger(__name__)

LAYER_NORM_OPS = frozenset(
    {"LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"}
)
_ATTENTION_OPS = frozenset({"Softmax", "BiasSoftmax", "BiasSoftmaxDropout", "Attention", "MultiHeadAttention"})
# Ops a post-LN residual stream passes through unchanged in value or role on its way to
# the next block (BERT's embedding LayerNorm -> Dropout).
_STREAM_OPS = frozenset({"Dropout", "Identity"})


@dataclasses.dataclass
class LayerBoundaries:
    """The boundary LayerNorm of each detected layer, and which layer a node lies in."""

    nodes: list[ir.Node]
    _starts: list[int]  # position of each boundary in the forward order
    _end: int  # one past the last node of the last layer
    last_output: ir.Value | None = None  # the residual stream leaving the last layer
    # The residual stream entering each layer (input 0 of a pre-LN boundary, the output
    # of a post-LN one); default: input 0 of each boundary.
    inputs: list[ir.Value] | None = None

    def __post_init__(self) -> None:
        if self.inputs is None:
            self.inputs = [node.inputs[0] for node in self.nodes]
        self._inputs = frozenset(self.inputs)

    def __len__(self) -> int:
        return len(self.nodes)

    def layer_of(self, position: int) -> int | None:
        """The layer containing the forward node at ``position``, or None (before layer 0)."""
        if not self._starts or position < self._starts[0] or position >= self._end:
            return None
        return bisect.bisect_right(self._starts, position) - 1

    def is_layer_input(self, value: ir.Value) -> bool:
        """True when ``value`` is the residual stream entering a layer (input 0 of a pre-LN
        boundary LayerNorm, the output of a post-LN one)."""
        return value in self._inputs

    def is_checkpoint(self, value: ir.Value) -> bool:
        """True when a layer-wise plan keeps ``value``: a layer's input or the last layer's output."""
        return value is self.last_output or self.is_layer_input(value)


def _is_norm(node: ir.Node) -> bool:
    """A LayerNorm op, or the first node of an RMSNorm written out in ONNX ops (torch's
    autograd differentiates it so: ``x * rsqrt(mean(x ** 2) + eps) * w``), the square
    read by a ``ReduceMean``: ``Pow(x, 2)``, or ``Mul(x, x)`` as the torch builder writes
    it (:mod:`ortpass.training.joint_decompositions`); its input 0 is the residual stream,
    as a LayerNorm's."""
    if node.op_type in LAYER_NORM_OPS:
        return True
    square = node.op_type == "Pow" or (node.op_type == "Mul" and len(node.inputs) == 2 and node.inputs[0] is node.inputs[1])
    return square and any(use.node.op_type == "ReduceMean" for use in node.outputs[0].uses())


def _is_attention(node: ir.Node) -> bool:
    if node.op_type in _ATTENTION_OPS or node.op_type.startswith("OrtpassAttention_"):  # stock fused attention
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


def _post_ln_stream(ln: ir.Node, position: dict[ir.Node, int]) -> ir.Value | None:
    """The residual stream leaving post-LN LayerNorm ``ln``: its output, passed on through
    forward Dropout (output 0) or Identity nodes that are its only reader."""
    value = ln.outputs[0] if ln.outputs else None
    while value is not None:
        readers = [use.node for use in value.uses() if use.node in position]
        if len(readers) != 1 or readers[0].op_type not in _STREAM_OPS or not readers[0].outputs:
            return value
        value = readers[0].outputs[0]
    return None


def _post_ln_layer_end(stream: ir.Value, after: int, position: dict[ir.Node, int]) -> tuple[ir.Node | None, ir.Value]:
    """Follow a post-LN residual stream through each Add that reads it and the LayerNorm
    that normalizes the sum; returns the last node on it and the stream it leaves."""
    last = None
    add = _next_add(stream, after, position)
    while add is not None:
        last, stream = add, add.outputs[0]
        norms = [u.node for u in stream.uses() if u.node.op_type in LAYER_NORM_OPS and u.idx == 0 and u.node in position]
        if norms:
            norm = min(norms, key=position.__getitem__)
            last, stream = norm, _post_ln_stream(norm, position) or norm.outputs[0]
        add = _next_add(stream, position[last], position)
    return last, stream


def find_layer_boundaries(forward: Sequence[ir.Node]) -> LayerBoundaries:
    """Detect layer boundaries among ``forward`` (the forward nodes in execution order)."""
    position = {node: i for i, node in enumerate(forward)}
    boundaries: list[ir.Node] = []
    inputs: list[ir.Value] = []
    post_ln: list[ir.Value | None] = []
    for node in forward:
        if not _is_norm(node) or not node.inputs or node.inputs[0] is None:
            continue
        add = _residual_add(node, position)
        if add is not None and _reaches_attention_before(node, position[add], position):
            boundaries.append(node)
            inputs.append(node.inputs[0])
            post_ln.append(None)
            continue
        stream = _post_ln_stream(node, position)
        add = None if stream is None else _next_add(stream, position[node], position)
        if add is not None and _reaches_attention_before(node, position[add], position):
            boundaries.append(node)
            inputs.append(stream)
            post_ln.append(stream)
    logger.debug("layer boundaries: %s", [n.name for n in boundaries])
    end, last_output = len(forward), None
    if boundaries:
        if post_ln[-1] is not None:
            closing, stream = _post_ln_layer_end(post_ln[-1], position[boundaries[-1]], position)
            if closing is not None:
                end, last_output = position[closing] + 1, stream
        else:
            closing = _last_residual_add(boundaries[-1], position)
            if closing is not None:
                end, last_output = position[closing] + 1, closing.outputs[0]
    return LayerBoundaries(boundaries, [position[n] for n in boundaries], end, last_output, inputs)
