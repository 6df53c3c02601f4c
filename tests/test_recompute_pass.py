"""RecomputePass: plan options, the rewrite's structure, errors, and parity on ORT.

Hand-built graphs have answers worked out by hand; the decoder tests check on ONNX
Runtime that recompute changes no number (dropout > 0, seeded in both graphs so both
draw the same masks), and that the clones survive in the graph ORT actually runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
import torch

import ortpass
from ortpass.analysis import find_layer_boundaries, get_partition
from ortpass.analysis.partition import TrainingInfo, set_training_info, tag
from ortpass.conventions import RECOMPUTE_OF_KEY, SIDE_KEY
from ortpass.errors import PassOrderingError, PipelineSpecError, PlanError
from ortpass.export import export
from ortpass.passes import FixDropoutSeedPass, RecomputePass
from ortpass.runtime import TrainingSession
from ortpass.runtime.session import DISABLED_ORT_OPTIMIZERS
from ortpass.testing.models import GPTDecoder
from ortpass.testing.profiling import ort_execution_order
from ortpass.training import build_training_graph

F = onnx.TensorProto.FLOAT


def gelu_training_graph() -> ir.Model:
    """Forward: h = x*w (Mul), a = Gelu(h) (opset 20), y = a*w2, loss = ReduceSum(y).
    Backward (hand-written, tagged): reads `a` (stashed) and `h` (stashed).

    The plan `Gelu+:1:-1` clones Gelu reading h; only the backward consumer of `a` moves.
    """
    nodes = [
        ("forward", oh.make_node("Mul", ["x", "w"], ["h"], name="mul")),
        ("forward", oh.make_node("Gelu", ["h"], ["a"], name="gelu")),
        ("forward", oh.make_node("Mul", ["a", "w2"], ["y"], name="mul2")),
        ("forward", oh.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0)),
        ("backward", oh.make_node("Mul", ["a", "x"], ["w2_grad"], name="w2_grad_mul")),
        ("backward", oh.make_node("Mul", ["h", "w2"], ["w_grad"], name="w_grad_mul")),
    ]
    shape = [4, 8]
    graph = oh.make_graph(
        [n for _, n in nodes],
        "gelu",
        [oh.make_tensor_value_info(n, F, shape) for n in ("x", "w", "w2")],
        [oh.make_tensor_value_info("loss", F, []), *(oh.make_tensor_value_info(n, F, shape) for n in ("w_grad", "w2_grad"))],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)], ir_version=8)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    for (side, _), node in zip(nodes, model.graph):
        tag(node, side)
    set_training_info(model, TrainingInfo("loss", ("w", "w2"), {"w": "w_grad", "w2": "w2_grad"}))
    return model


def _node(model: ir.Model, name: str) -> ir.Node:
    return next(n for n in model.graph if n.name == name)


# -- plan options ---------------------------------------------------------------------------


def test_gelu_plan_clones_gelu_and_moves_only_the_backward_consumer():
    model = gelu_training_graph()
    pass_ = RecomputePass("Gelu+:1:-1", min_elements=0)
    result = pass_(model)
    assert result.modified
    clone = _node(model, "gelu_recompute")
    original = _node(model, "gelu")
    assert clone.op_type == "Gelu" and clone.inputs[0] is original.inputs[0]  # reads h, as ORT's test
    assert clone.outputs[0].name == "a_recompute"
    assert clone.metadata_props[SIDE_KEY] == "backward"
    assert clone.metadata_props[RECOMPUTE_OF_KEY] == "gelu"
    assert _node(model, "w2_grad_mul").inputs[0] is clone.outputs[0]  # backward moved
    assert _node(model, "mul2").inputs[0] is original.outputs[0]  # forward kept
    # Placed right before its first backward consumer; the graph is still sorted.
    names = [n.name for n in model.graph]
    assert names.index("gelu_recompute") == names.index("w2_grad_mul") - 1
    onnx.checker.check_model(ir.to_proto(model))
    assert [a.plan for a in pass_.applied] == ["Gelu+:1:-1"] and pass_.applied[0].applied == 1
    assert pass_.applied[0].saving_bytes == 4 * 8 * 4  # a: float[4, 8]
    assert pass_.stats["counts"]["nodes cloned"] == 1


def leaf_chain_training_graph() -> ir.Model:
    """The gelu graph's forward, and a backward laid out as ORT's pre-gradient fusions
    leave it, with the weight-gradient chain after all of backward:

    - ``d1 = a * x`` (reads the stashed ``a``) feeds the leaf ``b1_sum`` and the chain
      ``w1_transpose -> w1_neg`` (the leaf), which only ``w1_neg`` reads;
    - ``d2 = d1 * h`` (reads the stashed ``h``) feeds the leaves ``b2_sum`` and ``b3_max``.
    """
    nodes = [
        ("forward", oh.make_node("Mul", ["x", "w"], ["h"], name="mul")),
        ("forward", oh.make_node("Gelu", ["h"], ["a"], name="gelu")),
        ("forward", oh.make_node("Mul", ["a", "w2"], ["y"], name="mul2")),
        ("forward", oh.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0)),
        ("backward", oh.make_node("Mul", ["a", "x"], ["d1"], name="d1_mul")),
        ("backward", oh.make_node("ReduceSum", ["d1"], ["b1_grad"], name="b1_sum", keepdims=0)),
        ("backward", oh.make_node("Mul", ["d1", "h"], ["d2"], name="d2_mul")),
        ("backward", oh.make_node("ReduceSum", ["d2"], ["b2_grad"], name="b2_sum", keepdims=0)),
        ("backward", oh.make_node("ReduceMax", ["d2"], ["b3_grad"], name="b3_max", keepdims=0)),
        ("backward", oh.make_node("Transpose", ["d1"], ["w1_t"], name="w1_transpose")),
        ("backward", oh.make_node("Neg", ["w1_t"], ["w1_grad"], name="w1_neg")),
    ]
    scalar_grads = ("b1_grad", "b2_grad", "b3_grad")
    graph = oh.make_graph(
        [n for _, n in nodes],
        "leaf_chain",
        [oh.make_tensor_value_info(n, F, [4, 8]) for n in ("x", "w", "w2", "b3")],
        [
            oh.make_tensor_value_info("loss", F, []),
            *(oh.make_tensor_value_info(n, F, []) for n in scalar_grads),
            oh.make_tensor_value_info("w1_grad", F, [8, 4]),
        ],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)], ir_version=8)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    for (side, _), node in zip(nodes, model.graph):
        tag(node, side)
    grads = {"x": "b1_grad", "w": "w1_grad", "w2": "b2_grad", "b3": "b3_grad"}
    set_training_info(model, TrainingInfo("loss", tuple(grads), grads))
    return model


def test_a_leaf_moves_with_the_chain_only_it_reads_ranked_by_when_its_inputs_exist():
    model = leaf_chain_training_graph()
    assert RecomputePass("Gelu+:1:-1", min_elements=0)(model).modified
    names = [n.name for n in model.graph]
    # ORT's default order walks leaves from the last one in graph order.  Units by when
    # their outside inputs exist: b1_sum and the w1 chain after d1_mul (b1_sum first: it
    # sits earlier), b2_sum and b3_max after d2_mul.  The first ready goes last.  Ranked
    # by the leaves' own positions, w1_neg (last in the graph) would be walked last and
    # keep d1 alive to the end of the step.
    assert names[-7:] == ["d1_mul", "d2_mul", "b3_max", "b2_sum", "w1_transpose", "w1_neg", "b1_sum"]
    assert names.index("gelu_recompute") == names.index("d1_mul") - 1
    onnx.checker.check_model(ir.to_proto(model))


def test_plans_given_as_list_string_and_file_give_the_same_graph(tmp_path):
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(["Gelu+:1:-1"]))
    graphs = []
    for options in ({"plans": "Gelu+:1:-1"}, {"plans": ["Gelu+:1:-1"]}, {"config_file": path}):
        model = gelu_training_graph()
        RecomputePass(**options, min_elements=0)(model)
        graphs.append([(n.name, n.op_type, [v.name for v in n.inputs]) for n in model.graph])
    assert graphs[0] == graphs[1] == graphs[2]


def test_a_plan_that_matches_nothing_leaves_the_model_unchanged():
    model = gelu_training_graph()
    before = ir.to_proto(model).SerializeToString()
    result = RecomputePass("Tile+:1:-1", min_elements=0)(model)
    assert not result.modified
    assert ir.to_proto(model).SerializeToString() == before


def test_level_0_without_plans_does_nothing():
    model = gelu_training_graph()
    assert not RecomputePass(min_elements=0)(model).modified


@pytest.mark.parametrize(
    "options, message",
    [
        ({"plans": "Gelu+:1"}, "Gelu\\+:1"),
        ({"plans": "Gelu:1:-1"}, "Gelu"),
        ({"plans": "Gelu+:7:-1"}, "type"),
        ({"plans": "Gelu+:1:-1,,"}, "empty plan"),
        ({"config_file": "/nonexistent/plans.json"}, "does not exist"),
        ({"level": 1, "plans": "Gelu+:1:-1"}, "level 1"),
    ],
)
def test_bad_plan_options_raise_plan_error_naming_the_problem(options, message):
    with pytest.raises(PlanError, match=message):
        RecomputePass(**options)


def test_bad_json_file_raises_plan_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[\"Gelu+:1:-1\",")
    with pytest.raises(PlanError, match="not valid JSON"):
        RecomputePass(config_file=bad)
    not_a_list = tmp_path / "dict.json"
    not_a_list.write_text('{"plan": "Gelu+:1:-1"}')
    with pytest.raises(PlanError, match="list"):
        RecomputePass(config_file=not_a_list)


def test_bad_level_is_refused():
    with pytest.raises(ValueError, match="level"):
        RecomputePass(level=3)


def test_bad_plan_in_a_pipeline_fails_before_touching_the_model():
    # The pipeline names the pass and its options, and keeps the PlanError as the cause.
    with pytest.raises(PipelineSpecError, match=r"recompute.*Gelu\+:x:-1") as caught:
        ortpass.pipeline("recompute(plans='Gelu+:x:-1')")
    assert isinstance(caught.value.__cause__, PlanError)


# -- ordering and dropout seeds -------------------------------------------------------------------


def test_the_manager_runs_fix_dropout_seed_first_from_declarations():
    manager = ortpass.PassManager(
        [RecomputePass(level=1), FixDropoutSeedPass(level=1)], assume=["training-graph"]
    )
    assert [p.name for p in manager.passes] == ["fix-dropout-seed", "recompute"]


def test_recompute_alone_requires_seeded_dropouts():
    with pytest.raises(PassOrderingError, match="dropout-seeds-fixed"):
        ortpass.PassManager([RecomputePass(level=1)], assume=["training-graph"])


# -- a decoder from build_training_graph -----------------------------------------------------------


@pytest.fixture(scope="module")
def decoder_graph() -> ir.Model:
    torch.manual_seed(0)
    model = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, max_seq=16, dropout=0.2)
    ids = torch.randint(0, 64, (2, 16))
    return build_training_graph(export(model, (ids, ids), input_names=["input_ids", "labels"]))


@pytest.fixture(scope="module")
def decoder_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"input_ids": rng.integers(0, 64, (2, 16)), "labels": rng.integers(0, 64, (2, 16))}


def _rewrite(model: ir.Model, level: int, recompute: bool) -> tuple[ir.Model, RecomputePass | None]:
    # min_elements=0: the test model's tensors are far below ORT's 1Mi-element floor.
    passes = [FixDropoutSeedPass(level=level, min_elements=0)]
    recompute_pass = RecomputePass(level=level, min_elements=0) if recompute else None
    if recompute_pass is not None:
        passes.append(recompute_pass)
    return ortpass.PassManager(passes, assume=["training-graph"])(model).model, recompute_pass


def test_unseeded_dropout_is_refused_and_the_model_unchanged(decoder_graph):
    model = ir.from_proto(ir.to_proto(decoder_graph))
    before = ir.to_proto(model).SerializeToString()
    with pytest.raises(ir.passes.PreconditionError, match="seed"):
        RecomputePass(level=1, min_elements=0)(model)
    assert ir.to_proto(model).SerializeToString() == before


@pytest.mark.parametrize("level", [1, 2])
def test_recompute_changes_no_number_on_ort(decoder_graph, decoder_batch, level):
    baseline, _ = _rewrite(decoder_graph, level, recompute=False)
    recomputed, pass_ = _rewrite(decoder_graph, level, recompute=True)
    assert pass_.stats["counts"]["nodes cloned"] > 0
    assert any(n.op_type == "Dropout" and n.name.endswith("_recompute") for n in recomputed.graph)
    expected_session, got_session = TrainingSession(baseline), TrainingSession(recomputed)
    for step in range(2):  # masks change between steps, and the clones follow
        # Dropouts recompute leaves alone keep no seed: reseed ORT's global generator alike.
        expected, got = expected_session.run(decoder_batch, seed=step), got_session.run(decoder_batch, seed=step)
        assert got.loss == expected.loss
        for name, grad in expected.gradients.items():
            np.testing.assert_array_equal(got.gradients[name], grad, err_msg=name)


def test_level_1_keeps_only_layer_checkpoints_inside_layers(decoder_graph):
    """Layer-wise checkpointing: after level 1, the forward values backward (originals and
    clones) reads from inside a layer are each layer's input, the last layer's output,
    the last Dropout's mask and at most Reshape shapes (a few int64s; ORT's pre-gradient constant folding usually
    leaves none); everything else in a layer is recomputed.  Before the
    fixes, Gelu's Erf chain, q/k/v (their Reshape shapes come from Concat), the final
    residual and the last layer's tail stayed stashed."""
    recomputed, _ = _rewrite(decoder_graph, 1, recompute=True)
    partition = get_partition(recomputed)
    layers = find_layer_boundaries(partition.forward)
    assert len(layers) == 2
    position = {node: i for i, node in enumerate(partition.forward)}
    inside = [v for v in partition.stashed if layers.layer_of(position[v.producer()]) is not None]
    checkpoints = [v for v in inside if layers.is_checkpoint(v)]
    assert [v.name for v in checkpoints] == ["/blocks.0/Add_2_output_0", "/blocks.1/Add_2_output_0"]
    # Each layer's last Dropout keeps its mask: a clone would also compute the Dropout's
    # output, which only the checkpoint Add reads in forward, so nothing would read it.
    masks = [v for v in inside if v.producer().op_type == "Dropout" and v.index() == 1]
    assert [v.name for v in masks] == ["/blocks.0/drop_1/Dropout_output_1", "/blocks.1/drop_1/Dropout_output_1"]
    assert all(
        [u.node.op_type for u in v.producer().outputs[0].uses()] == ["Add"]
        and layers.is_checkpoint(v.producer().outputs[0].uses()[0].node.outputs[0])
        for v in masks
    )
    others = [v for v in inside if v not in checkpoints and v not in masks]
    assert all(v.dtype == ir.DataType.INT64 and len(v.shape) == 1 for v in others)
    assert all(v.uses() and all(u.node.op_type == "Reshape" for u in v.uses() if u.node.name.endswith("_recompute"))
               for v in others)
    # The first layer's input is produced outside the layers (the embedding Add) and kept.
    assert any(v.name == "/Add_output_0" and layers.is_checkpoint(v) for v in partition.stashed)


