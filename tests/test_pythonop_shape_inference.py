"""PythonOpShapeInferencePass and the shape-inferer registry."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
import torch

from ortpass.errors import OrtpassError
from ortpass.passes.pythonop_shape_inference import PythonOpShapeInferencePass
from ortpass.pythonop.shape_inference import (
    get_shape_inferer,
    register_shape_inferer,
    unregister_shape_inferer,
)

PASS_THROUGH = "tests_models.PassThrough"


def _model(func_name: str = PASS_THROUGH) -> ir.Model:
    """x[batch, seq, 8] -> PythonOp -> y -> Relu -> z -> MatMul(w[8, 4]) -> out.

    y and z carry stale dims (as torch's exporter leaves them) that the pass must replace.
    """
    nodes = [
        oh.make_node(
            "PythonOp",
            ["x"],
            ["y_ctx", "y"],
            name="pythonop",
            domain="com.microsoft",
            func_name=func_name,
            input_convention="d",
            input_requires_grads=[1],
            input_tensor_types=[onnx.TensorProto.FLOAT],
            input_tensor_ranks=[3],
            output_tensor_types=[onnx.TensorProto.FLOAT],
            output_tensor_ranks=[3],
            training_mode=1,
        ),
        oh.make_node("Relu", ["y"], ["z"], name="relu"),
        oh.make_node("MatMul", ["z", "w"], ["out"], name="matmul"),
    ]
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "seq", 8])],
        [oh.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(np.ones((8, 4), np.float32), "w")],
        value_info=[
            oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["stale0", "stale1", "stale2"]),
            oh.make_tensor_value_info("z", onnx.TensorProto.FLOAT, ["stale0", "stale1", "stale2"]),
        ],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)])
    return ir.from_proto(proto)


def _shapes(model: ir.Model) -> dict[str, ir.Shape | None]:
    return {v.name: v.shape for node in model.graph for v in node.outputs}


def _dims(shape: ir.Shape) -> list:
    return [d if isinstance(d, int) else d.value for d in shape]


@pytest.fixture
def pass_through_inferer():
    @register_shape_inferer(PASS_THROUGH)
    def same_as_input(node, input_shapes, input_dtypes):
        return [input_shapes[0]], [input_dtypes[0]]

    yield same_as_input
    unregister_shape_inferer(PASS_THROUGH)


def test_registered_inferer_keeps_dim_names_on_both_sides(pass_through_inferer):
    model = _model()
    result = PythonOpShapeInferencePass()(model)
    assert result.modified
    shapes = _shapes(model)
    assert _dims(shapes["y"]) == ["batch", "seq", 8]
    assert _dims(shapes["z"]) == ["batch", "seq", 8]
    assert _dims(shapes["out"]) == ["batch", "seq", 4]  # MatMul with w[8, 4]
    assert shapes["y_ctx"] == ir.Shape([])
    assert model.graph.node("pythonop").outputs[0].dtype == ir.DataType.INT64


def test_without_inferer_outputs_get_rank_and_fresh_dims_that_flow_downstream():
    model = _model()
    assert get_shape_inferer(PASS_THROUGH) is None
    assert PythonOpShapeInferencePass()(model).modified
    shapes = _shapes(model)
    assert _dims(shapes["y"]) == ["y_d0", "y_d1", "y_d2"]
    assert _dims(shapes["z"]) == ["y_d0", "y_d1", "y_d2"]  # stale dims replaced
    assert _dims(shapes["out"]) == ["y_d0", "y_d1", 4]
    assert model.graph.node("pythonop").outputs[1].dtype == ir.DataType.FLOAT


def test_second_run_changes_nothing(pass_through_inferer):
    model = _model()
    PythonOpShapeInferencePass()(model)
    before = _shapes(model)
    assert not PythonOpShapeInferencePass()(model).modified
    assert _shapes(model) == before


def test_model_without_pythonop_is_left_alone():
    model = _model()
    model.graph.remove(model.graph.node("pythonop"), safe=False)
    assert not PythonOpShapeInferencePass()(model).modified


def test_inferer_with_wrong_output_count_fails_naming_node_and_leaves_shapes():
    register_shape_inferer(PASS_THROUGH)(lambda node, shapes, dtypes: ([shapes[0], shapes[0]], [dtypes[0]] * 2))
    try:
        model = _model()
        before = _shapes(model)
        with pytest.raises(OrtpassError, match=r"tests_models\.PassThrough.*pythonop.*1 tensor outputs"):
            PythonOpShapeInferencePass()(model)
        assert _shapes(model) == before
    finally:
        unregister_shape_inferer(PASS_THROUGH)


def test_inferer_is_keyed_by_class_qualified_name():
    class Local(torch.autograd.Function):
        pass

    inferer = register_shape_inferer(Local)(lambda node, shapes, dtypes: (shapes, dtypes))
    try:
        assert get_shape_inferer(f"{Local.__module__}.{Local.__qualname__}") is inferer
        with pytest.raises(ValueError, match="already registered"):
            register_shape_inferer(Local)(lambda node, shapes, dtypes: (shapes, dtypes))
    finally:
        unregister_shape_inferer(Local)


def test_pythonop_grad_outputs_take_the_forward_input_shape(pass_through_inferer):
    model = _model()
    forward = model.graph.node("pythonop")
    grad_y = ir.Value(name="y_grad", type=ir.TensorType(ir.DataType.FLOAT))
    grad = ir.Node(
        "com.microsoft",
        "PythonOpGrad",
        [forward.outputs[0], grad_y],
        attributes=[ir.AttrString("func_name", PASS_THROUGH)],
        num_outputs=1,
        name="pythonop_grad",
    )
    grad.outputs[0].name = "x_grad"
    model.graph.inputs.append(grad_y)
    model.graph.append(grad)
    model.graph.outputs.append(grad.outputs[0])
    PythonOpShapeInferencePass()(model)
    assert _dims(grad.outputs[0].shape) == ["batch", "seq", 8]
    assert grad.outputs[0].dtype == ir.DataType.FLOAT


class Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(Gate.apply(self.linear(x))).mean()


def test_exported_model_keeps_batch_and_seq_through_a_registered_function():
    from ortpass.export.torchscript import export
    from ortpass.pythonop.export import name_context_outputs

    model = export(_Gated(), (torch.randn(2, 3, 8),), input_names=["x"], dynamic_axes={"x": {0: "batch", 1: "seq"}})
    name_context_outputs(model)
    register_shape_inferer(Gate)(lambda node, shapes, dtypes: ([shapes[0]], [dtypes[0]]))
    try:
        PythonOpShapeInferencePass()(model)
    finally:
        unregister_shape_inferer(Gate)
    (node,) = [n for n in model.graph if n.op_type == "PythonOp"]
    assert _dims(node.inputs[0].shape) == ["batch", "seq", 8]
    assert _dims(node.outputs[1].shape) == ["batch", "seq", 8]
    (tanh,) = [n for n in model.graph if n.op_type == "Tanh"]
    assert _dims(tanh.outputs[0].shape) == ["batch", "seq", 8]
