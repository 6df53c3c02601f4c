"""Keys ortpass writes into model metadata, and readers for them (no torch, no ORT)."""

from __future__ import annotations

import json
from typing import Any

import onnx_ir as ir

__all__ = ["EXPORT_KEY", "get_export_info"]

# Written by ortpass.export.export: {"loss", "params", "dims", "opset", "label_density"}.
EXPORT_KEY = "pkg.ortpass.export"


def get_export_info(model: ir.Model) -> dict[str, Any]:
    """The record ``ortpass.export.export`` left in model metadata ({} for other models)."""
    raw = model.metadata_props.get(EXPORT_KEY)
    return json.loads(raw) if raw else {}
