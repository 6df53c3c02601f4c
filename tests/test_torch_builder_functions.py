"""``torch.autograd.Function`` on the torch builder (what stock ``onnxruntime`` gets): the
Function's forward and its own backward traced into the graph
(:mod:`ortpass.training.autograd_functions`), trained beside torch eager over several
optimizer steps with the batch size changing; BLOOM's ``GeLUFunction`` among them.  A
Function torch cannot trace is refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortpass.errors import OrtpassError
from ortpass.runtime.module import ORTModule

pytestmark = pytest.mark.stock


class ClippedTanh(torch.autograd.Function):
    """tanh with its gradient clipped to ``limit``: not the forward's derivative."""

    @staticmethod
    def forward(ctx, x, limit):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        ctx.limit = limit
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return (grad * (1 - y * y)).clamp(-ctx.limit, ctx.limit), None


class ReversedGradient(torch.autograd.Function):
    """The input as a view forward, its gradient scaled by ``-scale`` backward."""

    @staticmethod
    def forward(x, scale):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class SplitScaled(torch.autograd.Function):
    """Two outputs, a tuple argument, and another Function applied inside its forward."""

    @staticmethod
    def forward(ctx, x, scales):
        ctx.scales = scales
        half = x.shape[-1] // 2
        return ClippedTanh.apply(x[..., :half], 10.0) * scales[0], x[..., half:] * scales[1]

    @staticmethod
    def backward(ctx, grad_first, grad_second):
        return torch.cat([grad_first * 0.5, grad_second * ctx.scales[1]], dim=-1), None


class WithFunctions(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.second = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, labels):
        h = ClippedTanh.apply(self.first(x), 0.02)
        a, b = SplitScaled.apply(self.second(h), (2.0, 3.0))
        h = ReversedGradient.apply(torch.cat([a, b], dim=-1), 0.5) + h
        return F.cross_entropy(self.head(h), labels)


def _batches(sizes=(4, 5, 4, 6)):
    generator = torch.Generator().manual_seed(0)
    for batch in sizes:
        yield torch.randn(batch, 6, generator=generator) * 3, torch.randint(0, 3, (batch,), generator=generator)


def _forward_differentiated_by_torch(model, x, labels):
    """``WithFunctions``' forward with each Function's forward written out: the gradient a
    graph that dropped the Functions' backward would compute."""
    h = torch.tanh(model.first(x))
    s = model.second(h)
    half = s.shape[-1] // 2
    a, b = torch.tanh(s[..., :half]) * 2.0, s[..., half:] * 3.0
    return F.cross_entropy(model.head(torch.cat([a, b], dim=-1) + h), labels)


def _grads(loss, model):
    return torch.autograd.grad(loss, list(model.parameters()))


def test_functions_with_their_own_backward_train_like_torch():
    from test_module_conformance import train_side_by_side

    torch.manual_seed(0)
    model = WithFunctions()
    x, labels = next(_batches())
    own, derived = _grads(model(x, labels), model), _grads(_forward_differentiated_by_torch(model, x, labels), model)
    # Every parameter before the Functions gets another gradient: a lost backward would show.
    assert all(not torch.allclose(g, h, atol=1e-4) for g, h in zip(own[:4], derived[:4]))  # first, second
    wrapped = train_side_by_side(model, lambda m, b: m(*b), _batches(), builder="torch")
    assert wrapped.graph_builds == 1  # the batch dim is dynamic through the Functions
    x, labels = next(_batches((7,)))
    with torch.no_grad():  # a forward graph: the Functions' forward inlined
        assert wrapped(x, labels).item() == pytest.approx(model(x, labels).item(), rel=1e-5)
    assert wrapped.transitions.current_graph.kind == "forward"


class ThroughNumpy(torch.autograd.Function):
    """A custom kernel: its forward runs outside torch's ops."""

    @staticmethod
    def forward(ctx, x):
        return torch.from_numpy(x.detach().numpy() * 2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_a_function_with_a_custom_kernel_is_refused_by_name():
    class WithKernel(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return ThroughNumpy.apply(self.linear(x)).sum()

    wrapped = ORTModule(WithKernel(), builder="torch")
    with pytest.raises(OrtpassError, match=r"ThroughNumpy, whose forward torch cannot trace"):
        wrapped(torch.randn(3, 4))


@pytest.mark.slow
def test_bloom_trains_with_its_gelu_function_like_torch():
    transformers = pytest.importorskip("transformers")
    from test_module_conformance import train_side_by_side
    from test_module_families import _batches as causal_batches

    config = transformers.BloomConfig(
        vocab_size=1000, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
        use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(config)
    assert any(type(m).__name__ == "BloomGelu" for m in model.modules())  # GeLUFunction.apply inside
    wrapped = train_side_by_side(
        model, lambda m, b: m(input_ids=b[0], labels=b[1]).loss, causal_batches("causal"), builder="torch"
    )
    assert wrapped.graph_builds == 1
    ids, labels = next(causal_batches("causal", seed=2))
    wrapped.eval()
    with torch.no_grad():  # evaluated: GeLUFunction's forward in a forward graph, against the model in torch
        got, expected = wrapped(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    assert got.loss.item() == pytest.approx(expected.loss.item(), rel=1e-5)
    assert wrapped.transitions.current_graph.kind == "forward"
