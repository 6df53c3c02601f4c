"""InsertGatherBeforeSceLossPass: ORT's InsertGatherBeforeSceLoss cases, both directions, and
numerical parity on ONNX Runtime (loss and gradients) between the original and rewritten graphs."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto

from ortpass.conventions import CREATED_BY_KEY, PRINT_DENSITY_ENV
from ortpass.ops.density_flag import FLAG_FUNC_NAME
from ortpass.passes.insert_gather_before_sce_loss import InsertGatherBeforeSceLossPass
from ortpass.runtime import TrainingSession
from ortpass.training import build_training_graph

IGNORE = -100


def sce_model(
    *,
    op: str = "onnx",
    opset: int = 17,
    rows: int = 32,
    classes: int = 256,
    hidden: int = 8,
    reduction: str | None = "mean",
    ignore_index: int | None = IGNORE,
    ignore_index_source: str = "initializer",
    flag: bool = True,
    reshape: bool = False,
    log_prob: str = "unused",
    labels_dtype: int = TensorProto.INT64,
    logits_dims: list | None = None,
    projection: str = "matmul",
    bias_dims: list | None = None,
) -> ir.Model:
    """logits = MatMul(x, W); loss = SCE(logits, [Reshape](PythonOp flag)(labels)).

    ``log_prob``: "absent" (one output), "unused", "consumed" (by an Identity) or "output".
    ``ignore_index_source`` (Internal op only): "initializer", "constant" (a Constant node)
    or "input" (a graph input, not known at rewrite time).
    """
    logits_dims = logits_dims or [rows, classes]
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((hidden, classes)).astype(np.float32)
    initializers = [oh.make_tensor("W", TensorProto.FLOAT, [hidden, classes], weights.ravel())]
    if projection == "matmul":
        nodes = [oh.make_node("MatMul", ["x", "W"], ["logits"], name="matmul")]
    else:  # "gemm", or "gemm-transA" (x given as [hidden, rows])
        gemm_inputs = ["x", "W"]
        if bias_dims is not None:
            bias = rng.standard_normal(bias_dims).astype(np.float32)
            initializers.append(oh.make_tensor("bias", TensorProto.FLOAT, bias_dims, bias.ravel()))
            gemm_inputs.append("bias")
        nodes = [oh.make_node("Gemm", gemm_inputs, ["logits"], name="matmul", transA=int(projection == "gemm-transA"))]
    inputs = [
        oh.make_tensor_value_info(
            "x", TensorProto.FLOAT, [hidden, rows] if projection == "gemm-transA" else [*logits_dims[:-1], hidden]
        ),
        oh.make_tensor_value_info("labels", labels_dtype, [rows]),
    ]
    outputs = [oh.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    value_info = [oh.make_tensor_value_info("logits", TensorProto.FLOAT, logits_dims)]
    label = "labels"
    if flag:
        nodes.append(
            oh.make_node(
                "PythonOp",
                [label],
                ["labels_flagged_ctx", "labels_flagged"],
                domain="com.microsoft",
                name="flag",
                func_name=FLAG_FUNC_NAME,
                input_convention="dcc",
                training_mode=1,
                input_int_scalars=[IGNORE],
                input_int_scalar_positions=[1],
                input_float_scalars=[25.0],
                input_float_scalar_positions=[2],
            )
        )
        value_info.append(oh.make_tensor_value_info("labels_flagged", labels_dtype, [rows]))
        label = "labels_flagged"
    if reshape:
        initializers.append(oh.make_tensor("label_shape", TensorProto.INT64, [1], [-1]))
        nodes.append(oh.make_node("Reshape", [label, "label_shape"], ["labels_reshaped"], name="reshape"))
        value_info.append(oh.make_tensor_value_info("labels_reshaped", labels_dtype, [rows]))
        label = "labels_reshaped"

    loss_outputs = ["loss"] if log_prob == "absent" else ["loss", "log_prob"]
    attrs = {} if reduction is None else {"reduction": reduction}
    if op == "onnx":
        if ignore_index is not None:
            attrs["ignore_index"] = ignore_index
        nodes.append(oh.make_node("SoftmaxCrossEntropyLoss", ["logits", label], loss_outputs, name="sce", **attrs))
    else:
        loss_inputs = ["logits", label]
        if ignore_index is not None:
            loss_inputs += ["", "ignore_index"]
            if ignore_index_source == "initializer":
                initializers.append(oh.make_tensor("ignore_index", TensorProto.INT64, [], [ignore_index]))
            elif ignore_index_source == "constant":
                value = oh.make_tensor("v", TensorProto.INT64, [], [ignore_index])
                nodes.insert(0, oh.make_node("Constant", [], ["ignore_index"], name="ignore_const", value=value))
            else:
                inputs.append(oh.make_tensor_value_info("ignore_index", TensorProto.INT64, []))
        nodes.append(
            oh.make_node(
                "SoftmaxCrossEntropyLossInternal", loss_inputs, loss_outputs, name="sce", domain="com.microsoft", **attrs
            )
        )
    if log_prob == "consumed":
        nodes.append(oh.make_node("Identity", ["log_prob"], ["log_prob_copy"], name="use_log_prob"))
        outputs.append(oh.make_tensor_value_info("log_prob_copy", TensorProto.FLOAT, logits_dims))
    elif log_prob == "output":
        outputs.append(oh.make_tensor_value_info("log_prob", TensorProto.FLOAT, logits_dims))

    graph = oh.make_graph(nodes, "sce_graph", inputs, outputs, initializers, value_info=value_info)
    opsets = [oh.make_opsetid("", opset), oh.make_opsetid("com.microsoft", 1)]
    return ir.from_proto(oh.make_model(graph, opset_imports=opsets, ir_version=8))


def loss_node(model: ir.Model) -> ir.Node:
    (node,) = [n for n in model.graph if n.op_type.startswith("SoftmaxCrossEntropyLoss")]
    return node


def op_types(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def serialized(model: ir.Model) -> bytes:
    return ir.to_proto(model).SerializeToString()


# -- the rewrite ------------------------------------------------------------------------------
def test_allowed_case_inserts_sub_nonzero_squeeze_and_two_gathers():
    """ORT's allowed case: logits [32,256], labels [32], ignore -100, mean."""
    model = sce_model()
    pass_ = InsertGatherBeforeSceLossPass()
    result = pass_(model)

    assert result.modified
    assert op_types(model) == [
        "MatMul", "Constant", "Sub", "NonZero", "Constant", "Squeeze", "ShrunkenGather", "ShrunkenGather",
        "SoftmaxCrossEntropyLoss",
    ]  # fmt: skip
    loss = loss_node(model)
    gathered_logits, gathered_labels = loss.inputs[0].producer(), loss.inputs[1].producer()
    assert (gathered_logits.domain, gathered_labels.domain) == ("com.microsoft", "com.microsoft")
    assert gathered_logits.inputs[0].name == "logits"
    # The flag is gone: the gather and the Sub read the label input itself.
    assert gathered_labels.inputs[0].name == "labels"
    indices = gathered_logits.inputs[1]
    assert indices is gathered_labels.inputs[1]
    squeeze = indices.producer()
    nonzero = squeeze.inputs[0].producer()
    sub = nonzero.inputs[0].producer()
    assert sub.inputs[0].name == "labels"
    assert ir.convenience.get_const_tensor(sub.inputs[1]).numpy().item() == IGNORE
    # A new named dim counts the valid labels, on the indices and both gathered values.
    assert str(indices.shape) == "[valid_label_count_0]"
    assert list(gathered_logits.outputs[0].shape) == [ir.SymbolicDim("valid_label_count_0"), 256]
    assert str(gathered_labels.outputs[0].shape) == "[valid_label_count_0]"
    assert all(n.metadata_props.get(CREATED_BY_KEY) == "insert-gather-before-sce-loss" for n in (sub, squeeze))
    assert pass_.stats["counts"]["losses rewritten"] == 1
    assert pass_.stats["counts"]["gathers inserted"] == 2
    assert pass_.stats["counts"]["flags removed"] == 1
    (note,) = pass_.stats["notes"]["rewritten"]
    assert note == {"node": "sce", "op": "SoftmaxCrossEntropyLoss", "valid_dim": "valid_label_count_0", "export_density": 25.0}
    onnx.checker.check_model(ir.to_proto(model))


