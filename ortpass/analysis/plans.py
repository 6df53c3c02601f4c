"""Recompute plan strings: parsing and formatting.

A plan names a recompute subgraph *cluster* and says how to apply it, in ORTModule's
format ``<cluster id>:<type>:<count>``:

- the cluster id is the op types of the subgraph in topological order, each followed by
  ``+`` (``Reshape+Where+BiasSoftmax+``);
- type ``0`` is no optimization, ``1`` recompute, ``2`` recompute with compromise;
- count ``-1`` applies the plan to every occurrence, ``N > 0`` to the last N occurrences
  in execution order.

Several plans are comma-joined in one string, or held as a JSON list of plan strings in a
file (ORT moved to files because session option strings had a length limit).  Every
malformed input raises :class:`ortpass.errors.PlanError` naming the bad string or file.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import re
from typing import Iterable, Sequence

from ortpass.errors import PlanError

__all__ = [
    "PlanType",
    "PlanSpec",
    "parse_plan",
    "parse_plans",
    "format_plans",
    "load_plan_file",
    "save_plan_file",
    "cluster_id",
]

logger = logging.getLogger(__name__)

# An op type as ONNX spells it: a letter, then letters, digits or underscores.
_OP_TYPE = r"[A-Za-z_][A-Za-z0-9_]*"
_CLUSTER_RE = re.compile(rf"^(?:{_OP_TYPE}\+)+$")


class PlanType(enum.IntEnum):
    """How a cluster is optimized (ORT's ``OptimizationType``)."""

    NONE = 0
    RECOMPUTE = 1
    RECOMPUTE_WITH_COMPROMISE = 2


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """One parsed plan: which cluster, how, and on how many of its occurrences."""

    cluster: str
    type: PlanType
    count: int = -1

    def __post_init__(self):
        if not _CLUSTER_RE.match(self.cluster):
            raise PlanError(
                f"bad cluster id {self.cluster!r}: expected op types each followed by '+', "
                "e.g. 'Gelu+' or 'Expand+Tile+'"
            )
        if self.count == 0 or self.count < -1:
            raise PlanError(f"bad count {self.count} in plan for {self.cluster!r}: use -1 (all) or N > 0 (the last N)")

    @property
    def op_types(self) -> tuple[str, ...]:
        return tuple(self.cluster.rstrip("+").split("+"))

    def __str__(self) -> str:
        return f"{self.cluster}:{int(self.type)}:{self.count}"


def cluster_id(op_types: Iterable[str]) -> str:
    """The cluster id of a subgraph whose nodes, in topological order, have ``op_types``."""
    return "".join(f"{op}+" for op in op_types)


def parse_plan(text: str) -> PlanSpec:
    """Parse one ``<cluster>:<type>:<count>`` string."""
    if not isinstance(text, str):
        raise PlanError(f"a plan must be a string like 'Gelu+:1:-1', not {type(text).__name__} {text!r}")
    parts = text.strip().split(":")
    if len(parts) != 3:
        raise PlanError(f"bad plan string {text!r}: expected '<cluster>:<type>:<count>', e.g. 'Gelu+:1:-1'")
    cluster, type_text, count_text = (p.strip() for p in parts)
    try:
        plan_type = PlanType(int(type_text))
    except ValueError:
        raise PlanError(f"bad plan string {text!r}: type must be 0, 1 or 2, not {type_text!r}") from None
    try:
        count = int(count_text)
    except ValueError:
        raise PlanError(f"bad plan string {text!r}: count must be an integer, not {count_text!r}") from None
    try:
        return PlanSpec(cluster, plan_type, count)
    except PlanError as exc:
        raise PlanError(f"bad plan string {text!r}: {exc}") from None


def parse_plans(plans: str | PlanSpec | Sequence[str | PlanSpec] | None) -> list[PlanSpec]:
    """Parse plans given as a comma-joined string, a list of strings/specs, or None.

    Empty entries (``"a,,b"``, a trailing comma) are a mistake, not silence: they raise.
    """
    if plans is None:
        return []
    if isinstance(plans, PlanSpec):
        return [plans]
    if isinstance(plans, str):
        if not plans.strip():
            return []
        items: Sequence[str | PlanSpec] = plans.split(",")
    elif isinstance(plans, (list, tuple)):
        items = plans
    else:
        raise PlanError(
            f"plans must be a comma-joined string or a list of plan strings, not {type(plans).__name__} {plans!r}"
        )
    specs = []
    for item in items:
        if isinstance(item, PlanSpec):
            specs.append(item)
        elif isinstance(item, str) and not item.strip():
            raise PlanError(f"empty plan in {plans!r}")
        else:
            specs.append(parse_plan(item))
    return specs


def format_plans(plans: Iterable[PlanSpec | str]) -> str:
    """Comma-join plans (the inverse of :func:`parse_plans` on a string)."""
    return ",".join(str(p) for p in plans)


def load_plan_file(path: str | os.PathLike) -> list[PlanSpec]:
    """Read a JSON file holding a list of plan strings."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise PlanError(f"plan file {os.fspath(path)!r} does not exist") from None
    except OSError as exc:
        raise PlanError(f"plan file {os.fspath(path)!r} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"plan file {os.fspath(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise PlanError(
            f"plan file {os.fspath(path)!r} must hold a JSON list of plan strings, not {type(data).__name__}"
        )
    try:
        return [parse_plan(item) for item in data]
    except PlanError as exc:
        raise PlanError(f"plan file {os.fspath(path)!r}: {exc}") from None


def save_plan_file(path: str | os.PathLike, plans: Iterable[PlanSpec | str]) -> None:
    """Write plans as a JSON list of plan strings (the format ORT's config file uses)."""
    strings = [str(p) for p in parse_plans(list(plans))]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(strings, f, indent=1)
    logger.debug("wrote %d recompute plans to %s", len(strings), os.fspath(path))
