"""Compute SiLU's sigmoid again for its gradient, and finish a gated MLP's partner gradient
before the activation's gradient starts.

The torch builder writes SiLU out, ``A = G * S`` with ``S = Sigmoid(G)``, and its gradient
as torch's ``silu_backward`` formula, ``dG = dA * S * (1 + G * (1 - S))``: backward reads
``S`` as well as ``G``.  In a gated MLP (``Y = A * U``: LLaMA, Mistral, Qwen2) backward
computes ``dU = dY * A`` and ``dA = dY * U``.  ORT's order ran the partner's weight
gradient from ``dU`` first, then the whole activation gradient, and the partner's input
gradient from ``dU`` last.  So ``dU`` lived through the activation gradient, and at its
second product ``G``, ``S``, ``dU``, ``dA`` and two temporaries were alive: six tensors of
batch x seq x ffn (HF LLaMA's step peak on stock onnxruntime, in every layer).  Making
``dU``'s readers run first does not help alone: ``S`` is still alive at ``dU``'s product,
with ``G``, ``U``, ``A``, ``dY`` and ``dU``.

Rule: for a ``Sigmoid`` ``S = Sigmoid(G)`` outside the gradient (forward, or a recompute
clone) read by a ``Mul`` ``A = G * S`` whose output is gated (a forward ``Mul`` multiplies
it by ``U`` of its shape):

1. For each gradient product ``dU = Mul(dY, A)`` and the gradient product
   ``dA = Mul(dY, U)`` of the same ``dY``: ``dA`` reads ``dY`` through
   ``Reshape(dY, Where(IsNaN(t), Shape(dY), Shape(dY)))``, where ``t`` sums the outputs of
   the nodes that read ``dU`` (through views and ``Transpose``).  ORT has no control edge;
   this gives ``dA`` an input that exists only once ``dU`` is used up, so ORT's walk
   (``docs/design/ort-execution-order.md``) runs ``dU``'s readers first.  Those readers and
   the nodes they need move before ``dA``, and ``dA`` with its new nodes moves to just
   before its first reader, after the activation gradient's other nodes, so that the walk
   takes ``dA`` before them.  A product whose readers depend on ``dA`` (Phi-3's fused
   gate and up projection, whose gradients meet in one ``Concat``) is left alone.
2. Where a product was so ordered, every gradient node that reads ``S`` reads instead
   ``S' = Sigmoid(G)``, computed right before the first of them in graph order; ``S`` then
   dies with ``A``'s computation.  Without the order the copy lowers no peak, and is not
   made.

Both are exact: ``S'`` is the same op on the same input, and ``Where`` returns
``Shape(dY)`` whatever its condition.  Then at most five such tensors are alive at once
(``G``, ``U``, ``A``, ``dY`` and ``dU`` at ``dU``'s product; ``U`` and ``dY`` die at
``dA``'s), for one more sigmoid a layer and a reduction of each of ``dU``'s readers.

Measured (HF LLaMA, 4 layers, ffn 1024, batch 8 x 512, ``ORTModule`` on stock
onnxruntime): its graph run alone 162.9 -> 150.8 MiB; ``benchmarks/hf_memory.py`` 141 ->
128 MiB, against torch with checkpointing's 135; step time unchanged within this machine's
noise (``docs/design/torch-builder.md``, "The SwiGLU backward").
"""

from __future__ import annotations

import logging
from typing import Sequence

import onnx_ir as ir

from ortpass.analysis.gated_mlp import feeds, gated_partner, is_gradient_node, late_copy
from ortpass.analysis.memory import is_alias_node
from ortpass.analysis.partition import tag
from ortpass.graph.names import NameAllocator
from ortpass.infra.base import OrtPass
from ortpass.infra.registry import register_pass

__all__ = ["RecomputeSiluSigmoidPass"]

logger = logging.getLogger(__name__)


