"""Pass instruments: hooks the pass manager calls around every pass (TVM/MLIR style).

An instrument is any object with some of these methods (all optional):

``run_begin(passes, model)``
    once, before the first pass, with the passes in the order they will run;
``before_pass(pass_, model)``
    before each pass, with the model the pass is about to get;
``after_pass(pass_, model, record)``
    after each pass, with the model as it now stands and the pass's
    :class:`ortpass.infra.report.PassRecord`.  After a failing pass ``record.failed`` is true
    and ``model`` is the model as it was before that pass (the manager rolled back);
``run_end(model, report)``
    once, after the last pass that ran (also when a pass failed).

Instruments observe; they must not change the model.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

import onnx_ir as ir

if TYPE_CHECKING:
    from ortpass.infra.report import PassRecord

__all__ = ["ProgressInstrument"]

logger = logging.getLogger(__name__)


class ProgressInstrument:
    """Logs one line per pass, ``[i/n] name: changed, 5 -> 7 nodes (12 ms)``.

    The start of a pass is logged at DEBUG and its end at ``level`` (INFO by default), so
    a command line tool shows progress at its normal verbosity without doubling the lines.
    """

    def __init__(self, log: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self._log = log or logger
        self._level = level
        self._total = 0
        self._next = 1  # position of the pass about to run; before_pass has no record yet

    def run_begin(self, passes: Sequence[ir.passes.PassBase], model: ir.Model) -> None:
        del model
        self._total = len(passes)
        self._next = 1

    def before_pass(self, pass_: ir.passes.PassBase, model: ir.Model) -> None:
        del model
        self._log.debug("[%s/%s] %s ...", self._next, self._total, _name(pass_))

    def after_pass(self, pass_: ir.passes.PassBase, model: ir.Model, record: PassRecord) -> None:
        del pass_, model
        if record.failed:
            # The reason travels in the PassFailedError (the command prints it once).
            outcome = "FAILED, rolled back"
        elif record.modified:
            outcome = f"changed, {record.nodes_before} -> {record.nodes_after} nodes"
        else:
            outcome = "unchanged"
        self._log.log(
            self._level, "[%d/%d] %s: %s (%.0f ms)", record.position, self._total, record.name, outcome,
            record.seconds * 1000,
        )
        self._next = record.position + 1


def _name(pass_: ir.passes.PassBase) -> str:
    return getattr(pass_, "pass_name", None) or type(pass_).__name__
