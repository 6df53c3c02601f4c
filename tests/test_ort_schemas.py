"""ORT's own ops in the ONNX domain: the checks accept them as ORT does, refuse what ORT
refuses, and onnx's shape inference gives SimplifiedLayerNormalization's InvStdDev the shape
ORT's kernel gives it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
import torch

import ortpass
from ortpass.export import export
from ortpass.infra import checks
from ortpass.runtime import TrainingSession
from ortpass.runtime.parity import check_parity
from ortpass.training import build_training_graph

FLOAT = onnx.TensorProto.FLOAT


def _rms_model(*, axis: int = -1, extra_attr: dict | None = None, op: str = "SimplifiedLayerNormalization",
               inputs=("x", "scale"), x_shape=("batch", 3, 4), scale_shape=(4,)) -> onnx.ModelProto:
    node = oh.make_node(op, list(inputs), ["y", "inv_std"], axis=axis, epsilon=1e-6, **(extra_attr or {}))
    graph = oh.make_graph(
        [node],
        "rms",
        [oh.make_tensor_value_info("x", FLOAT, list(x_shape)), oh.make_tensor_value_info("scale", FLOAT, list(scale_shape))],
        [oh.make_tensor_value_info("y", FLOAT, list(x_shape))],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=9)


def _both_checks(proto: onnx.ModelProto) -> None:
    onnx.checker.check_model(proto)
    checks.input_check(ir.from_proto(proto))


def test_simplified_layer_norm_passes_both_checks():
    _both_checks(_rms_model())


@pytest.mark.parametrize(
    "broken",
    [
        dict(op="NoSuchOp"),  # an op neither onnx nor ORT defines
        dict(extra_attr={"bogus": 1}),  # an attribute ORT's fusion never writes
        dict(inputs=("x",)),  # scale is required
        dict(inputs=("x", "scale", "scale")),  # one input too many
    ],
    ids=["unknown-op", "unknown-attribute", "missing-input", "extra-input"],
)
def test_checks_still_refuse_what_ort_would(broken):
    proto = _rms_model(**broken)
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(proto)
    with pytest.raises(onnx.checker.ValidationError):
        checks.input_check(ir.from_proto(proto))


@pytest.mark.parametrize("axis", [-1, 1])
def test_inv_std_shape_is_what_ort_computes(axis):
    """The normalized dims (axis to the last) become 1 in InvStdDev: measured on ORT's
    kernel here (ORT's own schema inference claims only ``axis`` becomes 1)."""
    import onnxruntime as ort

    scale_shape = (4,) if axis == -1 else (3, 4)
    proto = _rms_model(axis=axis, x_shape=(2, 3, 4), scale_shape=scale_shape)
    proto.graph.output.append(oh.make_tensor_value_info("inv_std", FLOAT, None))
    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    (info,) = [v for v in (*inferred.graph.value_info, *inferred.graph.output) if v.name == "inv_std"]
    ours = tuple(d.dim_value for d in info.type.tensor_type.shape.dim)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    _, inv_std = session.run(None, {"x": x, "scale": np.ones(scale_shape, np.float32)})
    assert ours == inv_std.shape == ((2, 3, 1) if axis == -1 else (2, 1, 1))


def test_inv_std_shape_keeps_symbolic_dims():
    inferred = onnx.shape_inference.infer_shapes(_rms_model(), strict_mode=True)
    (info,) = [v for v in inferred.graph.value_info if v.name == "inv_std"]
    dims = [d.dim_param or d.dim_value for d in info.type.tensor_type.shape.dim]
    assert dims == ["batch", 3, 1]


class _RMSNormRegression(torch.nn.Module):
    """x -> RMSNorm (LLaMA's chain: pow, mean, rsqrt, mul, weight) -> Linear -> MSE."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(hidden) + 0.5)
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x, target):
        variance = x.pow(2).mean(-1, keepdim=True)
        normed = self.weight * (x * torch.rsqrt(variance + 1e-6))
        return torch.nn.functional.mse_loss(self.proj(normed), target)


def test_rmsnorm_model_trains_through_the_checked_pipeline():
    """ORT's fusion turns the chain into SimplifiedLayerNormalization; the checked
    pipeline used to refuse it (``No Op registered ... domain_version of 17``)."""
    torch.manual_seed(0)
    module = _RMSNormRegression()
    args = (torch.randn(2, 8, 16), torch.randn(2, 8, 16))
    dims = {"x": {0: "batch", 1: "seq"}, "target": {0: "batch", 1: "seq"}}
    forward = export(module, args, input_names=["x", "target"], dynamic_axes=dims)
    for mode in ("incremental", "full"):
        result = ortpass.pipeline("build-training-graph", check=mode)(forward)
        assert "SimplifiedLayerNormalization" in {n.op_type for n in result.model.graph}
    check_parity(module, args, result.model, input_names=["x", "target"]).assert_ok()
    TrainingSession(result.model).run({"x": args[0], "target": args[1]})


def test_training_graph_gives_inv_std_a_shape():
    torch.manual_seed(0)
    module = _RMSNormRegression()
    args = (torch.randn(2, 8, 16), torch.randn(2, 8, 16))
    dims = {"x": {0: "batch", 1: "seq"}, "target": {0: "batch", 1: "seq"}}
    training = build_training_graph(export(module, args, input_names=["x", "target"], dynamic_axes=dims))
    (norm,) = [n for n in training.graph if n.op_type == "SimplifiedLayerNormalization"]
    inv_std = norm.outputs[1]
    assert inv_std.shape is not None and list(inv_std.shape) == [ir.SymbolicDim("batch"), ir.SymbolicDim("seq"), 1]


class _PoolingClassifier(torch.nn.Module):
    """Conv -> ReLU -> MaxPool -> AveragePool -> Linear -> cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 * 4 * 4, 3)

    def forward(self, x, labels):
        h = torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        h = torch.nn.functional.avg_pool2d(h, 2)
        return torch.nn.functional.cross_entropy(self.fc(h.flatten(1)), labels)


def test_pooling_gradients_pass_the_checks():
    """ORT's builder emits MaxPoolGrad and AveragePoolGrad in the ONNX domain; the checked
    pipeline refused them ("No Op registered for AveragePoolGrad")."""
    torch.manual_seed(0)
    module = _PoolingClassifier()
    args = (torch.randn(2, 1, 16, 16), torch.tensor([0, 2]))
    forward = export(module, args, input_names=["x", "labels"])
    for mode in ("incremental", "full"):
        result = ortpass.pipeline("build-training-graph", check=mode)(forward)
    ops = {(n.domain, n.op_type) for n in result.model.graph}
    assert {("", "MaxPoolGrad"), ("", "AveragePoolGrad")} <= ops
    check_parity(module, args, result.model, input_names=["x", "labels"]).assert_ok()
