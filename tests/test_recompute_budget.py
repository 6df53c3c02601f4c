"""The memory-budget planner (``recompute(budget=...)``): the step-memory prediction it
rests on (hand-worked graphs), the cost model, the budget's forms and errors, and on a
decoder that the choice fits the budget, costs less where the budget is looser, and
changes no number on ONNX Runtime."""

from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
import torch

import ortpass
from ortpass.analysis.ort_order import ort_default_order
from ortpass.analysis.recompute import find_recompute_candidates
from ortpass.analysis.recompute.budget import parse_budget, plan_for_budget
from ortpass.analysis.recompute.timing import CostModel, node_work
from ortpass.analysis.step_memory import kernel_scratch, predict_step_memory
from ortpass.errors import PassFailedError, PipelineSpecError, PlanError
from ortpass.export import export
from ortpass.ops.dropout import dropout_seed
from ortpass.passes import FixDropoutSeedPass, OrderBackwardJoinsPass, RecomputePass, ReplayDropoutMaskPass
from ortpass.runtime import TrainingSession
from ortpass.testing.models import GPTDecoder
from ortpass.training import build_training_graph

F = onnx.TensorProto.FLOAT
#: A fixed price list, so that the choices below do not depend on this machine's speed.
COSTS = CostModel(seconds_per_flop=5e-12, seconds_per_byte=2e-11)
CALIBRATED = CostModel.for_this_machine  # before the autouse fixture below replaces it


# -- the step-memory prediction ---------------------------------------------------------------------


def _view_graph() -> ir.Model:
    """x[4,8] -> a=Relu(x) -> b=Reshape(a) (a view) -> c=Relu(b) -> y=Add(c, a) (output);
    u=Relu(x), read by nobody.  Every float tensor is 4*8*4 = 128 bytes."""
    graph = oh.make_graph(
        [
            oh.make_node("Relu", ["x"], ["a"], name="n1"),
            oh.make_node("Reshape", ["a", "shape"], ["b"], name="n2"),
            oh.make_node("Relu", ["b"], ["c"], name="n3"),
            oh.make_node("Add", ["c", "a"], ["y"], name="n4"),
            oh.make_node("Relu", ["x"], ["u"], name="n5"),
        ],
        "views",
        [oh.make_tensor_value_info("x", F, [4, 8])],
        [oh.make_tensor_value_info("y", F, [4, 8])],
        [oh.make_tensor("shape", onnx.TensorProto.INT64, [2], [4, 8])],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto))


def test_ort_default_order_walks_from_the_last_leaf_inputs_last_first():
    # Leaves: n5 (unread) and n4 (the output), the last in graph order first; from n4 its
    # inputs' producers n3 then n1, each one's subgraph first: n3 needs n2, which needs n1.
    order = [n.name for n in ort_default_order(list(_view_graph().graph))]
    assert order == ["n5", "n1", "n2", "n3", "n4"]


def test_step_memory_counts_buffers_once_frees_after_the_last_read_and_holds_unread_values():
    step = predict_step_memory(_view_graph())
    # n5: u (held: nobody reads it); n1: a; n2: a view, nothing new; n3: c; n4: y while
    # a (read by n4 and through its view by n3) and c are still alive.
    assert [n.name for n in step.nodes] == ["n5", "n1", "n2", "n3", "n4"]
    assert step.live.tolist() == [128, 256, 256, 384, 512]
    assert step.peak_bytes == 512 and step.peak_node.name == "n4" and step.exact


