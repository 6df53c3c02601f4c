"""ortpass: composable training-graph optimization passes on onnx_ir for ONNX Runtime.

Data flows one way::

    export -> pre-grad passes -> gradient build -> post-grad passes -> run

``import ortpass`` stays light (no torch, no onnxruntime); the export, training and
runtime subpackages import those when used.
"""

from ortpass.manager import PassManager, PassReport, pipeline
from ortpass.registry import available_passes, get_pass, register_pass

__all__ = [
    "PassManager",
    "PassReport",
    "available_passes",
    "get_pass",
    "pipeline",
    "register_pass",
]

__version__ = "0.1.0"
