"""Issue 3: torch module -> export -> gradient build -> ORT step, with parity against torch."""

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from ortpass.analysis.partition import get_partition, get_training_info
from ortpass.conventions import SIDE_KEY
from ortpass.errors import ExportError, OrtpassError, TrainingGraphError
from ortpass.export import export
from ortpass.runtime import TrainingSession, dropout_mask_names
from ortpass.runtime.parity import check_parity, relative_error
from ortpass.testing.models import MLP, GPTDecoder, _BlockRegression
from ortpass.training import build_training_graph

REPO_ROOT = Path(__file__).resolve().parent.parent


def _mlp_case():
    torch.manual_seed(0)
    module = MLP(d_in=8, hidden=16, classes=5)
    x = torch.randn(6, 8)
    labels = torch.tensor([1, 2, -100, 4, 0, 3])
    return module, (x, labels), ["x", "labels"]


def test_export_names_parameters_and_loss():
    module, args, names = _mlp_case()
    model = export(module, args, input_names=names, dynamic_axes={"x": {0: "batch"}, "labels": {0: "batch"}})
    assert [o.name for o in model.graph.outputs] == ["loss"]
    assert set(model.graph.initializers) >= {name for name, _ in module.named_parameters()}
    info = json.loads(model.metadata_props["pkg.ortpass.export"])
    assert info["params"] == [name for name, _ in module.named_parameters()]
    assert info["dims"] == {"batch": 6}
    # 5 of 6 labels are not ignore_index: 83.3% < 90%, so the label was flagged.
    (density,) = info["label_density"]
    assert (density["valid"], density["total"], density["flagged"]) == (5, 6, True)
    assert density["density"] == pytest.approx(500 / 6)
    assert model.graph.inputs[0].shape[0] == ir.SymbolicDim("batch")


def test_export_keeps_dropout_in_training_mode():
    torch.manual_seed(0)
    module = _BlockRegression(hidden=16, heads=2, dropout=0.5)
    module.eval()  # export must still use training mode, and restore the module's mode
    model = export(module, (torch.randn(1, 4, 16), torch.randn(1, 4, 16)))
    assert sum(node.op_type == "Dropout" for node in model.graph) == 3
    assert not module.training


def test_training_graph_has_grads_partition_and_ort_limits():
    module, args, names = _mlp_case()
    training = build_training_graph(export(module, args, input_names=names))
    info = get_training_info(training)
    outputs = {o.name for o in training.graph.outputs}
    assert outputs == {"loss"} | {f"{p}_grad" for p in info.params}
    assert info.gradients == {p: f"{p}_grad" for p in info.params}
    partition = get_partition(training)
    assert partition.forward and partition.backward
    assert all(n.metadata_props[SIDE_KEY] in ("forward", "backward") for n in training.graph)
    # Forward nodes come first and never read a backward value.
    backward_values = {id(v) for n in partition.backward for v in n.outputs}
    assert not any(id(v) in backward_values for n in partition.forward for v in n.inputs if v is not None)
    # Stashed: forward values read by backward, e.g. the first Gemm's output (GELU's input).
    stashed_producers = {v.producer().op_type for v in partition.stashed}
    assert "Gemm" in stashed_producers
    assert training.ir_version <= 10
    assert training.opset_imports[""] <= 21


def test_gradient_builder_outputs_are_added_for_layernorm_and_loss():
    torch.manual_seed(0)
    module = GPTDecoder(vocab=16, hidden=16, heads=2, layers=1, max_seq=8, dropout=0.0)
    ids = torch.randint(0, 16, (2, 8))
    forward = export(module, (ids, ids), input_names=["input_ids", "labels"])
    assert all(len(n.outputs) == 1 for n in forward.graph if n.op_type == "LayerNormalization")
    training = build_training_graph(forward)
    assert all(len(n.outputs) == 3 for n in training.graph if n.op_type == "LayerNormalization")
    sce = [n for n in training.graph if n.op_type == "SoftmaxCrossEntropyLoss"]
    assert len(sce) == 1 and len(sce[0].outputs) == 2
    assert len(forward.graph.outputs) == 1  # the input model is not modified


