"""No export error quotes a tensor's values (ortpass/export/error_text.py).

torch's tracer prints a whole tensor when a forward reads a tensor that requires grad but
is neither a parameter nor an input (what FSDP's flat-parameter views are to the export):
megabytes of text for a real embedding.  The export's error names the problem, the
tensor's shape, and stays a few lines long.
"""

from __future__ import annotations

import pytest
import torch

from ortpass.errors import ExportError
from ortpass.export import export
from ortpass.export.error_text import MAX_CAUSE, without_tensor_values

pytestmark = pytest.mark.stock


class _ReadsAView(torch.nn.Module):
    """Its forward reads ``view``, a tensor that requires grad and is not a parameter."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((64, 48), 0.123456))

    def forward(self, x):
        return (x @ self.view).sum()


def test_export_error_leaves_the_tensor_out():
    module = _ReadsAView()
    module.view = module.weight * 1
    with pytest.raises(ExportError) as caught:
        export(module, (torch.randn(3, 64),))
    message = str(caught.value)
    assert "Cannot insert a Tensor that requires grad as a constant" in message  # the problem, named
    assert "tensor of shape [64, 48], values left out" in message
    assert "0.123" not in message and "0.1235" not in message
    assert len(message) < 1000, message


def test_python_tensor_reprs_are_left_out():
    values = torch.full((40, 40), 7.25)
    text = without_tensor_values(f"bad value {values} and {torch.nn.Parameter(values)} end")
    assert "7.25" not in text and "7.2500" not in text
    assert text.startswith("bad value tensor(<values left out>)") and text.endswith(" end")


def test_a_long_message_is_cut():
    assert len(without_tensor_values("x" * 100_000)) <= MAX_CAUSE + 40
