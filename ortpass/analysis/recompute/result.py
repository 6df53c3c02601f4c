"""What the recompute analysis found: stashed activations, plan records, occurrences and
skipped candidates, gathered in :class:`RecomputeReport` (tables, JSON, plots)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Iterable, Mapping, Sequence

import onnx_ir as ir
import sympy

from ortpass.analysis.plans import PlanSpec, PlanType, parse_plans
from ortpass.infra.text_table import format_table, wrap_line

__all__ = ["Occurrence", "PlanRecord", "RecomputeReport", "SkippedCandidate", "StashedActivation"]

logger = logging.getLogger(__name__)


def node_name(node: ir.Node) -> str:
    return node.name or f"<{node.op_type}>"


def _expr_str(expr: sympy.Expr | None) -> str | None:
    return None if expr is None else str(expr)


@dataclasses.dataclass(eq=False)
class StashedActivation:
    """A forward value backward reads, with the buffer that backs it and its size."""

    value: ir.Value
    producer: ir.Node
    buffer: ir.Value  # the value whose memory this one is (itself unless a view)
    symbolic_bytes: sympy.Expr | None  # of the buffer
    bytes: int | None  # at the report's dims
    layer: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.value.name,
            "producer": node_name(self.producer),
            "op_type": self.producer.op_type,
            "dtype": self.value.dtype.name if self.value.dtype is not None else None,
            "shape": [str(d) for d in self.value.shape] if self.value.shape is not None else None,
            "buffer": self.buffer.name,
            "bytes": self.bytes,
            "symbolic_bytes": _expr_str(self.symbolic_bytes),
            "layer": self.layer,
        }


@dataclasses.dataclass(eq=False)
class Occurrence:
    """One place where a plan applies: clone ``nodes`` (in this order) for backward.

    ``stashed`` are the entry's outputs backward reads; after the rewrite, backward reads
    the clones' outputs instead.  ``boundary`` are the forward values the clones read;
    ``kept`` those among them that stay alive only because of this plan (their cost is
    already subtracted from the saving).
    """

    cluster: str
    type: PlanType
    entry: ir.Node
    stashed: tuple[ir.Value, ...]
    nodes: tuple[ir.Node, ...]
    boundary: tuple[ir.Value, ...]
    kept: tuple[ir.Value, ...]
    symbolic_saving: sympy.Expr
    saving_bytes: int | None
    layer: int | None
    position: int  # of the entry in execution order

    def to_dict(self) -> dict[str, Any]:
        return {
            "entry": node_name(self.entry),
            "stashed": [v.name for v in self.stashed],
            "nodes": [node_name(n) for n in self.nodes],
            "boundary": [v.name for v in self.boundary],
            "kept": [v.name for v in self.kept],
            "saving_bytes": self.saving_bytes,
            "symbolic_saving": _expr_str(self.symbolic_saving),
            "layer": self.layer,
        }


@dataclasses.dataclass(eq=False)
class PlanRecord:
    """All occurrences of one cluster optimized one way (a plan string with count -1)."""

    cluster: str
    type: PlanType
    occurrences: list[Occurrence]

    @property
    def frequency(self) -> int:
        return len(self.occurrences)

    @property
    def saving_bytes(self) -> int | None:
        savings = [o.saving_bytes for o in self.occurrences]
        return None if any(s is None for s in savings) else sum(savings)  # type: ignore[misc]

    @functools.cached_property
    def symbolic_saving(self) -> sympy.Expr:
        # Cached: the report is built before anyone asks, and factoring is not free.
        return sympy.factor(sympy.Add(*(o.symbolic_saving for o in self.occurrences)))

    @property
    def spec(self) -> PlanSpec:
        return PlanSpec(self.cluster, self.type, -1)

    @property
    def plan_string(self) -> str:
        return str(self.spec)

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan_string,
            "cluster": self.cluster,
            "type": int(self.type),
            "frequency": self.frequency,
            "saving_bytes": self.saving_bytes,
            "symbolic_saving": _expr_str(self.symbolic_saving),
            "occurrences": [o.to_dict() for o in self.occurrences],
        }


@dataclasses.dataclass(frozen=True, eq=False)
class SkippedCandidate:
    """A node with stashed outputs for which no plan was found, and why (the reason the
    full recompute failed)."""

    entry: ir.Node
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"entry": node_name(self.entry), "op_type": self.entry.op_type, "reason": self.reason}


@dataclasses.dataclass(eq=False)
class RecomputeReport:
    """What :func:`find_recompute_candidates` found."""

    plans: list[PlanRecord]
    stashed: list[StashedActivation]
    layer_boundaries: list[ir.Node]
    skipped: list[SkippedCandidate]
    probe_level: int
    layer_boundary: bool
    dims: dict[str, int] | None
    dims_source: str  # "given", "export", "static" or "none"
    notes: list[str]
    # Execution order (graph order) of every node, computed once; the timeline needs it.
    positions: dict[ir.Node, int] = dataclasses.field(repr=False)

    def plan(self, cluster: str, type: int = 1) -> PlanRecord | None:
        """The plan of ``cluster`` with ``type``, or None."""
        for record in self.plans:
            if record.cluster == cluster and record.type == type:
                return record
        return None

    def plan_strings(self, types: Iterable[int] = (PlanType.RECOMPUTE,)) -> list[str]:
        wanted = set(types)
        return [p.plan_string for p in self.plans if p.type in wanted]

    def select(self, plans: str | PlanSpec | Sequence[str | PlanSpec] | None) -> list[Occurrence]:
        """The occurrences ``plans`` apply to, in execution order.

        Count N takes a plan's last N occurrences.  A stashed activation gets at most one
        subgraph: where a type-1 and a type-2 plan both cover an entry, type 1 (which
        saves more) wins.  Plans that match nothing here are logged and skipped.
        """
        chosen: dict[ir.Node, Occurrence] = {}
        for spec in parse_plans(plans):
            if spec.type == PlanType.NONE:
                continue
            record = self.plan(spec.cluster, spec.type)
            if record is None:
                logger.warning("recompute plan %s matches no candidate in this graph", spec)
                continue
            occurrences = record.occurrences if spec.count == -1 else record.occurrences[-spec.count :]
            for occ in occurrences:
                current = chosen.get(occ.entry)
                if current is None or occ.type < current.type:
                    chosen[occ.entry] = occ
        return sorted(chosen.values(), key=lambda o: o.position)

    @property
    def total_stashed_bytes(self) -> int | None:
        sizes = {}
        for s in self.stashed:
            sizes[s.buffer] = s.bytes
        return None if any(v is None for v in sizes.values()) else sum(sizes.values())  # type: ignore[misc]

    def to_table(
        self,
        enabled: str | Sequence[str | PlanSpec] | None = None,
        *,
        width: int | None = None,
        status: bool = True,
        title: str = "Recompute plans",
    ) -> str:
        """A table like ORTModule's: plan, ON/OFF, frequency, saving, symbolic saving.

        ``enabled``: the plans marked ON.  ``status=False`` leaves the Status column out
        (a report that enables nothing would mark every plan OFF, which reads as "this
        recompute does nothing").  ``title`` starts the first line.  ``width``: the
        characters a line may take; plan strings and savings wrap to fit (see
        :mod:`ortpass.infra.text_table`).  None: every row on one line.
        """
        on = {o.cluster + f":{int(o.type)}" for o in self.select(enabled)} if enabled else set()
        header = (
            f"{title} (probe level {self.probe_level}, layer boundary "
            f"{'ON' if self.layer_boundary else 'OFF'}, {len(self.layer_boundaries)} layer boundaries; "
            f"dims: {dims_text(self.dims, self.dims_source)})"
        )
        rows = [("", "Status", "Plan", "Freq", "Saving(B)", "Saving Symbolic(Bytes)")]
        for i, record in enumerate(self.plans, 1):
            state = "ON" if f"{record.cluster}:{int(record.type)}" in on else "OFF"
            saving = "?" if record.saving_bytes is None else f"{record.saving_bytes:,}"
            rows.append((f" - Plan {i}", state, record.plan_string, str(record.frequency), saving, str(record.symbolic_saving)))
        if not status:
            rows = [row[:1] + row[2:] for row in rows]
        wrap = {len(rows[0]) - 4, len(rows[0]) - 1}  # the plan string and the symbolic saving
        total = self.total_stashed_bytes
        footer = (
            f"Stashed activations: {len(self.stashed)}"
            + (f", {total:,} bytes in {len({s.buffer for s in self.stashed})} buffers" if total is not None else "")
            + f"; no plan for {len(self.skipped)} of their producers"
        )
        lines = [*wrap_line(header, width), *format_table(rows, width=width, wrap=wrap, rule=False), *wrap_line(footer, width)]
        for note in self.notes:
            lines += wrap_line(f"Note: {note}", width)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form of the report."""
        return {
            "probe_level": self.probe_level,
            "layer_boundary": self.layer_boundary,
            "dims": self.dims,
            "dims_source": self.dims_source,
            "notes": list(self.notes),
            "layer_boundaries": [node_name(n) for n in self.layer_boundaries],
            "stashed": [s.to_dict() for s in self.stashed],
            "total_stashed_bytes": self.total_stashed_bytes,
            "plans": [p.to_dict() for p in self.plans],
            "skipped": [s.to_dict() for s in self.skipped],
        }

    def plot(
        self, path: str | os.PathLike, plans: str | Sequence[str | PlanSpec] | None = None, *, baseline: str = "no recompute"
    ) -> str:
        """Write a PNG of live stashed bytes along execution order, without and with ``plans``
        (default: every type-1 plan); ``baseline`` labels the graph as analysed.  Returns the path."""
        from ortpass.analysis.recompute.timeline import plot_memory_timeline

        return plot_memory_timeline(self, path, plans, baseline=baseline)


def dims_text(dims: Mapping[str, int] | None, source: str) -> str:
    if dims is None:
        return "none (symbolic savings only)"
    if not dims:
        return "static shapes"
    shown = {k: v for k, v in dims.items() if not k.startswith("unk__")}  # internal ones: see the notes
    return ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) + f" [{source}]"
