"""The torch side: export a module with its loss to ONNX for training."""

from ortpass.export.torchscript import export

__all__ = ["export"]
