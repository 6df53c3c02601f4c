"""The candidate search: grows a recomputable subgraph up from each stashed activation's
producer and prices what recomputing it saves (rules: docs/design/recompute-analysis.md)."""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Sequence

import onnx_ir as ir
import sympy

from ortpass.analysis import memory
from ortpass.analysis.layers import LayerBoundaries, find_layer_boundaries
from ortpass.analysis.partition import Partition
from ortpass.analysis.plans import PlanType, cluster_id
from ortpass.analysis.recomputable_ops import (
    OptionalOutputs,
    RecomputableOp,
    lookup_recomputable,
    recomputable_function_of,
)
from ortpass.analysis.recompute.cost import ValueSizes, is_constant
from ortpass.analysis.recompute.small_values import absorb_free_small_values
from ortpass.analysis.recompute.result import (
    Occurrence,
    SkippedCandidate,
    StashedActivation,
    node_name,
)
from ortpass.conventions import is_onnx_domain

__all__ = ["CandidateSearch"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Growth:
    nodes: list[ir.Node]
    boundary: dict[ir.Value, None]  # ordered set
    kept: dict[ir.Value, None]
    compromised: bool


class CandidateSearch:
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
        # The stashed values viewing each buffer.
        self.stashed_views: dict[ir.Value, list[ir.Value]] = collections.defaultdict(list)
        for value in partition.stashed:
            self.stashed_views[self.buffers.root(value)].append(value)
        # Buffers kept alive anyway: stashed buffers, graph inputs, initializers.
        self.stashed_buffers = set(self.stashed_views)
        self.sizes = ValueSizes(self.buffers, self.stashed_buffers, min_elements)

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





    def layer_of(self, node: ir.Node) -> int | None:
        position = self.forward_position.get(node)
        return None if position is None else self.layers.layer_of(position)

    # -- candidates ------------------------------------------------------------------
    def stashed_activations(self) -> list[StashedActivation]:
        result = []
        for value in self.partition.stashed:
            buffer = self.buffers.root(value)
            expr = self.sizes.nbytes(buffer)
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
        if all(self.sizes.below_floor(self.buffers.root(v)) for v in outputs):
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
        small: dict[ir.Value, None] = {}  # kept by the size floor alone
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
                if index in ignored or producer is None or is_constant(producer) or self.kept_by_backward(value, outputs):
                    boundary[value] = None
                    continue
                if producer in members:
                    continue
                if self.sizes.below_floor(value):
                    boundary[value] = None
                    kept[value] = None
                    small[value] = None
                    continue
                if self.lookup(producer) is None:
                    return (
                        f"{node_name(producer)} ({producer.op_type}) is not recomputable and backward "
                        f"does not read its output {value.name!r}"
                    )
                if len(nodes) >= self.max_nodes:
                    return f"the subgraph would exceed {self.max_nodes} nodes"
                members.add(producer)
                nodes.append(producer)
                queue.append(producer)
        if small:
            absorb_free_small_values(self, outputs, nodes, members, boundary, kept, small)
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
            size = self.sizes.nbytes(buffer)
            if size is None:
                return f"the size of {buffer.name!r} is unknown"
            freed += size
        for value in growth.kept:
            buffer = self.buffers.root(value)
            if buffer in self.stashed_buffers or buffer.producer() is None:
                continue  # alive anyway
            size = self.sizes.nbytes(buffer)
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
            sizes = [self.sizes.nbytes(v) for v in unread]
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