def test_second_run_changes_nothing():
    model = sce_model()
    InsertGatherBeforeSceLossPass()(model)
    before = serialized(model)
    again = InsertGatherBeforeSceLossPass()
    assert not again(model).modified
    assert serialized(model) == before
    assert again.stats["notes"]["skipped"][0]["reason"].startswith("already rewritten")


def test_second_run_with_force_changes_nothing():
    model = sce_model()
    InsertGatherBeforeSceLossPass(force=True)(model)
    before = serialized(model)
    assert not InsertGatherBeforeSceLossPass(force=True)(model).modified
    assert serialized(model) == before


def test_label_through_reshape_is_recognized():
    model = sce_model(reshape=True)
    assert InsertGatherBeforeSceLossPass()(model).modified
    assert "Reshape" in op_types(model) and "PythonOp" not in op_types(model)
    gathered_labels = loss_node(model).inputs[1].producer()
    assert gathered_labels.op_type == "ShrunkenGather"
    assert gathered_labels.inputs[0].name == "labels_reshaped"


@pytest.mark.parametrize("opset", range(12, 22))
def test_every_opset_from_12_to_21(opset):
    model = sce_model(opset=opset)
    assert InsertGatherBeforeSceLossPass()(model).modified
    squeeze = next(n for n in model.graph if n.op_type == "Squeeze")
    if opset < 13:
        assert list(squeeze.attributes["axes"].value) == [0] and len(squeeze.inputs) == 1
    else:
        assert "axes" not in squeeze.attributes
        assert ir.convenience.get_const_tensor(squeeze.inputs[1]).numpy().tolist() == [0]
    onnx.checker.check_model(ir.to_proto(model))