@register_pass("recompute-silu-sigmoid")
class RecomputeSiluSigmoidPass(OrtPass):
    """Give a gated SiLU's gradient its own sigmoid, and use up the partner's gradient
    before the activation's gradient starts (see the module docstring for the rule).

    Runs after ``recompute`` (the sigmoid and the activation are then usually recompute
    clones) and before the passes that judge the order by the predicted step peak.
    Statistics: ``sigmoids copied``, ``partner gradients finished first``.
    """

    phase = "post-grad"
    shapes_step_memory = True
    runs_after = frozenset({"recompute", "recompute-gate-activation"})
    runs_before = frozenset({"order-backward-joins", "recompute-again-late"})

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        silus = _gated_silus(list(graph))
        if not silus:
            return ir.passes.PassResult(model, modified=False)
        names = NameAllocator.of_graph(graph)
        modified = False
        for sigmoid, activation, partner in silus:
            finished = False
            for product, activation_product, incoming in _product_pairs(activation.outputs[0], partner):
                finished |= self._finish_first(graph, product, activation_product, incoming, names)
            # The copy alone changes no peak: the forward sigmoid is alive at the first
            # product with the five others anyway (measured on HF LLaMA).
            if finished:
                self._copy_sigmoid(graph, sigmoid, names)
            modified |= finished
        return ir.passes.PassResult(model, modified=modified)

    def _copy_sigmoid(self, graph: ir.Graph, sigmoid: ir.Node, names: NameAllocator) -> None:
        readers = [(node, index) for node, index in sigmoid.outputs[0].uses() if is_gradient_node(node)]
        if not readers:
            return
        position = {node: i for i, node in enumerate(graph)}
        copy = late_copy(sigmoid, names, self.name)
        graph.insert_before(min((node for node, _ in readers), key=position.__getitem__), copy)
        for node, index in readers:
            node.replace_input_with(index, copy.outputs[0])
        self.count("sigmoids copied")
        logger.debug("%s: its gradient reads %s", sigmoid.name, copy.name)

    def _finish_first(self, graph: ir.Graph, product: ir.Node, activation_product: ir.Node, incoming: ir.Value,
                      names: NameAllocator) -> bool:  # fmt: skip
        """``activation_product`` waits for every reader of ``product``'s output; both read
        ``incoming``."""
        position = {node: i for i, node in enumerate(graph)}
        readers = _final_readers(product.outputs[0])
        first_reader = min((n for out in activation_product.outputs for n, _ in out.uses()), key=position.__getitem__, default=None)
        if first_reader is None or not _one_float_type(readers):
            return False
        if any(feeds(activation_product, reader, position) for reader in readers):
            logger.debug("%s: a reader of %s needs it, left alone", activation_product.name, product.name)
            return False
        token_nodes, waited = _wait_for(incoming, readers, names)
        activation_product.replace_input_with(_index_of(activation_product, incoming), waited)
        # Graph order: the readers (and what they need) before the token, and the token and
        # the product right before the product's first reader.
        hoisted = _ancestors_from(readers, position, start=position[first_reader])
        graph.remove([activation_product, *hoisted])
        graph.insert_before(first_reader, [*hoisted, *token_nodes, activation_product])
        for node in token_nodes:
            tag(node, "backward")
        self.count("partner gradients finished first")
        logger.debug("%s: waits for %s", activation_product.name, ", ".join(r.name for r in readers))
        return True


def _gated_silus(nodes: Sequence[ir.Node]) -> list[tuple[ir.Node, ir.Node, ir.Value]]:
    """(``Sigmoid``, the ``Mul`` making ``G * Sigmoid(G)``, the value gating it) for each
    gated SiLU outside the gradient."""
    found = []
    for sigmoid in nodes:
        if sigmoid.op_type != "Sigmoid" or sigmoid.domain != "" or is_gradient_node(sigmoid):
            continue
        gate, out = sigmoid.inputs[0], sigmoid.outputs[0]
        for reader, index in out.uses():
            if (reader.op_type == "Mul" and reader.domain == "" and not is_gradient_node(reader)
                    and reader.inputs[1 - index] is gate):  # fmt: skip
                partner = gated_partner(reader.outputs[0])
                if partner is not None:
                    found.append((sigmoid, reader, partner))
    return found


