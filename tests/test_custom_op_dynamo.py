"""torch.library.custom_op -> com.microsoft::PythonOp on the dynamo (torch.export) exporter."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from ortpass.errors import ExportError
from ortpass.pythonop.custom_op import export_with_custom_ops
from ortpass.pythonop.export import exported_functions


@torch.library.custom_op("ortpass_test::scale_clamp", mutates_args=())
def scale_clamp(x: torch.Tensor, alpha: float, bounds: list[int]) -> torch.Tensor:
    return (x * alpha).clamp(bounds[0], bounds[1])


@scale_clamp.register_fake
def _(x, alpha, bounds):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    x, alpha, bounds = inputs
    ctx.alpha = alpha
    ctx.save_for_backward((x * alpha >= bounds[0]) & (x * alpha <= bounds[1]))


def _backward(ctx, grad):
    (inside,) = ctx.saved_tensors
    return grad * inside * ctx.alpha, None, None


scale_clamp.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("ortpass_test::with_mode", mutates_args=())
def with_mode(x: torch.Tensor, mode: str) -> torch.Tensor:
    return x.clone()


@with_mode.register_fake
def _(x, mode):
    return torch.empty_like(x)


class _Model(torch.nn.Module):
    def __init__(self, op=None, *constants):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.op = op or scale_clamp
        self.constants = constants or (2.0, [-1, 1])

    def forward(self, x):
        return (self.op(self.linear(x), *self.constants) ** 2).sum()


@pytest.fixture(scope="module")
def exported():
    torch.manual_seed(0)
    module = _Model()
    x = torch.randn(3, 4)
    return module, x, export_with_custom_ops(module, (x,), custom_ops=[scale_clamp])


def test_custom_op_becomes_one_pythonop_with_ort_attributes(exported):
    _, _, model = exported
    pythonops = [n for n in model.graph if n.op_type == "PythonOp"]
    assert len(pythonops) == 1
    assert not any(n.op_type in ("Clip", "Mul") for n in model.graph)  # not inlined
    (node,) = pythonops
    attrs = {k: (list(a.value) if isinstance(a.value, tuple) else a.value) for k, a in node.attributes.items()}
    assert attrs == {
        "func_name": "ortpass_test::scale_clamp",
        "input_convention": "dcc",
        "input_requires_grads": [1, 0, 0],
        "input_tensor_types": [onnx.TensorProto.FLOAT],
        "input_tensor_ranks": [2],
        "output_tensor_types": [onnx.TensorProto.FLOAT],
        "output_tensor_ranks": [2],
        "training_mode": 1,
        "safe_run_mode": 1,
        "input_float_scalars": [2.0],
        "input_float_scalar_positions": [1],
        "input_int_tuples": [-1, 1],
        "input_int_tuple_positions": [2],
        "input_int_tuple_begins": [0],
    }
    ctx, out = node.outputs
    assert ctx.name == f"{out.name}_ctx" and ctx.dtype == ir.DataType.INT64
    assert exported_functions()["ortpass_test::scale_clamp"] is scale_clamp


def test_exported_model_passes_the_onnx_checker(exported):
    _, _, model = exported
    onnx.checker.check_model(ir.to_proto(model))


def test_training_step_through_the_bridge_matches_torch(exported):
    from ortpass.runtime import TrainingSession
    from ortpass.training import build_training_graph

    module, x, model = exported
    training = build_training_graph(model, loss=model.graph.outputs[0].name)
    result = TrainingSession(training).run({model.graph.inputs[0].name: x.numpy()})
    module.zero_grad()
    loss = module(x)
    loss.backward()
    np.testing.assert_allclose(result.loss, loss.item(), rtol=1e-5)
    for name, param in module.named_parameters():
        np.testing.assert_allclose(result.gradients[name], param.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_custom_op_argument_that_cannot_be_an_attribute_is_refused():
    with pytest.raises(ExportError, match=r"ortpass_test::with_mode: argument 1"):
        export_with_custom_ops(_Model(with_mode, "fast"), (torch.randn(3, 4),), custom_ops=[with_mode])
