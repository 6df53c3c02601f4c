"""Analyses shared by the passes of one pass-manager run (MLIR's analysis manager, in small).

A pass that needs an expensive read-only analysis asks the run's cache for it; the result
is computed once and handed to every later pass that asks for the same analysis of the
same model object, until a pass changes the model.  After a pass that reports a change,
:class:`ortpass.PassManager` drops every cached analysis except those the pass declares it
leaves valid (``preserves_analyses``): ``FixDropoutSeedPass`` only adds ``seed``
attributes, which the recompute analysis does not read, so ``RecomputePass`` reuses the
analysis it ran (on a 52k-node training graph that analysis takes about a second).

Outside a manager a pass has no cache and computes what it needs.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, Iterable

import onnx_ir as ir

__all__ = ["AnalysisCache"]

logger = logging.getLogger(__name__)


class AnalysisCache:
    """Results of read-only analyses, each tied to the model object it was computed on.

    Keys are tuples whose first element names the analysis (what passes list in
    ``preserves_analyses``); the rest are the options the result depends on.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[Hashable, ...], tuple[ir.Model, Any]] = {}
        self.hits = 0

    def get(self, key: tuple[Hashable, ...], model: ir.Model, compute: Callable[[], Any]) -> Any:
        """The cached result of ``key`` for ``model``, or ``compute()`` (then cached)."""
        entry = self._entries.get(key)
        if entry is not None and entry[0] is model:
            self.hits += 1
            logger.debug("analysis %s reused", key)
            return entry[1]
        result = compute()
        self._entries[key] = (model, result)
        return result

    def keep_only(self, analyses: Iterable[str]) -> None:
        """Drop every result whose analysis is not named in ``analyses``."""
        kept = set(analyses)
        self._entries = {key: entry for key, entry in self._entries.items() if key[0] in kept}

    def __len__(self) -> int:
        return len(self._entries)
