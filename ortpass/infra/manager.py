"""The pass manager: runs passes in the order their declarations demand
(:mod:`ortpass.infra.ordering`), checks the model after each one
(:mod:`ortpass.infra.checkers`), rolls back a failing pass (:mod:`ortpass.infra.rollback`),
and reports what every pass did (:mod:`ortpass.infra.report`).

:class:`PassManager` is itself an onnx_ir ``FunctionalPass``: the model it is given is never
changed, it returns a new model, and it nests inside any onnx_ir ``PassManager``.  Its
result, :class:`~ortpass.infra.report.ManagerResult`, also carries the report.  How the
checks and the rollback work, and what they cost: ``docs/design/checks-and-rollback.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn, Sequence

import onnx
import onnx_ir as ir

from ortpass.conventions import CREATED_BY_KEY
from ortpass.errors import (
    ModelLoadError,
    OrtpassError,
    PassFailedError,
)
from ortpass.infra.analysis_cache import AnalysisCache
from ortpass.infra.base import PassDeclarations, pass_name_of
from ortpass.infra.checkers import Accepted, checker_for
from ortpass.infra.checks import full_check, full_check_weight_by_weight
from ortpass.infra.gc_pause import CyclicGcPaused
from ortpass.infra.node_diff import all_nodes, count_ops, diff_nodes
from ortpass.infra.ordering import order_passes
from ortpass.infra.report import ManagerResult, PassRecord, PassReport, stats_of
from ortpass.infra.rollback import RollbackPoint
from ortpass.infra.validate import check_model
from ortpass.io import write_with

logger = logging.getLogger(__name__)

__all__ = ["PassManager"]


#: How to get back the model a pass was given: the model, and None or a sentence saying
#: that only an earlier state could be given back (see :mod:`ortpass.infra.rollback`).
Rollback = Callable[[], tuple[ir.Model, str | None]]


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__
    # onnx_ir wraps failed pre/postconditions and the cause says why; ortpass's own errors
    # say it themselves (their cause is the raw text they were made from: C++ signatures).
    if cause is not None and not isinstance(exc, OrtpassError):
        text += f" (caused by {type(cause).__name__}: {cause})"
    return text


@dataclasses.dataclass
class _Run:
    """What every pass of one run shares: the caller's model (never changed), the report,
    the analysis cache, and the point a failing pass is rolled back from."""

    given: ir.Model
    report: PassReport
    cache: AnalysisCache
    point: RollbackPoint


class PassManager(ir.passes.FunctionalPass):
    """Runs a set of passes in the order their declarations demand, checking after each.

    Args:
        passes: pass instances, in any order (see the module docstring for the rules).
        assume: properties the input model already has (e.g. ``["training-graph"]`` to run
            post-grad passes on a model that is already a training graph).
        check: how the model is checked, first the input (so a bad input is not blamed on
            the first pass), then after every pass that changed it: ``"full"`` (or
            ``True``) serializes the model and runs the onnx checker; ``"incremental"`` (the
            default) applies the checker's rules on the IR to what changed, and ends with
            the onnx checker itself on the output (should it refuse, the passes run again
            with the full check to name the first to blame); ``"none"`` (or ``False``)
            checks nothing.  In every mode the input is never changed and a pass that raises
            is rolled back (by running the passes before it again where copying would cost
            more: passes are assumed deterministic).  The rules and what each mode cannot
            see: ``docs/design/checks-and-rollback.md``.
        dump_dir: if given, write ``NN_<pass>.onnx`` after each pass that changed the
            model (NN = its 2-digit position), and ``NN_<pass>.failed-input.onnx`` with the
            input of a pass that failed, to reproduce the failure with that pass alone.
        instruments: hook objects, see :mod:`ortpass.infra.instruments`.

    Calling the manager returns a :class:`ManagerResult` (``.model``, ``.modified``,
    ``.report``, ``.proto``); the report of the latest run is also kept in ``.report``.  If a pass
    fails it raises :class:`~ortpass.errors.PassFailedError` carrying the model as it was
    before that pass and the report so far.  The nodes a pass creates are tagged with its
    name in node metadata (``CREATED_BY_KEY``) unless the pass tagged them itself.

    The ordering is decided in the constructor: an unorderable set raises
    PassOrderingError there, before any model is touched.
    """

    def __init__(
        self,
        passes: Iterable[ir.passes.PassBase],
        *,
        assume: Iterable[str] = (),
        check: bool | str = "incremental",
        dump_dir: str | os.PathLike | None = None,
        instruments: Iterable[Any] = (),
    ) -> None:
        given = list(passes)
        for p in given:
            if not isinstance(p, ir.passes.PassBase):
                hint = f"; pass an instance, {p.__name__}()" if isinstance(p, type) else ""
                raise TypeError(f"PassManager takes onnx_ir pass instances, got {p!r}{hint}")
        if isinstance(assume, str):
            raise TypeError(f"assume must be a collection of property names, not the str {assume!r}")
        self.assume = frozenset(assume)
        self.passes: list[ir.passes.PassBase] = order_passes(given, assume=self.assume)
        self.checker = checker_for(check)
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.instruments = tuple(instruments)
        self.report: PassReport | None = None

    @property
    def check(self) -> str:
        """The check mode: ``"full"``, ``"incremental"`` or ``"none"``."""
        return self.checker.mode

    def __repr__(self) -> str:
        return f"PassManager([{', '.join(pass_name_of(p) for p in self.passes)}])"

    def call(self, model: ir.Model) -> ManagerResult:
        with CyclicGcPaused() as collector:
            return self._run(model, collector)

    def _run(self, model: ir.Model, collector: CyclicGcPaused) -> ManagerResult:
        report = PassReport()
        self.report = report
        checked = self._check_input(model)
        self._refuse_bad_input(model)
        self._notify("run_begin", self.passes, model)
        run = _Run(model, report, AnalysisCache(), RollbackPoint.at_input(model))
        current, nodes = model, None  # nodes: those of ``current``, as the pass before left them
        try:
            try:
                for position, pass_ in enumerate(self.passes, start=1):
                    current, checked, nodes = self._run_pass(run, position, pass_, current, checked, nodes)
                    collector.between_passes()
            except PassFailedError as failure:
                if self.checker.confirms_with_onnx_checker:
                    self._refuse_input_if_the_checker_does(model, f"pass {failure.pass_name!r} failed: {failure.reason}")
                raise
            if self.checker.confirms_with_onnx_checker and not all(map(self._unchanged, report.records)):
                checked = Accepted(proto=self._final_check(model, current, report))
        finally:
            self._notify("run_end", current, report)
        if current is model:  # nothing replaced the input; a functional pass returns a new model
            current = model.clone()
        return ManagerResult(current, report.modified, report, checked.proto)

    def _final_check(self, model: ir.Model, out: ir.Model, report: PassReport) -> onnx.ModelProto | None:
        """The onnx checker itself on ``out``, the model the run returns, after the
        incremental checks (so what they cannot see, like a tensor changed in place,
        does not leave the manager), weight by weight where the weights are graph inputs
        (:func:`full_check_weight_by_weight`); returns the serialization it accepted where
        that is the whole model, else None.  Should it refuse ``out`` and accept
        the input, the passes run again from ``model`` with the checker after each, to
        name the first whose output it refuses."""
        start = time.perf_counter()
        try:
            proto = full_check_weight_by_weight(out)
        except Exception as exc:  # noqa: BLE001 - the pass to blame is looked for and named
            report.final_check_seconds = time.perf_counter() - start
            reason = _describe(exc)
            # Before running every pass again: the input may be what the checker refuses.
            self._refuse_input_if_the_checker_does(model, f"the final check refused the output: {reason}")
            self._blame_first_refused(model, report, reason, exc)
        report.final_check_seconds = time.perf_counter() - start
        return proto

    @staticmethod
    def _refuse_input_if_the_checker_does(model: ir.Model, found_when: str) -> None:
        """In the incremental mode the input got the checker's rules on the IR, not the
        checker itself (see :func:`ortpass.infra.checks.input_check`).  Should a pass fail, or
        the final check refuse, on an input that only the checker refuses, the input is to
        blame, not a pass.  ``found_when``: what failed, for the message."""
        try:
            full_check(model)
        except Exception as exc:  # noqa: BLE001 - named in the error raised
            raise ModelLoadError(
                f"the input model fails the onnx checker: {_describe(exc)} (found when {found_when})"
            ) from exc

    def _blame_first_refused(self, model: ir.Model, report: PassReport, reason: str, exc: Exception) -> NoReturn:
        records = report.records
        current, given = model.clone(), model
        for index, (pass_, record) in enumerate(zip(self.passes, records)):
            if self._unchanged(record):
                continue
            current, _ = self._run_again(pass_, current)
            try:
                proto = full_check(current)
            except Exception as refused:  # noqa: BLE001 - this is the pass to blame
                del records[index + 1 :]
                record.error = f"the model fails the onnx checker after this pass (the final check found it): {_describe(refused)}"
                raise PassFailedError(record.name, record.error, model=given, report=report) from refused
            given = ir.from_proto(proto)
        reason = (
            f"the model after the last pass fails the onnx checker ({reason}), yet no pass's output did "
            "when the passes ran again (a pass is not deterministic); nothing was applied"
        )
        raise PassFailedError(records[-1].name, reason, model=model.clone(), report=report) from exc

    def _refuse_bad_input(self, model: ir.Model) -> None:
        """Malformed metadata and attributes, and what a pass declares it cannot take
        (:meth:`PassDeclarations.check_input`), are refused before any pass runs."""
        check_model(model)
        for pass_ in self.passes:
            if isinstance(pass_, PassDeclarations):
                pass_.check_input(model)

    def _check_input(self, model: ir.Model) -> Accepted:
        """Check the input before any pass, so a bad input is named as such."""
        try:
            return self.checker.check_input(model)
        except Exception as exc:
            raise ModelLoadError(f"the input model fails the onnx checker before any pass ran: {_describe(exc)}") from exc

    def _run_pass(
        self, run: _Run, position: int, pass_: ir.passes.PassBase, model: ir.Model, checked: Accepted,
        nodes: list[ir.Node] | None,
    ) -> tuple[ir.Model, Accepted, list[ir.Node]]:
        """Run one pass; return the model after it, what its check accepted and its nodes.

        ``checked``: what the check of ``model`` accepted.  ``nodes``: the nodes of
        ``model`` as the pass before left them (None for the first), listed again only
        if the pass works on a copy (instruments observe, they do not change the model).
        """
        record = PassRecord(position, pass_name_of(pass_))
        self._notify("before_pass", pass_, model)
        work, rollback, checked = self._prepare(pass_, model, checked, run.point, owned=model is not run.given)
        # The objects, kept alive for the identity diff.
        before = nodes if nodes is not None and work is model else all_nodes(work)
        record.nodes_before = len(before)
        start = time.perf_counter()
        try:
            result = self._call_with_cache(pass_, work, run.cache, self.passes[position:])
        except Exception as exc:
            record.seconds = time.perf_counter() - start
            self._fail(pass_, record, rollback, run.report, _describe(exc), exc)
        record.seconds = time.perf_counter() - start
        record.stats = stats_of(pass_)
        after = self._record_changes(record, result, before)
        if not self._unchanged(record):
            run.cache.keep_only(getattr(pass_, "preserves_analyses", ()))
        if self._unchanged(record):
            accepted = checked  # nothing to check: what held for its input still holds
        else:
            accepted = self._check_output(pass_, record, rollback, run.report, result.model, checked)
        if accepted.proto is not None:
            run.point.move_to_serialized(accepted.proto, record.name)
        elif not self._unchanged(record):
            run.point.ran(record.name, pass_, record.seconds, record.nodes_after)
        if record.modified and self.dump_dir is not None:
            proto = accepted.proto if accepted.proto is not None else ir.to_proto(result.model)
            record.dump_path = self._dump(proto, f"{position:02d}_{record.name}.onnx")
        run.report.records.append(record)
        self._notify("after_pass", pass_, result.model, record)
        return result.model, accepted, after

    def _prepare(
        self, pass_: ir.passes.PassBase, model: ir.Model, checked: Accepted, point: RollbackPoint, *, owned: bool
    ) -> tuple[ir.Model, Rollback, Accepted]:
        """The model ``pass_`` works on, how to get back ``model`` as it is now should the
        pass fail, and what the check accepted of the model the pass works on.

        The caller's model is never changed: an in-place pass given it works on a clone
        (as checked as its original).  An in-place pass given the manager's own model
        rewrites it in place, so that analyses cached for it stay usable; ``point``
        rebuilds it should the pass fail (see :mod:`ortpass.infra.rollback`).
        """
        if not pass_.changes_input:
            return model, lambda: (model, None), checked  # a functional pass leaves its input alone
        if not owned:
            work = point.copy(model)
            return work, lambda: (model, None), checked.rebased(work)
        point.copy_if_cheaper(model)
        return model, lambda: point.rebuild(self._run_again), checked

    def _run_again(self, pass_: ir.passes.PassBase, model: ir.Model) -> tuple[ir.Model, int]:
        """Run ``pass_`` once more, to rebuild a rollback point: no check, no instrument,
        no dump; the nodes it creates are tagged as the first time."""
        before = all_nodes(model)
        following = self.passes[next(i for i, p in enumerate(self.passes) if p is pass_) + 1 :]
        result = self._call_with_cache(pass_, model, AnalysisCache(), following)
        record = PassRecord(0, pass_name_of(pass_))
        self._record_changes(record, result, before)
        return result.model, record.nodes_after

    def _record_changes(self, record: PassRecord, result: ir.passes.PassResult, before: list[ir.Node]) -> list[ir.Node]:
        """Fill in ``record``'s changes, tag the nodes the pass created; return the nodes after it."""
        after = all_nodes(result.model)
        added, removed = diff_nodes(before, after)
        for node in added:
            node.metadata_props.setdefault(CREATED_BY_KEY, record.name)
        record.modified = bool(result.modified)
        record.nodes_after = len(after)
        record.added = count_ops(added)
        record.removed = count_ops(removed)
        if not record.modified and (added or removed):
            logger.warning(
                "pass %r reported modified=False but added %s and removed %s", record.name, record.added, record.removed
            )
        return after

    @staticmethod
    def _call_with_cache(
        pass_: ir.passes.PassBase, model: ir.Model, cache: AnalysisCache, following: Sequence[ir.passes.PassBase] = ()
    ) -> ir.passes.PassResult:
        """Run ``pass_``, lending an ortpass pass the run's analysis cache and the passes after it meanwhile."""
        if not isinstance(pass_, PassDeclarations):
            return pass_(model)
        with pass_.lent(cache, following):
            return pass_(model)

    @staticmethod
    def _unchanged(record: PassRecord) -> bool:
        """The pass reports no change and no node came or went: its output is not checked
        again (serializing and checking a 50k-node graph takes seconds)."""
        return not record.modified and not record.added and not record.removed

    def _check_output(
        self,
        pass_: ir.passes.PassBase,
        record: PassRecord,
        rollback: Rollback,
        report: PassReport,
        out: ir.Model,
        previous: Accepted,
    ) -> Accepted:
        if not self.checker.checks_each_pass:
            return previous
        start = time.perf_counter()
        try:
            accepted = self.checker.check(out, previous)
        except Exception as exc:
            record.check_seconds = time.perf_counter() - start
            reason = f"the model fails the onnx checker after this pass: {_describe(exc)}"
            self._fail(pass_, record, rollback, report, reason, exc)
        record.check_seconds = time.perf_counter() - start
        return accepted

    def _fail(
        self, pass_: ir.passes.PassBase, record: PassRecord, rollback: Rollback, report: PassReport, reason: str, exc: Exception
    ) -> NoReturn:
        model, note = rollback()
        if note is not None:
            reason = f"{reason}; {note}"
        record.error = reason
        if not record.stats:
            record.stats = stats_of(pass_)
        if self.dump_dir is not None:
            record.dump_path = self._dump(ir.to_proto(model), f"{record.position:02d}_{record.name}.failed-input.onnx")
        report.records.append(record)
        logger.debug("pass %r failed; rolled back to the model before it", record.name, exc_info=exc)
        self._notify("after_pass", pass_, model, record)
        raise PassFailedError(record.name, reason, model=model, report=report) from exc

    def _dump(self, proto: onnx.ModelProto, file_name: str) -> str:
        assert self.dump_dir is not None
        path = self.dump_dir / file_name
        write_with(path, lambda tmp: onnx.save(proto, str(tmp)))
        logger.debug("wrote %s", path)
        return str(path)

    def _notify(self, hook: str, *args: Any) -> None:
        for instrument in self.instruments:
            method = getattr(instrument, hook, None)
            if method is not None:
                method(*args)
