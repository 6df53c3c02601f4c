"""The cyclic garbage collector during a :class:`ortpass.PassManager` run: paused, and
run between passes only once the objects made since its last run outnumber those alive
after it, so a dropped model copy is freed within a pass or two and the collections cost
time linear in what the run makes (issue 59: paused for the whole run, each dropped copy
stayed until the run ended, +5.8 GiB on an 80-layer LLaMA)."""

from __future__ import annotations

import gc
import logging
import time

__all__ = ["CyclicGcPaused"]

logger = logging.getLogger(__name__)


class CyclicGcPaused:
    """Python's cyclic garbage collector paused for a run, then restored as it was: an IR
    graph is many small objects in reference cycles, and collections walking them all over
    and over cost a tenth of a large run (docs/design/checks-and-rollback.md).

    Paused, it would keep every dropped model copy until the run ends (a copy serialized
    and parsed back, a rollback point replaced, a functional pass's input): so between
    passes it collects once the container objects made since the last collection
    (``gc.get_count()[0]``: allocations less deallocations, cyclic garbage included)
    outnumber those alive after it.  Each collection then walks at most about twice what
    was made since the one before: linear in all, and no dead copy outlives the next pass
    by more than one live model's worth of objects.

    The objects alive when the run starts (the caller's: a torch model, the input IR) are
    frozen for it (``gc.freeze``, unless the caller froze some of its own), so a collection
    walks only what the run made: a full collection on a 64-layer LLaMA's run walked the
    input model and torch's objects too, 0.75 s, that the run's own garbage never needs.
    The run holds its input, and a frozen object the caller drops meanwhile is collected
    after the run, once unfrozen."""

    #: Fewer new objects than this never trigger a collection (a small model's run).
    MIN_PENDING = 200_000
    #: New objects, as a multiple of those alive after the last collection, that trigger one.
    GROWTH = 1.0

    def __init__(self) -> None:
        self.was_enabled = False
        self.froze = False
        self.alive = 0
        self.collections = 0

    def __enter__(self) -> "CyclicGcPaused":
        self.was_enabled = gc.isenabled()
        gc.disable()
        self.froze = gc.get_freeze_count() == 0  # unfreezing would also unfreeze the caller's
        if self.froze:
            gc.freeze()
        self.alive = len(gc.get_objects())
        return self

    def __exit__(self, *exc: object) -> None:
        if self.froze:
            gc.unfreeze()
        if self.was_enabled:
            gc.enable()

    def between_passes(self) -> None:
        if gc.get_count()[0] <= max(self.MIN_PENDING, self.GROWTH * self.alive):
            return
        start = time.perf_counter()
        freed = gc.collect()
        self.alive = len(gc.get_objects())
        self.collections += 1
        logger.debug("collected %d objects between passes in %.3f s; %d alive", freed, time.perf_counter() - start, self.alive)
