"""A ``torch.autograd.Function`` torch cannot trace, on the torch builder: its forward and its
own backward run in eager torch from the graph, as ``onnxruntime-extensions`` Python ops
(:mod:`ortpass.training.python_ops`, :mod:`ortpass.training.python_op_kernels`), compared
with torch eager (the loss, every gradient, several steps at changing batch sizes); the
ctx between them kept per call and released; refusals named.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortpass.errors import OrtpassError
from ortpass.pythonop.shape_inference import register_shape_inferer
from ortpass.runtime.module import ORTModule
from ortpass.training import python_op_kernels as kernels
from ortpass.training import python_ops

pytestmark = pytest.mark.stock
# The training build's interpreter has no onnxruntime-extensions: there only the refusal runs.
needs_extensions = pytest.mark.skipif(not python_ops.extensions_available(), reason="onnxruntime-extensions is not installed")


class NumpyTanhScale(torch.autograd.Function):
    """``tanh(x) * w * k`` computed in numpy (torch cannot trace it); its backward halves
    the input's gradient, so a graph that differentiated the forward would differ."""

    @staticmethod
    def forward(ctx, x, w, k):
        ctx.save_for_backward(x, w)
        ctx.k = k
        return torch.from_numpy(np.tanh(x.detach().numpy()) * w.detach().numpy() * k)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        t = np.tanh(x.numpy())
        g = grad.numpy()
        grad_x = g * w.numpy() * ctx.k * (1 - t * t) * 0.5
        grad_w = (g * t * ctx.k).reshape(-1, g.shape[-1]).sum(axis=0)
        return torch.from_numpy(grad_x), torch.from_numpy(grad_w), None


@register_shape_inferer(NumpyTanhScale, replace=True)
def _same_as_x(node, shapes, dtypes):
    return [shapes[0]], [dtypes[0]]


class ValueBranch(torch.autograd.Function):
    """A branch on a tensor's value (torch.export cannot trace it), two outputs."""

    @staticmethod
    def forward(ctx, x):
        ctx.positive = bool(x.sum() > 0)
        return (x * 2 if ctx.positive else x * 3), x.abs()

    @staticmethod
    def backward(ctx, grad_scaled, grad_abs):
        return grad_scaled * (5 if ctx.positive else 7)


@register_shape_inferer(ValueBranch, replace=True)
def _twice_as_x(node, shapes, dtypes):
    return [shapes[0], shapes[0]], [dtypes[0], dtypes[0]]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.w = nn.Parameter(torch.rand(8) + 0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x, labels):
        h = NumpyTanhScale.apply(self.first(x), self.w, 1.5)
        scaled, magnitude = ValueBranch.apply(h)
        return F.cross_entropy(self.head(scaled + magnitude * 0.1), labels)


def _batches(sizes=(4, 5, 3, 6)):
    generator = torch.Generator().manual_seed(0)
    for batch in sizes:
        yield torch.randn(batch, 6, generator=generator), torch.randint(0, 3, (batch,), generator=generator)


@needs_extensions
def test_untraceable_functions_train_like_torch_as_python_ops():
    from test_module_conformance import train_side_by_side

    torch.manual_seed(0)
    model = Model()
    x, labels = next(_batches((5,)))
    reference = [p.detach().clone() for p in model.parameters()]
    wrapped = ORTModule(model, builder="torch")
    loss = wrapped(x, labels)
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    for p, r in zip(model.parameters(), reference):
        assert torch.equal(p.detach(), r)
        p.grad = None
    expected_loss = model(x, labels)
    expected = torch.autograd.grad(expected_loss, list(model.parameters()))
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert kernels.live_contexts() == 0  # each backward released its forward's ctx

    trained = train_side_by_side(model, lambda m, b: m(*b), _batches(), builder="torch")
    assert trained.graph_builds == 1  # the batch dim is dynamic through the Python ops
    assert kernels.live_contexts() == 0
    before = kernels.live_contexts()
    x, labels = next(_batches((7,)))
    with torch.no_grad():  # a forward graph: the Python ops keep no ctx
        assert trained(x, labels).item() == pytest.approx(model(x, labels).item(), rel=1e-5)
    assert trained.transitions.current_graph.kind == "forward"
    assert kernels.live_contexts() == before


