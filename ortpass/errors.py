"""Exception types.  Every error ortpass raises for bad input derives from OrtpassError
and names the thing that is wrong (a pass, a node, a file, a plan string)."""

from __future__ import annotations

__all__ = [
    "elide",
    "OrtpassError",
    "ModelLoadError",
    "PassOrderingError",
    "PipelineSpecError",
    "PassFailedError",
    "ExportError",
    "TrainingGraphError",
    "StaticDimsRequired",
    "PlanError",
    "UnregisteredFunctionError",
    "GoldenCaseError",
    "IndexRangeError",
]


#: Longest piece of user-given text (a value, a path, a plan string) an error message
#: quotes whole; longer ones are cut in the middle (see :func:`elide`).
MAX_QUOTED = 200


def elide(text: str, limit: int = MAX_QUOTED) -> str:
    """``text`` cut to about ``limit`` characters, keeping its start and end, saying how
    much was left out: a megabyte plan string must not become a megabyte message."""
    if len(text) <= limit:
        return text
    keep = max(limit // 2 - 10, 1)
    return f"{text[:keep]}...[{len(text) - 2 * keep} characters]...{text[-keep:]}"


class OrtpassError(Exception):
    """Base class of ortpass's errors."""


class ModelLoadError(OrtpassError):
    """A model file could not be read or is not a valid ONNX model."""


class PassOrderingError(OrtpassError):
    """A set of passes cannot be ordered (a cycle, or a requirement nobody provides)."""


class PipelineSpecError(OrtpassError):
    """A pipeline string names an unknown pass or gives a bad option."""


class PassFailedError(OrtpassError):
    """A pass raised or left a model that fails its checks; the model was rolled back.

    ``model`` is the model as it was before the failing pass, ``report`` the manager's
    report up to and including the failure.
    """

    def __init__(self, pass_name: str, reason: str, *, model=None, report=None):
        super().__init__(f"pass {pass_name!r} failed: {reason}")
        self.pass_name = pass_name
        self.reason = reason
        self.model = model
        self.report = report


class ExportError(OrtpassError):
    """A torch module could not be exported."""


class TrainingGraphError(OrtpassError):
    """The gradient graph could not be built, or a model is not a training graph."""


class StaticDimsRequired(TrainingGraphError):
    """An op's ORT gradient kernel needs input dims that the graph leaves dynamic.

    ``dims`` holds the names of the graph's dynamic dims those inputs are computed from
    (``x_dim2``): export with them static (``ortpass.ORTModule`` does so itself).
    """

    def __init__(self, message: str, dims: frozenset[str]):
        super().__init__(message)
        self.dims = dims


class PlanError(OrtpassError):
    """A recompute plan string, list or JSON file is malformed."""


class GoldenCaseError(OrtpassError):
    """A golden case file cannot be imported, has no ``case()``, or its ``case()`` fails."""


class UnregisteredFunctionError(OrtpassError):
    """A PythonOp names a torch.autograd.Function that nobody registered."""


class IndexRangeError(OrtpassError, IndexError):
    """A step's batch holds a class label or an embedding id that torch refuses (and ONNX
    Runtime's kernel would have taken): see the ``check-index-ranges`` pass.  An
    ``IndexError``, as torch's own."""
