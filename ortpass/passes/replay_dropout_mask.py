"""Compute a Dropout's gradient by drawing its mask again instead of keeping it.

ORT's gradient of ``Y, mask = Dropout(X, ratio, training_mode)`` is
``dX = DropoutGrad(dY, mask, ratio, training_mode)`` = ``dY * mask / (1 - ratio)``, so the
mask (one byte per element) stays alive from forward to backward.  A Dropout with a
``seed`` attribute owns a generator that starts from that seed and advances once per step,
and its mask does not depend on the input's values, only on its element count.  A second
Dropout with the same seed, the same ratio and the same element count therefore draws the
very same mask at every step, and ``Dropout(dY)`` multiplies by it and scales by
``1 / (1 - ratio)``: it *is* the gradient.  Measured bitwise equal to DropoutGrad on ORT
1.19.2's CPU kernels over several steps (tests/test_replay_dropout_mask.py).

With every reader of the mask replayed, the forward Dropout stops producing its mask:
ORT never frees an output nobody reads until the step ends, so leaving it would save
nothing.  The price is drawing the random numbers a second time, in backward.

Only masks a forward Dropout produces are replayed: those live from forward to backward.
A mask drawn by a recompute clone is already drawn in backward, next to its reader, and
replaying it would only draw it a third time; so the pass runs after ``recompute``.  On
the GPT decoder of benchmarks/recompute_memory.py, after recompute level 1, what is left
to replay is each layer's last Dropout, whose mask recompute keeps (1 MiB per layer at
hidden 256, batch 8 x 512); without recompute it is every Dropout (the attention
probabilities' masks are 8 MiB per layer there).

Where the forward Dropout is not the one drawing the mask (BiasDropout,
BitmaskDropout: other kernels that may map random numbers to elements differently) the
rewrite is not made.  For the same reason ``TrainingSession`` disables ORT's CUDA fusions
that would turn the forward Dropout into such a kernel after the rewrite
(``REPLAY_DISABLED_ORT_OPTIMIZERS``).  Only ORT's CPU kernels were checked here: no GPU was
available.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from ortpass.analysis.partition import is_backward, tag
from ortpass.conventions import MS_DOMAIN, REPLAY_OF_KEY, is_onnx_domain
from ortpass.infra.base import OrtPass
from ortpass.infra.registry import register_pass
from ortpass.ops.dropout import dropout_seed

__all__ = [ "ReplayDropoutMaskPass"]

logger = logging.getLogger(__name__)


def _is_onnx_dropout(node: ir.Node | None) -> bool:
    return node is not None and node.op_type == "Dropout" and is_onnx_domain(node.domain)


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if index < len(node.inputs) else None


def _forward_dropout(grad: ir.Node) -> ir.Node | None:
    """The forward ai.onnx Dropout whose mask ``grad`` (a DropoutGrad) reads, when replaying
    it draws the same mask: the same ratio and training_mode values as the forward node."""
    mask = _input(grad, 1)
    dropout = mask.producer() if mask is not None else None
    if not _is_onnx_dropout(dropout) or mask.index() != 1:
        return None
    if is_backward(dropout):  # a recompute clone
        return None
    if _input(grad, 2) is not _input(dropout, 1) or _input(grad, 3) is not _input(dropout, 2):
        return None
    return dropout


@register_pass("replay-dropout-mask")
class ReplayDropoutMaskPass(OrtPass):
    """Replace each DropoutGrad by a Dropout of the incoming gradient that draws the forward mask again.

    Rule: ``dX = com.microsoft::DropoutGrad(dY, M, ratio, mode)`` where ``M`` is output 1 of
    ``Y, M = Dropout(X, ratio, mode)`` (ai.onnx, the same ``ratio`` and ``mode`` values)
    becomes ``dX = Dropout(dY, ratio, mode)`` with the forward Dropout's ``seed``; a
    forward Dropout without a seed first gets :func:`dropout_seed`'s (plus ``base_seed``).
    A forward Dropout whose mask nobody reads any more stops producing it.  Each replay
    is tagged backward and records the forward node under ``REPLAY_OF_KEY``.

    The mask's producer must be on the forward side (a recompute clone's mask is drawn
    next to its reader already), so the pass runs after ``recompute``.  Statistics:
    ``gradients replayed``, ``dropouts seeded``, ``masks dropped``.
    """

    phase = "post-grad"
    shapes_step_memory = True
    runs_after = frozenset({"recompute"})

    def __init__(self, *, base_seed: int = 0) -> None:
        super().__init__()
        self.base_seed = int(base_seed)

    def __repr__(self) -> str:
        return f"ReplayDropoutMaskPass(base_seed={self.base_seed})"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        pairs = [
            (grad, dropout)
            for grad in graph
            if grad.op_type == "DropoutGrad" and grad.domain == MS_DOMAIN
            and (dropout := _forward_dropout(grad)) is not None
        ]
        for grad, dropout in pairs:
            self._replay(graph, grad, self._seed_of(dropout))
        # One removal for all: Graph.remove copies the graph's outputs on every call.
        graph.remove([grad for grad, _ in pairs], safe=True)
        for dropout in {id(d): d for _, d in pairs}.values():
            self._drop_unread_mask(dropout)
        return ir.passes.PassResult(model, modified=bool(pairs))

    def _seed_of(self, dropout: ir.Node) -> int:
        attr = dropout.attributes.get("seed")
        if attr is not None:
            return attr.as_int()
        seed = dropout_seed(dropout, self.base_seed)
        dropout.attributes["seed"] = ir.AttrInt64("seed", seed)
        self.count("dropouts seeded")
        return seed

    def _replay(self, graph: ir.Graph, grad: ir.Node, seed: int) -> None:
        forward = grad.inputs[1].producer()
        inputs = [grad.inputs[0], _input(grad, 2), _input(grad, 3)]
        while inputs[-1] is None:  # omitted trailing optionals: ratio 0.5, training_mode false
            inputs.pop()
        replay = ir.Node(
            "",
            "Dropout",
            inputs,
            attributes=[ir.AttrInt64("seed", seed)],
            name=f"{grad.name}_replay" if grad.name else None,
            num_outputs=1,
        )
        tag(replay, "backward")
        replay.metadata_props[REPLAY_OF_KEY] = forward.name or ""
        # Takes over the gradient's name, type, shape and readers (graph outputs included);
        # the caller removes the gradient.
        gradient, replayed = grad.outputs[0], replay.outputs[0]
        replayed.name, replayed.type, replayed.shape = gradient.name, gradient.type, gradient.shape
        ir.convenience.replace_all_uses_with(gradient, replayed, replace_graph_outputs=True)
        graph.insert_after(grad, replay)
        self.count("gradients replayed")
        logger.debug("replayed %s with %s (seed %d)", grad.name, replay.name, seed)

    def _drop_unread_mask(self, dropout: ir.Node) -> None:
        if len(dropout.outputs) < 2:
            return
        mask = dropout.outputs[1]
        if mask.uses() or mask.is_graph_output():
            return
        dropout.resize_outputs(1)
        self.count("masks dropped")
