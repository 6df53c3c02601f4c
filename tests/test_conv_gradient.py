"""The convolution gradient the torch builder writes (ortpass.training.conv_gradient):
equal to torch's own ``aten.convolution_backward`` in eager, and a CNN trains like torch
on the torch builder (what stock onnxruntime runs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_module_conformance import train_side_by_side
from torch import nn

from ortpass.training.conv_gradient import convolution_backward, input_gradient_cropped

aten = torch.ops.aten

CASES = {
    # name: (spatial input size, channels in/out, kernel, stride, padding, dilation, groups, transposed, output_padding)
    "1d": ((11,), (3, 4), (3,), (1,), (0,), (1,), 1, False, (0,)),
    "2d-stride-pad": ((9, 8), (3, 6), (3, 2), (2, 3), (1, 0), (1, 1), 1, False, (0, 0)),
    "2d-dilation": ((12, 10), (2, 4), (3, 3), (1, 2), (2, 1), (2, 3), 1, False, (0, 0)),
    "2d-groups": ((7, 9), (4, 6), (3, 3), (2, 1), (1, 1), (1, 1), 2, False, (0, 0)),
    "2d-depthwise": ((8, 8), (4, 4), (3, 3), (1, 1), (1, 1), (1, 1), 4, False, (0, 0)),
    "3d": ((5, 6, 7), (2, 3), (2, 3, 2), (1, 2, 1), (0, 1, 1), (1, 1, 2), 1, False, (0, 0, 0)),
    "2d-transposed": ((5, 6), (4, 3), (3, 2), (2, 2), (1, 0), (1, 1), 1, True, (1, 0)),
    "2d-transposed-groups": ((4, 5), (4, 6), (3, 3), (2, 1), (1, 1), (2, 1), 2, True, (1, 0)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True)], ids=["all", "input", "weight-bias"])
def test_equals_torchs_convolution_backward(name, mask):
    size, (c_in, c_out), kernel, stride, padding, dilation, groups, transposed, output_padding = CASES[name]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, c_in, *size, generator=generator, dtype=torch.float64)
    if transposed:
        weight = torch.randn(c_in, c_out // groups, *kernel, generator=generator, dtype=torch.float64)
    else:
        weight = torch.randn(c_out, c_in // groups, *kernel, generator=generator, dtype=torch.float64)
    args = (stride, padding, dilation, transposed, output_padding, groups)
    y = aten.convolution(x, weight, None, *args)
    grad = torch.randn(y.shape, generator=generator, dtype=torch.float64)
    expected = aten.convolution_backward(grad, x, weight, [c_out], *args, list(mask))
    got = convolution_backward(grad, x, weight, [c_out], *args, list(mask))
    for k, (e, g) in enumerate(zip(expected, got)):
        if not mask[k]:
            assert g is None
            continue
        assert g.shape == e.shape, (k, g.shape, e.shape)
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", sorted(name for name, case in CASES.items() if not case[7]))
def test_the_input_gradient_at_symbolic_sizes_equals_torchs(name):
    """The form written where the output padding depends on a symbolic size, run in eager."""
    size, (c_in, c_out), kernel, stride, padding, dilation, groups, _, output_padding = CASES[name]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, c_in, *size, generator=generator, dtype=torch.float64)
    weight = torch.randn(c_out, c_in // groups, *kernel, generator=generator, dtype=torch.float64)
    args = (stride, padding, dilation, False, output_padding, groups)
    grad = torch.randn(aten.convolution(x, weight, None, *args).shape, generator=generator, dtype=torch.float64)
    expected = aten.convolution_backward(grad, x, weight, None, *args, [True, False, False])[0]
    got = input_gradient_cropped(grad, weight, list(size), stride, padding, dilation, groups)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


class _ConvNet(nn.Module):
    """Every kind of convolution the decomposition covers, GroupNorm between (a training
    BatchNorm's buffer updates are refused by the torch builder)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8, bias=False)
        self.grouped = nn.Conv2d(8, 12, (3, 1), stride=(1, 2), groups=4)
        self.up = nn.ConvTranspose2d(12, 6, 3, stride=2, padding=1, output_padding=1)
        self.line = nn.Conv1d(6, 4, 5, padding=2)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        h = F.relu(self.norm(self.stem(x)))
        h = F.gelu(self.grouped(self.depthwise(h)))
        h = torch.tanh(self.up(h))
        h = self.line(h.flatten(2))
        return self.head(h.mean(-1))


@pytest.mark.stock
def test_a_cnn_trains_like_torch_on_the_torch_builder_as_the_batch_size_changes():
    """Stride, padding, dilation, depthwise and grouped kernels, a transposed convolution
    and a 1-d one: each step's loss and the parameters after it agree with torch eager.
    The weight gradients' convolutions (a batch-sized kernel) make the trace specialize
    the batch: the graph's dims are then static, and each batch size gets its own graph.
    Before, torch.onnx's name "4" for the specialized dim let ORT run the batch-4 graph
    on 3 samples and return 4 rows."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 3, 12, 10, generator=generator), torch.randint(0, 5, (n,), generator=generator)) for n in (4, 3, 4, 2)]
    loop = lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])  # noqa: E731
    train_side_by_side(_ConvNet(), loop, batches, builder="torch")
