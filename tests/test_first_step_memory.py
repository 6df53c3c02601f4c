"""Issue 59: the first call's host memory — the weights' bytes kept out of the protos the
gradient build and the shape analyses pass around, with the same graphs coming out."""

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import onnx_ir as ir
import pytest

from ortpass.analysis.memory import bind_internal_dims
from ortpass.errors import ModelLoadError
from ortpass.graph.weightless import proto_with_placeholders, proto_without_weights
from ortpass.infra.validate import check_declared_shapes
from ortpass.training import build
from ortpass.training.detached_weights import PLACEHOLDER, reattach, without_detached


def _mlp_model() -> ir.Model:
    """x @ w1 -> Relu -> Reshape(x, [-1, 2 * rows]) -> @ w2, loss = ReduceSum; w1 and w2
    are initializers and graph inputs (as ORTModule makes its state), the Reshape's
    shape a small int64 initializer."""
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])
    w1 = oh.make_tensor_value_info("w1", onnx.TensorProto.FLOAT, [4, 6])
    w2 = oh.make_tensor_value_info("w2", onnx.TensorProto.FLOAT, [12, 3])
    rng = np.random.default_rng(0)
    inits = [
        onnx.numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "w1"),
        onnx.numpy_helper.from_array(rng.standard_normal((12, 3)).astype(np.float32), "w2"),
        onnx.numpy_helper.from_array(np.array([-1, 12], dtype=np.int64), "shape"),
    ]
    nodes = [
        oh.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        oh.make_node("Relu", ["h"], ["r"], name="relu"),
        oh.make_node("Reshape", ["r", "shape"], ["rr"], name="reshape"),
        oh.make_node("MatMul", ["rr", "w2"], ["y"], name="mm2"),
        oh.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0),
    ]
    graph = oh.make_graph(nodes, "mlp", [x, w1, w2], [oh.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])], inits)
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    proto.ir_version = 9
    return ir.from_proto(proto)


def test_detached_weights_are_placeholders_that_fail_loudly_and_come_back_shared():
    model = _mlp_model()
    proto, detached = proto_with_placeholders(model, ["w1", "w2", "shape", "x"])
    assert detached == {"w1", "w2"}  # graph-input parameters only; "shape" is no parameter input
    by_name = {init.name: init for init in proto.graph.initializer}
    assert [init.name for init in proto.graph.initializer] == ["w1", "w2", "shape"]  # same places
    assert by_name["w1"].data_location == onnx.TensorProto.EXTERNAL and not by_name["w1"].raw_data
    assert list(by_name["w2"].dims) == [12, 3]
    assert by_name["shape"].data_location != onnx.TensorProto.EXTERNAL
    with pytest.raises(Exception):  # a tool reading one fails, it never computes with wrong data
        onnx.numpy_helper.to_array(by_name["w1"])
    training = ir.from_proto(proto)
    reattach(training, model, detached)
    assert training.graph.initializers["w1"].const_value is model.graph.initializers["w1"].const_value
    assert not any(isinstance(v.const_value, ir.ExternalTensor) for v in training.graph.initializers.values())


def test_reattach_refuses_a_placeholder_left_without_its_value():
    model = _mlp_model()
    proto, detached = proto_with_placeholders(model, ["w1", "w2"])
    training = ir.from_proto(proto)
    with pytest.raises(Exception, match="lost their values"):
        reattach(training, model, detached - {"w2"})


def test_shape_inference_runs_without_the_placeholders_and_puts_them_back_in_place():
    model = _mlp_model()
    proto, detached = proto_with_placeholders(model, ["w1", "w2"])
    seen = []

    def infer(p):
        seen.append([init.name for init in p.graph.initializer])
        return onnx.shape_inference.infer_shapes(p, strict_mode=True, data_prop=True)

    out = without_detached(infer, proto, detached)
    assert seen == [["shape"]]  # onnx checks an external file exists: it never sees them
    assert [init.name for init in out.graph.initializer] == ["w1", "w2", "shape"]
    assert [init.name for init in proto.graph.initializer] == ["w1", "w2", "shape"]
    shapes = {vi.name: [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim] for vi in out.graph.value_info}
    assert shapes["rr"][1] == 12 and shapes["y"][1] == 3  # the weights' shapes, from their inputs


def _training_graph(model: ir.Model, monkeypatch, *, detaching: bool) -> bytes:
    with monkeypatch.context() as patch:
        if not detaching:
            patch.setattr(build, "proto_with_placeholders", lambda model, names: (ir.to_proto(model), set()))
        training = build.build_training_graph(model, params=["w1", "w2"], loss="loss", ort_fusions=True)
    return ir.to_proto(training).SerializeToString()


def test_the_gradient_build_gives_the_same_bytes_with_the_weights_detached(monkeypatch):
    pytest.importorskip("onnxruntime.training")
    model = _mlp_model()
    calls = []
    real = build.proto_with_placeholders

    def recording(model, names):
        proto, detached = real(model, names)
        calls.append(detached)
        return proto, detached

    monkeypatch.setattr(build, "proto_with_placeholders", recording)
    detached = _training_graph(model, monkeypatch, detaching=True)
    assert calls == [{"w1", "w2"}]
    assert detached == _training_graph(model, monkeypatch, detaching=False)
    assert PLACEHOLDER.encode() not in detached
    assert [init.name for init in model.graph.initializers.values()] == ["w1", "w2", "shape"]  # input unchanged


