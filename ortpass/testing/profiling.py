"""The order ONNX Runtime actually runs a graph's nodes in, read from its profiler.

Passes that write an execution order into the graph (recompute, order-backward-joins) are
checked against this, not against graph order: ORT picks its own order.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

__all__ = ["ort_execution_order"]

_KERNEL_SUFFIX = "_kernel_time"


def ort_execution_order(model: ir.Model, feeds: Mapping[str, np.ndarray], profile_dir: str | os.PathLike) -> list[str]:
    """Node names in the order one CPU run of ``model`` on ``feeds`` executed them, in a
    session opened as :class:`ortpass.runtime.TrainingSession` opens its own (ORT's
    default order, the same disabled optimizers, the same node numbering)."""
    import onnxruntime as ort

    from ortpass.runtime.session import open_session

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(os.fspath(profile_dir), "profile")
    session, _ = open_session(ir.to_proto(model), model, "cpu", session_options=options)
    session.run(None, dict(feeds))
    with open(session.end_profiling(), encoding="utf-8") as f:
        events = json.load(f)
    return [
        e["name"][: -len(_KERNEL_SUFFIX)]
        for e in events
        if e.get("cat") == "Node" and e["name"].endswith(_KERNEL_SUFFIX)
    ]
