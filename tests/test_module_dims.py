"""A graph runs at other sizes only where a second export proved those dims dynamic
(``ortpass.runtime.module.dims``): a size the trace baked in pins its dims."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortpass.runtime.module import ORTModule
from ortpass.runtime.module.dims import PinnedDims, prove_dynamic_dims


class BakesTheBatchSize(nn.Module):
    """``int(x.shape[0])`` is a Python int to the tracer: the sample's batch size becomes
    a constant of the graph, which at another batch size would reshape across samples."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        rows = int(x.shape[0])
        return self.fc(x).reshape(rows, 2, -1).flip(1).reshape(x.shape[0], -1)


class Dynamic(BakesTheBatchSize):
    def forward(self, x):
        return self.fc(x).reshape(x.shape[0], 2, -1).flip(1).reshape(x.shape[0], -1)


@pytest.mark.parametrize("module, builds", [(BakesTheBatchSize, 2), (Dynamic, 1)], ids=["baked", "dynamic"])
def test_a_baked_size_builds_a_graph_per_size_and_a_proven_one_does_not(module, builds):
    torch.manual_seed(0)
    model = module()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    for n in (4, 3, 4, 3):
        x = torch.randn(n, 6)
        out, expected = wrapped(x), reference(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        F.mse_loss(out, torch.zeros_like(out)).backward()
    assert wrapped.graph_builds == builds
    actions = [action for action, _ in wrapped.transitions.transitions]
    assert actions == (["export", "export", "switch", "switch"] if builds == 2 else ["export"])
    if builds == 2:
        assert "x dim 0 is 3, and the graph for 4 is static in it" in wrapped.transitions.transitions[1][1]


def test_the_proof_pins_exactly_the_sizes_whose_change_changes_the_graph():
    tensors = [torch.zeros(4, 7), torch.zeros(4, 7, 1)]
    reference = ["graph"]
    tried: list[list[tuple]] = []

    def signature_at(changed):
        tried.append([tuple(t.shape) for t in changed])
        return ["other"] if changed[0].shape[1] != 7 else reference  # a graph that baked the 7

    pinned = prove_dynamic_dims(tensors, set(), signature_at, reference)
    # size-1 dims are pinned untried; 7 (two dims) changed the graph, 4 did not
    assert pinned == {(1, 2), (0, 1), (1, 1)}
    assert tried[0] == [(3, 6), (3, 6, 1)]  # first every size at once (4 -> 3, 7 -> 6)
    assert sorted(tried[1:]) == [[(3, 7), (3, 7, 1)], [(4, 6), (4, 6, 1)]]  # then each alone

    assert prove_dynamic_dims(tensors, set(), lambda changed: reference, reference) == {(1, 2)}
    assert prove_dynamic_dims(tensors, {(0, 0)}, lambda changed: None, reference) == {(0, 0), (1, 0), (0, 1), (1, 1), (1, 2)}


def test_pinned_dims_accept_only_their_sizes():
    x = torch.zeros(2, 5)
    pinned = PinnedDims.of([(0, 1)], [x])
    assert pinned.accepts([torch.zeros(9, 5)]) and not pinned.accepts([torch.zeros(2, 6)])
    assert pinned.difference([torch.zeros(2, 6)], ["x"]) == "x dim 1 is 6, and the graph for 5 is static in it"