def test_mlp_parity():
    module, args, names = _mlp_case()
    training = build_training_graph(export(module, args, input_names=names))
    result = check_parity(module, args, training, input_names=names)
    result.assert_ok()
    assert set(result.errors) == {"loss"} | {name for name, _ in module.named_parameters()}


def test_transformer_block_parity_with_dropout():
    torch.manual_seed(1)
    module = _BlockRegression(hidden=32, heads=4, dropout=0.2)
    args = (torch.randn(2, 8, 32), torch.randn(2, 8, 32))
    training = build_training_graph(export(module, args, input_names=["x", "target"]))
    ops = {(n.domain, n.op_type) for n in training.graph}
    # ORT's pre-gradient fusions turn torch's exact-GELU chain (Div/Erf/Add/Mul/Mul) into one Gelu.
    assert {("", "LayerNormalization"), ("", "Softmax"), ("", "Dropout"), ("com.microsoft", "Gelu")} <= ops
    assert ("", "Erf") not in ops
    assert len(dropout_mask_names(training)) == 3
    check_parity(module, args, training, input_names=["x", "target"]).assert_ok()


def test_gpt_decoder_parity_with_ignore_index():
    torch.manual_seed(2)
    module = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, max_seq=16, dropout=0.1)
    ids = torch.randint(0, 64, (2, 16))
    labels = ids.roll(-1, dims=1)
    labels[:, -4:] = -100
    training = build_training_graph(export(module, (ids, labels), input_names=["input_ids", "labels"]))
    check_parity(module, (ids, labels), training, input_names=["input_ids", "labels"]).assert_ok()


def test_parity_check_detects_a_wrong_gradient():
    module, args, names = _mlp_case()
    training = build_training_graph(export(module, args, input_names=names))
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1.0)
    result = check_parity(module, args, training, input_names=names)
    assert result.ok
    # Feed ORT different weights than torch uses: the check must fail.
    session = TrainingSession(training)
    other = session.run(dict(zip(names, args)), {"fc1.weight": np.zeros((16, 8), np.float32)})
    assert relative_error(other.gradients["fc2.weight"], result.torch_gradients["fc2.weight"]) > 1e-3


def test_session_returns_masks_and_validates_batch():
    torch.manual_seed(0)
    module = _BlockRegression(hidden=16, heads=2, dropout=0.5)
    args = (torch.randn(1, 4, 16), torch.randn(1, 4, 16))
    training = build_training_graph(export(module, args, input_names=["x", "target"]))
    masks = dropout_mask_names(training)
    session = TrainingSession(training, extra_outputs=masks)
    step = session.run({"x": args[0], "target": args[1].numpy()})
    assert set(step.extras) == set(masks)
    assert all(m.dtype == np.bool_ for m in step.extras.values())
    batch = {"x": args[0], "target": args[1]}
    first, second = session.run(batch, seed=3), session.run(batch, seed=3)
    assert all(np.array_equal(first.extras[m], second.extras[m]) for m in masks)
    assert first.loss == second.loss
    with pytest.raises(OrtpassError, match="missing graph inputs \\['target'\\]"):
        session.run({"x": args[0]})
    with pytest.raises(OrtpassError, match="does not take: \\['bogus'\\]"):
        session.run({"x": args[0], "target": args[1], "bogus": args[1]})
    with pytest.raises(OrtpassError, match="'nope' is not a parameter"):
        session.run({"x": args[0], "target": args[1]}, {"nope": args[1]})
    with pytest.raises(OrtpassError, match="no node of the graph produces it"):
        TrainingSession(training, extra_outputs=["no_such_value"])


def test_cuda_provider_is_refused_clearly_without_a_cuda_build():
    import onnxruntime as ort

    module, args, names = _mlp_case()
    training = build_training_graph(export(module, args, input_names=names))
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime build has CUDA; the refusal is for CPU builds")
    with pytest.raises(OrtpassError, match="CUDA execution provider is not available"):
        TrainingSession(training, "cuda")


# -- bad input ---------------------------------------------------------------------------


def test_missing_loss_is_named():
    module, args, names = _mlp_case()
    forward = export(module, args, input_names=names)
    with pytest.raises(TrainingGraphError, match="loss 'total' is not a graph output; outputs are \\['loss'\\]"):
        build_training_graph(forward, loss="total")


