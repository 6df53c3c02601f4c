"""How :class:`ortpass.PassManager` gets back the model a failing pass was given.

The manager promises that a failing pass leaves the model as it was.  It used to copy
the model (``ir.Model.clone``) before every in-place pass, so as to hand the copy back;
on a 17.5k-node training graph a copy takes about 0.45 s, as long as the four post-grad
passes of the default pipeline together, and a rollback is rare.  So the manager keeps
a :class:`RollbackPoint` instead: a *base* it can rebuild at any time (the caller's
model, which the manager never changes; the serialization a full check made; or, now
and then, a copy) and the passes that ran since.  Rolling back rebuilds the base and
runs those passes again.

This is the trade the recompute pass makes for activations, recompute instead of stash.
A copy costs every run; running passes again costs only the runs that roll back, which
are rare (a pass with a bug, a model a pass cannot handle).  So a copy is taken only
when running the passes since the base again would take longer than
:data:`REPLAY_LIMIT` copies: below that, copying would pay only if one run in ten rolled
back.  A rollback then runs at most about ten copies' worth of passes again (about
4 s at 17.5k nodes).  In the default pipeline the gradient build, seconds long, is
followed by a copy; the post-grad passes, together as fast as two copies, are not.

Running passes again assumes that each is a deterministic function of its input model
(the same model in, the same model out), as onnx_ir's passes and ortpass's are.  Should
a pass raise when it runs again, or leave a different number of nodes than the first
time, the rollback says so and gives back the base instead.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import onnx
import onnx_ir as ir

__all__ = ["RollbackPoint"]

logger = logging.getLogger(__name__)

#: Runs one pass again on a model and returns its output and how many nodes that has (the
#: manager's callback: it lends the pass an analysis cache and tags the nodes it creates,
#: as in the first run).
RunAgain = Callable[[ir.passes.PassBase, ir.Model], tuple[ir.Model, int]]

#: How many copies' time the passes since the base may take before the model is copied.
REPLAY_LIMIT = 10


class RollbackPoint:
    """A state of the model the manager can rebuild, and the passes that ran since."""

    def __init__(self, rebuild_base: Callable[[], ir.Model], base: str) -> None:
        self._rebuild_base = rebuild_base
        self._base = base  # what the base is, for messages
        self._since: list[tuple[str, ir.passes.PassBase, int]] = []  # name, pass, nodes after it
        self._seconds_since = 0.0
        # What copying the model took the last time; None until the manager first copies.
        self.copy_seconds: float | None = None

    @classmethod
    def at_input(cls, model: ir.Model) -> RollbackPoint:
        """The caller's model, which the manager never changes."""
        return cls(model.clone, "the model given to the manager")

    def move_to_serialized(self, proto: onnx.ModelProto, after: str) -> None:
        """The model is now ``proto`` (what the full check serialized after pass ``after``)."""
        self._reset(lambda: ir.from_proto(proto), f"the model after {after!r}")

    def ran(self, name: str, pass_: ir.passes.PassBase, seconds: float, nodes_after: int) -> None:
        """Pass ``name`` changed the model, in ``seconds``, leaving ``nodes_after`` nodes."""
        self._since.append((name, pass_, nodes_after))
        self._seconds_since += seconds

    def copy(self, model: ir.Model) -> ir.Model:
        """Copy ``model``, timing the copy so as to know when the next one pays."""
        start = time.perf_counter()
        copied = model.clone()
        self.copy_seconds = time.perf_counter() - start
        return copied

    def copy_if_cheaper(self, model: ir.Model) -> None:
        """Make a copy of ``model`` (the output of the latest pass) the base, if running
        the passes since the base again would take longer than REPLAY_LIMIT copies."""
        if not self._since:
            return
        if self.copy_seconds is not None and self._seconds_since < REPLAY_LIMIT * self.copy_seconds:
            return
        after = self._since[-1][0]
        snapshot = self.copy(model)
        logger.debug("rollback point: copied the model after %r (%.3f s)", after, self.copy_seconds)
        self._reset(snapshot.clone, f"the model after {after!r}")

    def rebuild(self, run_again: RunAgain) -> tuple[ir.Model, str | None]:
        """The model as it is now, rebuilt: the base with the passes since run again.

        Returns the model and None, or, when a pass did not run again as it first did,
        the base and a sentence saying so.
        """
        model = self._rebuild_base()
        for name, pass_, nodes_after in self._since:
            try:
                model, count = run_again(pass_, model)
            except Exception as exc:  # noqa: BLE001 - reported, and the base given back
                problem = f"running {name!r} again raised {type(exc).__name__}: {exc}"
            else:
                if count == nodes_after:
                    continue
                problem = f"running {name!r} again left {count} nodes, not {nodes_after}"
            note = f"could not rebuild the model before the failing pass ({problem}); given back instead: {self._base}"
            logger.warning(note)
            return self._rebuild_base(), note
        return model, None

    def _reset(self, rebuild_base: Callable[[], ir.Model], base: str) -> None:
        self._rebuild_base = rebuild_base
        self._base = base
        self._since = []
        self._seconds_since = 0.0
