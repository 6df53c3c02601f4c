"""Recompute candidate detection (issue 6) on hand-built training graphs whose answer is known.

Each graph is a few forward nodes plus backward nodes that read exactly the values the case
needs stashed (the backward op types do not matter to the analysis, only which forward
values they read).  Sizes: batch is a dim param, evaluated at batch=8 unless said otherwise.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest

from ortpass.analysis import (
    PlanType,
    find_recompute_candidates,
    register_recomputable_function,
)
from ortpass.analysis.memory import evaluate
from ortpass.analysis.partition import TrainingInfo, set_training_info, tag
from ortpass.analysis.recomputable_ops import (
    ProbeLevel,
    is_recomputable,
    unregister_recomputable_function,
)
from ortpass.errors import TrainingGraphError

F32, F16, I64, BOOL = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.INT64, onnx.TensorProto.BOOL


def _vi(name, dtype, shape):
    return oh.make_tensor_value_info(name, dtype, shape)


def training_graph(forward, backward, inputs, value_infos, initializers=(), opset=17):
    """A training graph: ``forward``/``backward`` are onnx NodeProtos, tagged by side."""
    outputs = [o for n in backward for o in n.output]
    graph = oh.make_graph(
        list(forward) + list(backward),
        "train",
        inputs,
        [oh.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in outputs],
        list(initializers),
        value_info=value_infos,
    )
    proto = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", opset), oh.make_opsetid("com.microsoft", 1)], ir_version=8
    )
    model = ir.from_proto(proto)
    backward_names = {n.name for n in backward}
    for node in model.graph:
        tag(node, "backward" if node.name in backward_names else "forward")
    set_training_info(model, TrainingInfo(loss="loss", params=(), gradients={}))
    return model


def bw(name, *reads):
    """A backward node reading ``reads``."""
    return oh.make_node("Concat", list(reads), [f"{name}_out"], name=name, axis=0)


def analyse(model, **kwargs):
    kwargs.setdefault("min_elements", 0)
    kwargs.setdefault("dims", {"batch": 8})
    return find_recompute_candidates(model, **kwargs)


def gelu_model():
    forward = [oh.make_node("Gelu", ["x"], ["h"], name="gelu", domain="com.microsoft")]
    return training_graph(
        forward, [bw("gelu_grad", "h")], [_vi("x", F32, ["batch", 64])], [_vi("h", F32, ["batch", 64])]
    )


def test_stashed_gelu_gives_gelu_plan_with_frequency_one():
    report = analyse(gelu_model())
    assert [p.plan_string for p in report.plans] == ["Gelu+:1:-1"]
    plan = report.plans[0]
    assert plan.frequency == 1
    assert plan.saving_bytes == 8 * 64 * 4
    occ = plan.occurrences[0]
    assert [n.name for n in occ.nodes] == ["gelu"]
    assert [v.name for v in occ.stashed] == ["h"]
    assert [v.name for v in occ.boundary] == ["x"]  # the clone reads the graph input


def test_expand_tile_chain_is_one_cluster():
    shape = oh.make_tensor("shape", I64, [3], [1, 4, 64])
    repeats = oh.make_tensor("repeats", I64, [3], [1, 2, 1])
    forward = [
        oh.make_node("Expand", ["x", "shape"], ["e"], name="expand"),
        oh.make_node("Tile", ["e", "repeats"], ["t"], name="tile"),
    ]
    model = training_graph(
        forward,
        [bw("tile_grad", "t")],
        [_vi("x", F32, ["batch", 1, 64])],
        [_vi("e", F32, ["batch", 4, 64]), _vi("t", F32, ["batch", 8, 64])],
        [shape, repeats],
    )
    report = analyse(model)
    assert [p.plan_string for p in report.plans] == ["Expand+Tile+:1:-1"]
    occ = report.plans[0].occurrences[0]
    assert [n.name for n in occ.nodes] == ["expand", "tile"]
    assert report.plans[0].saving_bytes == 8 * 8 * 64 * 4


def matmul_transpose_reshape_model(backward_reads_transpose=False, computed_shape=False):
    """x @ W -> Transpose -> Reshape(shape); ``computed_shape``: the shape is
    ``Concat(Unsqueeze(Gather(Shape(x), 0)), [-1])``, as torch exports ``t.reshape(b, -1)``."""
    w = oh.make_tensor("W", F32, [64, 64], np.zeros(64 * 64, np.float32))
    forward = [
        oh.make_node("MatMul", ["x", "W"], ["m"], name="matmul"),
        oh.make_node("Transpose", ["m"], ["t"], name="transpose", perm=[0, 2, 1]),
        oh.make_node("Reshape", ["t", "shape"], ["r"], name="reshape"),
    ]
    constants = [oh.make_tensor("shape", I64, [2], [0, -1])]
    if computed_shape:
        constants = [oh.make_tensor(n, I64, dims, vals) for n, dims, vals in
                     [("zero", [], [0]), ("axes", [1], [0]), ("minus_one", [1], [-1])]]
        forward[2:2] = [
            oh.make_node("Shape", ["x"], ["x_shape"], name="shape_of_x"),
            oh.make_node("Gather", ["x_shape", "zero"], ["b"], name="gather_batch", axis=0),
            oh.make_node("Unsqueeze", ["b", "axes"], ["b1"], name="unsqueeze_batch"),
            oh.make_node("Concat", ["b1", "minus_one"], ["shape"], name="concat_shape", axis=0),
        ]
    reads = ["r", "t"] if backward_reads_transpose else ["r"]
    return training_graph(
        forward,
        [bw("reshape_grad", *reads)],
        [_vi("x", F32, ["batch", 16, 64])],
        # The Reshape's output dims are anonymous: only its buffer (t) has a known size.
        [_vi("m", F32, ["batch", 16, 64]), _vi("t", F32, ["batch", 64, 16]), _vi("r", F32, [None, None])],
        [w, *constants],
    )


def test_matmul_transpose_reshape_is_found_with_saving_on_the_real_buffer():
    report = analyse(matmul_transpose_reshape_model())
    plan = report.plan("MatMul+Transpose+Reshape+")
    assert plan is not None and plan.frequency == 1
    # r is a view of t: the saving is t's buffer (batch*64*16 floats), though r's own
    # dims are unknown.
    assert plan.saving_bytes == 8 * 64 * 16 * 4
    assert [s.buffer.name for s in report.stashed] == ["t"]


def test_a_reshape_shape_computed_from_shape_ops_is_read_not_recomputed():
    # Following the shape input would reach Concat (not recomputable, not read by backward)
    # and fail the candidate even with no size floor; the clone reads the forward's shape.
    report = analyse(matmul_transpose_reshape_model(computed_shape=True), min_elements=0)
    plan = report.plan("MatMul+Transpose+Reshape+")
    assert plan is not None, report.to_table()
    (occ,) = plan.occurrences
    assert "shape" in [v.name for v in occ.boundary] and not occ.kept
    assert occ.saving_bytes == 8 * 64 * 16 * 4


def test_a_buffer_and_its_stashed_reshape_are_recomputed_together():
    report = analyse(matmul_transpose_reshape_model(backward_reads_transpose=True))
    # Recomputing the Reshape alone would free nothing (t stays alive for backward), so
    # no "Reshape+" plan: t and its view r form one candidate, t's buffer counted once.
    assert [p.plan_string for p in report.plans] == ["MatMul+Transpose+Reshape+:1:-1"]
    occ = report.plans[0].occurrences[0]
    assert [v.name for v in occ.stashed] == ["t", "r"] and occ.entry.name == "transpose"
    assert occ.saving_bytes == 8 * 64 * 16 * 4
    assert report.total_stashed_bytes == 8 * 64 * 16 * 4


def test_matmul_needs_the_advanced_probe_level():
    report = analyse(matmul_transpose_reshape_model(), probe_level=ProbeLevel.BASIC)
    assert report.plans == []
    (skip,) = report.skipped
    assert "matmul (MatMul) is not recomputable" in skip.reason


def test_two_stashed_views_of_one_buffer_are_one_candidate():
    forward = [
        oh.make_node("Gelu", ["x"], ["h"], name="gelu", domain="com.microsoft"),
        oh.make_node("Identity", ["h"], ["v1"], name="view1"),
        oh.make_node("Identity", ["h"], ["v2"], name="view2"),
    ]
    model = training_graph(
        forward,
        [bw("g1", "v1"), bw("g2", "v2")],
        [_vi("x", F32, ["batch", 64])],
        [_vi(n, F32, ["batch", 64]) for n in ("h", "v1", "v2")],
    )
    report = analyse(model)
    # h is freed only if both views are recomputed: one candidate covers both, and counts
    # h's buffer once.
    assert [p.plan_string for p in report.plans] == ["Gelu+Identity+Identity+:1:-1"]
    occ = report.plans[0].occurrences[0]
    assert [v.name for v in occ.stashed] == ["v1", "v2"] and occ.entry.name == "view1"
    assert occ.saving_bytes == 8 * 64 * 4
    assert report.total_stashed_bytes == 8 * 64 * 4  # one buffer, not two


def test_a_stashed_value_and_its_stashed_view_are_one_candidate():
    forward = [
        oh.make_node("Gelu", ["x"], ["h"], name="gelu", domain="com.microsoft"),
        oh.make_node("Reshape", ["h", "shape"], ["r"], name="reshape"),
    ]
    shape = oh.make_tensor("shape", I64, [1], [-1])
    model = training_graph(
        forward, [bw("g1", "h"), bw("g2", "r")], [_vi("x", F32, ["batch", 64])],
        [_vi("h", F32, ["batch", 64]), _vi("r", F32, [None])], [shape],
    )
    report = analyse(model)
    # Recomputing the Gelu alone would leave h alive through r: never "Gelu+" alone.
    assert [p.plan_string for p in report.plans] == ["Gelu+Reshape+:1:-1"]
    assert report.plans[0].saving_bytes == 8 * 64 * 4


def dropout_model(opset=17):
    ratio = oh.make_tensor("ratio", F32, [], [0.1])
    training = oh.make_tensor("training", BOOL, [], [True])
    forward = [oh.make_node("Dropout", ["x", "ratio", "training"], ["y", "mask"], name="dropout")]
    return training_graph(
        forward,
        [bw("dropout_grad", "y", "mask")],
        [_vi("x", F32, ["batch", 64])],
        [_vi("y", F32, ["batch", 64]), _vi("mask", BOOL, ["batch", 64])],
        [ratio, training],
        opset=opset,
    )


def test_dropout_is_recomputable_and_both_stashed_outputs_count():
    report = analyse(dropout_model())
    plan = report.plan("Dropout+")
    assert plan is not None
    occ = plan.occurrences[0]
    assert [v.name for v in occ.stashed] == ["y", "mask"]
    # ORT counts only one of the two outputs; both are freed: 4 + 1 bytes per element.
    assert plan.saving_bytes == 8 * 64 * (4 + 1)
    # ratio and training_mode are not followed: they are read, as they are, by the clone.
    assert {v.name for v in occ.boundary} == {"x", "ratio", "training"}


def mask_only_dropout_model(backward_reads_output):
    """Forward reads the Dropout's output (``Relu``, not recomputable, stands for a layer's
    checkpoint Add); backward reads the mask and, optionally, the output too."""
    ratio = oh.make_tensor("ratio", F32, [], [0.1])
    training = oh.make_tensor("training", BOOL, [], [True])
    forward = [
        oh.make_node("Dropout", ["x", "ratio", "training"], ["y", "mask"], name="dropout"),
        oh.make_node("Relu", ["y"], ["loss"], name="relu"),
    ]
    reads = ("y", "mask") if backward_reads_output else ("mask",)
    return training_graph(
        forward,
        [oh.make_node("Cast", list(reads[-1:]), ["mask_f"], name="cast", to=F32), bw("dropout_grad", "mask_f", *reads[:-1])],
        [_vi("x", F32, ["batch", 64])],
        [_vi("y", F32, ["batch", 64]), _vi("mask", BOOL, ["batch", 64]), _vi("loss", F32, ["batch", 64]),
         _vi("mask_f", F32, ["batch", 64])],
        [ratio, training],
    )


def test_a_dropout_recomputed_for_its_mask_alone_is_skipped():
    # The clone would compute y (4 bytes an element) for nobody, and ORT keeps a value
    # nobody reads until the step ends, to free a 1-byte mask.
    report = analyse(mask_only_dropout_model(backward_reads_output=False))
    assert report.plans == []
    (skip,) = report.skipped
    assert skip.entry.name == "dropout"
    assert "would compute 'y' for nobody" in skip.reason


def test_a_dropout_whose_output_backward_reads_too_is_recomputed():
    report = analyse(mask_only_dropout_model(backward_reads_output=True))
    assert report.plan("Dropout+").saving_bytes == 8 * 64 * (4 + 1)


def test_dropout_without_seed_attribute_opset_is_not_recomputable():
    report = analyse(dropout_model(opset=11))  # Dropout-10 has no seed: masks would differ
    assert report.plans == []


def non_recomputable_producer_model(backward_reads_relu):
    forward = [
        oh.make_node("Relu", ["x"], ["a"], name="relu"),
        oh.make_node("Gelu", ["a"], ["h"], name="gelu", domain="com.microsoft"),
    ]
    reads = [bw("gelu_grad", "h")] + ([bw("relu_grad", "a")] if backward_reads_relu else [])
    return training_graph(
        forward, reads, [_vi("x", F32, ["batch", 64])], [_vi("a", F32, ["batch", 64]), _vi("h", F32, ["batch", 64])]
    )


def test_non_recomputable_producer_not_read_by_backward_fails_the_candidate():
    report = analyse(non_recomputable_producer_model(backward_reads_relu=False))
    assert report.plans == []
    (skip,) = report.skipped
    assert skip.entry.name == "gelu"
    assert "relu (Relu) is not recomputable" in skip.reason


def test_producer_read_by_backward_is_a_boundary():
    report = analyse(non_recomputable_producer_model(backward_reads_relu=True))
    occ = report.plan("Gelu+").occurrences[0]
    assert [v.name for v in occ.boundary] == ["a"]


def cast_model(source, target, then_mul=False):
    forward = [
        oh.make_node("Relu", ["x"], ["a"], name="relu"),  # not recomputable, not stashed
        oh.make_node("Cast", ["a"], ["c"], name="cast", to=target),
    ]
    stashed = "c"
    infos = [_vi("a", source, ["batch", 64]), _vi("c", target, ["batch", 64])]
    if then_mul:
        forward.append(oh.make_node("Mul", ["c", "c"], ["m"], name="mul"))
        infos.append(_vi("m", target, ["batch", 64]))
        stashed = "m"
    return training_graph(forward, [bw("grad", stashed)], [_vi("x", source, ["batch", 64])], infos)


def test_cast_widening_to_the_stashed_value_gives_a_compromise_plan():
    # Walking up from the stashed fp32 value, the Cast narrows to fp16: keep the fp16 input
    # instead (ORT 1.19.2 reports `Cast+:2` at 50% for this; measured, see the benchmark).
    report = analyse(cast_model(F16, F32))
    assert report.plan("Cast+", 1) is None  # the full recompute fails at the Relu
    plan = report.plan("Cast+", 2)
    assert plan.type == PlanType.RECOMPUTE_WITH_COMPROMISE
    assert plan.saving_bytes == 8 * 64 * (4 - 2)
    assert [v.name for v in plan.occurrences[0].kept] == ["a"]


def test_compromise_cut_below_a_longer_subgraph():
    report = analyse(cast_model(F16, F32, then_mul=True))
    plan = report.plan("Cast+Mul+", 2)
    assert plan.saving_bytes == 8 * 64 * 4 - 8 * 64 * 2  # drop m (fp32), keep a (fp16)


def test_cast_whose_input_is_wider_gives_no_compromise():
    # Keeping the fp32 input of an fp32->fp16 Cast would hold more than the fp16 output.
    report = analyse(cast_model(F32, F16))
    assert report.plans == []


def test_symbolic_savings_at_the_dims_equal_the_byte_counts():
    for dims in ({"batch": 8}, {"batch": 3}, {"batch": 1024}):
        report = analyse(matmul_transpose_reshape_model(), dims=dims)
        for plan in report.plans:
            assert evaluate(plan.symbolic_saving, dims) == plan.saving_bytes
            for occ in plan.occurrences:
                assert evaluate(occ.symbolic_saving, dims) == occ.saving_bytes
        assert report.plans[0].saving_bytes == dims["batch"] * 64 * 16 * 4


def test_symbolic_only_without_dims_and_concrete_for_a_static_graph():
    report = find_recompute_candidates(gelu_model(), min_elements=0)
    assert report.dims is None and report.plans[0].saving_bytes is None
    assert str(report.plans[0].symbolic_saving) == "256*batch"
    assert any("symbolic only" in note for note in report.notes)

    forward = [oh.make_node("Gelu", ["x"], ["h"], name="gelu", domain="com.microsoft")]
    static = training_graph(forward, [bw("g", "h")], [_vi("x", F32, [4, 64])], [_vi("h", F32, [4, 64])])
    report = find_recompute_candidates(static, min_elements=0)
    assert report.dims == {} and report.dims_source == "static"
    assert report.plans[0].saving_bytes == 4 * 64 * 4


def test_small_static_tensors_are_below_the_default_floor():
    forward = [oh.make_node("Gelu", ["x"], ["h"], name="gelu", domain="com.microsoft")]
    static = training_graph(forward, [bw("g", "h")], [_vi("x", F32, [4, 64])], [_vi("h", F32, [4, 64])])
    report = find_recompute_candidates(static)
    assert report.plans == []
    assert "smaller than 1048576 elements" in report.skipped[0].reason
    big = training_graph(forward, [bw("g", "h")], [_vi("x", F32, [1024, 1024])], [_vi("h", F32, [1024, 1024])])
    assert [p.plan_string for p in find_recompute_candidates(big).plans] == ["Gelu+:1:-1"]


def rotary_like_model(neg_reads_new_value=False):
    """``out = ConcatTraining(-q2, q1) + q`` with ``q1, q2`` the halves of ``q`` (Slice): a
    rotary embedding's shape.  ``q`` and ``out`` are 1Mi elements, the halves 512Ki, under
    the default floor.  ``neg_reads_new_value``: ``-q2`` is ``Neg(Exp(x2))`` instead, from a
    small graph input through a value nothing keeps alive."""
    consts = [oh.make_tensor(name, I64, [1], [v]) for name, v in (("s0", 0), ("s1", 512), ("s2", 1024), ("ax", 1))]
    second_half = (
        [oh.make_node("Exp", ["x2"], ["e"], name="exp"), oh.make_node("Neg", ["e"], ["n"], name="neg")]
        if neg_reads_new_value
        else [oh.make_node("Slice", ["q", "s1", "s2", "ax"], ["q2"], name="slice2"),
              oh.make_node("Neg", ["q2"], ["n"], name="neg")]
    )  # fmt: skip
    forward = [
        oh.make_node("Gelu", ["x"], ["q"], name="gelu", domain="com.microsoft"),
        oh.make_node("Slice", ["q", "s0", "s1", "ax"], ["q1"], name="slice1"),
        *second_half,
        oh.make_node("ConcatTraining", ["n", "q1"], ["r"], name="concat", axis=1, domain="com.microsoft"),
        oh.make_node("Add", ["r", "q"], ["out"], name="add"),
    ]
    half, full = [1024, 512], [1024, 1024]
    return training_graph(
        forward,
        [bw("g", "out")],
        [_vi("x", F32, full), _vi("x2", F32, half)],
        [_vi("q", F32, full), _vi("q1", F32, half), _vi("q2", F32, half), _vi("e", F32, half),
         _vi("n", F32, half), _vi("r", F32, full), _vi("out", F32, full)],
        consts,
    )


def test_small_values_read_straight_off_the_subgraph_are_recomputed_not_kept():
    # The floor would keep a half and the other's negation (2 x 2 MiB, as much as the 4 MiB
    # freed: the candidate was skipped); their producers read only what the subgraph
    # computes, so they join it and nothing is kept.
    report = find_recompute_candidates(rotary_like_model())
    (occ,) = report.plans[0].occurrences
    assert {n.name for n in occ.nodes} == {"gelu", "slice1", "slice2", "neg", "concat", "add"}
    assert occ.kept == ()
    assert "q1" not in {v.name for v in occ.boundary}
    assert report.plans[0].saving_bytes == 1024 * 1024 * 4


def test_a_small_value_whose_producer_reads_a_new_value_stays_kept():
    report = find_recompute_candidates(rotary_like_model(neg_reads_new_value=True))
    (occ,) = report.plans[0].occurrences
    assert "neg" not in {n.name for n in occ.nodes} and "exp" not in {n.name for n in occ.nodes}
    assert [v.name for v in occ.kept] == ["n"]
    assert report.plans[0].saving_bytes == 1024 * 1024 * 4 - 1024 * 512 * 4


def test_subgraph_node_limit():
    forward = [oh.make_node("Add", ["x", "x"], ["a0"], name="add0")]
    infos = [_vi("a0", F32, ["batch", 64])]
    for i in range(1, 60):
        forward.append(oh.make_node("Add", [f"a{i-1}", "x"], [f"a{i}"], name=f"add{i}"))
        infos.append(_vi(f"a{i}", F32, ["batch", 64]))
    model = training_graph(forward, [bw("g", "a59")], [_vi("x", F32, ["batch", 64])], infos)
    report = analyse(model)
    assert report.plans == [] and "exceed 50 nodes" in report.skipped[0].reason
    report = analyse(model, max_nodes=60)
    assert report.plans[0].frequency == 1 and len(report.plans[0].occurrences[0].nodes) == 60


def test_pythonop_is_recomputable_only_when_its_function_is_registered():
    def model(func_name):
        node = oh.make_node(
            "PythonOp", ["x"], ["ctx", "y"], name="pyop", domain="com.microsoft", func_name=func_name,
            input_convention="d", input_tensor_types=[F32], input_tensor_ranks=[2],
            output_tensor_types=[F32], output_tensor_ranks=[2],
        )
        return training_graph(
            [node], [bw("pyop_grad", "y")], [_vi("x", F32, ["batch", 64])], [_vi("y", F32, ["batch", 64])]
        )

    flash = analyse(model("flash_attn.flash_attn_interface.FlashAttnFunc"))
    assert [p.plan_string for p in flash.plans] == ["PythonOp+:1:-1"]
    assert analyse(model("my.pkg.Attention")).plans == []
    register_recomputable_function("my.pkg.Attention")
    try:
        assert [p.plan_string for p in analyse(model("my.pkg.Attention")).plans] == ["PythonOp+:1:-1"]
    finally:
        unregister_recomputable_function("my.pkg.Attention")


def test_op_table_checks_the_schema_version_of_the_models_opset():
    gelu20 = oh.make_node("Gelu", ["x"], ["y"])
    node = ir.from_proto(oh.make_graph([gelu20], "g", [_vi("x", F32, [2])], [_vi("y", F32, [2])])).node(0)
    assert is_recomputable(node, {"": 20})
    dropout = ir.from_proto(
        oh.make_graph([oh.make_node("Dropout", ["x"], ["y"])], "g", [_vi("x", F32, [2])], [_vi("y", F32, [2])])
    ).node(0)
    assert is_recomputable(dropout, {"": 13}) and not is_recomputable(dropout, {"": 10})
    assert not is_recomputable(dropout, {"": 22})  # a newer schema nobody has checked yet


def test_analysis_never_changes_the_model():
    model = matmul_transpose_reshape_model()
    before = ir.to_proto(model).SerializeToString()
    report = analyse(model, probe_level=ProbeLevel.ADVANCED)
    report.to_table()
    report.to_dict()
    assert ir.to_proto(model).SerializeToString() == before


def test_report_table_json_and_selection():
    forward = [
        oh.make_node("Gelu", ["x"], ["h1"], name="gelu1", domain="com.microsoft"),
        oh.make_node("Gelu", ["h1"], ["h2"], name="gelu2", domain="com.microsoft"),
        oh.make_node("Relu", ["x"], ["a"], name="relu"),
        oh.make_node("Cast", ["a"], ["c"], name="cast", to=F32),
    ]
    model = training_graph(
        forward,
        [bw("g1", "h1"), bw("g2", "h2"), bw("g3", "c")],
        [_vi("x", F16, ["batch", 64])],
        [_vi("h1", F16, ["batch", 64]), _vi("h2", F16, ["batch", 64]), _vi("a", F16, ["batch", 64]), _vi("c", F32, ["batch", 64])],
    )
    report = analyse(model)
    # Sorted by saving: two Gelus (2 x 8*64*2) before the Cast compromise (8*64*2).
    assert [p.plan_string for p in report.plans] == ["Gelu+:1:-1", "Cast+:2:-1"]
    table = report.to_table(enabled="Gelu+:1:-1")
    gelu_row = next(line for line in table.splitlines() if "Gelu+:1:-1" in line)
    cast_row = next(line for line in table.splitlines() if "Cast+:2:-1" in line)
    assert " ON " in gelu_row and "2,048" in gelu_row and "256*batch" in gelu_row
    assert " OFF " in cast_row
    data = json.loads(json.dumps(report.to_dict()))
    assert data["plans"][0]["frequency"] == 2 and data["plans"][0]["occurrences"][1]["nodes"] == ["gelu2"]
    # Count N selects the last N occurrences in execution order.
    assert [o.entry.name for o in report.select("Gelu+:1:1")] == ["gelu2"]
    assert [o.entry.name for o in report.select(["Gelu+:1:-1", "Cast+:2:-1"])] == ["gelu1", "gelu2", "cast"]
    assert report.select("Softmax+:1:-1") == []  # matches nothing here


def test_not_a_training_graph_is_a_clear_error():
    proto = oh.make_model(
        oh.make_graph([oh.make_node("Relu", ["x"], ["y"])], "g", [_vi("x", F32, [2])], [_vi("y", F32, [2])])
    )
    with pytest.raises(TrainingGraphError, match="not a training graph"):
        find_recompute_candidates(ir.from_proto(proto))
    with pytest.raises(ValueError, match="probe_level"):
        find_recompute_candidates(gelu_model(), probe_level=2)
    with pytest.raises(ValueError, match="dims"):
        find_recompute_candidates(gelu_model(), dims={"batch": -1})


def test_timeline_before_and_after(tmp_path):
    from ortpass.analysis.recompute.timeline import memory_timeline

    report = analyse(gelu_model())
    timeline = memory_timeline(report, report.select("Gelu+:1:-1"))
    # Graph order: gelu (0), gelu_grad (1, backward).  h lives over both without
    # recompute; with it, h dies after its last forward reader (the Gelu itself, 0) and is
    # rebuilt just before its backward reader (1): the same two points stay live here, so
    # check the intervals on a graph with a forward gap instead.
    assert list(timeline.before) == [2048, 2048]

    forward = [
        oh.make_node("Gelu", ["x"], ["h"], name="gelu", domain="com.microsoft"),
        oh.make_node("Relu", ["h"], ["r1"], name="use"),
        oh.make_node("Relu", ["x"], ["r2"], name="other1"),
        oh.make_node("Relu", ["x"], ["r3"], name="other2"),
    ]
    model = training_graph(forward, [bw("g", "h")], [_vi("x", F32, ["batch", 64])], [_vi("h", F32, ["batch", 64])])
    report = analyse(model)
    timeline = memory_timeline(report, report.select("Gelu+:1:-1"))
    assert list(timeline.before) == [2048] * 5
    assert list(timeline.after) == [2048, 2048, 0, 0, 2048]
    path = report.plot(tmp_path / "timeline.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "domain, op, opset, expected",
    [
        ("", "Dropout", 13, [False, True]),  # the mask
        ("", "LayerNormalization", 17, [False, True, True]),  # Mean, InvStdDev
        ("com.microsoft", "BitmaskDropout", 1, [False, True]),
        ("", "BatchNormalization", 15, [False, False, False]),  # its outputs select training mode
        ("", "Split", 13, [False, False]),  # variadic: none is optional
        ("com.microsoft", "FusedMatMul", 1, [False]),  # unknown contrib schema: not optional
    ],
)
def test_which_outputs_are_optional(domain, op, opset, expected):
    from ortpass.analysis.recomputable_ops import is_optional_output

    node = ir.Node(domain, op, [], num_outputs=len(expected))
    opsets = {"": opset, "com.microsoft": 1}
    assert [is_optional_output(node, i, opsets) for i in range(len(expected))] == expected


def gemm_reshape_model():
    """GPT-2's Conv1D as exported: Gemm(x2d, W, b) -> Reshape back to (batch, 16, 64)."""
    w = oh.make_tensor("W", F32, [64, 64], np.zeros(64 * 64, np.float32))
    b = oh.make_tensor("B", F32, [64], np.zeros(64, np.float32))
    shape = oh.make_tensor("shape", I64, [3], [-1, 16, 64])
    forward = [
        oh.make_node("Gemm", ["x", "W", "B"], ["g"], name="gemm"),
        oh.make_node("Reshape", ["g", "shape"], ["r"], name="reshape"),
    ]
    return training_graph(
        forward,
        [bw("reshape_grad", "r")],
        [_vi("x", F32, ["batch", 64])],
        [_vi("g", F32, ["batch", 64]), _vi("r", F32, [None, 16, 64])],
        [w, b, shape],
    )


