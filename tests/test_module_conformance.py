"""ORTModule's contract, loop by loop: every case trains the wrapped module and a copy in
torch eager side by side (AdamW, several steps) and compares each step's loss, then the
parameters and buffers; or it checks that the wrapper refuses, by name.

Loop patterns (loss inside the module or computed in torch, gradients into inputs,
several outputs with gradient, accumulation, frozen and eval submodules, batch size and
sequence length changing every step, copies) times model kinds (an MLP, CNNs with
BatchNorm and MaxPool up to a ResNet-18, the decoder ortpass ships; Hugging Face
families in tests/test_module_families.py).
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Callable, Iterable

import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortpass.errors import OrtpassError
from ortpass.runtime.module import ORTModule
from ortpass.testing.models import GPTDecoder

Loop = Callable[[nn.Module, tuple], torch.Tensor]


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| relative to max|b|, absolute below 1."""
    return ((a - b).abs().max() / max(b.abs().max().item(), 1.0)).item()


def train_side_by_side(
    model: nn.Module,
    loop: Loop,
    batches: Iterable[tuple],
    *,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    tolerance: float = 1e-4,
    micro_batches: int = 1,
    optimizer: Callable = lambda params: torch.optim.AdamW(params, lr=1e-3, eps=1e-6),
    **options,
) -> nn.Module:
    """Train ``wrap(model)`` (default ``ORTModule(model, **options)``) and a torch copy of
    ``model`` alike: ``loop(model, batch)`` gives the loss; each step's loss must agree, and
    after the last step every parameter and buffer.  ``micro_batches`` > 1 accumulates
    that many backward calls (loss / n) per optimizer step.  Returns the wrapped model.

    AdamW's eps is 1e-6: Adam divides by sqrt(v) + eps, and a gradient that is rounding
    noise (a bias before a normalization) would otherwise be scaled up to a full step."""
    reference = copy.deepcopy(model)
    wrapped = wrap(model) if wrap is not None else ORTModule(model, **options)
    optimizers = [optimizer(m.parameters()) for m in (wrapped, reference)]
    for step, batch in enumerate(batches):
        losses = [loop(wrapped, batch), loop(reference, batch)]
        assert losses[0].item() == pytest.approx(losses[1].item(), rel=tolerance, abs=1e-6), f"step {step}"
        for loss in losses:
            (loss / micro_batches).backward()
        if (step + 1) % micro_batches == 0:
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    _assert_same_state(model, reference, tolerance)
    return wrapped


def fewer_on_training_build(names, keep) -> list:
    """``names`` as parameters, those outside ``keep`` skipped on the training build: the
    torch builder's graphs are the same on either runtime, so a few cases check that the
    training build runs them, and CI's stock venv runs them all."""
    from ortpass.training.backend import has_training_ops

    if not has_training_ops():
        return list(names)
    skip = pytest.mark.skip(reason="the training build runs fewer of these; CI's stock venv runs them all")
    return [name if name in keep else pytest.param(name, marks=skip) for name in names]


def _assert_same_state(model: nn.Module, reference: nn.Module, tolerance: float) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert _close(p.detach(), q.detach()) <= tolerance, name
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        if b.is_floating_point():
            assert _close(b, c) <= tolerance, name
        else:
            assert torch.equal(b, c), name
    for (name, m), n in zip(model.named_modules(), reference.modules()):
        assert m.training == n.training, f"mode of {name or 'the module'}"


# -- models -----------------------------------------------------------------------------------


