"""Padding elimination before the loss: gather the valid label rows into SoftmaxCrossEntropyLoss.

When most labels equal ``ignore_index`` (padding, or unmasked tokens in masked-LM training)
the loss and its gradient spend most of their time on rows that contribute nothing.  This
pass computes the indices of the valid labels and gathers only those rows of the logits and
labels before the loss, so the softmax, the loss and (after the gradient build) their
gradients run on the valid rows only.  It is ORTModule's ``InsertGatherBeforeSceLoss``;
see ``docs/design/ort-facts.md``.

Which losses are worth it is decided at export: :func:`ortpass.export.density.density_probe`
measures each cross-entropy's label density on the export batch and routes sparse labels
through an identity ``FlagAndPrintDensity`` PythonOp.  That flag is this pass's hint.

Written as a plain onnx_ir pass rather than an onnxscript rewrite rule: every loss that is
*not* rewritten must be reported with the condition that failed, the match looks through
an optional Reshape and depends on graph outputs, and the flag is removed even where the
loss is skipped -- a loop over the loss nodes states that more directly than a pattern.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import onnx
import onnx_ir as ir

from ortpass.conventions import (
    CREATED_BY_KEY,
    MS_DOMAIN,
    PRINT_DENSITY_ENV,
)
from ortpass.graph.names import NameAllocator
from ortpass.infra.base import OrtPass
from ortpass.infra.registry import register_pass
from ortpass.ops.density_flag import flag_before, flag_density, is_flag
from ortpass.ops.sce_loss import (
    LABEL_TYPES,
    SCE_MIN_OPSET,
    is_sce_loss,
    sce_ignore_index,
    sce_reduction,
)

__all__ = ["VALID_DIM_PREFIX", "InsertGatherBeforeSceLossPass"]

logger = logging.getLogger(__name__)


#: Name prefix of the symbolic dim that counts the valid labels of one loss.
VALID_DIM_PREFIX = "valid_label_count_"

# ai.onnx Squeeze takes its axes as an input from opset 13 on, as an attribute before.
_SQUEEZE_AXES_AS_INPUT_OPSET = 13


@dataclasses.dataclass
class _Candidate:
    """A loss node that passed every check, with what the rewrite needs."""

    loss: ir.Node
    ignore_index: int
    flag: ir.Node | None
    # Types and shapes of the loss inputs, wherever they were found (see _TypeSource).
    logits_dtype: ir.DataType
    logits_shape: ir.Shape
    label_dtype: ir.DataType
    label_shape: ir.Shape


@register_pass("insert-gather-before-sce-loss")
class InsertGatherBeforeSceLossPass(OrtPass):
    """Gather the rows whose label is not ``ignore_index`` before a softmax cross-entropy loss.

    Rule.  A loss node ``L`` -- ai.onnx ``SoftmaxCrossEntropyLoss`` (opset 12+) or
    ``com.microsoft::SoftmaxCrossEntropyLossInternal`` -- is rewritten when all of:

    1. its label does not already come from an inserted ``ShrunkenGather`` (idempotence);
    2. its label comes from a density flag (a ``com.microsoft::PythonOp`` whose
       ``func_name`` is in :data:`FLAG_FUNC_NAMES`), directly or through one Reshape --
       unless ``force=True``;
    3. the logits have known rank 2 and the labels known rank 1;
    4. ``reduction`` is ``mean`` or ``sum`` (the loss stays a scalar whatever the row count);
    5. ``ignore_index`` is known: the attribute of the ai.onnx op, or a constant input 3 of
       the Internal op;
    6. ``log_prob`` (output 1) has no consumer and is not a graph output (its rows would be
       missing).

    The rewrite inserts ``Sub(labels, ignore_index) -> NonZero -> Squeeze(axis 0)``, the
    indices of the valid rows with a new dim ``valid_label_count_<n>``, and
    ``com.microsoft::ShrunkenGather`` (axis 0) on the logits and on the labels of ``L``.
    Mean and sum are unchanged because ignored rows contribute neither to the sum nor to
    the mean's denominator; the gradient of the ignored rows is zero either way, and ORT's
    ShrunkenGather gradient (GatherGrad) scatters zeros there.

    Every density flag in the graph is removed afterwards (its only purpose is to mark
    labels for this pass, and a PythonOp needs the torch bridge to run), except when
    ``keep_flag_for_printing`` is set or ``ORTPASS_PRINT_INPUT_DENSITY=1``: the flags then
    stay and report the density of every step when run through the torch bridge (a kept
    flag over integer labels gets ``training_mode = 0``: it needs no backward, and a
    context the bridge kept for it would never be released).  A flag whose output is a
    graph output or whose context output is used is kept.

    With ``move_above_projection=True`` the logits' gather then moves above the MatMul or
    Gemm that produces the logits, when that projection works row by row
    (:mod:`ortpass.rewrite_rules.gather_before_projection`): the vocabulary projection and
    its gradients run on the valid rows too, and the scatter that is the gather's
    gradient covers ``rows x hidden`` instead of ``rows x vocab``.  ORT did this in a
    separate upstream-gather transformer; on ORT's CPU kernels the gather before the loss
    alone costs more than it saves above ~10% density (see ``benchmarks/sce_gather.py``).

    Statistics: counts ``losses rewritten``, ``gathers inserted``, ``flags removed``,
    ``losses skipped``, ``gathers moved above the projection``; notes ``rewritten`` (node,
    op, valid dim, export density when the flag recorded one) and ``skipped`` (node, op,
    and the condition that failed).
    """

    phase = "pre-grad"
    # Shapes recorded on the flag's output keep the label's dims connected; see _TypeSource.
    runs_after = frozenset({"pythonop-shape-inference"})

    def __init__(
        self, *, force: bool = False, keep_flag_for_printing: bool | None = None, move_above_projection: bool = False
    ) -> None:
        super().__init__()
        self.force = force
        self.move_above_projection = move_above_projection
        if keep_flag_for_printing is None:
            keep_flag_for_printing = os.environ.get(PRINT_DENSITY_ENV, "0") == "1"
        self.keep_flag_for_printing = keep_flag_for_printing

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(force={self.force}, keep_flag_for_printing={self.keep_flag_for_printing}, "
            f"move_above_projection={self.move_above_projection})"
        )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        types = _TypeSource(model)
        candidates = []
        for node in graph:
            if not is_sce_loss(node, model):
                continue
            candidate, reason = self._check(node, types)
            if candidate is None:
                self.count("losses skipped")
                self.note("skipped", {"node": node.name, "op": node.op_type, "reason": reason})
                logger.debug("not rewriting %s (%s): %s", node.name, node.op_type, reason)
            else:
                candidates.append(candidate)

        # Every check is done before the first edit: a loss that cannot be rewritten has
        # already been set aside, so the edits below cannot leave a half-rewritten graph.
        # Flags go first so that the new nodes read (and are named after) the label itself.
        if self.keep_flag_for_printing:
            flags_changed = self._drop_flag_contexts(graph)
        else:
            flags_changed = self._remove_flags(graph)
        namer = _Namer(graph)
        for candidate in candidates:
            self._rewrite(model, candidate, namer)
        moved = self._move_above_projection(model) if self.move_above_projection and candidates else 0
        return ir.passes.PassResult(model, modified=bool(candidates) or flags_changed > 0 or moved > 0)

    # -- checks ---------------------------------------------------------------------------
    def _check(self, loss: ir.Node, types: _TypeSource) -> tuple[_Candidate | None, str]:
        """Return the candidate, or None and the ORT condition that failed."""
        label = loss.inputs[1]
        producer = label.producer() if label is not None else None
        if producer is not None and producer.op_type == "ShrunkenGather" and producer.domain == MS_DOMAIN:
            return None, "already rewritten: the label comes from a ShrunkenGather"
        flag = flag_before(label)
        if flag is None and not self.force:
            return None, "label is not flagged by FlagAndPrintDensity (density at export >= threshold, or not probed)"
        logits_shape = types.shape(loss.inputs[0])
        label_shape = types.shape(label)
        if label_shape is None and flag is not None and producer is flag:
            # An identity flag's input has the shape its output may not have recorded.
            label_shape = types.shape(flag.inputs[0])
        logits_rank = len(logits_shape) if logits_shape is not None else None
        label_rank = len(label_shape) if label_shape is not None else None
        if logits_shape is None or label_shape is None:
            return None, f"rank unknown (logits rank {logits_rank}, labels rank {label_rank})"
        if (logits_rank, label_rank) != (2, 1):
            return None, f"logits rank {logits_rank} and labels rank {label_rank}; needs 2 and 1"
        reduction = sce_reduction(loss)
        if reduction not in ("mean", "sum"):
            return None, f"reduction is {reduction!r}; needs 'mean' or 'sum' (the loss would change shape)"
        ignore_index, reason = sce_ignore_index(loss)
        if ignore_index is None:
            return None, reason
        log_prob = loss.outputs[1] if len(loss.outputs) > 1 else None
        if log_prob is not None and log_prob.is_graph_output():
            return None, f"log_prob {log_prob.name!r} is a graph output"
        if log_prob is not None and log_prob.uses():
            return None, f"log_prob {log_prob.name!r} is consumed by {_consumer_names(log_prob)}"
        logits_dtype = types.dtype(loss.inputs[0])
        label_dtype = types.dtype(label) or (types.dtype(flag.inputs[0]) if flag is not None else None)
        if logits_dtype is None or label_dtype is None:
            return None, f"element type unknown (logits {logits_dtype}, labels {label_dtype})"
        if label_dtype not in LABEL_TYPES:
            # The loss itself would be invalid; rewriting it would only move the failure.
            return None, f"labels are {label_dtype.name}, not INT32/INT64 class indices"
        return _Candidate(loss, ignore_index, flag, logits_dtype, logits_shape, label_dtype, label_shape), ""

    # -- rewrite --------------------------------------------------------------------------
    def _rewrite(self, model: ir.Model, candidate: _Candidate, namer: _Namer) -> None:
        graph = model.graph
        loss = candidate.loss
        logits, labels = loss.inputs[0], loss.inputs[1]
        assert logits is not None and labels is not None  # _check read their ranks
        dim = namer.dims.fresh(VALID_DIM_PREFIX, always_number=True)
        opset = model.opset_imports.get("", SCE_MIN_OPSET)
        tape = ir.tape.Tape()
        indices = _valid_indices(tape, labels, candidate, dim, opset)
        types = ((candidate.logits_dtype, candidate.logits_shape), (candidate.label_dtype, candidate.label_shape))
        for index, (value, (dtype, shape)) in enumerate(zip((logits, labels), types)):
            gathered = tape.op("ShrunkenGather", [value, indices], domain=MS_DOMAIN)
            gathered.name = f"{value.name}_valid_rows"
            gathered.dtype = dtype
            gathered.shape = _with_first_dim(shape, dim)
            loss.replace_input_with(index, gathered)
        log_prob = loss.outputs[1] if len(loss.outputs) > 1 else None
        if log_prob is not None:
            # Unused, but the gradient build reads it: its rows are now the valid rows.
            log_prob.shape = _with_first_dim(log_prob.shape, dim)
        for node in tape.nodes:
            node.outputs[0].name = namer.values.fresh(node.outputs[0].name)
            node.name = namer.nodes.fresh(f"{node.outputs[0].name}_{node.op_type}")
            node.metadata_props[CREATED_BY_KEY] = self.pass_name
        graph.insert_before(loss, tape.nodes)
        model.opset_imports.setdefault(MS_DOMAIN, 1)
        self.count("losses rewritten")
        self.count("gathers inserted", 2)
        record = {"node": loss.name, "op": loss.op_type, "valid_dim": dim}
        density = flag_density(candidate.flag) if candidate.flag is not None else None
        if density is not None:
            record["export_density"] = density
        self.note("rewritten", record)
        logger.info("gathering valid label rows before %s (%s) along %s", loss.name, loss.op_type, dim)

    def _move_above_projection(self, model: ir.Model) -> int:
        # Imported here: onnxscript's rewriter is only needed when this option is on.
        from ortpass.rewrite_rules.gather_before_projection import (
            gather_before_projection_rules,
        )

        # The rewriter copies the replaced gather's metadata (our CREATED_BY_KEY) onto the
        # nodes it creates and adds the rule's name.
        moved = gather_before_projection_rules().apply_to_model(model)
        if moved:
            self.count("gathers moved above the projection", moved)
        return moved

    def _drop_flag_contexts(self, graph: ir.Graph) -> int:
        """Set ``training_mode = 0`` on kept flags over integer labels; returns how many.

        Nothing flows back through integer labels, so the gradient build gives such a flag
        no PythonOpGrad; in training mode the torch bridge would still keep a context for
        it at every step, and nothing would ever release it.
        """
        changed = 0
        for node in graph:
            label = node.inputs[0] if is_flag(node) and node.inputs else None
            if label is None or label.dtype is None or not label.dtype.is_integer():
                continue
            if node.attributes.get_int("training_mode", 0) != 0 and not node.outputs[0].uses():
                node.attributes["training_mode"] = ir.AttrInt64("training_mode", 0)
                changed += 1
        if changed:
            self.count("kept flags set to inference mode", changed)
        return changed

    def _remove_flags(self, graph: ir.Graph) -> int:
        removed = 0
        for node in list(graph):
            if not is_flag(node):
                continue
            context, flagged = node.outputs[0], node.outputs[1]
            if flagged.is_graph_output() or context.uses() or context.is_graph_output():
                self.note("flags kept", {"node": node.name, "reason": "its output is a graph output or its context is used"})
                continue
            flagged.replace_all_uses_with(node.inputs[0])
            graph.remove(node, safe=True)
            removed += 1
        if removed:
            self.count("flags removed", removed)
        return removed


class _TypeSource:
    """Element types and shapes of values: as recorded in the graph, else ONNX-inferred.

    An exported graph often records no intermediate shapes.  Rather than skip its losses,
    ONNX shape inference runs once, on a serialized copy, the first time a shape is
    missing; the model itself is not changed.  (A shape pass in the pipeline, such as
    ``pythonop-shape-inference``, which runs before this one, makes the copy unneeded.)
    """

    def __init__(self, model: ir.Model) -> None:
        self._model = model
        self._inferred: dict[str, ir.Value] | None = None

    def shape(self, value: ir.Value | None) -> ir.Shape | None:
        if value is None or value.shape is not None:
            return value.shape if value is not None else None
        inferred = self._lookup(value)
        return inferred.shape if inferred is not None else None

    def dtype(self, value: ir.Value | None) -> ir.DataType | None:
        if value is None or value.dtype is not None:
            return value.dtype if value is not None else None
        inferred = self._lookup(value)
        return inferred.dtype if inferred is not None else None

    def _lookup(self, value: ir.Value) -> ir.Value | None:
        if self._inferred is None:
            self._inferred = _infer_copy(self._model)
        return self._inferred.get(value.name or "")


def _infer_copy(model: ir.Model) -> dict[str, ir.Value]:
    try:
        proto = onnx.shape_inference.infer_shapes(ir.to_proto(model), strict_mode=False)
    except Exception as exc:  # onnx raises several types; an unknown shape is the outcome
        logger.debug("ONNX shape inference failed (%s); shapes not in the graph stay unknown", exc)
        return {}
    graph = ir.from_proto(proto).graph
    return {out.name: out for node in graph for out in node.outputs if out.name}


def _valid_indices(tape: ir.tape.Tape, labels: ir.Value, candidate: _Candidate, dim: str, opset: int) -> ir.Value:
    """``Squeeze(NonZero(labels - ignore_index), axis 0)``: positions of the valid labels."""
    # A fresh constant in the labels' own dtype: the Internal op's ignore_index input is
    # int64 even when the labels are int32, and Sub needs both operands alike.
    scalar = np.array(candidate.ignore_index, dtype=candidate.label_dtype.numpy())
    ignore = tape.op("Constant", [], {"value": ir.tensor(scalar)})
    ignore.name = f"{labels.name}_ignore_index"
    offset = tape.op("Sub", [labels, ignore])
    offset.name = f"{labels.name}_minus_ignore_index"
    nonzero = tape.op("NonZero", [offset])
    nonzero.name = f"{labels.name}_valid_positions"
    if opset >= _SQUEEZE_AXES_AS_INPUT_OPSET:
        axes = tape.op("Constant", [], {"value": ir.tensor(np.array([0], dtype=np.int64))})
        axes.name = f"{labels.name}_axis0"
        indices = tape.op("Squeeze", [nonzero, axes])
    else:
        indices = tape.op("Squeeze", [nonzero], {"axes": [0]})
    indices.name = f"{labels.name}_valid_indices"
    ignore.dtype, ignore.shape = candidate.label_dtype, ir.Shape([])
    offset.dtype, offset.shape = candidate.label_dtype, candidate.label_shape
    nonzero.dtype, nonzero.shape = ir.DataType.INT64, ir.Shape([1, dim])
    indices.dtype, indices.shape = ir.DataType.INT64, ir.Shape([dim])
    return indices


def _with_first_dim(shape: ir.Shape | None, dim: str) -> ir.Shape | None:
    if shape is None:
        return None
    return ir.Shape([dim, *list(shape)[1:]])


def _consumer_names(value: ir.Value) -> list[str]:
    return sorted({use.node.name or use.node.op_type for use in value.uses()})


class _Namer:
    """Fresh value, node and dim names for one graph (new names must not shadow old ones)."""

    def __init__(self, graph: ir.Graph) -> None:
        values = [*graph.inputs, *graph.initializers.values()]
        values += [out for node in graph for out in node.outputs]
        self.values = NameAllocator(v.name for v in values if v.name)
        self.nodes = NameAllocator(node.name for node in graph if node.name)
        self.dims = NameAllocator(
            str(d.value) for v in values for d in (v.shape or ()) if isinstance(d, ir.SymbolicDim) and d.value is not None
        )
