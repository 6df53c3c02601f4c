"""The memory-budget planner: which recompute occurrences bring a step's peak under a
budget at the least added time.

Rule: the step's memory along ONNX Runtime's execution order is predicted without recompute
(:func:`~ortpass.analysis.step_memory.predict_step_memory`).  Recomputing an occurrence
frees each buffer it rebuilds between its last forward reader and its first backward
reader, and holds the values it keeps (a compromise's cut) from their last reader to its
own last backward reader; those intervals are added to the prediction.  Starting from no
recompute, the planner takes, while the predicted peak is over the budget, the occurrence
that lowers the peak most per second of recompute (or, where no single one lowers it, the
one that frees most at the peak's position per second), then drops every chosen occurrence,
the most expensive first, that the budget does not need.  Each stashed activation gets one
subgraph (full or compromise).  A budget under the peak of recomputing every candidate is
refused, naming that peak.  Time is priced by :class:`~ortpass.analysis.recompute.timing.CostModel`.

Layer boundaries play no part: every candidate of the whole graph is weighed by its bytes
at the peak and its cost.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
from typing import Any, Sequence

import numpy as np
import onnx_ir as ir

from ortpass.analysis import memory
from ortpass.analysis.ort_order import gradient_leaf_order
from ortpass.analysis.layers import find_layer_boundaries
from ortpass.analysis.partition import get_partition, is_backward
from ortpass.analysis.plans import PlanType
from ortpass.analysis.recompute.result import Occurrence, RecomputeReport, node_name
from ortpass.analysis.recompute.rewrite import Finish, rewritten_peak
from ortpass.analysis.recompute.timing import CostModel
from ortpass.analysis.step_memory import predict_step_memory
from ortpass.errors import PlanError
from ortpass.infra.text_table import format_table, wrap_line

__all__ = ["BudgetPlan", "lowest_step_peak", "parse_budget", "plan_for_budget"]

logger = logging.getLogger(__name__)

_MIB = 1 << 20
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_budget(budget: int | float | str) -> tuple[str, float]:
    """``("bytes", n)`` or ``("fraction", f)``.  An int is bytes; a float between 0 and 1 a
    fraction of the way from recomputing everything (0) to nothing (1); a string a size
    with a unit (``"300MiB"``, ``"6GB"``).  Anything else raises :class:`PlanError`."""
    if isinstance(budget, bool):
        raise PlanError(f"memory budget must be bytes (an int or '6GiB') or a fraction in [0, 1], not {budget!r}")
    if isinstance(budget, int):
        if budget < 0:
            raise PlanError(f"memory budget must be at least 0 bytes, not {budget}")
        return "bytes", float(budget)
    if isinstance(budget, float):
        if not 0.0 <= budget <= 1.0:
            raise PlanError(
                f"a float memory budget is a fraction between 0 (recompute everything) and 1 (recompute nothing), "
                f"not {budget}; give bytes as an int or a string such as '300MiB'"
            )
        return "fraction", budget
    if isinstance(budget, str):
        match = _SIZE.match(budget)
        if match is None or match.group(2).lower() not in _UNITS:
            raise PlanError(f"memory budget {budget!r} is not a size: write a number and a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        return "bytes", float(match.group(1)) * _UNITS[match.group(2).lower()]
    raise PlanError(f"memory budget must be bytes (an int or '6GiB') or a fraction in [0, 1], not {budget!r}")


@dataclasses.dataclass
class BudgetPlan:
    """What the planner chose, and the predictions behind the choice (bytes above the
    graph's inputs, at the report's dims)."""

    budget: str  # as given
    target_bytes: int
    peak_without: int  # no recompute
    peak_floor: int  # every candidate recomputed
    predicted_peak: int  # with ``chosen``
    chosen: list[Occurrence]
    seconds: list[float]  # of each chosen occurrence, same order
    cost_model: CostModel

    @property
    def added_seconds(self) -> float:
        return float(sum(self.seconds))

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "target_bytes": self.target_bytes,
            "peak_without_recompute_bytes": self.peak_without,
            "peak_recomputing_everything_bytes": self.peak_floor,
            "predicted_peak_bytes": self.predicted_peak,
            "added_seconds": self.added_seconds,
            "cost_model": self.cost_model.to_dict(),
            "chosen": [
                {"entry": node_name(o.entry), "plan": f"{o.cluster}:{int(o.type)}", "saving_bytes": o.saving_bytes, "seconds": s}
                for o, s in zip(self.chosen, self.seconds)
            ],
        }

    def to_table(self, width: int | None = None) -> str:
        """The summary line, then each chosen subgraph: its entry, plan, bytes and time."""
        rows = [["entry", "plan", "saves MiB", "ms"]]
        rows += [
            [node_name(o.entry), f"{o.cluster}:{int(o.type)}", f"{(o.saving_bytes or 0) / _MIB:.2f}", f"{s * 1e3:.2f}"]
            for o, s in zip(self.chosen, self.seconds)
        ]
        lines = wrap_line(self.summary(), width)
        if self.chosen:
            lines += format_table(rows, width=width, right=(2, 3), wrap=(0, 1), indent="  ")
        return "\n".join(lines)

    def summary(self) -> str:
        return (
            f"memory budget {self.budget}: predicted step peak {self.predicted_peak / _MIB:.1f} MiB "
            f"(target {self.target_bytes / _MIB:.1f}; {self.peak_without / _MIB:.1f} without recompute, "
            f"{self.peak_floor / _MIB:.1f} recomputing every candidate) with {len(self.chosen)} subgraphs "
            f"recomputed, about {self.added_seconds * 1e3:.1f} ms more per step"
        )


def plan_for_budget(
    model: ir.Model, report: RecomputeReport, budget: int | float | str, cost_model: CostModel, finish: Finish | None = None
) -> BudgetPlan:
    """Choose the occurrences of ``report`` (an analysis of ``model``, every candidate of
    the graph) that fit ``budget`` at the least added time.  Read only.

    ``finish``: what the pipeline does after the rewrite that changes the step's memory
    (the dropout-mask replay, the ordering passes), applied to each graph tried, so that
    the peaks compared with the budget are those of the graph the pipeline ends with.
    """
    kind, amount = parse_budget(budget)
    ranked, seconds, search = _search(model, report, cost_model, finish)
    without, (best, floor) = search.peak(0), search.lowest()
    target = int(amount) if kind == "bytes" else int(floor + amount * (without - floor))
    if target < floor:
        raise PlanError(
            f"memory budget {budget!r} ({target / _MIB:.1f} MiB) is under the smallest step peak recompute reaches "
            f"in this graph, {floor / _MIB:.1f} MiB ({without / _MIB:.1f} MiB without recompute), at dims {report.dims}"
        )
    count, predicted = search.shortest_fitting(target, best)
    if finish is not None and count:
        # The passes after recompute that lower the peak stop once the target is met
        # (STEP_MEMORY_TARGET_KEY); a prefix fits with them stopping as it fits with them
        # going on, but its peak is then the stopped one.
        predicted = search.evaluate(count, target)
    logger.info("memory budget %s: %d of %d candidates, predicted peak %d bytes", budget, count, len(ranked), predicted)
    order = sorted(range(count), key=lambda i: ranked[i].position)
    return BudgetPlan(
        budget=str(budget),
        target_bytes=target,
        peak_without=without,
        peak_floor=floor,
        predicted_peak=predicted,
        chosen=[ranked[i] for i in order],
        seconds=[seconds[i] for i in order],
        cost_model=cost_model,
    )


def lowest_step_peak(model: ir.Model, report: RecomputeReport, cost_model: CostModel) -> int:
    """The lowest step peak recompute reaches in ``model``, the floor a budget is planned
    against (no plan is chosen).  Read only."""
    return _search(model, report, cost_model, None)[2].lowest()[1]


def _search(
    model: ir.Model, report: RecomputeReport, cost_model: CostModel, finish: Finish | None
) -> tuple[list[Occurrence], list[float], _PrefixSearch]:
    """The ranked occurrences, their seconds, and the search over the ranking's prefixes."""
    ranked, seconds, group_ends, dims = _rank(model, report, cost_model)

    def peak(count: int, target: int | None = None) -> int:
        return rewritten_peak(model, ranked[:count], report.positions, dims, finish, target)

    return ranked, seconds, _PrefixSearch(peak, len(ranked), group_ends)


