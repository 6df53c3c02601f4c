"""The ortpass pass manager: orders passes from their declarations, checks the model
after each one, rolls back a failing pass, and reports what every pass did.

:class:`PassManager` is itself an ``onnx_ir`` :class:`~onnx_ir.passes.FunctionalPass`: the
model it is given is never changed (the first in-place pass gets a copy; the passes after
it rewrite that copy, and :mod:`ortpass.infra.rollback` rebuilds what a failing pass was given),
it returns a new model, and it can be nested inside any onnx_ir ``PassManager``.  Its
result is a :class:`ManagerResult`, an ``onnx_ir`` ``PassResult`` that also carries the
:class:`PassReport`.

Ordering rules, from the declarations in :mod:`ortpass.infra.base`:

* phase: ``pre-grad`` passes run before the pass that provides ``"training-graph"``,
  ``post-grad`` passes after it (a post-grad pass implicitly requires ``"training-graph"``);
* ``requires_properties`` / ``provides_properties``: a pass runs after every other pass in
  the set that provides a property it requires; a requirement that no pass provides and
  that is not in ``assume`` is refused;
* ``runs_before`` / ``runs_after``: constraints between passes that are both in the set.

Where the declarations say nothing the given order is kept (a stable topological sort).
Plain onnx_ir passes (not ortpass passes) have phase ``"any"`` and no declarations.

Pipelines are written as text, MLIR style: ``pipeline("a,b(opt=1,name='x'),c")``.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import gc
import heapq
import inspect
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NoReturn, Sequence

import onnx
import onnx_ir as ir

from ortpass.infra.analysis_cache import AnalysisCache
from ortpass.infra.checks import (
    Checked,
    CheckedState,
    check_mode,
    full_check,
    incremental_check,
    input_check,
)
from ortpass.errors import (
    ModelLoadError,
    OrtpassError,
    PassFailedError,
    PassOrderingError,
    PipelineSpecError,
    elide,
)
from ortpass.io import write_file, write_with
from ortpass.infra.options import check_options
from ortpass.infra.base import CREATED_BY_KEY, PassDeclarations
from ortpass.infra.registry import get_pass
from ortpass.infra.rollback import RollbackPoint
from ortpass.infra.validate import check_model

__all__ = [
    "TRAINING_GRAPH",
    "ManagerResult",
    "PassManager",
    "PassRecord",
    "PassReport",
    "PassSpec",
    "order_passes",
    "parse_pipeline",
    "pipeline",
]

logger = logging.getLogger(__name__)

#: The property provided by the gradient build; it separates the two phases.
TRAINING_GRAPH = "training-graph"


# ---------------------------------------------------------------------------------------
# Ordering
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Declarations:
    name: str
    phase: str
    requires: frozenset[str]
    provides: frozenset[str]
    runs_before: frozenset[str]
    runs_after: frozenset[str]


def _pass_name(pass_: ir.passes.PassBase) -> str:
    return getattr(pass_, "pass_name", None) or getattr(pass_, "name", None) or type(pass_).__name__


def _declarations(pass_: ir.passes.PassBase) -> _Declarations:
    """Read a pass's declarations; a plain onnx_ir pass declares nothing."""
    if not isinstance(pass_, PassDeclarations):
        empty: frozenset[str] = frozenset()
        return _Declarations(_pass_name(pass_), "any", empty, empty, empty, empty)
    return _Declarations(
        name=pass_.pass_name,
        phase=pass_.phase,
        requires=frozenset(pass_.requires_properties),
        provides=frozenset(pass_.provides_properties),
        runs_before=frozenset(pass_.runs_before),
        runs_after=frozenset(pass_.runs_after),
    )


@dataclasses.dataclass(frozen=True)
class _Edge:
    first: int
    then: int
    reason: str


def _ordering_edges(decls: Sequence[_Declarations], assume: frozenset[str]) -> list[_Edge]:
    providers: dict[str, list[int]] = collections.defaultdict(list)
    for i, d in enumerate(decls):
        for prop in d.provides:
            providers[prop].append(i)
    edges: list[_Edge] = []
    for i, d in enumerate(decls):
        edges += _requirement_edges(i, decls, providers, assume)
        edges += _phase_edges(i, decls, providers, assume)
        for j, other in enumerate(decls):
            if j == i:
                continue
            if other.name in d.runs_before:
                edges.append(_Edge(i, j, f"{d.name!r} declares runs_before {other.name!r}"))
            if other.name in d.runs_after:
                edges.append(_Edge(j, i, f"{d.name!r} declares runs_after {other.name!r}"))
    return edges


