"""Never hold the full logits: compute the LM head and its softmax cross-entropy one slice of
the vocabulary at a time, in forward and in backward.

At a real vocabulary the logits dominate a language model's step: GPT-2's (vocabulary
50257) are 196 MiB at batch 2 x 512, LLaMA-3's (128256) 501 MiB, and the loss's log
probabilities and the logits' gradient are as large again.  Recompute per layer cannot
touch them.  This pass replaces the head projection, the loss and their gradients with the
chunked loss of :mod:`ortpass.ops.chunked_cross_entropy` (ai.onnx ops only, so it runs on
stock onnxruntime too): ``rows x chunk`` logits at a time, the vocabulary's slices
recomputed in backward.  The same idea as Liger-Kernel's fused linear cross-entropy and
Cut Cross-Entropy, written as a graph rewrite.

Rule.  A ``SoftmaxCrossEntropyLoss`` (ai.onnx, or ORT's ``...Internal``), or the torch
builder's ``LogSoftmax`` chain for the same loss (:mod:`ortpass.ops.torch_nll_loss`), ``L``
whose loss is the training graph's loss is rewritten when all of:

1. ``reduction`` is ``mean`` or ``sum``, there are no class weights, ``ignore_index`` is known;
2. its logits come from ``MatMul(h, B)`` or ``Gemm(h, B[, c])`` (no ``transA``, alpha and
   beta 1), with or without an ``Add`` of a bias (a weight, ``V`` or ``1 x V``), through
   one or more ``Reshape`` to rows x vocabulary, then at most one ``ShrunkenGather`` of the
   rows whose label is not ignored (``insert-gather-before-sce-loss``); ``B`` is
   ``Transpose(W)`` (read by nothing else in forward) or a weight itself; the weight's
   shape is static;
3. the log probabilities are read by nothing but backward;
4. the vocabulary is wider than one chunk;
5. the backward nodes that compute from the loss's gradient and the region's values (with
   the head's inputs and constants) hand exactly the gradients of ``h``, of the weight and
   of the bias (those that train) to the rest of the graph.

Those forward and backward nodes are removed; the chunked loss's values take their
readers (graph outputs keep their names).  When the graph returns the logits (Hugging
Face's output carries them) or a forward node reads them, the head stays: the logits are
computed whole anyway, and the chunked loss slices them instead of computing them again.
They are then alive from the head through all of backward (one ORT run computes both).
With ``logits_last=True``, where no forward node reads them, the loss is chunked from the
hidden rows as if they were not returned, and the returned logits are computed again by
one product that nothing reads, which ORT's default order runs after backward: the step
holds the full logits only at its end, for two more head products than slicing them.
Gathered rows are gathered by the chunked loss itself (from the hidden rows, or from each
slice of the kept logits), and their gradient scattered back into the other rows' zeros.
Runs after the gradient build and before ``accumulate-gradients-early`` (a tied weight's
head part is then the slices' concatenation) and ``recompute``.  Statistics: ``losses chunked``, ``losses skipped``;
notes ``chunked`` (loss, vocabulary, slices, chunk, returned_logits), ``skipped`` (loss, reason).

Width.  Without a ``chunk``, a slice holds :data:`DEFAULT_CHUNK_BYTES` of logits.  With a
memory ``budget`` in bytes, where recompute could not meet the budget at that width, the
returned logits are computed after backward first (as ``logits_last``, where the graph
returns them sliced), then the width is halved (from the narrower of it and the
vocabulary, down to 256 columns) until recompute can
(:mod:`ortpass.analysis.chunk_width`).  A fraction is relative to the graph's
own peaks, which every width meets: it keeps the default.
"""

from __future__ import annotations

import dataclasses
import logging

import onnx_ir as ir

from ortpass.analysis.recompute.budget import parse_budget
from ortpass.analysis.chunk_width import DEFAULT_CHUNK_BYTES, default_columns, halved, halvings_for_budget
from ortpass.analysis.partition import (
    TrainingInfo,
    get_training_info,
    is_backward,
    is_training_graph,
    tag,
)
from ortpass.analysis.region_gradients import (
    RegionGradientError,
    gradients_handed_on,
    region_backward,
)
from ortpass.errors import PlanError
from ortpass.graph.names import NameAllocator
from ortpass.infra.base import OrtPass
from ortpass.infra.metadata import get_export_info
from ortpass.infra.registry import register_pass
from ortpass.ops.chunked_cross_entropy import HeadLoss, write_chunked_loss
from ortpass.ops.lm_head import head_of, only_returned, reshapes_above, returned_logits, returned_shape_source
from ortpass.ops.loss_side import LossSide, UnsupportedLoss, loss_side
from ortpass.ops.sce_loss import LABEL_TYPES

