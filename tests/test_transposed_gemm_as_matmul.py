"""TransposedGemmAsMatmulPass: ``Gemm(A, B, transA=1)`` as ``Transpose`` and ``MatMul`` on the
torch builder's graphs, transposing the narrower operand, equal to the Gemm and to numpy on
ORT; the Gemms it leaves alone; and the two nodes kept by the sessions ortpass opens."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest

from ortpass.analysis.partition import tag
from ortpass.conventions import BUILDER_KEY
from ortpass.passes import TransposedGemmAsMatmulPass
from ortpass.runtime.session import open_session

F, D, I64 = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.INT64
ROWS = 12


def _gemm_graph(a_cols=3, b_cols=5, builder: str | None = "torch", dtype: int = F, c: bool = False, a_rows=ROWS, **attributes) -> ir.Model:
    """a [rows, a_cols], b [rows, b_cols] -> Gemm -> dw, then Neg(dw) -> y, so that dw has a
    reader and is a graph output (as a weight gradient is)."""
    attributes = {"transA": 1, **attributes}
    inputs = ["a", "b", "c"] if c else ["a", "b"]
    out_shape = [a_cols, b_cols]
    graph = oh.make_graph(
        [oh.make_node("Gemm", inputs, ["dw"], name="weight_grad", **attributes), oh.make_node("Neg", ["dw"], ["y"], name="neg")],
        "weight_gradient",
        [oh.make_tensor_value_info("a", dtype, [a_rows, a_cols]), oh.make_tensor_value_info("b", dtype, [a_rows, b_cols]),
         *([oh.make_tensor_value_info("c", dtype, out_shape)] if c else [])],
        [oh.make_tensor_value_info("dw", dtype, None), oh.make_tensor_value_info("y", dtype, None)],
    )  # fmt: skip
    model = ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8))
    for node in model.graph:
        tag(node, "backward")
    if builder is not None:
        model.metadata_props[BUILDER_KEY] = builder
    return model


def _feeds(a_cols=3, b_cols=5, dtype=np.float32, c: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((ROWS, a_cols)).astype(dtype), "b": rng.standard_normal((ROWS, b_cols)).astype(dtype)}
    if c:
        feeds["c"] = rng.standard_normal((a_cols, b_cols)).astype(dtype)
    return feeds


def _run(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.add_session_config_entry("optimization.disable_specified_optimizers", "MatmulTransposeFusion")
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(["dw", "y"], feeds)


@pytest.mark.parametrize(
    "a_cols, b_cols, ops",
    [(3, 5, ["Transpose", "MatMul", "Neg"]),  # A narrower: its copy, and the product as it is
     (5, 3, ["Transpose", "MatMul", "Transpose", "Neg"]),  # B narrower: its copy, and the product's
     (4, 4, ["Transpose", "MatMul", "Neg"])],
)  # fmt: skip
def test_the_narrower_operand_is_transposed_and_the_product_equals_the_gemms(a_cols, b_cols, ops):
    feeds = _feeds(a_cols, b_cols)
    gemm_dw, _ = _run(_gemm_graph(a_cols, b_cols), feeds)
    pass_ = TransposedGemmAsMatmulPass()
    result = pass_(_gemm_graph(a_cols, b_cols))
    assert result.modified and pass_.stats["counts"]["gemms written as matmuls"] == 1
    graph = result.model.graph
    assert [n.op_type for n in graph] == ops
    transposed = next(iter(graph)).inputs[0].name
    assert transposed == ("a" if a_cols <= b_cols else "b")
    assert graph.outputs[0].name == "dw" and graph.outputs[0].shape == ir.Shape([a_cols, b_cols])
    assert all(n.metadata_props.get("pkg.ortpass.side") == "backward" for n in graph)
    dw, y = _run(result.model, feeds)
    np.testing.assert_allclose(dw, feeds["a"].astype(np.float64).T @ feeds["b"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, gemm_dw, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y, -dw)  # the reader reads the new product


def test_double_and_symbolic_columns():
    """Columns unknown at export count as more: A's symbolic, B is transposed."""
    model = _gemm_graph(3, 5, dtype=D)
    model.graph.inputs[0].shape = ir.Shape([ROWS, "hidden"])
    result = TransposedGemmAsMatmulPass()(model)
    assert result.modified and next(iter(result.model.graph)).inputs[0].name == "b"
    feeds = _feeds(3, 5, np.float64)
    dw, _ = _run(result.model, feeds)
    np.testing.assert_allclose(dw, feeds["a"].T @ feeds["b"], rtol=1e-12)