def test_a_view_that_is_a_graph_output_is_a_copy():
    """x[4,8] -> a=Relu(x) (128 B) -> b=Reshape(a): returned, b is a buffer of its own
    (ORT copies a returned view; docs/design/ort-facts.md), and a dies after the Reshape
    and its other reader."""
    x = oh.make_tensor_value_info("x", F, [4, 8])
    shape = oh.make_tensor("shape", onnx.TensorProto.INT64, [2], [8, 4])
    nodes = [oh.make_node("Relu", ["x"], ["a"], name="relu"), oh.make_node("Reshape", ["a", "shape"], ["b"], name="view"),
             oh.make_node("Neg", ["b"], ["y"], name="neg")]
    returned = predict_step_memory(_graph(nodes, [x], [oh.make_tensor_value_info(n, F, [8, 4]) for n in ("b", "y")], [shape]))
    assert [n.name for n in returned.nodes] == ["relu", "view", "neg"]
    assert returned.live.tolist() == [128, 256, 256]  # a; a and its copy b; b and y (a freed)
    internal = predict_step_memory(_graph(nodes, [x], [oh.make_tensor_value_info("y", F, [8, 4])], [shape]))
    assert internal.live.tolist() == [128, 128, 256]  # b shares a's buffer until y is written


def _graph(nodes, inputs, outputs, initializers=()) -> ir.Model:
    graph = oh.make_graph(nodes, "g", inputs, outputs, list(initializers))
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto))


def test_a_transpose_only_matmuls_read_is_fused_into_them_and_costs_nothing():
    """x[4,8] -> a=Relu(x) (128 B) -> t=Transpose(a) -> y=MatMul(w[4,4], t) (128 B)."""
    x, w = oh.make_tensor_value_info("x", F, [4, 8]), oh.make_tensor_value_info("w", F, [4, 4])
    nodes = [oh.make_node("Relu", ["x"], ["a"]), oh.make_node("Transpose", ["a"], ["t"], perm=[1, 0]),
             oh.make_node("MatMul", ["t", "w"], ["y"])]
    fused = predict_step_memory(_graph(nodes, [x, w], [oh.make_tensor_value_info("y", F, [8, 4])]))
    assert fused.live.tolist() == [128, 128, 256]  # a, then t as a view of a, then y
    # Read by a Relu too, the Transpose stays and allocates its own 128 bytes.
    kept = predict_step_memory(_graph(
        [*nodes, oh.make_node("Relu", ["t"], ["r"])], [x, w],
        [oh.make_tensor_value_info("y", F, [8, 4]), oh.make_tensor_value_info("r", F, [8, 4])],
    ))
    # ORT's walk: r's chain first (a, t, r), then y; a dies after t, r (an output) stays.
    assert kept.live.tolist() == [128, 256, 256, 384]


def test_a_node_of_initializers_alone_is_folded_unless_an_initializer_can_be_fed():
    """c = Transpose(k) of an initializer k[8,4] (128 B), then y = Add(Relu(x), c)."""
    k = oh.make_tensor("k", F, [8, 4], [0.0] * 32)
    nodes = [oh.make_node("Transpose", ["k"], ["c"], perm=[1, 0]), oh.make_node("Relu", ["x"], ["a"]),
             oh.make_node("Add", ["a", "c"], ["y"])]
    x, y = oh.make_tensor_value_info("x", F, [4, 8]), oh.make_tensor_value_info("y", F, [4, 8])
    assert predict_step_memory(_graph(nodes, [x], [y], [k])).peak_bytes == 2 * 128  # a and y
    fed = predict_step_memory(_graph(nodes, [x, oh.make_tensor_value_info("k", F, [8, 4])], [y], [k]))
    assert fed.peak_bytes == 3 * 128  # k is also a graph input: c is computed in the step


def test_a_data_dependent_dim_is_counted_at_the_largest_input():
    """NonZero(x[b,8]) is 2 x n, n the nonzero count, known only when the step runs: at
    b = 4 the prediction bounds n by x's 32 elements (the rows a gather keeps are at most
    the batch's tokens), so a budget it meets is met."""
    x, w = oh.make_tensor_value_info("x", F, ["b", 8]), oh.make_tensor_value_info("w", F, [64, 64])
    model = _graph([oh.make_node("NonZero", ["x"], ["n"]), oh.make_node("Transpose", ["n"], ["t"], perm=[1, 0])],
                   [x, w], [oh.make_tensor_value_info("t", onnx.TensorProto.INT64, None)])
    assert not predict_step_memory(model).exact  # without dims, nothing is bounded
    step = predict_step_memory(model, {"b": 4})  # bounded by x (the batch), not by the weight w
    assert step.exact and len(step.bounded) == 1
    assert step.live.tolist() == [2 * 32 * 8, 2 * 2 * 32 * 8]  # n, then t while n is read


