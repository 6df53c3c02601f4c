"""pythonop-shape-inference settles chained PythonOps in one sweep (issue 59): one
whole-model ONNX inference however many PythonOp levels, the result the rounds over the
whole model reached, and the dims ONNX invents named fresh across the model."""

from __future__ import annotations

import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest

from ortpass.passes.pythonop_shape_inference import PythonOpShapeInferencePass
from ortpass.pythonop.propagation import levels_of
from ortpass.pythonop.shape_inference import register_shape_inferer, unregister_shape_inferer

PASS_THROUGH = "tests_models.ChainPassThrough"


def _pythonop(x: str, y: str, name: str) -> onnx.NodeProto:
    return oh.make_node(
        "PythonOp", [x], [f"{y}_ctx", y], name=name, domain="com.microsoft", func_name=PASS_THROUGH,
        input_convention="d", input_requires_grads=[1], input_tensor_types=[onnx.TensorProto.FLOAT],
        input_tensor_ranks=[3], output_tensor_types=[onnx.TensorProto.FLOAT], output_tensor_ranks=[3], training_mode=1,
    )  # fmt: skip


def _chain(levels: int) -> ir.Model:
    """x[batch, seq, 8] -> (PythonOp -> Reshape(., Shape(x)) -> Relu) x levels -> out, and
    after each level a NonZero, whose second dim ONNX invents.  Every value starts with stale
    dims, as torch's exporter leaves them."""
    nodes = [oh.make_node("Shape", ["x"], ["x_shape"], name="shape")]
    value_info, outputs, h = [], [], "x"
    for i in range(levels):
        nodes += [
            _pythonop(h, f"y{i}", f"pythonop{i}"),
            oh.make_node("Reshape", [f"y{i}", "x_shape"], [f"r{i}"], name=f"reshape{i}"),
            oh.make_node("Relu", [f"r{i}"], [f"h{i}"], name=f"relu{i}"),
            oh.make_node("NonZero", [f"h{i}"], [f"nz{i}"], name=f"nonzero{i}"),
        ]
        for value in (f"y{i}", f"r{i}", f"h{i}"):
            value_info.append(oh.make_tensor_value_info(value, onnx.TensorProto.FLOAT, [f"stale{i}", "s1", "s2"]))
        outputs.append(oh.make_tensor_value_info(f"nz{i}", onnx.TensorProto.INT64, None))
        h = f"h{i}"
    graph = oh.make_graph(
        nodes, "chain", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "seq", 8])],
        [oh.make_tensor_value_info(h, onnx.TensorProto.FLOAT, None), *outputs], value_info=value_info,
    )  # fmt: skip
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)])
    return ir.from_proto(proto)


@pytest.fixture
def pass_through():
    @register_shape_inferer(PASS_THROUGH)
    def same_as_input(node, input_shapes, input_dtypes):
        return [input_shapes[0]], [input_dtypes[0]]

    yield same_as_input
    unregister_shape_inferer(PASS_THROUGH)


def _dims(value: ir.Value) -> list | None:
    return None if value.shape is None else [d if isinstance(d, int) else d.value for d in value.shape]


def _values(model: ir.Model) -> dict[str, ir.Value]:
    return {v.name: v for node in model.graph for v in node.outputs}


def test_levels_count_the_pythonops_on_the_way(pass_through):
    levels = levels_of(_chain(3))
    by_name = {node.name: level for node, level in levels.items()}
    assert by_name["shape"] == 0
    assert [by_name[f"pythonop{i}"] for i in range(3)] == [1, 2, 3]
    assert [by_name[f"relu{i}"] for i in range(3)] == [1, 2, 3]


def test_every_level_settles_with_one_whole_model_inference(pass_through, monkeypatch):
    sizes = []
    original = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", lambda p, **k: sizes.append(len(p.graph.node)) or original(p, **k))
    model = _chain(6)
    nodes = len(model.graph)
    result = PythonOpShapeInferencePass()(model)
    assert result.modified
    assert sizes.count(nodes) == 1  # the whole model once, then each level alone
    assert sum(sizes) <= 2 * nodes + 6  # each level: its nodes and the Shape feeding its Reshape
    values = _values(result.model)
    for i in range(6):
        assert _dims(values[f"y{i}"]) == ["batch", "seq", 8]
        assert _dims(values[f"h{i}"]) == ["batch", "seq", 8]


def test_the_result_is_what_the_rounds_over_the_whole_model_reached(pass_through):
    swept = PythonOpShapeInferencePass()(_chain(5)).model
    rounds = _chain(5)
    pass_ = PythonOpShapeInferencePass()
    pass_._until_settled(rounds, [n for n in rounds.graph if n.op_type == "PythonOp"])
    expected, got = _values(rounds), _values(swept)
    for name, value in expected.items():
        want, have = _dims(value), _dims(got[name])
        if want is None or have is None:
            assert want == have, name
            continue
        invented = [isinstance(d, str) and d.startswith("unk__") for d in want]
        assert [isinstance(d, str) and d.startswith("unk__") for d in have] == invented, name
        assert [d for d, fresh in zip(have, invented) if not fresh] == [d for d, fresh in zip(want, invented) if not fresh]
        assert got[name].dtype == value.dtype, name


def test_invented_dims_are_fresh_across_the_model(pass_through):
    model = PythonOpShapeInferencePass()(_chain(4)).model
    values = _values(model)
    invented = [_dims(values[f"nz{i}"])[1] for i in range(4)]
    assert all(name.startswith("unk__") for name in invented)
    assert len(set(invented)) == 4  # one per level, none reused by another level's sub-model
    others = {d for v in values.values() if not v.name.startswith("nz") for d in (_dims(v) or ()) if isinstance(d, str)}
    assert not others & set(invented)


def test_a_graph_with_a_subgraph_is_settled_by_rounds(pass_through):
    model = _chain(2)
    identities = [ir.Node("", "Identity", [model.graph.inputs[0]], name=f"identity{k}") for k in range(2)]
    branches = [ir.Graph([], [n.outputs[0]], nodes=[n], name=f"branch{k}") for k, n in enumerate(identities)]
    cond = ir.Value(name="cond", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    model.graph.inputs.append(cond)
    model.graph.append(ir.Node("", "If", [cond], [ir.AttrGraph("then_branch", branches[0]),
                                                  ir.AttrGraph("else_branch", branches[1])], name="if"))  # fmt: skip
    assert levels_of(model) is None
    result = PythonOpShapeInferencePass()(model)
    assert _dims(_values(result.model)["h1"]) == ["batch", "seq", 8]
