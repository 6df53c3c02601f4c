"""OrderBackwardJoinsPass: the chain that frees the most runs first where backward chains meet."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import onnx_ir as ir
import pytest
import torch

import ortpass
from ortpass.analysis.partition import TrainingInfo
from ortpass.export import export
from ortpass.testing.models import CausalLMLoss, add_low_rank_adapters
from ortpass.passes import (
    FixDropoutSeedPass,
    OrderBackwardJoinsPass,
    RecomputePass,
    ReplayDropoutMaskPass,
)
from ortpass.runtime import TrainingSession
from ortpass.testing.graphs import as_training_graph
from ortpass.testing.models import GPTDecoder
from ortpass.testing.profiling import ort_execution_order
from ortpass.training import build_training_graph

F = onnx.TensorProto.FLOAT
SHAPE = [64, 32]


def join_graph(*, big_read_later: bool = False, known_size: bool = True) -> ir.Model:
    """Backward ``join = Add(ga, gb)`` of two chains: ``ga = Mul(g, big)`` reads the stashed
    ``big`` last, ``gb = Mul(g, w)`` reads only a weight.  Graph order: ga, gb, join, so
    ORT's walk (highest producer index first) runs gb's chain first while big is held."""
    nodes = [
        ("forward", oh.make_node("Tanh", ["x"], ["big"], name="tanh")),
        ("forward", oh.make_node("Mul", ["big", "w"], ["y"], name="mul")),
        ("forward", oh.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0)),
        ("backward", oh.make_node("Neg", ["w"], ["g"], name="g")),
        ("backward", oh.make_node("Mul", ["g", "big"], ["ga"], name="ga")),
        ("backward", oh.make_node("Mul", ["g", "w"], ["gb"], name="gb")),
        ("backward", oh.make_node("Add", ["ga", "gb"], ["w_grad"], name="join")),
    ]
    outputs = [oh.make_tensor_value_info("loss", F, []), oh.make_tensor_value_info("w_grad", F, SHAPE)]
    if big_read_later:  # another backward reader of big after the join: ga does not free it
        nodes.append(("backward", oh.make_node("Relu", ["big"], ["late"], name="late")))
        outputs.append(oh.make_tensor_value_info("late", F, SHAPE))
    shape = SHAPE if known_size else ["n", 32]
    graph = oh.make_graph(
        [n for _, n in nodes],
        "join",
        [oh.make_tensor_value_info("x", F, shape), oh.make_tensor_value_info("w", F, SHAPE)],
        outputs,
        initializer=[onnx.numpy_helper.from_array(np.random.default_rng(1).standard_normal(SHAPE, dtype=np.float32), "w")],
        value_info=[oh.make_tensor_value_info(v, F, shape) for v in ("big", "y", "ga")]
        + [oh.make_tensor_value_info(v, F, SHAPE) for v in ("g", "gb")],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    return as_training_graph(proto, [side for side, _ in nodes], TrainingInfo("loss", ("w",), {"w": "w_grad"}))


def _order(model: ir.Model) -> list[str]:
    return [n.name for n in model.graph]


def test_moves_the_chain_that_frees_the_stash_to_just_before_the_join():
    model = join_graph()
    pass_ = OrderBackwardJoinsPass()
    assert pass_(model).modified
    assert _order(model) == ["tanh", "mul", "sum", "g", "gb", "ga", "join"]
    assert dict(pass_.stats["counts"]) == {"joins reordered": 1, "nodes moved": 1}


def test_ort_runs_the_moved_chain_first_and_computes_the_same(tmp_path):
    model = join_graph()
    feeds = {"x": np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)}
    before = ort_execution_order(model, feeds, tmp_path)
    assert before.index("gb") < before.index("ga")  # the walk takes the highest index first
    expected = TrainingSession(model).run(feeds)
    OrderBackwardJoinsPass()(model)
    after = ort_execution_order(model, feeds, tmp_path)
    assert after.index("ga") < after.index("gb")
    got = TrainingSession(model).run(feeds)
    assert got.loss == expected.loss
    np.testing.assert_array_equal(got.gradients["w"], expected.gradients["w"])


@pytest.mark.parametrize(
    "options, reason",
    [({"big_read_later": True}, "big is read after the join: ga does not free it"),
     ({"known_size": False}, "big's size is unknown")],
)
def test_does_not_fire_when_no_chain_is_known_to_free_more(options, reason):
    model = join_graph(**options)
    before = ir.to_proto(model).SerializeToString()
    assert not OrderBackwardJoinsPass()(model).modified, reason
    assert ir.to_proto(model).SerializeToString() == before


def test_a_second_run_changes_nothing():
    model = join_graph()
    OrderBackwardJoinsPass()(model)
    once = ir.to_proto(model).SerializeToString()
    assert not OrderBackwardJoinsPass()(model).modified
    assert ir.to_proto(model).SerializeToString() == once


def test_the_manager_runs_it_after_recompute_and_replay():
    manager = ortpass.PassManager(
        [OrderBackwardJoinsPass(), ReplayDropoutMaskPass(), RecomputePass(level=1), FixDropoutSeedPass(level=1)],
        assume=["training-graph"],
    )
    assert [p.name for p in manager.passes] == [
        "fix-dropout-seed", "recompute", "replay-dropout-mask", "order-backward-joins"
    ]


def gradient_join_graph(*, gradient_last: bool = False, reads_loss_gradient: bool = True) -> ir.Model:
    """Backward ``join = Mul(gneg, rr)``: ``gneg = Neg(Mul(loss_grad, w))`` carries the loss's
    gradient, ``rr = Mul(r, r)`` with ``r = Tanh(x)`` recomputes an activation.  Graph
    order puts the recomputation last (ORT walks it first) unless ``gradient_last``."""
    seed = "loss_grad" if reads_loss_gradient else "w"
    gradient = [("backward", oh.make_node("Mul", [seed, "w"], ["g"], name="g")),
                ("backward", oh.make_node("Neg", ["g"], ["gneg"], name="gneg"))]
    recompute = [("backward", oh.make_node("Tanh", ["x"], ["r"], name="r")),
                 ("backward", oh.make_node("Mul", ["r", "r"], ["rr"], name="rr"))]
    nodes = [
        ("forward", oh.make_node("Tanh", ["x"], ["big"], name="tanh")),
        ("forward", oh.make_node("Mul", ["big", "w"], ["y"], name="mul")),
        ("forward", oh.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0)),
        *(recompute + gradient if gradient_last else gradient + recompute),
        ("backward", oh.make_node("Mul", ["gneg", "rr"], ["w_grad"], name="join")),
    ]
    rng = np.random.default_rng(1)
    graph = oh.make_graph(
        [n for _, n in nodes],
        "gradient_join",
        [oh.make_tensor_value_info("x", F, SHAPE), oh.make_tensor_value_info("w", F, SHAPE)],
        [oh.make_tensor_value_info("loss", F, []), oh.make_tensor_value_info("w_grad", F, SHAPE)],
        initializer=[onnx.numpy_helper.from_array(rng.standard_normal(SHAPE, dtype=np.float32), "w"),
                     onnx.numpy_helper.from_array(np.array(1.0, np.float32), "loss_grad")],
        value_info=[oh.make_tensor_value_info(v, F, SHAPE) for v in ("big", "y", "g", "gneg", "r", "rr")],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    return as_training_graph(proto, [side for side, _ in nodes], TrainingInfo("loss", ("w",), {"w": "w_grad"}))


def test_the_gradient_chain_moves_before_a_recomputation_ort_would_walk_first(tmp_path):
    model = gradient_join_graph()
    feeds = {"x": np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)}
    before = ort_execution_order(model, feeds, tmp_path)
    assert before.index("r") < before.index("g")  # the recomputation runs before the gradient exists
    expected = TrainingSession(model).run(feeds)
    pass_ = OrderBackwardJoinsPass()
    assert pass_(model).modified
    assert _order(model) == ["tanh", "mul", "sum", "r", "rr", "g", "gneg", "join"]
    assert dict(pass_.stats["counts"]) == {"gradients walked first": 1, "joins reordered": 1, "nodes moved": 2}
    after = ort_execution_order(model, feeds, tmp_path)
    assert after.index("gneg") < after.index("r")
    got = TrainingSession(model).run(feeds)
    assert got.loss == expected.loss
    np.testing.assert_array_equal(got.gradients["w"], expected.gradients["w"])


@pytest.mark.parametrize(
    "options, reason",
    [({"gradient_last": True}, "ORT walks the gradient's chain first already"),
     ({"reads_loss_gradient": False}, "no chain carries the loss's gradient, and neither frees more")],
)
def test_the_gradient_rule_does_not_fire(options, reason):
    model = gradient_join_graph(**options)
    before = ir.to_proto(model).SerializeToString()
    assert not OrderBackwardJoinsPass()(model).modified, reason
    assert ir.to_proto(model).SerializeToString() == before


def _lora_gpt2(frozen: bool) -> torch.nn.Module:
    """Tiny HF GPT-2 with rank-2 adapters ``base(x) + x A B`` on every projection."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    gpt2 = transformers.GPT2LMHeadModel(config)
    add_low_rank_adapters(gpt2, rank=2)
    model = CausalLMLoss(gpt2).train()
    for name, p in model.named_parameters():
        p.requires_grad_(not frozen or name.endswith((".a", ".b")))
    return model


