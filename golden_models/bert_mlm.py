"""Golden model: a BERT-like encoder with masked-LM labels at about 15% density.

The export's density probe flags the functional cross_entropy's labels, and
insert-gather-before-sce-loss gathers the valid rows before the loss.
"""

import torch

from ortpass.golden import GoldenCase
from ortpass.testing.models import BertMLM

PIPELINE = (
    "insert-gather-before-sce-loss(move_above_projection=True),build-training-graph,"
    "fix-dropout-seed(level=1),recompute(level=1)"
)


def case() -> GoldenCase:
    torch.manual_seed(0)
    module = BertMLM(vocab=128, hidden=32, heads=4, layers=2, max_seq=32, dropout=0.1)
    input_ids = torch.randint(0, 128, (4, 32))
    labels = torch.full((4, 32), -100)
    masked = torch.rand(4, 32) < 0.15
    labels[masked] = input_ids[masked]
    return GoldenCase(
        module=module,
        args=(input_ids, labels),
        input_names=["input_ids", "labels"],
        dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}},
        pipeline=PIPELINE,
        description=f"BERT-like encoder, 2 layers, hidden 32, MLM labels at {masked.float().mean().item():.0%} density",
    )
