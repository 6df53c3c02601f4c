"""Attention with dropout on the CPU, a block at a time.

With dropout on the CPU, torch's ``scaled_dot_product_attention`` takes its math kernel
(the CPU flash kernel refuses dropout).  That kernel builds the scores, the probabilities,
the dropout noise and the dropped probabilities, each (batch, heads, L, S) in float, and
autograd keeps three of them for backward: at seq 2048 with GPT-2's batch of 8 and 4 heads
that is 512 MiB a tensor, and the fused-attention PythonOp's backward peaked at about
2.3 GiB on it.

Here the same arithmetic runs on one block of (batch, head, rows) slices at a time, each
block's tensors at most :data:`BLOCK_BYTES` (small enough to stay in cache: 2x faster than
whole heads at seq 2048, see docs/design/ort-facts.md); a causal block reads only the keys
its rows see:

- the dropout mask is drawn once for the whole attention, as torch draws its noise: one
  ``bernoulli_(1 - p)`` over a tensor of the same shape, but boolean (1 byte an element
  instead of 4).  torch's CPU ``bernoulli_`` produces the same values in any dtype (its
  MKL path fills an int buffer and copies it, its default path draws element by element),
  so the mask is the one torch eager draws from the same generator state;
- each block runs the math kernel's steps: q and k scaled by sqrt(scale), the (causal or
  boolean) mask added as -inf, a softmax that gives 0 on fully masked rows, the
  probabilities times ``keep / (1 - p)``, then ``@ v``;
- forward returns the mask packed eight elements a byte (16 MiB at GPT-2's seq 2048, where
  torch's float noise is 512 MiB); backward runs each block again under autograd with it
  and differentiates it before the next, so one block's intermediates live at a time.
  Drawing the mask again instead costs more: torch's CPU ``bernoulli_`` took 0.83 s for
  that mask (boolean; 1.56 s in float) and packing it 0.15 s, and keeping the bits took a
  forward plus forward and backward from 3.65 to 3.21 s (causal 3.23 to 2.37 s).

Measured on torch 2.14.1 (tests/test_attention_blocks.py): outputs equal torch's SDPA
from the same generator state bit for bit on this machine's shapes; gradients too where a
block holds whole heads (blocks of rows sum key gradients in another order: float
rounding).  A float mask (which may want a gradient) keeps torch's kernel.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Iterator

import torch

__all__ = ["BLOCK_BYTES", "GRAPH_BYTES", "applies", "attend", "attention_bytes", "block_count", "gradients",
           "keeps_graph"]

logger = logging.getLogger(__name__)

#: Most bytes one block's (heads, rows, keys) float tensor may take.
BLOCK_BYTES = 4 * 2**20
#: Up to this size of one (batch, heads, L, S) float tensor, a recompute clone keeps the
#: attention's autograd graph for backward (three such tensors) instead of going block by
#: block again in backward.
GRAPH_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True)
class _Block:
    """Where one block reads: batch elements, query heads and rows; key/value heads and keys."""

    batch: slice
    heads: slice
    rows: slice
    kv_heads: slice
    keys: slice

    @property
    def queries(self) -> tuple[slice, slice, slice]:
        return self.batch, self.heads, self.rows

    @property
    def keys_values(self) -> tuple[slice, slice, slice]:
        return self.batch, self.kv_heads, self.keys

    @property
    def scores(self) -> tuple[slice, slice, slice, slice]:
        return self.batch, self.heads, self.rows, self.keys


def applies(q: torch.Tensor, dropout_p: float, mask: torch.Tensor | None) -> bool:
    """Where torch would run its math kernel for dropout and this module stands in: dropout
    on the CPU, (batch, heads, L, E) tensors, no mask or a boolean one."""
    boolean_or_none = mask is None or mask.dtype == torch.bool
    return dropout_p > 0 and q.device.type == "cpu" and q.dim() == 4 and boolean_or_none


def attention_bytes(q: torch.Tensor, k: torch.Tensor) -> int:
    """Bytes of one (batch, heads, L, S) tensor of this attention in q's dtype."""
    return q.shape[:-1].numel() * k.shape[-2] * q.element_size()


