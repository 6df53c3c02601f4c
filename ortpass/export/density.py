"""Label-density probe at export, and the flag it leaves for padding elimination.

:func:`density_probe` is a context manager entered around ``torch.onnx.export``
(``ortpass.export.export`` does it).  While it is active, every cross-entropy call --
``nn.CrossEntropyLoss`` modules and functional ``F.cross_entropy`` alike (ORTModule only
saw the modules) -- measures the density of the labels it actually receives::

    density = count(label != ignore_index) / numel(label) * 100

with that call's own ``ignore_index``.  Below the threshold, the label is routed through
:class:`FlagAndPrintDensity`, an identity ``torch.autograd.Function`` that the PythonOp
exporter (:func:`ortpass.pythonop.export.pythonop_export_context`) writes as a
``com.microsoft::PythonOp`` just before the loss.  That flag is what
``InsertGatherBeforeSceLossPass`` looks for; it records the ignore_index and the measured
density as typed attributes (``input_int_scalars``, ``input_float_scalars``).

Only the export batch is measured: a model whose later batches are denser still gets the
gather, which costs one NonZero and two gathers over the labels' rows.

The torch builder has no PythonOp and no pre-grad pass: its label gather
(:mod:`ortpass.training.label_gather`) measures with :func:`measure_labels` under the same
replacement of the builtin (:func:`cross_entropy_replaced`) and gathers while tracing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from typing import Callable, Iterator

import torch

from ortpass.conventions import PRINT_DENSITY_ENV
from ortpass.errors import ExportError

__all__ = [
    "DEFAULT_THRESHOLD",
    "DensityProbe",
    "DensityRecord",
    "FlagAndPrintDensity",
    "cross_entropy_replaced",
    "density_probe",
    "label_density",
    "measure_labels",
    "track_loss_modules",
]

logger = logging.getLogger(__name__)

#: Percent of valid labels under which a loss is flagged (ORTModule used 90).
DEFAULT_THRESHOLD = 90.0

FUNCTIONAL_SITE = "F.cross_entropy"

# Every cross-entropy in torch (the module, F.cross_entropy, and names imported from it)
# ends in this one builtin, so wrapping it sees them all.
_PATCH_OWNER = torch._C._nn
_PATCH_NAME = "cross_entropy_loss"
_patch_lock = threading.Lock()


def label_density(labels: torch.Tensor, ignore_index: int) -> tuple[int, int, float]:
    """``(valid, total, density in percent)`` of ``labels`` given ``ignore_index``."""
    total = labels.numel()
    valid = int(torch.count_nonzero(labels != ignore_index))
    return valid, total, (valid / total * 100.0 if total else 0.0)


class FlagAndPrintDensity(torch.autograd.Function):
    """Identity on a label tensor that marks it for padding elimination before the loss.

    ``FlagAndPrintDensity.apply(labels, ignore_index, export_density)`` returns ``labels``.
    Exported as a PythonOp (func_name ``ortpass.export.density.FlagAndPrintDensity``),
    it tells ``InsertGatherBeforeSceLossPass`` that the labels were sparse at export.  The
    pass removes it, unless density printing is on: then it stays, and each run of its
    forward (through the torch bridge) reports the step's label density -- printed when
    ``ORTPASS_PRINT_INPUT_DENSITY=1``, logged at INFO otherwise.
    """

    @staticmethod
    def forward(ctx, labels: torch.Tensor, ignore_index: int, export_density: float) -> torch.Tensor:
        # While exporting, the forward runs inside the trace: report nothing there.
        if not torch.jit.is_tracing():
            _report_step_density(labels, ignore_index, export_density)
        return labels

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # Labels are integers: nothing flows back in practice, but stay an identity.
        return grad_output, None, None


def _report_step_density(labels: torch.Tensor, ignore_index: int, export_density: float) -> None:
    valid, total, density = label_density(labels, ignore_index)
    message = (
        f"label density {density:.2f}% ({valid}/{total} labels != ignore_index {ignore_index}; "
        f"{export_density:.2f}% at export)"
    )
    if os.environ.get(PRINT_DENSITY_ENV, "0") == "1":
        print(message, flush=True)
    else:
        logger.info(message)


@dataclasses.dataclass(frozen=True)
class DensityRecord:
    """One cross-entropy call seen by the probe.

    ``site`` is the ``nn.CrossEntropyLoss`` submodule's name in the probed module (``""``
    for the module itself) or ``"F.cross_entropy"`` for a functional call.  ``density`` is
    None when it could not be measured; ``reason`` then says why, and otherwise why the
    label was or was not flagged.
    """

    site: str
    ignore_index: int
    valid: int | None
    total: int | None
    density: float | None
    flagged: bool
    reason: str


@dataclasses.dataclass
class DensityProbe:
    """What one :func:`density_probe` measured, in call order."""

    threshold: float
    records: list[DensityRecord] = dataclasses.field(default_factory=list)

    @property
    def flagged(self) -> list[DensityRecord]:
        return [r for r in self.records if r.flagged]

    def summary(self) -> str:
        """One line per record, for the export's log."""
        lines = []
        for r in self.records:
            measured = f"{r.density:.2f}% ({r.valid}/{r.total})" if r.density is not None else "not measured"
            verdict = "flagged" if r.flagged else "not flagged"
            lines.append(f"{r.site}: label density {measured}, ignore_index {r.ignore_index}: {verdict} ({r.reason})")
        return "\n".join(lines)