class _PrefixSearch:
    """The step peak of the ranking's prefixes, each from a rewrite of a copy (memoized).

    The peak does not fall all the way: past some length, recomputing what other
    recomputations read (a layer's input) makes ORT run recomputations early, and it
    rises again.  So the lowest peak is looked for at evenly spaced lengths, and the
    shortest fitting prefix by bisection below the lowest.
    """

    SAMPLES = 8

    def __init__(self, evaluate, length: int, also: Sequence[int] = ()) -> None:
        """``also``: lengths to try besides the evenly spaced ones (where the ranking's
        groups end)."""
        self.evaluate = evaluate
        self.length = length
        self.also = list(also)
        self.known: dict[int, int] = {}

    def peak(self, count: int) -> int:
        if count not in self.known:
            self.known[count] = self.evaluate(count)
        return self.known[count]

    def lowest(self) -> tuple[int, int]:
        """(length, peak) of the lowest-peaked prefix among the sampled lengths."""
        lengths = sorted({round(self.length * i / self.SAMPLES) for i in range(self.SAMPLES + 1)} | set(self.also))
        best = min(lengths, key=lambda n: (self.peak(n), n))
        return best, self.peak(best)

    def shortest_fitting(self, target: int, best: int) -> tuple[int, int]:
        """(length, peak) of the shortest prefix up to ``best`` whose peak is at most ``target``."""
        if self.peak(0) <= target:
            return 0, self.peak(0)
        low, high = 0, best  # peak(low) > target >= peak(high)
        while high - low > 1:
            middle = (low + high) // 2
            if self.peak(middle) <= target:
                high = middle
            else:
                low = middle
        return high, self.peak(high)


