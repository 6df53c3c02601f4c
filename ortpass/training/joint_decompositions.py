"""ATen ops of the joint trace that torch.onnx cannot write, decomposed while tracing.

``torch.export.experimental._export_forward_backward`` traces the joint forward+backward
graph with the decompositions of ``torch._decomp.core_aten_decompositions()`` applied.
torch.onnx (torch 2.14, onnxscript 0.7) then translates the ATen ops left; three that a
CNN meets it cannot translate right, and :func:`joint_decompositions` adds theirs:

- ``aten.convolution_backward``: no translation (its entry raises).  Decomposed into
  convolutions (:func:`ortpass.training.conv_gradient.convolution_backward`).
- ``aten.avg_pool{2,3}d_backward`` (1-d pooling runs as 2-d): no translation.  Decomposed
  into a depthwise convolution's input gradient
  (:func:`ortpass.training.conv_gradient.avg_pool_backward`).
- ``aten._native_batch_norm_legit_functional`` (BatchNorm in training mode): translated
  *wrong*.  Its torch_lib entry sets ``training = False`` and writes the inference
  ``BatchNormalization``, which normalizes by the running statistics instead of the
  batch's: the first step's loss of a CNN with BatchNorm was 2.4492 where torch gives
  2.4682.  torch's own decomposition (``torch._decomp``, batch mean and variance, the
  running statistics updated by torch's formulas) is applied instead.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ortpass.training.conv_gradient import avg_pool_backward, convolution_backward

__all__ = ["joint_decompositions"]

aten = torch.ops.aten


def _extra_decompositions() -> dict:
    from torch._decomp import decomposition_table

    batch_norm = aten._native_batch_norm_legit_functional.default
    return {
        aten.convolution_backward.default: convolution_backward,
        aten.avg_pool2d_backward.default: avg_pool_backward,
        aten.avg_pool3d_backward.default: avg_pool_backward,
        batch_norm: decomposition_table[batch_norm],
    }


@contextlib.contextmanager
def joint_decompositions() -> Iterator[None]:
    """While open, the decompositions the joint trace applies
    (``torch._decomp.core_aten_decompositions``, which ``_export_forward_backward`` reads
    when called) include this module's."""
    import torch._decomp as decomp

    original = decomp.core_aten_decompositions
    extra = _extra_decompositions()

    def with_extra():
        table = original()
        table.update(extra)
        return table

    decomp.core_aten_decompositions = with_extra
    try:
        yield
    finally:
        decomp.core_aten_decompositions = original
