"""The gradient of a convolution in ops torch.onnx can write: the torch builder's CNNs.

AOTAutograd differentiates ``aten.convolution`` into ``aten.convolution_backward``, for
which torch.onnx (torch 2.14, onnxscript 0.7) has no translation: its torch_lib entry
raises ``NotImplementedError``, so no CNN could train on stock ``onnxruntime``.  Both
gradients are convolutions themselves (the adjoint identities below), and
``aten.convolution`` translates to ONNX ``Conv`` / ``ConvTranspose``.  So the joint trace
decomposes ``convolution_backward`` with :func:`convolution_backward`, in ATen ops, before
torch.onnx sees the graph (:mod:`ortpass.training.joint_decompositions`).  No library
offers this decomposition (torch's own, in Inductor, only splits the bias gradient off and
keeps ``convolution_backward``).  Average pooling's gradient, which torch.onnx cannot write
either, is the input gradient of a depthwise convolution by a kernel of ``1 / k``.

For ``y = conv(x, w)`` (stride ``s``, padding ``p``, dilation ``d``, ``g`` groups):

- ``dx = conv_transpose(dy, w)`` with the same ``s``, ``p``, ``d``, ``g``, and the output
  padding that gives back ``x``'s size (the rows a stride skipped; where that depends on a
  symbolic size, :func:`input_gradient_cropped`);
- ``dw[o, c, k] = sum_{n, t} dy[n, o, t] * x_pad[n, group(o) * C_in/g + c, t*s + k*d]``: a
  convolution of ``x`` (its channels as the batch, its batch as the channels) by ``dy``
  with stride and dilation swapped, narrowed to the kernel's size;
- ``db = sum of dy`` over every axis but the channels.

A transposed convolution ``y = conv_transpose(x, w)`` is the adjoint of ``conv(., w)``, so
``dx = conv(dy, w)`` and ``dw`` is the weight gradient above with ``dy`` as the input and
``x`` as the output gradient.  Checked against ``aten.convolution_backward`` in eager for
1-3 spatial dims, stride, padding, dilation, groups and transposed convolutions
(``tests/test_conv_gradient.py``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["avg_pool_backward", "convolution_backward", "input_gradient_cropped"]

aten = torch.ops.aten


def convolution_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Sequence[int] | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``aten.convolution_backward`` in ``aten.convolution``, reshapes and a sum: the
    gradients of the input, the weight and the bias (None where ``output_mask`` asks for
    none)."""
    spatial = input.dim() - 2
    kernel = list(weight.shape[2:])
    grad_input = grad_weight = grad_bias = None
    if output_mask[2]:
        grad_bias = aten.sum.dim_IntList(grad_output, [0, *range(2, grad_output.dim())])
    if transposed:
        if output_mask[0]:
            grad_input = aten.convolution.default(grad_output, weight, None, stride, padding, dilation, False, [0] * spatial, groups)
        if output_mask[1]:
            grad_weight = _weight_gradient(grad_output, input, kernel, stride, padding, dilation, groups)
        return grad_input, grad_weight, grad_bias
    if output_mask[0]:
        restored = [
            input.shape[2 + i] - ((grad_output.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (kernel[i] - 1) + 1)
            for i in range(spatial)
        ]
        if all(isinstance(rows, int) for rows in restored):
            grad_input = aten.convolution.default(grad_output, weight, None, stride, padding, dilation, True, restored, groups)
        else:
            grad_input = input_gradient_cropped(grad_output, weight, list(input.shape[2:]), stride, padding, dilation, groups)
    if output_mask[1]:
        grad_weight = _weight_gradient(input, grad_output, kernel, stride, padding, dilation, groups)
    return grad_input, grad_weight, grad_bias


def input_gradient_cropped(
    grad_output: torch.Tensor, weight: torch.Tensor, sizes: list, stride, padding, dilation, groups: int
) -> torch.Tensor:
    """``dx`` of ``conv(x, w)`` where ``x``'s spatial ``sizes`` are symbolic: ONNX's
    ``ConvTranspose`` takes its output padding as an attribute, a constant, and the rows a
    stride skipped depend on the size.  So the transposed convolution runs unpadded and
    uncropped, gains ``stride - 1`` zero rows at the end of each axis (at most that many
    rows of ``x`` are never read), and each axis is cut to ``x``'s rows from ``padding``."""
    spatial = len(sizes)
    full = aten.convolution.default(grad_output, weight, None, stride, [0] * spatial, dilation, True, [0] * spatial, groups)
    widths = [w for axis in reversed(range(spatial)) for w in (0, stride[axis] - 1)]
    full = aten.constant_pad_nd.default(full, widths, 0.0)
    for axis in range(spatial):
        full = full.narrow(2 + axis, padding[axis], sizes[axis])
    return full


def _weight_gradient(
    input: torch.Tensor, grad_output: torch.Tensor, kernel: list[int], stride, padding, dilation, groups: int
) -> torch.Tensor:
    """``dw`` of ``conv(input, w)`` given ``grad_output``: shaped ``(C_out, C_in/groups, *kernel)``."""
    batch, channels = input.shape[0], input.shape[1]
    per_group = channels // groups
    sizes = list(input.shape[2:])
    # Channels of one group as the batch, (group, sample) as the channels: a grouped
    # convolution then pairs group j's inputs with group j's output channels.
    regrouped = input.reshape(batch, groups, per_group, *sizes).transpose(0, 2).reshape(per_group, groups * batch, *sizes)
    by_channel = grad_output.transpose(0, 1)  # (C_out, N, *out): C_out filters over N channels
    spatial = len(kernel)
    full = aten.convolution.default(regrouped, by_channel, None, dilation, padding, stride, False, [0] * spatial, groups)
    full = full.transpose(0, 1)  # (C_out, C_in/groups, *at least the kernel)
    for axis, size in enumerate(kernel):
        full = full.narrow(2 + axis, 0, size)
    return full


def avg_pool_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> torch.Tensor:
    """``aten.avg_pool{2,3}d_backward`` (1-d pooling runs as 2-d): average pooling is a depthwise convolution by a
    kernel of ``1 / prod(kernel)`` when every window divides by the kernel's size (no
    ``ceil_mode``, no divisor override, and padded windows counting their padding or no
    padding).  Otherwise ``NotImplemented``: the op stays, and torch.onnx names it."""
    spatial = input.dim() - 2
    kernel = list(kernel_size) * spatial if len(kernel_size) == 1 else list(kernel_size)
    stride = (list(stride) * spatial if len(stride) == 1 else list(stride)) or kernel
    padding = list(padding) * spatial if len(padding) == 1 else list(padding)
    if ceil_mode or divisor_override is not None or (any(padding) and not count_include_pad):
        return NotImplemented
    channels = input.shape[1]
    weight = torch.full((channels, 1, *kernel), 1.0 / math.prod(kernel), dtype=grad_output.dtype, device=grad_output.device)
    grad_input, _, _ = convolution_backward(
        grad_output, input, weight, None, stride, padding, [1] * spatial, False, [0] * spatial, channels, [True, False, False]
    )
    return grad_input