@pytest.mark.parametrize(
    "case, kwargs",
    [("another builder's graph", {"builder": None}),  # ORT's MatmulTransposeFusion would undo it there
     ("ORT's builder's graph", {"builder": "ort"}),
     ("a bias C", {"c": True}),
     ("alpha", {"alpha": 2.0}),
     ("transB too", {"transB": 1, "b_cols": 3, "a_rows": ROWS}),
     ("no transA", {"transA": 0}),
     ("integers", {"dtype": I64})],
)  # fmt: skip
def test_other_gemms_are_left_as_they_are(case, kwargs):
    if "transB" in kwargs or kwargs.get("transA") == 0:
        kwargs = {**kwargs, "a_cols": ROWS, "b_cols": ROWS}  # shapes that fit the product asked for
    model = _gemm_graph(**kwargs)
    before = [(n.op_type, dict(n.attributes)) for n in model.graph]
    pass_ = TransposedGemmAsMatmulPass()
    result = pass_(model)
    assert not result.modified, case
    assert [(n.op_type, dict(n.attributes)) for n in result.model.graph] == before
    assert "gemms written as matmuls" not in pass_.stats.get("counts", {})


def test_the_sessions_ortpass_opens_keep_the_transpose_and_the_matmul(tmp_path):
    """ORT's MatmulTransposeFusion is off for the torch builder's graphs, so ORT runs the
    rewritten form; with it on, ORT fuses them back into a transposed-A FusedMatMul."""
    model = TransposedGemmAsMatmulPass()(_gemm_graph(3, 5)).model
    optimized = tmp_path / "optimized.onnx"
    session, _ = open_session(ir.to_proto(model), model, "cpu", optimized_model_path=optimized)
    assert [n.op_type for n in onnx.load(optimized).graph.node] == ["Transpose", "MatMul", "Neg"]
    feeds = _feeds(3, 5)
    np.testing.assert_allclose(session.run(["dw"], feeds)[0], feeds["a"].T @ feeds["b"], rtol=1e-5, atol=1e-6)
    fused = tmp_path / "fused.onnx"
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(fused)
    ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert [n.op_type for n in onnx.load(fused).graph.node] == ["FusedMatMul", "Neg"]


def test_ort_runs_the_operands_chains_in_the_gemms_order_and_the_transpose_right_before_its_matmul():
    """ORT walks a node's producers from the highest number down: the Gemm's operands come
    from ``Relu`` (number 0) and ``Sigmoid`` (1), so ORT runs ``Sigmoid`` first.  The
    ``Transpose`` of ``Relu``'s output goes right after ``Relu``, not before the MatMul
    (where its number would be the highest and ORT would run ``Relu``'s chain first)."""
    from ortpass.analysis.ort_order import ort_default_order

    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["a"], name="relu"), oh.make_node("Sigmoid", ["dy"], ["b"], name="sigmoid"),
         oh.make_node("Gemm", ["a", "b"], ["dw"], name="weight_grad", transA=1)],
        "chains",
        [oh.make_tensor_value_info("x", F, [ROWS, 3]), oh.make_tensor_value_info("dy", F, [ROWS, 5])],
        [oh.make_tensor_value_info("dw", F, None)],
        value_info=[oh.make_tensor_value_info("a", F, [ROWS, 3]), oh.make_tensor_value_info("b", F, [ROWS, 5])],
    )  # fmt: skip
    model = ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8))
    model.metadata_props[BUILDER_KEY] = "torch"
    before = [n.op_type for n in ort_default_order(list(model.graph))]
    assert before == ["Sigmoid", "Relu", "Gemm"]
    result = TransposedGemmAsMatmulPass()(model)
    assert [n.op_type for n in result.model.graph] == ["Relu", "Transpose", "Sigmoid", "MatMul"]
    assert [n.op_type for n in ort_default_order(list(result.model.graph))] == ["Sigmoid", "Relu", "Transpose", "MatMul"]
