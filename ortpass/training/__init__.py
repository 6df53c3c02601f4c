"""Gradient graph building: forward+loss model -> forward+backward training graph, with ORT's
gradient builder (``build_training_graph``, the training build) or torch's autograd
(``build_training_graph_from_torch``, any onnxruntime)."""

from ortpass.training.build import build_training_graph, clamp_for_ort

__all__ = ["build_training_graph", "build_training_graph_from_torch", "clamp_for_ort"]


def __getattr__(name: str):
    if name == "build_training_graph_from_torch":  # imports torch: only when asked for
        from ortpass.training.from_torch import build_training_graph_from_torch

        return build_training_graph_from_torch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