def test_gemm_is_recomputable_at_the_advanced_level_as_in_ort():
    report = analyse(gemm_reshape_model())
    assert [p.plan_string for p in report.plans] == ["Gemm+Reshape+:1:-1"]
    (occ,) = report.plans[0].occurrences
    assert sorted(v.name for v in occ.boundary) == ["B", "W", "shape", "x"]
    basic = analyse(gemm_reshape_model(), probe_level=ProbeLevel.BASIC)
    assert basic.plans == [] and "gemm (Gemm) is not recomputable" in basic.skipped[0].reason


def isnan_guard_model():
    """torch's SDPA export: p = Softmax(s); Where(IsNaN(p), 0, p); backward reads p (the
    softmax gradient), the mask and the guarded copy (the Where and MatMul gradients)."""
    zero = oh.make_tensor("zero", F32, [], [0.0])
    forward = [
        oh.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        oh.make_node("IsNaN", ["p"], ["nan"], name="isnan"),
        oh.make_node("Where", ["nan", "zero", "p"], ["guarded"], name="where"),
    ]
    shape = ["batch", 4, 32, 32]
    return training_graph(
        forward,
        [bw("softmax_grad", "p"), bw("where_grad", "nan"), bw("matmul_grad", "guarded")],
        [_vi("s", F32, shape)],
        [_vi("p", F32, shape), _vi("nan", BOOL, shape), _vi("guarded", F32, shape)],
        [zero],
    )


