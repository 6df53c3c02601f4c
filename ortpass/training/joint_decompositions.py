"""ATen ops of the joint trace that torch.onnx cannot write, or writes slowly, decomposed
while tracing.

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

Two more are written right but slowly, and get cheaper decompositions:

- ``aten.slice_backward`` (the gradient of ``x[..., a:b]``: rotary's halves in every
  LLaMA-like model).  torch's decomposition scatters the gradient into zeros
  (``slice_scatter``), which torch.onnx writes as a ``ScatterND`` between Transposes that
  move the sliced dim first and back: ORT's profile of a 2.2 s LLaMA step (4 layers,
  batch 8, seq 512) had 290 ms of Transposes, 105 ms with this decomposition.  With a step of 1 it is the gradient with zeros
  concatenated before (``a`` long) and after (``size - b``) (:func:`slice_backward`).
- ``aten.pow.Tensor_Scalar`` with exponent 2 or 1 (RMSNorm's ``x.pow(2)``, and its
  gradient ``2 * x.pow(1)``): ORT's CPU ``Pow`` took 85 ms of that step for 18 calls on
  1M floats each.  ``x * x`` and a copy of ``x`` instead, the special cases of
  ``torch._refs.pow`` (:func:`pow_by_multiplying`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

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
        aten.slice_backward.default: slice_backward,
        aten.pow.Tensor_Scalar: pow_by_multiplying,
    }


def pow_by_multiplying(x: torch.Tensor, exponent):
    """``x ** exponent`` for a floating-point ``x`` and an exponent of 2 (``x * x``) or 1 (a
    copy of ``x``); anything else is left to torch (``NotImplemented``): an integer ``x``
    with a float exponent gives a float result, which ``x * x`` would not."""
    if not x.is_floating_point() or isinstance(exponent, bool) or not isinstance(exponent, (int, float)):
        return NotImplemented
    if exponent == 2:
        return x * x
    if exponent == 1:
        return x.clone()
    return NotImplemented


def slice_backward(grad: torch.Tensor, input_sizes, dim: int, start, end, step: int):
    """The gradient of ``input.slice(dim, start, end, step)``: zeros of ``input_sizes`` with
    ``grad`` at the slice.  With ``step`` 1 that is ``grad`` between zeros along ``dim``.
    Bounds as ``aten.slice`` takes them: negative ones count from the end, both clamped to
    the size.  Left to torch's decomposition (``NotImplemented``): another step, and bounds
    whose clamping depends on a symbolic size (the zeros' sizes would be ``Min``/``Max``
    expressions, which ortpass's memory planning cannot evaluate at the export's dims)."""
    if step != 1:
        return NotImplemented
    dim = dim % len(input_sizes)
    size = input_sizes[dim]
    start, end = _clamped(start, size), _clamped(end, size)
    if start is None or end is None:
        return NotImplemented
    end = _at_least(end, start)
    if end is None:
        return NotImplemented
    # Zeros concatenated on either side, not aten.constant_pad_nd: tracing that one guards
    # on the other dims' sizes (a symbolic batch became static).
    parts = [_zeros_like_along(grad, dim, start), grad, _zeros_like_along(grad, dim, size - end)]
    return torch.cat([part for part in parts if part is not None], dim)


# torch's bound for a slice to the end of a dim (``x[a:]``): sys.maxsize.
_END_OF_DIM = sys.maxsize


def _clamped(bound, size):
    """A slice bound within ``[0, size]``, a negative one counted from the end; None where
    that depends on a symbolic ``size``.  A symbolic bound (the forward's own clamped end,
    ``Min(9223372036854775807, s0)``) only where it is known to be the size."""
    if not isinstance(bound, int):
        return size if statically_known_true(bound == size) else None
    if bound >= _END_OF_DIM:
        return size
    if bound < 0:
        bound = bound + size
        return _at_least(bound, 0)
    if statically_known_true(bound <= size):
        return bound
    return size if statically_known_true(bound >= size) else None


def _at_least(value, lower):
    """``max(value, lower)`` where it is known without a guard, else None."""
    if statically_known_true(value >= lower):
        return value
    return lower if statically_known_true(value <= lower) else None


def _zeros_like_along(grad: torch.Tensor, dim: int, length):
    """Zeros shaped as ``grad`` but ``length`` along ``dim``; None where ``length`` is 0."""
    if statically_known_true(length == 0):
        return None
    shape = list(grad.shape)
    shape[dim] = length
    return grad.new_zeros(shape)


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