@pytest.mark.parametrize("training_mode, peak", [(1, 8192), (0, 4104)])
def test_a_training_pythonops_ctx_holds_its_saved_inputs_and_its_outputs(training_mode, peak):
    """q, k, v = Relu(x) (1 KiB each) -> fused attention PythonOp -> ctx, out (1 KiB);
    PythonOpGrad(ctx, g) -> dq.  In training mode the bridge's ctx keeps the Function's
    q, k, v (saved) and its out (ORT got a copy): at the PythonOp, q, k, v, the ctx's 4 KiB
    and out.  In inference mode (a recompute made it so) the ctx is its int64 handle."""
    from ortpass.conventions import FUSED_ATTENTION, MS_DOMAIN, SIDE_KEY

    vector = [oh.make_tensor_value_info(n, F, [256]) for n in ("x", "g")]
    nodes = [oh.make_node("Relu", ["x"], [n]) for n in ("q", "k", "v")] + [
        oh.make_node("PythonOp", ["q", "k", "v"], ["ctx", "out"], domain=MS_DOMAIN, func_name=FUSED_ATTENTION,
                     training_mode=training_mode),
        oh.make_node("PythonOpGrad", ["ctx", "g"], ["dq"], domain=MS_DOMAIN, func_name=FUSED_ATTENTION, name="grad"),
    ]
    graph = oh.make_graph(nodes, "g", vector, [oh.make_tensor_value_info(n, F, [256]) for n in ("out", "dq")],
                          value_info=[oh.make_tensor_value_info("ctx", onnx.TensorProto.INT64, []),
                                      *(oh.make_tensor_value_info(n, F, [256]) for n in ("q", "k", "v"))])
    model = ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid(MS_DOMAIN, 1)], ir_version=8))
    model.graph.node(4).metadata_props[SIDE_KEY] = "backward"
    assert predict_step_memory(model).peak_bytes == peak


def test_step_memory_names_values_of_unknown_size():
    model = _view_graph()
    next(n for n in model.graph if n.name == "n5").outputs[0].shape = ir.Shape(["batch", 8])
    step = predict_step_memory(model)
    assert step.unknown == ["u"] and not step.exact
    assert predict_step_memory(model, {"batch": 4}).exact


def _one_node(op: str, inputs, outputs, **attrs) -> ir.Node:
    graph = oh.make_graph(
        [oh.make_node(op, [n for n, _, _ in inputs], [n for n, _, _ in outputs], name="n", **attrs)],
        "one",
        [oh.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [oh.make_tensor_value_info(n, t, s) for n, t, s in outputs],
    )
    return next(iter(ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])).graph))


def test_where_scratch_is_each_branch_broadcast_with_the_condition():
    B = onnx.TensorProto.BOOL
    masked = _one_node("Where", [("c", B, [1, 1, 4, 4]), ("x", F, [2, 3, 4, 4]), ("y", F, [])], [("z", F, [2, 3, 4, 4])])
    # X with the condition: 2*3*4*4 floats; the scalar Y with it: 4*4 floats.
    assert kernel_scratch(masked, None) == 4 * (2 * 3 * 4 * 4 + 4 * 4)
    full = _one_node("Where", [("c", B, ["b", 3]), ("x", F, [1]), ("y", F, ["b", 3])], [("z", F, ["b", 3])])
    assert kernel_scratch(full, {"b": 5}) == 2 * 4 * 5 * 3  # twice the output
    assert kernel_scratch(full, None) == 0  # unknown dims: not guessed


def test_cross_entropy_scratch_is_two_logits_one_of_them_its_log_prob_output():
    I64 = onnx.TensorProto.INT64
    inputs = [("logits", F, [6, 10]), ("labels", I64, [6])]
    with_log_prob = _one_node("SoftmaxCrossEntropyLoss", inputs, [("loss", F, []), ("log_prob", F, [6, 10])])
    alone = _one_node("SoftmaxCrossEntropyLoss", inputs, [("loss", F, [])])
    assert kernel_scratch(with_log_prob, None) == 6 * 10 * 4
    assert kernel_scratch(alone, None) == 2 * 6 * 10 * 4
    assert kernel_scratch(_one_node("Relu", [("x", F, [6, 10])], [("y", F, [6, 10])]), None) == 0


