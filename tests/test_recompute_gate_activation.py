"""RecomputeGateActivationPass: a gated MLP's partner gradient reads a late copy of the activation."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

from ortpass.analysis.ort_order import order_gradient_leaves
from ortpass.analysis.partition import is_backward
from ortpass.export import export
from ortpass.passes import RecomputeGateActivationPass
from ortpass.runtime import TrainingSession
from ortpass.testing.models import GatedMLP
from ortpass.testing.profiling import ort_execution_order
from ortpass.training import build_training_graph

BATCH, SEQ, HIDDEN, FFN = 2, 8, 16, 32


def _batch() -> dict[str, np.ndarray]:
    return {name: v.numpy() for name, v in GatedMLP(HIDDEN, FFN).example_batch(BATCH, SEQ).items()}


def _training(**kwargs) -> tuple[GatedMLP, ir.Model]:
    torch.manual_seed(0)
    module = GatedMLP(hidden=HIDDEN, ffn=FFN, **kwargs)
    args = tuple(torch.from_numpy(v) for v in _batch().values())
    return module, build_training_graph(export(module, args, input_names=["x", "target"]))


def _activation_and_gradient(model: ir.Model, op_type: str) -> tuple[ir.Node, ir.Node]:
    gradient = next(n for n in model.graph if n.op_type == f"{op_type}Grad")
    activation = next(n for n in model.graph if n.op_type == op_type and not is_backward(n))
    assert gradient.inputs[1] is activation.inputs[0]
    return activation, gradient


def _weight_gradient_leaf(model: ir.Model, param: str) -> str:
    return next(n.name for n in model.graph for out in n.outputs if out.name == f"{param}_grad")


@pytest.mark.parametrize(("act", "op_type"), [("silu", "QuickGelu"), ("gelu", "Gelu")])
def test_the_partner_gradient_reads_a_late_copy_and_the_forward_activation_dies_in_forward(act, op_type):
    _, model = _training(act=act)
    activation, gradient = _activation_and_gradient(model, op_type)
    product = next(n for n, _ in activation.outputs[0].uses() if is_backward(n))  # dU = dY * act(G)
    pass_ = RecomputeGateActivationPass()
    assert pass_(model).modified
    assert dict(pass_.stats["counts"])["activations copied"] == 1
    copy = next(v.producer() for v in product.inputs if v.producer() is not None and v.producer().op_type == op_type)
    assert copy is not activation and copy.op_type == op_type and is_backward(copy)
    assert copy.inputs[0] is gradient.inputs[1]  # computed from G, which the gradient reads anyway
    # No backward node reads the forward activation: it is not stashed any more.
    assert not [n for n, _ in activation.outputs[0].uses() if is_backward(n)]


def test_ort_runs_the_activation_gradient_first_then_the_copy_and_the_partner(tmp_path):
    _, model = _training()
    # The leaf order the recompute pass writes: the unit computable first (the partner's
    # weight gradient, whose product comes first) last, so ORT walks it first.
    order_gradient_leaves(model.graph, list(model.graph))
    _, gradient = _activation_and_gradient(model, "QuickGelu")
    gate, up = (_weight_gradient_leaf(model, f"{p}.weight") for p in ("gate", "up"))
    before = ort_execution_order(model, _batch(), tmp_path)
    assert before.index(up) < before.index(gate)
    pass_ = RecomputeGateActivationPass()
    pass_(model)
    assert dict(pass_.stats["counts"]) == {"activations copied": 1, "leaves moved": 1}
    copy = next(n for n in model.graph if n.name.endswith("_late"))
    after = ort_execution_order(model, _batch(), tmp_path)
    assert after.index(gradient.name) < after.index(copy.name)
    assert after.index(gate) < after.index(up)


def test_training_steps_match_the_unrewritten_graph_and_torch():
    module, model = _training()
    expected = TrainingSession(model).run(_batch())
    rewritten = RecomputeGateActivationPass()(_training()[1]).model
    got = TrainingSession(rewritten).run(_batch())
    assert got.loss == expected.loss
    for name, grad in expected.gradients.items():
        np.testing.assert_array_equal(got.gradients[name], grad, err_msg=name)
    batch = {k: torch.from_numpy(v) for k, v in _batch().items()}
    loss = module(batch["x"], batch["target"])
    loss.backward()
    np.testing.assert_allclose(got.loss, loss.item(), rtol=1e-5)
    for name, param in module.named_parameters():
        np.testing.assert_allclose(got.gradients[name], param.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def test_does_not_fire_where_the_activation_is_only_scaled():
    _, model = _training(gated=False)
    assert any(n.op_type == "QuickGeluGrad" for n in model.graph)  # the activation and its gradient are there
    pass_ = RecomputeGateActivationPass()
    assert not pass_(model).modified
    assert not any(n.name.endswith("_late") for n in model.graph)
