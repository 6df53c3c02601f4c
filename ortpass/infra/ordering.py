"""Orders passes from their declarations.

Rules, from the declarations in :mod:`ortpass.infra.base`:

* phase: ``pre-grad`` passes run before the pass that provides ``"training-graph"``,
  ``post-grad`` passes after it (a post-grad pass implicitly requires it);
* ``requires_properties`` / ``provides_properties``: a pass runs after every other pass in
  the set that provides a property it requires; a requirement that no pass provides and
  that is not in ``assume`` is refused;
* ``runs_before`` / ``runs_after``: constraints between passes that are both in the set.

Where the declarations say nothing the given order is kept (a stable topological sort); a
cycle is refused with the declarations that make it.  Plain onnx_ir passes have phase
``"any"`` and no declarations.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Iterable, Sequence

import onnx_ir as ir

from ortpass.conventions import TRAINING_GRAPH
from ortpass.errors import (
    PassOrderingError,
)
from ortpass.infra.base import PassDeclarations, pass_name_of


@dataclasses.dataclass(frozen=True)
class _Declarations:
    name: str
    phase: str
    requires: frozenset[str]
    provides: frozenset[str]
    runs_before: frozenset[str]
    runs_after: frozenset[str]

__all__ = ["order_passes"]



def _declarations(pass_: ir.passes.PassBase) -> _Declarations:
    """Read a pass's declarations; a plain onnx_ir pass declares nothing."""
    if not isinstance(pass_, PassDeclarations):
        empty: frozenset[str] = frozenset()
        return _Declarations(pass_name_of(pass_), "any", empty, empty, empty, empty)
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