@pytest.mark.parametrize("source", ["initializer", "constant"])
def test_internal_loss_with_constant_ignore_index(source):
    model = sce_model(op="internal", ignore_index_source=source)
    pass_ = InsertGatherBeforeSceLossPass()
    assert pass_(model).modified
    assert op_types(model).count("ShrunkenGather") == 2
    assert pass_.stats["notes"]["rewritten"][0]["op"] == "SoftmaxCrossEntropyLossInternal"


def test_int32_labels_get_an_int32_ignore_index():
    # The Internal op's ignore_index input is int64 whatever the labels are; Sub needs both alike.
    model = sce_model(op="internal", labels_dtype=TensorProto.INT32)
    assert InsertGatherBeforeSceLossPass()(model).modified
    sub = next(n for n in model.graph if n.op_type == "Sub")
    assert ir.convenience.get_const_tensor(sub.inputs[1]).dtype == ir.DataType.INT32


def test_force_applies_without_a_flag():
    model = sce_model(flag=False)
    assert InsertGatherBeforeSceLossPass(force=True)(model).modified
    assert op_types(model).count("ShrunkenGather") == 2


def test_two_losses_on_one_label_get_distinct_dims_and_names():
    model = sce_model()
    flagged = model.graph.node("flag").outputs[1]
    logits = model.graph.node("matmul").outputs[0]
    second = ir.Node(
        "", "SoftmaxCrossEntropyLoss", [logits, flagged], {"reduction": ir.AttrString("reduction", "sum"),
        "ignore_index": ir.AttrInt64("ignore_index", IGNORE)}, num_outputs=1, name="sce_2",
    )  # fmt: skip
    second.outputs[0].name = "loss_2"
    second.outputs[0].dtype, second.outputs[0].shape = ir.DataType.FLOAT, ir.Shape([])
    model.graph.append(second)
    model.graph.outputs.append(second.outputs[0])
    pass_ = InsertGatherBeforeSceLossPass()
    assert pass_(model).modified
    assert pass_.stats["counts"]["losses rewritten"] == 2
    assert [r["valid_dim"] for r in pass_.stats["notes"]["rewritten"]] == ["valid_label_count_0", "valid_label_count_1"]
    onnx.checker.check_model(ir.to_proto(model))  # value names stay unique


