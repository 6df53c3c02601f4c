"""What a failed ONNX Runtime step raises: ORT's message, with the real error of a failing
PythonOp (ORT reports only a generic one), or an :class:`~ortpass.errors.IndexRangeError`
naming the label or id a ``check-index-ranges`` node refused."""

from __future__ import annotations

import sys

from ortpass.conventions import INDEX_CHECK_PREFIX
from ortpass.errors import IndexRangeError, OrtpassError

__all__ = ["ort_error", "raise_kept_runner_error", "step_error", "take_runner_error"]


def take_runner_error() -> BaseException | None:
    """The error a PythonOp's torch code raised in the last step, if any (then forgotten)."""
    # Only models with PythonOps load the bridge (or, on stock, the Python op kernels); don't import torch for the others.
    bridge = sys.modules.get("ortpass.pythonop.bridge")
    kernels = sys.modules.get("ortpass.training.python_op_kernels")
    error = bridge.last_runner_error(clear=True) if bridge is not None else None
    python_op_error = kernels.take_failure() if kernels is not None else None
    return error or python_op_error


def step_error(exc: BaseException) -> OrtpassError:
    """The error to raise for a step ORT failed: an :class:`IndexRangeError` naming what the
    batch holds when a ``check-index-ranges`` node refused it, else ORT's own message."""
    message = ort_error(exc)
    start = message.find("Name:'")
    name = message[start + len("Name:'") : message.find("'", start + len("Name:'"))] if start >= 0 else ""
    if INDEX_CHECK_PREFIX in name:
        refused = name[name.index(INDEX_CHECK_PREFIX) + len(INDEX_CHECK_PREFIX) :].removesuffix(" (bias)")
        return IndexRangeError(f"the batch holds {refused}: torch raises IndexError for it, and so does ortpass (ONNX "
                               f"Runtime's kernels would read some such indices without a word). ONNX Runtime: {message}")  # fmt: skip
    return OrtpassError(f"the training step failed on ONNX Runtime: {message}")


def ort_error(exc: BaseException) -> str:
    """ORT reports a failing PythonOp runner only as a generic error; the bridge kept the real one."""
    runner_error = take_runner_error()
    if runner_error is not None:
        return f"a PythonOp's torch code raised {type(runner_error).__name__}: {runner_error}"
    return f"{type(exc).__name__}: {exc}"


def raise_kept_runner_error() -> None:
    """Raise the error a Python op kept during a run that ORT finished (its kernels never
    raise: onnxruntime-extensions aborts the process on a Python exception)."""
    failed = take_runner_error()
    if failed is not None:
        raise OrtpassError(f"the training step failed on ONNX Runtime: {failed}") from failed
