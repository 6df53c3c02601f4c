"""Smaller traps of ORTModule (#57): ``torch.utils.checkpoint`` bound at import, a fallback
that captured later calls, autocast's way out, and the warnings a first export printed."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint  # bound at import: the wrapper's patch never reaches it

from test_module_conformance import train_side_by_side

from ortpass.runtime.module import ORTModule
from ortpass.training.backend import has_training_ops

BUILDERS = [
    pytest.param("ort", marks=pytest.mark.skipif(not has_training_ops(), reason="needs onnxruntime-training")),
    pytest.param("torch", marks=pytest.mark.stock),
]


# -- torch.utils.checkpoint, either import style -----------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, style: str, use_reentrant: bool):
        super().__init__()
        self.style, self.use_reentrant = style, use_reentrant
        # An embedding-like first layer: torch's reentrant checkpoint gives the parameters
        # inside no gradient when no input of the block requires grad.
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        call = checkpoint if self.style == "bound" else torch.utils.checkpoint.checkpoint
        x = self.stem(x)
        for block in self.blocks:
            x = call(block, x, use_reentrant=self.use_reentrant)
        return nn.functional.cross_entropy(self.head(x), y)


def _classification_batches(steps: int = 4, width: int = 8):
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        yield torch.randn(6, width, generator=generator), torch.randint(0, 3, (6,), generator=generator)


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("style", ["bound", "attribute"])
def test_checkpoint_either_import_style_is_a_plain_call(style, use_reentrant, builder):
    torch.manual_seed(0)
    model = Checkpointed(style, use_reentrant)
    attribute = torch.utils.checkpoint.checkpoint
    with pytest.warns(UserWarning, match="graph recompute replaces it"):
        wrapped = train_side_by_side(model, lambda m, b: m(*b), _classification_batches(), builder=builder)
    assert wrapped.graph_builds == 1
    # The patch is undone: eager checkpointing is torch's own again.
    assert "apply" not in torch.utils.checkpoint.CheckpointFunction.__dict__
    assert torch.utils.checkpoint.checkpoint is attribute


# -- autocast: a fallback for one call, a way out that runs -------------------------------------


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def _loss_in_torch(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


@pytest.mark.parametrize("builder", BUILDERS)
def test_a_fallback_under_autocast_does_not_capture_later_calls(builder):
    """One call under autocast runs in torch (one warning); the next calls with the same
    inputs outside autocast run on ORT, as torch would compute them."""
    torch.manual_seed(0)
    model = Classifier()
    wrapped = ORTModule(model, builder=builder, fallback="torch")
    batches = list(_classification_batches(3))
    with pytest.warns(UserWarning, match="autocast") as warned, torch.autocast("cpu", dtype=torch.bfloat16):
        under = wrapped(batches[0][0])
    assert len([w for w in warned if "autocast" in str(w.message)]) == 1
    assert under.dtype == torch.bfloat16  # torch's autocast ran it
    assert wrapped.graph_builds == 0
    reference = Classifier()
    reference.load_state_dict(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no other fallback warning
        for x, _ in batches:
            torch.testing.assert_close(wrapped(x), reference(x), rtol=1e-5, atol=1e-6)
    assert wrapped.graph_builds == 1  # on ORT, not sent to torch for good


@pytest.mark.parametrize("builder", BUILDERS)
def test_the_autocast_refusal_names_a_way_out_that_runs(builder):
    torch.manual_seed(0)
    model = Classifier()
    with pytest.raises(Exception, match="autocast") as raised, torch.autocast("cpu", dtype=torch.bfloat16):
        ORTModule(model, builder=builder)(torch.randn(4, 8))
    message = str(raised.value)
    assert "bfloat16" not in message  # a bfloat16 model has no ORT CPU Gemm
    assert "model.half()" in message and "loss in torch" in message
    # The way out, followed: float16 weights, the loss in torch from the outputs.
    batches = [(x.half(), y) for x, y in _classification_batches(3)]
    train_side_by_side(model.half(), _loss_in_torch, batches, builder=builder, tolerance=2e-3,
                       optimizer=lambda params: torch.optim.SGD(params, lr=0.1))  # fmt: skip


# -- one line per export at most ------------------------------------------------------------------


class ManyBatchNorms(nn.Module):
    """ResNet-like: a dozen training BatchNorms between convolutions, no transformer layer."""

    def __init__(self, norms: int = 12):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.body = nn.Sequential(
            *(nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1, bias=False)) for _ in range(norms))
        )
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.body(self.stem(x)).mean((2, 3)))


def _images(steps: int = 3):
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        yield torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator)


@pytest.mark.parametrize("builder", BUILDERS)
def test_a_first_export_says_one_line_at_most(builder, recwarn, caplog):
    """A dozen BatchNorms: torch's exporter warned once per norm per export that it drops
    the ``num_batches_tracked`` update (ORTModule counts in torch): now at most one line."""
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO):
        wrapped = train_side_by_side(ManyBatchNorms(), _loss_in_torch, _images(), builder=builder,
                                     optimizer=lambda params: torch.optim.SGD(params, lr=0.01))  # fmt: skip
    assert wrapped.graph_builds == 1
    assert not [w for w in recwarn if "Removing mutation" in str(w.message)]
    # torch.onnx's dynamo exporter (the torch builder's ONNX writer) logs that torchvision's
    # ops are skipped when torchvision is absent, four lines each time it builds its
    # registry: torch's own notice, outside what ortpass's export says.
    registry = "torch.onnx._internal.exporter._registration"
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name != registry]
    said = [str(w.message) for w in recwarn] + logged
    assert len(said) <= 1, said


def test_layerwise_recompute_with_nothing_to_do_is_info_where_the_user_did_not_ask(caplog):
    """A caller that picked recompute's level (a default pipeline) hears "recomputes
    nothing" at INFO; asked for explicitly, it stays a WARNING (tests/test_layers.py)."""
    import ortpass
    from ortpass.export import export
    from ortpass.passes.recompute import layerwise_notices_at
    from ortpass.testing.models import MLP

    torch.manual_seed(0)
    x, labels = torch.randn(6, 8), torch.tensor([1, 2, 0, 4, 0, 3])
    axes = {"x": {0: "batch"}, "labels": {0: "batch"}}
    forward = export(MLP(d_in=8, hidden=16, classes=5), (x, labels), input_names=["x", "labels"], dynamic_axes=axes)
    with caplog.at_level(logging.INFO, logger="ortpass.passes.recompute"), layerwise_notices_at(logging.INFO):
        ortpass.pipeline("build-training-graph,fix-dropout-seed(level=1),recompute(level=1)")(forward)
    (record,) = [r for r in caplog.records if "recomputes nothing" in r.getMessage()]
    assert record.levelno == logging.INFO


@pytest.mark.parametrize("written", [False, True])
def test_ortmodule_says_recomputes_nothing_at_info_unless_the_user_wrote_the_pipeline(written, caplog):
    from ortpass.testing.models import MLP

    pipeline = "build-training-graph,fix-dropout-seed(level=1),recompute(level=1)" if written else None
    wrapped = ORTModule(MLP(d_in=8, hidden=16, classes=5), pipeline=pipeline)
    with caplog.at_level(logging.INFO, logger="ortpass.passes.recompute"):
        wrapped(torch.randn(6, 8), torch.tensor([1, 2, 0, 4, 0, 3])).backward()
    (record,) = [r for r in caplog.records if "recomputes nothing" in r.getMessage()]
    assert record.levelno == (logging.WARNING if written else logging.INFO)


def test_a_hugging_face_export_does_not_repeat_torchs_constant_folding_notes(recwarn):
    """torch's shape inference said a dozen times per LLaMA export that it does not fold a
    Slice with steps (ortpass exports without constant folding): not said at all now."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)  # fmt: skip
    wrapped = ORTModule(transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, 64, (2, 10))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    assert wrapped.graph_builds == 1
    assert not [w for w in recwarn if "Constant folding" in str(w.message)]