# -- where it must not fire ---------------------------------------------------------------------
SKIPS = {
    "reduction none": (dict(reduction="none"), "reduction is 'none'"),
    "ignore_index missing": (dict(ignore_index=None), "ignore_index attribute is missing"),
    "log_prob consumed": (dict(log_prob="consumed"), "is consumed by"),
    "log_prob graph output": (dict(log_prob="output"), "is a graph output"),
    "logits rank 3": (dict(logits_dims=[4, 8, 256]), "logits rank 3"),
    "internal without ignore_index": (dict(op="internal", ignore_index=None), "input 3) is missing"),
    "internal ignore_index not constant": (dict(op="internal", ignore_index_source="input"), "is not a constant"),
}


@pytest.mark.parametrize("case", SKIPS)
def test_skips_loss_and_says_why(case):
    kwargs, reason = SKIPS[case]
    model = sce_model(**kwargs)
    loss_inputs = [v.name for v in loss_node(model).inputs if v is not None]
    pass_ = InsertGatherBeforeSceLossPass()
    pass_(model)

    assert "ShrunkenGather" not in op_types(model)
    assert "NonZero" not in op_types(model)
    (skipped,) = pass_.stats["notes"]["skipped"]
    assert reason in skipped["reason"]
    # The flag was only a hint: it goes even where the loss stays, and the loss reads the label.
    assert "PythonOp" not in op_types(model)
    assert [v.name for v in loss_node(model).inputs if v is not None] == [
        "labels" if name == "labels_flagged" else name for name in loss_inputs
    ]


@pytest.mark.parametrize("case", SKIPS)
def test_skipped_loss_with_flags_kept_is_untouched(case):
    model = sce_model(**SKIPS[case][0])
    loss_inputs = [v.name for v in loss_node(model).inputs if v is not None]
    InsertGatherBeforeSceLossPass(keep_flag_for_printing=True)(model)
    assert {"ShrunkenGather", "NonZero", "Sub"}.isdisjoint(op_types(model))
    assert "PythonOp" in op_types(model)
    assert [v.name for v in loss_node(model).inputs if v is not None] == loss_inputs


def test_no_flag_leaves_graph_unchanged():
    model = sce_model(flag=False)
    before = serialized(model)
    pass_ = InsertGatherBeforeSceLossPass()
    assert not pass_(model).modified
    assert serialized(model) == before
    assert "not flagged" in pass_.stats["notes"]["skipped"][0]["reason"]


def test_flag_with_a_different_func_name_is_not_a_flag():
    model = sce_model()
    model.graph.node("flag").attributes["func_name"] = ir.AttrString("func_name", "mypkg.SomeOtherFunction")
    before = serialized(model)
    assert not InsertGatherBeforeSceLossPass()(model).modified
    assert serialized(model) == before


def test_shapes_missing_from_the_graph_are_inferred_on_a_copy():
    model = sce_model(reshape=True)
    model.graph.node("reshape").outputs[0].shape = None
    model.graph.node("matmul").outputs[0].shape = None
    pass_ = InsertGatherBeforeSceLossPass()
    assert pass_(model).modified
    assert str(loss_node(model).inputs[0].shape) == "[valid_label_count_0,256]"
    # The inference ran on a copy: values the pass did not create keep their (missing) shape.
    assert model.graph.node("reshape").outputs[0].shape is None


def test_unknown_logits_rank_is_skipped():
    model = sce_model()
    model.graph.inputs[0].shape = None  # x: so nothing can tell the rank of MatMul's output
    model.graph.node("matmul").outputs[0].shape = None
    pass_ = InsertGatherBeforeSceLossPass()
    pass_(model)
    assert "ShrunkenGather" not in op_types(model)
    assert "rank unknown (logits rank None, labels rank 1)" in pass_.stats["notes"]["skipped"][0]["reason"]


# -- density printing keeps the flag --------------------------------------------------------------
def test_printing_keeps_the_flag_in_front_of_the_gather():
    model = sce_model()
    pass_ = InsertGatherBeforeSceLossPass(keep_flag_for_printing=True)
    assert pass_(model).modified
    flag = model.graph.node("flag")
    gathered_labels = loss_node(model).inputs[1].producer()
    assert gathered_labels.inputs[0] is flag.outputs[1]
    assert "flags removed" not in pass_.stats["counts"]
    assert flag.attributes["training_mode"].value == 0  # integer labels: no backward, no ctx