def test_the_sdpa_nan_guard_is_recomputed_from_the_softmax_output():
    report = analyse(isnan_guard_model())
    plans = {p.plan_string: p for p in report.plans}
    assert {"IsNaN+:1:-1", "Where+:1:-1"} <= set(plans)
    # The mask (1 byte an element) and the float copy (4) are recomputed from p, which
    # backward keeps anyway.
    assert plans["IsNaN+:1:-1"].saving_bytes == 8 * 4 * 32 * 32
    assert plans["Where+:1:-1"].saving_bytes == 8 * 4 * 32 * 32 * 4
    assert [v.name for v in plans["IsNaN+:1:-1"].occurrences[0].boundary] == ["p"]


def test_isnan_is_not_recomputable_when_removed_from_the_table(monkeypatch):
    from ortpass.analysis import recomputable_ops

    table = dict(recomputable_ops._TABLE)
    del table[("", "IsNaN")]
    monkeypatch.setattr(recomputable_ops, "_TABLE", table)
    report = analyse(isnan_guard_model())
    assert "IsNaN+:1:-1" not in {p.plan_string for p in report.plans}


def mask_bias_softmax_model():
    """The torch builder's attention with transformers' padding mask: the mask gathered per
    key (GatherND), queries that may attend to no key found by a ReduceMax, the mask added
    to the scores as a 0 / -inf bias; backward reads the probabilities only."""
    zero, neg = oh.make_tensor("zero", F32, [], [0.0]), oh.make_tensor("neg", F32, [], [float("-inf")])
    forward = [
        oh.make_node("Cast", ["attention_mask"], ["m"], name="to_bool", to=BOOL),
        oh.make_node("GatherND", ["m", "idx"], ["keep"], name="gather_mask"),
        oh.make_node("Cast", ["keep"], ["keep_f"], name="to_float", to=F32),
        oh.make_node("ReduceMax", ["keep_f"], ["any_f"], name="any", axes=[-1], keepdims=1),
        oh.make_node("Cast", ["any_f"], ["attends"], name="any_bool", to=BOOL),
        oh.make_node("Not", ["attends"], ["none"], name="none"),
        oh.make_node("Or", ["keep", "none"], ["kept"], name="kept"),
        oh.make_node("Where", ["kept", "zero", "neg"], ["bias"], name="bias"),
        oh.make_node("Add", ["s", "bias"], ["masked"], name="add_bias"),
        oh.make_node("Softmax", ["masked"], ["p"], name="softmax", axis=-1),
    ]
    mask_shape, scores = ["batch", 1, 1, 32], ["batch", 4, 32, 32]
    value_infos = [_vi("m", BOOL, ["batch", 32]), _vi("keep", BOOL, mask_shape), _vi("keep_f", F32, mask_shape),
                   _vi("any_f", F32, ["batch", 1, 1, 1]), _vi("attends", BOOL, ["batch", 1, 1, 1]),
                   _vi("none", BOOL, ["batch", 1, 1, 1]), _vi("kept", BOOL, mask_shape), _vi("bias", F32, mask_shape),
                   _vi("masked", F32, scores), _vi("p", F32, scores)]  # fmt: skip
    inputs = [_vi("s", F32, scores), _vi("attention_mask", I64, ["batch", 32]), _vi("idx", I64, ["batch", 1, 1, 32, 2])]
    return training_graph(forward, [bw("softmax_grad", "p")], inputs, value_infos, [zero, neg])


