"""Attention with dropout on the CPU, a block of heads at a time, against torch's SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ortpass.export import attention_blocks
from ortpass.export.fused_attention import FusedAttention, FusedMaskedAttention

_TORCH_SDPA = F.scaled_dot_product_attention


def _inputs(batch=2, heads=4, kv_heads=4, length=24, keys=24, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, dim, generator=g, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v


def _heads_per_block(monkeypatch, heads: int, length=24, keys=24):
    monkeypatch.setattr(attention_blocks, "BLOCK_BYTES", heads * length * keys * 4)


def _torch_step(q, k, v, grad_out, seed, **options):
    torch.manual_seed(seed)
    out = _TORCH_SDPA(q, k, v, **options)
    return out, torch.autograd.grad(out, [q, k, v], grad_out)


def _blocks_step(q, k, v, grad_out, seed, mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False):
    tensors = tuple(t.detach() for t in (q, k, v)) + ((mask,) if mask is not None else ())
    scale = q.shape[-1] ** -0.5
    torch.manual_seed(seed)
    out, keep_bits = attention_blocks.attend(tensors, dropout_p, is_causal, scale, enable_gqa)
    after_forward = torch.get_rng_state()
    grads = attention_blocks.gradients(tensors, keep_bits, grad_out, dropout_p, is_causal, scale, enable_gqa)
    assert torch.equal(torch.get_rng_state(), after_forward)  # backward draws nothing
    return out, grads, after_forward


@pytest.mark.parametrize(
    "case, rows_per_block, expected_blocks",
    [
        ("plain", 8 * 24, 1),  # both batch elements' 4 heads in one block
        ("plain", 4 * 24, 2),  # one batch element a block
        ("causal", 2 * 24, 4),  # half a batch element's heads a block
        ("mask", 24, 8),  # one head a block; the mask empties a row
        ("gqa", 2 * 24, 4),  # 2 key/value heads, each read by 2 query heads: one kv head a block
        ("causal", 8, 24),  # 8 rows of one head a block, reading only the keys they see
        ("mask", 5, 40),  # 5 rows of one head a block, the last one 4 rows
        ("gqa", 10, 20),  # 5 rows of each of the 2 query heads one kv head serves
    ],
)
def test_blocks_equal_torchs_sdpa_with_the_same_dropout_mask(monkeypatch, case, rows_per_block, expected_blocks):
    q, k, v = _inputs(kv_heads=2 if case == "gqa" else 4)
    options = {"dropout_p": 0.3}
    if case == "causal":
        options["is_causal"] = True
    if case == "mask":
        mask = torch.rand(2, 1, 24, 24, generator=torch.Generator().manual_seed(1)) > 0.4
        mask[1, 0, 5] = False  # a query that sees no key: the math kernel gives 0, not NaN
        options["attn_mask"] = mask
    if case == "gqa":
        options["enable_gqa"] = True
    monkeypatch.setattr(attention_blocks, "BLOCK_BYTES", rows_per_block * 24 * 4)
    assert attention_blocks.block_count(q, k, case == "causal", case == "gqa") == expected_blocks
    grad_out = torch.randn(2, 4, 24, 8, generator=torch.Generator().manual_seed(2))

    expected, expected_grads = _torch_step(q, k, v, grad_out, seed=7, **options)
    blocks_options = {("mask" if key == "attn_mask" else key): value for key, value in options.items()}
    actual, grads, after_forward = _blocks_step(q, k, v, grad_out, seed=7, **blocks_options)

    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7)
    # Blocks of rows sum a key's gradient in another order than one (L, S) product: float
    # rounding of a few 1e-7.
    grad_tolerance = {"rtol": 1e-6, "atol": 1e-7} if rows_per_block >= 24 else {"rtol": 1e-5, "atol": 5e-7}
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, **grad_tolerance)
    assert not actual.isnan().any()
    # One draw for the whole attention, as torch's: the generator ends where torch's did.
    torch.manual_seed(7)
    _TORCH_SDPA(q.detach(), k.detach(), v.detach(), **options)
    assert torch.equal(after_forward, torch.get_rng_state())


@pytest.mark.parametrize("keys, is_causal", [(24, False), (21, False), (21, True), (5, True)])
def test_the_packed_mask_gives_back_each_blocks_mask(monkeypatch, keys, is_causal):
    """Eight elements a byte, padded where the keys are not a multiple of 8; a causal
    block unpacks only the keys it reads."""
    monkeypatch.setattr(attention_blocks, "BLOCK_BYTES", 3 * keys * 4)  # 3 rows a block
    q, k, _ = _inputs(length=21, keys=keys)
    keep = torch.rand(2, 4, 21, keys, generator=torch.Generator().manual_seed(5)) > 0.5
    bits = attention_blocks._pack(keep)
    assert bits.dtype == torch.uint8 and bits.shape == (2, 4, 21, -(-keys // 8))
    blocks = list(attention_blocks._blocks(q, k, is_causal, False))
    assert len(blocks) == 2 * 4 * 7
    for block in blocks:
        assert torch.equal(attention_blocks._unpack(bits, block, keys), keep[block.scores])


def test_a_different_generator_state_draws_a_different_mask():
    q, k, v = _inputs()
    grad_out = torch.zeros(2, 4, 24, 8)
    first, _, _ = _blocks_step(q, k, v, grad_out, seed=7, dropout_p=0.3)
    second, _, _ = _blocks_step(q, k, v, grad_out, seed=8, dropout_p=0.3)
    assert not torch.equal(first, second)


@pytest.mark.parametrize(
    "dropout_p, mask, rank, expected",
    [
        (0.1, None, 4, True),
        (0.1, torch.bool, 4, True),
        (0.0, None, 4, False),  # no dropout: torch's flash kernel keeps no seq x seq tensor
        (0.1, torch.float32, 4, False),  # a float mask may want its gradient
        (0.1, None, 3, False),  # (heads, L, E) without a batch dim
    ],
)
def test_applies_only_where_torch_takes_its_math_kernel_for_dropout(dropout_p, mask, rank, expected):
    q = torch.zeros((2, 2, 4, 8)[-rank:])
    attn_mask = None if mask is None else torch.zeros(4, 4, dtype=mask)
    assert attention_blocks.applies(q, dropout_p, attn_mask) is expected


def test_the_fused_function_runs_its_backward_block_by_block(monkeypatch):
    """FusedAttention with dropout on several blocks: forward keeps no graph, backward
    differentiates one block at a time from forward's generator state; values and
    gradients equal SDPA's."""
    _heads_per_block(monkeypatch, 2)
    q, k, v = _inputs()
    grad_out = torch.randn(2, 4, 24, 8, generator=torch.Generator().manual_seed(2))
    expected, expected_grads = _torch_step(q, k, v, grad_out, seed=4, dropout_p=0.2)
    graphs = []
    block = attention_blocks._block

    def recording(*args, **kwargs):
        out = block(*args, **kwargs)
        graphs.append(out.grad_fn is not None)
        return out

    monkeypatch.setattr(attention_blocks, "_block", recording)
    torch.manual_seed(4)
    actual = FusedAttention.apply(q, k, v, 0.2, False, 8**-0.5, False)
    grads = torch.autograd.grad(actual, [q, k, v], grad_out)
    assert graphs == [False] * 4 + [True] * 4
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-7)


def test_a_recompute_clone_keeps_the_graph_of_a_small_attention_only(monkeypatch):
    """Up to GRAPH_BYTES the clone's autograd graph serves backward; above it the Function
    runs (no graph) and its backward goes block by block."""
    q, k, v = (t.detach().requires_grad_() for t in _inputs())
    mask = torch.ones(24, 24, dtype=torch.bool)
    _heads_per_block(monkeypatch, 1)  # several blocks either way
    torch.manual_seed(3)
    small = FusedMaskedAttention.recompute_forward(q, k, v, mask, 0.2, 0.5, False)
    assert small.grad_fn is not None and "FusedMaskedAttention" not in type(small.grad_fn).__name__
    monkeypatch.setattr(attention_blocks, "GRAPH_BYTES", 2 * 4 * 24 * 24 * 4 - 1)
    torch.manual_seed(3)
    large = FusedMaskedAttention.recompute_forward(q, k, v, mask, 0.2, 0.5, False)
    assert "FusedMaskedAttention" in type(large.grad_fn).__name__  # the Function's own backward
    torch.testing.assert_close(small, large)
