"""Torch's selective activation checkpointing, as large-model trainers configure it: an anchor.

Per-layer checkpointing recomputes a whole layer in backward.  Selective activation
checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``, the op-level
policy torchtitan and NeMo use) keeps what is expensive to compute again, the matrix
products and attention, and recomputes the rest (pointwise ops, normalizations): more
memory than per-layer checkpointing, less time.  The benchmarks run it on the same Hugging
Face models through transformers' own checkpointing (``gradient_checkpointing_enable`` with
``use_reentrant=False`` and this policy as ``context_fn``), so the layers checkpointed are
the ones per-layer checkpointing uses.
"""

from __future__ import annotations

import functools

__all__ = ["SAVED_OPS", "enable_selective_checkpointing"]

#: The ops whose outputs are kept (torchtitan's list, less the collectives): every matrix
#: product and every fused attention kernel torch may dispatch SDPA to on CPU or GPU.
SAVED_OPS = (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)  # fmt: skip


@functools.cache
def _saved() -> frozenset:
    import torch

    aten = torch.ops.aten
    return frozenset(getattr(aten, name).default for name in SAVED_OPS if hasattr(aten, name))


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _saved() else CheckpointPolicy.PREFER_RECOMPUTE


def enable_selective_checkpointing(model) -> None:
    """Checkpoint ``model``'s layers (a transformers model) with the op-level policy."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    context = functools.partial(create_selective_checkpoint_contexts, _policy)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": context})
