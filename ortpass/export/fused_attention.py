"""Export ``torch.nn.functional.scaled_dot_product_attention`` as one recomputable PythonOp.

Hugging Face models (and most others) compute attention with torch's
``scaled_dot_product_attention`` (SDPA).  The TorchScript exporter decomposes it into
``MatMul -> Softmax -> Where(IsNaN) -> MatMul``, so ORT materializes the attention
probabilities (batch x heads x seq x seq) and keeps them for backward.  torch's own fused
kernels never keep that matrix: the flash kernel saves only a log-sum-exp per row and
backward recomputes the rest.

Inside :func:`fused_attention_export`, every SDPA call is routed through one of two
``torch.autograd.Function``s, which the exporter turns into ``com.microsoft::PythonOp``
nodes (ORT runs them through ortpass's torch bridge):

- :class:`FusedAttention` ``(q, k, v, dropout_p, is_causal, scale, enable_gqa)``;
- :class:`FusedMaskedAttention` ``(q, k, v, mask, dropout_p, scale, enable_gqa)`` for a
  boolean or additive float mask (gradients flow into a float mask, e.g. T5's position
  bias).

Their forward runs torch's SDPA without building a graph and keeps only its inputs and,
with dropout, the generator state it started from; backward runs SDPA again from that
state and differentiates it.  So the PythonOp costs one extra attention forward in
backward and holds no seq x seq tensor between forward and backward, which is what
FlashAttention's own Function does.  With dropout on the CPU, where torch's SDPA takes its
math kernel and builds several (batch, heads, L, S) float tensors, both run the same
arithmetic block by block instead (:mod:`ortpass.export.attention_blocks`), and forward
keeps the dropout mask it drew, packed into bits, so backward draws nothing.  Both Functions are registered as recomputable
attention (the recompute analysis may clone them, replaying the generator state, and
layer detection sees them) under their func_names in :mod:`ortpass.conventions`, so a
process that only loads an exported model knows them without importing torch.  A
recompute clone runs right before its backward, so it runs ``recompute_forward`` instead:
SDPA with autograd, whose saved tensors serve backward without that extra forward (with
torch's flash kernel they are the output and a log-sum-exp per row; with the math kernel
that dropout takes, the attention probabilities, which the re-run would build anyway).

A boolean mask that is exactly SDPA's causal mask (what HF decoders trace for a batch
without padding: transformers itself skips the mask then) runs as ``is_causal=True``, the
same attention without the mask: torch's CPU flash kernel then skips the masked half.
Measured (torch 2.14.1, 2 cores, batch 8, 4 heads, head dim 64, outputs equal bit for
bit): forward 294 -> 130 ms and forward + backward 872 -> 486 ms at seq 2048, 19 -> 14 ms
and 56 -> 52 ms at seq 512; checking the mask costs 12 ms and 1 ms.

Parity: the dropout mask comes from torch's generator, as in torch eager; a step on ORT and
a torch step started from the same generator state draw the same masks when no other
torch randomness runs between them (ORT's own Dropout nodes use ORT's generator).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Iterator

import torch
import torch.nn.functional as F

from ortpass.export import attention_blocks

__all__ = ["AUTO_DROPOUT_BYTES", "FusedAttention", "FusedMaskedAttention", "fused_attention_export"]

logger = logging.getLogger(__name__)

#: torch's own SDPA, taken before anything patches the name.
_torch_sdpa = F.scaled_dot_product_attention

#: ``fused_attention="auto"`` fuses a call with attention dropout when one (batch, heads,
#: L, S) float tensor of it is at least this large at export.  HF GPT-2 (attention dropout
#: 0.1, batch 8, 4 heads; README "Fused attention"): at seq 512 (32 MiB) fused and
#: decomposed held the same step peak (212 and 216 MiB) and fused took 1.05-1.10x the time;
#: at seq 1024 (128 MiB) decomposed held 780 MiB, above torch with checkpointing's 708, and
#: fused 240; at seq 2048 (512 MiB) fused held 487 MiB against 2964.
AUTO_DROPOUT_BYTES = 64 * 2**20


def _generator_states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda_state


@contextlib.contextmanager
def _generators_at(states: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> Iterator[None]:
    """Run with torch's generators set to ``states``; restore the current ones afterwards."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state(states[1], device)
        yield


