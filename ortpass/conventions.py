"""Names shared across ortpass's stages (no torch, no ORT)."""

from __future__ import annotations

__all__ = ["BUILTIN_FUNCTION_MODULES", "FUSED_ATTENTION", "FUSED_MASKED_ATTENTION"]

#: func_names of ortpass's own autograd Functions (``ortpass.export.fused_attention``).
FUSED_ATTENTION = "ortpass.export.fused_attention.FusedAttention"
FUSED_MASKED_ATTENTION = "ortpass.export.fused_attention.FusedMaskedAttention"

#: ortpass's own Functions and the ortpass module that defines and registers them with the
#: torch bridge.  A model naming one needs no registration by the user: it is ortpass's code.
BUILTIN_FUNCTION_MODULES = {
    FUSED_ATTENTION: "ortpass.export.fused_attention",
    FUSED_MASKED_ATTENTION: "ortpass.export.fused_attention",
}
