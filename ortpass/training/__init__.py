"""Gradient graph building: forward+loss model -> forward+backward training graph."""

from ortpass.training.build import build_training_graph, clamp_for_ort

__all__ = ["build_training_graph", "clamp_for_ort"]