@contextlib.contextmanager
def density_probe(module: torch.nn.Module, threshold: float = DEFAULT_THRESHOLD) -> Iterator[DensityProbe]:
    """Measure label density at every cross-entropy call; flag labels below ``threshold``.

    Yields a :class:`DensityProbe` whose ``records`` fill in as ``module`` runs.  Names of
    ``nn.CrossEntropyLoss`` submodules of ``module`` label the records; functional calls
    anywhere are probed too.  Everything patched is restored on exit.  Flags become
    PythonOps only under :func:`ortpass.pythonop.export.pythonop_export_context`
    (``ortpass.export.export`` enters both).

    The wrapped builtin is process-wide: probes do not nest, and another thread calling
    cross-entropy during the probe is probed as well.
    """
    if not 0.0 <= threshold <= 100.0:
        raise ValueError(f"density threshold is a percentage in [0, 100], got {threshold}")
    probe = DensityProbe(threshold=threshold)
    sites: list[str] = []  # names of the CrossEntropyLoss modules currently running
    with cross_entropy_replaced(lambda original: _probing(original, probe, sites), "density_probe"):
        handles = track_loss_modules(module, sites)
        try:
            yield probe
        finally:
            for handle in handles:
                handle.remove()
    if probe.records:
        logger.info("label density probe (threshold %.1f%%):\n%s", threshold, probe.summary())


@contextlib.contextmanager
def cross_entropy_replaced(make: Callable[[Callable], Callable], who: str) -> Iterator[None]:
    """Replace torch's cross-entropy builtin by ``make(original)`` for the block.

    Every cross-entropy in torch ends in that one builtin (the module, ``F.cross_entropy``
    and names imported from it), so the replacement sees them all.  It is process-wide:
    one replacement at a time (the density probe of ORT's path and the torch builder's
    label gather, :mod:`ortpass.training.label_gather`, share it); ``who`` names the
    caller in the refusal of a second one.
    """
    if not _patch_lock.acquire(blocking=False):
        raise ExportError(f"{who}: the cross-entropy probe is already active (in this or another thread); probes do not nest")
    try:
        original = getattr(_PATCH_OWNER, _PATCH_NAME)
        setattr(_PATCH_OWNER, _PATCH_NAME, make(original))
        try:
            yield
        finally:
            setattr(_PATCH_OWNER, _PATCH_NAME, original)
    finally:
        _patch_lock.release()


def track_loss_modules(module: torch.nn.Module, sites: list[str]) -> list:
    """Hooks keeping ``sites`` equal to the stack of running ``nn.CrossEntropyLoss``
    submodules of ``module`` (by name); the caller removes them when done."""
    def leave(_module, _args, _output) -> None:  # a hook returning a value would replace the output
        sites.pop()

    handles = []
    for name, sub in module.named_modules():
        if not isinstance(sub, torch.nn.CrossEntropyLoss):
            continue

        def enter(_module, _args, name=name) -> None:
            sites.append(name)

        handles.append(sub.register_forward_pre_hook(enter))
        handles.append(sub.register_forward_hook(leave, always_call=True))
    return handles


def _probing(original: Callable, probe: DensityProbe, sites: list[str]) -> Callable:
    def cross_entropy_loss(input, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
        site = sites[-1] if sites else FUNCTIONAL_SITE
        record = measure_labels(target, int(ignore_index), probe.threshold, site)
        probe.records.append(record)
        if record.flagged:
            target = FlagAndPrintDensity.apply(target, int(ignore_index), float(record.density))
        return original(input, target, weight, reduction, ignore_index, label_smoothing)

    return cross_entropy_loss


def measure_labels(target: torch.Tensor, ignore_index: int, threshold: float, site: str) -> DensityRecord:
    """The density of one cross-entropy call's ``target``, and whether it is under ``threshold``."""
    def unmeasured(reason: str) -> DensityRecord:
        return DensityRecord(site, ignore_index, None, None, None, False, reason)

    if target.is_floating_point():
        return unmeasured("class-probability targets have no ignore_index")
    if target.is_meta or torch.compiler.is_compiling():
        return unmeasured("labels carry no data here (meta tensor or torch.compile)")
    with _tracing_paused():
        if target.numel() == 0:
            return unmeasured("empty labels")
        valid, total, density = label_density(target.detach(), ignore_index)
    flagged = density < threshold
    reason = f"density {'<' if flagged else '>='} threshold {threshold:g}%"
    return DensityRecord(site, ignore_index, valid, total, density, flagged, reason)


@contextlib.contextmanager
def _tracing_paused() -> Iterator[None]:
    # The measurement must not become part of the traced graph: suspend the JIT tracer.
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)