# -- the cost model ------------------------------------------------------------------------------


def test_a_matmul_costs_2mnk_flops_and_an_add_only_its_bytes():
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["a", "b"], ["c"], name="mm"), oh.make_node("Add", ["c", "c"], ["d"], name="add")],
        "mm",
        [oh.make_tensor_value_info("a", F, ["m", 16]), oh.make_tensor_value_info("b", F, [16, 8])],
        [oh.make_tensor_value_info("d", F, ["m", 8])],
    )
    model = ir.from_proto(onnx.shape_inference.infer_shapes(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])))
    mm, add = list(model.graph)
    assert node_work(mm, {"m": 4}) == (2 * 4 * 8 * 16, 4 * (4 * 16 + 16 * 8 + 4 * 8))
    assert node_work(add, {"m": 4}) == (0, 4 * 3 * 4 * 8)


def test_the_machine_is_calibrated_once_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTPASS_CACHE_DIR", str(tmp_path))
    first = CALIBRATED()
    assert first.source == "calibrated" and first.seconds_per_flop > 0 and first.seconds_per_byte > 0
    stored = json.loads((tmp_path / "cost_model.json").read_text())
    assert len(stored) == 1
    second = CALIBRATED()
    assert (second.seconds_per_flop, second.seconds_per_byte) == (first.seconds_per_flop, first.seconds_per_byte)
    assert second.source == str(tmp_path / "cost_model.json")


# -- the budget's forms ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "budget, expected",
    [(1 << 20, ("bytes", 1 << 20)), ("300MiB", ("bytes", 300 << 20)), ("1.5 GB", ("bytes", 1.5e9)), (0.25, ("fraction", 0.25)), (0.0, ("fraction", 0.0))],
)
def test_a_budget_is_bytes_a_size_with_a_unit_or_a_fraction(budget, expected):
    assert parse_budget(budget) == expected


@pytest.mark.parametrize(
    "budget, message",
    [(True, "not True"), (-1, "at least 0"), (1.5, "between 0"), ("lots", "not a size"), ("3 parsecs", "not a size"), ([1], "not \\[1\\]")],
)
def test_a_bad_budget_is_refused_naming_it(budget, message):
    with pytest.raises(PlanError, match=message):
        RecomputePass(budget=budget)


def test_a_budget_with_a_level_or_plans_is_refused():
    with pytest.raises(PlanError, match="chooses the plans itself"):
        RecomputePass(budget=0.5, level=1)
    with pytest.raises(PlanError, match="chooses the plans itself"):
        FixDropoutSeedPass("Gelu+:1:-1", budget=0.5)


def test_a_pipeline_string_takes_a_budget_and_refuses_a_bad_one():
    assert "budget=0.5" in repr(ortpass.pipeline("fix-dropout-seed(budget=0.5),recompute(budget=0.5)", assume=["training-graph"]).passes[-1])
    with pytest.raises((PipelineSpecError, PlanError), match="not a size"):
        ortpass.pipeline("recompute(budget='huge')", assume=["training-graph"])


# -- the planner on a decoder ----------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def fixed_costs(monkeypatch):
    """The passes price recompute with :data:`COSTS` too (not this machine's calibration)."""
    monkeypatch.setattr(CostModel, "for_this_machine", classmethod(lambda cls: COSTS))


@pytest.fixture(scope="module")
def decoder_graph() -> ir.Model:
    torch.manual_seed(0)
    model = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, max_seq=16, dropout=0.2)
    ids = torch.randint(0, 64, (2, 16))
    return build_training_graph(export(model, (ids, ids), input_names=["input_ids", "labels"]))


