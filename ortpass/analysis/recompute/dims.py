"""The concrete dims the analysis prices symbolic sizes at: given, from the export record,
or bound from the graph's own internal dims."""

from __future__ import annotations

import logging
from typing import Mapping

import onnx_ir as ir

from ortpass.analysis import memory
from ortpass.infra.metadata import get_export_info

logger = logging.getLogger(__name__)


def resolve_dims(model: ir.Model, dims: Mapping[str, int] | None, symbols: set[str]) -> tuple[dict | None, str]:
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


def bind_internal_dims(model: ir.Model, dims: dict | None, symbols: set[str]) -> tuple[dict | None, list[str]]:
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


def dims_notes(dims: dict | None, symbols: set[str]) -> list[str]:
    if dims is None:
        return [f"the graph has symbolic dims ({', '.join(sorted(symbols))}) and no dims were given: savings are symbolic only"]
    missing = [s for s in sorted(symbols) if s not in dims]
    if missing:
        return [f"no value for dims {', '.join(missing)}: sizes that depend on them are left symbolic ('?')"]
    return []
