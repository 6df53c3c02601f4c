"""Names shared across ortpass's stages (no torch, no ORT)."""

from __future__ import annotations

__all__ = ["BUILTIN_FUNCTIONS", "DENSITY_FLAG", "FUSED_ATTENTION", "FUSED_MASKED_ATTENTION"]

#: func_names of ortpass's own autograd Functions.
DENSITY_FLAG = "ortpass.export.density.FlagAndPrintDensity"
FUSED_ATTENTION = "ortpass.export.fused_attention.FusedAttention"
FUSED_MASKED_ATTENTION = "ortpass.export.fused_attention.FusedMaskedAttention"

#: ortpass's own Functions: func_name -> ``module:QualName`` where ortpass defines it.  The
#: torch bridge runs a model naming one without any registration by the user: it is
#: ortpass's code, not something the model asks to import.
BUILTIN_FUNCTIONS = {
    DENSITY_FLAG: "ortpass.export.density:FlagAndPrintDensity",
    FUSED_ATTENTION: "ortpass.export.fused_attention:FusedAttention",
    FUSED_MASKED_ATTENTION: "ortpass.export.fused_attention:FusedMaskedAttention",
}
