"""Small values the floor would keep that cost nothing to recompute (rules:
docs/design/recompute-analysis.md, "Size floor")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx_ir as ir

from ortpass.analysis.recompute.cost import is_constant

if TYPE_CHECKING:
    from ortpass.analysis.recompute.search import CandidateSearch

__all__ = ["absorb_free_small_values"]


def absorb_free_small_values(
    search: CandidateSearch, outputs: list[ir.Value], nodes: list[ir.Node], members: set[ir.Node],
    boundary: dict[ir.Value, None], kept: dict[ir.Value, None], small: dict[ir.Value, None],
) -> None:
    """Recompute the small values the floor kept that cost no memory to recompute.

    The floor keeps a small input rather than growing through it (ORT's rule: not worth
    the nodes).  But a small value computed, through recomputable nodes, only from what
    the subgraph computes or keeps anyway costs nothing to recompute, and keeping it
    costs its bytes: a rotary embedding's halves and their negation, 2 MiB each and four
    per layer, read straight off the recomputed query and key.  Such chains join the
    subgraph (``nodes``, ``members``; their reads join ``boundary``); a value of ``small``
    (the ones the floor alone kept) still ``kept`` after that is one whose recompute would
    need more, or would take the subgraph past ``max_nodes``.  What a compromise plan keeps
    (a widening Cast's input) stays kept.  Updates the growth in place.
    """
    for value in small:
        chain = _free_chain(search, value, members, outputs, budget=search.max_nodes - len(nodes))
        if chain is None:
            continue
        members.update(chain)
        nodes.extend(chain)
        for node in chain:
            ignored = search.lookup(node).ignored_inputs  # type: ignore[union-attr]
            for index, read in enumerate(node.inputs):
                if read is not None and (index in ignored or read.producer() not in members):
                    boundary[read] = None
        del kept[value], boundary[value]
    for value in small:  # a later chain may have taken an earlier small value's producer
        if value in kept and value.producer() in members:
            del kept[value], boundary[value]


def _free_chain(
    search: CandidateSearch, value: ir.Value, members: set[ir.Node], outputs: list[ir.Value], budget: int
) -> list[ir.Node] | None:
    """The recomputable nodes, producers first, that compute ``value`` from the subgraph's
    own values, ignored inputs, graph inputs, initializers, Constants and values backward
    keeps anyway; None when ``value`` needs anything else or more than ``budget`` nodes."""
    chain: list[ir.Node] = []
    taken = set(members)

    def visit(node: ir.Node) -> bool:
        if node in taken:
            return True
        lookup = search.lookup(node)
        if lookup is None or len(chain) >= budget:
            return False
        for index, read in enumerate(node.inputs):
            if read is None or index in lookup.ignored_inputs:
                continue
            source = read.producer()
            if source is None or is_constant(source) or search.kept_by_backward(read, outputs):
                continue
            if not visit(source):
                return False
        taken.add(node)
        chain.append(node)
        return True

    producer = value.producer()
    return chain if producer is not None and visit(producer) else None
