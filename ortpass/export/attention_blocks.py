"""Attention with dropout on the CPU, a block of heads at a time.

With dropout on the CPU, torch's ``scaled_dot_product_attention`` takes its math kernel
(the CPU flash kernel refuses dropout).  That kernel builds the scores, the probabilities,
the dropout noise and the dropped probabilities, each (batch, heads, L, S) in float, and
autograd keeps three of them for backward: at seq 2048 with GPT-2's batch of 8 and 4 heads
that is 512 MiB a tensor, and the fused-attention PythonOp's backward peaked at about
2.3 GiB on it.

Here the same arithmetic runs on one block of (batch, head) slices at a time, each block's
tensors at most :data:`BLOCK_BYTES`:

- the dropout mask is drawn once for the whole attention, as torch draws its noise: one
  ``bernoulli_(1 - p)`` over a tensor of the same shape, but boolean (1 byte an element
  instead of 4).  torch's CPU ``bernoulli_`` produces the same values in any dtype (its
  MKL path fills an int buffer and copies it, its default path draws element by element),
  so the mask is the one torch eager draws from the same generator state;
- each block runs the math kernel's steps: q and k scaled by sqrt(scale), the (causal or
  boolean) mask added as -inf, a softmax that gives 0 on fully masked rows, the
  probabilities times ``keep / (1 - p)``, then ``@ v``;
- backward runs each block again under autograd and differentiates it before the next, so
  one block's intermediates live at a time (plus the boolean mask, drawn again from the
  forward's generator state).

Measured on torch 2.14.1 (tests/test_attention_blocks.py): outputs and gradients equal
torch's SDPA from the same generator state bit for bit on this machine's shapes; the tests
allow float rounding.  A float mask (which may want a gradient) keeps torch's kernel.
"""

from __future__ import annotations

import logging
import math
from typing import Iterator

import torch

__all__ = ["BLOCK_BYTES", "applies", "attend", "block_count", "gradients"]

logger = logging.getLogger(__name__)

#: Most bytes one block's (heads, L, S) float tensor may take.
BLOCK_BYTES = 32 * 2**20


def applies(q: torch.Tensor, dropout_p: float, mask: torch.Tensor | None) -> bool:
    """Where torch would run its math kernel for dropout and this module stands in: dropout
    on the CPU, (batch, heads, L, E) tensors, no mask or a boolean one."""
    boolean_or_none = mask is None or mask.dtype == torch.bool
    return dropout_p > 0 and q.device.type == "cpu" and q.dim() == 4 and boolean_or_none


def block_count(q: torch.Tensor, k: torch.Tensor, enable_gqa: bool) -> int:
    return sum(1 for _ in _blocks(q, k, enable_gqa))


def attend(tensors, dropout_p: float, is_causal: bool, scale: float, enable_gqa: bool) -> torch.Tensor:
    """SDPA's value, block by block; draws the dropout mask from torch's generator."""
    q, k, v, mask, keep = _prepare(tensors, dropout_p)
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    for rows, kv_rows in _blocks(q, k, enable_gqa):
        out[rows] = _block(q[rows], k[kv_rows], v[kv_rows], mask, keep, rows, dropout_p, is_causal, scale)
    return out


def gradients(tensors, grad_out: torch.Tensor, dropout_p: float, is_causal: bool, scale: float,
              enable_gqa: bool) -> list[torch.Tensor]:  # fmt: skip
    """[dq, dk, dv] for ``grad_out``.  Draws the dropout mask again from torch's generator:
    call it from the generator state the forward started from."""
    q, k, v, mask, keep = _prepare(tensors, dropout_p)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rows, kv_rows in _blocks(q, k, enable_gqa):
        leaves = [t.detach().requires_grad_() for t in (q[rows], k[kv_rows], v[kv_rows])]
        with torch.enable_grad():
            out = _block(*leaves, mask, keep, rows, dropout_p, is_causal, scale)
        for total, index, grad in zip(grads, (rows, kv_rows, kv_rows), torch.autograd.grad(out, leaves, grad_out[rows])):
            total[index] += grad
    return grads


def _prepare(tensors, dropout_p: float):
    """q, k, v, the mask broadcast to (batch, heads, L, S) (a view) or None, and the
    boolean dropout mask drawn like torch's noise."""
    q, k, v, *rest = tensors
    shape = (*q.shape[:-1], k.shape[-2])
    mask = rest[0].expand(shape) if rest else None
    keep = torch.empty(shape, dtype=torch.bool, device=q.device).bernoulli_(1 - dropout_p)
    return q, k, v, mask, keep


def _blocks(q: torch.Tensor, k: torch.Tensor, enable_gqa: bool) -> Iterator[tuple[tuple, tuple]]:
    """(query index, key/value index) per block: whole key/value heads with the query
    heads that read them, or whole batch elements where an element's heads fit in one."""
    batch, heads, length, _ = q.shape
    kv_heads = k.shape[-3]
    group = heads // kv_heads if enable_gqa else 1
    per_block = max(1, BLOCK_BYTES // (group * length * k.shape[-2] * q.element_size()))
    if per_block >= kv_heads:
        step = per_block // kv_heads
        for start in range(0, batch, step):
            yield (slice(start, start + step),), (slice(start, start + step),)
        return
    for element in range(batch):
        for start in range(0, kv_heads, per_block):
            stop = min(start + per_block, kv_heads)
            yield (element, slice(start * group, stop * group)), (element, slice(start, stop))


def _block(q, k, v, mask, keep, rows, dropout_p: float, is_causal: bool, scale: float) -> torch.Tensor:
    """The math kernel's steps on one block (``rows`` indexes ``mask`` and ``keep``)."""
    if q.shape[-3] != k.shape[-3]:  # grouped-query attention: each key/value head serves a group
        k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
    factor = math.sqrt(scale)
    scores = (q * factor) @ (k.transpose(-2, -1) * factor)
    if is_causal:
        scores = scores.masked_fill(~_causal(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    elif mask is not None:
        scores = scores.masked_fill(~mask[rows], float("-inf"))
    # torch's math kernel softmax: a row with every key masked gets 0s, not NaNs.
    probabilities = torch._safe_softmax(scores, -1)
    noise = keep[rows].to(probabilities.dtype).div_(1 - dropout_p)
    return (probabilities * noise) @ v


def _causal(query_length: int, key_length: int, device: torch.device) -> torch.Tensor:
    return torch.ones(query_length, key_length, dtype=torch.bool, device=device).tril()
