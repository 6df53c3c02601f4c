"""The torch builder's label gather (``ortpass.training.label_gather``): a cross-entropy whose
labels were sparse at export is traced over its valid rows, and the graph's loss and
gradients equal torch eager's at every later batch, whatever its count of valid labels
(none, one, all); dense labels, a threshold of None and ``reduction="none"`` are left as
they are.  CI runs this file on stock onnxruntime and on the training build.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_module_conformance import fewer_on_training_build

from ortpass.analysis.step_memory import predict_step_memory
from ortpass.infra.metadata import get_export_info
from ortpass.runtime import TrainingSession
from ortpass.training.from_torch import build_training_graph_from_torch
from ortpass.training.label_gather import VALID_DIM_PREFIX, gathered_losses

pytestmark = pytest.mark.stock

CLASSES = 16
LOGGER = "ortpass.training.label_gather"


class _Head(nn.Module):
    """Logits ``batch x seq x classes`` from ids; the loss from ``loss_kwargs``."""

    def __init__(self, k_dim: bool = False, weighted: bool = False, **loss_kwargs):
        super().__init__()
        self.embed = nn.Embedding(CLASSES, 8)
        self.head = nn.Linear(8, CLASSES)
        self.k_dim, self.loss_kwargs = k_dim, loss_kwargs
        self.register_buffer("weight", torch.linspace(0.5, 2.0, CLASSES) if weighted else None)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.embed(ids)))
        if self.k_dim:  # N x C x L against N x L, as nn.CrossEntropyLoss takes sequences
            return nn.CrossEntropyLoss(weight=self.weight, **self.loss_kwargs)(logits.transpose(1, 2), labels)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), weight=self.weight, **self.loss_kwargs)


def _batch(batch: int, seq: int, valid_share: float, seed: int, ignore_index: int = -100):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CLASSES, (batch, seq), generator=generator)
    labels = torch.randint(1, CLASSES, (batch, seq), generator=generator)
    labels[torch.rand(batch, seq, generator=generator) >= valid_share] = ignore_index
    return ids, labels


def _build(module, ids, labels, **kwargs):
    return build_training_graph_from_torch(
        module, (ids, labels), input_names=["ids", "labels"], dynamic_axes={"ids": [0, 1], "labels": [0, 1]}, **kwargs
    )


def _assert_like_torch(module, model, batches):
    session = TrainingSession(model)
    for ids, labels in batches:
        module.zero_grad()
        expected = module(ids, labels)
        expected.backward()
        result = session.run({"ids": ids.numpy(), "labels": labels.numpy()})
        np.testing.assert_allclose(result.loss, expected.item(), rtol=1e-5, atol=1e-6, equal_nan=True)
        for name, p in module.named_parameters():
            np.testing.assert_allclose(result.gradients[name], p.grad.numpy(), rtol=1e-5, atol=1e-6, equal_nan=True)


#: Valid labels per later batch: a few, most, none (NaN for a mean, as in torch), all, one.
LATER = [(3, 5, 0.2, 1), (2, 7, 0.9, 2), (4, 3, 0.0, 3), (2, 4, 1.0, 4), (5, 9, 0.03, 5)]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"reduction": "sum", "label_smoothing": 0.1},
        pytest.param({"weighted": True, "label_smoothing": 0.2, "ignore_index": 0, "k_dim": True}, marks=pytest.mark.slow),
    ],
    ids=["mean", "sum-smoothing", "weights-smoothing-ignore0-kdim"],
)
def test_sparse_labels_are_gathered_and_the_step_equals_torch_at_every_valid_count(options, caplog):
    torch.manual_seed(0)
    module = _Head(**options)
    ignore_index = options.get("ignore_index", -100)
    ids, labels = _batch(4, 6, 0.15, seed=0, ignore_index=ignore_index)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        model = _build(module, ids, labels)
    (gathered,) = gathered_losses(model)
    valid = int((labels != ignore_index).sum())
    assert (gathered.valid, gathered.total, gathered.ignore_index) == (valid, 24, ignore_index)
    assert gathered.density == pytest.approx(valid / 24 * 100)
    assert gathered.reduction == options.get("reduction", "mean") and gathered.dim == f"{VALID_DIM_PREFIX}0"
    assert [n.op_type for n in model.graph].count("NonZero") == 1
    # The loss runs over the valid rows: its log-probabilities are valid_label_count_0 x classes.
    log_softmax = next(n for n in model.graph if n.op_type == "LogSoftmax")
    assert str(log_softmax.outputs[0].shape[0]) == gathered.dim
    assert any(f"density {gathered.density:.2f}%" in r.getMessage() and "valid rows only" in r.getMessage() for r in caplog.records)
    # Every size is known at the export's dims (the row count among them), as the memory passes need.
    dims = get_export_info(model)["dims"]
    assert dims[gathered.dim] == valid
    step = predict_step_memory(model, dims)
    assert step.exact and not step.bounded, (step.unknown, step.bounded)
    _assert_like_torch(module, model, [_batch(b, s, share, seed, ignore_index) for b, s, share, seed in LATER])


def test_dense_labels_and_no_threshold_are_not_gathered():
    torch.manual_seed(0)
    module = _Head()
    ids, dense = _batch(3, 5, 0.95, seed=0)
    dense[0, 0] = -100  # 14/15 valid: 93% >= 90%
    model = _build(module, ids, dense)
    assert gathered_losses(model) == [] and "NonZero" not in {n.op_type for n in model.graph}
    _, sparse = _batch(3, 5, 0.1, seed=0)
    model = _build(module, ids, sparse, density_threshold=None)
    assert gathered_losses(model) == [] and "NonZero" not in {n.op_type for n in model.graph}
    _assert_like_torch(module, model, [_batch(b, s, share, seed) for b, s, share, seed in LATER[:2]])


class _ThreeLosses(_Head):
    """A sparse mean (gathered), a dense sum (not: its density), and a sparse
    ``reduction="none"`` (not: one loss per row), in that order."""

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.embed(ids))).flatten(0, 1)
        flat = labels.flatten()
        dense = torch.where(flat == -100, torch.zeros_like(flat), flat)
        per_row = F.cross_entropy(logits * 0.5, flat, reduction="none")
        return F.cross_entropy(logits, flat) + F.cross_entropy(logits, dense, reduction="sum") + (per_row * 2).sum()


def test_each_call_is_decided_by_its_own_labels_and_reduction(caplog):
    torch.manual_seed(0)
    module = _ThreeLosses()
    ids, labels = _batch(4, 6, 0.2, seed=0)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        model = _build(module, ids, labels)
    (gathered,) = gathered_losses(model)
    assert gathered.reduction == "mean" and gathered.density < 90
    assert [n.op_type for n in model.graph].count("NonZero") == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("reduction='none'" in m and "not gathering" in m for m in messages), messages
    assert any("density >= threshold" in m for m in messages), messages
    _assert_like_torch(module, model, [_batch(b, s, share, seed) for b, s, share, seed in LATER if share > 0])


class _LanguageHead(nn.Module):
    """Hidden states through a Linear vocabulary head to the loss, as a language model ends."""

    def __init__(self, vocab: int = 512):
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab, bias=False)

    def forward(self, ids, labels):
        return F.cross_entropy(self.head(torch.tanh(self.embed(ids))).flatten(0, 1), labels.flatten())


def test_chunk_lm_head_loss_takes_the_gathered_loss_and_chunks_it_from_the_valid_rows():
    """The post-grad pass sees through the gather (``ortpass.ops.loss_side``): the chunked
    loss reads the valid hidden rows, and the step still equals torch's."""
    import ortpass

    torch.manual_seed(0)
    module = _LanguageHead()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (4, 8), generator=generator)
    labels = torch.where(torch.rand(4, 8, generator=generator) < 0.2, ids, torch.full_like(ids, -100))
    model = _build(module, ids, labels)
    assert len(gathered_losses(model)) == 1
    result = ortpass.pipeline("chunk-lm-head-loss(chunk=128)", assume=["training-graph"])(model)
    assert result.report["chunk-lm-head-loss"].stats["counts"] == {"losses chunked": 1}
    batches = []
    for batch, seq, share in [(3, 5, 0.3), (2, 9, 0.05), (4, 4, 1.0)]:
        ids = torch.randint(0, 512, (batch, seq), generator=generator)
        batches.append((ids, torch.where(torch.rand(batch, seq, generator=generator) < share, ids, torch.full_like(ids, -100))))
    _assert_like_torch(module, result.model, batches)


