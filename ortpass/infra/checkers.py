"""One checker per ``PassManager`` check mode, so the run loop asks, never tests a mode.

A checker checks the input and the model after each pass, and hands what it accepted
(:class:`Accepted`) to its next check.  ``full`` keeps the serialization the onnx checker
accepted (also the manager's rollback point); ``incremental`` keeps the state of
:func:`~ortpass.infra.checks.incremental_check`, and asks the manager to confirm the output
with the onnx checker itself at the end; ``none`` accepts everything.  The rules each mode
applies are in :mod:`ortpass.infra.checks` and ``docs/design/checks-and-rollback.md``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import onnx
import onnx_ir as ir

from ortpass.infra.checks import (
    CHECK_MODES,
    CheckedState,
    full_check,
    incremental_check,
    input_check,
)

__all__ = ["Accepted", "Checker", "FullChecker", "IncrementalChecker", "NoChecker", "checker_for"]


@dataclasses.dataclass(frozen=True)
class Accepted:
    """What a check accepted of a model: the serialization the onnx checker accepted
    (full mode), or the incremental check's state; neither where nothing was checked."""

    proto: onnx.ModelProto | None = None
    state: CheckedState | None = None

    def rebased(self, model: ir.Model) -> Accepted:
        """The same verdict for ``model``, a copy of the model it was given for."""
        return Accepted(self.proto, self.state.rebased(model) if self.state is not None else None)


class Checker:
    """A check mode: how the input and each pass's output are checked."""

    mode: ClassVar[str]
    #: Whether each pass's output is checked (and timed) at all.
    checks_each_pass: ClassVar[bool] = True
    #: Whether the run ends with the onnx checker itself on the output, and a failing pass
    #: first has the onnx checker look at the input (the per-pass checks did not run it).
    confirms_with_onnx_checker: ClassVar[bool] = False

    def check_input(self, model: ir.Model) -> Accepted:
        return self.check(model, Accepted())

    def check(self, model: ir.Model, previous: Accepted) -> Accepted:
        raise NotImplementedError


class FullChecker(Checker):
    mode = "full"

    def check(self, model: ir.Model, previous: Accepted) -> Accepted:
        return Accepted(proto=full_check(model))


class IncrementalChecker(Checker):
    mode = "incremental"
    confirms_with_onnx_checker = True

    def check_input(self, model: ir.Model) -> Accepted:
        return Accepted(state=input_check(model))

    def check(self, model: ir.Model, previous: Accepted) -> Accepted:
        return Accepted(state=incremental_check(model, previous.state))


class NoChecker(Checker):
    mode = "none"
    checks_each_pass = False

    def check(self, model: ir.Model, previous: Accepted) -> Accepted:
        return Accepted()


_CHECKERS = {c.mode: c for c in (FullChecker, IncrementalChecker, NoChecker)}


def checker_for(check: bool | str) -> Checker:
    """The checker named by ``PassManager``'s ``check`` argument (``True`` is ``"full"``,
    ``False`` ``"none"``)."""
    mode = {True: "full", False: "none"}.get(check, check) if isinstance(check, bool) else check
    if mode not in _CHECKERS:
        raise ValueError(f"check must be True, False or one of {CHECK_MODES}, not {check!r}")
    return _CHECKERS[mode]()
