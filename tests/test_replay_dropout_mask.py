"""ReplayDropoutMaskPass: a Dropout of the incoming gradient, with the forward seed, replaces DropoutGrad."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import onnx_ir as ir
import pytest
import torch

import ortpass
from ortpass.analysis.partition import TrainingInfo, tag
from ortpass.conventions import REPLAY_OF_KEY, SIDE_KEY
from ortpass.errors import OrtpassError
from ortpass.export import export
from ortpass.ops.dropout import dropout_seed
from ortpass.passes import FixDropoutSeedPass, RecomputePass, ReplayDropoutMaskPass
from ortpass.runtime import TrainingSession, dropout_mask_names, with_dropout_masks
from ortpass.runtime.parity import check_parity
from ortpass.testing.graphs import as_training_graph
from ortpass.testing.models import GPTDecoder
from ortpass.training import build_training_graph

F = onnx.TensorProto.FLOAT
SHAPE = [64, 32]


def dropout_training_graph(*, seed: int | None = None, grad_ratio: str = "ratio", mask_is_output: bool = False,
                           op: str = "Dropout", domain: str = "") -> ir.Model:
    """y, m = Dropout(x); loss = sum(y * w); w_grad = DropoutGrad(w, m) * x (a stand-in
    backward: the numbers only have to be the same before and after the rewrite)."""
    attrs = {} if seed is None else {"seed": seed}
    nodes = [
        ("forward", oh.make_node(op, ["x", "ratio", "training"], ["y", "m"], name="drop", domain=domain, **attrs)),
        ("forward", oh.make_node("Mul", ["y", "w"], ["yw"], name="mul")),
        ("forward", oh.make_node("ReduceSum", ["yw"], ["loss"], name="sum", keepdims=0)),
        ("backward", oh.make_node("DropoutGrad", ["w", "m", grad_ratio, "training"], ["dx"], name="drop_grad",
                                  domain="com.microsoft")),
        ("backward", oh.make_node("Mul", ["dx", "x"], ["w_grad"], name="w_grad")),
    ]
    outputs = [oh.make_tensor_value_info("loss", F, []), oh.make_tensor_value_info("w_grad", F, SHAPE)]
    if mask_is_output:
        outputs.append(oh.make_tensor_value_info("m", onnx.TensorProto.BOOL, SHAPE))
    graph = oh.make_graph(
        [n for _, n in nodes],
        "dropout",
        [oh.make_tensor_value_info("x", F, SHAPE), oh.make_tensor_value_info("w", F, SHAPE)],  # w: a parameter
        outputs,
        initializer=[
            onnx.numpy_helper.from_array(np.random.default_rng(1).standard_normal(SHAPE, dtype=np.float32), "w"),
            oh.make_tensor("ratio", F, [], [0.3]),
            oh.make_tensor("other_ratio", F, [], [0.3]),
            oh.make_tensor("training", onnx.TensorProto.BOOL, [], [True]),
        ],
        value_info=[oh.make_tensor_value_info(v, F, SHAPE) for v in ("y", "yw", "dx")]
        + ([] if mask_is_output else [oh.make_tensor_value_info("m", onnx.TensorProto.BOOL, SHAPE)]),
    )
    opsets = [oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)]
    proto = oh.make_model(graph, opset_imports=opsets, ir_version=8)
    return as_training_graph(proto, [side for side, _ in nodes], TrainingInfo("loss", ("w",), {"w": "w_grad"}))


def _node(model: ir.Model, name: str) -> ir.Node:
    return next(n for n in model.graph if n.name == name)


def _seeded_copy(model: ir.Model) -> ir.Model:
    """The model with every Dropout given the seed the pass would give it, and nothing else."""
    copy = ir.from_proto(ir.to_proto(model))
    for node in copy.graph:
        if node.op_type == "Dropout" and "seed" not in node.attributes:
            node.attributes["seed"] = ir.AttrInt64("seed", dropout_seed(node))
    return copy


def _assert_same_steps(expected: ir.Model, got: ir.Model, batch: dict, params: dict | None = None, steps: int = 3) -> None:
    expected_session, got_session = TrainingSession(expected), TrainingSession(got)
    for step in range(steps):  # the generators advance once per step, in step with each other
        want = expected_session.run(batch, params, seed=step)
        have = got_session.run(batch, params, seed=step)
        assert have.loss == want.loss
        assert want.gradients.keys() == have.gradients.keys()
        for name, grad in want.gradients.items():
            np.testing.assert_array_equal(have.gradients[name], grad, err_msg=f"{name} at step {step}")


def _feeds() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal(SHAPE, dtype=np.float32)}, {}


def test_replaces_dropout_grad_seeds_the_forward_and_drops_its_mask():
    model = dropout_training_graph()
    pass_ = ReplayDropoutMaskPass()
    result = pass_(model)
    assert result.modified
    assert [n.op_type for n in model.graph] == ["Dropout", "Mul", "ReduceSum", "Dropout", "Mul"]
    forward, replay = _node(model, "drop"), _node(model, "drop_grad_replay")
    assert len(forward.outputs) == 1  # the mask is gone: nobody reads it any more
    seed = forward.attributes["seed"].as_int()
    assert seed == dropout_seed(forward)
    assert replay.attributes["seed"].as_int() == seed
    assert [v.name for v in replay.inputs] == ["w", "ratio", "training"]
    assert replay.outputs[0].name == "dx" and replay.outputs[0].shape == ir.Shape(SHAPE)
    assert replay.metadata_props[SIDE_KEY] == "backward"
    assert replay.metadata_props[REPLAY_OF_KEY] == "drop"
    assert dict(pass_.stats["counts"]) == {"gradients replayed": 1, "dropouts seeded": 1, "masks dropped": 1}


def test_the_replay_gives_bitwise_the_gradient_of_the_kept_mask_on_ort():
    model = dropout_training_graph()
    expected = _seeded_copy(model)
    ReplayDropoutMaskPass()(model)
    _assert_same_steps(expected, model, *_feeds())


def test_an_existing_seed_is_kept_and_used():
    model = dropout_training_graph(seed=7)
    pass_ = ReplayDropoutMaskPass()
    pass_(model)
    assert _node(model, "drop").attributes["seed"].as_int() == 7
    assert _node(model, "drop_grad_replay").attributes["seed"].as_int() == 7
    assert "dropouts seeded" not in pass_.stats["counts"]


def test_a_mask_someone_else_reads_is_kept():
    model = dropout_training_graph(mask_is_output=True)
    pass_ = ReplayDropoutMaskPass()
    pass_(model)
    assert _node(model, "drop_grad_replay").op_type == "Dropout"
    assert len(_node(model, "drop").outputs) == 2
    assert "masks dropped" not in pass_.stats["counts"]


@pytest.mark.parametrize(
    "graph_options",
    [
        {"grad_ratio": "other_ratio"},  # a ratio value of its own: the replay could draw at another rate
        {"op": "BiasDropout", "domain": "com.microsoft"},  # another kernel draws the mask
    ],
    ids=["another-ratio-value", "bias-dropout"],
)
def test_does_not_fire_when_the_replay_might_draw_another_mask(graph_options):
    model = dropout_training_graph(**graph_options)
    before = ir.to_proto(model).SerializeToString()
    result = ReplayDropoutMaskPass()(model)
    assert not result.modified
    assert ir.to_proto(model).SerializeToString() == before


def test_a_second_run_changes_nothing():
    model = dropout_training_graph()
    ReplayDropoutMaskPass()(model)
    once = ir.to_proto(model).SerializeToString()
    assert not ReplayDropoutMaskPass()(model).modified
    assert ir.to_proto(model).SerializeToString() == once


def test_the_manager_runs_it_after_recompute():
    manager = ortpass.PassManager(
        [ReplayDropoutMaskPass(), RecomputePass(level=1), FixDropoutSeedPass(level=1)], assume=["training-graph"]
    )
    assert [p.name for p in manager.passes] == ["fix-dropout-seed", "recompute", "replay-dropout-mask"]


def test_a_mask_a_recompute_clone_draws_is_not_replayed():
    model = dropout_training_graph()
    tag(_node(model, "drop"), "backward")  # as recompute tags its clones
    before = ir.to_proto(model).SerializeToString()
    assert not ReplayDropoutMaskPass()(model).modified
    assert ir.to_proto(model).SerializeToString() == before


# -- a decoder from build_training_graph ---------------------------------------------------------


@pytest.fixture(scope="module")
def decoder():
    torch.manual_seed(0)
    module = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, max_seq=16, dropout=0.2)
    ids = torch.randint(0, 64, (2, 16))
    return module, ids, build_training_graph(export(module, (ids, ids), input_names=["input_ids", "labels"]))


@pytest.fixture(scope="module")
def decoder_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"input_ids": rng.integers(0, 64, (2, 16)), "labels": rng.integers(0, 64, (2, 16))}


def test_every_decoder_dropout_is_replayed_and_no_mask_is_left(decoder):
    _, _, training = decoder
    model = ir.from_proto(ir.to_proto(training))
    pass_ = ReplayDropoutMaskPass()
    pass_(model)
    dropouts = sum(n.op_type == "Dropout" and n.metadata_props[SIDE_KEY] == "forward" for n in training.graph)
    assert dropouts == 6  # per layer: attention probabilities, attention out, FFN out
    assert pass_.stats["counts"]["gradients replayed"] == dropouts
    assert pass_.stats["counts"]["masks dropped"] == dropouts
    assert not any(n.op_type == "DropoutGrad" for n in model.graph)


@pytest.mark.parametrize("recompute_level", [None, 1, 2])
def test_decoder_steps_are_bitwise_those_of_the_kept_masks_on_ort(decoder, decoder_batch, recompute_level):
    _, _, training = decoder
    expected = _seeded_copy(training)
    passes = [ReplayDropoutMaskPass()]
    if recompute_level is not None:  # replay composes with recompute: masks clones draw stay as they are
        passes += [FixDropoutSeedPass(level=recompute_level, min_elements=0),
                   RecomputePass(level=recompute_level, min_elements=0)]
    got = ortpass.PassManager(passes, assume=["training-graph"])(training).model
    _assert_same_steps(expected, got, decoder_batch)


def test_parity_with_torch_restores_the_dropped_masks(decoder):
    module, ids, training = decoder
    replayed = ReplayDropoutMaskPass()(ir.from_proto(ir.to_proto(training))).model
    with pytest.raises(OrtpassError, match="with_dropout_masks"):
        dropout_mask_names(replayed)
    _, masks = with_dropout_masks(replayed)
    assert len(masks) == 6 and all(len(n.outputs) == 1 for n in replayed.graph if n.op_type == "Dropout")
    result = check_parity(module, (ids, ids), replayed, input_names=["input_ids", "labels"])
    assert result.ok, result.errors


def test_a_replay_with_another_seed_gives_other_gradients():
    # Negative control for the bitwise checks: the equality comes from the shared seed.
    model = dropout_training_graph()
    expected = _seeded_copy(model)
    ReplayDropoutMaskPass()(model)
    replay = _node(model, "drop_grad_replay")
    replay.attributes["seed"] = ir.AttrInt64("seed", replay.attributes["seed"].as_int() + 1)
    batch, params = _feeds()
    want, have = TrainingSession(expected).run(batch, params), TrainingSession(model).run(batch, params)
    assert have.loss == want.loss  # forward untouched
    assert not np.array_equal(have.gradients["w"], want.gradients["w"])


def test_after_recompute_level_1_only_the_masks_forward_keeps_are_replayed(decoder):
    _, _, training = decoder
    manager = ortpass.PassManager(
        [FixDropoutSeedPass(level=1, min_elements=0), RecomputePass(level=1, min_elements=0), ReplayDropoutMaskPass()],
        assume=["training-graph"],
    )
    model = manager(training).model
    replays = [n for n in model.graph if REPLAY_OF_KEY in n.metadata_props]
    # Level 1 recomputes each layer but its last Dropout (after fc_out), whose mask alone
    # backward reads: that mask is the one forward keeps, and the one replayed.
    assert sorted(n.metadata_props[REPLAY_OF_KEY] for n in replays) == [
        "/blocks.0/drop_1/Dropout", "/blocks.1/drop_1/Dropout"
    ]
    assert all(len(n.outputs) == 1 for n in model.graph if n.op_type == "Dropout" and n.metadata_props[SIDE_KEY] == "forward")
    # Every remaining DropoutGrad reads a mask a clone draws in backward.
    for grad in (n for n in model.graph if n.op_type == "DropoutGrad"):
        assert grad.inputs[1].producer().metadata_props[SIDE_KEY] == "backward"


def test_sessions_over_replayed_graphs_disable_the_cuda_dropout_fusions():
    # On CUDA, BiasDropoutFusion would make the forward Dropout another kernel than the replay.
    from ortpass.runtime.session import (
        REPLAY_DISABLED_ORT_OPTIMIZERS,
        disabled_optimizers,
    )

    model = dropout_training_graph()
    assert not set(REPLAY_DISABLED_ORT_OPTIMIZERS) & set(disabled_optimizers(model))
    ReplayDropoutMaskPass()(model)
    assert set(REPLAY_DISABLED_ORT_OPTIMIZERS) <= set(disabled_optimizers(model))
