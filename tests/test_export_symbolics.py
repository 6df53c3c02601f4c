"""ortpass's symbolics for aten ops torch's TorchScript exporter lacks or gets wrong, and
the gradient of a Dropout exported without ``training_mode`` (issue #21)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import onnx_ir as ir
import pytest
import torch

import ortpass
from ortpass.errors import ExportError
from ortpass.export import export
from ortpass.export.symbolics import (
    register_symbolic,
    registered_symbolics,
    unregister_symbolic,
)
from ortpass.runtime import TrainingSession
from ortpass.runtime.parity import check_parity
from ortpass.training import build_training_graph

F = onnx.TensorProto.FLOAT


def _run_forward(model: ir.Model, feeds: dict) -> dict:
    import onnxruntime

    proto = ir.to_proto(model)
    outputs = [o.name for o in proto.graph.output]
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(outputs, session.run(outputs, feeds)))


class DiffLoss(torch.nn.Module):
    """torch.diff with prepend along the last dim, then a bool diff's cumsum, as
    transformers' find_packed_sequence_indices computes them."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 8))

    def forward(self, x, positions):
        step = torch.diff(x * self.w, dim=-1, prepend=x[:, :1])
        packed = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        second = torch.diff(x, n=2, dim=0)
        return (step * packed).sum() + second.sum(), packed


def test_diff_and_bool_cumsum_export_and_match_torch():
    module = DiffLoss()
    x = torch.randn(3, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7], [5, 6, 0, 1, 0, 1, 2, 3]])
    model = export(module, (x, positions), input_names=["x", "positions"],
                   dynamic_axes={"x": {0: "batch"}, "positions": {0: "batch"}})
    ops = {node.op_type for node in model.graph}
    assert "Sub" in ops and "CumSum" in ops
    # Run the forward on ORT: the bool diff's cumsum counts in int64, as torch does.
    cumsum = next(node for node in model.graph if node.op_type == "CumSum")
    model.graph.outputs.append(cumsum.outputs[0])
    got = _run_forward(model, {"x": x.numpy(), "positions": positions.numpy()})
    loss, packed = module(x, positions)
    np.testing.assert_allclose(got["loss"], loss.detach().numpy(), rtol=1e-6)
    assert cumsum.outputs[0].dtype == ir.DataType.INT64
    np.testing.assert_array_equal(got[cumsum.outputs[0].name], packed.numpy())
    # A later batch size: the symbolic uses no export-time shape.
    x2, p2 = torch.randn(5, 8), torch.arange(8).repeat(5, 1)
    got2 = _run_forward(model, {"x": x2.numpy(), "positions": p2.numpy()})
    np.testing.assert_allclose(got2["loss"], module(x2, p2)[0].detach().numpy(), rtol=1e-5)


def test_symbolics_are_only_registered_during_export():
    from torch.onnx._internal.torchscript_exporter import registration

    assert registration.registry.get_function_group("aten::diff") is None or \
        registration.registry.get_function_group("aten::diff").get(17) is None
    model = export(DiffLoss(), (torch.randn(3, 8), torch.arange(8).repeat(3, 1)), input_names=["x", "positions"])
    assert "CumSum" in {node.op_type for node in model.graph}
    group = registration.registry.get_function_group("aten::diff")
    assert group is None or group.get(17) is None


def test_a_symbolic_registered_with_torch_before_the_export_is_restored_after():
    from torch.onnx._internal.torchscript_exporter import registration

    def users_own(g, x, n, dim, prepend, append):
        raise AssertionError("ortpass's symbolic should win during export")

    torch.onnx.register_custom_op_symbolic("aten::diff", users_own, 17)
    try:
        export(DiffLoss(), (torch.randn(3, 8), torch.arange(8).repeat(3, 1)), input_names=["x", "positions"])
        assert registration.registry.get_function_group("aten::diff").get(17) is users_own
    finally:
        torch.onnx.unregister_custom_op_symbolic("aten::diff", 17)


def test_registered_symbolic_is_used_and_unregistered():
    class Erfinv(torch.nn.Module):
        def forward(self, x):
            return torch.special.erfinv(x).sum()

    with pytest.raises(ExportError) as failure:
        export(Erfinv(), (torch.rand(4) * 0.5,))
    message = str(failure.value)
    assert "aten::erfinv" in message and "register_symbolic" in message

    @register_symbolic("aten::erfinv")
    def erfinv(g, x):
        return g.op("Mul", x, g.op("Constant", value_t=torch.tensor(2.0)))

    try:
        model = export(Erfinv(), (torch.rand(4) * 0.5,))
        assert "Mul" in {node.op_type for node in model.graph}
        with pytest.raises(ValueError, match="already registered"):
            register_symbolic("aten::erfinv")(lambda g, x: x)
    finally:
        unregister_symbolic("aten::erfinv")
    assert "aten::erfinv" not in registered_symbolics()
    with pytest.raises(ValueError, match="namespace::name"):
        register_symbolic("erfinv")


