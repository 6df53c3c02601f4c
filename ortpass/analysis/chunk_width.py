"""How wide the chunked LM head's vocabulary slices are: by default, and for a memory budget.

By default a slice holds :data:`DEFAULT_CHUNK_BYTES` of logits at the graph's row count,
a multiple of 256 columns (symbolic rows counted at the export's dims; 8192 columns when
there are none): at most a few percent of step time (``benchmarks/results/hf_memory_real_width.md``).

For a budget: the default width is kept where recompute can bring the step's peak under the budget
(the budget planner's lowest peak on the graph chunked at that width); else it is halved
(from the narrower of it and the vocabulary) until recompute can, or until every slice is
256 columns wide.  The planner sees the graph
as the chunking leaves it, before the passes between it and recompute, which only lower
the peak: the width chosen may be narrower than the budget needs, never wider.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import onnx_ir as ir

from ortpass.analysis.memory import dim_expr, evaluate
from ortpass.analysis.recompute.budget import lowest_step_peak
from ortpass.analysis.recompute.candidates import find_recompute_candidates
from ortpass.analysis.recompute.timing import CostModel
from ortpass.errors import PlanError

__all__ = ["DEFAULT_CHUNK_BYTES", "WidthChoice", "default_columns", "halved", "halvings_for_budget"]

logger = logging.getLogger(__name__)

#: Logits bytes of one slice when the rows are known: 32 MiB.
DEFAULT_CHUNK_BYTES = 32 * 1024 * 1024
_SYMBOLIC_ROWS_COLUMNS = 8192  # the width when the row count is unknown
GRANULE = 256  # every width is a multiple of it


def default_columns(rows: int | ir.SymbolicDim, dtype: ir.DataType, dims: dict[str, int] | None = None) -> int:
    """Columns that make DEFAULT_CHUNK_BYTES of logits at ``rows``: a static count, or a
    symbolic one at the export's ``dims``; else 8192."""
    if not isinstance(rows, int):
        rows = evaluate(dim_expr(rows, unknown_name="rows"), dims) if dims else None
    if rows is None:
        return _SYMBOLIC_ROWS_COLUMNS
    columns = DEFAULT_CHUNK_BYTES // max(1, rows * dtype.bitwidth // 8)
    return max(GRANULE, columns // GRANULE * GRANULE)


def halved(default: int, vocab: int, halvings: int) -> int:
    """``default`` columns, or after ``halvings`` > 0, the narrower of it and ``vocab``
    halved that many times (a multiple of the granule, at least one)."""
    if halvings == 0:
        return default
    columns = min(default, vocab) >> halvings
    return max(GRANULE, columns // GRANULE * GRANULE)


@dataclasses.dataclass(frozen=True)
class WidthChoice:
    halvings: int  # of the default width
    widths: list[int]  # each chunked loss's slice width, in columns
    lowest_peak_bytes: int | None  # what recompute reaches at those widths; None: unknown sizes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def halvings_for_budget(
    chunk_at: Callable[[int], tuple[ir.Model, list[int]]], target: int, *, start: int = 0, stop: int | None = None
) -> WidthChoice:
    """The fewest halvings of the default width at which recompute can meet ``target``
    bytes, from ``start`` on (at most ``stop``).  ``chunk_at(h)``: a copy of the graph
    chunked at ``h`` halvings, and each loss's slice width."""
    cost_model = CostModel.for_this_machine()
    halvings = start
    while True:
        chunked, widths = chunk_at(halvings)
        try:
            lowest = lowest_step_peak(chunked, find_recompute_candidates(chunked, min_elements=0), cost_model)
        except PlanError:  # a size is unknown: the recompute pass will say which
            return WidthChoice(0, [], None)
        # Stop where it fits, where no loss can be chunked (none even at one halving), or at the narrowest.
        narrowest = widths and all(w <= GRANULE for w in widths)
        if lowest <= target or (halvings and not widths) or narrowest or halvings == stop:
            logger.info("slices of %s columns: lowest step peak recompute reaches %d bytes (budget %d)", widths, lowest, target)
            return WidthChoice(halvings, widths, lowest)
        halvings += 1
