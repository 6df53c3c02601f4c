"""Tiny Hugging Face GPT-2, BERT (MLM), LLaMA and T5 through the default pipeline, with the
checks on: one ORT step's loss and every gradient equal torch eager's, every gradient has
its parameter's shape, and layer-wise recompute (level 1) clones something in each.

The graph-side causes each family hit: RMSNorm's ``SimplifiedLayerNormalization`` refused
by the checks (LLaMA, T5) and unsized for the recompute analysis, post-LN layers not
detected (BERT: level 1 applied nothing), a broadcast ``Where`` gradient left unreduced by
ORT's builder (T5: the step failed), Gemm and the SDPA NaN guard not recomputable (GPT-2).

Tiny configs (2 layers, hidden 64, vocab 1000, batch 2, seq 32), dropout 0, an attention
mask of ones, exported with dynamic batch and sequence axes (as ORTModule exported: with
static dims every tensor of a tiny model is under the recompute size floor).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import ortpass
from ortpass.analysis import find_layer_boundaries, get_partition
from ortpass.export import export
from ortpass.passes import DEFAULT_PIPELINE
from ortpass.runtime import TrainingSession

transformers = pytest.importorskip("transformers")

INPUTS = ["input_ids", "attention_mask", "labels"]
DYNAMIC_AXES = {name: {0: "batch", 1: "seq"} for name in INPUTS}
# max|ort - torch| <= RTOL * max|torch| + ATOL, per tensor.
RTOL, ATOL = 1e-5, 1e-7


class _Loss(torch.nn.Module):
    """The model's loss first, as ``export`` wants it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def _gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(config)


def _bert():
    config = transformers.BertConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def _llama():
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def _t5():
    config = transformers.T5Config(
        d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=1000, d_kv=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


FAMILIES = {"gpt2": _gpt2, "bert": _bert, "llama": _llama, "t5": _t5}


@dataclasses.dataclass
class _Run:
    module: _Loss
    result: ortpass.infra.report.ManagerResult
    ort_loss: float
    ort_gradients: dict[str, np.ndarray]
    torch_loss: float
    torch_gradients: dict[str, np.ndarray]


def _batch(family: str):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 1000, (2, 32), generator=generator)
    labels = ids.clone()
    if family == "bert":
        labels[:, ::3] = -100  # MLM: most positions are not predicted
    return ids, torch.ones(2, 32, dtype=torch.int64), labels


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def run(request) -> tuple[str, _Run]:
    family = request.param
    torch.manual_seed(0)
    module = _Loss(FAMILIES[family]())
    module.train()
    batch = _batch(family)
    forward = export(module, batch, input_names=INPUTS, dynamic_axes=DYNAMIC_AXES)
    result = ortpass.pipeline(DEFAULT_PIPELINE)(forward)  # checks on (the default)
    step = TrainingSession(result.model).run(dict(zip(INPUTS, batch)))
    module.zero_grad()
    loss = module(*batch)
    loss.backward()
    torch_gradients = {name: p.grad.numpy() for name, p in module.named_parameters() if p.grad is not None}
    return family, _Run(module, result, step.loss, step.gradients, float(loss.detach()), torch_gradients)


def test_loss_and_every_gradient_match_torch(run):
    family, r = run
    assert r.ort_loss == pytest.approx(r.torch_loss, rel=RTOL, abs=ATOL)
    assert set(r.ort_gradients) == set(r.torch_gradients), family
    for name, expected in r.torch_gradients.items():
        got = r.ort_gradients[name]
        assert got.shape == expected.shape, f"{family}: {name} gradient {got.shape} vs parameter {expected.shape}"
        error = float(np.abs(got - expected).max())
        assert error <= RTOL * float(np.abs(expected).max()) + ATOL, f"{family}: {name} off by {error}"


def test_recompute_level_1_clones_in_every_family(run):
    family, r = run
    stats = r.result.report["recompute"].stats
    assert stats["counts"].get("nodes cloned", 0) > 0, f"{family}: {stats}"
    assert any(node.name.endswith("_recompute") for node in r.result.model.graph)


def test_one_layer_boundary_per_attention_block(run):
    """Pre-LN (GPT-2, LLaMA, T5) by ORT's rule, post-LN (BERT) by ours; T5 has 2 encoder
    blocks and 2 decoder blocks of self- and cross-attention each."""
    family, r = run
    boundaries = find_layer_boundaries(get_partition(r.result.model).forward)
    assert len(boundaries) == {"gpt2": 2, "bert": 2, "llama": 2, "t5": 6}[family]


# What each family's level-1 recompute must clone, among what this change made possible.
EXPECTED_CLONES = {
    "gpt2": {"Gemm", "IsNaN", "ConcatTraining"},  # Conv1D's Gemm, the SDPA NaN guard, the QKV concat
    "bert": {"LayerNormalization", "IsNaN"},  # needs the post-LN layer boundaries
    "llama": {"SimplifiedLayerNormalization", "IsNaN"},
    "t5": {"SimplifiedLayerNormalization"},
}


def test_recompute_clones_what_real_graphs_hold(run):
    family, r = run
    cloned = {node.op_type for node in r.result.model.graph if node.name.endswith("_recompute")}
    assert EXPECTED_CLONES[family] <= cloned, f"{family}: cloned {sorted(cloned)}"