def test_unknown_parameter_is_named():
    module, args, names = _mlp_case()
    forward = export(module, args, input_names=names)
    with pytest.raises(TrainingGraphError, match="parameter 'fc3.weight' is neither"):
        build_training_graph(forward, params=["fc1.weight", "fc3.weight"])


def test_integer_parameter_is_refused():
    module, args, names = _mlp_case()
    forward = export(module, args, input_names=names)
    with pytest.raises(TrainingGraphError, match="parameter 'labels' is not floating point"):
        build_training_graph(forward, params=["labels"])


def test_opset_too_new_for_ort_is_named():
    module, args, names = _mlp_case()
    with pytest.raises(ExportError, match="opset 22 is not supported: ORT 1.19.2 loads ai.onnx opsets up to 21"):
        export(module, args, input_names=names, opset=22)
    # A model from elsewhere with opset 22 is refused by the gradient build too.
    forward = export(module, args, input_names=names)
    proto = ir.to_proto(forward)
    proto.opset_import[0].version = 22
    with pytest.raises(TrainingGraphError, match="opset 22 is newer than ONNX Runtime 1.19.2 loads"):
        build_training_graph(ir.from_proto(proto))


def test_forward_must_return_a_scalar_loss():
    class NotALoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    with pytest.raises(ExportError, match="loss 'loss' has rank 2; it must be a scalar"):
        export(NotALoss(), (torch.randn(2, 4),))


def test_parameter_independent_of_loss_is_named():
    module, args, names = _mlp_case()
    forward = export(module, args, input_names=names)
    proto = ir.to_proto(forward)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.ones((2, 2), np.float32), "unused.weight"))
    for fusions in (True, False):  # the fusions drop the unused initializer: still named
        with pytest.raises(TrainingGraphError, match="parameter 'unused.weight' does not affect the loss 'loss': nothing reads it"):
            build_training_graph(ir.from_proto(proto), params=["fc1.weight", "unused.weight"], ort_fusions=fusions)


def test_gradient_build_without_ort_fusions_keeps_the_exported_ops():
    module, args, names = _mlp_case()
    training = build_training_graph(export(module, args, input_names=names), ort_fusions=False)
    ops = {(n.domain, n.op_type) for n in training.graph}
    assert ("", "Erf") in ops and ("com.microsoft", "Gelu") not in ops
    check_parity(module, args, training, input_names=names).assert_ok()


def test_build_training_graph_pass_refuses_a_training_graph():
    from ortpass.passes import BuildTrainingGraphPass

    module, args, names = _mlp_case()
    forward = export(module, args, input_names=names)
    build = BuildTrainingGraphPass()
    result = build(forward)
    assert result.modified and result.model is not forward
    partition = get_partition(result.model)
    assert build.stats["counts"]["backward nodes"] == len(partition.backward)
    assert get_training_info(result.model).loss == "loss"
    with pytest.raises(ir.passes.PreconditionError, match="already a training graph"):
        BuildTrainingGraphPass()(result.model)


def test_training_graph_shapes_are_expressed_in_the_export_dims(tmp_path, monkeypatch):
    # Symbolic inference carries Reshape/Range-derived dims as batch/seq expressions;
    # onnx's own inference would leave fresh unk__N dims the memory analysis cannot bind.
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    module = GPTDecoder(vocab=16, hidden=16, heads=2, layers=1, max_seq=8, dropout=0.1)
    ids = torch.randint(0, 16, (2, 8))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}}
    training = build_training_graph(export(module, (ids, ids), input_names=["input_ids", "labels"], dynamic_axes=axes))
    partition = get_partition(training)
    unknown = [
        v.name
        for v in partition.stashed
        if v.shape is None or any(isinstance(d, ir.SymbolicDim) and str(d.value).startswith("unk__") for d in v.shape)
    ]
    assert not unknown
    softmax = next(n for n in training.graph if n.op_type == "Softmax")
    assert [str(d) for d in softmax.outputs[0].shape] == ["batch", "2", "seq", "seq"]
    assert list(tmp_path.iterdir()) == []  # ORT's wrapper would have left sym_shape_infer_temp.onnx here


