"""Memory timeline of stashed activations: live bytes along execution order, without and
with a set of recompute plans, as numbers and as a PNG.

Model of a step (graph order is the execution order): a stashed buffer is born at the node
that produces it and lives until its last backward reader.  When a plan recomputes every
stashed view of a buffer, the buffer dies after its last forward reader instead and is
born again (by the clones) just before its first backward reader.  Values a plan keeps
(compromise cut values) then live until the last backward reader of what they replace.
Only stashed activations are counted: temporaries that die inside forward or backward are
the same with and without recompute.

matplotlib is imported only when a plot is drawn, with the non-interactive Agg backend.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Sequence

import numpy as np
import onnx_ir as ir

from ortpass.analysis import memory
from ortpass.analysis.plans import PlanSpec
from ortpass.conventions import SIDE_KEY

if TYPE_CHECKING:
    from ortpass.analysis.recompute.result import Occurrence, RecomputeReport

__all__ = ["MemoryTimeline", "memory_timeline", "plot_memory_timeline"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class MemoryTimeline:
    """Live stashed bytes after each node, without (``before``) and with (``after``) plans."""

    before: np.ndarray
    after: np.ndarray
    backward_start: int  # position of the first backward node
    plans: list[str]

    @property
    def peak_before(self) -> int:
        return int(self.before.max(initial=0))

    @property
    def peak_after(self) -> int:
        return int(self.after.max(initial=0))


@dataclasses.dataclass
class _Buffer:
    nbytes: int
    birth: int
    last_forward_read: int
    first_backward_read: int
    last_backward_read: int


def _reader_positions(values: Sequence[ir.Value], positions: dict[ir.Node, int]) -> tuple[list[int], list[int]]:
    forward, backward = [], []
    for value in values:
        for use in value.uses():
            position = positions.get(use.node)
            if position is None:
                continue
            is_backward = use.node.metadata_props.get(SIDE_KEY) == "backward"
            (backward if is_backward else forward).append(position)
    return forward, backward


def _stashed_buffers(report: RecomputeReport) -> dict[ir.Value, _Buffer]:
    views: dict[ir.Value, list[ir.Value]] = collections.defaultdict(list)
    sizes: dict[ir.Value, int | None] = {}
    for stashed in report.stashed:
        views[stashed.buffer].append(stashed.value)
        sizes[stashed.buffer] = stashed.bytes
    unknown = [b.name for b, size in sizes.items() if size is None]
    if unknown:
        raise ValueError(
            f"the memory timeline needs concrete sizes; {len(unknown)} stashed buffers (e.g. {unknown[0]!r}) "
            "depend on dims with no value: pass dims= to find_recompute_candidates"
        )
    buffers = {}
    for buffer, values in views.items():
        birth = report.positions[buffer.producer()] if buffer.producer() in report.positions else 0
        forward, backward = _reader_positions([buffer, *values], report.positions)
        buffers[buffer] = _Buffer(
            nbytes=sizes[buffer],  # type: ignore[arg-type]
            birth=birth,
            last_forward_read=max(forward, default=birth),
            first_backward_read=min(backward, default=birth),
            last_backward_read=max(backward, default=birth),
        )
    return buffers


def _add_interval(live: np.ndarray, start: int, end: int, nbytes: int) -> None:
    """Count ``nbytes`` as live after each node in [start, end] (a difference array)."""
    live[start] += nbytes
    live[end + 1] -= nbytes


def memory_timeline(report: RecomputeReport, occurrences: Sequence[Occurrence], plans: Sequence[str] = ()) -> MemoryTimeline:
    """Compute live stashed bytes without and with ``occurrences`` recomputed."""
    buffers = _stashed_buffers(report)
    length = len(report.positions)
    before = np.zeros(length + 1, dtype=np.int64)
    after = np.zeros(length + 1, dtype=np.int64)

    buffer_of = {s.value: s.buffer for s in report.stashed}
    recomputed_views: dict[ir.Value, set[ir.Value]] = collections.defaultdict(set)
    rebuilt: set[ir.Value] = set()  # buffers whose producer a selected subgraph recomputes
    for occ in occurrences:
        members = set(occ.nodes)
        for value in occ.stashed:
            buffer = buffer_of[value]
            recomputed_views[buffer].add(value)
            if buffer.producer() in members:
                rebuilt.add(buffer)
    stashed_views = collections.defaultdict(set)
    for s in report.stashed:
        stashed_views[s.buffer].add(s.value)

    for buffer, info in buffers.items():
        _add_interval(before, info.birth, info.last_backward_read, info.nbytes)
        freed = buffer in rebuilt and recomputed_views[buffer] == stashed_views[buffer]
        if freed:
            _add_interval(after, info.birth, info.last_forward_read, info.nbytes)
            _add_interval(after, info.first_backward_read, info.last_backward_read, info.nbytes)
        else:
            _add_interval(after, info.birth, info.last_backward_read, info.nbytes)

    buffer_map = memory.BufferMap()
    for occ in occurrences:
        for value in occ.kept:
            kept = buffer_map.root(value)
            if kept in buffers or kept.producer() not in report.positions:
                continue  # stashed or a graph input: alive anyway
            size = memory.evaluate(memory.symbolic_nbytes(kept), report.dims)
            if size is None:
                raise ValueError(f"the size of kept value {kept.name!r} is unknown at the report's dims")
            until = max(buffers[buffer_of[v]].last_backward_read for v in occ.stashed)
            _add_interval(after, report.positions[kept.producer()], until, size)

    backward_start = min(
        (p for n, p in report.positions.items() if n.metadata_props.get(SIDE_KEY) == "backward"), default=length
    )
    return MemoryTimeline(np.cumsum(before)[:-1], np.cumsum(after)[:-1], backward_start, list(plans))


def plot_memory_timeline(
    report: RecomputeReport,
    path: str | os.PathLike,
    plans: str | Sequence[str | PlanSpec] | None = None,
    *,
    baseline: str = "no recompute",
) -> str:
    """Draw the timeline of ``report`` with ``plans`` (default: every type-1 plan) to a PNG.

    ``baseline`` labels the graph as analysed (say what it already recomputes, where it
    does: "no recompute" would be wrong for the output of the recompute pass)."""
    if plans is None:
        plans = report.plan_strings()
    occurrences = report.select(plans)
    plan_names = sorted({f"{o.cluster}:{int(o.type)}" for o in occurrences})
    timeline = memory_timeline(report, occurrences, plan_names)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 1024 * 1024
    steps = np.arange(len(timeline.before))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.step(steps, timeline.before / mib, where="post", label=f"{baseline} (peak {timeline.peak_before / mib:.2f} MiB)")
    ax.step(
        steps,
        timeline.after / mib,
        where="post",
        label=f"{len(plan_names)} plans, {len(occurrences)} subgraphs (peak {timeline.peak_after / mib:.2f} MiB)",
    )
    ax.axvline(timeline.backward_start - 0.5, color="gray", linestyle="--", linewidth=1)
    ax.text(timeline.backward_start, ax.get_ylim()[1] * 0.95, " backward", color="gray", va="top")
    ax.set_xlabel("node (execution order)")
    ax.set_ylabel("live stashed activations (MiB)")
    ax.set_title("Stashed activation memory along one training step")
    ax.legend(loc="upper left")
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    logger.info("memory timeline written to %s", path)
    return path