def _plan(model: ir.Model, budget):
    report = find_recompute_candidates(model, min_elements=0)
    return plan_for_budget(model, report, budget, COSTS)


def test_the_plan_fits_its_budget_and_a_looser_budget_costs_less(decoder_graph):
    tight, middle, loose = (_plan(decoder_graph, f) for f in (0.0, 0.5, 1.0))
    assert tight.peak_floor < tight.peak_without  # recompute can lower this step's peak
    assert tight.predicted_peak == tight.peak_floor and tight.chosen
    assert loose.chosen == [] and loose.predicted_peak == loose.peak_without
    assert middle.predicted_peak <= middle.target_bytes < middle.peak_without
    assert middle.target_bytes == int(tight.peak_floor + 0.5 * (tight.peak_without - tight.peak_floor))
    assert 0 < middle.added_seconds < tight.added_seconds
    assert len({o.entry for o in tight.chosen}) == len(tight.chosen)  # one subgraph per stashed activation


def test_the_predicted_peak_is_the_rewritten_graphs(decoder_graph):
    middle = _plan(decoder_graph, 0.5)
    model = decoder_graph.clone()
    result = ortpass.PassManager([FixDropoutSeedPass(budget=middle.target_bytes), RecomputePass(budget=middle.target_bytes)], assume=["training-graph"])(model)
    counts = result.report["recompute"].stats["counts"]
    assert counts["predicted peak bytes"] == predict_step_memory(result.model).peak_bytes <= middle.target_bytes


def test_the_budget_is_judged_on_the_graph_the_pipeline_ends_with(decoder_graph):
    # replay-dropout-mask stops the forward Dropouts producing their masks, which lowers
    # the peak without recompute: a budget between the two peaks needs recompute only
    # where the pipeline ends with the recompute pass.
    def run(*after):
        passes = [FixDropoutSeedPass(budget=budget), RecomputePass(budget=budget), *after]
        return ortpass.PassManager(passes, assume=["training-graph"])(decoder_graph.clone()), passes

    finished = predict_step_memory(ReplayDropoutMaskPass()(decoder_graph.clone()).model).peak_bytes
    unfinished = predict_step_memory(decoder_graph).peak_bytes
    assert finished < unfinished
    budget = (finished + unfinished) // 2
    ended, passes = run(ReplayDropoutMaskPass(), OrderBackwardJoinsPass())
    assert not any(n.name.endswith("_recompute") for n in ended.model.graph)
    counts = ended.report["recompute"].stats["counts"]
    assert counts["predicted peak bytes"] == predict_step_memory(ended.model).peak_bytes == finished <= budget
    assert all(p.following == () for p in passes)  # lent for the call only
    alone, _ = run()
    assert any(n.name.endswith("_recompute") for n in alone.model.graph)
    assert alone.report["recompute"].stats["counts"]["predicted peak bytes"] <= budget


def test_a_budget_under_the_lowest_reachable_peak_names_that_peak_and_changes_nothing(decoder_graph):
    floor = _plan(decoder_graph, 0.0).peak_floor
    model = decoder_graph.clone()
    before = ir.to_proto(model).SerializeToString()
    with pytest.raises(PassFailedError, match=f"smallest step peak recompute reaches in this graph, {floor / 2**20:.1f} MiB"):
        ortpass.PassManager([FixDropoutSeedPass(budget=floor - 1), RecomputePass(budget=floor - 1)], assume=["training-graph"])(model)
    assert ir.to_proto(model).SerializeToString() == before