def _unread(model: ir.Model) -> list[str]:
    return [v.name for n in model.graph for v in n.outputs if v.name and not v.uses() and not v.is_graph_output()]


def test_recompute_leaves_no_output_that_nobody_reads(decoder_graph):
    # ORT never frees a value nobody reads until the step ends: the forward Dropouts'
    # masks (backward reads the clones') and LayerNorms' statistics are dropped.
    baseline, _ = _rewrite(decoder_graph, 1, recompute=False)
    recomputed, _ = _rewrite(decoder_graph, 1, recompute=True)
    assert _unread(baseline) == []
    assert _unread(recomputed) == []
    recomputed_names = {n.metadata_props[RECOMPUTE_OF_KEY] for n in recomputed.graph if RECOMPUTE_OF_KEY in n.metadata_props}
    for node in recomputed.graph:
        if node.name in recomputed_names and node.op_type in ("Dropout", "LayerNormalization"):
            assert len(node.outputs) == 1, node.name
    baseline_dropouts = [n for n in baseline.graph if n.op_type == "Dropout"]
    assert baseline_dropouts and all(len(n.outputs) == 2 for n in baseline_dropouts)


def test_a_forward_node_only_backward_read_is_removed_once_recomputed():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4, 8]))
    w = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4, 8]))
    relu = ir.node("Relu", [x], name="relu")  # forward: loss
    neg = ir.node("Neg", [x], name="neg")  # forward, read by backward only
    grad = ir.node("Mul", [neg.outputs[0], w], name="grad")
    relu.outputs[0].name, neg.outputs[0].name, grad.outputs[0].name = "loss", "n", "w_grad"
    for v in (relu.outputs[0], neg.outputs[0], grad.outputs[0]):
        v.type, v.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape([4, 8])
    graph = ir.Graph([x, w], [relu.outputs[0], grad.outputs[0]], nodes=[relu, neg, grad], opset_imports={"": 17})
    model = ir.Model(graph, ir_version=8)
    for node, side in ((relu, "forward"), (neg, "forward"), (grad, "backward")):
        tag(node, side)
    set_training_info(model, TrainingInfo("loss", ("w",), {"w": "w_grad"}))
    RecomputePass("Neg+:1:-1", min_elements=0)(model)
    assert [n.name for n in model.graph] == ["relu", "neg_recompute", "grad"]