def test_an_op_without_a_symbolic_is_named_with_the_module_path_inside_a_sequential():
    # torch names the child of an nn.Sequential that runs it "blocks.1", not "1".
    class Erfinv(torch.nn.Module):
        def forward(self, x):
            return torch.special.erfinv(x)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.Sequential(torch.nn.Identity(), Erfinv())

        def forward(self, x):
            return self.blocks(x).sum()

    with pytest.raises(ExportError, match=r"in blocks\.1 \(Erfinv\)"):
        export(Model(), (torch.rand(4) * 0.5,))


class Attention(torch.nn.Module):
    """SDPA with dropout over grouped-query heads (4 query heads, 2 key/value heads)."""

    def __init__(self, *, gqa: bool, dropout: float):
        super().__init__()
        self.q = torch.nn.Linear(16, 16)
        self.kv = torch.nn.Linear(16, 16 if not gqa else 8)
        self.gqa, self.dropout = gqa, dropout

    def forward(self, x, target):
        batch, seq, _ = x.shape
        q = self.q(x).view(batch, seq, 4, 4).transpose(1, 2)
        kv = self.kv(x).view(batch, seq, -1, 4).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, kv, kv * 2, dropout_p=self.dropout, is_causal=True, enable_gqa=self.gqa
        )
        return ((out.transpose(1, 2).reshape(batch, seq, 16) - target) ** 2).mean()


@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_dropout_exports_in_training_mode_and_matches_torch(gqa):
    torch.manual_seed(0)
    module = Attention(gqa=gqa, dropout=0.25)
    args = (torch.randn(2, 6, 16), torch.randn(2, 6, 16))
    model = export(module, args, input_names=["x", "target"], dynamic_axes={"x": {0: "batch", 1: "seq"}})
    dropouts = [node for node in model.graph if node.op_type == "Dropout"]
    assert len(dropouts) == 1 and len(dropouts[0].inputs) == 3  # training_mode given
    assert ir.convenience.get_const_tensor(dropouts[0].inputs[2]).numpy().item() is True
    training = build_training_graph(model)
    result = check_parity(module, args, training, input_names=["x", "target"])
    result.assert_ok()
    # The dropout really happens: about a quarter of the mask is off.
    (mask,) = [v for k, v in result.ort.extras.items()]
    assert 0.1 < 1 - mask.mean() < 0.4


def _inference_dropout_graph() -> ir.Model:
    """loss = sum(Dropout(x * w, ratio=0.5) * c), the Dropout without training_mode (so
    the identity, per ONNX), as torch used to export SDPA's attention dropout."""
    nodes = [
        oh.make_node("Mul", ["x", "w"], ["xw"], name="mul"),
        oh.make_node("Dropout", ["xw", "ratio"], ["y"], name="drop"),
        oh.make_node("Mul", ["y", "c"], ["yc"], name="scale"),
        oh.make_node("ReduceSum", ["yc"], ["loss"], name="sum", keepdims=0),
    ]
    rng = np.random.default_rng(0)
    initializers = [
        onnx.numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w"),
        onnx.numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "c"),
        onnx.numpy_helper.from_array(np.array(0.5, dtype=np.float32), "ratio"),
    ]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", F, [8, 16])],
                          [oh.make_tensor_value_info("loss", F, [])], initializers)
    return ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=9))


def test_dropout_without_training_mode_is_the_identity_in_backward_too():
    model = _inference_dropout_graph()
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    c = onnx.numpy_helper.to_array(next(t for t in ir.to_proto(model).graph.initializer if t.name == "c"))
    expected = x * c  # d/dw sum(x * w * c): the Dropout is the identity
    plain = build_training_graph(model, params=["w"], ort_fusions=False)
    step = TrainingSession(plain).run({"x": x})
    np.testing.assert_allclose(step.gradients["w"], expected, rtol=1e-6)
    # The same with the passes that rewrite DropoutGrad: the answer does not depend on them.
    result = ortpass.pipeline("build-training-graph(ort_fusions=False),fix-dropout-seed,replay-dropout-mask")(model)
    np.testing.assert_array_equal(TrainingSession(result.model).run({"x": x}).gradients["w"], step.gradients["w"])
