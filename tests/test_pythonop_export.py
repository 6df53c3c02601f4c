"""torch.autograd.Function -> com.microsoft::PythonOp on the TorchScript exporter."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from ortpass.errors import ExportError
from ortpass.pythonop.export import (
    exported_functions,
    name_context_outputs,
    pythonop_export_context,
    register_exporter,
    unregister_exporter,
)


class AllKinds(torch.autograd.Function):
    """Takes every kind of argument the PythonOp attributes can carry."""

    @staticmethod
    def forward(ctx, x, alpha, n, flag, dims, scales, mask, more_dims, y):
        return x * alpha + y * n, x.sum(-1)

    @staticmethod
    def backward(ctx, grad, grad_sum):
        return grad + grad_sum.unsqueeze(-1), None, None, None, None, None, None, None, None


class TakesAnything(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anything):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


class ScaledRelu(torch.autograd.Function):
    """Its mode argument (a string) cannot be an attribute: only a registered exporter can export it."""

    @staticmethod
    def forward(ctx, x, alpha, mode):
        return torch.relu(x * alpha)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError


class _AllKindsModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        out, summed = AllKinds.apply(self.linear(x), 0.5, 3, True, (1, 2), (0.5, 0.25), (True, False), (4, 5, 6), y)
        return out.sum() + summed.sum()


class _CallsWith(torch.nn.Module):
    def __init__(self, function, *constants):
        super().__init__()
        self.function = function
        self.constants = constants

    def forward(self, x):
        return self.function.apply(x, *self.constants).sum()


def _torchscript_export(module, args) -> ir.Model:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            args,
            buffer,
            dynamo=False,
            training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False,
            opset_version=17,
            output_names=["loss"],
        )
    return ir.from_proto(onnx.load_from_string(buffer.getvalue()))


def _export(module, args) -> ir.Model:
    with pythonop_export_context():
        model = _torchscript_export(module, args)
    name_context_outputs(model)
    return model


def _pythonops(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "PythonOp" and n.domain == "com.microsoft"]


def _attrs(node: ir.Node) -> dict:
    return {name: attr.value if not isinstance(attr.value, tuple) else list(attr.value) for name, attr in node.attributes.items()}


def test_tensor_scalar_and_tuple_arguments_become_exact_attributes():
    model = _export(_AllKindsModel(), (torch.randn(2, 4), torch.randn(2, 4)))
    (node,) = _pythonops(model)
    # Positions: x=0 alpha=1 n=2 flag=3 dims=4 scales=5 mask=6 more_dims=7 y=8.
    expected = {
        "func_name": f"{AllKinds.__module__}.AllKinds",
        "input_convention": "dcccccccd",
        "input_requires_grads": [1, 0, 0, 0, 0, 0, 0, 0, 0],  # x comes from Linear; y is a plain input
        "input_tensor_types": [onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT],
        "input_tensor_ranks": [2, 2],
        "output_tensor_types": [onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT],
        "output_tensor_ranks": [2, 1],
        "training_mode": 1,
        "safe_run_mode": 1,
        "input_float_scalars": [0.5],
        "input_float_scalar_positions": [1],
        "input_int_scalars": [3],
        "input_int_scalar_positions": [2],
        "input_bool_scalars": [1],
        "input_bool_scalar_positions": [3],
        "input_int_tuples": [1, 2, 4, 5, 6],
        "input_int_tuple_positions": [4, 7],
        "input_int_tuple_begins": [0, 2],
        "input_float_tuples": [0.5, 0.25],
        "input_float_tuple_positions": [5],
        "input_float_tuple_begins": [0],
        "input_bool_tuples": [1, 0],
        "input_bool_tuple_positions": [6],
        "input_bool_tuple_begins": [0],
    }
    assert _attrs(node) == expected
    assert node.attributes["input_float_scalars"].type == ir.AttributeType.FLOATS
    assert node.attributes["input_bool_scalars"].type == ir.AttributeType.INTS


def test_pythonop_takes_only_tensors_and_puts_ctx_first():
    model = _export(_AllKindsModel(), (torch.randn(2, 4), torch.randn(2, 4)))
    (node,) = _pythonops(model)
    assert len(node.inputs) == 2
    assert node.inputs[1].name == model.graph.inputs[1].name  # y feeds the node directly
    ctx, first, second = node.outputs
    assert ctx.name == f"{first.name}_ctx"
    assert ctx.dtype == ir.DataType.INT64 and ctx.shape == ir.Shape([])
    assert first.dtype == ir.DataType.FLOAT and second.dtype == ir.DataType.FLOAT


def test_exported_function_is_recorded_for_the_bridge():
    _export(_AllKindsModel(), (torch.randn(2, 4), torch.randn(2, 4)))
    assert exported_functions()[f"{AllKinds.__module__}.AllKinds"] is AllKinds


@pytest.mark.parametrize(
    "constant, kind",
    [(None, "NoneType"), ("mode", "str"), ([1, 2], "list"), ((1, 2.0), "tuple"), (torch.float32, "dtype")],
)
def test_argument_that_cannot_be_an_attribute_is_refused_with_function_and_position(constant, kind):
    with pytest.raises(ExportError) as info:
        _export(_CallsWith(TakesAnything, constant), (torch.randn(2, 4),))
    message = str(info.value)
    assert f"{TakesAnything.__module__}.TakesAnything" in message
    assert "argument 1" in message and kind in message


def test_no_object_address_is_ever_written():
    model = _export(_AllKindsModel(), (torch.randn(2, 4), torch.randn(2, 4)))
    (node,) = _pythonops(model)
    assert not any("pointer" in name for name in node.attributes)


@pytest.fixture
def scaled_relu_exporter():
    @register_exporter(ScaledRelu)
    def export_scaled_relu(g, call):
        x, alpha, mode = call.args
        assert mode == "fast"
        scale = g.op("Constant", value_t=torch.tensor(alpha, dtype=torch.float32))
        return g.op("Relu", g.op("Mul", x, scale))

    yield export_scaled_relu
    unregister_exporter(ScaledRelu)


def test_registered_exporter_wins_and_emits_its_subgraph(scaled_relu_exporter):
    import onnxruntime as ort

    module = _CallsWith(ScaledRelu, 1.5, "fast")
    x = torch.randn(3, 4)
    model = _export(module, (x,))
    assert _pythonops(model) == []
    assert [n.op_type for n in model.graph if n.op_type in ("Mul", "Relu")] == ["Mul", "Relu"]

    proto = ir.to_proto(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    (loss,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(loss, module(x).detach().numpy(), rtol=1e-6)


def test_without_registered_exporter_the_same_function_is_refused():
    with pytest.raises(ExportError, match="argument 2"):
        _export(_CallsWith(ScaledRelu, 1.5, "fast"), (torch.randn(3, 4),))


def test_context_restores_torch_symbolic_registry():
    from torch.onnx._internal.torchscript_exporter import registration

    def lookup():
        group = registration.registry.get_function_group("prim::PythonOp")
        return group.get(1) if group is not None else None

    before = lookup()
    with pythonop_export_context():
        assert lookup() is not before
    assert lookup() is before
    # Outside the context torch inlines the Function again: no PythonOp appears.
    model = _torchscript_export(_AllKindsModel(), (torch.randn(2, 4), torch.randn(2, 4)))
    assert _pythonops(model) == []


def test_context_restores_a_symbolic_registered_before_it():
    def someone_elses(g, *args, **kwargs):
        raise AssertionError("not called in this test")

    torch.onnx.register_custom_op_symbolic("prim::PythonOp", someone_elses, 1)
    try:
        from torch.onnx._internal.torchscript_exporter import registration

        with pythonop_export_context():
            pass
        assert registration.registry.get_function_group("prim::PythonOp").get(1) is someone_elses
    finally:
        torch.onnx.unregister_custom_op_symbolic("prim::PythonOp", 1)


def test_function_whose_inputs_need_no_gradient_exports_in_inference_mode():
    # Nothing differentiable flows in: ORT builds no PythonOpGrad, so a training-mode ctx
    # would never be released.  Gradients of other inputs keep training mode (previous test).
    class _OnPlainInput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.linear(TakesAnything.apply(x, 3)).sum()

    (node,) = _pythonops(_export(_OnPlainInput(), (torch.randn(2, 3),)))
    assert _attrs(node)["input_requires_grads"] == [0, 0]
    assert _attrs(node)["training_mode"] == 0


class _ReshapesByOutputShape(torch.nn.Module):
    """Reads the Function output's batch size, as transformers' SDPA path does with
    ``attn_output.shape[0]``: it must stay a run-time value, not the export batch's."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 1)

    def forward(self, x):
        out = TakesAnything.apply(x, 1.0)
        return self.linear(out.reshape(out.shape[0], -1)).square().mean()


def test_function_output_sizes_stay_symbolic_so_another_batch_size_runs_right():
    import ortpass
    from ortpass.export import export
    from ortpass.runtime import TrainingSession

    torch.manual_seed(0)
    module = _ReshapesByOutputShape()
    forward = export(module, (torch.randn(2, 3, 2),), input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    reshape = next(n for n in forward.graph if n.op_type == "Reshape")
    assert reshape.inputs[1].const_value is None and reshape.inputs[1].producer().op_type != "Constant"
    session = TrainingSession(ortpass.pipeline("build-training-graph")(forward).model)
    x = torch.randn(3, 3, 2)  # another batch size than the export's
    assert session.run({"x": x}).loss == pytest.approx(module(x).item(), rel=1e-6)