def _rank(
    model: ir.Model, report: RecomputeReport, cost_model: CostModel
) -> tuple[list[Occurrence], list[float], list[int], dict[str, int]]:
    """Every entry's occurrence in the order the budget should take them, their seconds,
    where each group of the order ends, and every dim the step's sizes are taken at
    (internal and data-dependent ones included: the rewrites are predicted at them).

    Within a group: greedily, what lowers the interval model's peak most per second of
    recompute (where nothing lowers it, what frees most at the peak's position), then the
    rest by bytes freed per second.  The groups, a hint from the layer structure: inside
    the layers first, then outside them (the loss's and the embedding's neighbours), then
    the layers' inputs, whose recompute makes every recomputation reading them wait on it.
    One occurrence per entry: the full recompute where there is one (as levels 1 and 2).
    """
    # The order the recompute pass writes (its clones aside): the weight gradients' chains
    # run as soon as they can, which is what the budget is about.
    step = predict_step_memory(model, report.dims, graph_order=gradient_leaf_order(list(model.graph)))
    if not step.exact:
        raise PlanError(
            f"a memory budget needs every value's size, and {len(step.unknown)} are unknown at the dims "
            f"{report.dims} (e.g. {step.unknown[0]!r}): export with the batch's dims recorded, or give them"
        )
    found = [o for plan in report.plans for o in plan.occurrences]
    full = {o.entry for o in found if o.type == PlanType.RECOMPUTE}
    occurrences = [o for o in found if o.type == PlanType.RECOMPUTE or o.entry not in full]
    deltas = _Deltas(step, report, occurrences)
    seconds = np.array([cost_model.seconds(o.nodes, report.dims) for o in occurrences])
    order = _greedy(deltas, np.maximum(seconds, 1e-12))
    layers = find_layer_boundaries(get_partition(model).forward)

    def group(i: int) -> int:
        if any(layers.is_checkpoint(v) for v in occurrences[i].stashed):
            return 2
        return 0 if occurrences[i].layer is not None else 1

    order.sort(key=group)  # stable: the greedy order within each group
    ends = [sum(1 for i in order if group(i) <= g) for g in (0, 1)]
    return [occurrences[i] for i in order], [float(seconds[i]) for i in order], ends, step.dims


