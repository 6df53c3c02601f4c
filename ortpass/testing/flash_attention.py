"""A FlashAttention-like ``torch.autograd.Function`` for tests, golden models and benchmarks.

:class:`FlashAttentionFunction` computes ``softmax(q k^T * scale [+ causal mask])``,
applies dropout to the probabilities and multiplies by ``v``, like flash_attn's
``FlashAttnFunc``: its forward keeps only ``q, k, v`` and the generator state it started
from, and its backward recomputes the probabilities and *regenerates* the dropout mask
from that state instead of storing them.  Its randomness comes from torch's global CPU
generator, which is what makes PythonOp recompute need the replayed RNG state.

Importing this module registers the Function with the torch bridge (so ORT can run its
PythonOp) and as a recomputable attention function (so the recompute analysis may grow
subgraphs through it, and layer detection sees the attention in each layer).
:func:`use_flash_attention` swaps it into ``ortpass.testing.models`` decoders.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ortpass.analysis.recomputable_ops import register_recomputable_function
from ortpass.pythonop import bridge
from ortpass.pythonop.export import qualified_name
from ortpass.testing.models import CausalSelfAttention

__all__ = ["FlashAttentionFunction", "FlashSelfAttention", "use_flash_attention"]

logger = logging.getLogger(__name__)


def _probabilities(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        seq_q, seq_k = scores.shape[-2:]
        mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores.softmax(dim=-1)


def _keep_mask(shape: torch.Size, dropout_p: float, device: torch.device) -> torch.Tensor:
    """Scaled keep mask drawn from torch's global generator (1/(1-p) where kept, else 0)."""
    keep = torch.rand(shape, device=device) >= dropout_p
    return keep.to(torch.float32) / (1.0 - dropout_p)


class FlashAttentionFunction(torch.autograd.Function):
    """Attention with dropout inside and its own memory-light backward.

    ``apply(q, k, v, dropout_p, causal, scale)`` with ``q, k, v`` of shape
    ``[batch, heads, seq, head_dim]`` returns ``[batch, heads, seq, head_dim]``.
    """

    @staticmethod
    def forward(ctx, q, k, v, dropout_p: float, causal: bool, scale: float):
        rng_state = torch.get_rng_state()
        probs = _probabilities(q, k, scale, causal)
        if dropout_p > 0:
            probs = probs * _keep_mask(probs.shape, dropout_p, q.device)
        ctx.save_for_backward(q, k, v)
        ctx.rng_state = rng_state
        ctx.dropout_p, ctx.causal, ctx.scale = dropout_p, causal, scale
        return probs @ v

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        probs = _probabilities(q, k, ctx.scale, ctx.causal)
        if ctx.dropout_p > 0:
            # Regenerate forward's mask from the state forward started from.
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(ctx.rng_state)
                keep = _keep_mask(probs.shape, ctx.dropout_p, q.device)
        else:
            keep = torch.ones_like(probs)
        dropped = probs * keep
        grad_v = dropped.transpose(-2, -1) @ grad_out
        grad_probs = (grad_out @ v.transpose(-2, -1)) * keep
        grad_scores = probs * (grad_probs - (grad_probs * probs).sum(dim=-1, keepdim=True)) * ctx.scale
        grad_q = grad_scores @ k
        grad_k = grad_scores.transpose(-2, -1) @ q
        return grad_q, grad_k, grad_v, None, None, None


class FlashSelfAttention(nn.Module):
    """Multi-head self-attention calling :class:`FlashAttentionFunction` (same parameters
    and interface as ``ortpass.testing.models.CausalSelfAttention``)."""

    def __init__(self, hidden: int, heads: int, dropout: float, causal: bool = True):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
        self.heads = heads
        self.scale = 1.0 / math.sqrt(hidden // heads)
        self.causal = causal
        self.dropout = dropout
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.heads, hidden // self.heads).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        out = FlashAttentionFunction.apply(q, k, v, dropout, self.causal, self.scale)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, hidden))


def use_flash_attention(model: nn.Module) -> nn.Module:
    """Replace every ``CausalSelfAttention`` in ``model`` by a :class:`FlashSelfAttention`
    with the same weights; returns ``model``."""
    for name, child in list(model.named_children()):
        if isinstance(child, CausalSelfAttention):
            hidden = child.qkv.in_features
            flash = FlashSelfAttention(hidden, child.heads, child.attn_drop.p, child.causal)
            flash.load_state_dict(child.state_dict())
            flash.train(child.training)
            setattr(model, name, flash)
        else:
            use_flash_attention(child)
    return model


bridge.register_function(FlashAttentionFunction)
register_recomputable_function(qualified_name(FlashAttentionFunction), attention=True)
