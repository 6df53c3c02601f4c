"""Recompute candidates of a training graph: which stashed activations can be recomputed in
backward instead of kept alive from forward, what that saves, and as which plans.

Rules (ORT's memory optimizer, ``recompute_analysis.cc``, restated; differences marked):

- *Stashed activations* are the forward values backward reads (the training graph's
  partition).  Candidates are grown per producing node (the *entry*), from all of its
  stashed outputs at once, as ORT does.
- *Growth* is breadth-first, upward from the entry, through producers in the allow-table
  (:mod:`ortpass.analysis.recomputable_ops`), skipping each op's ignored inputs.  An input
  is a *boundary* (the clone reads the forward value) when it is a graph input, an
  initializer or a Constant, when backward keeps its buffer anyway (it reads the value or
  another view of the same buffer), or when it is all-static and smaller than
  ``min_elements`` (ORT's floor).  A producer outside the table whose output
  backward does not read fails the candidate; so does growing past ``max_nodes`` (50).
- *Size floor*: a stashed buffer that is all-static and smaller than ``min_elements``
  (1Mi elements, ORT's floor) is not worth recomputing.
- *PythonOp ctx* (not in ORT): the stashed ctx of a registered recomputable Function is
  an int64 handle; its size is estimated as the tensor inputs it holds that nothing else
  keeps alive (``_Analysis.context_buffers``), for the floor and the savings.
- *Aliases* (better than ORT): savings are counted on buffers (:class:`BufferMap`).  A
  stashed view (Reshape, Squeeze, ...) frees memory only if the subgraph also recomputes
  the node that produced its buffer; a subgraph ending in a view (``MatMul+Transpose+
  Reshape+``) is found and credited with its buffer once.  A buffer that backward keeps
  through a view outside the candidate is a boundary; stashed views of one buffer made by
  different nodes form one candidate (the buffer is freed only if all are recomputed).
- *Savings* (better than ORT): the sum over every stashed output of the entry (ORT counts
  only the last one), minus what the plan newly keeps alive (compromise cut values, small
  static boundary inputs).  A candidate that saves nothing is reported as skipped.
- *Values nobody reads* (not in ORT): ORT 1.19.2 never frees a value that no node reads
  until the step ends.  A stashed output counts as freed only if, once backward reads
  its clone, the forward node stops producing it (it is optional and the recompute pass
  drops it, or the node is left with no reader and removed); a clone's output that
  neither backward nor another clone reads, and that is not optional, is charged
  against the saving (a Dropout recomputed for its mask alone frees 1 byte an element
  and computes 4 for nobody: skipped).
- *Compromise* (type 2): the growth stops at a Cast that widens (its input has fewer bytes
  per element than its output); the narrower input is kept instead.  Unlike ORT, a
  type-2 plan is also offered where the full (type 1) subgraph fails.
- *Layer-wise* (``layer_boundary=True``): only entries inside a detected layer
  (:mod:`ortpass.analysis.layers`, pre-LN and post-LN) are candidates, and a layer's input
  (input 0 of its pre-LN boundary LayerNorm, the output of a post-LN one) is kept, as a
  per-layer checkpoint, not recomputed; so is the last layer's output (what the head reads).

The analysis reads the model and never changes it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
from typing import Any, Iterable, Mapping, Sequence

import onnx_ir as ir
import sympy

from ortpass.analysis import memory
from ortpass.analysis.layers import LayerBoundaries, find_layer_boundaries
from ortpass.analysis.partition import Partition, get_partition
from ortpass.analysis.plans import PlanSpec, PlanType, cluster_id, parse_plans
from ortpass.analysis.recomputable_ops import (
    OptionalOutputs,
    ProbeLevel,
    RecomputableOp,
    lookup_recomputable,
    recomputable_function_of,
)
from ortpass.conventions import is_onnx_domain
from ortpass.infra.metadata import get_export_info

__all__ = [
    "DEFAULT_MAX_NODES",
    "DEFAULT_MIN_ELEMENTS",
    "StashedActivation",
    "Occurrence",
    "PlanRecord",
    "SkippedCandidate",
    "RecomputeReport",
    "find_recompute_candidates",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_NODES = 50
DEFAULT_MIN_ELEMENTS = 1024 * 1024


def _name(node: ir.Node) -> str:
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
            "producer": _name(self.producer),
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
            "entry": _name(self.entry),
            "stashed": [v.name for v in self.stashed],
            "nodes": [_name(n) for n in self.nodes],
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
        return {"entry": _name(self.entry), "op_type": self.entry.op_type, "reason": self.reason}


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

    def to_table(self, enabled: str | Sequence[str | PlanSpec] | None = None) -> str:
        """A table like ORTModule's: plan, ON/OFF, frequency, saving, symbolic saving."""
        on = {o.cluster + f":{int(o.type)}" for o in self.select(enabled)} if enabled else set()
        header = (
            f"Recompute plans (probe level {self.probe_level}, layer boundary "
            f"{'ON' if self.layer_boundary else 'OFF'}, {len(self.layer_boundaries)} layer boundaries; "
            f"dims: {_dims_text(self.dims, self.dims_source)})"
        )
        rows = [("", "Status", "Plan", "Freq", "Saving(B)", "Saving Symbolic(Bytes)")]
        for i, record in enumerate(self.plans, 1):
            status = "ON" if f"{record.cluster}:{int(record.type)}" in on else "OFF"
            saving = "?" if record.saving_bytes is None else f"{record.saving_bytes:,}"
            rows.append(
                (f" - Plan {i}", status, record.plan_string, str(record.frequency), saving, str(record.symbolic_saving))
            )
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [header]
        for row in rows:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        total = self.total_stashed_bytes
        lines.append(
            f"Stashed activations: {len(self.stashed)}"
            + (f", {total:,} bytes in {len({s.buffer for s in self.stashed})} buffers" if total is not None else "")
            + f"; no plan for {len(self.skipped)} of their producers"
        )
        lines.extend(f"Note: {note}" for note in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form of the report."""
        return {
            "probe_level": self.probe_level,
            "layer_boundary": self.layer_boundary,
            "dims": self.dims,
            "dims_source": self.dims_source,
            "notes": list(self.notes),
            "layer_boundaries": [_name(n) for n in self.layer_boundaries],
            "stashed": [s.to_dict() for s in self.stashed],
            "total_stashed_bytes": self.total_stashed_bytes,
            "plans": [p.to_dict() for p in self.plans],
            "skipped": [s.to_dict() for s in self.skipped],
        }

    def plot(self, path: str | os.PathLike, plans: str | Sequence[str | PlanSpec] | None = None) -> str:
        """Write a PNG of live stashed bytes along execution order, without and with ``plans``
        (default: every type-1 plan).  Returns the path."""
        from ortpass.analysis.timeline import plot_memory_timeline

        return plot_memory_timeline(self, path, plans)


def _dims_text(dims: Mapping[str, int] | None, source: str) -> str:
    if dims is None:
        return "none (symbolic savings only)"
    if not dims:
        return "static shapes"
    shown = {k: v for k, v in dims.items() if not k.startswith("unk__")}  # internal ones: see the notes
    return ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) + f" [{source}]"


@dataclasses.dataclass
class _Growth:
    nodes: list[ir.Node]
    boundary: dict[ir.Value, None]  # ordered set
    kept: dict[ir.Value, None]
    compromised: bool


class _Analysis:
    """State shared by every candidate of one analysis: built once, so each candidate costs
    only its own growth (at most ``max_nodes`` nodes), not a walk over the graph."""

    def __init__(
        self,
        model: ir.Model,
        nodes: Sequence[ir.Node],
        partition: Partition,
        probe_level: int,
        layer_boundary: bool,
        dims: dict[str, int] | None,
        max_nodes: int,
        min_elements: int,
    ):
        self.model = model
        self.partition = partition
        self.probe_level = probe_level
        self.layer_boundary = layer_boundary
        self.dims = dims
        self.max_nodes = max_nodes
        self.min_elements = min_elements
        self.opsets = dict(model.opset_imports)
        self.optional_outputs = OptionalOutputs(self.opsets)
        self.positions = {node: i for i, node in enumerate(nodes)}
        self.buffers = memory.BufferMap()
        self.stashed_set = set(partition.stashed)
        self.layers: LayerBoundaries = find_layer_boundaries(partition.forward)
        self.forward_position = {node: i for i, node in enumerate(partition.forward)}
        self._lookup_cache: dict[ir.Node, RecomputableOp | None] = {}
        self._op_lookup_cache: dict[tuple[str, str, int | None], RecomputableOp | None] = {}
        self._bytes_cache: dict[ir.Value, sympy.Expr | None] = {}
        self._numel_cache: dict[ir.Value, int | None] = {}
        # The stashed values viewing each buffer.
        self.stashed_views: dict[ir.Value, list[ir.Value]] = collections.defaultdict(list)
        for value in partition.stashed:
            self.stashed_views[self.buffers.root(value)].append(value)
        # Buffers kept alive anyway: stashed buffers, graph inputs, initializers.
        self.stashed_buffers = set(self.stashed_views)

    # -- small lookups ---------------------------------------------------------------
    def lookup(self, node: ir.Node) -> RecomputableOp | None:
        if node not in self._lookup_cache:
            self._lookup_cache[node] = self._lookup_op(node)
        return self._lookup_cache[node]

    def _lookup_op(self, node: ir.Node) -> RecomputableOp | None:
        """:func:`lookup_recomputable` of ``node``, asked once per op: the answer depends on
        the domain, op type and version alone, but for a PythonOp, whose ``func_name``
        decides (6.5k nodes asked about, 13 distinct ops, at 17.5k nodes)."""
        if node.op_type == "PythonOp":
            return lookup_recomputable(node, self.opsets, self.probe_level)
        key = (node.domain, node.op_type, node.version)
        if key not in self._op_lookup_cache:
            self._op_lookup_cache[key] = lookup_recomputable(node, self.opsets, self.probe_level)
        return self._op_lookup_cache[key]

    def nbytes(self, value: ir.Value) -> sympy.Expr | None:
        """Bytes ``value`` keeps alive (for a PythonOp's ctx, the estimate of
        :meth:`context_buffers`), or None when unknown."""
        if value not in self._bytes_cache:
            held = self.context_buffers(value)
            if held is None:
                size = memory.symbolic_nbytes(value)
            else:
                sizes = [memory.symbolic_nbytes(v) for v in held]
                size = None if None in sizes else sympy.Add(*sizes)  # type: ignore[arg-type]
            self._bytes_cache[value] = size
        return self._bytes_cache[value]

    def context_buffers(self, value: ir.Value) -> list[ir.Value] | None:
        """What the ctx output of a registered recomputable PythonOp holds, else None.

        The ctx is an int64 handle; the memory is what the Function saved in it, which
        ONNX does not show.  Estimate (FlashAttention-like functions save their tensor
        inputs, ``q, k, v``): the buffers of the PythonOp's tensor inputs that nothing else
        keeps alive, i.e. not read by backward and not graph inputs, initializers or
        Constants.  Inputs backward reads anyway cost the ctx nothing.
        """
        node = value.producer()
        if node is None or value.index() != 0 or recomputable_function_of(node) is None:
            return None
        roots = dict.fromkeys(self.buffers.root(v) for v in node.inputs if v is not None)
        return [
            root for root in roots
            if root.producer() is not None and not _is_constant(root.producer()) and root not in self.stashed_buffers
        ]

    def static_numel(self, value: ir.Value) -> int | None:
        """Element count when static (for a ctx, of what it holds), else None.  Memoized:
        growth asks about the same boundary values again and again (17k asks at 17.5k nodes)."""
        if value not in self._numel_cache:
            held = self.context_buffers(value)
            if held is None:
                self._numel_cache[value] = memory.static_numel(value)
            else:
                counts = [memory.static_numel(v) for v in held]
                self._numel_cache[value] = None if None in counts else sum(counts)  # type: ignore[arg-type]
        return self._numel_cache[value]

    def below_floor(self, value: ir.Value) -> bool:
        if self.min_elements <= 0:
            return False  # no element count is below a floor of 0: skip counting
        numel = self.static_numel(value)
        return numel is not None and numel < self.min_elements

    def layer_of(self, node: ir.Node) -> int | None:
        position = self.forward_position.get(node)
        return None if position is None else self.layers.layer_of(position)

    # -- candidates ------------------------------------------------------------------
    def stashed_activations(self) -> list[StashedActivation]:
        result = []
        for value in self.partition.stashed:
            buffer = self.buffers.root(value)
            expr = self.nbytes(buffer)
            result.append(
                StashedActivation(
                    value=value,
                    producer=value.producer(),  # type: ignore[arg-type]
                    buffer=buffer,
                    symbolic_bytes=expr,
                    bytes=memory.evaluate(expr, self.dims),
                    layer=self.layer_of(value.producer()),  # type: ignore[arg-type]
                )
            )
        return result

    def entries(self) -> list[tuple[ir.Node, list[ir.Value]]]:
        """Candidates: each node with stashed outputs, together with every other stashed
        view of the same buffers (a buffer is freed only if all its views are recomputed).
        The entry is the first producer in execution order; a value is in one candidate."""
        by_producer: dict[ir.Node, list[ir.Value]] = collections.defaultdict(list)
        for value in self.partition.stashed:
            by_producer[value.producer()].append(value)  # type: ignore[index]
        covered: set[ir.Value] = set()
        candidates = []
        for producer in sorted(by_producer, key=self.positions.__getitem__):
            if all(v in covered for v in by_producer[producer]):
                continue
            group = dict.fromkeys(by_producer[producer])
            for value in by_producer[producer]:
                for view in self.stashed_views[self.buffers.root(value)]:
                    group.update(dict.fromkeys(by_producer[view.producer()]))  # type: ignore[index]
            outputs = list(group)
            if len(outputs) > 1:  # most candidates are one value: nothing to sort
                outputs.sort(key=lambda v: (self.positions[v.producer()], v.index()))  # type: ignore[index]
            covered.update(outputs)
            candidates.append((outputs[0].producer(), outputs))
        return candidates  # type: ignore[return-value]

    def entry_rejection(self, entry: ir.Node, outputs: list[ir.Value]) -> str | None:
        """Why ``entry`` is not a candidate at all, or None."""
        if all(self.below_floor(self.buffers.root(v)) for v in outputs):
            return f"stashed outputs are all-static and smaller than {self.min_elements} elements"
        if self.layer_boundary:
            if self.layer_of(entry) is None:
                return "outside the detected layers"
            if any(self.layers.is_checkpoint(v) for v in outputs):
                return "its output is a layer's input or the last layer's output (kept as a checkpoint)"
        return None

    def kept_by_backward(self, value: ir.Value, outputs: list[ir.Value]) -> bool:
        """True when backward keeps ``value``'s buffer alive whatever this candidate does:
        it reads ``value``, or a view of its buffer other than the candidate's ``outputs``."""
        if value in self.stashed_set:
            return True
        views = self.stashed_views.get(self.buffers.root(value))
        return bool(views) and any(v not in outputs for v in views)

    def grow(self, outputs: list[ir.Value], compromise: bool) -> _Growth | str:
        """Grow the recompute subgraph producing ``outputs``; a string says why it failed."""
        starts = list(dict.fromkeys(v.producer() for v in outputs))
        for start in starts:
            if self.lookup(start) is None:  # type: ignore[arg-type]
                return f"{start.op_type} is not recomputable at probe level {self.probe_level}"  # type: ignore[union-attr]
        nodes = list(starts)
        members = set(starts)
        boundary: dict[ir.Value, None] = {}
        kept: dict[ir.Value, None] = {}
        compromised = False
        queue = collections.deque(starts)
        while queue:
            node = queue.popleft()
            if compromise and _widening_cast(node):
                # Keep the narrower input instead of recomputing what produced it.
                boundary[node.inputs[0]] = None  # type: ignore[index]
                if node.inputs[0] not in self.stashed_set:
                    kept[node.inputs[0]] = None  # type: ignore[index]
                    compromised = True
                continue
            ignored = self.lookup(node).ignored_inputs  # type: ignore[union-attr]
            for index, value in enumerate(node.inputs):
                if value is None:
                    continue
                producer = value.producer()
                if index in ignored or producer is None or _is_constant(producer) or self.kept_by_backward(value, outputs):
                    boundary[value] = None
                    continue
                if producer in members:
                    continue
                if self.below_floor(value):
                    boundary[value] = None
                    kept[value] = None
                    continue
                if self.lookup(producer) is None:
                    return (
                        f"{_name(producer)} ({producer.op_type}) is not recomputable and backward "
                        f"does not read its output {value.name!r}"
                    )
                if len(nodes) >= self.max_nodes:
                    return f"the subgraph would exceed {self.max_nodes} nodes"
                members.add(producer)
                nodes.append(producer)
                queue.append(producer)
        nodes.sort(key=self.positions.__getitem__)
        return _Growth(nodes, boundary, kept, compromised)

    def saving(self, outputs: list[ir.Value], growth: _Growth) -> sympy.Expr | str:
        """Bytes freed by recomputing ``outputs`` with ``growth`` (a string: why none)."""
        members = set(growth.nodes)
        rewired = set(outputs)
        freed = sympy.Integer(0)
        # Growth passes a buffer only when every stashed view of it is among ``outputs``
        # (see kept_by_backward), so a freed buffer is counted here and nowhere else.
        for buffer in dict.fromkeys(self.buffers.root(v) for v in outputs):
            if buffer.producer() not in members:
                continue  # a view of a buffer the clones read: it stays alive
            if any(self.left_unread(v, rewired) for v in self.stashed_views[buffer]):
                continue  # the forward node still writes it and nobody frees it
            size = self.nbytes(buffer)
            if size is None:
                return f"the size of {buffer.name!r} is unknown"
            freed += size
        for value in growth.kept:
            buffer = self.buffers.root(value)
            if buffer in self.stashed_buffers or buffer.producer() is None:
                continue  # alive anyway
            size = self.nbytes(buffer)
            if size is None:
                return f"the size of kept value {buffer.name!r} is unknown"
            freed -= size
        if freed.is_nonpositive:
            return "it frees no memory (its outputs are views of buffers that stay alive)"
        return freed

    def droppable(self, value: ir.Value) -> bool:
        """An output nobody reads that the rewrite drops (an optional output: see
        :func:`~ortpass.analysis.recomputable_ops.is_optional_output`)."""
        return value.index() in self.optional_outputs(value.producer())  # type: ignore[arg-type]

    def left_unread(self, value: ir.Value, rewired: set[ir.Value]) -> bool:
        """True when, once backward reads a clone of ``value``, the forward node still
        computes ``value`` for nobody.  ORT 1.19.2 frees a value after its last reader
        and never frees one nobody reads: it stays allocated until the step ends
        (measured: a forward Dropout whose mask only the clone's backward reads kept
        10 MiB per layer).  Such a value is not freed unless the rewrite can drop it:
        an optional output, or a producer whose every output ends up unread."""
        if value not in rewired or value.is_graph_output():
            return False
        if any(not self.partition.is_backward(user) for user, _ in value.uses()):
            return False  # forward still reads it; it dies after its last forward reader
        if self.droppable(value):
            return False
        producer = value.producer()
        if recomputable_function_of(producer) is not None:  # type: ignore[arg-type]
            return False  # the forward PythonOp then runs in inference mode: its ctx holds nothing
        return any(
            out.is_graph_output() or bool(out.uses())
            for out in producer.outputs  # type: ignore[union-attr]
            if out is not value and out not in rewired
        )

    def charge_unread_clone_outputs(self, occurrences: list[Occurrence]) -> list[Occurrence | SkippedCandidate]:
        """Subtract from each occurrence the outputs its clones would compute for nobody,
        and turn an occurrence that then frees nothing into a skipped candidate.

        Such an output is neither read by backward nor by another clone, and is not
        optional (ORT keeps it until the step ends; see :meth:`left_unread`).  A recomputed
        Dropout whose output backward does not need is the usual one: backward reads only
        its mask, so recomputing a 1-byte-per-element mask costs a 4-byte-per-element
        output.  Clones are shared between occurrences, so "another clone" means one of
        any full (type-1) occurrence found, as level 1 applies them all; a level-0 plan
        list that applies fewer can leave more unread.
        """
        members = {n for occ in occurrences if occ.type == PlanType.RECOMPUTE for n in occ.nodes}
        rewired = {v for occ in occurrences if occ.type == PlanType.RECOMPUTE for v in occ.stashed}
        charged: list[Occurrence | SkippedCandidate] = []
        for occ in occurrences:
            own = set(occ.nodes)
            # A node with one output never leaves it unread: it is a stashed output, or
            # growth took the node because a member reads it.  Most nodes: no readers to scan.
            unread = [
                value
                for node in occ.nodes
                if len(node.outputs) > 1
                for value in node.outputs
                if value not in rewired
                and value not in occ.stashed
                and not any(user in members or user in own for user, _ in value.uses())
                and not self.droppable(value)
            ]
            if not unread:  # most occurrences: nothing to charge
                charged.append(occ)
                continue
            sizes = [self.nbytes(v) for v in unread]
            if None in sizes:
                name = unread[sizes.index(None)].name
                reason = f"the size of {name!r}, which its clone would compute for nobody, is unknown"
                charged.append(SkippedCandidate(occ.entry, reason))
                continue
            saving = occ.symbolic_saving - sympy.Add(*sizes)  # type: ignore[arg-type]
            if saving.is_nonpositive:
                names = ", ".join(repr(v.name) for v in unread)
                charged.append(SkippedCandidate(
                    occ.entry,
                    f"its clones would compute {names} for nobody, which ORT keeps until the step ends: "
                    "more memory than recompute frees",
                ))
                continue
            charged.append(dataclasses.replace(occ, symbolic_saving=saving, saving_bytes=memory.evaluate(saving, self.dims)))
        return charged

    def occurrences(self, entry: ir.Node, outputs: list[ir.Value]) -> tuple[Occurrence | str, Occurrence | str]:
        """The full (type-1) and compromise (type-2) occurrences of a candidate; a string
        says why there is none."""
        full = self.grow(outputs, compromise=False)
        if isinstance(full, _Growth) and not any(_widening_cast(n) for n in full.nodes):
            # The compromise growth would take the same steps and find no Cast to stop at;
            # skipping it halves the growth time (most subgraphs have no Cast).
            compromise: _Growth | str = "no widening Cast to stop at"
        else:
            compromise = self.grow(outputs, compromise=True)
        return (
            self.occurrence(entry, outputs, PlanType.RECOMPUTE, full),
            self.occurrence(entry, outputs, PlanType.RECOMPUTE_WITH_COMPROMISE, compromise),
        )

    def occurrence(self, entry: ir.Node, outputs: list[ir.Value], plan_type: PlanType, growth: _Growth | str) -> Occurrence | str:
        if isinstance(growth, str):
            return growth
        if plan_type == PlanType.RECOMPUTE_WITH_COMPROMISE and not growth.compromised:
            return "no widening Cast to stop at"
        saved = self.saving(outputs, growth)
        if isinstance(saved, str):
            return saved
        return Occurrence(
            cluster=cluster_id(n.op_type for n in growth.nodes),
            type=plan_type,
            entry=entry,
            stashed=tuple(outputs),
            nodes=tuple(growth.nodes),
            boundary=tuple(growth.boundary),
            kept=tuple(growth.kept),
            symbolic_saving=saved,
            saving_bytes=memory.evaluate(saved, self.dims),
            layer=self.layer_of(entry),
            position=self.positions[entry],
        )


def _widening_cast(node: ir.Node) -> bool:
    if node.op_type != "Cast" or not is_onnx_domain(node.domain) or not node.inputs or node.inputs[0] is None:
        return False
    source, target = node.inputs[0].dtype, node.outputs[0].dtype
    if source is None or target is None or ir.DataType.STRING in (source, target):
        return False
    return source.bitwidth < target.bitwidth


def _is_constant(node: ir.Node) -> bool:
    return node.op_type == "Constant" and is_onnx_domain(node.domain)


def _resolve_dims(model: ir.Model, dims: Mapping[str, int] | None, symbols: set[str]) -> tuple[dict | None, str]:
    if dims is not None:
        bad = {k: v for k, v in dims.items() if not isinstance(k, str) or not isinstance(v, int) or v <= 0}
        if bad:
            raise ValueError(f"dims must map dim-param names to positive ints; bad entries: {bad}")
        return dict(dims), "given"
    exported = get_export_info(model).get("dims")
    if exported:
        return {str(k): int(v) for k, v in exported.items()}, "export"
    if not symbols:
        return {}, "static"
    return None, "none"


def _bind_internal_dims(model: ir.Model, dims: dict | None, symbols: set[str]) -> tuple[dict | None, list[str]]:
    """Add the values of graph-internal dims (named by shape inference) at ``dims``."""
    if not dims:
        return dims, []
    unbound = symbols - set(dims)
    if not unbound:
        return dims, []
    bound = memory.bind_internal_dims(model, dims, unbound)
    notes = []
    if bound:
        notes.append(
            "internal dims bound by shape inference at these dims: "
            + ", ".join(f"{k}={v}" for k, v in sorted(bound.items()))
        )
    return {**dims, **bound}, notes


def _dims_notes(dims: dict | None, symbols: set[str]) -> list[str]:
    if dims is None:
        return [f"the graph has symbolic dims ({', '.join(sorted(symbols))}) and no dims were given: savings are symbolic only"]
    missing = [s for s in sorted(symbols) if s not in dims]
    if missing:
        return [f"no value for dims {', '.join(missing)}: sizes that depend on them are left symbolic ('?')"]
    return []


def find_recompute_candidates(
    training_model: ir.Model,
    *,
    probe_level: int = ProbeLevel.ADVANCED,
    layer_boundary: bool = False,
    dims: Mapping[str, int] | None = None,
    max_nodes: int = DEFAULT_MAX_NODES,
    min_elements: int = DEFAULT_MIN_ELEMENTS,
) -> RecomputeReport:
    """Find recompute plans for the stashed activations of a forward+backward graph.

    Args:
        training_model: a training graph (``ortpass.training.build_training_graph``); read only.
        probe_level: ORT's levels: 0 basic ops, 1 also MatMul/Softmax/LayerNorm (advanced).
        layer_boundary: only candidates inside detected transformer layers, keeping each
            layer's input (see :mod:`ortpass.analysis.layers`).
        dims: dim-param values to evaluate sizes at; default: the dims recorded at export,
            or the concrete shapes of a static graph.  Without either, savings are symbolic.
        max_nodes: the largest subgraph to recompute (ORT: 50).
        min_elements: all-static tensors smaller than this are not recomputed (ORT: 1Mi).

    Raises:
        ortpass.errors.TrainingGraphError: the model is not a tagged training graph.
        ValueError: a bad ``probe_level`` or ``dims``.
    """
    if probe_level not in (ProbeLevel.BASIC, ProbeLevel.ADVANCED):
        raise ValueError(f"probe_level must be 0 (basic) or 1 (advanced, ORT's default), not {probe_level!r}")
    nodes = list(training_model.graph)  # one walk of onnx_ir's linked list, shared
    partition = get_partition(training_model, nodes)
    symbols = memory.graph_dim_params(partition.stashed)  # once: dims resolution and the notes need it
    resolved_dims, dims_source = _resolve_dims(training_model, dims, symbols)
    resolved_dims, notes = _bind_internal_dims(training_model, resolved_dims, symbols)
    analysis = _Analysis(
        training_model, nodes, partition, probe_level, layer_boundary, resolved_dims, max_nodes, min_elements
    )
    found: list[Occurrence] = []
    skipped: list[SkippedCandidate] = []
    for entry, outputs in analysis.entries():
        rejection = analysis.entry_rejection(entry, outputs)
        if rejection is not None:
            skipped.append(SkippedCandidate(entry, rejection))
            continue
        full, compromise = analysis.occurrences(entry, outputs)
        if isinstance(compromise, Occurrence) and isinstance(full, Occurrence) and compromise.nodes == full.nodes:
            compromise = "the same subgraph as the full recompute"
        occurrences = [occ for occ in (full, compromise) if isinstance(occ, Occurrence)]
        if not occurrences:
            skipped.append(SkippedCandidate(entry, full))  # type: ignore[arg-type]
        found += occurrences
    records: dict[tuple[str, PlanType], PlanRecord] = {}
    skipped_entries = {s.entry for s in skipped}
    for occ in analysis.charge_unread_clone_outputs(found):
        if isinstance(occ, SkippedCandidate):
            if occ.entry not in skipped_entries:  # its full and compromise plans: one reason
                skipped_entries.add(occ.entry)
                skipped.append(occ)
            continue
        key = (occ.cluster, occ.type)
        records.setdefault(key, PlanRecord(occ.cluster, occ.type, [])).occurrences.append(occ)
    plans = sorted(records.values(), key=lambda r: _sort_key(r, resolved_dims))
    stashed = analysis.stashed_activations()
    logger.info(
        "recompute analysis: %d stashed activations, %d plans, %d layer boundaries",
        len(stashed),
        len(plans),
        len(analysis.layers),
    )
    return RecomputeReport(
        plans=plans,
        stashed=stashed,
        layer_boundaries=list(analysis.layers.nodes),
        skipped=skipped,
        probe_level=probe_level,
        layer_boundary=layer_boundary,
        dims=resolved_dims,
        dims_source=dims_source,
        notes=notes + _dims_notes(resolved_dims, symbols),
        positions=analysis.positions,
    )


# Where savings cannot be evaluated, plans are ordered by their size at this value of
# every unbound dim: a stand-in for "large", so the dominant power of the dims wins.
_ORDERING_DIM = 1024


def _sort_key(record: PlanRecord, dims: Mapping[str, int] | None) -> tuple:
    saving = record.saving_bytes
    if saving is None:
        expr = record.symbolic_saving
        bound = {s: (dims or {}).get(s.name, _ORDERING_DIM) for s in expr.free_symbols}
        saving = int(expr.xreplace(bound))
    return (-saving, int(record.type), record.cluster)