def test_without_seeds_the_clone_draws_another_mask(decoder_graph, decoder_batch):
    # Negative control for the test above: strip the seeds after the rewrite and the
    # numbers change.
    baseline, _ = _rewrite(decoder_graph, 1, recompute=False)
    recomputed, _ = _rewrite(decoder_graph, 1, recompute=True)
    for model in (baseline, recomputed):
        for node in model.graph:
            node.attributes.pop("seed", None)
    expected = TrainingSession(baseline).run(decoder_batch, seed=7)
    got = TrainingSession(recomputed).run(decoder_batch, seed=7)
    # Unseeded, every dropout draws from ORT's global generator, so the clones also shift
    # the forward dropouts that run after them: nothing guarantees equal numbers.
    assert got.loss != expected.loss or any(
        not np.array_equal(got.gradients[k], v) for k, v in expected.gradients.items()
    )


def _surviving_clones(recomputed: ir.Model, ort_names: set[str]) -> set[str]:
    """Clones of ``recomputed`` that still compute in the graph ORT optimized.

    ORT fuses some clones into a neighbouring clone and names the fused node after it:
    ``<clone>/MatmulTransposeFusion/``, ``<MatMul clone>/MatMulScaleFusion/`` (which also
    absorbed the ``Mul`` clone after it).  A clone merged back by CSE leaves no trace.
    """

    def present(name: str) -> bool:
        return _present(name, ort_names)

    clones = [n for n in recomputed.graph if n.name.endswith("_recompute")]
    surviving = {c.name for c in clones if present(c.name)}
    for clone in clones:
        neighbours = [v.producer() for v in clone.inputs if v is not None and v.producer() is not None]
        neighbours += [user for out in clone.outputs for user, _ in out.uses()]
        if any(n.name.endswith("_recompute") and present(n.name) for n in neighbours):
            surviving.add(clone.name)
    return surviving


