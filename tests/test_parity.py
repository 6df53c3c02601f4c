"""check_parity on the cases that made it cry wolf (issue #21): p=0 Dropout modules, which
ORT's fusions remove; SDPA's internal attention dropout; gradients that are zero in exact
arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ortpass.export import export
from ortpass.runtime.parity import check_parity, relative_error, replay_dropout_masks
from ortpass.training import build_training_graph


def test_relative_error_has_an_absolute_floor():
    # An attention key bias: zero in exact arithmetic, float32 noise on both sides.
    torch_grad, ort_grad = np.array([2.6e-12, -1e-12]), np.array([-1.8e-12, 3e-13])
    assert relative_error(ort_grad, torch_grad) > 1  # relative to its own scale: 170%
    assert relative_error(ort_grad, torch_grad, floor=1e-2 * 0.1) < 1e-5  # next to gradients of 0.1
    # The floor does not hide a real difference at a normal scale.
    assert relative_error(np.array([1.0, 2.0]), np.array([1.0, 2.1]), floor=1e-4) == pytest.approx(0.1 / 2.1)
    assert relative_error(np.zeros(2), np.zeros(3)) == float("inf")


class KeyBiasAttention(torch.nn.Module):
    """Softmax attention whose key bias gets an exactly-zero gradient (softmax ignores a
    shift along the keys), followed by p=0 and p=0.5 Dropout modules."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))
        self.off, self.on = torch.nn.Dropout(0.0), torch.nn.Dropout(0.5)

    def forward(self, x, target):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 8**0.5
        out = self.on(self.off(torch.softmax(scores, -1)) @ self.v(x))
        return ((out - target) ** 2).mean()


def test_parity_with_p0_dropout_and_a_zero_gradient():
    torch.manual_seed(0)
    module = KeyBiasAttention()
    args = (torch.randn(2, 5, 8), torch.randn(2, 5, 8))
    training = build_training_graph(export(module, args, input_names=["x", "target"]))
    # ORT's fusions removed the p=0 Dropout; torch still calls F.dropout(p=0) for it.
    assert sum(node.op_type == "Dropout" for node in training.graph) == 1
    result = check_parity(module, args, training, input_names=["x", "target"])
    assert np.abs(result.torch_gradients["k.bias"]).max() < 1e-7  # zero but for rounding
    # Relative to its own scale the noise is a large error; the floor makes it none.
    assert relative_error(result.ort.gradients["k.bias"], result.torch_gradients["k.bias"]) > 0.1
    result.assert_ok()
    # The p=0.5 Dropout's mask was replayed: a wrong one would change the loss.
    assert result.errors["loss"] < 1e-6


def test_replay_refuses_masks_that_do_not_fit():
    mask = np.ones((2, 3), dtype=bool)
    with pytest.raises(AssertionError, match="mask shape"):
        with replay_dropout_masks([mask]):
            torch.nn.functional.dropout(torch.ones(3, 2), 0.1)
    with pytest.raises(AssertionError, match="not used"):
        with replay_dropout_masks([mask]):
            torch.nn.functional.dropout(torch.ones(2, 3), 0.0)  # p=0 takes no mask
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(AssertionError, match="more often"):
        with replay_dropout_masks([]):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    # SDPA's dropout takes a mask of the attention probabilities' shape and applies it.
    keep = np.zeros((1, 2, 4, 4), dtype=bool)
    with replay_dropout_masks([keep]):
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    assert torch.count_nonzero(out) == 0  # every probability dropped
