"""Move a row gather above the projection that produces the gathered rows.

``ShrunkenGather(MatMul(a, b), idx)`` selects rows of the product, and row ``i`` of
``a @ b`` is ``a[i] @ b``, so the gather can run on ``a`` first::

    ShrunkenGather(MatMul(a, b), idx)     ->  MatMul(ShrunkenGather(a, idx), b)
    ShrunkenGather(Gemm(a, b[, c]), idx)  ->  Gemm(ShrunkenGather(a, idx), b[, c])

for a 2-D ``a`` (and, for Gemm, ``transA = 0`` and a bias ``c`` that does not vary along
rows: rank 0 or 1, or a first dim of 1).  Only when the product has no other consumer
(the rewriter refuses to drop a value that is still used).

Why: ``InsertGatherBeforeSceLossPass`` gathers the valid label rows right before the loss,
after the vocabulary projection.  The projection then still runs on every row, and ORT's
CPU gradient of the gather (GatherGrad, a scatter) costs about as much per element as the
softmax saved, over ``rows x vocab`` elements.  Gathering the hidden states instead makes
the projection, its two gradient matmuls and the loss all run on the valid rows, and the
scatter covers only ``rows x hidden``.  ORT did this in its upstream-gather transformer
(compute_optimizer/upstream_gather.cc); this covers the projection, the case that matters
for a large vocabulary.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

from ortpass.conventions import MS_DOMAIN

__all__ = [
    "ShrunkenGatherBeforeGemm",
    "ShrunkenGatherBeforeGemmNoBias",
    "ShrunkenGatherBeforeMatMul",
    "gather_before_projection_rules",
]

logger = logging.getLogger(__name__)



def _gather_rows(op, data: ir.Value, indices: ir.Value) -> ir.Value:
    """``ShrunkenGather(data, indices)`` with its type and shape recorded."""
    gathered = op.ShrunkenGather(data, indices, _domain=MS_DOMAIN)
    gathered.dtype = data.dtype
    if data.shape is not None and indices.shape is not None and len(indices.shape) == 1:
        gathered.shape = ir.Shape([indices.shape[0], *list(data.shape)[1:]])
    return gathered


def _rank_is(value: ir.Value, rank: int) -> bool:
    return value.shape is not None and len(value.shape) == rank


class ShrunkenGatherBeforeMatMul(RewriteRuleClassBase):
    """``ShrunkenGather(MatMul(a, b), idx)`` -> ``MatMul(ShrunkenGather(a, idx), b)``, a 2-D."""

    def pattern(self, op, a, b, indices):
        return op.ShrunkenGather(op.MatMul(a, b), indices, _domain=MS_DOMAIN)

    def check(self, context, a, b, indices, **_):
        result = MatchResult()
        if not _rank_is(a, 2):
            return result.fail(f"MatMul input {a.name!r} is not known to be 2-D (rows of a batched product)")
        return result

    def rewrite(self, op, a, b, indices):
        return op.MatMul(_gather_rows(op, a, indices), b)


class ShrunkenGatherBeforeGemm(RewriteRuleClassBase):
    """``ShrunkenGather(Gemm(a, b, c), idx)`` -> ``Gemm(ShrunkenGather(a, idx), b, c)``."""

    with_bias: ClassVar[bool] = True

    def pattern(self, op, a, b, c, indices):
        inputs = (a, b, c) if self.with_bias else (a, b)
        product = op.Gemm(*inputs, _allow_other_attributes=True, _outputs=["product"])
        return op.ShrunkenGather(product, indices, _domain=MS_DOMAIN)

    def check(self, context, a, b, indices, product, c=None, **_):
        result = MatchResult()
        gemm = product.producer()
        if gemm.attributes.get_int("transA", 0) != 0:
            return result.fail("Gemm has transA=1: its rows are columns of A")
        if not _rank_is(a, 2):
            return result.fail(f"Gemm input {a.name!r} has no known 2-D shape")
        if c is not None and not _bias_is_row_invariant(c):
            return result.fail(f"Gemm bias {c.name!r} may vary along rows")
        return result

    def rewrite(self, op, a, b, indices, product, c=None):
        attributes = {name: attr.value for name, attr in product.producer().attributes.items()}
        inputs = (b, c) if self.with_bias else (b,)
        return op.Gemm(_gather_rows(op, a, indices), *inputs, **attributes)


class ShrunkenGatherBeforeGemmNoBias(ShrunkenGatherBeforeGemm):
    """The same for a Gemm without its optional bias input."""

    with_bias: ClassVar[bool] = False

    def pattern(self, op, a, b, indices):
        return super().pattern(op, a, b, None, indices)


def _bias_is_row_invariant(bias: ir.Value) -> bool:
    shape = bias.shape
    if shape is None:
        return False
    return len(shape) <= 1 or shape[0] == 1


def gather_before_projection_rules() -> RewriteRuleSet:
    """The rule set; ``.apply_to_model(model)`` returns how many gathers moved."""
    rules = (ShrunkenGatherBeforeMatMul, ShrunkenGatherBeforeGemm, ShrunkenGatherBeforeGemmNoBias)
    return RewriteRuleSet([rule.rule() for rule in rules])