def _present(name: str, ort_names: set[str]) -> bool:
    """``name`` is in ORT's graph, itself or fused (ORT names a fused node ``<name>/<Fusion>/``)."""
    return name in ort_names or any(other.startswith(name + "/") for other in ort_names)


def _optimized_names(model: ir.Model, path, disabled: list[str]) -> set[str]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(path)
    ort.InferenceSession(
        ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
    )
    return {n.name for n in onnx.load(path).graph.node}


def test_clones_survive_in_the_graph_ort_runs(decoder_graph, tmp_path):
    recomputed, _ = _rewrite(decoder_graph, 1, recompute=True)
    clones = {n.name for n in recomputed.graph if n.name.endswith("_recompute")}
    path = tmp_path / "ort_optimized.onnx"
    TrainingSession(recomputed, optimized_model_path=path)  # the session the tests run
    ort_names = {n.name for n in onnx.load(path).graph.node}
    assert clones and _surviving_clones(recomputed, ort_names) == clones


def test_graphs_without_pythonops_keep_ort_thread_spinning(decoder_graph):
    recomputed, _ = _rewrite(decoder_graph, 1, recompute=True)
    options = TrainingSession(recomputed)._session.get_session_options()
    with pytest.raises(RuntimeError, match="does not have configuration"):  # unset: ORT's default, spin
        options.get_session_config_entry("session.intra_op.allow_spinning")