class MLP(nn.Module):
    """Logits out, no loss: the loop computes it."""

    def __init__(self, width: int = 16, classes: int = 5, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(width, classes)

    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


class TwoHeads(nn.Module):
    """Two outputs that both enter the loss."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return {"classes": self.a(h), "score": self.b(h).squeeze(-1)}


def _mlp_batches(steps: int, sizes=(6,), seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    for k in range(steps):
        n = sizes[k % len(sizes)]
        yield torch.randn(n, 8, generator=generator), torch.randint(0, 5, (n,), generator=generator)


class _FlatLogits(nn.Module):
    """Put in place of a GPTDecoder's loss: its forward then returns the flat logits."""

    def forward(self, logits, labels):
        return logits


def cross_entropy_outside(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


# -- loops ------------------------------------------------------------------------------------


@pytest.mark.stock
def test_loss_computed_in_torch_from_the_logits():
    torch.manual_seed(0)
    wrapped = train_side_by_side(MLP(), cross_entropy_outside, _mlp_batches(5, sizes=(6, 3, 9)))
    assert wrapped.transitions.current_graph.kind == "split"
    assert wrapped.graph_builds == 1  # three batch sizes, one graph: the batch dim was proven dynamic


@pytest.mark.stock
def test_several_outputs_with_gradient():
    def loop(model, batch):
        x, y = batch
        out = model(x)
        return F.cross_entropy(out["classes"], y % 4) + out["score"].square().mean()

    torch.manual_seed(0)
    train_side_by_side(TwoHeads(), loop, _mlp_batches(4))


@pytest.mark.stock
def test_a_loss_and_its_logits_both_differentiated_with_differentiate_outputs():
    """Distillation: the module's loss plus a term on its logits."""
    torch.manual_seed(0)
    model = GPTDecoder(vocab=32, hidden=16, heads=2, layers=1, dropout=0.0)

    class LossAndLogits(nn.Module):
        def __init__(self, decoder):
            super().__init__()
            self.decoder = decoder

        def forward(self, ids, labels):
            d = self.decoder
            x = d.tok(ids) + d.pos(torch.arange(ids.shape[1]))
            logits = d.head(d.ln_f(d.blocks[0](x)))
            return {"loss": d.loss(logits.flatten(0, 1), labels.flatten()), "logits": logits}

    def loop(m, batch):
        out = m(*batch)
        return out["loss"] + 0.1 * out["logits"].square().mean()

    batches = [(torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))) for _ in range(3)]
    wrapped = train_side_by_side(LossAndLogits(model), loop, batches, differentiate="outputs")
    assert wrapped.transitions.current_graph.kind == "split"
    with pytest.raises(OrtpassError, match=r"a gradient reached output logits"):
        loop(ORTModule(LossAndLogits(copy.deepcopy(model))), batches[0]).backward()