def _requirement_edges(
    i: int, decls: Sequence[_Declarations], providers: dict[str, list[int]], assume: frozenset[str]
) -> list[_Edge]:
    d = decls[i]
    needs = set(d.requires)
    if d.phase == "post-grad":
        needs.add(TRAINING_GRAPH)  # post-grad passes run on the training graph
    edges = []
    for prop in sorted(needs):
        sources = [j for j in providers.get(prop, ()) if j != i]
        if not sources and prop not in assume:
            why = " (post-grad passes run on the training graph)" if prop == TRAINING_GRAPH else ""
            raise PassOrderingError(
                f"pass {d.name!r} requires {prop!r}{why}, but no pass in the set provides it; "
                f"add a pass that provides {prop!r}, or declare that the input model has it "
                f"with assume=[{prop!r}]"
            )
        edges += [_Edge(j, i, f"{d.name!r} requires {prop!r}, provided by {decls[j].name!r}") for j in sources]
    return edges


def _phase_edges(
    i: int, decls: Sequence[_Declarations], providers: dict[str, list[int]], assume: frozenset[str]
) -> list[_Edge]:
    d = decls[i]
    if d.phase != "pre-grad":
        return []
    builders = [j for j in providers.get(TRAINING_GRAPH, ()) if j != i]
    if not builders and TRAINING_GRAPH in assume:
        raise PassOrderingError(
            f"pass {d.name!r} is a pre-grad pass, but the input model is declared to be a training "
            f"graph already (assume contains {TRAINING_GRAPH!r})"
        )
    return [
        _Edge(i, j, f"{d.name!r} is pre-grad, so it runs before {decls[j].name!r} which provides {TRAINING_GRAPH!r}")
        for j in builders
    ]