def test_your_own_session_options_are_used_and_the_clones_still_survive(decoder_graph, tmp_path):
    import onnxruntime as ort

    recomputed, _ = _rewrite(decoder_graph, 1, recompute=True)
    clones = {n.name for n in recomputed.graph if n.name.endswith("_recompute")}
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.enable_profiling = True  # proof that these options, not ortpass's, made the session
    options.profile_file_prefix = str(tmp_path / "profile")
    path = tmp_path / "ort_optimized.onnx"
    session = TrainingSession(recomputed, optimized_model_path=path, session_options=options)
    assert Path(session._session.end_profiling()).is_file()
    ort_names = {n.name for n in onnx.load(path).graph.node}
    assert clones and _surviving_clones(recomputed, ort_names) == clones


def test_common_subexpression_elimination_would_merge_clones(decoder_graph, tmp_path):
    # Why sessions must disable it: with ORT's CSE on, a clone and its original become one
    # node (which one survives depends on ORT's topological order), so forward and backward
    # share a value again and nothing is recomputed.  Only CSE differs between the sessions.
    recomputed, _ = _rewrite(decoder_graph, 1, recompute=True)
    clones = [n for n in recomputed.graph if n.name.endswith("_recompute")]
    others = [name for name in DISABLED_ORT_OPTIMIZERS if name != "CommonSubexpressionElimination"]
    cse_names = _optimized_names(recomputed, tmp_path / "cse.onnx", others)
    no_cse_names = _optimized_names(recomputed, tmp_path / "no_cse.onnx", list(DISABLED_ORT_OPTIMIZERS))

    def pairs(names: set[str]) -> set[str]:
        """Clones that survive next to their original."""
        surviving = _surviving_clones(recomputed, names)
        return {
            c.name for c in clones
            if c.name in surviving and _present(c.metadata_props[RECOMPUTE_OF_KEY], names)
        }

    assert _surviving_clones(recomputed, no_cse_names) == {c.name for c in clones}
    assert pairs(cse_names) < pairs(no_cse_names)  # (an original fused under another name drops out of both)


