"""Golden model: gpt_decoder's 3-layer decoder with dropout and batch, its training graph
built from torch's autograd (what stock onnxruntime gets), recomputed layer-wise and its
backward joins ordered for memory."""

import dataclasses
from pathlib import Path

from ortpass.golden import GoldenCase, load_case

PIPELINE = "fix-dropout-seed(level=1),recompute(level=1),order-backward-joins"


def case() -> GoldenCase:
    decoder = load_case(Path(__file__).with_name("gpt_decoder.py"))
    return dataclasses.replace(
        decoder, pipeline=PIPELINE, builder="torch", description=decoder.description + "; torch builder"
    )