class Outer(nn.Module):
    """The wrapped module inside a bigger torch model: a torch layer before it, so its
    input requires grad."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.inner = inner

    def forward(self, x):
        return self.inner(torch.relu(self.pre(x)))


@pytest.mark.stock
@pytest.mark.parametrize("loss_inside", [False, True], ids=["loss-outside", "loss-inside"])
def test_gradient_flows_into_inputs_that_require_it(loss_inside):
    torch.manual_seed(0)

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP()

        def forward(self, h):
            return self.mlp(h).square().mean()

    inner = WithLoss() if loss_inside else MLP()

    def loop(model, batch):
        out = model(batch[0])
        return out if loss_inside else F.cross_entropy(out, batch[1])

    def wrap(model):
        model.inner = ORTModule(model.inner)
        return model

    wrapped = train_side_by_side(Outer(inner), loop, _mlp_batches(4, sizes=(6, 4)), wrap=wrap)
    assert wrapped.inner.transitions.current_graph.kind == ("loss" if loss_inside else "split")


@pytest.mark.stock
@pytest.mark.parametrize("loss_inside", [False, True], ids=["loss-outside", "loss-inside"])
def test_gradient_accumulation_over_micro_batches(loss_inside):
    torch.manual_seed(0)
    model = GPTDecoder(vocab=32, hidden=16, heads=2, layers=2, dropout=0.0)
    if loss_inside:
        loop = lambda m, b: m(*b)  # noqa: E731
    else:
        model.loss = _FlatLogits()
        loop = lambda m, b: F.cross_entropy(m(*b), b[1].flatten())  # noqa: E731
    batches = [(torch.randint(0, 32, (n, 8)), torch.randint(0, 32, (n, 8))) for n in (2, 3, 2, 1, 2, 2, 3, 2)]
    train_side_by_side(model, loop, batches, micro_batches=4)


@pytest.mark.stock
def test_losses_summed_before_one_backward_with_dropout_recomputed():
    """Two forwards, then one backward of their sum: backward runs in reverse order.  With
    dropout recomputed, each backward must still see its own forward's mask."""
    torch.manual_seed(0)
    model = GPTDecoder(vocab=32, hidden=16, heads=2, layers=2, dropout=0.1)
    model.loss = _FlatLogits()
    wrapped = ORTModule(copy.deepcopy(model))
    ids = [torch.randint(0, 32, (2, 8)) for _ in range(2)]
    onnxruntime.set_seed(0)
    reference_grads = []
    for k in range(2):  # each micro-batch alone: forward, backward
        wrapped.zero_grad()
        F.cross_entropy(wrapped(ids[k], ids[k]), ids[k].flatten()).backward()
        reference_grads.append({n: p.grad.clone() for n, p in wrapped.named_parameters()})
    # The same ORT masks again, summed: run a fresh wrapper in the same order.  A dropout
    # the pipeline seeds starts from its seed in each session; one it leaves unseeded (the
    # torch builder's, where nothing is recomputed) draws from ORT's process-wide
    # generator, which a fresh wrapper does not reset: onnxruntime.set_seed does, here and
    # before the first run.
    onnxruntime.set_seed(0)
    again = ORTModule(copy.deepcopy(model))
    losses = [F.cross_entropy(again(ids[k], ids[k]), ids[k].flatten()) for k in range(2)]
    sum(losses).backward()
    for name, p in again.named_parameters():
        expected = reference_grads[0][name] + reference_grads[1][name]
        assert _close(p.grad, expected) <= 1e-5, name


@pytest.mark.stock
def test_frozen_parameters_and_eval_submodules_follow_torch():
    torch.manual_seed(0)
    model = MLP(dropout=0.5)
    model.fc1.weight.requires_grad_(False)
    model.drop.eval()  # inside a training model: off, as in torch
    wrapped = train_side_by_side(model, cross_entropy_outside, _mlp_batches(4))
    assert model.training and not model.drop.training  # every flag as the user left it
    assert model.fc1.weight.grad is None and "fc1.weight" not in wrapped.transitions.current_graph.params


@pytest.mark.stock
def test_batch_and_sequence_length_change_every_step():
    torch.manual_seed(0)
    model = GPTDecoder(vocab=32, hidden=16, heads=2, layers=2, dropout=0.0)
    shapes = [(2, 8), (3, 5), (1, 12), (4, 8), (2, 3)]
    batches = [(torch.randint(0, 32, s), torch.randint(0, 32, s)) for s in shapes]
    wrapped = train_side_by_side(model, lambda m, b: m(*b), batches)
    assert wrapped.graph_builds <= 2  # the size-1 batch is pinned (it may broadcast), the rest proven dynamic


