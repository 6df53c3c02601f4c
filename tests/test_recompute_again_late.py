"""RecomputeAgainLatePass: a recomputed value read early and late is computed again for its
late readers, where holding it sets the step's peak.

Built by torch's autograd (the torch builder), so CI runs this file on the training build
and on stock onnxruntime; the predictions are the graph as the installed runtime runs it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

import ortpass
from ortpass.analysis.ort_order import ort_default_order
from ortpass.analysis.partition import is_backward
from ortpass.analysis.step_memory import predict_step_memory
from ortpass.conventions import CREATED_BY_KEY, RECOMPUTE_OF_KEY, STEP_MEMORY_TARGET_KEY
from ortpass.runtime import TrainingSession
from ortpass.runtime.parity import check_parity
from ortpass.testing.models import GPTDecoder
from ortpass.training.from_torch import build_training_graph_from_torch
from ortpass.training.split import masks_read_where_redraws_differ

pytestmark = pytest.mark.stock

# Tiny tensors: recompute's size floor off, so the layers are recomputed as at real sizes.
RECOMPUTE = "fix-dropout-seed(level=1,min_elements=0),recompute(level=1,min_elements=0)"
AGAIN = RECOMPUTE + ",recompute-again-late"


def _decoder_graph(*, vocab: int = 32, dropout: float = 0.1) -> tuple[GPTDecoder, tuple, ir.Model]:
    torch.manual_seed(0)
    module = GPTDecoder(vocab=vocab, hidden=16, heads=2, layers=2, max_seq=16, dropout=dropout)
    ids = torch.randint(0, vocab, (4, 16))
    args = (ids, ids.roll(-1, 1))
    model = build_training_graph_from_torch(module, args, input_names=["input_ids", "labels"])
    for seed, node in enumerate(n for n in model.graph if n.op_type == "Dropout"):
        node.attributes["seed"] = ir.AttrInt64("seed", seed)  # both pipelines draw alike
    return module, args, model


def _peak(model: ir.Model) -> int:
    return predict_step_memory(masks_read_where_redraws_differ(model)).peak_bytes


def test_the_attention_probabilities_are_computed_again_for_their_gradient_and_the_peak_falls():
    module, args, model = _decoder_graph()
    without = ortpass.pipeline(RECOMPUTE, assume=["training-graph"])(model.clone()).model
    result = ortpass.pipeline(AGAIN, assume=["training-graph"])(model)
    counts = result.report["recompute-again-late"].stats["counts"]
    assert counts["values recomputed again"] >= 2  # one softmax per layer at least
    copies = [n for n in result.model.graph if n.metadata_props.get(CREATED_BY_KEY) == "recompute-again-late"]
    assert len(copies) == counts["nodes copied"]
    assert sum(n.op_type == "Softmax" for n in copies) >= 2  # each layer's probabilities
    assert all(is_backward(n) and RECOMPUTE_OF_KEY in n.metadata_props for n in copies)
    # Recompute's clone of each copied softmax now feeds only the recomputation (of the
    # attention's output, which the MLP's needs): the attention's gradient reads the copy.
    for copy in (n for n in copies if n.op_type == "Softmax"):
        clone = next(n for n in result.model.graph if n.metadata_props.get(CREATED_BY_KEY) == "recompute"
                     and n.metadata_props[RECOMPUTE_OF_KEY] == copy.metadata_props[RECOMPUTE_OF_KEY])
        assert all(RECOMPUTE_OF_KEY in u.metadata_props for u, _ in clone.outputs[0].uses())
    # The prediction the pass made is the graph's, and lower than without the copies.
    assert counts["predicted peak bytes"] == _peak(result.model) < _peak(without)
    # Copies run the same nodes on the same inputs: the step is the one without them, bit for bit.
    feeds = {"input_ids": args[0].numpy(), "labels": args[1].numpy()}
    plain = TrainingSession(without, threads=1).run(feeds)
    again = TrainingSession(result.model, threads=1).run(feeds)
    assert again.loss == plain.loss
    for name, grad in plain.gradients.items():
        np.testing.assert_array_equal(again.gradients[name], grad, err_msg=name)


def test_each_copy_runs_after_the_other_inputs_of_its_first_reader_in_orts_order():
    """ORT's walk visits a node's inputs from the last in graph order down.  A copy placed
    right before its reader ran first there, and was held while the reader's other inputs
    were computed: the gradient chain through the rest of the layer, where a weight's
    gradient reads the layer input directly (``Gemm(x, dY, transA=1)``).  Placed as early
    as its inputs allow, each copy runs after them, right before the node that reads it
    first."""
    _, _, model = _decoder_graph()
    result = ortpass.pipeline(AGAIN, assume=["training-graph"])(model)
    order = ort_default_order(list(result.model.graph))
    ran_at = {node: i for i, node in enumerate(order)}
    copies = [n for n in order if n.metadata_props.get(CREATED_BY_KEY) == "recompute-again-late"]
    first_readers = {copy: min((u for out in copy.outputs for u, _ in out.uses()), key=ran_at.__getitem__)
                     for copy in copies}  # fmt: skip
    checked = [(copy, reader) for copy, reader in first_readers.items() if reader not in first_readers]
    assert any(reader.op_type == "Gemm" for _, reader in checked)  # a weight gradient reads a copy
    for copy, reader in checked:
        others = [v.producer() for v in reader.inputs if v is not None and v.producer() not in (None, copy)]
        assert all(ran_at[copy] > ran_at[p] for p in others if p in ran_at), (copy.name, reader.name)


def test_without_dropout_the_step_matches_torch():
    module, args, model = _decoder_graph(dropout=0.0)
    result = ortpass.pipeline(AGAIN, assume=["training-graph"])(model)
    assert result.report["recompute-again-late"].stats["counts"]["values recomputed again"] >= 2
    check_parity(module, args, result.model, input_names=["input_ids", "labels"]).assert_ok()


def test_nothing_is_copied_without_recompute_clones():
    _, _, model = _decoder_graph()
    result = ortpass.pipeline("recompute-again-late", assume=["training-graph"])(model)
    assert not result.report["recompute-again-late"].modified


def test_nothing_is_copied_where_no_copy_lowers_the_peak():
    """With a vocabulary of 4096 the step peaks at the loss's gradient, where no recomputed
    value is alive: a copy would only cost time."""
    _, _, model = _decoder_graph(vocab=4096)
    recomputed = ortpass.pipeline(RECOMPUTE, assume=["training-graph"])(model).model
    before = ir.to_proto(recomputed).SerializeToString()
    result = ortpass.pipeline("recompute-again-late", assume=["training-graph"])(recomputed)
    assert not result.report["recompute-again-late"].modified
    assert ir.to_proto(result.model).SerializeToString() == before


def test_a_recomputation_longer_than_the_chain_limit_is_not_copied_and_the_log_says_so(monkeypatch, caplog):
    from ortpass.passes import recompute_again_late

    _, _, model = _decoder_graph()
    recomputed = ortpass.pipeline(RECOMPUTE, assume=["training-graph"])(model).model
    monkeypatch.setattr(recompute_again_late, "MAX_CHAIN", 1)  # every copy takes more nodes
    with caplog.at_level("DEBUG", logger=recompute_again_late.__name__):
        result = ortpass.pipeline("recompute-again-late", assume=["training-graph"])(recomputed)
    copies = [n for n in result.model.graph if n.metadata_props.get(CREATED_BY_KEY) == "recompute-again-late"]
    assert not any(n.op_type == "Softmax" for n in copies)  # the probabilities take several nodes
    counts = result.report["recompute-again-late"].stats.get("counts", {})
    assert counts.get("nodes copied", 0) == counts.get("values recomputed again", 0)  # one node each
    assert "longer than MAX_CHAIN (1 nodes)" in caplog.text


def test_without_a_budget_a_copy_must_save_memory_in_proportion_to_the_time_it_adds(monkeypatch, caplog):
    """A copy is priced by the cost model: with a fixed price per FLOP and per byte, the
    copies made are those whose peak saving is at least MIN_SAVED_PER_ADDED times their
    share of the step's time.  Asking for a saving no copy gives makes none, and says why;
    under a budget the price is not asked (the user asked for the memory)."""
    from ortpass.analysis.recompute.timing import CostModel
    from ortpass.passes import recompute_again_late

    _, _, model = _decoder_graph()
    recomputed = ortpass.pipeline(RECOMPUTE, assume=["training-graph"])(model).model
    monkeypatch.setattr(CostModel, "for_this_machine", classmethod(lambda cls: cls(1e-10, 1e-9)))
    made = ortpass.pipeline("recompute-again-late", assume=["training-graph"])(recomputed.clone())
    assert made.report["recompute-again-late"].modified  # the copies are worth their time here
    monkeypatch.setattr(recompute_again_late, "MIN_SAVED_PER_ADDED", 1e6)
    with caplog.at_level("DEBUG", logger=recompute_again_late.__name__):
        refused = ortpass.pipeline("recompute-again-late", assume=["training-graph"])(recomputed.clone())
    assert not refused.report["recompute-again-late"].modified
    assert "more time" in caplog.text and "not computed again" in caplog.text
    budgeted = recomputed.clone()
    budgeted.metadata_props[STEP_MEMORY_TARGET_KEY] = "1"  # below any reachable peak
    under_budget = ortpass.pipeline("recompute-again-late", assume=["training-graph"])(budgeted)
    assert under_budget.report["recompute-again-late"].modified


def test_a_budget_is_planned_on_the_graph_as_the_installed_runtime_runs_it():
    """On stock onnxruntime a session makes recomputed Dropouts read the forward masks
    (``masks_read_where_redraws_differ``); the budget planner and this pass judge that
    graph, so the planned peak is the one of the graph that runs, on either runtime."""
    _, _, model = _decoder_graph()
    pipeline = ("fix-dropout-seed(budget=0.0,min_elements=0),recompute(budget=0.0,min_elements=0),"
                "replay-dropout-mask,recompute-again-late")
    result = ortpass.pipeline(pipeline, assume=["training-graph"])(model)
    planned = result.report["recompute"].stats["counts"]["predicted peak bytes"]
    assert planned == _peak(result.model)


def test_under_a_budget_the_copies_stop_once_the_peak_meets_it():
    """``recompute(budget=)`` records its target; the copies stop there, and the planned
    peak is the one the pipeline ends with.  Taking the target away, the pass lowers the
    peak further on some budget: it had stopped early, saving the copies' time."""
    _, _, model = _decoder_graph()
    pipeline = ("fix-dropout-seed(budget={0},min_elements=0),recompute(budget={0},min_elements=0),"
                "replay-dropout-mask,recompute-again-late")
    def planned(budget):
        return ortpass.pipeline(pipeline.format(budget), assume=["training-graph"])(model.clone())

    lowest = planned(0.0)
    floor = lowest.report["recompute"].stats["counts"]["predicted peak bytes"]
    stopped_early = False
    # Budgets at the floor, a little and well above it, and a fraction: each pipeline run
    # plans the whole graph (seconds each; tens on stock onnxruntime), so a few points stand
    # for the range.
    for budget in (0.0, *(int(floor * (1 + k / 100)) for k in (1, 8)), 0.5):
        result = lowest if budget == 0.0 else planned(budget)
        counts = result.report["recompute"].stats["counts"]
        final = _peak(result.model)
        assert final == counts["predicted peak bytes"] <= counts["budget target bytes"]
        recomputed = result.report["recompute"].modified
        recorded = result.model.metadata_props.get(STEP_MEMORY_TARGET_KEY)
        assert recorded == (str(counts["budget target bytes"]) if recomputed else None)
        unbounded = result.model.clone()
        unbounded.metadata_props.pop(STEP_MEMORY_TARGET_KEY, None)
        further = ortpass.pipeline("recompute-again-late", assume=["training-graph"])(unbounded)
        stopped_early |= _peak(further.model) < final
    assert stopped_early


def test_on_a_graph_with_dynamic_dims_copies_are_judged_at_the_export_dims_and_exact_at_others():
    """ORTModule's graphs carry symbolic dims; the copies are chosen at the sizes of the
    export (its record) and stay exact at any other batch and sequence."""
    torch.manual_seed(0)
    module = GPTDecoder(vocab=32, hidden=16, heads=2, layers=2, max_seq=16, dropout=0.0)
    ids = torch.randint(0, 32, (4, 16))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}}
    model = build_training_graph_from_torch(module, (ids, ids.roll(-1, 1)), input_names=["input_ids", "labels"],
                                            dynamic_axes=axes)  # fmt: skip
    result = ortpass.pipeline(AGAIN, assume=["training-graph"])(model)
    assert result.report["recompute-again-late"].stats["counts"]["values recomputed again"] >= 2
    for batch, seq in ((4, 16), (3, 11)):
        other = torch.randint(0, 32, (batch, seq))
        check_parity(module, (other, other.roll(-1, 1)), result.model, input_names=["input_ids", "labels"]).assert_ok()
