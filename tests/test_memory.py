"""Symbolic sizes and buffer aliasing (ortpass.analysis.memory)."""

import onnx
import onnx.helper as oh
import onnx_ir as ir
import sympy

from ortpass.analysis.memory import (
    BufferMap,
    bind_internal_dims,
    dim_symbol,
    evaluate,
    static_numel,
    symbolic_nbytes,
)


def _value(shape, dtype=ir.DataType.FLOAT, name="v"):
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))


def test_bytes_over_dim_params():
    batch, seq = dim_symbol("batch"), dim_symbol("seq")
    assert symbolic_nbytes(_value(["batch", "seq", 64])) == 256 * batch * seq
    assert symbolic_nbytes(_value(["batch", 8], ir.DataType.FLOAT16)) == 16 * batch
    assert symbolic_nbytes(_value([3, 5], ir.DataType.BOOL)) == 15
    assert symbolic_nbytes(_value([4, 3], ir.DataType.INT4)) == 6  # half a byte each



def test_static_sizes_are_the_numbers_sympy_arithmetic_gives():
    # The all-static fast path must not change a report: same value, same sympy type.
    for dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BOOL, ir.DataType.INT4):
        for shape in ([3, 5], [7], [], [0, 4]):
            size = symbolic_nbytes(_value(shape, dtype))
            product = sympy.Mul(*map(sympy.Integer, shape)) * sympy.Rational(dtype.bitwidth, 8)
            assert sympy.srepr(size) == sympy.srepr(product)
            assert evaluate(size, None) == int(sympy.ceiling(product))

def test_expression_dim_params_and_unknown_dims():
    s0, s1 = dim_symbol("s0"), dim_symbol("s1")
    assert symbolic_nbytes(_value(["s0*s1", 2])) == 8 * s0 * s1
    expr = symbolic_nbytes(_value([None, 2], name="x"))
    assert expr == 8 * dim_symbol("unk__x_0")
    assert evaluate(expr, {"batch": 4}) is None  # never guessed


def test_unknown_rank_or_type_has_no_size():
    assert symbolic_nbytes(ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT))) is None
    assert symbolic_nbytes(ir.Value(name="x", shape=ir.Shape([2]))) is None


def test_evaluate_and_static_numel():
    expr = 640 * dim_symbol("a") * dim_symbol("b") ** 2
    assert evaluate(expr, {"a": 2, "b": 3}) == 640 * 2 * 9
    assert evaluate(expr, {"a": 2}) is None
    assert evaluate(sympy.Integer(12), None) == 12
    # A bare symbol (a rank-1 bool of n elements is n bytes): xreplace returns the bound value itself.
    assert evaluate(dim_symbol("n"), {"n": 7}) == 7
    assert static_numel(_value([2, 3])) == 6 and static_numel(_value(["b", 3])) is None


def _chain():
    x = _value(["b", 4, 8], name="x")
    transpose = ir.node("Transpose", [x], attributes={"perm": [0, 2, 1]})
    shape = ir.Value(name="shape")
    reshape = ir.node("Reshape", [transpose.outputs[0], shape])
    squeeze = ir.node("Unsqueeze", [reshape.outputs[0], shape])
    split = ir.node("Split", [squeeze.outputs[0]], num_outputs=2)
    return x, transpose, reshape, squeeze, split


def test_views_resolve_to_the_buffer_they_alias():
    x, transpose, reshape, squeeze, split = _chain()
    buffers = BufferMap()
    real = transpose.outputs[0]
    assert buffers.root(squeeze.outputs[0]) is real  # Unsqueeze of Reshape of the Transpose
    assert buffers.root(reshape.outputs[0]) is real
    assert buffers.root(real) is real  # Transpose copies: its own buffer
    assert buffers.root(split.outputs[1]) is split.outputs[1]  # Split copies too
    assert buffers.is_view(reshape.outputs[0]) and not buffers.is_view(real)


def test_internal_dims_are_bound_by_shape_inference_at_concrete_dims():
    # Shape inference cannot name Reshape's output dims over the inputs; at batch=3 they are known.
    shape = oh.make_tensor("shape", onnx.TensorProto.INT64, [2], [-1, 8])
    graph = oh.make_graph(
        [oh.make_node("Reshape", ["x", "shape"], ["y"], name="r")],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 16])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["unk__0", 8])],
        [shape],
    )
    model = ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))
    assert bind_internal_dims(model, {"batch": 3}, {"unk__0"}) == {"unk__0": 6}
    assert bind_internal_dims(model, {"batch": 3}, set()) == {}


def _range_graph(limit_nodes, limit: str, constants=()):
    """x [batch, seq] -> r = Range(0, <limit>, 1) -> u = Unsqueeze(r, [1]) (shapes left
    anonymous, as torch.onnx leaves them); returns the model."""
    zero = oh.make_tensor("zero", onnx.TensorProto.INT64, [], [0])
    one = oh.make_tensor("one", onnx.TensorProto.INT64, [], [1])
    axes = oh.make_tensor("axes", onnx.TensorProto.INT64, [1], [1])
    graph = oh.make_graph(
        [*limit_nodes,
         oh.make_node("Range", ["zero", limit, "one"], ["r"], name="range"),
         oh.make_node("Unsqueeze", ["r", "axes"], ["u"], name="unsqueeze")],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.INT64, ["batch", "seq"])],
        [oh.make_tensor_value_info("u", onnx.TensorProto.INT64, [None, 1])],
        [zero, one, axes, *constants],
        value_info=[oh.make_tensor_value_info("r", onnx.TensorProto.INT64, [None])],
    )
    return ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))


def test_a_range_over_a_shape_element_has_its_length_at_concrete_dims():
    # onnx's inference takes a Range's length as data; read off the shape it is seq, and
    # the Unsqueeze after it gets its size too.  Anonymous dims go by unk__<value>_<axis>.
    index = oh.make_tensor("index", onnx.TensorProto.INT64, [], [1])
    model = _range_graph(
        [oh.make_node("Shape", ["x"], ["shape"]), oh.make_node("Gather", ["shape", "index"], ["seq"], axis=0)],
        "seq", [index],
    )
    bound = bind_internal_dims(model, {"batch": 3, "seq": 7}, {"unk__r_0", "unk__u_0"})
    assert bound == {"unk__r_0": 7, "unk__u_0": 7}
    # Sliced by Shape's start/end and squeezed, as torch writes it.
    squeeze_axes = oh.make_tensor("squeeze_axes", onnx.TensorProto.INT64, [1], [0])
    model = _range_graph(
        [oh.make_node("Shape", ["x"], ["shape"], start=0, end=1),
         oh.make_node("Squeeze", ["shape", "squeeze_axes"], ["rows"])], "rows", [squeeze_axes],
    )
    assert bind_internal_dims(model, {"batch": 3, "seq": 7}, {"unk__r_0"}) == {"unk__r_0": 3}


def test_a_range_over_the_data_stays_unbound():
    # The limit is the largest token id: no size at any dims can tell it.
    model = _range_graph([oh.make_node("ReduceMax", ["x"], ["top"], keepdims=0)], "top")
    assert bind_internal_dims(model, {"batch": 3, "seq": 7}, {"unk__r_0", "unk__u_0"}) == {}