def _hf_batches(kind: str, vocab: int = 1000):
    """MLM labels at ~15% (the first token always), or causal labels padded after each
    row's own length; a new batch size, then a new length, every step."""
    generator = torch.Generator().manual_seed(1)
    for batch, seq in [(2, 16), (3, 11), (4, 16)]:
        ids = torch.randint(4, vocab, (batch, seq), generator=generator)
        if kind == "mlm":
            keep = torch.rand(batch, seq, generator=generator) < 0.15
            keep[:, 0] = True
        else:
            lengths = torch.randint(2, seq // 2, (batch, 1), generator=generator)
            keep = torch.arange(seq) < lengths
        yield ids, torch.where(keep, ids, torch.full_like(ids, -100))


@pytest.mark.slow
@pytest.mark.parametrize("name", fewer_on_training_build(["bert", "gpt2"], ("gpt2",)))
def test_ortmodule_gathers_hugging_face_labels_and_trains_like_torch(name, caplog):
    """``ORTModule(model, builder="torch")`` (stock onnxruntime's default): BertForMaskedLM
    with -100 labels, GPT2LMHeadModel with padded labels (shifted inside the model)."""
    pytest.importorskip("transformers")
    from test_module_conformance import train_side_by_side
    from test_module_families import _model, loss_from_labels

    with caplog.at_level(logging.INFO, logger=LOGGER):
        wrapped = train_side_by_side(_model(name), loss_from_labels, _hf_batches("mlm" if name == "bert" else "causal"),
                                     builder="torch")  # fmt: skip
    assert wrapped.graph_builds == 1
    gathered = [r.getMessage() for r in caplog.records if "valid rows only" in r.getMessage()]
    assert len(gathered) == 1 and "F.cross_entropy" in gathered[0] and "valid_label_count_0" in gathered[0], gathered


def test_a_probe_already_active_leaves_the_build_ungathered_not_failed(caplog):
    """The cross-entropy patch is process-wide: while another probe holds it (another
    thread's export), the build goes on without the gather and says so."""
    from ortpass.export.density import density_probe

    torch.manual_seed(0)
    module = _Head()
    ids, labels = _batch(3, 5, 0.1, seed=0)
    with caplog.at_level(logging.WARNING, logger=LOGGER), density_probe(nn.Module()):
        model = _build(module, ids, labels)
    assert gathered_losses(model) == [] and "NonZero" not in {n.op_type for n in model.graph}
    assert any("not gathering" in r.getMessage() and "do not nest" in r.getMessage() for r in caplog.records)
    _assert_like_torch(module, model, [_batch(b, s, share, seed) for b, s, share, seed in LATER[:2]])
