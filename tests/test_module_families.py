"""ORTModule on the Hugging Face families of the real-models suite, as training loops call
them: batch size and sequence length change every step (the last short batch of an
epoch, micro-batches), with the loss from ``labels`` inside the model or computed in
torch from the logits.  Each case trains the wrapper and torch eager side by side.

At dropout 0 ``fused_attention="auto"`` fuses every SDPA call, so each family also runs
its attention as the fused PythonOp, whose output shape once froze the first batch size.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from test_module_conformance import train_side_by_side  # noqa: E402
from test_real_models import FAMILIES, VOCAB  # noqa: E402

# ORTModule trains 17 Hugging Face families beside torch: end-to-end, the larger part of the suite's time.
pytestmark = pytest.mark.slow

SHAPES = [(2, 16), (3, 11), (4, 16)]  # (batch, sequence): a new batch size, then a new length


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    family = FAMILIES[name]
    return getattr(transformers, family.model)(family.config(0.0))


def _batches(kind: str, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    for batch, seq in SHAPES:
        # Ids from 4 up: clear of the special tokens (pad 0/1) the families use.
        ids = torch.randint(4, VOCAB, (batch, seq), generator=generator)
        if kind == "mlm":
            masked = torch.rand(batch, seq, generator=generator) < 0.3
            masked[:, 0] = True
            labels = torch.where(masked, ids, torch.full_like(ids, -100))
        elif kind == "seq2seq":
            labels = torch.randint(4, VOCAB, (batch, seq), generator=generator)
        else:
            labels = ids.clone()
        yield ids, labels


def loss_from_labels(model, batch):
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_shapes_changing_every_step_train_like_torch(name):
    wrapped = train_side_by_side(_model(name), loss_from_labels, _batches(FAMILIES[name].labels))
    assert wrapped.graph_builds == 1, wrapped.transitions.transitions  # proven dynamic: one graph


def loss_from_logits(model, batch):
    """The loop computes the loss from the logits: the model is called without labels."""
    ids, labels = batch
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "bart"])
def test_loss_computed_in_torch_from_the_logits(name):
    wrapped = train_side_by_side(_model(name), loss_from_logits, _batches(FAMILIES[name].labels))
    assert wrapped.transitions.current_graph.kind == "split"


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_peft_lora_trains_only_its_adapters_like_torch(name):
    """peft's LoRA: the base frozen by peft, the adapters trained; the PeftModel wrapped whole."""
    peft = pytest.importorskip("peft")
    targets = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}[name]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(_model(name), config)
    wrapped = train_side_by_side(model, loss_from_labels, _batches(FAMILIES[name].labels))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert set(wrapped.transitions.current_graph.params) == trainable
