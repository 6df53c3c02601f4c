"""ORT 1.19.2's gradient builder leaves the gradient of a broadcast ``Where`` input (and of
a broadcast ``Pow`` base) in the output's shape; the gradient build reduces it, and a gradient whose shape is not its
parameter's is refused (at build time when static, at run time otherwise)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
import torch

from ortpass.errors import OrtpassError, TrainingGraphError
from ortpass.runtime import TrainingSession
from ortpass.training import build as build_module
from ortpass.training import build_training_graph

FLOAT = onnx.TensorProto.FLOAT
OUT = (2, 4, 8, 8)


def _where_model(batch, bias_shape, position: int, opset: int = 17) -> ir.Model:
    """loss = sum(Where(cond, bias, x) * x) (bias at ``position`` 1 or 2 of the Where)."""
    bias = np.random.default_rng(0).standard_normal(bias_shape).astype(np.float32)
    where_inputs = ["cond", "bias", "x"] if position == 1 else ["cond", "x", "bias"]
    nodes = [
        oh.make_node("Where", where_inputs, ["w"], name="where"),
        oh.make_node("Mul", ["w", "x"], ["m"], name="mul"),
        oh.make_node("ReduceSum", ["m"], ["loss"], keepdims=0, name="sum"),
    ]
    dims = [batch, *OUT[1:]]
    graph = oh.make_graph(
        nodes,
        "where_broadcast",
        [oh.make_tensor_value_info("cond", onnx.TensorProto.BOOL, dims), oh.make_tensor_value_info("x", FLOAT, dims)],
        [oh.make_tensor_value_info("loss", FLOAT, [])],
        [onnx.numpy_helper.from_array(bias, "bias")],
    )
    return ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=9))


def _batch():
    rng = np.random.default_rng(1)
    return {"cond": rng.random(OUT) > 0.5, "x": rng.standard_normal(OUT).astype(np.float32)}


def _torch_gradient(model: ir.Model, batch, position: int) -> np.ndarray:
    bias = torch.tensor(model.graph.initializers["bias"].const_value.numpy(), requires_grad=True)
    cond, x = torch.tensor(batch["cond"]), torch.tensor(batch["x"])
    where = torch.where(cond, bias, x) if position == 1 else torch.where(cond, x, bias)
    (where * x).sum().backward()
    return bias.grad.numpy()


@pytest.mark.parametrize("batch_dim", [2, "batch"], ids=["static", "symbolic"])
@pytest.mark.parametrize("position", [1, 2])
@pytest.mark.parametrize("bias_shape", [(1, 4, 8, 8), (8, 8), (1, 4, 1, 8)], ids=["leading-1", "lower-rank", "two-axes"])
def test_broadcast_where_input_gets_its_own_gradient(batch_dim, position, bias_shape):
    model = _where_model(batch_dim, bias_shape, position)
    training = build_training_graph(model, params=["bias"], loss="loss")
    assert "ReduceSum" in {n.op_type for n in training.graph if n.metadata_props.get("pkg.ortpass.side") == "backward"}
    batch = _batch()
    gradient = TrainingSession(training).run(batch).gradients["bias"]
    expected = _torch_gradient(model, batch, position)
    assert gradient.shape == bias_shape
    np.testing.assert_allclose(gradient, expected, rtol=1e-5, atol=1e-6)


def test_before_opset_13_the_reduction_takes_its_axes_as_attributes():
    model = _where_model("batch", (8, 8), 1, opset=12)
    training = build_training_graph(model, params=["bias"], loss="loss")
    reduce_sum = next(n for n in training.graph if n.op_type == "ReduceSum" and "ortpass_broadcast" in n.name)
    assert list(reduce_sum.attributes["axes"].as_ints()) == [0, 1] and len(reduce_sum.inputs) == 1
    batch = _batch()
    gradient = TrainingSession(training).run(batch).gradients["bias"]
    np.testing.assert_allclose(gradient, _torch_gradient(model, batch, 1), rtol=1e-5, atol=1e-6)


def test_where_without_broadcast_is_left_alone():
    training = build_training_graph(_where_model(2, OUT, 1), params=["bias"], loss="loss")
    assert not any("ortpass_broadcast" in n.name for n in training.graph)
    batch = _batch()
    gradient = TrainingSession(training).run(batch).gradients["bias"]
    np.testing.assert_allclose(gradient, _torch_gradient(_where_model(2, OUT, 1), batch, 1), rtol=1e-5, atol=1e-6)


def _without_repair(monkeypatch):
    monkeypatch.setattr(build_module, "reduce_broadcast_gradients", lambda proto, names: 0)


def test_without_the_repair_a_static_wrong_gradient_shape_is_refused_at_build(monkeypatch):
    """ORT's own result: a (2,4,8,8) gradient for the (1,4,8,8) parameter."""
    _without_repair(monkeypatch)
    with pytest.raises(TrainingGraphError, match=r"parameter 'bias' has shape \[2, 4, 8, 8\], not the parameter's \[1, 4, 8, 8\]"):
        build_training_graph(_where_model(2, (1, 4, 8, 8), 1), params=["bias"], loss="loss")


def test_without_the_repair_a_symbolic_wrong_gradient_shape_is_refused_at_run_time(monkeypatch):
    _without_repair(monkeypatch)
    training = build_training_graph(_where_model("batch", (1, 4, 8, 8), 1), params=["bias"], loss="loss")
    with pytest.raises(OrtpassError, match=r"gradient of parameter 'bias' has shape \[2, 4, 8, 8\]"):
        TrainingSession(training).run(_batch())


def _pow_model(batch, base_shape) -> ir.Model:
    """loss = sum(Pow(base, x) * x), the base a parameter broadcast against x."""
    base = (np.random.default_rng(0).random(base_shape) + 0.5).astype(np.float32)
    nodes = [
        oh.make_node("Pow", ["base", "x"], ["p"], name="pow"),
        oh.make_node("Mul", ["p", "x"], ["m"], name="mul"),
        oh.make_node("ReduceSum", ["m"], ["loss"], keepdims=0, name="sum"),
    ]
    graph = oh.make_graph(
        nodes, "pow_broadcast", [oh.make_tensor_value_info("x", FLOAT, [batch, *OUT[1:]])],
        [oh.make_tensor_value_info("loss", FLOAT, [])], [onnx.numpy_helper.from_array(base, "base")],
    )
    return ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=9))


@pytest.mark.parametrize("batch_dim", [2, "batch"], ids=["static", "symbolic"])
@pytest.mark.parametrize("base_shape", [(1, 4, 8, 8), (8, 8)], ids=["leading-1", "lower-rank"])
def test_broadcast_pow_base_gets_its_own_gradient(batch_dim, base_shape):
    model = _pow_model(batch_dim, base_shape)
    training = build_training_graph(model, params=["base"], loss="loss")
    x = (np.random.default_rng(1).random(OUT) + 0.5).astype(np.float32)
    gradient = TrainingSession(training).run({"x": x}).gradients["base"]
    base = torch.tensor(model.graph.initializers["base"].const_value.numpy(), requires_grad=True)
    xt = torch.tensor(x)
    (base**xt * xt).sum().backward()
    assert gradient.shape == base_shape
    np.testing.assert_allclose(gradient, base.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_without_the_repair_the_pow_base_gradient_is_refused(monkeypatch):
    _without_repair(monkeypatch)
    with pytest.raises(TrainingGraphError, match=r"parameter 'base' has shape \[2, 4, 8, 8\]"):
        build_training_graph(_pow_model(2, (1, 4, 8, 8)), params=["base"], loss="loss")
