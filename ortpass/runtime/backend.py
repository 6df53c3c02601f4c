"""Which ONNX Runtime is installed, and what it can do: exactly one ONNX Runtime
distribution may be installed (they share the import name ``onnxruntime``), and only the
training build runs ORT's gradient builder.

Defined in :mod:`ortpass.training.backend` (the gradient build, an earlier stage, needs it
too); the same functions here, for the runtime and the command line.
"""

from ortpass.training.backend import (
    RUNTIME_DISTRIBUTIONS,
    check_single_runtime,
    has_training_ops,
    installed_runtimes,
    require_training_build,
)

__all__ = [
    "RUNTIME_DISTRIBUTIONS",
    "check_single_runtime",
    "has_training_ops",
    "installed_runtimes",
    "require_training_build",
]
