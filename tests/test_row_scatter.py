"""A gradient's final row ScatterND left to the session, which adds the rows in place
(ortpass.training.row_scatter, ortpass.runtime.row_adds): when it fires and when not, the
same gradients bitwise as ORT's ScatterND, in TrainingSession and SplitTrainingSession,
and the step's predicted peak without the copy."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ortpass.analysis.step_memory import predict_step_memory
from ortpass.errors import OrtpassError
from ortpass.passes import ScatterEmbeddingGradientPass
from ortpass.runtime import SplitTrainingSession, TrainingSession
from ortpass.runtime.row_adds import add_rows, rows_added_after
from ortpass.runtime.session import disabled_optimizers, training_options
from ortpass.training import build_training_graph_from_torch
from ortpass.training.row_scatter import defer_row_scatters
from ortpass.training.split import as_run

pytestmark = pytest.mark.stock

ROWS, WIDTH, IDS = 7, 5, (3, 40)  # 120 ids over 7 rows: every row repeats


def _scatter_graph(*, data_from_node=True, data_read_twice=False, data_output=False, output_read=False, reduction="add",
                   index_width=1):  # fmt: skip
    """``out = ScatterND(part * 1, Unsqueeze(ids, -1), rows)``, and variants that must not fire."""
    nodes = [helper.make_node("Unsqueeze", ["ids", "axes"], ["index"])] if index_width == 1 else []
    data = "part"
    if data_from_node:
        nodes.append(helper.make_node("Mul", ["weight", "one"], ["part"]))
    else:
        data = "weight"
    nodes.append(helper.make_node("ScatterND", [data, "index" if index_width == 1 else "ids", "rows"], ["out"], reduction=reduction))
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [ROWS, WIDTH])]
    if data_read_twice:
        nodes.append(helper.make_node("ReduceSum", [data], ["also"], keepdims=0))
        outputs.append(helper.make_tensor_value_info("also", TensorProto.FLOAT, []))
    if data_output:
        outputs.append(helper.make_tensor_value_info(data, TensorProto.FLOAT, [ROWS, WIDTH]))
    if output_read:
        nodes.append(helper.make_node("ReduceSum", ["out"], ["total"], keepdims=0))
        outputs.append(helper.make_tensor_value_info("total", TensorProto.FLOAT, []))
    ids_shape = [*IDS] if index_width == 1 else [*IDS, index_width]
    rows_shape = [*IDS, WIDTH] if index_width == 1 else [*IDS]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("weight", TensorProto.FLOAT, [ROWS, WIDTH]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ids_shape),
         helper.make_tensor_value_info("rows", TensorProto.FLOAT, rows_shape)],
        outputs,
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]), helper.make_tensor("axes", TensorProto.INT64, [1], [-1])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    return ir.from_proto(onnx.shape_inference.infer_shapes(model))  # the rule reads the indices' shape


def _session(model: ir.Model):
    options = training_options(ort, runs_torch=False)
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"],
                                disabled_optimizers=disabled_optimizers(model))  # fmt: skip


def _feeds(low: int = 0) -> dict:
    rng = np.random.default_rng(0)
    return {
        "weight": rng.standard_normal((ROWS, WIDTH)).astype(np.float32),
        "ids": rng.integers(low, ROWS, IDS),
        "rows": rng.standard_normal((*IDS, WIDTH)).astype(np.float32) * 1e3,  # big and small: rounding shows order
    }


@pytest.mark.parametrize(("low", "read_twice"), [(0, False), (-ROWS, False), (0, True)],
                         ids=["ids", "negative-ids", "data-also-read"])  # fmt: skip
def test_the_session_adds_the_rows_as_scatternd_does_bitwise(low, read_twice):
    """Another reader of the data reads it before the rows are added, as in the graph."""
    model = _scatter_graph(data_read_twice=read_twice)
    feeds = _feeds(low)
    names = ["out", "also"] if read_twice else ["out"]
    expected = _session(model).run(names, feeds)
    deferred, adds = rows_added_after(model)
    assert adds and not any(n.op_type == "ScatterND" for n in deferred.graph)
    assert any(n.op_type == "ScatterND" for n in model.graph)  # the caller's model is left as it was
    fetch = adds.fetch(names)
    assert fetch == [*names, "index", "rows_for_out"]  # a graph input is output through an Identity
    got = adds.finish(names, _session(deferred).run(fetch, feeds), torch.from_numpy)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "variant",
    [dict(data_from_node=False), dict(data_output=True), dict(output_read=True), dict(reduction="none"),
     dict(index_width=2)],
    ids=["data-is-an-input", "data-is-an-output", "output-read-by-a-node", "no-reduction", "indices-pick-elements"],
)  # fmt: skip
def test_does_not_fire(variant):
    model = _scatter_graph(**variant)
    same, scatters = defer_row_scatters(model)
    assert same is model and scatters == []


def test_out_of_range_rows_are_refused_by_name():
    gradient = torch.zeros(ROWS, WIDTH)
    with pytest.raises(OrtpassError, match=r"emb\.weight_grad: a row index is out of range for 7 rows"):
        add_rows(gradient, torch.tensor([[1], [ROWS]]), torch.ones(2, WIDTH), "emb.weight_grad")
    assert not gradient.any()


VOCAB, HIDDEN, BATCH, SEQ = 1024, 256, 2, 24  # the weight (1 MiB) outweighs the logits


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)

    def logits(self, ids):
        return torch.tanh(self.fc(self.emb(ids))) @ self.emb.weight.T

    def forward(self, ids, labels):
        return torch.nn.functional.cross_entropy(self.logits(ids).reshape(-1, VOCAB), labels.reshape(-1))


class TiedLogits(TiedLM):
    def forward(self, ids):
        return self.logits(ids)


def _args():
    generator = torch.Generator().manual_seed(3)
    return tuple(torch.randint(0, VOCAB // 16, (BATCH, SEQ), generator=generator) for _ in range(2))  # rows repeat


def _tied_graph() -> ir.Model:
    torch.manual_seed(0)
    built = build_training_graph_from_torch(TiedLM(), _args(), input_names=["ids", "labels"])
    return ScatterEmbeddingGradientPass()(built).model


def test_training_session_gradients_are_ort_scatternds_bitwise():
    model = _tied_graph()
    assert sum(n.op_type == "ScatterND" for n in model.graph) == 1  # the token rows, into the head's part
    session = TrainingSession(model)
    batch = dict(zip(["ids", "labels"], (a.numpy() for a in _args())))
    result = session.run(batch)
    names = [session.info.loss, *session.info.gradients.values()]
    expected = _session(model).run(names, {**session._default_params, **batch})
    assert session._rows  # the session's graph ends without the token embedding's scatter
    for (param, _), value in zip(session.info.gradients.items(), expected[1:]):
        np.testing.assert_array_equal(result.gradients[param], value, err_msg=param)
    assert result.loss == float(expected[0])


def test_split_session_gradients_are_ort_scatternds_bitwise():
    torch.manual_seed(0)
    (ids, _) = _args()
    built = build_training_graph_from_torch(TiedLogits(), (ids,), input_names=["ids"], loss=None)
    model = ScatterEmbeddingGradientPass()(built).model
    session = SplitTrainingSession(model)
    assert session._rows
    seed = np.random.default_rng(1).standard_normal((BATCH, SEQ, VOCAB)).astype(np.float32)
    seeds = {session.outputs[0]: seed}
    _, gradients = session.run({"ids": ids.numpy()}, seeds)
    feeds = {**session._default_params, "ids": ids.numpy(), session.seeds[session.outputs[0]]: seed}
    expected = _session(model).run(session.gradients, feeds)
    for name, value in zip(session.gradients, expected):
        np.testing.assert_array_equal(gradients[name], value, err_msg=name)


def test_the_predicted_peak_drops_by_the_copy():
    """At these sizes the step's peak is the scatter's copy of the weight's gradient; as run,
    the peak is the highest of the other points."""
    model = _tied_graph()
    before, after = predict_step_memory(model), predict_step_memory(as_run(model))
    assert before.peak_node.op_type == "ScatterND"
    at = before.nodes.index(before.peak_node)
    assert after.peak_bytes == np.delete(before.live, at).max() < before.peak_bytes