@needs_extensions
def test_two_forwards_then_their_backwards_in_either_order():
    from ortpass.runtime.split_session import SplitTrainingSession
    from ortpass.training.from_torch import build_training_graph_from_torch

    torch.manual_seed(1)
    model = Model()
    batches = list(_batches((4, 6)))
    graph = build_training_graph_from_torch(
        model, batches[0], input_names=["x", "labels"], dynamic_axes={"x": {0: "batch"}, "labels": {0: "batch"}}
    )
    assert sum(python_ops.is_python_op(n) for n in graph.graph) == 4  # two Functions, forward and backward
    session = SplitTrainingSession(graph)
    from onnxruntime.capi import _pybind_state as C

    def ort(value):
        return C.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), C.OrtDevice(0, 0, 0))

    params = {name: ort(p.detach().numpy()) for name, p in model.named_parameters()}
    feeds = [{**params, "x": ort(x.numpy()), "labels": ort(labels.numpy())} for x, labels in batches]
    runs = [session.run_forward(f) for f in feeds]
    assert kernels.live_contexts() == 4
    for k in (1, 0):  # the second forward's backward first
        gradients = session.run_backward(feeds[k], runs[k][1], {})
        expected = torch.autograd.grad(model(*batches[k]), list(model.parameters()))
        by_name = dict(zip(session.gradients, gradients))
        for (name, _), e in zip(model.named_parameters(), expected):
            torch.testing.assert_close(torch.from_numpy(by_name[f"{name}_grad"].numpy()), e, rtol=1e-5, atol=1e-6)
    assert kernels.live_contexts() == 0



@needs_extensions
def test_a_split_step_dropped_before_backward_releases_its_python_op_contexts():
    """The loop computes on the outputs (a split step): a step whose outputs are kept holds
    its Python ops' contexts until its backward, which releases them; a step dropped
    before backward (a skipped step) releases them when torch frees it, not never."""
    import gc

    torch.manual_seed(2)
    model = Model()
    wrapped = ORTModule(model, builder="torch", differentiate="outputs")
    x, labels = next(_batches((4,)))
    before = kernels.live_contexts()
    kept = wrapped(x, labels)
    assert wrapped.transitions.current_graph.kind == "split"
    assert kernels.live_contexts() == before + 2  # two Functions' forwards wait for their backward
    dropped = wrapped(x, labels)
    assert kernels.live_contexts() == before + 4
    del dropped
    gc.collect()
    assert kernels.live_contexts() == before + 2  # the dropped step's went, the kept step's stay
    kept.backward()
    expected = torch.autograd.grad(model(x, labels), list(model.parameters()))
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-6)
    del kept
    gc.collect()
    assert kernels.live_contexts() == before

def test_a_traceable_function_stays_in_the_graph():
    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 3

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return Doubled.apply(self.linear(x)).sum()

    from ortpass.training.from_torch import build_training_graph_from_torch

    graph = build_training_graph_from_torch(Small(), [torch.randn(3, 4)])
    assert not any(python_ops.is_python_op(n) for n in graph.graph)
    assert {n.op_type for n in graph.graph} >= {"Mul", "Gemm"}  # its forward and backward, traced


class ThroughNumpyWithoutShapes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.from_numpy(x.detach().numpy() * 2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _Kernel(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.linear, self.function = nn.Linear(4, 4), function

    def forward(self, x):
        return self.function.apply(self.linear(x)).sum()


@needs_extensions
def test_a_function_without_shapes_is_refused_naming_the_registry():
    wrapped = ORTModule(_Kernel(ThroughNumpyWithoutShapes), builder="torch")
    with pytest.raises(OrtpassError, match=r"ThroughNumpyWithoutShapes, whose forward torch cannot trace.*register_shape_inferer"):
        wrapped(torch.randn(3, 4))


def test_without_onnxruntime_extensions_the_function_is_refused(monkeypatch):
    monkeypatch.setattr(python_ops, "extensions_available", lambda: False)
    wrapped = ORTModule(Model(), builder="torch")
    with pytest.raises(OrtpassError, match=r"NumpyTanhScale, whose forward torch cannot trace.*pip install onnxruntime-extensions"):
        wrapped(*next(_batches()))


class FailsBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.from_numpy(x.detach().numpy().copy())

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("backward refuses")


@register_shape_inferer(FailsBackward, replace=True)
def _fails_shapes(node, shapes, dtypes):
    return [shapes[0]], [dtypes[0]]


@needs_extensions
def test_a_python_op_error_is_raised_from_the_step():
    """onnxruntime-extensions aborts the process on a Python op's exception; the kernel
    keeps it and the step raises it."""
    wrapped = ORTModule(_Kernel(FailsBackward), builder="torch")
    with pytest.raises(OrtpassError, match=r"backward of torch.autograd.Function .*FailsBackward raised ValueError: backward refuses"):
        wrapped(torch.randn(3, 4)).backward()  # a loss step runs forward and backward in one run
    assert kernels.live_contexts() == 0


@needs_extensions
def test_a_cached_graph_from_another_process_is_built_again(tmp_path, monkeypatch):
    """The ops' numbers are the tracing process's: another process's cached graph could name
    another call under the same number, so ORTModule builds its graph again."""
    torch.manual_seed(0)
    model = Model()
    x, labels = next(_batches((4,)))
    first = ORTModule(model, builder="torch", cache_dir=tmp_path)
    expected = first(x, labels).item()
    assert first.graph_builds == 1
    monkeypatch.setattr(python_ops, "PROCESS_TOKEN", "another")  # as a fresh process sees the cache
    again = ORTModule(model, builder="torch", cache_dir=tmp_path)
    assert again(x, labels).item() == pytest.approx(expected, rel=1e-6)
    assert again.graph_builds == 1  # built, not loaded
