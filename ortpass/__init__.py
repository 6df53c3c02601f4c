"""ortpass: composable training-graph optimization passes on onnx_ir for ONNX Runtime.

Data flows one way::

    export -> pre-grad passes -> gradient build -> post-grad passes -> run

``import ortpass`` stays light (no torch, no onnxruntime); the export, training and
runtime subpackages import those when used, and so does ``ortpass.ORTModule`` (the
drop-in ``torch.nn.Module`` wrapper, :mod:`ortpass.runtime.module`) on first access.
"""

from ortpass.infra.manager import PassManager
from ortpass.infra.pipeline_text import pipeline
from ortpass.infra.registry import available_passes, get_pass, register_pass
from ortpass.infra.report import PassReport

__all__ = [
    "ORTModule",
    "PassManager",
    "PassReport",
    "available_passes",
    "get_pass",
    "pipeline",
    "register_pass",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "ORTModule":  # imports torch: only when asked for
        from ortpass.runtime.module import ORTModule

        globals()[name] = ORTModule
        return ORTModule
    raise AttributeError(f"module 'ortpass' has no attribute {name!r}")