__all__ = ["DEFAULT_CHUNK_BYTES", "ChunkLmHeadLossPass"]

logger = logging.getLogger(__name__)

_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE})


class _Skip(UnsupportedLoss):
    """A loss that is not rewritten, and why."""


@dataclasses.dataclass
class _Match:
    loss: ir.Node
    region: list[ir.Node]  # forward: [Transpose], head, [bias Add], Reshapes, the loss side (LossSide.nodes)
    removed: list[ir.Node]  # the region's nodes the rewrite removes: all, or the loss alone when the logits are kept
    backward: list[ir.Node]  # the loss's backward, in graph order
    head: HeadLoss
    chunk: int
    hidden_3d: ir.Value | None  # the head's input when it is not already rows x hidden
    hidden_grad: ir.Value  # the gradient of the head's input, as the builder wrote it
    weight_grad: ir.Value | None
    bias_grad: ir.Value | None
    returned: list[ir.Value]  # with logits_last: the logits the graph returns, computed again after backward


@register_pass("chunk-lm-head-loss")
class ChunkLmHeadLossPass(OrtPass):
    """Replace the LM head, its softmax cross-entropy and their gradients by a loss computed
    one vocabulary slice at a time (see the module docstring for the rule).

    ``chunk``: the slice width in vocabulary columns; default: as many columns as make
    :data:`DEFAULT_CHUNK_BYTES` of logits at the graph's row count (symbolic rows counted
    at the export's dims; 8192 when there are none), a multiple of 256.  ``budget``: the
    step's memory budget, as ``recompute(budget=...)`` takes it; in bytes, the default
    width narrows where recompute could not meet it otherwise (module docstring).  A
    ``budget`` note says which width was chosen and why.  ``logits_last``: compute the
    logits the graph returns after backward rather than slicing them for the loss (module
    docstring); each ``chunked`` note says which the returned logits got.
    """

    phase = "post-grad"
    runs_before = frozenset({"accumulate-gradients-early", "recompute"})

    def __init__(
        self, *, chunk: int | None = None, budget: int | float | str | None = None, logits_last: bool = False
    ) -> None:
        super().__init__()
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be a positive number of vocabulary columns, got {chunk}")
        if chunk is not None and budget is not None:
            raise PlanError(f"give chunk= or budget=, not both: the budget chooses the width (got chunk={chunk}, budget={budget!r})")
        self.chunk = chunk
        self.budget = budget
        self.logits_last = logits_last
        self._target = parse_budget(budget) if budget is not None else None
        self._halvings = 0  # of the default width (chunk_width.halved)
        self._last = logits_last  # this call's: a budget may turn it on

    def __repr__(self) -> str:
        budget = "" if self.budget is None else f", budget={self.budget!r}"
        last = ", logits_last=True" if self.logits_last else ""
        return f"ChunkLmHeadLossPass(chunk={self.chunk}{budget}{last})"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not is_training_graph(model):
            return ir.passes.PassResult(model, modified=False)
        self._last = self.logits_last
        if self._target is not None and self._target[0] == "bytes":
            self._choose_for_budget(model, int(self._target[1]))
        matches = self._matches(model)
        for match in matches:  # every check passed before the first edit
            self._rewrite(model, match)
        return ir.passes.PassResult(model, modified=bool(matches))

    def _matches(self, model: ir.Model) -> list[_Match]:
        info, matches = get_training_info(model), []
        for node in model.graph:
            try:
                side = loss_side(node, model, info.loss)
                if side is not None:
                    matches.append(self._match(model, side, info))
            except UnsupportedLoss as why:
                self.count("losses skipped")
                self.note("skipped", {"loss": node.name, "reason": str(why)})
                logger.debug("not chunking %s: %s", node.name, why)
        return matches

    def _choose_for_budget(self, model: ir.Model, target: int) -> None:
        """The fewest halvings of the default width at which recompute can meet ``target``;
        where it cannot at the default width with the returned logits sliced, they are
        computed after backward (``logits_last``) before any halving."""

        def chunking(last: bool):
            def chunk_at(halvings: int) -> tuple[ir.Model, list[int]]:
                trial = ChunkLmHeadLossPass(logits_last=last)
                trial._halvings = halvings
                chunked = trial(model.clone()).model
                return chunked, [note["chunk"] for note in trial.stats.get("notes", {}).get("chunked", [])]

            return chunk_at

        choice = halvings_for_budget(chunking(self._last), target, stop=0)
        if choice.lowest_peak_bytes is not None and choice.lowest_peak_bytes > target:
            if not self._last and _computes_returned_logits_last(model):
                self._last = True
                choice = halvings_for_budget(chunking(True), target)
            else:
                choice = halvings_for_budget(chunking(self._last), target, start=1)
        self.note("budget", {"target_bytes": target, **choice.to_dict(), "logits_last": self._last})
        self._halvings = choice.halvings

    # -- matching ---------------------------------------------------------------------------
    def _match(self, model: ir.Model, side: LossSide, info: TrainingInfo) -> _Match:
        loss, logits_rows, labels, row_indices = side.loss, side.logits, side.labels, side.row_indices
        if labels is None or labels.dtype not in LABEL_TYPES or labels.shape is None or labels.shape.rank() != 1:
            raise _Skip("labels are not a rank-1 tensor of class indices")
        if logits_rows.shape is None or logits_rows.shape.rank() != 2:
            raise _Skip("the loss's logits are not rank 2 with a known shape")
        reshapes, chain = reshapes_above(logits_rows)
        logits = chain[-1]
        head, bias_add, bias, inner = head_of(logits)
        hidden, projection = head.inputs[0], head.inputs[1]
        weight, rows_are_vocab, transpose = self._weight_of(head, projection)
        if weight.shape is None or not weight.shape.is_static() or weight.shape.rank() != 2:
            raise _Skip("the head weight's shape is not static and rank 2")
        vocab = weight.shape[0 if rows_are_vocab else 1]
        dtype = hidden.dtype if hidden is not None else None
        if dtype not in _FLOAT_TYPES or weight.dtype != dtype or (bias is not None and bias.dtype != dtype):
            raise _Skip(f"the head computes in {dtype}; float32 and float64 are handled")
        if bias is not None and (bias.shape is None or list(bias.shape) not in ([vocab], [1, vocab])):
            raise _Skip("the head's bias is not one value per vocabulary entry")
        if hidden.shape is None or (hidden.shape.rank() != 2 and not reshapes):
            raise _Skip("the head's input is not rows x hidden and no Reshape flattens the logits")
        if logits_rows.shape[1] != vocab:
            raise _Skip(f"the loss's logits have {logits_rows.shape[1]} columns, not the head's vocabulary {vocab}")
        rows = logits_rows.shape[0]
        chunk = self.chunk or halved(default_columns(rows, dtype, get_export_info(model).get("dims")), vocab, self._halvings)
        if vocab <= chunk:
            raise _Skip(f"vocabulary {vocab} fits one chunk of {chunk} columns")
        region = [n for n in (transpose, head) if n is not None] + inner + ([bias_add] if bias_add is not None else []) + reshapes + side.nodes
        kept = returned_logits(region, chain)
        last = bool(kept) and self._last and only_returned(kept, region, hidden, vocab, bias is not None)
        seed = _value_named(model.graph, info.loss_gradient)  # _loss_settings checked info.loss
        if seed is None:
            raise _Skip(f"the loss's gradient {info.loss_gradient} is not in the graph")
        operands = [v for v in (hidden, weight, bias) if v is not None]
        try:
            boundary = {*operands, labels} | ({row_indices} if row_indices is not None else set())
            backward = region_backward(model.graph, region, seed, boundary, operands)
            handed = gradients_handed_on(region, backward, operands, kept)
        except RegionGradientError as why:
            raise _Skip(str(why)) from None
        loss_head = HeadLoss(
            hidden=hidden, rows=rows, weight=weight, weight_rows_are_vocab=rows_are_vocab, vocab=vocab, labels=labels,
            ignore_index=side.ignore_index, reduction=side.reduction, loss_grad=seed, dtype=dtype, bias=bias,
            bias_trains=handed[2] is not None, logits=logits_rows if kept and not last else None,
            row_indices=row_indices,
        )  # fmt: skip
        removed = side.nodes if kept and not last else region
        returned = [v for v in chain if v.is_graph_output()] if last else []
        return _Match(loss, region, removed, backward, loss_head, chunk, hidden if hidden.shape.rank() != 2 else None,
                      *handed, returned=returned)

    @staticmethod
    def _weight_of(head: ir.Node, projection: ir.Value | None) -> tuple[ir.Value, bool, ir.Node | None]:
        """The head weight, whether its rows are the vocabulary, and the Transpose between."""
        if projection is None:
            raise _Skip("the head has no weight input")
        trans_b = head.attributes.get_int("transB", 0) if head.op_type == "Gemm" else 0
        producer = projection.producer()
        if trans_b == 0 and producer is not None and producer.op_type == "Transpose":
            perm = producer.attributes.get_ints("perm", None)
            perm = None if perm is None else list(perm)
            forward_readers = [n for n, _ in projection.uses() if not is_backward(n)]
            if perm in (None, [1, 0]) and forward_readers == [head] and not projection.is_graph_output():
                return producer.inputs[0], True, producer
        return projection, bool(trans_b), None

    # -- rewriting --------------------------------------------------------------------------
    def _rewrite(self, model: ir.Model, match: _Match) -> None:
        graph, head = model.graph, match.head
        names = NameAllocator.of_graph(graph)
        prefix = names.fresh(f"{match.loss.name or 'loss'}_chunked")
        forward, backward = _NodeWriter(names, prefix, "forward"), _NodeWriter(names, prefix, "backward")
        hidden_size = head.weight.shape[1 if head.weight_rows_are_vocab else 0]
        if match.hidden_3d is not None:
            rows = forward.reshape(match.hidden_3d, forward.ints([-1, hidden_size]), [head.rows, hidden_size], head.dtype, "rows")
            head = dataclasses.replace(head, hidden=rows)
        if head.bias is not None and head.bias.shape.rank() == 2:
            head = dataclasses.replace(head, bias=forward.reshape(head.bias, forward.ints([head.vocab]), [head.vocab], head.dtype, "bias_flat"))
        chunk = match.chunk
        written = write_chunked_loss(head, chunk, names, prefix=prefix, opset=model.opset_imports.get("", 17))
        returned = [(old, _logits_again(forward, head, match.hidden_3d, old)) for old in match.returned]
        if any(new.producer().op_type == "FusedMatMul" for _, new in returned):
            model.opset_imports.setdefault("com.microsoft", 1)
        hidden_grad, bias_grad = written.hidden_grad, written.bias_grad
        if match.hidden_3d is not None:
            shape_of = backward.add(ir.node("Shape", [match.hidden_3d]), "hidden_shape")
            shape_of.shape, shape_of.dtype = ir.Shape([match.hidden_3d.shape.rank()]), ir.DataType.INT64
            hidden_grad = backward.reshape(hidden_grad, shape_of, match.hidden_3d.shape, head.dtype, "hidden_grad_3d")
        if match.bias_grad is not None and bias_grad is not None:
            bias_grad = backward.reshape(bias_grad, backward.ints(list(match.bias_grad.shape)), match.bias_grad.shape, head.dtype, "bias_grad_as_bias")
        # Backward goes where the loss's backward starts after the loss (the builder writes
        # some of its Shape reads among the forward nodes).
        position = {node: i for i, node in enumerate(graph)}
        start = next(n for n in match.backward if position[n] > position[match.loss])
        graph.insert_before(match.loss, [*forward.nodes, *written.forward])
        graph.insert_before(start, [*written.backward, *backward.nodes])
        for old, new in ((match.loss.outputs[0], written.loss), (match.hidden_grad, hidden_grad),
                         (match.weight_grad, written.weight_grad), (match.bias_grad, bias_grad), *returned):  # fmt: skip
            if old is not None:
                _take_over(old, new)
        _remove_with_feeders(graph, [*match.backward, *reversed(match.removed)])
        self.count("losses chunked")
        slices = -(-head.vocab // chunk)
        logits = "computed after backward" if match.returned else "sliced" if head.logits is not None else "not returned"
        self.note("chunked", {"loss": match.loss.name, "vocab": head.vocab, "slices": slices, "chunk": chunk,
                              "returned_logits": logits})
        logger.info("%s: the head and loss run in %d vocabulary slices of %d (returned logits: %s)",
                    match.loss.name, slices, chunk, logits)


def _logits_again(forward: _NodeWriter, head: HeadLoss, hidden_3d: ir.Value | None, returned: ir.Value) -> ir.Value:
    """The returned logits again, by one product in ``returned``'s shape: no Transpose for ORT
    to fuse into a new node, which its default order would run early, and no view after it,
    which ORT would copy (a graph output).  A forward leaf that nothing reads, before the
    loss in graph order: ORT's default order takes leaves from the last one down."""
    source = returned_shape_source(returned, hidden_3d if hidden_3d is not None else head.hidden, head.vocab)
    trans_b = 1 if head.weight_rows_are_vocab else 0
    if source == "rows":
        inputs = [head.hidden, head.weight] + ([head.bias] if head.bias is not None else [])
        logits = forward.add(ir.node("Gemm", inputs, {"transB": trans_b}), "logits_again")
        logits.shape, logits.dtype = ir.Shape([head.rows, head.vocab]), head.dtype
        return logits
    hidden = hidden_3d
    if source == "reshape":  # the builder's rows, viewed with its logits' leading dims
        size = head.weight.shape[1 if head.weight_rows_are_vocab else 0]
        dims = returned.producer().inputs[1]
        leading = forward.add(ir.node("Slice", [dims, forward.ints([0]), forward.ints([-1])]), "logits_leading")
        shape = forward.add(ir.node("Concat", [leading, forward.ints([size])], {"axis": 0}), "hidden_dims")
        hidden = forward.reshape(head.hidden, shape, [*returned.shape[:-1], size], head.dtype, "hidden_again")
    if trans_b:  # com.microsoft's MatMul with transB: stock onnxruntime has it too
        product = ir.node("FusedMatMul", [hidden, head.weight], {"transB": 1, "alpha": 1.0}, domain="com.microsoft")
    else:
        product = ir.node("MatMul", [hidden, head.weight])
    logits = forward.add(product, "logits_again")
    logits.shape, logits.dtype = returned.shape.copy(), head.dtype
    return logits


def _computes_returned_logits_last(model: ir.Model) -> bool:
    """Whether ``logits_last`` would compute some loss's returned logits after backward,
    at any slice width (matching only: the graph is not changed)."""
    return any(match.returned for match in ChunkLmHeadLossPass(chunk=1, logits_last=True)._matches(model))


class _NodeWriter:
    """The few nodes around the chunked loss that reshape its inputs and gradients."""

    def __init__(self, names: NameAllocator, prefix: str, side: str) -> None:
        self.names, self.prefix, self.side = names, prefix, side
        self.nodes: list[ir.Node] = []

    def add(self, node: ir.Node, name: str) -> ir.Value:
        node.name = self.names.fresh(f"{self.prefix}/{name}")
        node.outputs[0].name = self.names.fresh(f"{node.name}_output")
        self.nodes.append(tag(node, self.side))  # type: ignore[arg-type]
        return node.outputs[0]

    def ints(self, values: list[int]) -> ir.Value:
        return self.add(ir.node("Constant", [], {"value": ir.tensor(values, dtype=ir.DataType.INT64)}), "shape")

    def reshape(self, x: ir.Value, shape: ir.Value, dims, dtype: ir.DataType, name: str) -> ir.Value:
        out = self.add(ir.node("Reshape", [x, shape]), name)
        out.shape, out.dtype = ir.Shape(list(dims)), dtype
        return out


def _value_named(graph: ir.Graph, name: str) -> ir.Value | None:
    for value in graph.inputs:
        if value.name == name:
            return value
    if name in graph.initializers:
        return graph.initializers[name]
    for node in graph:
        for out in node.outputs:
            if out.name == name:
                return out
    return None


def _take_over(old: ir.Value, new: ir.Value) -> None:
    """``new`` takes ``old``'s readers, and its place and name among the graph outputs."""
    was_output, name = old.is_graph_output(), old.name
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    if was_output:
        old.name = None
        new.name = name


def _remove_with_feeders(graph: ir.Graph, removed: list[ir.Node]) -> None:
    """Remove ``removed``, then what fed only them (the Reshapes the builder wrote from the
    head's input for the old gradients), walking up from their inputs."""
    frontier = [v.producer() for node in removed for v in node.inputs if v is not None]
    graph.remove(removed, safe=True)
    while frontier:
        node = frontier.pop()
        if node is None or node.graph is not graph:
            continue
        if any(out.uses() or out.is_graph_output() for out in node.outputs):
            continue
        frontier.extend(v.producer() for v in node.inputs if v is not None)
        graph.remove(node, safe=True)
