"""Golden model: the 3-layer GPT-like decoder with dropout, its training graph built from
torch's autograd (what stock onnxruntime gets), recomputed layer-wise and its backward joins
ordered for memory."""

import torch

from ortpass.golden import GoldenCase
from ortpass.testing.models import GPTDecoder

PIPELINE = "fix-dropout-seed(level=1),recompute(level=1),order-backward-joins"


def case() -> GoldenCase:
    torch.manual_seed(0)
    module = GPTDecoder(vocab=64, hidden=32, heads=4, layers=3, max_seq=32, dropout=0.1)
    input_ids = torch.randint(0, 64, (2, 32))
    labels = input_ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return GoldenCase(
        module=module,
        args=(input_ids, labels),
        input_names=["input_ids", "labels"],
        dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}},
        pipeline=PIPELINE,
        builder="torch",
        description="GPT-like decoder, 3 layers, hidden 32, 4 heads, dropout 0.1, seq 32; torch builder",
    )