def test_the_probabilities_are_recomputed_through_a_gathered_mask_bias():
    report = analyse(mask_bias_softmax_model())
    (plan,) = [p for p in report.plans if "Softmax" in p.plan_string]
    assert {"GatherND", "ReduceMax", "Where", "Softmax"} <= set(plan.plan_string.split(":")[0].split("+"))
    (occurrence,) = plan.occurrences
    # the gather's indices are read as the forward left them, as Gather's are
    assert sorted(v.name for v in occurrence.boundary) == ["attention_mask", "idx", "neg", "s", "zero"]


@pytest.mark.parametrize("op_type", ["GatherND", "ReduceMax"])
def test_without_the_masks_ops_in_the_table_the_probabilities_stay_stashed(monkeypatch, op_type):
    from ortpass.analysis import recomputable_ops

    table = {key: entry for key, entry in recomputable_ops._TABLE.items() if key != ("", op_type)}
    monkeypatch.setattr(recomputable_ops, "_TABLE", table)
    report = analyse(mask_bias_softmax_model())
    assert not [p for p in report.plans if "Softmax" in p.plan_string]
    (skipped,) = [s for s in report.skipped if s.entry.name == "softmax"]
    assert f"({op_type}) is not recomputable" in skipped.reason


def rotary_model():
    """A rotary embedding as the torch builder writes it: ``rotate_half`` is a Concat of the
    query's negated second half and its first; backward reads the rotated query only."""
    bounds = [oh.make_tensor(n, I64, [1], [v]) for n, v in (("zero_i", 0), ("half", 8), ("end", 16), ("last", -1))]
    forward = [
        oh.make_node("Slice", ["q", "zero_i", "half", "last"], ["q1"], name="first_half"),
        oh.make_node("Slice", ["q", "half", "end", "last"], ["q2"], name="second_half"),
        oh.make_node("Neg", ["q2"], ["neg_q2"], name="neg"),
        oh.make_node("Concat", ["neg_q2", "q1"], ["rotated"], name="rotate_half", axis=-1),
        oh.make_node("Mul", ["q", "cos"], ["q_cos"], name="mul_cos"),
        oh.make_node("Mul", ["rotated", "sin"], ["rotated_sin"], name="mul_sin"),
        oh.make_node("Add", ["q_cos", "rotated_sin"], ["q_embed"], name="add_rotary"),
    ]
    full, half = ["batch", 4, 32, 16], ["batch", 4, 32, 8]
    value_infos = [_vi("q1", F32, half), _vi("q2", F32, half), _vi("neg_q2", F32, half), _vi("rotated", F32, full),
                   _vi("q_cos", F32, full), _vi("rotated_sin", F32, full), _vi("q_embed", F32, full)]  # fmt: skip
    inputs = [_vi("q", F32, full), _vi("cos", F32, [32, 16]), _vi("sin", F32, [32, 16])]
    return training_graph(forward, [bw("matmul_grad", "q_embed")], inputs, value_infos, bounds)


