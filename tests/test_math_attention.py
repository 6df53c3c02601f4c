"""The torch builder's attention (``scaled_dot_product_attention`` traced as matmul and
softmax): equal to torch's SDPA, values and gradients, for every kind of mask, a query
that may attend to no key included; its mask added as a bias, so that the backward holds
no batch x heads x seq x seq ``Where``; and a padded batch trained through ``ORTModule``
like torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ortpass.runtime.module import ORTModule
from ortpass.training.from_torch import _math_attention, build_training_graph_from_torch

pytestmark = pytest.mark.stock

B, H, L, D = 2, 3, 5, 4
NEG = float("-inf")


def _masks() -> dict[str, tuple[torch.Tensor | None, bool]]:
    generator = torch.Generator().manual_seed(0)
    keep = torch.rand(B, 1, L, L, generator=generator) > 0.4
    keep[0, 0, 2, :] = False  # a query that may attend to no key
    keep[1, 0, :, 0] = True
    return {
        "none": (None, False),
        "causal": (None, True),
        "bool": (keep, False),
        "bool, one for all": (keep[1, 0], False),
        "float with -inf": (torch.where(keep, torch.randn(B, 1, L, L, generator=generator), torch.tensor(NEG)), False),
        # Hugging Face's masks: the dtype's minimum, never -inf
        "float with finfo.min": (torch.where(keep, 0.0, torch.finfo(torch.float32).min), False),
    }


@pytest.mark.parametrize("name", list(_masks()))
def test_values_and_gradients_are_torchs(name):
    mask, causal = _masks()[name]
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(B, H, L, D, generator=generator, requires_grad=True) for _ in range(3)]
    # torch's math kernel is the reference: its CPU flash kernel disagrees with it on the
    # gradient of a row that is all finfo.min (torch 2.14), which the math kernel and
    # this decomposition give alike.
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(*inputs, attn_mask=mask, is_causal=causal)
    actual = _math_attention(*inputs, attn_mask=mask, is_causal=causal)
    seed = torch.randn(expected.shape, generator=generator)
    expected_grads = torch.autograd.grad(expected, inputs, seed)
    actual_grads = torch.autograd.grad(actual, inputs, seed)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    for got, want in zip(actual_grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    if name in ("bool", "float with -inf"):  # torch's safe softmax: 0, not NaN
        assert not torch.isnan(actual).any() and (actual[0, :, 2] == 0).all()
        assert all(not torch.isnan(grad).any() for grad in actual_grads)


def test_grouped_query_attention_is_torchs():
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(B, 4, L, D, generator=generator)
    key, value = (torch.randn(B, 2, L, D, generator=generator) for _ in range(2))
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(_math_attention(query, key, value, is_causal=True, enable_gqa=True), expected)


class _Attention(nn.Module):
    """One attention layer and a token loss; ``causal`` or a padding mask from ``keep``."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.embed = nn.Embedding(16, 8)
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 16)

    def forward(self, ids, keep, labels):
        batch, seq = ids.shape
        q, k, v = self.qkv(self.embed(ids)).view(batch, seq, 3, 2, 4).permute(2, 0, 3, 1, 4)
        mask = None if self.causal else keep[:, None, None, :] & keep[:, None, :, None]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        logits = self.head(attended.transpose(1, 2).reshape(batch, seq, 8))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _padded(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Right-padded rows: a padded query attends to no key (padded keys are masked too)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 16, (batch, seq), generator=generator)
    lengths = torch.randint(1, seq + 1, (batch,), generator=generator)
    keep = torch.arange(seq)[None, :] < lengths[:, None]
    keep[0] = True
    labels = torch.where(keep, torch.randint(0, 16, (batch, seq), generator=generator), -100)
    return ids, keep, labels


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "padding mask"])
def test_the_backward_holds_no_where_over_the_scores(causal):
    """``masked_fill`` gave a ``Where`` of the scores' size in forward and backward; the
    bias leaves the scores' ``Where`` out of the graph altogether."""
    model = _Attention(causal)
    ids, keep, labels = _padded(3, 6, seed=0)
    graph = build_training_graph_from_torch(model, (ids, keep, labels), input_names=["ids", "keep", "labels"]).graph
    scores_sized = [
        node.name for node in graph if node.op_type == "Where" and node.outputs[0].shape is not None
        and list(node.outputs[0].shape) == [3, 2, 6, 6]
    ]  # fmt: skip
    assert scores_sized == []
    assert any(node.op_type == "Softmax" for node in graph)


def test_the_scale_multiplies_the_query_not_the_scores():
    """Fires: the scale is one Mul of the query's size (forward and backward); does not: no
    Mul of a constant scalar over batch x heads x seq x seq remains."""
    import onnx_ir as ir

    ids, keep, labels = _padded(3, 6, seed=0)
    graph = build_training_graph_from_torch(_Attention(True), (ids, keep, labels), input_names=["ids", "keep", "labels"]).graph

    def scalings(shape):
        found = []
        for node in graph:
            if node.op_type != "Mul" or node.outputs[0].shape is None or list(node.outputs[0].shape) != shape:
                continue
            constants = [ir.convenience.get_const_tensor(v) for v in node.inputs if v is not None]
            found += [c.numpy().item() for c in constants if c is not None and c.size == 1]
        return found

    assert scalings([3, 2, 6, 6]) == []
    assert 0.5 in scalings([3, 2, 6, 4])  # head dim 4: the scale 1/2, once in forward and once in backward


@pytest.mark.parametrize("head_dim", [6, 64], ids=["scale not a power of two", "head dim 64"])
def test_the_query_scaled_first_is_torchs_at_other_head_dims(head_dim):
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(B, H, L, head_dim, generator=generator, requires_grad=True) for _ in range(3)]
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(*inputs, is_causal=True)
    actual = _math_attention(*inputs, is_causal=True)
    seed = torch.randn(expected.shape, generator=generator)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    for got, want in zip(torch.autograd.grad(actual, inputs, seed), torch.autograd.grad(expected, inputs, seed)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_a_padded_batch_with_queries_that_attend_to_nothing_trains_like_torch():
    from test_module_conformance import train_side_by_side

    def loop(model, batch):
        return model(*batch)

    batches = [_padded(4, 6, seed) for seed in range(3)]
    assert any((~keep).any() for _, keep, _ in batches)
    train_side_by_side(_Attention(causal=False), loop, batches, builder="torch")
