"""Fused attention on the torch builder (stock onnxruntime): SDPA as one Python op whose
kernels are torch's (:mod:`ortpass.training.stock_attention`), compared with torch eager at
changing sizes, cloned by the recompute pass without changing a bit, with dropout too (its
mask drawn again from the call's seed, and equal to torch's SDPA drawing from that seed); a
call without dropout keeps the flash kernel's logsumexp for its backward (equal to torch's
SDPA bit for bit); a mask that requires grad keeps the math attention.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortpass
from ortpass.runtime import TrainingSession
from ortpass.runtime.split_session import SplitTrainingSession
from ortpass.training import python_ops, stock_attention
from ortpass.training.from_torch import build_training_graph_from_torch

pytestmark = [
    pytest.mark.stock,
    pytest.mark.skipif(not python_ops.extensions_available(), reason="onnxruntime-extensions is not installed"),
]


class Block(nn.Module):
    def __init__(self, mode: str, dropout: float = 0.0):
        super().__init__()
        self.ln, self.qkv, self.o = nn.LayerNorm(16), nn.Linear(16, 48), nn.Linear(16, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.mode, self.dropout = mode, dropout
        self.bias = nn.Parameter(torch.zeros(1, 1, 1, 1))  # a float mask that requires grad

    def forward(self, x, padding):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if self.mode == "causal":
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        elif self.mode == "padded":  # a boolean mask: causal and padding, as HF decoders build it
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril() & padding[:, None, None, :].bool()
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:  # "learned": a float mask with a parameter in it
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias.expand(b, 1, s, s) * 1.0)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, 16))
        return x + self.mlp(x)


class Decoder(nn.Module):
    def __init__(self, *blocks: Block):
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.blocks = nn.ModuleList(blocks)

    def forward(self, ids, padding, labels):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x, padding)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _batch(batch: int, seq: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (batch, seq), generator=generator)
    padding = torch.ones(batch, seq, dtype=torch.int64)
    padding[-1, : seq // 3] = 0  # the last row left-padded
    return ids, padding, ids.roll(-1, dims=1)


_NAMES = ["ids", "padding", "labels"]
_DYNAMIC = {name: [0, 1] for name in _NAMES}


def _build(module, batch):
    return build_training_graph_from_torch(module, batch, input_names=_NAMES, dynamic_axes=_DYNAMIC, fused_attention=True)


def _attention_nodes(model) -> list[str]:
    return [n.op_type.rstrip("0123456789") for n in model.graph if n.domain.startswith(python_ops.DOMAIN_PREFIX)]


@pytest.mark.parametrize("mode", ["causal", "padded"])
def test_fused_attention_gives_torchs_loss_and_gradients_at_changing_sizes(mode):
    torch.manual_seed(0)
    module = Decoder(Block(mode))
    model = _build(module, _batch(2, 6))
    assert sorted(_attention_nodes(model)) == ["OrtpassAttentionGrad_", "OrtpassAttention_"]
    assert not any(n.op_type == "Softmax" for n in model.graph)  # no seq x seq probabilities in the graph
    session = SplitTrainingSession(model)
    for batch, seq in ((2, 6), (3, 9)):
        ids, padding, labels = _batch(batch, seq, seed=batch)
        outputs, gradients = session.run({"ids": ids.numpy(), "padding": padding.numpy(), "labels": labels.numpy()})
        loss = module(ids, padding, labels)
        expected = torch.autograd.grad(loss, list(module.parameters()), allow_unused=True)
        assert float(outputs["loss"]) == pytest.approx(loss.item(), rel=1e-6)
        for (name, _), grad in zip(module.named_parameters(), expected):
            if grad is not None:
                np.testing.assert_allclose(gradients[f"{name}_grad"], grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def test_recompute_clones_the_fused_attention_and_changes_no_bit():
    torch.manual_seed(0)
    model = _build(Decoder(Block("causal"), Block("padded")), _batch(2, 8))
    result = ortpass.pipeline("fix-dropout-seed(level=1),recompute(level=1)", assume=["training-graph"])(model.clone())
    clones = [n for n in result.model.graph if n.op_type.startswith("OrtpassAttention_") and n.name.endswith("_recompute")]
    assert len(clones) == 2  # each layer's attention computed again in backward, its output not stashed
    feeds = dict(zip(_NAMES, (t.numpy() for t in _batch(2, 8, seed=5))))
    plain, recomputed = TrainingSession(model, threads=1).run(feeds), TrainingSession(result.model, threads=1).run(feeds)
    assert plain.loss == recomputed.loss
    for name, grad in plain.gradients.items():
        np.testing.assert_array_equal(recomputed.gradients[name], grad, err_msg=name)


def test_dropout_is_replayed_by_recompute_and_backward_from_the_calls_seed():
    torch.manual_seed(0)
    module = Decoder(Block("causal", dropout=0.3), Block("causal", dropout=0.3))
    model = _build(module, _batch(2, 8))
    assert sorted(set(_attention_nodes(model))) == ["OrtpassAttentionGrad_", "OrtpassAttentionSeed_", "OrtpassAttention_"]
    result = ortpass.pipeline("fix-dropout-seed(level=1),recompute(level=1)", assume=["training-graph"])(model.clone())
    assert sum(n.op_type.startswith("OrtpassAttention_") and n.name.endswith("_recompute") for n in result.model.graph) == 2
    batch = _batch(2, 8, seed=5)
    feeds = dict(zip(_NAMES, (t.numpy() for t in batch)))
    torch.manual_seed(7)  # the seeds come from torch's generator, one per call and step
    plain = TrainingSession(model, threads=1).run(feeds)
    torch.manual_seed(7)
    recomputed = TrainingSession(result.model, threads=1).run(feeds)
    assert plain.loss == recomputed.loss  # the clones drew the forward's masks
    for name, grad in plain.gradients.items():
        np.testing.assert_array_equal(recomputed.gradients[name], grad, err_msg=name)

    def seeded_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        seed = int(torch.randint(0, 2**62, ()))  # what the seed op draws
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return stock_attention._torch_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", seeded_sdpa)
        torch.manual_seed(7)
        loss = module(*batch)
    expected = torch.autograd.grad(loss, list(module.parameters()), allow_unused=True)
    assert float(plain.loss) == pytest.approx(loss.item(), rel=1e-6)  # the backward used the forward's masks
    for (name, _), grad in zip(module.named_parameters(), expected):
        if grad is not None:
            np.testing.assert_allclose(plain.gradients[name], grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    torch.manual_seed(8)
    assert TrainingSession(model, threads=1).run(feeds).loss != plain.loss  # another step, other masks


@pytest.mark.parametrize("mode", ["causal", "padded"])
def test_the_backward_reads_the_forwards_logsumexp_and_does_not_run_it_again(mode):
    model = _build(Decoder(Block(mode)), _batch(2, 6))
    (forward,) = [n for n in model.graph if n.op_type.startswith("OrtpassAttention_")]
    (backward,) = [n for n in model.graph if n.op_type.startswith("OrtpassAttentionGrad_")]
    out, logsumexp = forward.outputs
    assert logsumexp.shape is not None and logsumexp.shape.rank() == 3  # batch x heads x seq
    assert list(backward.inputs[4:6]) == [out, logsumexp]


def _eager_attention(q, k, v, dout, **options):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = stock_attention._torch_sdpa(*leaves, **options)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


@pytest.mark.parametrize(
    "options",
    [dict(is_causal=True), dict(mask="bool4"), dict(mask="bool2"), dict(mask="float"), dict(mask="bool4", scale=0.3)],
    ids=["causal", "bool-mask", "2d-bool-mask", "float-mask", "scaled"],
)
def test_the_flash_kernels_give_torchs_sdpa_output_and_gradients_bit_for_bit(options):
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 9, 8) for _ in range(4))
    options = dict(options)
    mask = {"bool4": torch.rand(2, 1, 9, 9) > 0.3, "bool2": torch.rand(9, 9) > 0.3, "float": torch.randn(2, 1, 9, 9)}.get(options.pop("mask", None))
    if mask is not None:
        mask[..., 0] = True if mask.dtype == torch.bool else mask[..., 0]
    eager = _eager_attention(q, k, v, dout, attn_mask=mask, **options)
    call = stock_attention._Attention(
        0, options.get("is_causal", False), options.get("scale"), False, torch.float32, None if mask is None else mask.dtype, flash=True
    )
    rest = [mask] if mask is not None else []
    out, logsumexp = call.flash_forward(q, k, v, rest)
    for got, expected in zip([out, *call.flash_backward(dout, q, k, v, out, logsumexp, rest)], eager):
        assert torch.equal(got, expected)


def test_calls_the_flash_kernel_does_not_take_keep_the_backward_that_runs_sdpa_again():
    q = torch.randn(2, 4, 6, 8)
    kv = torch.randn(2, 2, 6, 8)
    takes = stock_attention._flash_kernel_takes
    assert takes(q, q, q, None, 0.0, False)
    assert not takes(q, q, q, None, 0.1, False)  # dropout: the kernel has none
    assert not takes(q, kv, kv, None, 0.0, True)  # grouped heads
    assert not takes(q, q, q, torch.ones(2, 6, 6, dtype=torch.bool), 0.0, False)  # a 3-d mask
    assert not takes(q, q, torch.randn(2, 4, 6, 4), None, 0.0, False)  # another head size for v
    model = _build(Decoder(Block("causal", dropout=0.3)), _batch(2, 6))
    (forward,) = [n for n in model.graph if n.op_type.startswith("OrtpassAttention_")]
    (backward,) = [n for n in model.graph if n.op_type.startswith("OrtpassAttentionGrad_")]
    assert len(forward.outputs) == 1 and len(backward.inputs) == 5  # dout, q, k, v, seed


def test_a_mask_that_requires_grad_keeps_the_math_attention():
    torch.manual_seed(0)
    model = _build(Decoder(Block("learned")), _batch(2, 6))
    assert _attention_nodes(model) == []
    assert sum(n.op_type == "Softmax" for n in model.graph) == 1


@pytest.mark.slow
def test_ortmodule_with_fused_attention_trains_and_evaluates_like_torch():
    from test_module_conformance import train_side_by_side

    torch.manual_seed(0)
    module = Decoder(Block("padded"))
    batches = [_batch(2, 6, 1), _batch(3, 9, 2)]
    wrapped = train_side_by_side(module, lambda m, b: m(*b), batches, builder="torch", fused_attention=True)
    ids, padding, labels = _batch(3, 7, 4)
    with torch.no_grad():  # the forward graph keeps the math attention
        assert wrapped(ids, padding, labels).item() == pytest.approx(module(ids, padding, labels).item(), rel=1e-5)