def _forward(ctx, tensors: tuple[torch.Tensor, ...], dropout_p: float, is_causal: bool, scale: float, enable_gqa: bool):
    q = tensors[0]
    ctx.states = _generator_states(q.device) if dropout_p > 0 else None
    ctx.options = (dropout_p, is_causal, scale, enable_gqa)
    ctx.save_for_backward(*tensors)
    out, ctx.keep_bits = _attend(tensors, *ctx.options)
    return out


def _attend(tensors, dropout_p, is_causal, scale, enable_gqa) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention's value, and its dropout mask packed into bits where
    :mod:`attention_blocks` ran it (None where torch's SDPA did)."""
    tensors, is_causal = _without_causal_mask(tensors, is_causal)
    if attention_blocks.applies(tensors[0], dropout_p, _mask(tensors)):
        return attention_blocks.attend(tensors, dropout_p, is_causal, scale, enable_gqa)
    q, k, v = tensors[:3]
    out = _torch_sdpa(
        q, k, v, attn_mask=_mask(tensors), dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
    )
    return out, None


def _mask(tensors) -> torch.Tensor | None:
    return tensors[3] if len(tensors) > 3 else None


def _without_causal_mask(tensors, is_causal: bool):
    q, k, *_ = tensors
    mask = _mask(tensors)
    if mask is not None and _is_causal_mask(mask, q.shape[-2], k.shape[-2]):
        # The export traced the mask, so a batch without padding still brings one; torch's
        # causal kernel skips the masked half that the masked kernel computes (module docstring).
        return tensors[:3], True
    return tensors, is_causal


def _is_causal_mask(mask: torch.Tensor, query_length: int, key_length: int) -> bool:
    """``mask`` is boolean and equals SDPA's ``is_causal`` mask, ``ones(L, S).tril()``, for
    every batch element and head."""
    if mask.dtype != torch.bool or tuple(mask.shape[-2:]) != (query_length, key_length):
        return False
    return torch.equal(mask, _causal(query_length, key_length, mask.device).expand_as(mask))


@functools.lru_cache(maxsize=8)
def _causal(query_length: int, key_length: int, device: torch.device) -> torch.Tensor:
    return torch.ones(query_length, key_length, dtype=torch.bool, device=device).tril()


def _backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Run forward again from its generator state and differentiate it; where
    :mod:`attention_blocks` ran the attention, go block by block with forward's mask."""
    saved = ctx.saved_tensors
    wanted = ctx.needs_input_grad[: len(saved)]
    if ctx.keep_bits is not None:
        dropout_p, is_causal, scale, enable_gqa = ctx.options
        tensors, is_causal = _without_causal_mask(saved, is_causal)
        grads = attention_blocks.gradients(tensors, ctx.keep_bits, grad_out, dropout_p, is_causal, scale, enable_gqa)
        return tuple(grad if need else None for grad, need in zip(grads, wanted)) + (None,) * (len(saved) - 3)
    replay = _generators_at(ctx.states, saved[0].device) if ctx.states is not None else contextlib.nullcontext()
    leaves = tuple(t.detach().requires_grad_(need) for t, need in zip(saved, wanted))
    with torch.enable_grad(), replay:
        out, _ = _attend(leaves, *ctx.options)
    differentiable = [leaf for leaf in leaves if leaf.requires_grad]
    grads = iter(torch.autograd.grad(out, differentiable, grad_out, allow_unused=True)) if differentiable else iter(())
    return tuple(next(grads) if leaf.requires_grad else None for leaf in leaves)


def _recompute_forward(function, tensors, dropout_p, is_causal, scale, enable_gqa, apply_arguments):
    """What a recompute clone runs: SDPA with autograd, unless :mod:`attention_blocks` runs
    an attention larger than its GRAPH_BYTES (the graph would hold three tensors of that
    size), where the Function itself runs and its backward goes block by block."""
    q, k = tensors[:2]
    if attention_blocks.applies(q, dropout_p, _mask(tensors)) and not attention_blocks.keeps_graph(q, k):
        return function.apply(*apply_arguments)
    return _attend(tensors, dropout_p, is_causal, scale, enable_gqa)[0]


class FusedAttention(torch.autograd.Function):
    """``scaled_dot_product_attention(q, k, v)`` without a mask, as one PythonOp."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p: float, is_causal: bool, scale: float, enable_gqa: bool):
        return _forward(ctx, (q, k, v), dropout_p, is_causal, scale, enable_gqa)

    @staticmethod
    def backward(ctx, grad_out):
        return (*_backward(ctx, grad_out), None, None, None, None)

    @staticmethod
    def recompute_forward(q, k, v, dropout_p: float, is_causal: bool, scale: float, enable_gqa: bool):
        """What a recompute clone runs (module docstring)."""
        arguments = (q, k, v, dropout_p, is_causal, scale, enable_gqa)
        return _recompute_forward(FusedAttention, (q, k, v), dropout_p, is_causal, scale, enable_gqa, arguments)


class FusedMaskedAttention(torch.autograd.Function):
    """``scaled_dot_product_attention(q, k, v, attn_mask=mask)``, as one PythonOp."""

    @staticmethod
    def forward(ctx, q, k, v, mask, dropout_p: float, scale: float, enable_gqa: bool):
        return _forward(ctx, (q, k, v, _boolean(mask)), dropout_p, False, scale, enable_gqa)

    @staticmethod
    def backward(ctx, grad_out):
        return (*_backward(ctx, grad_out), None, None, None)

    @staticmethod
    def recompute_forward(q, k, v, mask, dropout_p: float, scale: float, enable_gqa: bool):
        """What a recompute clone runs (module docstring)."""
        arguments = (q, k, v, mask, dropout_p, scale, enable_gqa)
        tensors = (q, k, v, _boolean(mask))
        return _recompute_forward(FusedMaskedAttention, tensors, dropout_p, False, scale, enable_gqa, arguments)


def _boolean(mask: torch.Tensor) -> torch.Tensor:
    # ORT hands a bool tensor over DLPack as uint8 (measured on 1.19.2); SDPA takes no
    # uint8 mask, so this is always the boolean mask, viewed without a copy.
    return mask.view(torch.bool) if mask.dtype == torch.uint8 else mask


def _fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Drop-in for ``F.scaled_dot_product_attention`` that calls the PythonOp Functions."""
    if scale is None:
        scale = float(query.shape[-1]) ** -0.5
    scale, dropout_p = float(scale), float(dropout_p)
    if attn_mask is None:
        return FusedAttention.apply(query, key, value, dropout_p, bool(is_causal), scale, bool(enable_gqa))
    if is_causal:
        # torch refuses a mask together with is_causal; so do we, with its words.
        raise RuntimeError("scaled_dot_product_attention: explicit attn_mask should not be set when is_causal=True")
    return FusedMaskedAttention.apply(query, key, value, attn_mask, dropout_p, scale, bool(enable_gqa))


def _fused_sdpa_auto(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The PythonOp for a call without dropout or with a large attention (see
    :data:`AUTO_DROPOUT_BYTES`); torch's SDPA, exported decomposed, for the others."""
    fuse = float(dropout_p) == 0 or attention_blocks.attention_bytes(query, key) >= AUTO_DROPOUT_BYTES
    sdpa = _fused_sdpa if fuse else _torch_sdpa
    return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa)  # fmt: skip


@contextlib.contextmanager
def fused_attention_export(auto: bool = False) -> Iterator[None]:
    """While active, ``torch.nn.functional.scaled_dot_product_attention`` exports as a
    PythonOp (callers that look the name up at call time, as transformers does).

    ``auto``: only the calls without attention dropout and those whose attention at export
    is at least :data:`AUTO_DROPOUT_BYTES`; the others export decomposed.
    """
    F.scaled_dot_product_attention = _fused_sdpa_auto if auto else _fused_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _torch_sdpa
