"""Golden model: a 2-layer decoder whose attention is a FlashAttention-like autograd Function.

The Function (ortpass.testing.flash_attention) exports as a com.microsoft::PythonOp with
dropout inside; ORT runs it through ortpass's torch bridge.  Its dropout draws from torch's
generator (the golden run seeds it before the step), and parity with torch eager is not re-measured at
update time (the ORT step and an eager step would draw different masks); the Function's
own tests (tests/test_pythonop_recompute.py, tests/test_bridge.py) check its numerics.
"""

import torch

from ortpass.golden import GoldenCase
from ortpass.testing.flash_attention import use_flash_attention
from ortpass.testing.models import GPTDecoder

PIPELINE = (
    "pythonop-shape-inference,insert-gather-before-sce-loss,build-training-graph,"
    "fix-dropout-seed(level=1),recompute(level=1)"
)


def case() -> GoldenCase:
    torch.manual_seed(0)
    module = use_flash_attention(GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, max_seq=32, dropout=0.1))
    input_ids = torch.randint(0, 64, (2, 32))
    labels = input_ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return GoldenCase(
        module=module,
        args=(input_ids, labels),
        input_names=["input_ids", "labels"],
        dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}},
        pipeline=PIPELINE,
        parity=False,
        description="GPT-like decoder, 2 layers, hidden 32, attention as a FlashAttention-like PythonOp",
    )