def _decoder_forward(dynamic_axes=None) -> ir.Model:
    torch.manual_seed(0)
    module = GPTDecoder(vocab=16, hidden=16, heads=2, layers=2, max_seq=8, dropout=0.1)
    ids = torch.randint(0, 16, (2, 8))
    return export(module, (ids, ids), input_names=["input_ids", "labels"], dynamic_axes=dynamic_axes)


def test_a_static_forward_gets_onnx_inference_and_the_same_training_graph(monkeypatch):
    """Every dim static: onnx's shape inference stands in for ORT's symbolic one (a tenth
    of the time) and the training graph comes out byte for byte the same."""
    from ortpass.training import build, shapes

    forward = _decoder_forward()
    proto = ir.to_proto(forward)
    build.clamp_for_ort(proto)
    assert shapes._infer_static_shapes(proto) is not None
    fast = ir.to_proto(build_training_graph(forward)).SerializeToString()
    monkeypatch.setattr(shapes, "_infer_static_shapes", lambda proto: None)
    symbolic = ir.to_proto(build_training_graph(forward)).SerializeToString()
    assert fast == symbolic


def test_a_forward_with_a_dim_onnx_cannot_tell_keeps_the_symbolic_inference():
    from ortpass.training import shapes

    axes = {"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}}
    dynamic = ir.to_proto(_decoder_forward(axes))
    assert shapes._infer_static_shapes(dynamic) is None
    # A static graph with an op onnx has no rule for: its output's shape stays unknown.
    unknown_op = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Mystery", ["x"], ["y"], domain="custom.ops"), onnx.helper.make_node("Relu", ["y"], ["z"])],
            "g",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
            [onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2, 3])],
        ),
        opset_imports=[onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("custom.ops", 1)],
    )
    assert shapes._infer_static_shapes(unknown_op) is None


@pytest.mark.slow
def test_the_training_graph_is_the_same_whatever_python_hashes(tmp_path):
    """ORT's gradient builder emits gradients in the order of a set of names, which follows
    Python's string hashing (PYTHONHASHSEED): the build must not pass that on."""
    import subprocess
    import sys

    script = (
        "import sys, onnx_ir as ir\n"
        "from ortpass.training import build_training_graph\n"
        "ir.save(build_training_graph(ir.load('golden_models/mlp.onnx')), sys.argv[1])\n"
    )
    built = []
    for seed in ("1", "2"):
        path = tmp_path / f"mlp_{seed}.onnx"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", script, str(path)], check=True, env=env, cwd=REPO_ROOT)
        built.append(path.read_bytes())
    assert built[0] == built[1]
    outputs = [o.name for o in onnx.load_from_string(built[0]).graph.output]
    params = get_training_info(ir.from_proto(onnx.load_from_string(built[0]))).params
    assert outputs == ["loss", *(f"{p}_grad" for p in params)]


def test_concat_training_lengths_get_a_shape():
    """ORT's fusions replace Concat by com.microsoft::ConcatTraining, whose second output
    (one int64 length per input) onnx's inference cannot shape; the build gives it one, so
    the recompute analysis can size it."""
    import onnx.helper as oh

    w = [onnx.numpy_helper.from_array(np.full((4, 4), 0.1 * (i + 1), np.float32), f"w{i}") for i in range(3)]
    nodes = [oh.make_node("MatMul", ["x", f"w{i}"], [f"h{i}"], name=f"mm{i}") for i in range(3)]
    nodes += [
        oh.make_node("Concat", ["h0", "h1", "h2"], ["c"], name="concat", axis=1),
        oh.make_node("ReduceSum", ["c"], ["loss"], name="sum", keepdims=0),
    ]
    graph = oh.make_graph(
        nodes, "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [oh.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])], w,
    )
    forward = ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=9))
    training = build_training_graph(forward, params=["w0", "w1", "w2"], loss="loss")
    (concat,) = [n for n in training.graph if n.op_type == "ConcatTraining"]
    lengths = concat.outputs[1]
    assert lengths.dtype == ir.DataType.INT64 and list(lengths.shape) == [3]
