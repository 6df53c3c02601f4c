"""Smaller traps of ORTModule (#57): ``torch.utils.checkpoint`` bound at import, a fallback
that captured later calls, autocast's way out, and the warnings a first export printed."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint  # bound at import: the wrapper's patch never reaches it

from test_module_conformance import train_side_by_side

from ortpass.runtime.module import ORTModule
from ortpass.training.backend import has_training_ops

BUILDERS = [
    pytest.param("ort", marks=pytest.mark.skipif(not has_training_ops(), reason="needs onnxruntime-training")),
    pytest.param("torch", marks=pytest.mark.stock),
]


# -- torch.utils.checkpoint, either import style -----------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, style: str, use_reentrant: bool):
        super().__init__()
        self.style, self.use_reentrant = style, use_reentrant
        # An embedding-like first layer: torch's reentrant checkpoint gives the parameters
        # inside no gradient when no input of the block requires grad.
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        call = checkpoint if self.style == "bound" else torch.utils.checkpoint.checkpoint
        x = self.stem(x)
        for block in self.blocks:
            x = call(block, x, use_reentrant=self.use_reentrant)
        return nn.functional.cross_entropy(self.head(x), y)


def _classification_batches(steps: int = 4, width: int = 8):
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        yield torch.randn(6, width, generator=generator), torch.randint(0, 3, (6,), generator=generator)


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("style", ["bound", "attribute"])
def test_checkpoint_either_import_style_is_a_plain_call(style, use_reentrant, builder):
    torch.manual_seed(0)
    model = Checkpointed(style, use_reentrant)
    attribute = torch.utils.checkpoint.checkpoint
    with pytest.warns(UserWarning, match="graph recompute replaces it"):
        wrapped = train_side_by_side(model, lambda m, b: m(*b), _classification_batches(), builder=builder)
    assert wrapped.graph_builds == 1
    # The patch is undone: eager checkpointing is torch's own again.
    assert "apply" not in torch.utils.checkpoint.CheckpointFunction.__dict__
    assert torch.utils.checkpoint.checkpoint is attribute
