"""Small reference models with their losses, shared by tests, golden models and benchmarks.

Each ``forward`` returns the scalar loss first, which is what ``ortpass.export.export``
expects.  Attention is written out (no ``scaled_dot_product_attention``) so that the
exported graph has the MatMul/Softmax/Dropout structure the recompute analysis targets
and so that every dropout goes through ``torch.nn.functional.dropout``, which the parity
helper replays.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["MLP", "GatedMLP", "CausalSelfAttention", "TransformerBlock", "GPTDecoder", "BertMLM", "CausalLMLoss", "LowRankAdapter",
           "add_low_rank_adapters"]


class MLP(nn.Module):
    """Two linear layers with GELU and CrossEntropy: the smallest trainable classifier."""

    def __init__(self, d_in: int = 16, hidden: int = 32, classes: int = 10, ignore_index: int = -100):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.loss = nn.CrossEntropyLoss(ignore_index=ignore_index)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.fc2(nn.functional.gelu(self.fc1(x))), labels)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` (LLaMA's MLP with SiLU, Gemma's with GELU) or, ungated,
    ``down(act(gate(x)) * 2)``; the loss is the mean squared error against ``target``."""

    def __init__(self, hidden: int = 16, ffn: int = 32, act: str = "silu", gated: bool = True) -> None:
        super().__init__()
        self.hidden = hidden
        self.act = {"silu": nn.functional.silu, "gelu": nn.functional.gelu}[act]
        self.gated = gated
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def example_batch(self, batch: int, seq: int) -> dict[str, torch.Tensor]:
        """``x`` and ``target``, batch x seq x hidden, the same for every call."""
        generator = torch.Generator().manual_seed(0)
        return {name: torch.randn(batch, seq, self.hidden, generator=generator) for name in ("x", "target")}

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        partner = self.up(x) if self.gated else 2.0
        return nn.functional.mse_loss(self.down(self.act(self.gate(x)) * partner), target)


class CausalSelfAttention(nn.Module):
    """Multi-head attention with a causal mask, softmax and attention dropout."""

    def __init__(self, hidden: int, heads: int, dropout: float, causal: bool = True):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
        self.heads = heads
        self.scale = 1.0 / math.sqrt(hidden // heads)  # a Python float: no tracer warning
        self.causal = causal
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        head_dim = hidden // self.heads
        q, k, v = self.qkv(x).split(hidden, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * self.scale
        if self.causal:
            mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        probs = self.attn_drop(scores.softmax(dim=-1))
        out = (probs @ v).transpose(1, 2).reshape(batch, seq, hidden)
        return self.proj(out)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: LN -> attention -> residual, LN -> GELU MLP -> residual."""

    def __init__(self, hidden: int = 32, heads: int = 4, dropout: float = 0.1, causal: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, dropout, causal)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc_in = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.fc_out(nn.functional.gelu(self.fc_in(self.ln2(x)))))


class _BlockRegression(nn.Module):
    """A single block with a mean-squared loss, for block-level parity."""

    def __init__(self, **block_kwargs):
        super().__init__()
        self.block = TransformerBlock(**block_kwargs)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.block(x), target)


class GPTDecoder(nn.Module):
    """A GPT-like decoder LM: token + position embeddings, N blocks, LN, LM head, CE loss.

    ``checkpoint=True`` wraps each block in ``torch.utils.checkpoint`` (for the memory
    benchmark's torch baseline; export the model without it).
    """

    def __init__(
        self,
        vocab: int = 64,
        hidden: int = 32,
        heads: int = 4,
        layers: int = 2,
        max_seq: int = 64,
        dropout: float = 0.1,
        ignore_index: int = -100,
        checkpoint: bool = False,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_seq, hidden)
        self.blocks = nn.ModuleList(TransformerBlock(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        self.loss = nn.CrossEntropyLoss(ignore_index=ignore_index)
        self.checkpoint = checkpoint

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)
        for block in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        return self.loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class BertMLM(nn.Module):
    """A BERT-like encoder (bidirectional attention) with a masked-LM loss.

    Labels are ``ignore_index`` everywhere except the masked positions, so label density
    is low (about 15% in the golden model): the case padding elimination targets.
    """

    def __init__(self, vocab: int = 128, hidden: int = 32, heads: int = 4, layers: int = 2,
                 max_seq: int = 64, dropout: float = 0.1, ignore_index: int = -100):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_seq, hidden)
        self.ln_emb = nn.LayerNorm(hidden)
        self.blocks = nn.ModuleList(TransformerBlock(hidden, heads, dropout, causal=False) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        self.ignore_index = ignore_index

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        x = self.ln_emb(self.tok(input_ids) + self.pos(torch.arange(seq, device=input_ids.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        # Functional cross_entropy on purpose: ORTModule's density probe missed this form.
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=self.ignore_index
        )


class CausalLMLoss(nn.Module):
    """A transformers causal LM that returns its loss alone (no logits, no cache)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


class LowRankAdapter(nn.Module):
    """``base(x) + x A B``: a LoRA update around a GPT-2 ``Conv1D`` (weight: in x out).
    ``B`` starts at zero, as in LoRA, so the adapted model starts as the base."""

    def __init__(self, base: nn.Module, rank: int) -> None:
        super().__init__()
        d_in, d_out = base.weight.shape
        self.base = base
        self.a = nn.Parameter(torch.randn(d_in, rank) * 0.02)
        self.b = nn.Parameter(torch.zeros(rank, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a @ self.b


def add_low_rank_adapters(gpt2: nn.Module, rank: int) -> None:
    """Wrap every projection of a transformers GPT-2's blocks (attention ``c_attn``,
    ``c_proj``; MLP ``c_fc``, ``c_proj``) in a :class:`LowRankAdapter`, in place."""
    for block in gpt2.transformer.h:
        for owner, name in ((block.attn, "c_attn"), (block.attn, "c_proj"), (block.mlp, "c_fc"), (block.mlp, "c_proj")):
            setattr(owner, name, LowRankAdapter(getattr(owner, name), rank))
