"""The torch side: export a module with its loss to ONNX for training, and the registries
that say how ``torch.autograd.Function``s export (``register_exporter``), what shapes their
outputs have (``register_shape_inferer``) and which of them may run (``register_function``), and symbolics for aten ops torch's exporter
lacks (``register_symbolic``).

Names load on first use: the shape-inferer registry is read by a pass that must not pull
torch into ``import ortpass``.
"""

import importlib

__all__ = ["export", "register_exporter", "register_function", "register_shape_inferer", "register_symbolic"]

_LAZY = {
    "export": "ortpass.export.torchscript",
    "register_exporter": "ortpass.pythonop.export",
    "register_shape_inferer": "ortpass.pythonop.shape_inference",
    "register_function": "ortpass.pythonop.registry",
    "register_symbolic": "ortpass.export.symbolics",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ortpass.export' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
