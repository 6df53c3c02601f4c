"""Shared fixtures: a tiny hand-built model and an isolated pass registry."""

from __future__ import annotations

import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest

from ortpass.infra import registry


def make_relu_model() -> ir.Model:
    """x: float[2,3] -> Relu -> y; IR version 8 so ONNX Runtime 1.19 could load it."""
    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["y"], name="relu")],
        "relu_graph",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    return ir.from_proto(proto)


@pytest.fixture
def relu_model() -> ir.Model:
    return make_relu_model()


@pytest.fixture
def isolated_registry(monkeypatch):
    """Registrations made during the test are forgotten after it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return registry._REGISTRY
