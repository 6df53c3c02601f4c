"""Golden model: a two-layer MLP with CrossEntropy (all labels valid: no padding flag)."""

import torch

from ortpass.golden import GoldenCase
from ortpass.testing.models import MLP

PIPELINE = "insert-gather-before-sce-loss,build-training-graph,fix-dropout-seed(level=1),recompute(level=1)"


def case() -> GoldenCase:
    torch.manual_seed(0)
    module = MLP(d_in=16, hidden=32, classes=10)
    x = torch.randn(8, 16)
    labels = torch.randint(0, 10, (8,))
    return GoldenCase(
        module=module,
        args=(x, labels),
        input_names=["x", "labels"],
        dynamic_axes={"x": {0: "batch"}, "labels": {0: "batch"}},
        pipeline=PIPELINE,
        description="MLP 16-32-10, GELU, CrossEntropy; batch 8",
    )