def test_the_weightless_proto_is_the_model_but_the_floating_point_input_initializers():
    model = _mlp_model()
    full, light = ir.to_proto(model), proto_without_weights(model)
    assert [init.name for init in light.graph.initializer] == ["shape"]
    for field in ("node", "input", "output", "value_info"):
        assert getattr(full.graph, field) == getattr(light.graph, field), field
    assert full.opset_import == light.opset_import and full.ir_version == light.ir_version
    # A model without such initializers is serialized as it is.
    bare = ir.from_proto(full)
    for name in ("w1", "w2"):
        bare.graph.inputs.remove(bare.graph.initializers[name])
    assert proto_without_weights(bare) == ir.to_proto(bare)



def test_placeholders_keep_every_initializer_in_place_without_the_weights_bytes():
    model = _mlp_model()
    big = np.ones((4096, 6), dtype=np.float32)  # 96 KiB that must not be serialized
    model.graph.initializers["w1"].const_value = ir.tensor(big, name="w1")
    model.graph.initializers["w1"].shape = ir.Shape([4096, 6])
    full = ir.to_proto(model)
    proto, placeholders = proto_with_placeholders(model)
    assert placeholders == {"w1", "w2"}
    assert [init.name for init in proto.graph.initializer] == ["w1", "w2", "shape"]
    assert proto.ByteSize() < 4096 and full.ByteSize() > big.nbytes
    by_name = {init.name: init for init in proto.graph.initializer}
    assert list(by_name["w1"].dims) == [4096, 6] and by_name["w1"].data_type == onnx.TensorProto.FLOAT
    assert by_name["w1"].external_data[0].value == PLACEHOLDER
    assert by_name["shape"] == {init.name: init for init in full.graph.initializer}["shape"]
    for field in ("node", "input", "output", "value_info"):
        assert getattr(full.graph, field) == getattr(proto.graph, field), field
    # Only those named, and never a weight that is no graph input: serialized as before.
    assert proto_with_placeholders(model, ["w2"])[1] == {"w2"}
    bare = ir.from_proto(full)
    bare.graph.inputs.remove(bare.graph.initializers["w1"])
    assert proto_with_placeholders(bare)[1] == {"w2"}


def test_a_placeholder_declared_with_other_dims_is_refused_by_the_shape_check():
    """A placeholder keeps its dims, so the up-front shape check still compares them with
    their declaration (fires on a wrong one, not on the right one)."""
    model = _mlp_model()
    check_declared_shapes(proto_with_placeholders(model)[0])  # consistent: accepted
    model.graph.initializers["w2"].shape = ir.Shape([12, 5])  # declared otherwise than held
    with pytest.raises(ModelLoadError, match=r"initializer 'w2' holds a tensor of shape \[12, 3\]"):
        check_declared_shapes(proto_with_placeholders(model)[0])

def test_internal_dims_are_bound_as_before_without_the_weights(monkeypatch):
    """``unk`` dims computed from a shape the int64 constant gives (kept), and from the
    weights' shapes (their inputs' declarations)."""
    model = _mlp_model()
    for node in model.graph:
        for value in node.outputs:
            if value.shape is None and value.name != "loss":
                value.shape = ir.Shape([None, None]) if value.name != "y" else ir.Shape(["unk__9", 3])
    model.graph.node("reshape").outputs[0].shape = ir.Shape(["unk__7", 12])
    wanted = {"unk__7", "unk__9"}
    light = bind_internal_dims(model, {"batch": 6}, wanted)
    monkeypatch.setattr("ortpass.graph.weightless.proto_without_weights", ir.to_proto)
    assert light == bind_internal_dims(model, {"batch": 6}, wanted) == {"unk__7": 3, "unk__9": 3}



def test_an_export_without_the_weights_is_the_same_graph_with_the_state_as_inputs():
    """``export(weights=False)`` (ORTModule's export and its dims proof) writes no weight:
    the graph is node for node the export with weights, its state named alike as graph
    inputs, and the trainable parameters recorded alike."""
    import json

    import torch

    from ortpass.conventions import EXPORT_KEY
    from ortpass.export import export
    from ortpass.runtime.module.dims import graph_signature

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 16))
    module[2].bias.requires_grad_(False)  # frozen: not a trainable parameter either way
    ids = torch.randint(0, 16, (2, 5))
    state = {n for n, _ in module.named_parameters()}
    kwargs = dict(input_names=["ids"], loss_name=None, outputs_with_grad=[])
    full = export(module, (ids,), **kwargs)
    bare = export(module, (ids,), weights=False, **kwargs)
    assert set(full.graph.initializers) >= state and not set(bare.graph.initializers) & state
    assert {v.name for v in bare.graph.inputs} == {"ids", *state}
    assert graph_signature(bare, state) == graph_signature(full, state)
    params = [json.loads(m.metadata_props[EXPORT_KEY])["params"] for m in (full, bare)]
    assert params[0] == params[1] == ["0.weight", "1.weight", "1.bias", "2.weight"]


def test_ortmodule_gives_its_graph_the_modules_own_tensors_not_copies():
    import torch

    from ortpass.runtime.module.graph_state import attach_state

    weight = torch.randn(4, 6)
    model = _mlp_model()
    model.graph.initializers.pop("w1").const_value = None  # as an export without weights has it
    attach_state(model, {"w1": weight})
    attached = model.graph.initializers["w1"]
    assert attached.is_graph_input()
    assert attached.const_value.raw.data_ptr() == weight.data_ptr()  # shared with torch
    np.testing.assert_array_equal(attached.const_value.numpy(), weight.numpy())
