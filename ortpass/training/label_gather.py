"""The label gather before the loss, on the torch builder: sparse-label cross-entropy
computed over the valid rows only, written into the trace before AOTAutograd runs.

Rule.  A cross-entropy call (``nn.CrossEntropyLoss``, ``F.cross_entropy``, anything
ending in torch's one builtin) whose labels' density on the example batch,
``count(label != ignore_index) / numel * 100``, is under the threshold (ORTModule's 90%,
``ortpass.export.density.DEFAULT_THRESHOLD``), is traced as::

    rows = nonzero(labels.flatten() != ignore_index).squeeze(1)
    cross_entropy(logits_2d.index_select(0, rows), labels.flatten().index_select(0, rows), ...)

with the call's own weight, reduction, ignore_index and label smoothing.  The sum and the
mean are unchanged: an ignored row adds nothing to the sum, nor (its weight) to the mean's
denominator, with class weights and with label smoothing alike; and its gradient is zero
either way.  AOTAutograd then writes the backward of what was traced: log-softmax, loss
and their gradients run over ``valid`` rows, and the gradient of the logits is scattered
back (``index_select``'s backward).  The row count is data-dependent (an unbacked
symbol of torch.export, a ``NonZero`` in ONNX), so each step's batch may have any number
of valid labels, none included: a mean over none is NaN, as in torch.

It is ``insert-gather-before-sce-loss`` of ORT's path, done on the torch side because the
torch builder has no forward ONNX graph to run a pre-grad pass on; see
``docs/design/label-gather-torch-builder.md``.

Left ungathered, with the reason logged: ``reduction="none"`` (the output has one loss per
row, so fewer rows would change it), a target of class probabilities (no ignore_index),
unbatched input (one label), and a call the example run did not measure.

:class:`LabelGather` works in two phases of one build: :meth:`LabelGather.measured` runs the
builder's eager probe forward with every call's labels measured (real data), and
:meth:`LabelGather.traced` runs the trace with the k-th call gathered when the k-th
measured call was flagged.  If the trace fails with a gather in it, it runs once more
without: the build then gives the graph it gave before this existed, and says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

import onnx_ir as ir
import torch

from ortpass.errors import ExportError
from ortpass.export.density import (
    DEFAULT_THRESHOLD,
    DensityRecord,
    cross_entropy_replaced,
    measure_labels,
    track_loss_modules,
)
from ortpass.infra.metadata import get_export_info, update_export_info

__all__ = ["DEFAULT_THRESHOLD", "VALID_DIM_PREFIX", "GatheredLoss", "LabelGather", "gathered_losses"]

logger = logging.getLogger(__name__)

#: Name given to the data-dependent row count of each gathered loss in the graph (as
#: ``insert-gather-before-sce-loss`` names its dim): ``valid_label_count_<k>``.
VALID_DIM_PREFIX = "valid_label_count_"

_FUNCTIONAL = "F.cross_entropy"
# torch's Reduction enum, as the builtin receives it.
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
# torch.export's name for a data-dependent size: u0, u1...
_UNBACKED = re.compile(r"^u\d+$")

# Ops whose output has their one input's dims.
_ELEMENTWISE = frozenset({"Cast", "Not", "Neg", "Identity", "Abs", "Exp", "Log", "Sign"})

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class GatheredLoss:
    """One cross-entropy call traced over its valid rows: where it was (``site``), its
    labels' density at export, and the name of its row-count dim in the graph (None when
    the graph does not show it)."""

    site: str
    ignore_index: int
    valid: int
    total: int
    density: float
    reduction: str
    dim: str | None = None


class LabelGather:
    """Measure the losses' labels in the probe forward, gather the sparse ones in the trace.

    ``threshold`` None turns it off (both phases run the module as it is).
    """

    def __init__(self, module: torch.nn.Module, threshold: float | None = DEFAULT_THRESHOLD) -> None:
        if threshold is not None and not 0.0 <= threshold <= 100.0:
            raise ValueError(f"density threshold is a percentage in [0, 100], got {threshold}")
        self.module, self.threshold = module, threshold
        self.records: list[DensityRecord] = []  # one per call of the probe forward
        self.reductions: list[int] = []
        self.gathered: list[GatheredLoss] = []
        self._traced_calls = 0

    # -- phase 1: the eager probe forward -----------------------------------------------
    def measured(self, run: Callable[..., T], *args: Any) -> T:
        """``run(*args)`` (the builder's eager forward) with every cross-entropy's labels measured."""
        if self.threshold is None:
            return run(*args)
        sites: list[str] = []

        def make(original: Callable) -> Callable:
            def cross_entropy_loss(input, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
                site = sites[-1] if sites else _FUNCTIONAL
                self.records.append(measure_labels(target, int(ignore_index), self.threshold, site))
                self.reductions.append(int(reduction))
                return original(input, target, weight, reduction, ignore_index, label_smoothing)

            return cross_entropy_loss

        with contextlib.ExitStack() as stack:
            if not self._replaced(stack, make):
                self.records = []  # nothing measured: nothing gathered
                return run(*args)
            for handle in track_loss_modules(self.module, sites):
                stack.callback(handle.remove)
            return run(*args)

    # -- phase 2: the trace --------------------------------------------------------------
    def traced(self, run: Callable[..., T], *args: Any) -> T:
        """``run(*args)`` (the builder's trace) with the flagged calls gathered; again without
        any gather if that trace fails."""
        if not any(r.flagged for r in self.records):
            self._log_kept()
            return run(*args)
        self._traced_calls = 0
        try:
            with contextlib.ExitStack() as stack:
                if not self._replaced(stack, self._gathering):
                    return run(*args)
                result = run(*args)
        except Exception as exc:
            if not self.gathered:
                raise
            logger.warning(
                "the trace with the label gather before %s failed (%s); tracing again without it",
                [g.site for g in self.gathered], exc,
            )  # fmt: skip
            self.gathered = []
            return run(*args)
        self._log_kept()
        return result

    @staticmethod
    def _replaced(stack: contextlib.ExitStack, make: Callable[[Callable], Callable]) -> bool:
        """Replace cross-entropy for the stack's block; False when another probe holds it
        (another thread's export): the build then goes on without the gather."""
        try:
            stack.enter_context(cross_entropy_replaced(make, "the torch builder's label gather"))
        except ExportError as exc:
            logger.warning("label gather: not gathering (%s)", exc)
            return False
        return True

    def _gathering(self, original: Callable) -> Callable:
        def cross_entropy_loss(input, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
            # Calls pair with the probe's in order (the same module at the same inputs);
            # torch.export may run the forward more than once, each run in the same order.
            k = self._traced_calls % len(self.records)
            self._traced_calls += 1
            record, reason = self.records[k], self._reason_not_to_gather(k, input, target, int(ignore_index))
            if reason is not None:
                if record.flagged:
                    logger.info("label gather: not gathering before %s: %s", record.site, reason)
                return original(input, target, weight, reduction, ignore_index, label_smoothing)
            if self._traced_calls <= len(self.records):  # the first run of the forward
                self.gathered.append(self._gathered_loss(record, k))
            logits = input if input.dim() == 2 else input.movedim(1, -1).flatten(0, -2)
            labels = target.flatten()
            rows = (labels != ignore_index).nonzero().squeeze(1)
            return original(
                logits.index_select(0, rows), labels.index_select(0, rows), weight, reduction, ignore_index, label_smoothing
            )

        return cross_entropy_loss

    def _gathered_loss(self, record: DensityRecord, k: int) -> GatheredLoss:
        assert record.valid is not None and record.total is not None and record.density is not None
        return GatheredLoss(
            record.site, record.ignore_index, record.valid, record.total, record.density, _REDUCTIONS[self.reductions[k]]
        )

    def _reason_not_to_gather(self, k: int, input: torch.Tensor, target: torch.Tensor, ignore_index: int) -> str | None:
        record = self.records[k]
        if not record.flagged:
            return record.reason
        if record.ignore_index != ignore_index:
            return f"the trace's call {k} has ignore_index {ignore_index}, the probe's {record.ignore_index}"
        reduction = _REDUCTIONS.get(self.reductions[k], "?")
        if reduction not in ("mean", "sum"):
            return f"reduction={reduction!r}: one loss per row, which fewer rows would change"
        if target.is_floating_point():
            return "class-probability targets"
        if input.dim() < 2 or input.dim() != target.dim() + 1:
            return f"input of rank {input.dim()} with target of rank {target.dim()} (unbatched or not class indices)"
        return None

    def _log_kept(self) -> None:
        for record in self.records:
            if not record.flagged:
                logger.debug("label gather: not gathering before %s: %s", record.site, record.reason)

    # -- after the build ---------------------------------------------------------------
    def record(self, model: ir.Model) -> None:
        """Name each gathered loss's row-count dim ``valid_label_count_<k>`` in ``model``,
        record its size at export beside the input dims (the memory analyses bind dims by
        name), note the gathered losses in the export record, and log them."""
        if not self.gathered:
            return
        values = [*model.graph.inputs, *(v for node in model.graph for v in node.outputs)]
        counts = _row_count_dims(model)
        # Named only where the graph's NonZeros are exactly the gathers': another op with a
        # data-dependent size would make the pairing a guess.
        renames: dict[str, str] = {}
        if len(counts) == len(self.gathered):
            renames = {old: f"{VALID_DIM_PREFIX}{k}" for k, old in enumerate(counts)}
            self.gathered = [dataclasses.replace(g, dim=renames[old]) for g, old in zip(self.gathered, counts)]
            renames.update(_aliases(model, renames))
            for old, nonzero in counts.items():  # the memory analyses size every value
                rank = nonzero.inputs[0].shape.rank() if nonzero.inputs[0] is not None and nonzero.inputs[0].shape else None
                if rank is not None:
                    nonzero.outputs[0].shape = ir.Shape([rank, ir.SymbolicDim(renames[old])])
            for value in values:
                if value.shape is not None and any(_name(d) in renames for d in value.shape):
                    value.shape = ir.Shape([ir.SymbolicDim(renames[_name(d)]) if _name(d) in renames else d for d in value.shape])
        dims = dict(get_export_info(model).get("dims", {}))
        dims.update({g.dim: g.valid for g in self.gathered if g.dim is not None})
        update_export_info(model, dims=dims, label_gather=[dataclasses.asdict(g) for g in self.gathered])
        for g in self.gathered:
            logger.info(
                "label gather: the loss at %s runs on its valid rows only (label density %.2f%% at export, %d/%d labels "
                "!= ignore_index %d, reduction %s; rows %s)",
                g.site, g.density, g.valid, g.total, g.ignore_index, g.reduction, g.dim or "data-dependent",
            )  # fmt: skip


def _name(dim: Any) -> str | None:
    return dim.value if isinstance(dim, ir.SymbolicDim) else None


def _row_count_dims(model: ir.Model) -> dict[str, ir.Node]:
    """The data-dependent dim of each NonZero's rows, in graph order, and the NonZero:
    torch.onnx writes ``nonzero`` as ``Transpose(NonZero(x))``, whose first dim is the
    count (``u3``); the NonZero's own output leaves it anonymous."""
    found: dict[str, ir.Node] = {}
    for node in model.graph:
        if node.op_type != "NonZero":
            continue
        for use in node.outputs[0].uses():
            shape = use.node.outputs[0].shape if use.node.op_type == "Transpose" else None
            name = _name(shape[0]) if shape is not None and len(shape) == 2 else None
            if name is not None and _UNBACKED.match(name) and name not in found:
                found[name] = node
                break
    return found


def _aliases(model: ir.Model, renames: dict[str, str]) -> dict[str, str]:
    """Other symbols torch.onnx gave the same count (a Cast of a ``[u3]`` tensor written as
    ``[u6]``): an elementwise op of one input keeps its input's dims."""
    aliases = dict(renames)
    for node in model.graph:
        if node.op_type not in _ELEMENTWISE or len(node.inputs) != 1 or node.inputs[0] is None:
            continue
        before, after = node.inputs[0].shape, node.outputs[0].shape
        if before is None or after is None or len(before) != len(after):
            continue
        for b, a in zip(before, after):
            if _name(b) in aliases and _name(a) is not None and _UNBACKED.match(_name(a)) and _name(a) not in aliases:
                aliases[_name(a)] = aliases[_name(b)]
    return {old: new for old, new in aliases.items() if old not in renames}


def gathered_losses(model: ir.Model) -> list[GatheredLoss]:
    """The losses the torch builder traced over their valid rows, from ``model``'s record."""
    raw = get_export_info(model).get("label_gather", [])
    return [GatheredLoss(**entry) for entry in raw]
