"""A forward whose Python reads a tensor's value is refused, naming the line, never traced
into one frozen path; ``fallback="torch"`` runs it in torch; a conversion from sizes only
is not refused (:mod:`ortpass.export.control_flow`)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from test_module_conformance import train_side_by_side

from ortpass.export.control_flow import DataDependentControlFlow
from ortpass.runtime.module import ORTModule
from ortpass.training.backend import has_training_ops

BUILDERS = [
    pytest.param("ort", marks=pytest.mark.skipif(not has_training_ops(), reason="needs onnxruntime-training")),
    pytest.param("torch", marks=pytest.mark.stock),
]


class Branch(nn.Module):
    """``if x.mean() > 0:``: which branch depends on the batch."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        if y.mean() > 0:  # BRANCH
            y = y * 2
        return (y**2).mean()


class SliceToLength(nn.Module):
    """``x[:, :int(lengths.max())]``: a size read from a tensor's data."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, lengths):
        y = self.linear(x)
        y = y[:, : int(lengths.max())]  # SLICE
        return (y**2).mean()


class LoopCount(nn.Module):
    """``for _ in range(int(n))``: a loop count read from a tensor."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, n):
        for _ in range(int(n)):  # LOOP
            x = torch.tanh(self.linear(x))
        return (x**2).mean()


def _line(cls: type, mark: str) -> int:
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, line in enumerate(lines) if f"# {mark}" in line)


def _branch_batches():
    # The first batch takes one branch, later ones the other.
    yield (torch.full((2, 3, 4), 3.0),)
    for seed in (1, 2, 3):
        yield (torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(seed)) - 3.0,)


def _slice_batches():
    for seed, lengths in ((1, [3, 1]), (2, [2, 2]), (3, [1, 1]), (4, [3, 2])):
        yield torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(seed)), torch.tensor(lengths)


def _loop_batches():
    for seed, n in ((1, 2), (2, 1), (3, 3), (4, 2)):
        yield torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(seed)), torch.tensor(n)


CASES = {
    "branch": (Branch, "BRANCH", _branch_batches),
    "slice": (SliceToLength, "SLICE", _slice_batches),
    "loop": (LoopCount, "LOOP", _loop_batches),
}


def _model(cls: type) -> nn.Module:
    torch.manual_seed(0)
    return cls()


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_value_read_in_python_is_refused_naming_the_line(case, builder):
    cls, mark, batches = CASES[case]
    wrapped = ORTModule(_model(cls), builder=builder)
    with pytest.raises(DataDependentControlFlow) as raised:
        wrapped(*next(batches()))
    message = str(raised.value)
    assert f"{__file__}:{_line(cls, mark)}" in message
    assert "fallback='torch'" in message
    assert "tensor(" not in message  # no tensor's values in the message


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_fallback_runs_it_in_torch_like_torch(case, builder):
    cls, _, batches = CASES[case]
    with pytest.warns(UserWarning, match="DataDependentControlFlow") as warned:
        wrapped = train_side_by_side(_model(cls), lambda model, batch: model(*batch), batches(),
                                     builder=builder, fallback="torch", tolerance=1e-6)  # fmt: skip
    (warning,) = [w for w in warned if "DataDependentControlFlow" in str(w.message)]
    assert warning.filename == __file__  # the loop's call, not torch's or ortpass's frames
    assert wrapped.graph_builds == 0


class ShapeOnly(nn.Module):
    """Python ints and bools from sizes only: ``int(x.shape[1])``, a branch on a size."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        half = int(x.shape[1]) // 2
        if x.shape[0] > 1:
            y = y + 1
        return (y[:, :half] ** 2).mean()


@pytest.mark.parametrize("builder", BUILDERS)
def test_a_value_from_sizes_only_is_not_refused(builder):
    batches = [(torch.randn(b, s, 4, generator=torch.Generator().manual_seed(b * s)),) for b, s in ((2, 6), (3, 6), (2, 8))]
    wrapped = train_side_by_side(_model(ShapeOnly), lambda model, batch: model(*batch), batches, builder=builder)
    assert wrapped.graph_builds >= 1  # ran on ORT: nothing fell back


@pytest.mark.skipif(not has_training_ops(), reason="the torch builder refuses momentum=None (from_torch.py)")
def test_batch_norms_cumulative_average_is_a_known_safe_read():
    """``momentum=None`` reads ``num_batches_tracked`` in torch's own BatchNorm (here in an
    ``nn.Sequential`` of torch layers only); ORTModule computes the statistics in torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 1))
    batches = [(torch.randn(6, 4, generator=torch.Generator().manual_seed(seed)),) for seed in (1, 2, 3)]
    wrapped = train_side_by_side(model, lambda m, batch: (m(*batch) ** 2).mean(), batches)
    assert wrapped.graph_builds == 1


class ScaleByMax(torch.autograd.Function):
    """Reads a value in its forward: exported as one PythonOp, which torch runs every step."""

    @staticmethod
    def forward(ctx, x):
        ctx.scale = float(x.abs().max()) + 1.0
        return x / ctx.scale

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.scale


class ScaledByAFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return (ScaleByMax.apply(self.linear(x)) ** 2).mean()


@pytest.mark.skipif(not has_training_ops(), reason="a Function runs as a PythonOp on ORT's builder only")
def test_a_value_read_inside_an_autograd_function_is_not_refused():
    from ortpass.export import register_function

    register_function(ScaleByMax)
    batches = [(torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(seed)) * seed,) for seed in (1, 2, 3)]
    wrapped = train_side_by_side(_model(ScaledByAFunction), lambda model, batch: model(*batch), batches)
    assert wrapped.graph_builds == 1


@pytest.mark.stock
def test_a_transformers_attention_mask_is_not_refused():
    """transformers reads the mask's sizes while tracing (its value-reading shortcuts are
    off under tracing): a padded batch trains on ORT like torch."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=100, n_embd=16, n_layer=1, n_head=2, n_positions=32, use_cache=False,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)

    def batches():
        generator = torch.Generator().manual_seed(0)
        for batch, seq, padded in ((2, 8, 3), (2, 8, 0), (3, 8, 5)):
            ids = torch.randint(0, 100, (batch, seq), generator=generator)
            mask = torch.ones_like(ids)
            mask[0, seq - padded :] = 0
            yield ids, mask

    def loop(m, batch):
        ids, mask = batch
        return m(input_ids=ids, attention_mask=mask, labels=ids).loss

    wrapped = train_side_by_side(model, loop, batches())
    assert wrapped.graph_builds == 1
