"""Recompute already applied to a training graph, read back from the tags of its clones.

Rule: the recompute pass tags every node it clones into backward with the forward node it
copies (``RECOMPUTE_OF_KEY``) and with its own name (``CREATED_BY_KEY``), and so does
``recompute-gate-activation`` for the activation copies it makes.  Copies that read each
other's outputs, made by the same pass, form one recomputed subgraph.  A subgraph is named
by its op chain -- its op types in graph order joined by ``+``, as a plan names its
cluster -- and subgraphs with the same chain and pass are counted together, like the
occurrences of a plan.  A subgraph's recomputed values are its outputs that a node outside
it reads: the stashed activations backward now computes again instead of keeping them
from forward; their bytes, at the dims given, are what the recompute took off the stash
(an upper bound where a recomputed value is a view of a buffer something else keeps).

No pass records more than these tags, so this is what a saved graph can say about the
recompute that made it, whatever options it ran with.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Mapping

import onnx_ir as ir
import sympy

from ortpass.analysis import memory
from ortpass.conventions import CREATED_BY_KEY, RECOMPUTE_OF_KEY

__all__ = ["AppliedRecompute", "RecomputedGroup", "find_applied_recompute"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RecomputedGroup:
    """Recomputed subgraphs with the same op chain, made by the same pass."""

    chain: str  # "MatMul+Add+Reshape"
    created_by: str
    subgraphs: int = 0
    nodes: int = 0
    values: int = 0  # recomputed values backward reads
    symbolic_bytes: sympy.Expr | None = dataclasses.field(default_factory=lambda: sympy.Integer(0))
    bytes: int | None = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "chain": self.chain,
            "created_by": self.created_by,
            "subgraphs": self.subgraphs,
            "nodes": self.nodes,
            "values": self.values,
            "bytes": self.bytes,
            "symbolic_bytes": None if self.symbolic_bytes is None else str(self.symbolic_bytes),
        }


@dataclasses.dataclass
class AppliedRecompute:
    """What :func:`find_applied_recompute` read from a graph's clone tags."""

    groups: list[RecomputedGroup]

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @property
    def subgraphs(self) -> int:
        return sum(g.subgraphs for g in self.groups)

    @property
    def bytes(self) -> int | None:
        sizes = [g.bytes for g in self.groups]
        return None if None in sizes else sum(sizes)  # type: ignore[arg-type]

    def __bool__(self) -> bool:
        return bool(self.groups)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "subgraphs": self.subgraphs,
            "bytes": self.bytes,
            "groups": [g.to_dict() for g in self.groups],
        }


def _components(clones: list[ir.Node]) -> list[list[ir.Node]]:
    """Clones that read each other's outputs, made by the same pass, in graph order."""
    parent = {node: node for node in clones}

    def root(node: ir.Node) -> ir.Node:
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for node in clones:
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer in parent and _creator(producer) == _creator(node):
                parent[root(producer)] = root(node)
    groups: dict[ir.Node, list[ir.Node]] = collections.defaultdict(list)
    for node in clones:  # graph order, kept within each group
        groups[root(node)].append(node)
    return list(groups.values())


def _creator(node: ir.Node) -> str:
    return node.metadata_props.get(CREATED_BY_KEY) or "recompute"


def find_applied_recompute(model: ir.Model, dims: Mapping[str, int] | None = None) -> AppliedRecompute:
    """The recomputed subgraphs of ``model`` by op chain (see the module docstring); sizes
    at ``dims`` (None where a dim has no value).  Reads the model, never changes it."""
    clones = [node for node in model.graph.all_nodes() if RECOMPUTE_OF_KEY in node.metadata_props]
    groups: dict[tuple[str, str], RecomputedGroup] = {}
    for component in _components(clones):
        members = set(component)
        chain = "+".join(node.op_type for node in component)
        group = groups.setdefault((_creator(component[0]), chain), RecomputedGroup(chain, _creator(component[0])))
        group.subgraphs += 1
        group.nodes += len(component)
        for value in (v for node in component for v in node.outputs):
            if not any(use.node not in members for use in value.uses()):
                continue
            group.values += 1
            size = memory.symbolic_nbytes(value)
            group.symbolic_bytes = None if size is None or group.symbolic_bytes is None else group.symbolic_bytes + size
            evaluated = memory.evaluate(size, dims)
            group.bytes = None if evaluated is None or group.bytes is None else group.bytes + evaluated
    ordered = sorted(groups.values(), key=lambda g: (-(g.bytes or 0), -g.subgraphs, g.chain))
    if ordered:
        logger.debug("recompute applied: %d subgraphs, %d nodes", sum(g.subgraphs for g in ordered), len(clones))
    return AppliedRecompute(ordered)