def _stable_toposort(decls: Sequence[_Declarations], edges: Sequence[_Edge]) -> list[int]:
    """Kahn's algorithm taking the lowest given position among the ready passes."""
    n = len(decls)
    successors: dict[int, set[int]] = collections.defaultdict(set)
    indegree = [0] * n
    for e in edges:
        if e.then not in successors[e.first]:
            successors[e.first].add(e.then)
            indegree[e.then] += 1
    ready = [i for i in range(n) if indegree[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in successors[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, j)
    if len(order) < n:
        raise _cycle_error(decls, edges, {i for i in range(n) if indegree[i] > 0})
    return order


def _cycle_error(decls: Sequence[_Declarations], edges: Sequence[_Edge], stuck: set[int]) -> PassOrderingError:
    # Every pass left over has a predecessor that is also left over, so walking
    # predecessors from any of them must come back to a pass already seen: a cycle.
    incoming = {e.then: e for e in edges if e.first in stuck and e.then in stuck}
    path: list[int] = []
    node = min(stuck)
    while node not in path:
        path.append(node)
        node = incoming[node].first
    cycle = path[path.index(node):][::-1]
    steps = [incoming[j].reason for j in cycle[1:] + cycle[:1]]
    names = " -> ".join(decls[i].name for i in cycle + cycle[:1])
    return PassOrderingError(f"the passes cannot be ordered, they form a cycle: {names} ({'; '.join(steps)})")


def order_passes(passes: Sequence[ir.passes.PassBase], *, assume: Iterable[str] = ()) -> list[ir.passes.PassBase]:
    """Return ``passes`` in the order their declarations demand (see the module docstring).

    Raises PassOrderingError naming the passes when there is a cycle, a requirement that
    nobody provides, or a pre-grad pass for a model assumed to be a training graph.
    """
    decls = [_declarations(p) for p in passes]
    edges = _ordering_edges(decls, frozenset(assume))
    return [passes[i] for i in _stable_toposort(decls, edges)]


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class PassRecord:
    """What one pass did.  ``added``/``removed`` count nodes by op type
    (``domain::Op`` outside the default domain); ``stats`` is the pass's own statistics."""

    position: int
    name: str
    seconds: float = 0.0
    check_seconds: float = 0.0
    modified: bool = False
    nodes_before: int = 0
    nodes_after: int = 0
    added: dict[str, int] = dataclasses.field(default_factory=dict)
    removed: dict[str, int] = dataclasses.field(default_factory=dict)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    dump_path: str | None = None
    # For a failed pass, seconds/added/removed/stats describe the attempt that was rolled back.

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclasses.dataclass
class PassReport:
    """Per-pass records of one pass-manager run, in the order the passes ran."""

    records: list[PassRecord] = dataclasses.field(default_factory=list)
    #: The onnx checker on the model the run returned (the incremental mode's last check).
    final_check_seconds: float = 0.0

    @property
    def modified(self) -> bool:
        return any(r.modified and not r.failed for r in self.records)

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds + r.check_seconds for r in self.records) + self.final_check_seconds

    def __getitem__(self, name: str) -> PassRecord:
        """The record of the first pass called ``name``."""
        for record in self.records:
            if record.name == name:
                return record
        raise KeyError(f"no pass named {name!r} in this report; passes: {[r.name for r in self.records]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "passes": [dataclasses.asdict(r) for r in self.records],
            "final_check_seconds": self.final_check_seconds,
            "total_seconds": self.total_seconds,
            "modified": self.modified,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PassReport:
        return cls([PassRecord(**r) for r in data["passes"]], data.get("final_check_seconds", 0.0))

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> PassReport:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        write_file(path, self.to_json() + "\n")

    def to_table(self) -> str:
        """A fixed-width text table, one row per pass, and a total line."""
        header = ("#", "pass", "ms", "check ms", "changed", "nodes", "added", "removed", "stats")
        rows = [header] + [_table_row(r) for r in self.records]
        widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
        numeric = {0, 2, 3}  # right-align numbers
        lines = [
            "  ".join(cell.rjust(w) if c in numeric else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.records:
            first, last = self.records[0], self.records[-1]
            nodes_after = last.nodes_before if last.failed else last.nodes_after
            final_check = f" (final check {self.final_check_seconds * 1000:.1f})" if self.final_check_seconds else ""
            lines.append(
                f"total: {len(self.records)} passes, {self.total_seconds * 1000:.1f} ms{final_check}, "
                f"nodes {first.nodes_before} -> {nodes_after}"
            )
        else:
            lines.append("total: no passes ran")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_table()


def _table_row(r: PassRecord) -> tuple[str, ...]:
    changed = "FAILED" if r.failed else ("yes" if r.modified else "no")
    nodes = f"{r.nodes_before}" if r.failed else f"{r.nodes_before} -> {r.nodes_after}"
    return (
        str(r.position),
        r.name,
        f"{r.seconds * 1000:.1f}",
        f"{r.check_seconds * 1000:.1f}",
        changed,
        nodes,
        _format_counts(r.added, "+"),
        _format_counts(r.removed, "-"),
        " ".join(r.error.split()) if r.error else _format_stats(r.stats),  # one line per row
    )


#: Op types listed per table cell; a gradient build adds dozens (the JSON report has all).
_TABLE_OPS = 6


def _format_counts(counts: dict[str, int], sign: str) -> str:
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    cell = " ".join(f"{op}{sign}{n}" for op, n in ranked[:_TABLE_OPS])
    if len(ranked) > _TABLE_OPS:
        rest = ranked[_TABLE_OPS:]
        cell += f" (+{len(rest)} types, {sign}{sum(n for _, n in rest)})"
    return cell or "-"


def _format_stats(stats: dict[str, Any]) -> str:
    parts = [f"{key}={value}" for key, value in stats.get("counts", {}).items()]
    parts += [f"{key}: {len(values)} noted" for key, values in stats.get("notes", {}).items()]
    return "; ".join(parts) or "-"


@dataclasses.dataclass
class ManagerResult(ir.passes.PassResult):
    """An onnx_ir PassResult that also carries the manager's report, and ``model``
    serialized as the run's last onnx checker accepted it (None where no check serialized
    the model returned): saving it spares serializing the model again."""

    report: PassReport
    proto: onnx.ModelProto | None = None


# ---------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a run, then restore it as it was.

    An IR graph is many small objects in reference cycles (nodes and their values), so
    each full collection walks every one of them, and passes that allocate trigger such
    collections over and over.  The default pipeline on a 192-layer decoder (17.5k
    training nodes) took 12.9-16.8 s over four runs with the collector on and 11.4-13.9 s
    with it paused, most of it in the gradient build.  Garbage without cycles is still
    freed at once; cycles wait until the run ends.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _all_nodes(model: ir.Model) -> list[ir.Node]:
    """Every node of ``model``: its graph's, their subgraphs' and its functions'.

    The graph's own nodes are listed straight from its node list; onnx_ir's recursive
    iterator (``Graph.all_nodes``), which looks for subgraphs under every attribute, took
    30 ms a call on a 17.5k-node training graph, and the manager lists the nodes twice a
    pass.  Reading the attributes through ``Attributes.data`` halved a listing's time
    (about 25 to 12 ms).
    """
    nodes = []
    for node in model.graph:
        nodes.append(node)
        attributes = node.attributes.data  # a UserDict's dict: iterated at dict speed
        if attributes:
            for attr in attributes.values():
                kind = attr.type
                if kind == ir.AttributeType.GRAPH:
                    nodes.extend(ir.traversal.RecursiveGraphIterator(attr.value))
                elif kind == ir.AttributeType.GRAPHS:
                    for subgraph in attr.value:
                        nodes.extend(ir.traversal.RecursiveGraphIterator(subgraph))
    for function in model.functions.values():
        nodes.extend(ir.traversal.RecursiveGraphIterator(function))
    return nodes


def _op_label(node: ir.Node) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def _signature(node: ir.Node) -> tuple:
    return (node.domain, node.op_type, node.name, tuple(v.name for v in node.outputs))


def _diff_nodes(before: list[ir.Node], after: list[ir.Node]) -> tuple[list[ir.Node], list[ir.Node]]:
    """Nodes created and nodes removed by a pass, by node identity.

    ``before`` must hold the node objects themselves (not their ids) so that a removed
    node cannot be freed and its id reused by a new one while we compare.  A pass that
    rebuilt the whole model (a functional pass that cloned it) shares no node objects
    with its input; then nodes are matched by (domain, op type, name, output names).
    """
    # Sets of the nodes themselves: ir.Node compares and hashes by identity, and building
    # them takes no Python call per node.
    before_set, after_set = set(before), set(after)
    if before and after and before_set.isdisjoint(after_set):
        return _multiset_minus(after, before), _multiset_minus(before, after)
    return [n for n in after if n not in before_set], [n for n in before if n not in after_set]


def _multiset_minus(nodes: list[ir.Node], others: list[ir.Node]) -> list[ir.Node]:
    remaining = collections.Counter(_signature(n) for n in others)
    extra = []
    for node in nodes:
        key = _signature(node)
        if remaining[key]:
            remaining[key] -= 1
        else:
            extra.append(node)
    return extra


def _count_ops(nodes: Iterable[ir.Node]) -> dict[str, int]:
    return dict(sorted(collections.Counter(_op_label(n) for n in nodes).items()))


def _stats_of(pass_: ir.passes.PassBase) -> dict[str, Any]:
    stats = getattr(pass_, "stats", None)
    if not isinstance(stats, dict):
        return {}
    # A JSON round trip copies the statistics (the pass resets them on its next run) and
    # makes them serializable; values JSON cannot hold are written as their str().
    return json.loads(json.dumps(stats, default=str))


#: How to get back the model a pass was given: the model, and None or a sentence saying
#: that only an earlier state could be given back (see :mod:`ortpass.infra.rollback`).
Rollback = Callable[[], tuple[ir.Model, str | None]]


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__
    if cause is not None:  # onnx_ir wraps failed pre/postconditions; the cause says why
        text += f" (caused by {type(cause).__name__}: {cause})"
    return text


class PassManager(ir.passes.FunctionalPass):
    """Runs a set of passes in the order their declarations demand, checking after each.

    Args:
        passes: pass instances, in any order (see the module docstring for the rules).
        assume: properties the input model already has (e.g. ``["training-graph"]`` to run
            post-grad passes on a model that is already a training graph).
        check: how the model is checked, first the input (so a bad input is not blamed on
            the first pass), then after every pass.  A pass that reports ``modified=False``
            and adds or removes no node is trusted and not checked again.  The modes:

            ``"full"`` (or ``True``): serialize with ``ir.to_proto`` and run
            ``onnx.checker.check_model``.  The checker validates graph structure
            (topological order, single assignment, every input defined, every graph
            output defined, opset imports present), every node against its schema
            (ai.onnx and ai.onnx.ml; it has no schemas for ``com.microsoft`` ops and lets
            them through), initializers and the graph inputs' and outputs' types.  The
            serialization is also the rollback point.

            ``"incremental"`` (the default): the checker's rules on the IR, without
            serializing the model, first on the whole input (with the checker itself on
            the model's header: IR version, opset imports), then after each pass:
            the structural rules over the whole graph, ``check_value_info`` on the graph
            inputs and outputs that changed, and ``check_node`` / ``check_tensor`` only on
            the nodes and initializers that are new or changed (a node's op, domain,
            attributes, or input or output values) since the last check, ``check_node``
            once per signature (op, domain and its opset version, attributes by value,
            which inputs and outputs are present: all it decides on).  It falls back to
            the full check when the IR version changes, an opset import changes or goes
            away, the model has functions, or a changed node holds a subgraph.  What it
            does not see: a change made inside an existing attribute or initializer
            tensor (its data mutated in place), and a value type or shape that
            ``ir.to_proto`` could not write.  So the run ends with
            the full check of the model it returns; should that refuse it, the passes run
            again from the input, with the full check after each, and the first whose
            output is refused fails as it would have in the full mode.  Should a pass
            fail, or the final check refuse, the checker itself looks at the input first,
            and a bad input is named instead of the pass.  So the input and the output
            get the full mode's verdict, a pass whose output only the onnx checker
            refuses is still named, and the models in between are checked for a sixth
            to a twelfth of the full mode's cost (``benchmarks/scaling.md``).

            ``"none"`` (or ``False``): no check; the input is still never changed and a
            pass that raises is still rolled back.

            Without the full check's serialization to go back to, a failing pass's input
            is rebuilt by running the passes before it again from the latest copy (see
            :mod:`ortpass.infra.rollback`): the manager copies the model only where that would
            take longer than ten copies.  This assumes passes are deterministic.

            The pass's own ``ensures`` postconditions run through onnx_ir's
            ``PassBase.__call__`` in every mode.
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
        self.check = check_mode(check)  # "full", "incremental" or "none"
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.instruments = tuple(instruments)
        self.report: PassReport | None = None

    def __repr__(self) -> str:
        return f"PassManager([{', '.join(_pass_name(p) for p in self.passes)}])"

    def call(self, model: ir.Model) -> ManagerResult:
        with _cyclic_gc_paused():
            return self._run(model)

    def _run(self, model: ir.Model) -> ManagerResult:
        report = PassReport()
        self.report = report
        # What the latest check accepted (see Checked).  In the full mode it is the
        # serialized form of the model each pass is given: the rollback point, so
        # in-place passes can work on the manager's own copy instead of a fresh clone each
        # (on a 6k-node training graph a clone costs about as much as the recompute analysis).
        checked = self._check_input(model)
        self._refuse_bad_input(model)
        self._notify("run_begin", self.passes, model)
        current = model
        cache = AnalysisCache()
        point = RollbackPoint.at_input(model)
        nodes = None  # the nodes of ``current``, as the pass before left them
        try:
            try:
                for position, pass_ in enumerate(self.passes, start=1):
                    current, checked, nodes = self._run_pass(
                        position, pass_, current, report, checked, cache, point, nodes, owned=current is not model
                    )
            except PassFailedError as failure:
                if self.check == "incremental":
                    self._refuse_input_if_the_checker_does(model, f"pass {failure.pass_name!r} failed: {failure.reason}")
                raise
            if self.check == "incremental" and not all(map(self._unchanged, report.records)):
                checked = self._final_check(model, current, report)
        finally:
            self._notify("run_end", current, report)
        if current is model:  # nothing replaced the input; a functional pass returns a new model
            current = model.clone()
        proto = checked if isinstance(checked, onnx.ModelProto) else None
        return ManagerResult(current, report.modified, report, proto)

    def _check(self, model: ir.Model, previous: Checked) -> Checked:
        """Check ``model`` in this manager's mode; ``previous``: what the check before accepted."""
        if self.check == "full":
            return full_check(model)
        if self.check == "incremental":
            return incremental_check(model, previous if isinstance(previous, CheckedState) else None)
        return None

    def _final_check(self, model: ir.Model, out: ir.Model, report: PassReport) -> onnx.ModelProto:
        """The onnx checker itself on ``out``, the model the run returns, after the
        incremental checks (so what they cannot see, like a tensor changed in place,
        does not leave the manager); returns the serialization it accepted.  Should it
        refuse ``out`` and accept the input, the passes run again from ``model`` with the
        checker after each, to name the first whose output it refuses."""
        start = time.perf_counter()
        try:
            proto = full_check(out)
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

    def _check_input(self, model: ir.Model) -> Checked:
        """Check the input; in the incremental mode with the checker's rules on the IR
        and the checker itself on the model's header (:func:`ortpass.infra.checks.input_check`),
        since serializing the model is most of a full check's cost.  Should a pass fail
        later, the checker itself looks at the input before the pass is blamed."""
        try:
            if self.check == "incremental":
                return input_check(model)
            return self._check(model, None)
        except Exception as exc:
            raise ModelLoadError(f"the input model fails the onnx checker before any pass ran: {_describe(exc)}") from exc

    def _run_pass(
        self,
        position: int,
        pass_: ir.passes.PassBase,
        model: ir.Model,
        report: PassReport,
        checked: Checked,
        cache: AnalysisCache,
        point: RollbackPoint,
        nodes: list[ir.Node] | None,
        *,
        owned: bool,
    ) -> tuple[ir.Model, Checked, list[ir.Node]]:
        """Run one pass; return the model after it, what its check accepted and its nodes.

        ``owned``: ``model`` is the manager's own (not the caller's).  ``checked``: what
        the check of ``model`` accepted (its serialization in the full mode).  ``point``:
        how to rebuild ``model``, moved on as the pass succeeds.  ``nodes``: the nodes of
        ``model`` as the pass before left them (None for the first), listed again only
        if the pass works on a copy (instruments observe, they do not change the model).
        """
        record = PassRecord(position, _pass_name(pass_))
        self._notify("before_pass", pass_, model)
        work, rollback, checked = self._prepare(pass_, model, checked, point, owned=owned)
        # The objects, kept alive for the identity diff.
        before = nodes if nodes is not None and work is model else _all_nodes(work)
        record.nodes_before = len(before)
        start = time.perf_counter()
        try:
            result = self._call_with_cache(pass_, work, cache)
        except Exception as exc:
            record.seconds = time.perf_counter() - start
            self._fail(pass_, record, rollback, report, _describe(exc), exc)
        record.seconds = time.perf_counter() - start
        record.stats = _stats_of(pass_)
        after = self._record_changes(record, result, before)
        if not self._unchanged(record):
            cache.keep_only(getattr(pass_, "preserves_analyses", ()))
        if self._unchanged(record) and checked is not None:
            accepted = checked  # nothing to check: what held for its input still holds
        else:
            accepted = self._check_output(pass_, record, rollback, report, result.model, checked)
        if isinstance(accepted, onnx.ModelProto):
            point.move_to_serialized(accepted, record.name)
        elif not self._unchanged(record):
            point.ran(record.name, pass_, record.seconds, record.nodes_after)
        if record.modified and self.dump_dir is not None:
            proto = accepted if isinstance(accepted, onnx.ModelProto) else ir.to_proto(result.model)
            record.dump_path = self._dump(proto, f"{position:02d}_{record.name}.onnx")
        report.records.append(record)
        self._notify("after_pass", pass_, result.model, record)
        return result.model, accepted, after

    def _prepare(
        self, pass_: ir.passes.PassBase, model: ir.Model, checked: Checked, point: RollbackPoint, *, owned: bool
    ) -> tuple[ir.Model, Rollback, Checked]:
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
            rebased = checked.rebased(work) if isinstance(checked, CheckedState) else checked
            return work, lambda: (model, None), rebased
        point.copy_if_cheaper(model)
        return model, lambda: point.rebuild(self._run_again), checked

    def _run_again(self, pass_: ir.passes.PassBase, model: ir.Model) -> tuple[ir.Model, int]:
        """Run ``pass_`` once more, to rebuild a rollback point: no check, no instrument,
        no dump; the nodes it creates are tagged as the first time."""
        before = _all_nodes(model)
        result = self._call_with_cache(pass_, model, AnalysisCache())
        record = PassRecord(0, _pass_name(pass_))
        self._record_changes(record, result, before)
        return result.model, record.nodes_after

    def _record_changes(self, record: PassRecord, result: ir.passes.PassResult, before: list[ir.Node]) -> list[ir.Node]:
        """Fill in ``record``'s changes, tag the nodes the pass created; return the nodes after it."""
        after = _all_nodes(result.model)
        added, removed = _diff_nodes(before, after)
        for node in added:
            node.metadata_props.setdefault(CREATED_BY_KEY, record.name)
        record.modified = bool(result.modified)
        record.nodes_after = len(after)
        record.added = _count_ops(added)
        record.removed = _count_ops(removed)
        if not record.modified and (added or removed):
            logger.warning(
                "pass %r reported modified=False but added %s and removed %s", record.name, record.added, record.removed
            )
        return after

    @staticmethod
    def _call_with_cache(pass_: ir.passes.PassBase, model: ir.Model, cache: AnalysisCache) -> ir.passes.PassResult:
        """Run ``pass_``, lending an ortpass pass the run's analysis cache meanwhile."""
        if not isinstance(pass_, PassDeclarations):
            return pass_(model)
        pass_.analysis_cache = cache
        try:
            return pass_(model)
        finally:
            pass_.analysis_cache = None

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
        previous: Checked,
    ) -> Checked:
        if self.check == "none":
            return None
        start = time.perf_counter()
        try:
            accepted = self._check(out, previous)
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
            record.stats = _stats_of(pass_)
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


# ---------------------------------------------------------------------------------------
# Pipeline text
# ---------------------------------------------------------------------------------------

_PASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_OPTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SCALARS = (bool, int, float, str, type(None))
_CLOSING = {"(": ")", "[": "]", "{": "}"}


@dataclasses.dataclass(frozen=True)
class PassSpec:
    """One pass of a parsed pipeline: its name, options, and where it starts in the text."""

    name: str
    options: dict[str, Any]
    position: int


class _PipelineParser:
    """Recursive descent over ``name[(key=value, ...)](, name[(...)])*``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, message: str, pos: int | None = None) -> PipelineSpecError:
        where = self.pos if pos is None else pos
        return PipelineSpecError(f"pipeline {_quote_around(self.text, where)}, position {where}: {message}")

    def peek(self) -> str:
        self.skip_space()
        return self.text[self.pos : self.pos + 1]

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def found(self) -> str:
        return repr(self.text[self.pos]) if self.pos < len(self.text) else "the end of the text"

    def match(self, pattern: re.Pattern[str], what: str) -> str:
        self.skip_space()
        m = pattern.match(self.text, self.pos)
        if m is None:
            raise self.error(f"expected {what}, found {self.found()}")
        self.pos = m.end()
        return m.group()

    def parse(self) -> list[PassSpec]:
        if not self.peek():
            raise self.error("the pipeline is empty; name at least one pass")
        specs = [self.parse_pass()]
        while self.peek() == ",":
            self.pos += 1
            specs.append(self.parse_pass())
        if self.peek():
            raise self.error(f"expected ',' between passes, found {self.found()}")
        return specs

    def parse_pass(self) -> PassSpec:
        self.skip_space()
        start = self.pos
        name = self.match(_PASS_NAME, "a pass name")
        options: dict[str, Any] = {}
        if self.peek() == "(":
            self.pos += 1
            if self.peek() == ")":
                self.pos += 1
            else:
                self.parse_options(name, options)
        return PassSpec(name, options, start)

    def parse_options(self, pass_name: str, options: dict[str, Any]) -> None:
        while True:
            self.skip_space()
            key_pos = self.pos
            key = self.match(_OPTION_NAME, f"an option name in pass {pass_name!r}")
            if key in options:
                raise self.error(f"option {key!r} of pass {pass_name!r} is given twice", key_pos)
            if self.peek() != "=":
                raise self.error(f"expected '=' after option {key!r} of pass {pass_name!r}, found {self.found()}")
            self.pos += 1
            options[key] = self.parse_value(pass_name, key)
            nxt = self.peek()
            if nxt not in (",", ")"):
                raise self.error(f"expected ',' or ')' after option {key!r} of pass {pass_name!r}, found {self.found()}")
            self.pos += 1
            if nxt == ")":
                return

    def parse_value(self, pass_name: str, key: str) -> Any:
        self.skip_space()
        start = self.pos
        end = self.value_end(start)
        raw = self.text[start:end].strip()
        if not raw:
            raise self.error(f"option {key!r} of pass {pass_name!r} has no value", start)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise self.error(
                f"option {key!r} of pass {pass_name!r}: {elide(repr(raw))} is not a literal (int, float, True/False, "
                "None, a quoted string, or a [list] of those; quote strings: name='x')",
                start,
            ) from None
        if not _is_option_value(value):
            raise self.error(
                f"option {key!r} of pass {pass_name!r}: {elide(repr(raw))} is a {type(value).__name__}; options take "
                "int, float, bool, None, str, or a list of those",
                start,
            )
        self.pos = end
        return value

    def value_end(self, start: int) -> int:
        """Index where the value starting at ``start`` ends: a ',' or ')' outside quotes and brackets."""
        stack: list[str] = []
        i = start
        while i < len(self.text):
            ch = self.text[i]
            if ch in "'\"":
                i = self.string_end(i)
                continue
            if ch in _CLOSING:
                stack.append(_CLOSING[ch])
            elif stack and ch == stack[-1]:
                stack.pop()
            elif not stack and ch in ",)":
                return i
            i += 1
        if stack:
            raise self.error(f"unbalanced brackets: {stack[-1]!r} expected before the end of the text", start)
        raise self.error("the options are not closed: expected ')' before the end of the text", start)

    def string_end(self, quote_pos: int) -> int:
        quote = self.text[quote_pos]
        i = quote_pos + 1
        while i < len(self.text):
            if self.text[i] == "\\":
                i += 2
                continue
            if self.text[i] == quote:
                return i + 1
            i += 1
        raise self.error(f"unterminated string starting with {quote}", quote_pos)


def _quote_around(text: str, position: int) -> str:
    """``text`` quoted for an error at ``position``: whole if short, else the part around
    the position (a megabyte pipeline must not become a megabyte message)."""
    if len(text) <= 200:
        return repr(text)
    start, end = max(position - 60, 0), min(position + 60, len(text))
    return f"of {len(text)} characters, near {'...' if start else ''}{text[start:end]!r}{'...' if end < len(text) else ''}"


def _is_option_value(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, _SCALARS) for v in value)
    return isinstance(value, _SCALARS)


def parse_pipeline(spec: str) -> list[PassSpec]:
    """Parse pipeline text into pass names and options, without looking the names up."""
    if not isinstance(spec, str):
        raise TypeError(f"a pipeline spec is a str, got {type(spec).__name__}")
    return _PipelineParser(spec).parse()


def _check_options(cls: type, spec: PassSpec) -> None:
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no introspectable constructor: let the call decide
        return
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    for key in spec.options:
        if key not in accepted:
            raise PipelineSpecError(
                f"pass {spec.name!r} (position {spec.position}) has no option {key!r}; "
                f"its options: {', '.join(accepted) or 'none'}"
            )
    check_options(cls, spec.options, f"pass {spec.name!r} (position {spec.position})")


def _construct(spec: PassSpec) -> ir.passes.PassBase:
    try:
        cls = get_pass(spec.name)
    except PipelineSpecError as exc:
        raise PipelineSpecError(f"position {spec.position}: {exc}") from exc
    _check_options(cls, spec)
    try:
        return cls(**spec.options)
    except (TypeError, ValueError, OrtpassError) as exc:  # e.g. a PlanError from recompute(plans=...)
        raise PipelineSpecError(
            f"pass {spec.name!r} (position {spec.position}) rejected its options {elide(repr(spec.options))}: "
            f"{type(exc).__name__}: {elide(str(exc), 400)}"
        ) from exc


def pipeline(spec: str, **manager_kwargs: Any) -> PassManager:
    """Build a :class:`PassManager` from text such as ``"a,b(opt=1,name='x'),c"``.

    Pass names are looked up with :func:`ortpass.infra.registry.get_pass`; option values are
    Python literals (int, float, True/False, None, quoted strings, and [lists] of those)
    checked against the pass constructor.  ``manager_kwargs`` go to PassManager.
    Raises PipelineSpecError naming the pass, option or text position that is wrong.
    """
    return PassManager([_construct(s) for s in parse_pipeline(spec)], **manager_kwargs)
