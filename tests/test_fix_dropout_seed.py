"""FixDropoutSeedPass: seeds exactly the dropouts recompute will clone, keeps existing seeds.

(That seeded forward and clone draw the same mask on ORT is checked end to end in
test_recompute_pass.py and test_pythonop_recompute.py.)
"""

from __future__ import annotations

import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest

import ortpass
from ortpass.analysis.partition import TrainingInfo
from ortpass.ops.dropout import dropout_seed
from ortpass.passes import FixDropoutSeedPass, RecomputePass
from ortpass.testing.graphs import as_training_graph

F = onnx.TensorProto.FLOAT
SHAPE = [4, 8]


def dropout_graph(dropout_domain: str = "", dropout_op: str = "Dropout") -> ir.Model:
    """Three dropouts on graph input x; backward reads the outputs of d_plain and d_seeded
    (stashed, so recompute plans cover them) but not of d_forward_only.

        d_plain:        no seed            -> recomputed -> gets a seed
        d_seeded:       seed=5             -> recomputed -> keeps 5
        d_forward_only: no seed            -> not stashed, not recomputed -> untouched
    """
    ratio = oh.make_tensor("ratio", F, [], [0.25])
    training = oh.make_tensor("training", onnx.TensorProto.BOOL, [], [True])
    mask_type = onnx.TensorProto.UINT32 if dropout_op == "BitmaskDropout" else onnx.TensorProto.BOOL

    def dropout(name, output, **attrs):
        return oh.make_node(
            dropout_op, ["x", "ratio", "training"], [output, f"{output}_mask"], name=name, domain=dropout_domain, **attrs
        )

    nodes = [
        ("forward", dropout("d_plain", "a")),
        ("forward", dropout("d_seeded", "b", seed=5)),
        ("forward", dropout("d_forward_only", "c")),
        ("forward", oh.make_node("Add", ["a", "b"], ["ab"], name="add")),
        ("forward", oh.make_node("Add", ["ab", "c"], ["abc"], name="add2")),
        ("forward", oh.make_node("Mul", ["abc", "w"], ["y"], name="mul")),
        ("forward", oh.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0)),
        ("backward", oh.make_node("Mul", ["a", "b"], ["w_grad"], name="w_grad")),
    ]
    graph = oh.make_graph(
        [n for _, n in nodes],
        "dropouts",
        [oh.make_tensor_value_info("x", F, SHAPE), oh.make_tensor_value_info("w", F, SHAPE)],
        [oh.make_tensor_value_info("loss", F, []), oh.make_tensor_value_info("w_grad", F, SHAPE)],
        initializer=[ratio, training],
        # Typed by hand: ONNX shape inference does not know com.microsoft ops.
        value_info=[oh.make_tensor_value_info(v, F, SHAPE) for v in ("a", "b", "c", "ab", "abc", "y")]
        + [oh.make_tensor_value_info(f"{v}_mask", mask_type, None) for v in ("a", "b", "c")],
    )
    opsets = [oh.make_opsetid("", 13)] + ([oh.make_opsetid(dropout_domain, 1)] if dropout_domain else [])
    proto = oh.make_model(graph, opset_imports=opsets, ir_version=8)
    return as_training_graph(proto, [side for side, _ in nodes], TrainingInfo("loss", ("w",), {"w": "w_grad"}))


def _node(model: ir.Model, name: str) -> ir.Node:
    return next(n for n in model.graph if n.name == name)


def _seed(model: ir.Model, name: str) -> int | None:
    attr = _node(model, name).attributes.get("seed")
    return None if attr is None else attr.as_int()


@pytest.mark.parametrize("domain, op", [("", "Dropout"), ("com.microsoft", "BitmaskDropout")])
def test_seeds_the_recomputed_dropouts_only_and_keeps_existing_seeds(domain, op):
    model = dropout_graph(domain, op)
    pass_ = FixDropoutSeedPass("Dropout+:1:-1" if op == "Dropout" else "BitmaskDropout+:1:-1", min_elements=0)
    result = pass_(model)
    assert result.modified
    assert _seed(model, "d_plain") == dropout_seed(_node(model, "d_plain"))
    assert _seed(model, "d_seeded") == 5
    assert _seed(model, "d_forward_only") is None
    assert pass_.stats["counts"] == {"dropouts seeded": 1, "seeds kept": 1}


def test_seeds_are_stable_and_distinct():
    first, second = dropout_graph(), dropout_graph()
    for model in (first, second):
        FixDropoutSeedPass("Dropout+:1:-1", min_elements=0)(model)
    assert _seed(first, "d_plain") == _seed(second, "d_plain")  # same graph, same seed
    c = _node(first, "d_forward_only")
    assert dropout_seed(c) != _seed(first, "d_plain")  # another output name, another seed
    assert dropout_seed(c, base_seed=1) == dropout_seed(c) + 1


def test_nothing_to_seed_is_not_a_modification():
    model = dropout_graph()
    FixDropoutSeedPass("Dropout+:1:-1", min_elements=0)(model)
    again = FixDropoutSeedPass("Dropout+:1:-1", min_elements=0)
    assert not again(model).modified
    assert again.stats["counts"] == {"seeds kept": 2}
    assert not FixDropoutSeedPass(min_elements=0)(dropout_graph()).modified  # level 0, no plans


def test_a_plan_without_dropout_seeds_nothing():
    model = dropout_graph()
    assert not FixDropoutSeedPass("Add+:1:-1", min_elements=0)(model).modified
    assert _seed(model, "d_plain") is None


def test_recompute_after_the_seed_fix_clones_the_seeded_dropout():
    model = dropout_graph()
    manager = ortpass.PassManager(
        [RecomputePass("Dropout+:1:-1", min_elements=0), FixDropoutSeedPass("Dropout+:1:-1", min_elements=0)],
        assume=["training-graph"],
    )
    result = manager(model).model
    clone = _node(result, "d_plain_recompute")
    assert clone.attributes["seed"].as_int() == _seed(result, "d_plain")
    assert _node(result, "d_seeded_recompute").attributes["seed"].as_int() == 5
    # The backward Mul reads the clones; forward Adds keep the originals.
    assert [v.name for v in _node(result, "w_grad").inputs] == ["a_recompute", "b_recompute"]
    assert [v.name for v in _node(result, "add").inputs] == ["a", "b"]


def test_declarations():
    assert "dropout-seeds-fixed" in FixDropoutSeedPass.provides_properties
    assert "dropout-seeds-fixed" in RecomputePass.requires_properties
    assert FixDropoutSeedPass.phase == "post-grad"