def keeps_graph(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a recompute clone of this attention keeps its autograd graph (GRAPH_BYTES)."""
    return attention_bytes(q, k) <= GRAPH_BYTES


def block_count(q: torch.Tensor, k: torch.Tensor, is_causal: bool, enable_gqa: bool) -> int:
    return sum(1 for _ in _blocks(q, k, is_causal, enable_gqa))


def attend(tensors, dropout_p: float, is_causal: bool, scale: float, enable_gqa: bool):
    """SDPA's value, block by block, and the dropout mask it drew from torch's generator,
    packed eight elements a byte, for :func:`gradients`."""
    q, k, v, mask = _prepare(tensors)
    keep = torch.empty(_scores_shape(q, k), dtype=torch.bool, device=q.device).bernoulli_(1 - dropout_p)
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    for block in _blocks(q, k, is_causal, enable_gqa):
        kv = block.keys_values
        out[block.queries] = _block(
            q[block.queries], k[kv], v[kv], mask, keep[block.scores], block, dropout_p, is_causal, scale
        )
    return out, _pack(keep)


def gradients(tensors, keep_bits: torch.Tensor, grad_out: torch.Tensor, dropout_p: float, is_causal: bool,
              scale: float, enable_gqa: bool) -> list[torch.Tensor]:  # fmt: skip
    """[dq, dk, dv] for ``grad_out``, with the dropout mask :func:`attend` returned; draws
    nothing from torch's generator (a draw costs more than the rest of a block's work)."""
    q, k, v, mask = _prepare(tensors)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for block in _blocks(q, k, is_causal, enable_gqa):
        where = (block.queries, block.keys_values, block.keys_values)
        leaves = [t[index].detach().requires_grad_() for t, index in zip((q, k, v), where)]
        keep = _unpack(keep_bits, block, k.shape[-2])
        with torch.enable_grad():
            out = _block(*leaves, mask, keep, block, dropout_p, is_causal, scale)
        for total, index, grad in zip(grads, where, torch.autograd.grad(out, leaves, grad_out[block.queries])):
            total[index] += grad
    return grads


def _prepare(tensors):
    """q, k, v and the mask broadcast to (batch, heads, L, S) (a view) or None."""
    q, k, v, *rest = tensors
    mask = rest[0].expand(_scores_shape(q, k)) if rest else None
    return q, k, v, mask


def _scores_shape(q: torch.Tensor, k: torch.Tensor) -> tuple[int, ...]:
    return (*q.shape[:-1], k.shape[-2])


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1 << bit for bit in range(8)], dtype=torch.uint8, device=device)


def _pack(keep: torch.Tensor) -> torch.Tensor:
    """``keep``'s last dim eight elements a byte, element j in bit j (padded with False):
    1/8 of the boolean mask, 1/32 of torch's float noise.  One batch element at a time, so
    the temporaries stay small."""
    pad = -keep.shape[-1] % 8
    weights = _bit_weights(keep.device)
    bits = torch.empty((*keep.shape[:-1], (keep.shape[-1] + pad) // 8), dtype=torch.uint8, device=keep.device)
    for element, element_keep in enumerate(keep):
        if pad:
            element_keep = torch.cat([element_keep, element_keep.new_zeros((*element_keep.shape[:-1], pad))], -1)
        # (.to, not a dtype view: the TorchScript tracer that exports the Function refuses one)
        bits[element] = (element_keep.to(torch.uint8).unflatten(-1, (-1, 8)) * weights).sum(-1, dtype=torch.uint8)
    return bits


def _unpack(bits: torch.Tensor, block: _Block, keys: int) -> torch.Tensor:
    """The boolean dropout mask of ``block`` from :func:`_pack`'s bits (a block's keys
    start at key 0)."""
    stop = keys if block.keys.stop is None else block.keys.stop
    packed = bits[block.batch, block.heads, block.rows][..., : -(-stop // 8)]
    return (packed.unsqueeze(-1) & _bit_weights(bits.device)).ne(0).flatten(-2)[..., :stop]


def _blocks(q: torch.Tensor, k: torch.Tensor, is_causal: bool, enable_gqa: bool) -> Iterator[_Block]:
    """Blocks of at most BLOCK_BYTES: whole batch elements where they fit, else whole
    key/value heads with the query heads that read them, else rows of one such head; a
    causal block of rows reads only the keys its last row sees."""
    batch, heads, length, _ = q.shape
    kv_heads, keys = k.shape[-3], k.shape[-2]
    group = heads // kv_heads if enable_gqa else 1
    row_bytes = group * keys * q.element_size()  # one query row of each head a kv head serves
    every = slice(None)
    if kv_heads * length * row_bytes <= BLOCK_BYTES:
        step = BLOCK_BYTES // (kv_heads * length * row_bytes)
        for start in range(0, batch, step):
            yield _Block(slice(start, start + step), every, every, every, every)
        return
    head_step = BLOCK_BYTES // (length * row_bytes)
    row_step = length if head_step else max(1, BLOCK_BYTES // row_bytes)
    for element in range(batch):
        for head in range(0, kv_heads, max(head_step, 1)):
            last_head = min(head + max(head_step, 1), kv_heads)
            for row in range(0, length, row_step):
                last_row = min(row + row_step, length)
                seen = slice(0, min(last_row, keys)) if is_causal else every
                yield _Block(slice(element, element + 1), slice(head * group, last_head * group),
                             slice(row, last_row), slice(head, last_head), seen)  # fmt: skip


def _block(q, k, v, mask, keep, block: _Block, dropout_p: float, is_causal: bool, scale: float) -> torch.Tensor:
    """The math kernel's steps on one block (``block`` indexes ``mask``; ``keep`` is the
    block's dropout mask)."""
    if q.shape[-3] != k.shape[-3]:  # grouped-query attention: each key/value head serves a group
        k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
    factor = math.sqrt(scale)
    scores = (q * factor) @ (k.transpose(-2, -1) * factor)
    if is_causal:
        first_row = block.rows.start or 0
        seen = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(diagonal=first_row)
        scores = scores.masked_fill(~seen, float("-inf"))
    elif mask is not None:
        scores = scores.masked_fill(~mask[block.scores], float("-inf"))
    # torch's math kernel softmax: a row with every key masked gets 0s, not NaNs.
    probabilities = torch._safe_softmax(scores, -1)
    # torch's noise is bernoulli(1 - p) / (1 - p) in the tensor's dtype: keep * that.
    noise = keep * probabilities.new_ones(()).div_(1 - dropout_p)
    return (probabilities * noise) @ v