@pytest.mark.stock
def test_deepcopy_pickle_and_torch_save_carry_the_module_not_the_sessions(tmp_path):
    torch.manual_seed(0)
    wrapped = ORTModule(MLP())
    x, y = next(_mlp_batches(1))
    F.cross_entropy(wrapped(x), y).backward()
    ema = copy.deepcopy(wrapped)  # an EMA copy, as training scripts make
    assert ema.graph_builds == wrapped.graph_builds and ema.transitions.current_graph is None
    with torch.no_grad():
        torch.testing.assert_close(ema(x), wrapped.module(x))
    restored = pickle.loads(pickle.dumps(wrapped))
    buffer = io.BytesIO()
    torch.save(wrapped, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for copy_ in (restored, loaded):
        out = copy_(x)
        F.cross_entropy(out, y).backward()
        torch.testing.assert_close(out, wrapped.module(x), rtol=1e-5, atol=1e-6)


@pytest.mark.stock
def test_torch_compile_runs_the_ort_call_as_a_graph_break():
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    compiled = torch.compile(ORTModule(model), backend="eager")
    x, y = next(_mlp_batches(1))
    loss = F.cross_entropy(compiled(x), y)
    loss.backward()
    expected = F.cross_entropy(reference(x), y)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert _close(model.fc1.weight.grad, reference.fc1.weight.grad) <= 1e-5


# -- CNNs -------------------------------------------------------------------------------------


class SmallCNN(nn.Module):
    def __init__(self, norm: Callable[[int], nn.Module] = nn.BatchNorm2d, pool: nn.Module | None = None):
        super().__init__()
        # No conv bias before a norm (as ResNets do): a training BatchNorm removes it, its
        # gradient is rounding noise, and Adam would scale that noise up to full steps.
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.norm = norm(8)
        self.pool = pool if pool is not None else nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.norm2 = norm(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        h = self.pool(F.relu(self.norm(self.conv(x))))
        h = F.relu(self.norm2(self.conv2(h)))
        return self.head(h.mean((2, 3)))


class FrozenBatchNorm2d(nn.Module):
    """torchvision's FrozenBatchNorm2d: BatchNorm with its statistics and affine frozen as buffers."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("weight", torch.rand(n) + 0.5)
        self.register_buffer("bias", torch.randn(n) * 0.1)
        self.register_buffer("running_mean", torch.randn(n) * 0.1)
        self.register_buffer("running_var", torch.rand(n) + 0.5)

    def forward(self, x):
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        bias = self.bias - self.running_mean * scale
        return x * scale.reshape(1, -1, 1, 1) + bias.reshape(1, -1, 1, 1)


def _images(steps: int, sizes=(4,), side: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    for k in range(steps):
        n = sizes[k % len(sizes)]
        yield torch.randn(n, 3, side, side, generator=generator), torch.randint(0, 10, (n,), generator=generator)


@pytest.mark.parametrize(
    "norm",
    [
        pytest.param(nn.BatchNorm2d, marks=pytest.mark.stock),
        # A cumulative average: the torch builder (stock) refuses it, naming the module
        # (tests/test_from_torch.py).
        lambda n: nn.BatchNorm2d(n, momentum=None),
        pytest.param(lambda n: nn.BatchNorm2d(n, track_running_stats=False), marks=pytest.mark.stock),
        pytest.param(FrozenBatchNorm2d, marks=pytest.mark.stock),
    ],
    ids=["batchnorm", "momentum-none", "no-running-stats", "frozen"],
)
def test_cnn_with_batchnorm_and_maxpool_trains_like_torch(norm):
    torch.manual_seed(0)
    train_side_by_side(SmallCNN(norm), cross_entropy_outside, _images(4, sizes=(4, 3, 5)))


@pytest.mark.stock
def test_batchnorm_in_eval_mode_uses_and_keeps_its_statistics():
    torch.manual_seed(0)
    model = SmallCNN()
    for x, _ in _images(2):
        model(x)  # some statistics to use
    model.norm.eval()  # frozen inside a training model, as fine-tuning does
    train_side_by_side(model, cross_entropy_outside, _images(3))


@pytest.mark.stock
def test_average_pool_keeps_its_dims_static_and_builds_again_for_a_new_batch_size():
    """ORT's AveragePoolGrad crashes the process with a dynamic batch: those dims are
    exported static, and another batch size builds another graph."""
    torch.manual_seed(0)
    wrapped = train_side_by_side(SmallCNN(pool=nn.AvgPool2d(2)), cross_entropy_outside, _images(3, sizes=(4, 2)))
    assert wrapped.graph_builds == 2


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """torchvision's ResNet-18 layout (7x7 stem, max pool, [2, 2, 2, 2] basic blocks,
    global average pool), narrowed to ``width`` channels for a test."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        blocks, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
            for k in range(2):
                blocks.append(BasicBlock(cin, cout, 2 if stage > 0 and k == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


@pytest.mark.slow
def test_resnet18_trains_like_torch():
    """On ORT's builder.  The torch builder's (stock) is checked step by step at its own
    parameters (tests/test_conv_gradient.py): after two SGD steps this ResNet's gradients
    are ill-conditioned, torch's own 10% apart at two points 1.7e-7 apart (measured), so
    two trajectories cannot be compared there to 1e-4."""
    torch.manual_seed(0)
    # SGD: gradients agree to 5e-6, but AdamW normalizes each element by its own gradient,
    # and the deep BatchNorms' near-zero gradient elements then moved 2e-4 apart in 3 steps.
    sgd = lambda params: torch.optim.SGD(params, lr=0.01)  # noqa: E731
    train_side_by_side(ResNet18(), cross_entropy_outside, _images(3, sizes=(4, 3), side=64), optimizer=sgd)


# -- refusals and fallback --------------------------------------------------------------------


@pytest.mark.stock
def test_a_module_wrapped_in_ddp_is_refused_naming_ddp(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(MLP())
        with pytest.raises(OrtpassError, match=r"cannot wrap DistributedDataParallel.*DDP\(ORTModule\(model\)\)"):
            ORTModule(ddp)
    finally:
        dist.destroy_process_group()


@pytest.mark.stock
def test_autocast_is_refused_naming_autocast_and_the_graph_is_untouched():
    torch.manual_seed(0)
    wrapped = ORTModule(MLP())
    x, y = next(_mlp_batches(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(OrtpassError, match=r"does not run under torch.autocast"):
            wrapped(x)
    assert wrapped.graph_builds == 0


class Unexportable(nn.Module):
    """An op with no ONNX symbolic (torch.fft), so the export fails."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.fft.rfft(self.fc(x)).abs()


@pytest.mark.stock
def test_fallback_runs_torch_with_one_warning_naming_the_cause():
    torch.manual_seed(0)
    # ORT's builder names the op torch.onnx cannot write (fft); torch's, where its backward
    # fails (complex outputs).
    with pytest.raises(OrtpassError, match=r"fft|complex dtype"):
        ORTModule(Unexportable())(torch.randn(2, 8))
    model = Unexportable()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, fallback="torch")
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match=r"runs Unexportable in torch.*(fft|complex dtype)"):
        out = wrapped(x)
    torch.testing.assert_close(out, reference(x))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second call says nothing
        wrapped(x).sum().backward()
    assert model.fc.weight.grad is not None
    assert [action for action, _ in wrapped.transitions.transitions] == ["fallback"]


@pytest.mark.stock
def test_batchnorm_statistics_update_under_no_grad_in_training_mode_as_in_torch():
    """torch updates a training BatchNorm's statistics under no_grad too (a forward-only
    pass over data in train mode): the wrapper runs its training graph for that."""
    torch.manual_seed(0)
    model = SmallCNN()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    with torch.no_grad():
        for x, _ in _images(2, sizes=(4, 3)):
            torch.testing.assert_close(wrapped(x), reference(x), rtol=1e-4, atol=1e-5)
    _assert_same_state(model, reference, 1e-5)
    assert int(model.norm.num_batches_tracked) == 2


@pytest.mark.stock
def test_a_split_graph_comes_back_from_the_cache(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    x, y = next(_mlp_batches(1))
    first = ORTModule(copy.deepcopy(model), cache_dir=tmp_path)
    F.cross_entropy(first(x), y).backward()
    second = ORTModule(model, cache_dir=tmp_path)
    F.cross_entropy(second(x), y).backward()
    assert [action for action, _ in second.transitions.transitions] == ["load"]
    assert second.transitions.current_graph.kind == "split"
    for p, q in zip(second.parameters(), first.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
