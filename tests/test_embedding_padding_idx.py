"""``nn.Embedding(padding_idx=p)`` trains as in torch: row ``p`` gets nothing from the lookup.

The ONNX export of an embedding is a plain Gather, and ORT 1.19.2's GatherGrad gives
every looked-up row a gradient, the padding row included.  ``ortpass.export`` records the
padding row of each embedding Gather and the gradient build masks the padding positions
out of the gradient reaching its GatherGrad (``ortpass.training.padding_rows``).
"""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortpass
from ortpass.conventions import PADDING_IDX_KEY
from ortpass.errors import ExportError, ModelLoadError, TrainingGraphError
from ortpass.export import export
from ortpass.passes import DEFAULT_PIPELINE
from ortpass import ORTModule
from ortpass.runtime.parity import check_parity
from ortpass.training.build import build_training_graph

VOCAB, HIDDEN = 16, 8
NAMES = ["input_ids", "labels"]
DYNAMIC = {name: {0: "batch", 1: "seq"} for name in NAMES}


class Lookup(nn.Module):
    """An embedding, a nonlinearity and an output head; ``tied``: the head is the embedding."""

    def __init__(self, padding_idx: int | None = 0, tied: bool = False, freeze: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN, padding_idx=padding_idx)
        self.embedding.weight.requires_grad_(not freeze)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=not tied)
        if tied:
            self.head.weight = self.embedding.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embedding(input_ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _padded_batch(pad: int, batch: int = 4, seq: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids right-padded with ``pad`` to different lengths (labels -100 there), and ``pad``
    also in the middle of the first row."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    ids[ids == pad] = (pad + 1) % VOCAB
    labels = ids.roll(-1, 1)
    for row in range(batch):
        length = seq - 2 * row - 1
        ids[row, length:] = pad
        labels[row, length:] = -100
    ids[0, 2] = pad
    return ids, labels


def _train(model: nn.Module, args) -> ir.Model:
    forward = export(model, args, input_names=NAMES, dynamic_axes=DYNAMIC)
    return ortpass.pipeline(DEFAULT_PIPELINE)(forward).model


def _mask_nodes(model) -> list:
    return [node for node in model.graph if "/ortpass_padding/" in node.name]


@pytest.mark.parametrize("padding_idx, row", [(0, 0), (5, 5), (-1, VOCAB - 1)])
def test_padding_row_gets_no_gradient_from_the_lookup(padding_idx, row):
    """(a) An untied embedding on padded batches: loss and every gradient as in torch, the
    padding row's exactly zero; again on a batch of another shape (dynamic dims)."""
    torch.manual_seed(0)
    model = Lookup(padding_idx)
    args = _padded_batch(row)
    trained = _train(model, args)
    assert {node.op_type for node in _mask_nodes(trained)} == {"Equal", "Unsqueeze", "Where"}
    for batch in (args, _padded_batch(row, batch=3, seq=7, seed=1)):
        parity = check_parity(model, batch, trained, input_names=NAMES)
        parity.assert_ok()
        gradient = parity.ort.gradients["embedding.weight"]
        assert not gradient[row].any()
        assert np.abs(gradient).sum(axis=1).astype(bool).sum() > 1  # the other rows do train


def test_tied_head_still_gives_the_padding_row_its_gradient():
    """(b) Only the lookup's share is masked: the output head, the same weight, still
    trains row ``p`` (its logit), as in torch."""
    torch.manual_seed(0)
    model = Lookup(0, tied=True)
    args = _padded_batch(0)
    parity = check_parity(model, args, _train(model, args), input_names=NAMES)
    parity.assert_ok()
    assert set(parity.ort.gradients) == {"embedding.weight"}
    row = parity.ort.gradients["embedding.weight"][0]
    assert np.abs(row).max() > 1e-3
    np.testing.assert_allclose(row, parity.torch_gradients["embedding.weight"][0], rtol=1e-5, atol=1e-7)


def test_without_padding_idx_the_graphs_are_unchanged():
    """The symbolic writes the Gather torch writes; no padding_idx, no record and no mask.
    With one, the training graph differs by the three mask nodes and nothing else."""
    args = _padded_batch(0)
    plain = export(Lookup(None), args, input_names=NAMES)
    padded = export(Lookup(0), args, input_names=NAMES)
    assert PADDING_IDX_KEY not in plain.metadata_props
    assert json.loads(padded.metadata_props[PADDING_IDX_KEY]) == {"/embedding/Gather_output_0": 0}
    for forward in (plain, padded):
        gathers = [node for node in forward.graph if node.op_type == "Gather"]
        assert [list(node.attributes) for node in gathers] == [[]]  # the mark is gone
    assert [(n.op_type, n.name) for n in plain.graph] == [(n.op_type, n.name) for n in padded.graph]

    without, with_mask = build_training_graph(plain), build_training_graph(padded)
    assert _mask_nodes(without) == []
    added = _mask_nodes(with_mask)
    assert [node.op_type for node in added] == ["Equal", "Unsqueeze", "Where"]
    assert all(node.metadata_props["pkg.ortpass.side"] == "backward" for node in added)
    assert [n.name for n in with_mask.graph if n not in added] == [n.name for n in without.graph]
    gather_grad = next(node for node in with_mask.graph if node.op_type == "GatherGrad")
    assert gather_grad.inputs[2].producer() is added[-1]


def test_a_frozen_embedding_with_padding_idx_builds_without_a_mask():
    torch.manual_seed(0)
    model = Lookup(0, freeze=True)
    args = _padded_batch(0)
    trained = _train(model, args)
    assert _mask_nodes(trained) == []
    check_parity(model, args, trained, input_names=NAMES).assert_ok()


def test_a_record_naming_a_gather_that_is_not_there_is_refused():
    forward = export(Lookup(0), _padded_batch(0), input_names=NAMES)
    forward.metadata_props[PADDING_IDX_KEY] = json.dumps({"no_such_value": 0})
    with pytest.raises(TrainingGraphError, match=r"Gather\(s\) computing \['no_such_value'\] have a padding row"):
        build_training_graph(forward)
    forward.metadata_props[PADDING_IDX_KEY] = json.dumps({"/embedding/Gather_output_0": -1})
    with pytest.raises(ModelLoadError, match="pkg.ortpass.padding_idx"):
        build_training_graph(forward)


class Options(nn.Module):
    def __init__(self, functional: bool, **options):
        super().__init__()
        self.functional, self.options = functional, options
        self.embedding = nn.Embedding(VOCAB, HIDDEN, **({} if functional else options))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.functional:
            return F.embedding(input_ids, self.embedding.weight, **self.options).square().mean()
        return self.embedding(input_ids).square().mean()


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
@pytest.mark.parametrize("option", ["scale_grad_by_freq", "sparse"])
def test_options_that_change_the_gradient_are_refused(option, functional):
    """(d) torch scales (scale_grad_by_freq) or sparsifies (sparse) the weight's gradient;
    GatherGrad does neither.  An eval export, which has no gradient, is fine."""
    ids = torch.tensor([[1, 2, 2, 3]])
    module = Options(functional, **{option: True, "padding_idx": 0})
    where = "the top-level module" if functional else "embedding (Embedding)"
    with pytest.raises(ExportError, match=rf"embedding in {re.escape(where)} has {option}=True: .* set {option}=False"):
        export(module, (ids,))
    assert export(module, (ids,), training=False).metadata_props[PADDING_IDX_KEY]


def _seq2seq_config(name: str):
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False,
    )  # fmt: skip
    if name == "marian":  # the pad token is the last id, and starts every decoder sequence
        return transformers.MarianConfig(**common, pad_token_id=95, decoder_start_token_id=95, eos_token_id=0)
    return transformers.PegasusConfig(**common, pad_token_id=0, decoder_start_token_id=0, eos_token_id=1)


class TrainingCall(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def _hf(name: str) -> tuple[nn.Module, int]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        return TrainingCall(transformers.BertForMaskedLM(config)), config.pad_token_id
    config = _seq2seq_config(name)
    cls = transformers.MarianMTModel if name == "marian" else transformers.PegasusForConditionalGeneration
    return TrainingCall(cls(config)), config.pad_token_id


@pytest.mark.parametrize("name", ["marian", "pegasus", "bert"])
def test_hugging_face_models_with_pad_tokens_match_torch(name):
    """(c) Marian and Pegasus (decoder_start_token_id == pad_token_id: every decoder
    sequence starts with the padding row; labels padded with -100, which the shift turns
    into pad tokens too) and BERT on padded input_ids (pad 0)."""
    module, pad = _hf(name)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 95, (2, 12), generator=generator)
    ids[0, 8:] = pad
    labels = torch.randint(2, 95, (2, 12), generator=generator)
    if name == "bert":
        labels[torch.rand(2, 12, generator=generator) > 0.5] = -100
    labels[1, 9:] = -100
    forward = export(module, (ids, labels), input_names=NAMES, dynamic_axes=DYNAMIC)
    recorded = json.loads(forward.metadata_props[PADDING_IDX_KEY])
    assert set(recorded.values()) == {pad} and len(recorded) == (1 if name == "bert" else 2)
    trained = ortpass.pipeline(DEFAULT_PIPELINE)(forward).model
    assert len([n for n in _mask_nodes(trained) if n.op_type == "Where"]) == len(recorded)
    check_parity(module, (ids, labels), trained, input_names=NAMES).assert_ok()


def test_ortmodule_trains_an_embedding_with_padding_like_torch_eager():
    """The wrapper, five AdamW steps on batches full of the padding index, tied head: the
    loss at every step and the weights after them as in torch eager, and the padding row
    moved only by the head's gradient."""
    torch.manual_seed(0)
    model = Lookup(0, tied=True)
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(5):
        args = _padded_batch(0, seed=step)
        loss, expected = wrapped(*args), reference(*args)
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5), f"step {step}"
        for opt, value in ((optimizer, loss), (reference_optimizer, expected)):
            value.backward()
            opt.step()
            opt.zero_grad()
    assert wrapped.graph_builds == 1
    torch.testing.assert_close(model.embedding.weight.detach(), reference.embedding.weight.detach(), rtol=1e-5, atol=1e-6)

