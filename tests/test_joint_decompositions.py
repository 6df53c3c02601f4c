"""The decompositions the torch builder adds to its joint trace for speed
(``ortpass.training.joint_decompositions``): the slice gradient and the square, each equal
to torch's own in eager; a model that slices (rotary's halves) trains like torch with the
gradient concatenated zeros, not torch.onnx's ``ScatterND`` between Transposes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_module_conformance import train_side_by_side
from torch import nn

from ortpass.training.from_torch import build_training_graph_from_torch
from ortpass.training.joint_decompositions import pow_by_multiplying, slice_backward

aten = torch.ops.aten
BIG = 9223372036854775807  # torch's "to the end"

CASES = {
    # name: (input sizes, dim, start, end)
    "first-half": ((2, 3, 8), -1, 0, 4),
    "second-half-to-the-end": ((2, 3, 8), 2, 4, BIG),
    "middle-of-dim-0": ((6, 5), 0, 1, 4),
    "negative-bounds": ((4, 7, 3), 1, -5, -1),
    "start-before-the-beginning": ((4, 7), 1, -20, 3),
    "empty": ((4, 7), 1, 5, 2),
    "whole": ((3, 5), 1, 0, BIG),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_torchs_slice_backward(name):
    sizes, dim, start, end = CASES[name]
    sliced = aten.slice.Tensor(torch.empty(sizes), dim, start, end)  # aten.slice clamps the bounds itself
    grad = torch.randn(sliced.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = aten.slice_backward(grad, list(sizes), dim, start, end, 1)
    assert torch.equal(slice_backward(grad, list(sizes), dim, start, end, 1), expected)


def test_a_step_other_than_one_is_left_to_torch():
    assert slice_backward(torch.ones(2, 2), [2, 4], 1, 0, 4, 2) is NotImplemented


class _Rotary(nn.Module):
    """LLaMA's ``rotate_half`` on a projection, the halves sliced off the last dim (with
    ``step`` 2: the even and odd columns instead, whose gradient torch.onnx writes)."""

    def __init__(self, step: int = 1):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.step = step

    def forward(self, x, labels=None):
        h = self.proj(x)
        if self.step == 1:
            rotated = torch.cat((-h[..., 4:], h[..., :4]), dim=-1)
        else:
            rotated = torch.cat((-h[..., 1::2], h[..., ::2]), dim=-1)
        logits = self.head(h * 0.5 + rotated * 0.25)
        return logits if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.stock
@pytest.mark.parametrize("step", [1, 2])
def test_a_model_slicing_halves_trains_like_torch_its_gradient_concatenated_zeros(step):
    """Batch and sequence change every step, in one graph: the decomposition guards on no
    size (``aten.constant_pad_nd`` did, and made the batch static).  With a step of 2 the
    gradient stays torch.onnx's ScatterND."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, s, 8, generator=generator), torch.randint(0, 3, (n, s), generator=generator))
               for n, s in ((4, 6), (3, 5), (2, 7))]  # fmt: skip
    loop = lambda model, batch: F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())  # noqa: E731
    wrapped = train_side_by_side(_Rotary(step), loop, batches, builder="torch")
    assert wrapped.graph_builds == 1, wrapped.transitions.transitions
    model = build_training_graph_from_torch(_Rotary(step), batches[0], input_names=["x", "labels"],
                                            dynamic_axes={"x": [0, 1], "labels": [0, 1]})  # fmt: skip
    ops = [node.op_type for node in model.graph]
    assert ("ScatterND" in ops) == (step == 2), ops


@pytest.mark.parametrize("exponent", [2, 2.0, 1, 1.0])
def test_a_square_and_a_first_power_multiply_as_torch_does(exponent):
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pow_by_multiplying(x, exponent), torch.pow(x, exponent))


@pytest.mark.parametrize("exponent", [3, 0.5, -1, True])
def test_other_exponents_are_left_to_torch(exponent):
    assert pow_by_multiplying(torch.ones(2), exponent) is NotImplemented


def test_an_integer_tensor_is_left_to_torch():
    """``torch.pow(int_tensor, 2.0)`` is a float tensor; ``x * x`` would stay integer."""
    assert torch.pow(torch.tensor([2]), 2.0).is_floating_point()
    assert pow_by_multiplying(torch.tensor([2]), 2.0) is NotImplemented


class _Shifted(nn.Module):
    """Slices along the sequence, a symbolic dim: ``h[:, 1:]`` and ``h[:, :-1]`` (a causal
    LM's shift)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, labels=None):
        h = self.proj(x)
        logits = self.head(h[:, 1:] * h[:, :-1])
        return logits if labels is None else F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())


@pytest.mark.stock
def test_slices_along_a_symbolic_dim_leave_sizes_the_memory_planner_can_evaluate():
    """The zeros' sizes are ``1`` and ``seq - 1``, not ``Min``/``Max`` expressions of the
    sequence: those made recompute-again-late skip LLaMA's graph ("sizes unknown at the
    export's dims (s85 - Min(9223372036854775807, s85))") in a first version."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, s, 8, generator=generator), torch.randint(0, 3, (n, s), generator=generator))
               for n, s in ((4, 6), (3, 5), (2, 7))]  # fmt: skip
    loop = lambda model, batch: model(*batch)  # noqa: E731
    wrapped = train_side_by_side(_Shifted(), loop, batches, builder="torch")
    assert wrapped.graph_builds == 1, wrapped.transitions.transitions
    model = build_training_graph_from_torch(_Shifted(), batches[0], input_names=["x", "labels"],
                                            dynamic_axes={"x": [0, 1], "labels": [0, 1]})  # fmt: skip
    assert "ScatterND" not in [node.op_type for node in model.graph]
    dims = {str(dim) for node in model.graph for value in node.outputs if value.shape for dim in value.shape}
    assert not [dim for dim in dims if "Min" in dim or "Max" in dim], dims
