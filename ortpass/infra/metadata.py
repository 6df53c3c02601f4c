"""Keys ortpass writes into model metadata, and readers for them (no torch, no ORT)."""

from __future__ import annotations

import json
from typing import Any

import onnx_ir as ir

from ortpass.conventions import EXPORT_KEY, PADDING_IDX_KEY
from ortpass.errors import ModelLoadError, elide

__all__ = [ "get_export_info", "get_padding_indices"]



def get_export_info(model: ir.Model) -> dict[str, Any]:
    """The record ``ortpass.export.export`` left in model metadata ({} for other models).

    Raises ModelLoadError naming the key when the record is not a JSON object, or a field
    the passes read has the wrong type: ``loss`` a str, ``params`` a list of str, ``dims``
    an object of positive ints, ``outputs_with_grad`` and ``inputs_with_grad`` lists of str.
    """
    raw = model.metadata_props.get(EXPORT_KEY)
    if not raw:
        return {}
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ModelLoadError(f"model metadata {EXPORT_KEY!r} is not valid JSON ({exc})") from None
    if not isinstance(info, dict):
        raise ModelLoadError(f"model metadata {EXPORT_KEY!r} must be a JSON object, not {type(info).__name__}")
    problem = _field_problem(info)
    if problem is not None:
        raise ModelLoadError(f"model metadata {EXPORT_KEY!r}: {problem}")
    return info


def _field_problem(info: dict[str, Any]) -> str | None:

    loss, dims = info.get("loss"), info.get("dims")
    if loss is not None and not isinstance(loss, str):
        return f"'loss' must be a string, not {elide(repr(loss), 80)}"
    for key in ("params", "outputs_with_grad", "inputs_with_grad"):
        names = info.get(key)
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            return f"{key!r} must be a list of names, not {elide(repr(names), 80)}"
    if dims is not None:
        if not isinstance(dims, dict):
            return f"'dims' must map dim names to sizes, not {type(dims).__name__} {elide(repr(dims), 80)}"
        bad = {k: v for k, v in dims.items() if type(v) is not int or v <= 0}
        if bad:
            return f"'dims' sizes must be positive integers; bad: {elide(repr(bad), 80)}"
    return None


def get_padding_indices(model: ir.Model) -> dict[str, int]:
    """The padding row of each embedding Gather, by output name, as ``ortpass.export``
    recorded them ({} for other models).

    Raises ModelLoadError naming the key when the record is not a JSON object of
    non-negative integers.
    """
    raw = model.metadata_props.get(PADDING_IDX_KEY)
    if not raw:
        return {}
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ModelLoadError(f"model metadata {PADDING_IDX_KEY!r} is not valid JSON ({exc})") from None
    if not isinstance(record, dict) or any(type(row) is not int or row < 0 for row in record.values()):
        raise ModelLoadError(
            f"model metadata {PADDING_IDX_KEY!r} must map Gather outputs to padding rows (integers >= 0), "
            f"not {elide(raw, 80)}"
        )
    return record


def update_export_info(model: ir.Model, **fields: Any) -> None:
    """Set ``fields`` in the export record of ``model`` (a field set to None is removed)."""
    info = get_export_info(model)
    for key, value in fields.items():
        if value is None:
            info.pop(key, None)
        else:
            info[key] = value
    model.metadata_props[EXPORT_KEY] = json.dumps(info)
