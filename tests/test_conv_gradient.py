"""The convolution gradient the torch builder writes (ortpass.training.conv_gradient):
equal to torch's own ``aten.convolution_backward`` in eager, and a CNN trains like torch
on the torch builder (what stock onnxruntime runs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_module_conformance import train_side_by_side
from torch import nn

from ortpass.training.backend import has_training_ops
from ortpass.training.conv_gradient import avg_pool_backward, convolution_backward, input_gradient_cropped

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


@pytest.mark.parametrize(
    "size, kernel, stride, padding, count_include_pad",
    [((8, 8), (2, 2), (2, 2), (0, 0), True), ((9, 7), (3, 2), (2, 1), (1, 1), True), ((7, 6), (3, 3), (1, 2), (0, 1), True),
     ((5, 6, 7), (2, 3, 2), (1, 2, 2), (1, 1, 0), True), ((8, 8), (2, 2), (), (0, 0), False)],
    ids=["2d", "2d-padded", "2d-overlapping", "3d", "2d-default-stride"],
)
def test_average_pooling_gradient_equals_torchs(size, kernel, stride, padding, count_include_pad):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, *size, generator=generator, dtype=torch.float64)
    pool, backward = (aten.avg_pool2d, aten.avg_pool2d_backward) if len(size) == 2 else (aten.avg_pool3d, aten.avg_pool3d_backward)
    y = pool(x, kernel, stride, padding, False, count_include_pad)
    grad = torch.randn(y.shape, generator=generator, dtype=torch.float64)
    expected = backward(grad, x, kernel, stride, padding, False, count_include_pad, None)
    got = avg_pool_backward(grad, x, kernel, stride, padding, False, count_include_pad, None)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_average_pooling_whose_windows_divide_differently_is_left_to_torch_onnx():
    x, grad = torch.randn(1, 2, 5, 5), torch.randn(1, 2, 3, 3)
    assert avg_pool_backward(grad, x, [2, 2], [2, 2], [0, 0], True, True, None) is NotImplemented  # ceil_mode
    assert avg_pool_backward(grad, x, [3, 3], [2, 2], [1, 1], False, False, None) is NotImplemented  # padding not counted
    assert avg_pool_backward(grad, x, [2, 2], [2, 2], [0, 0], False, True, 3) is NotImplemented  # divisor_override


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
    batches = [(torch.randn(n, 3, 12, 10, generator=generator), torch.randint(0, 5, (n,), generator=generator)) for n in (4, 3, 4)]
    loop = lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])  # noqa: E731
    train_side_by_side(_ConvNet(), loop, batches, builder="torch")


@pytest.mark.stock
@pytest.mark.slow
@pytest.mark.skipif(has_training_ops(), reason="ORT's builder trains ResNet-18 there (test_module_conformance.py)")
def test_resnet18_with_training_batchnorm_steps_like_torch_at_each_steps_parameters():
    """ResNet-18 (training BatchNorms, strided and 1x1 convolutions, max and adaptive
    average pooling) on the torch builder, two SGD steps (SmallCNN's tests change the batch
    size; a ResNet graph takes 40 s to build here): at every step
    the loss, each gradient and the new BatchNorm statistics agree with torch eager run at
    the wrapper's own parameters and buffers (a copy taken before the step)."""
    import copy

    from test_module_conformance import ResNet18, _images

    from ortpass.runtime.module import ORTModule

    torch.manual_seed(0)
    model = ResNet18()
    wrapped = ORTModule(model, builder="torch")
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    for x, y in _images(2, sizes=(4,), side=32):
        same = copy.deepcopy(model)
        loss, expected = F.cross_entropy(wrapped(x), y), F.cross_entropy(same(x), y)
        loss.backward()
        expected.backward()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
        for (name, p), q in zip(model.named_parameters(), same.parameters()):
            # float32 sums in another order through 18 layers of convolution gradients: up to
            # 1.3e-4 of the largest (blocks.1.bn1.weight, one AMD EPYC, 2026-11-30); a wrong
            # gradient is off by far more.
            assert ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item() <= 5e-4, name
        for (name, b), c in zip(model.named_buffers(), same.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=name)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.stock
def test_a_cnn_loaded_from_the_cache_updates_its_batchnorm_statistics_like_torch(tmp_path):
    """The buffer updates are part of the cached graph's record: a second wrapper loads the
    graph without building it and still updates the running statistics as torch does."""
    from test_module_conformance import SmallCNN, _images, cross_entropy_outside

    from ortpass.runtime.module import ORTModule

    torch.manual_seed(0)
    model = SmallCNN()
    ORTModule(SmallCNN(), builder="torch", cache_dir=tmp_path)(next(_images(1))[0]).sum().backward()
    wrapped = train_side_by_side(model, cross_entropy_outside, _images(2), wrap=lambda m: ORTModule(m, builder="torch", cache_dir=tmp_path))
    assert wrapped.graph_builds == 0
    assert int(model.norm.num_batches_tracked) == 2