@pytest.fixture(scope="module")
def fused_decoder_graph() -> ir.Model:
    """The decoder built with ORT's pre-gradient fusions, which re-sort the graph: the
    weight-gradient Reshape-Gemm-Transpose chains come after all of backward."""
    torch.manual_seed(0)
    model = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, max_seq=16, dropout=0.2)
    ids = torch.randint(0, 64, (2, 16))
    return build_training_graph(export(model, (ids, ids), input_names=["input_ids", "labels"]), ort_fusions=True)


def _ort_execution_order(model: ir.Model, tmp_path) -> list[str]:
    feeds = {"input_ids": np.zeros((2, 16), np.int64), "labels": np.zeros((2, 16), np.int64)}
    return ort_execution_order(model, feeds, tmp_path)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "ort-fusions"])
def test_clones_and_gradient_outputs_run_when_backward_needs_them_on_ort(decoder_graph, fused_decoder_graph, fused, tmp_path):
    """ORT's default order, profiled: no clone runs before the loss (forward keeps only the
    checkpoints), and every gradient output of the last layer (bias ReduceSums, weight
    gradients: leaves, moved to the end of the graph) runs before any clone of the first
    layer, not at the end of the step where it would keep its inputs alive: the properties
    the memory saving rests on.  With ORT's fusions the weight-gradient chains sit after
    all of backward in the graph as built, and ranking leaves by position deferred them
    (and the bias gradients ranked alike) to the end of the step."""
    recomputed, _ = _rewrite(fused_decoder_graph if fused else decoder_graph, 1, recompute=True)
    order = _ort_execution_order(recomputed, tmp_path)
    loss = order.index("/loss/SoftmaxCrossEntropyLoss")
    assert not [name for name in order[:loss] if "_recompute" in name]
    first_layer0_clone = min(i for i, name in enumerate(order) if "/blocks.0/" in name and "_recompute" in name)
    layer1_leaves = {  # nodes that produce a gradient output and that no node reads
        node.name
        for node in recomputed.graph
        if any(out.name.startswith("blocks.1.") and out.is_graph_output() for out in node.outputs)
        and not any(out.uses() for out in node.outputs)
    }
    assert len(layer1_leaves) == 8  # weight and bias of qkv, proj, fc_in and fc_out
    late = [name for name in layer1_leaves if order.index(name) > first_layer0_clone]
    assert not late


def test_recompute_pass_is_registered_post_grad():
    from ortpass.infra.registry import get_pass

    assert get_pass("recompute") is RecomputePass and RecomputePass.phase == "post-grad"
    assert get_pass("fix-dropout-seed") is FixDropoutSeedPass