def test_with_a_frozen_base_ort_computes_the_loss_before_any_recomputation(tmp_path):
    """With only the adapters trainable, the first gradient ORT walks reads a recomputed
    ``x A``: without the rule the last layer was recomputed before the loss existed."""
    from ortpass.passes import DEFAULT_PIPELINE

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    names = ["input_ids", "labels"]
    dynamic = {n: {0: f"{n}_dim0", 1: f"{n}_dim1"} for n in names}
    forward = export(_lora_gpt2(frozen=True), (ids, ids.roll(-1, 1)), input_names=names, dynamic_axes=dynamic)
    pipeline = DEFAULT_PIPELINE.replace("recompute(level=1)", "recompute(level=1,min_elements=0)").replace(
        "fix-dropout-seed(level=1)", "fix-dropout-seed(level=1,min_elements=0)")
    result = ortpass.pipeline(pipeline)(forward)
    assert result.report["order-backward-joins"].stats["counts"]["gradients walked first"] >= 1
    order = ort_execution_order(result.model, {"input_ids": ids.numpy(), "labels": ids.roll(-1, 1).numpy()}, tmp_path)
    loss = next(i for i, name in enumerate(order) if name.endswith("SoftmaxCrossEntropyLoss"))
    recomputed = [i for i, name in enumerate(order) if "_recompute" in name]
    assert recomputed and loss < min(recomputed)