class _Deltas:
    """The step's live bytes over segments of execution order, and what each occurrence
    changes in each segment (a segment: positions over which no occurrence's effect
    changes, so a peak over it is its live maximum plus the effects)."""

    def __init__(self, step, report: RecomputeReport, occurrences: Sequence[Occurrence]) -> None:
        position = {node: i for i, node in enumerate(step.nodes)}
        reads = _ReadSpans(step.nodes, position, report)
        intervals = [_intervals(o, report, reads, position) for o in occurrences]
        cuts = sorted({0, len(step.nodes)} | {p for spans in intervals for s, e, _ in spans for p in (s, e + 1)})
        self.segment_max = np.maximum.reduceat(step.live, cuts[:-1]) if len(step.live) else np.zeros(0, np.int64)
        index = {c: i for i, c in enumerate(cuts)}
        self.matrix = np.zeros((len(occurrences), len(cuts) - 1), dtype=np.int64)
        for row, spans in enumerate(intervals):
            for start, end, nbytes in spans:
                self.matrix[row, index[start] : index[end + 1]] += nbytes
        self.entries = [o.entry for o in occurrences]

    def live(self, chosen: Sequence[int]) -> np.ndarray:
        return self.segment_max + self.matrix[list(chosen)].sum(axis=0)

    def peak(self, chosen: Sequence[int]) -> int:
        return int(self.live(chosen).max(initial=0))

    def most_saving_per_entry(self) -> list[int]:
        best: dict[ir.Node, int] = {}
        for row, entry in enumerate(self.entries):
            if entry not in best or self.matrix[row].sum() < self.matrix[best[entry]].sum():
                best[entry] = row
        return list(best.values())



def _greedy(deltas: _Deltas, seconds: np.ndarray) -> list[int]:
    ranked: list[int] = []
    taken: set[ir.Node] = set()
    live = deltas.live(ranked)
    while True:
        open_rows = [r for r, e in enumerate(deltas.entries) if e not in taken]
        if not open_rows:
            return ranked
        rows = deltas.matrix[open_rows]
        gain = live.max() - (live[None, :] + rows).max(axis=1)
        if gain.max() <= 0:  # a flat peak: free what is live at its position
            gain = -rows[:, int(live.argmax())]
        if gain.max() <= 0:
            break
        pick = open_rows[int(np.argmax(gain / seconds[open_rows]))]
        ranked.append(pick)
        taken.add(deltas.entries[pick])
        live = live + deltas.matrix[pick]
    rest = [r for r in deltas.most_saving_per_entry() if deltas.entries[r] not in taken]
    return ranked + sorted(rest, key=lambda r: deltas.matrix[r].sum() / seconds[r])


class _ReadSpans:
    """Where each buffer is read in forward and in backward (positions in execution
    order, over the buffer and every view of it), and the report's stashed buffers."""

    def __init__(self, nodes: Sequence[ir.Node], position: dict[ir.Node, int], report: RecomputeReport) -> None:
        self.buffers = memory.BufferMap()
        self.forward: dict[ir.Value, list[int]] = collections.defaultdict(list)
        self.backward: dict[ir.Value, list[int]] = collections.defaultdict(list)
        for node in nodes:
            side = self.backward if is_backward(node) else self.forward
            for value in node.inputs:
                if value is not None:
                    side[self.buffers.root(value)].append(position[node])
        # Once for every occurrence: each stashed buffer's stashed views and its bytes.
        self.stashed_views: dict[ir.Value, set[ir.Value]] = collections.defaultdict(set)
        for stashed in report.stashed:
            self.stashed_views[stashed.buffer].add(stashed.value)
        self.stashed_bytes = {s.buffer: s.bytes for s in report.stashed}


def _intervals(occ: Occurrence, report: RecomputeReport, reads: _ReadSpans, position: dict[ir.Node, int]) -> list[tuple[int, int, int]]:
    """(start, end, bytes) spans of execution order where recomputing ``occ`` changes the
    live bytes: minus each buffer it frees between forward and backward, plus each value
    it keeps until its last backward reader."""
    members = set(occ.nodes)
    views, sizes = reads.stashed_views, reads.stashed_bytes
    spans = []
    last_backward = 0
    for buffer in dict.fromkeys(reads.buffers.root(v) for v in occ.stashed):
        last_backward = max(last_backward, max(reads.backward.get(buffer, [0])))
        if buffer.producer() not in members or not views[buffer] <= set(occ.stashed) or not sizes.get(buffer):
            continue
        born = position[buffer.producer()]
        start = max(reads.forward.get(buffer, [born])) + 1
        end = min(reads.backward.get(buffer, [born])) - 1
        if start <= end:
            spans.append((start, end, -int(sizes[buffer])))
    for value in occ.kept:
        buffer = reads.buffers.root(value)
        if buffer.producer() is None or buffer in sizes:
            continue  # a graph input or a stashed buffer: alive anyway
        nbytes = memory.nbytes_at(buffer, report.dims) or 0
        start = max([*reads.forward.get(buffer, []), *reads.backward.get(buffer, []), position[buffer.producer()]]) + 1
        if nbytes and start <= last_backward:
            spans.append((start, last_backward, nbytes))
    return spans