def test_the_rotated_query_is_recomputed_through_rotate_halfs_concat():
    report = analyse(rotary_model())
    (plan,) = [p for p in report.plans if "Concat" in p.plan_string]
    assert set(plan.plan_string.split(":")[0].rstrip("+").split("+")) == {"Slice", "Neg", "Concat", "Mul", "Add"}
    assert plan.saving_bytes == 8 * 4 * 32 * 16 * 4
    (occurrence,) = plan.occurrences
    assert {"q", "cos", "sin"} <= {v.name for v in occurrence.boundary}


def test_without_concat_in_the_table_the_rotated_query_stays_stashed(monkeypatch):
    from ortpass.analysis import recomputable_ops

    table = {key: entry for key, entry in recomputable_ops._TABLE.items() if key != ("", "Concat")}
    monkeypatch.setattr(recomputable_ops, "_TABLE", table)
    report = analyse(rotary_model())
    assert not [p for p in report.plans if "Add" in p.plan_string]  # plans list ops in graph order
    (skipped,) = [s for s in report.skipped if s.entry.name == "add_rotary"]
    assert "(Concat) is not recomputable" in skipped.reason


def simplified_layer_norm_model(inv_std_shape):
    """RMSNorm as ORT's fusion leaves it; backward reads Y's input and InvStdDev."""
    scale = oh.make_tensor("scale", F32, [64], np.ones(64, np.float32))
    forward = [
        oh.make_node("Gelu", ["x"], ["h"], name="gelu", domain="com.microsoft"),
        oh.make_node("SimplifiedLayerNormalization", ["h", "scale"], ["y", "inv_std"], name="rms", axis=-1),
    ]
    return training_graph(
        forward,
        [bw("rms_grad", "h", "inv_std"), bw("next_grad", "y")],
        [_vi("x", F32, ["batch", 16, 64])],
        [_vi("h", F32, ["batch", 16, 64]), _vi("y", F32, ["batch", 16, 64]), _vi("inv_std", F32, inv_std_shape)],
        [scale],
    )


def test_simplified_layer_norm_is_recomputable_once_inv_std_has_a_size():
    """SimplifiedLayerNormalization is advanced, like LayerNormalization (a reduction over
    the hidden dim, as ORT ranks it).  Its InvStdDev shape comes from the schema ortpass
    registers; without it the candidate was skipped."""
    report = analyse(simplified_layer_norm_model(["batch", 16, 1]))
    assert "SimplifiedLayerNormalization+:1:-1" in {p.plan_string for p in report.plans}
    unknown = analyse(simplified_layer_norm_model(None))
    assert "SimplifiedLayerNormalization+:1:-1" not in {p.plan_string for p in unknown.plans}
    assert any("inv_std" in s.reason and "unknown" in s.reason for s in unknown.skipped)
    basic = analyse(simplified_layer_norm_model(["batch", 16, 1]), probe_level=ProbeLevel.BASIC)
    assert "SimplifiedLayerNormalization+:1:-1" not in {p.plan_string for p in basic.plans}