def _product_pairs(activation: ir.Value, partner: ir.Value) -> list[tuple[ir.Node, ir.Node, ir.Value]]:
    """(``Mul(dY, A)``, ``Mul(dY, U)``, ``dY``): the gradient products of one incoming
    gradient ``dY`` with the activation and with its partner."""
    pairs = []
    for product, index in activation.uses():
        if product.op_type != "Mul" or product.domain != "" or not is_gradient_node(product):
            continue
        incoming = product.inputs[1 - index]
        for other, other_index in partner.uses() if incoming is not None else ():
            if (other.op_type == "Mul" and other.domain == "" and is_gradient_node(other)
                    and other.inputs[1 - other_index] is incoming):  # fmt: skip
                pairs.append((product, other, incoming))
    return pairs


def _one_float_type(readers: list[ir.Node]) -> bool:
    """Every reader's first output has one floating-point type, which the token sums."""
    types = {r.outputs[0].dtype if r.outputs else None for r in readers}
    return len(types) == 1 and None not in types and types.pop().is_floating_point()


def _final_readers(value: ir.Value) -> list[ir.Node]:
    """The nodes that read ``value`` through views and ``Transpose`` (which copies), not
    those in between: once they ran, nothing holds ``value`` or a copy of it."""
    found, stack = [], [value]
    while stack:
        for reader, _ in stack.pop().uses():
            if (is_alias_node(reader) or reader.op_type == "Transpose") and reader.domain == "" and len(reader.outputs) == 1:
                stack.append(reader.outputs[0])
            elif reader not in found:
                found.append(reader)
    return found


def _ancestors_from(nodes: list[ir.Node], position: dict[ir.Node, int], *, start: int) -> list[ir.Node]:
    """The members of ``nodes`` at or after position ``start`` and every node they need
    from there on, in graph order: what must move before ``start`` for ``nodes`` to run
    there."""
    found, stack = set(), [n for n in nodes if position[n] >= start]
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and position.get(producer, -1) >= start:
                stack.append(producer)
    return sorted(found, key=position.__getitem__)


def _wait_for(value: ir.Value, readers: list[ir.Node], names: NameAllocator) -> tuple[list[ir.Node], ir.Value]:
    """Nodes computing ``value`` again as a view that exists only after ``readers`` ran:
    ``Reshape(value, Where(IsNaN(sum of ReduceSum(reader output)), Shape(value), Shape(value)))``."""
    nodes = [ir.node("ReduceSum", [r.outputs[0]], {"keepdims": 0}, name=names.fresh(f"{r.name}_done")) for r in readers]
    if len(nodes) > 1:
        nodes.append(ir.node("Sum", [n.outputs[0] for n in nodes], name=names.fresh(f"{value.name}_readers_done")))
    done = nodes[-1].outputs[0]
    is_nan = ir.node("IsNaN", [done], name=names.fresh(f"{value.name}_token"))
    shape = ir.node("Shape", [value], name=names.fresh(f"{value.name}_shape"))
    # The shape whatever the condition: the Where only carries the dependency.
    same = ir.node("Where", [is_nan.outputs[0], shape.outputs[0], shape.outputs[0]], name=names.fresh(f"{value.name}_shape_after"))
    view = ir.node("Reshape", [value, same.outputs[0]], name=names.fresh(f"{value.name}_after_readers"))
    # Typed, so that the memory analyses downstream know every value's size.
    for reduction in nodes:  # the readers share one float type (_one_float_type)
        reduction.outputs[0].dtype, reduction.outputs[0].shape = readers[0].outputs[0].dtype, ir.Shape([])
    nodes += [is_nan, shape, same, view]
    for node in nodes:
        node.outputs[0].name = names.fresh(f"{node.name}_output")
    is_nan.outputs[0].dtype, is_nan.outputs[0].shape = ir.DataType.BOOL, ir.Shape([])
    rank = ir.Shape([len(value.shape)]) if value.shape is not None else None
    for node in (shape, same):
        node.outputs[0].dtype, node.outputs[0].shape = ir.DataType.INT64, rank
    view.outputs[0].dtype, view.outputs[0].shape = value.dtype, value.shape.copy() if value.shape is not None else None
    return nodes, view.outputs[0]


def _index_of(node: ir.Node, value: ir.Value) -> int:
    return next(i for i, v in enumerate(node.inputs) if v is value)