@pytest.fixture(scope="module")
def decoder_graph() -> ir.Model:
    torch.manual_seed(0)
    model = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, max_seq=16, dropout=0.2)
    ids = torch.randint(0, 64, (2, 16))
    training = build_training_graph(export(model, (ids, ids), input_names=["input_ids", "labels"]))
    passes = [FixDropoutSeedPass(level=1, min_elements=0), RecomputePass(level=1, min_elements=0), ReplayDropoutMaskPass()]
    return ortpass.PassManager(passes, assume=["training-graph"])(training).model


def test_attention_backward_runs_dv_first_on_ort(decoder_graph, tmp_path):
    """dV's chain is the last reader of the recomputed attention probabilities: after the
    pass ORT computes dV before dQ and dK, which need the probabilities' gradient."""
    model = ir.from_proto(ir.to_proto(decoder_graph))
    feeds = {"input_ids": np.zeros((2, 16), np.int64), "labels": np.zeros((2, 16), np.int64)}
    split_grad = next(n for n in model.graph if n.name == "/blocks.1/attn/Split_Grad/Concat_0")
    dq, dk, dv = (v.producer().name for v in split_grad.inputs)
    dv_matmul = next(  # the head of dV's chain: it reads the recomputed probabilities
        n.name for n in model.graph if n.op_type == "FusedMatMul" and "/blocks.1/attn/attn_drop/Dropout_output_0" in
        {v.name.removesuffix("_recompute") for v in n.inputs if v is not None}
    )
    probs_grad = next(n.name for n in model.graph if n.op_type == "DropoutGrad" and "/blocks.1/attn/attn_drop" in n.name)

    def dv_runs_first(order: list[str]) -> bool:
        return order.index(dv_matmul) < order.index(probs_grad) and order.index(dv) < min(order.index(dq), order.index(dk))

    assert not dv_runs_first(ort_execution_order(model, feeds, tmp_path))
    pass_ = OrderBackwardJoinsPass()
    pass_(model)
    assert pass_.stats["counts"]["joins reordered"] >= 2  # one Split gradient per layer at least
    assert dv_runs_first(ort_execution_order(model, feeds, tmp_path))


def test_decoder_steps_are_bitwise_the_same_on_ort(decoder_graph):
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 64, (2, 16)), "labels": rng.integers(0, 64, (2, 16))}
    ordered = OrderBackwardJoinsPass()(ir.from_proto(ir.to_proto(decoder_graph))).model
    expected_session, got_session = TrainingSession(decoder_graph), TrainingSession(ordered)
    for step in range(2):
        want, have = expected_session.run(batch, seed=step), got_session.run(batch, seed=step)
        assert have.loss == want.loss
        for name, grad in want.gradients.items():
            np.testing.assert_array_equal(have.gradients[name], grad, err_msg=name)


def _moves_one_by_one(nodes: list, moves: list) -> list:
    """What the pass did before batching its graph edits: each chain, outer joins first,
    removed and put back before its join."""
    order = list(nodes)
    for join, chain in reversed(moves):
        order = [n for n in order if n not in chain]
        at = order.index(join)
        order[at:at] = chain
    return order


@pytest.mark.parametrize(
    "moves",
    [
        [("j1", ["b", "c"]), ("j2", ["e"])],  # two joins side by side
        [("j1", ["a", "b"]), ("j2", ["b", "d", "a", "j1"])],  # j1 and its chain inside j2's chain
    ],
)
def test_moves_land_as_one_move_per_join_would(moves):
    from ortpass.passes.order_backward_joins import _moved_order

    nodes = ["a", "b", "c", "x", "j1", "d", "e", "y", "j2", "z"]
    assert _moved_order(nodes, moves) == _moves_one_by_one(nodes, moves)