def test_recompute_reuses_the_analysis_fix_dropout_seed_ran(decoder_graph, monkeypatch):
    import ortpass.analysis.recompute.selection as recompute_module

    calls = []
    real = recompute_module.find_recompute_candidates
    monkeypatch.setattr(recompute_module, "find_recompute_candidates", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    result = ortpass.PassManager(
        [RecomputePass(level=1, min_elements=0), FixDropoutSeedPass(level=1, min_elements=0)], assume=["training-graph"]
    )(decoder_graph)
    assert len(calls) == 1
    assert result.report["recompute"].stats["counts"]["analysis reused"] == 1
    # Alone, each pass analyses the graph itself.
    FixDropoutSeedPass(level=1, min_elements=0)(ir.from_proto(ir.to_proto(decoder_graph)))
    assert len(calls) == 2


def frozen_projection_training_graph() -> ir.Model:
    """A frozen linear layer on a recomputed activation, as a LoRA base is exported:
    a = Gelu(x); v = Reshape(a) (the 2-D view the projection reads); g = MatMul(v, w) with
    ``w`` frozen; y = g * w2.  Backward reads ``a`` (``w2``-side gradient) and ``g`` only
    for its shape (a Reshape gradient's ``Shape``), as ORT's builder does for a frozen base.

    Applying ``Gelu+`` and ``MatMul+`` together, the MatMul clone must read the view of the
    *recomputed* ``a``: reading the forward view keeps the forward ``a`` alive through
    backward, and the Gelu recompute would free nothing.
    """
    nodes = [
        ("forward", oh.make_node("Gelu", ["x"], ["a"], name="gelu")),
        ("forward", oh.make_node("Reshape", ["a", "flat"], ["v"], name="view")),
        ("forward", oh.make_node("MatMul", ["v", "w"], ["g"], name="proj")),
        ("forward", oh.make_node("Mul", ["g", "w2"], ["y"], name="mul2")),
        ("forward", oh.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0)),
        ("backward", oh.make_node("Mul", ["a", "x"], ["x_grad"], name="x_grad_mul")),
        ("backward", oh.make_node("Shape", ["g"], ["g_shape"], name="g_shape")),
    ]
    graph = oh.make_graph(
        [n for _, n in nodes],
        "frozen_projection",
        [oh.make_tensor_value_info("x", F, [2, 4, 8]), oh.make_tensor_value_info("w2", F, [8, 8])],
        [oh.make_tensor_value_info("loss", F, []), oh.make_tensor_value_info("x_grad", F, [2, 4, 8]),
         oh.make_tensor_value_info("g_shape", onnx.TensorProto.INT64, [2])],
        initializer=[onnx.numpy_helper.from_array(np.array([8, 8], dtype=np.int64), "flat"),
                     onnx.numpy_helper.from_array(np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), "w")],
    )  # fmt: skip
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)], ir_version=8)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    for (side, _), node in zip(nodes, model.graph):
        tag(node, side)
    set_training_info(model, TrainingInfo("loss", ("x",), {"x": "x_grad"}))
    return model


def _run_on_ort(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime

    session = onnxruntime.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_a_clone_reads_the_view_of_a_recomputed_value_not_the_forward_one():
    model = frozen_projection_training_graph()
    feeds = {"x": np.linspace(-2, 2, 64, dtype=np.float32).reshape(2, 4, 8), "w2": np.ones((8, 8), np.float32)}
    expected = _run_on_ort(model, feeds)
    RecomputePass("Gelu+:1:-1,MatMul+:1:-1", min_elements=0)(model)
    proj_clone, view_clone = _node(model, "proj_recompute"), _node(model, "view_recompute")
    assert proj_clone.inputs[0] is view_clone.outputs[0]
    assert view_clone.inputs[0] is _node(model, "gelu_recompute").outputs[0]
    # The forward a and its view are read by forward nodes only now: they die after forward.
    forward_a = _node(model, "gelu").outputs[0]
    assert {user.name for user, _ in forward_a.uses()} == {"view"}
    onnx.checker.check_model(ir.to_proto(model))
    for got, want in zip(_run_on_ort(model, feeds), expected):
        np.testing.assert_array_equal(got, want)


def test_a_view_of_a_value_not_recomputed_is_read_as_it_is():
    model = frozen_projection_training_graph()
    RecomputePass("MatMul+:1:-1", min_elements=0)(model)
    assert _node(model, "proj_recompute").inputs[0] is _node(model, "view").outputs[0]
    assert not any(n.name == "view_recompute" for n in model.graph)