def test_a_budget_the_step_fits_already_recomputes_nothing(decoder_graph):
    model = decoder_graph.clone()
    result = ortpass.PassManager([FixDropoutSeedPass(budget="1GiB"), RecomputePass(budget="1GiB")], assume=["training-graph"])(model)
    assert not any(n.name.endswith("_recompute") for n in result.model.graph)
    assert result.report["recompute"].stats["counts"]["predicted peak bytes"] == predict_step_memory(decoder_graph).peak_bytes


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_budget_recompute_changes_no_number_on_ort(decoder_graph, fraction):
    batch = {"input_ids": np.random.default_rng(0).integers(0, 64, (2, 16)), "labels": np.random.default_rng(1).integers(0, 64, (2, 16))}
    chosen = _plan(decoder_graph, fraction).chosen
    dropouts = {n.name for o in chosen for n in o.nodes if n.op_type == "Dropout"}
    # Both graphs seed the dropouts the budget recomputes, so both draw the same masks.
    baseline = decoder_graph.clone()
    for node in baseline.graph:
        if node.name in dropouts:
            node.attributes["seed"] = ir.AttrInt64("seed", dropout_seed(node, 0))
    recomputed = ortpass.PassManager(
        [FixDropoutSeedPass(budget=fraction), RecomputePass(budget=fraction)], assume=["training-graph"]
    )(decoder_graph.clone()).model
    assert any(n.name.endswith("_recompute") for n in recomputed.graph)
    expected_session, got_session = TrainingSession(baseline), TrainingSession(recomputed)
    for step in range(2):
        expected, got = expected_session.run(batch, seed=step), got_session.run(batch, seed=step)
        assert got.loss == expected.loss
        for name, grad in expected.gradients.items():
            np.testing.assert_array_equal(got.gradients[name], grad, err_msg=name)


# -- the pipeline text and the wrapper --------------------------------------------------------------------


def test_a_memory_budget_replaces_the_plan_options_of_both_recompute_passes():
    from ortpass.infra.pipeline_text import with_memory_budget

    spec = "build-training-graph,fix-dropout-seed(level=1,base_seed=3),recompute(level=1,probe_level=0),order-backward-joins"
    assert with_memory_budget(spec, "6GiB") == (
        "build-training-graph,fix-dropout-seed(base_seed=3,budget='6GiB'),recompute(probe_level=0,budget='6GiB'),order-backward-joins"
    )
    # Without a seeding pass, one choosing as recompute does is added before it.
    assert with_memory_budget("recompute(plans='Gelu+:1:-1',min_elements=0)", 0.5) == (
        "fix-dropout-seed(min_elements=0,budget=0.5),recompute(min_elements=0,budget=0.5)"
    )
    with pytest.raises(PipelineSpecError, match="needs a recompute pass"):
        with_memory_budget("build-training-graph,order-backward-joins", 0.5)
    # The LM head's slices are chosen by the budget too, unless their width is given.
    assert with_memory_budget("chunk-lm-head-loss,recompute", "1GiB") == (
        "chunk-lm-head-loss(budget='1GiB'),fix-dropout-seed(budget='1GiB'),recompute(budget='1GiB')"
    )
    assert with_memory_budget("chunk-lm-head-loss(chunk=512),recompute", 0.5).startswith("chunk-lm-head-loss(chunk=512),")
    assert with_memory_budget("chunk-lm-head-loss(logits_last=True),recompute", 0.5).startswith(
        "chunk-lm-head-loss(logits_last=True,budget=0.5),"
    )


def test_the_wrapper_refuses_a_bad_budget_when_wrapping():
    from ortpass.runtime.module import ORTModule

    with pytest.raises(PlanError, match="not a size"):
        ORTModule(torch.nn.Linear(2, 2), memory_budget="lots")
    with pytest.raises(PipelineSpecError, match="needs a recompute pass"):
        ORTModule(torch.nn.Linear(2, 2), pipeline="build-training-graph", memory_budget=0.5)


def _step(optimizers, losses) -> None:
    for optimizer, loss in zip(optimizers, losses):
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _assert_parameters_match(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert ((p - ref).abs().max() / max(ref.abs().max().item(), 1.0)).item() <= 1e-4, name


@pytest.mark.parametrize("loss_in", ["module", "torch"])
def test_the_wrapper_trains_like_torch_eager_under_a_memory_budget(loss_in):
    """HF LLaMA (2 layers) for 5 AdamW steps under the tightest budget, its loss returned by
    the module or computed in torch from the logits: every loss and parameter as torch's."""
    transformers = pytest.importorskip("transformers")
    from ortpass.runtime.module import ORTModule

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, memory_budget=0.0)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (wrapped, reference)]
    generator = torch.Generator().manual_seed(1)

    def loss_of(module, ids):
        if loss_in == "module":
            return module(input_ids=ids, labels=ids, use_cache=False).loss
        logits = module(input_ids=ids, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))

    for step in range(5):
        ids = torch.randint(0, 256, (2, 32), generator=generator)
        losses = [loss_of(m, ids) for m in (wrapped, reference)]
        assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-4), f"step {step}"
        _step(optimizers, losses)
    _assert_parameters_match(model, reference)
    counts = wrapped.transitions.current_graph.report["recompute"].stats["counts"]
    assert counts["occurrences recomputed"] > 0
    assert counts["predicted peak bytes"] <= counts["budget target bytes"]