def test_printing_leaves_training_mode_of_a_flag_over_floats():
    model = sce_model()
    flag = model.graph.node("flag")
    flag.attributes["training_mode"] = ir.AttrInt64("training_mode", 1)
    flag.inputs[0].dtype = ir.DataType.FLOAT  # not a label: gradients may flow through it
    InsertGatherBeforeSceLossPass(keep_flag_for_printing=True)(model)
    assert flag.attributes["training_mode"].value == 1


def test_print_env_variable_keeps_the_flag(monkeypatch):
    monkeypatch.setenv(PRINT_DENSITY_ENV, "1")
    assert InsertGatherBeforeSceLossPass().keep_flag_for_printing
    monkeypatch.setenv(PRINT_DENSITY_ENV, "0")
    assert not InsertGatherBeforeSceLossPass().keep_flag_for_printing
    # An explicit option wins over the environment.
    monkeypatch.setenv(PRINT_DENSITY_ENV, "1")
    assert not InsertGatherBeforeSceLossPass(keep_flag_for_printing=False).keep_flag_for_printing


# -- numerical parity on ONNX Runtime ---------------------------------------------------------------
def padded_batch(rows: int, hidden: int, classes: int, density: int, seed: int = 1, dtype=np.int64) -> dict:
    """A batch whose labels are valid at ``density`` percent of the rows, ignore_index elsewhere."""
    rng = np.random.default_rng(seed)
    labels = np.full(rows, IGNORE, dtype=dtype)
    valid = rng.choice(rows, size=rows * density // 100, replace=False)
    labels[valid] = rng.integers(0, classes, size=valid.size)
    return {"x": rng.standard_normal((rows, hidden)).astype(np.float32), "labels": labels}


def forward_loss(model: ir.Model, batch: dict) -> float:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(serialized(model), options, providers=["CPUExecutionProvider"])
    return float(session.run(["loss"], batch)[0])


@pytest.mark.parametrize("opset", range(12, 22))
def test_forward_loss_unchanged_on_ort_at_every_opset(opset):
    shape = dict(rows=32, classes=256, hidden=8)
    original = sce_model(opset=opset, flag=False, **shape)
    rewritten = sce_model(opset=opset, **shape)
    InsertGatherBeforeSceLossPass()(rewritten)
    batch = padded_batch(32, 8, 256, density=25)
    np.testing.assert_allclose(forward_loss(rewritten, batch), forward_loss(original, batch), rtol=1e-5)


@pytest.mark.parametrize("move", [False, True], ids=["before-loss", "above-projection"])
@pytest.mark.parametrize("op", ["onnx", "internal"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("density", [10, 50, 100])
def test_loss_and_gradients_equal_the_original_on_ort(op, reduction, density, move):
    shape = dict(rows=40, classes=16, hidden=8)
    original = sce_model(op=op, reduction=reduction, flag=False, **shape)
    rewritten = sce_model(op=op, reduction=reduction, **shape)
    assert InsertGatherBeforeSceLossPass(move_above_projection=move)(rewritten).modified
    gathered = sorted(n.inputs[0].name for n in rewritten.graph if n.op_type == "ShrunkenGather")
    assert gathered == (["labels", "x"] if move else ["labels", "logits"])
    batch = padded_batch(40, 8, 16, density)

    expected = TrainingSession(build_training_graph(original, params=["W"])).run(batch)
    training = build_training_graph(rewritten, params=["W"])
    assert [n.op_type for n in training.graph].count("ShrunkenGather") == 2
    actual = TrainingSession(training).run(batch)

    np.testing.assert_allclose(actual.loss, expected.loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(actual.gradients["W"], expected.gradients["W"], rtol=1e-5, atol=1e-6)
    # The ignored rows really were ignored: the gradient is not trivially zero.
    assert np.abs(expected.gradients["W"]).max() > 1e-3


def test_int32_labels_run_on_ort():
    shape = dict(op="internal", rows=40, classes=16, hidden=8, labels_dtype=TensorProto.INT32)
    original = sce_model(flag=False, **shape)
    rewritten = sce_model(**shape)
    InsertGatherBeforeSceLossPass()(rewritten)
    batch = padded_batch(40, 8, 16, density=50, dtype=np.int32)
    np.testing.assert_allclose(forward_loss(rewritten, batch), forward_loss(original, batch), rtol=1e-5)


# -- moving the logits' gather above the projection ---------------------------------------------------
def gathered_inputs(model: ir.Model) -> list[str]:
    return sorted(n.inputs[0].name for n in model.graph if n.op_type == "ShrunkenGather")


@pytest.mark.parametrize(
    "projection, bias_dims", [("matmul", None), ("gemm", None), ("gemm", [256]), ("gemm", [1, 256])]
)
def test_gather_moves_above_a_row_wise_projection(projection, bias_dims):
    model = sce_model(projection=projection, bias_dims=bias_dims)
    pass_ = InsertGatherBeforeSceLossPass(move_above_projection=True)
    assert pass_(model).modified
    assert gathered_inputs(model) == ["labels", "x"]
    assert pass_.stats["counts"]["gathers moved above the projection"] == 1
    projection_node = loss_node(model).inputs[0].producer()
    assert projection_node.op_type == ("MatMul" if projection == "matmul" else "Gemm")
    assert str(projection_node.inputs[0].shape) == "[valid_label_count_0,8]"
    onnx.checker.check_model(ir.to_proto(model))
    before = serialized(model)
    assert not InsertGatherBeforeSceLossPass(move_above_projection=True)(model).modified
    assert serialized(model) == before


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(projection="gemm", bias_dims=[32, 256]),  # a bias that differs per row
        dict(projection="gemm-transA", bias_dims=[256]),  # rows of the product are columns of x
    ],
    ids=["per-row-bias", "transA"],
)
def test_gather_stays_below_a_projection_that_mixes_rows(kwargs):
    model = sce_model(**kwargs)
    assert InsertGatherBeforeSceLossPass(move_above_projection=True)(model).modified
    assert gathered_inputs(model) == ["labels", "logits"]


def test_gather_stays_below_a_projection_whose_output_is_used_elsewhere():
    model = sce_model()
    logits = model.graph.node("matmul").outputs[0]
    model.graph.outputs.append(logits)
    assert InsertGatherBeforeSceLossPass(move_above_projection=True)(model).modified
    assert gathered_inputs(model) == ["labels", "logits"]


@pytest.mark.parametrize("density", [10, 100])
def test_gemm_with_bias_above_projection_matches_on_ort(density):
    shape = dict(rows=40, classes=16, hidden=8, projection="gemm", bias_dims=[16])
    original = sce_model(flag=False, **shape)
    rewritten = sce_model(**shape)
    InsertGatherBeforeSceLossPass(move_above_projection=True)(rewritten)
    assert gathered_inputs(rewritten) == ["labels", "x"]
    batch = padded_batch(40, 8, 16, density)
    params = ["W", "bias"]
    expected = TrainingSession(build_training_graph(original, params=params)).run(batch)
    actual = TrainingSession(build_training_graph(rewritten, params=params)).run(batch)
    np.testing.assert_allclose(actual.loss, expected.loss, rtol=1e-5, atol=1e-6)
    for name in params:
        np.testing.assert_allclose(actual.gradients[name], expected.gradients[name], rtol=1e-5, atol=1e-6)


def test_ortmodule_flag_is_recognized_too():
    model = sce_model()
    func_name = "onnxruntime.training.ortmodule._runtime_inspector.FlagAndPrintDensity"
    model.graph.node("flag").attributes["func_name"] = ir.AttrString("func_name", func_name)
    assert InsertGatherBeforeSceLossPass()(model).modified
    assert "PythonOp" not in op_types(model) and op_types(model).count("ShrunkenGather") == 2


def test_runs_from_a_pipeline_string_with_its_options():
    import ortpass

    model = sce_model(flag=False)
    result = ortpass.pipeline("insert-gather-before-sce-loss(force=True, move_above_projection=True)")(model)
    assert gathered_inputs(result.model) == ["labels", "x"]


def test_flag_shape_inferer_is_known_without_torch():
    # A process that only loads a saved model must still give the flag its label's shape.
    import subprocess
    import sys

    code = (
        "import sys, ortpass.passes\n"
        "from ortpass.pythonop.shape_inference import get_shape_inferer\n"
        "from ortpass.ops.density_flag import FLAG_FUNC_NAMES\n"
        "assert all(get_shape_inferer(n) is not None for n in FLAG_FUNC_NAMES)\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