def test_a_batch_the_budgeted_graph_would_not_fit_gets_a_graph_planned_at_its_sizes():
    """A byte budget the first batch (2) meets without recompute: at batch 3 that graph
    would go over it, and the wrapper plans again there (recomputing), then goes back to
    the first graph at batch 2; at batch 8 no recompute reaches the budget, and the call
    says so.  Losses as torch eager's throughout."""
    from ortpass.runtime.module import ORTModule

    torch.manual_seed(0)
    model = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, max_seq=64, dropout=0.0)
    reference = copy.deepcopy(model)
    probe = ORTModule(copy.deepcopy(model), memory_budget="1TiB")  # recomputes nothing: the peak without
    ids = torch.randint(0, 64, (2, 32))
    probe(ids, ids.roll(-1, 1)).backward()
    without = probe.transitions.current_graph.report["recompute"].stats["counts"]["predicted peak bytes"]
    wrapped = ORTModule(model, memory_budget=without)
    for batch in (2, 3, 2):
        ids = torch.randint(0, 64, (batch, 32))
        loss = wrapped(ids, ids.roll(-1, 1))
        assert loss.item() == pytest.approx(reference(ids, ids.roll(-1, 1)).item(), rel=1e-5)
        loss.backward()
    assert [action for action, _ in wrapped.transitions.transitions] == ["export", "export", "switch"]
    assert "over the memory budget" in wrapped.transitions.transitions[1][1]
    (first, second), = ([graph for _, graph in graphs] for graphs in wrapped.transitions._graphs.values())
    assert "occurrences recomputed" not in first.report["recompute"].stats["counts"]
    counts = second.report["recompute"].stats["counts"]
    assert counts["occurrences recomputed"] > 0 and counts["predicted peak bytes"] <= without
    with pytest.raises(PassFailedError, match="smallest step peak recompute reaches"):
        ids = torch.randint(0, 64, (8, 32))
        wrapped(ids, ids.roll(-1, 1))


def test_the_wrapper_under_a_budget_trains_like_torch_with_frozen_and_eval_submodules():
    """The loops real training runs: the embedding and the first block frozen, the first
    block in eval mode (its dropout 0.1 off), a batch size that changes every step; every
    loss as torch eager's, and the trainable parameters after AdamW as well."""
    from ortpass.runtime.module import ORTModule

    torch.manual_seed(0)
    model = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, max_seq=64, dropout=0.1)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and not name.startswith("blocks.0."):
            module.p = 0.0  # train-mode dropout elsewhere would draw masks torch cannot match
    model.tok.requires_grad_(False)
    model.blocks[0].requires_grad_(False)
    model.blocks[0].eval()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, memory_budget=0.0)
    # eps 1e-6: the key biases' gradient is analytically zero, rounding noise Adam would
    # otherwise scale up to full steps, differently in the two runs (as tests/test_module.py).
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, eps=1e-6) for m in (wrapped, reference)]
    for step, batch in enumerate((2, 3, 4, 3)):
        ids = torch.randint(0, 64, (batch, 32))
        losses = [m(ids, ids.roll(-1, 1)) for m in (wrapped, reference)]
        assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-5), f"step {step}"
        _step(optimizers, losses)
    _assert_parameters_match(model, reference)
    assert wrapped.transitions.current_graph.report["recompute"].stats["counts"]["occurrences recomputed"] > 0
