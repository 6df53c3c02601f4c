"""CheckIndexRangesPass: the labels and embedding ids torch refuses are refused on ONNX
Runtime too, named; every index torch accepts gives the very same step.

Without the pass ORT 1.19.2's SoftmaxCrossEntropyLoss returned a loss for label 53 of 50
classes and for -5, and ai.onnx Gather / GatherElements read a negative index from the
end: a step with no error where torch raises IndexError.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir
import pytest
import torch

import ortpass
from ortpass.conventions import INDEX_CHECK_PREFIX
from ortpass.errors import IndexRangeError
from ortpass.export import export
from ortpass.passes import CheckIndexRangesPass
from ortpass.runtime import TrainingSession
from ortpass.runtime.parity import check_parity
from ortpass.training import build_training_graph
from ortpass.training.backend import has_training_ops

VOCAB, HIDDEN, BATCH, SEQ, IGNORE = 20, 8, 2, 6, -100
needs_training_build = pytest.mark.skipif(not has_training_ops(), reason="ORT's gradient builder needs the training build")


class SmallLM(torch.nn.Module):
    """Embedding, a layer, an untied head and cross-entropy."""

    def __init__(self, ignore_index: int = IGNORE) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.fc(self.emb(ids))))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=self.ignore_index)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels[0, 0] = IGNORE
    return ids, labels


def _training(module: torch.nn.Module, args) -> ir.Model:
    return build_training_graph(export(module, args, input_names=["ids", "labels"]))


def _feeds(args) -> dict[str, np.ndarray]:
    return dict(zip(["ids", "labels"], (a.numpy() for a in args)))


@needs_training_build
def test_valid_indices_give_the_same_step_and_bad_ones_are_refused_by_name():
    torch.manual_seed(0)
    module, args = SmallLM(), _batch()
    plain = _training(module, args)
    pass_ = CheckIndexRangesPass()
    checked = pass_(_training(module, args)).model
    assert pass_.stats["counts"] == {"labels checked": 1, "ids checked": 1}
    a, b = TrainingSession(plain).run(_feeds(args)), TrainingSession(checked).run(_feeds(args))
    assert a.loss == b.loss
    for name, gradient in a.gradients.items():
        np.testing.assert_array_equal(b.gradients[name], gradient, err_msg=name)
    check_parity(module, args, checked, input_names=["ids", "labels"]).assert_ok()

    session = TrainingSession(checked)
    for bad in (VOCAB, VOCAB + 33, -1, -5):
        ids, labels = _batch()
        labels[1, 2] = bad
        with pytest.raises(IndexError, match=rf"a label of \S+ outside \[0, {VOCAB}\) that is not ignore_index {IGNORE}"):
            session.run(_feeds((ids, labels)))
        ids, labels = _batch()
        ids[0, 1] = bad
        with pytest.raises(IndexRangeError, match=rf"an id of the embedding emb.weight outside \[0, {VOCAB}\)"):
            session.run(_feeds((ids, labels)))


@needs_training_build
def test_an_ignore_index_among_the_classes_stays_ignored():
    torch.manual_seed(0)
    module, args = SmallLM(ignore_index=3), _batch()
    args[1][args[1] == IGNORE] = 3
    checked = CheckIndexRangesPass()(_training(module, args)).model
    check_parity(module, args, checked, input_names=["ids", "labels"]).assert_ok()


def _sce_by_hand(label_dtype: ir.DataType) -> ir.Model:
    """``SoftmaxCrossEntropyLoss(x @ W, labels)`` by hand, labels of ``label_dtype`` (int32
    labels come from ONNX files written elsewhere: torch's loss takes int64 only)."""
    weight = ir.Value(name="W", shape=ir.Shape([HIDDEN, VOCAB]), type=ir.TensorType(ir.DataType.FLOAT))
    weight.const_value = ir.tensor(np.random.default_rng(1).standard_normal((HIDDEN, VOCAB)).astype(np.float32))
    x = ir.Value(name="x", shape=ir.Shape([5, HIDDEN]), type=ir.TensorType(ir.DataType.FLOAT))
    labels = ir.Value(name="labels", shape=ir.Shape([5]), type=ir.TensorType(label_dtype))
    logits = ir.node("MatMul", [x, weight])
    loss = ir.node("SoftmaxCrossEntropyLoss", [logits.outputs[0], labels], {"ignore_index": IGNORE, "reduction": "mean"})
    loss.outputs[0].name = "loss"
    graph = ir.Graph([x, labels], [loss.outputs[0]], nodes=[logits, loss], initializers=[weight], opset_imports={"": 17})
    return ir.Model(graph, ir_version=8)


@needs_training_build
@pytest.mark.parametrize("label_dtype", [ir.DataType.INT64, ir.DataType.INT32])
def test_labels_of_either_integer_type_are_checked(label_dtype):
    dtype = label_dtype.numpy()
    x = np.random.default_rng(2).standard_normal((5, HIDDEN)).astype(np.float32)
    good = np.array([1, IGNORE, VOCAB - 1, 0, 7], dtype=dtype)
    plain = build_training_graph(_sce_by_hand(label_dtype), loss="loss")
    pass_ = CheckIndexRangesPass()
    checked = pass_(build_training_graph(_sce_by_hand(label_dtype), loss="loss")).model
    assert pass_.stats["counts"] == {"labels checked": 1}
    written = [v.shape for n in checked.graph if n.name.startswith(INDEX_CHECK_PREFIX) for v in n.outputs if v.shape is not None]
    labels_shape = next(v.shape for v in checked.graph.inputs if v.name == "labels")
    assert len({id(s) for s in [*written, labels_shape]}) == len(written) + 1  # no Shape object shared
    a, b = TrainingSession(plain).run({"x": x, "labels": good}), TrainingSession(checked).run({"x": x, "labels": good})
    assert a.loss == b.loss
    np.testing.assert_array_equal(b.gradients["W"], a.gradients["W"])
    for bad in (VOCAB, -1):
        with pytest.raises(IndexRangeError, match=rf"outside \[0, {VOCAB}\) that is not ignore_index"):
            TrainingSession(checked).run({"x": x, "labels": np.where(good == 7, bad, good).astype(dtype)})


def _hand_built(indices_from: str) -> ir.Model:
    """A forward graph by hand: ``Gather(table, idx)`` summed into the loss, with ``idx``
    the graph input ``ids`` ("input"), ``ids + 1`` ("computed") or a constant ("constant")."""
    table = ir.Value(name="table", shape=ir.Shape([VOCAB, HIDDEN]), type=ir.TensorType(ir.DataType.FLOAT))
    table.const_value = ir.tensor(np.random.default_rng(0).standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    ids = ir.Value(name="ids", shape=ir.Shape([4]), type=ir.TensorType(ir.DataType.INT64))
    nodes, index = [], ids
    if indices_from == "computed":
        one = ir.node("Constant", [], {"value": ir.tensor(np.array(1, dtype=np.int64))})
        nodes += [one, ir.node("Add", [ids, one.outputs[0]])]
        index = nodes[-1].outputs[0]
    elif indices_from == "constant":
        nodes.append(ir.node("Constant", [], {"value": ir.tensor(np.array([0, 2, 4, 6], dtype=np.int64))}))
        index = nodes[-1].outputs[0]
    gather = ir.node("Gather", [table, index], {"axis": 0})
    loss = ir.node("ReduceSum", [gather.outputs[0]], {"keepdims": 0})
    loss.outputs[0].name = "loss"
    nodes += [gather, loss]
    graph = ir.Graph([ids], [loss.outputs[0]], nodes=nodes, initializers=[table], opset_imports={"": 17})
    return ir.Model(graph, ir_version=8)


@needs_training_build
@pytest.mark.parametrize(("indices_from", "checked"), [("input", True), ("computed", False), ("constant", False)])
def test_only_lookups_by_a_graph_input_are_checked(indices_from, checked):
    """An index torch computed (``ids + 1``, a constant) may be negative on purpose (torch's
    ``x[idx]`` counts from the end): only lookups straight from an input are checked."""
    pass_ = CheckIndexRangesPass()
    result = pass_(build_training_graph(_hand_built(indices_from), loss="loss"))
    assert result.modified is checked
    assert pass_.stats.get("counts", {}).get("ids checked") == (1 if checked else None)


def test_a_forward_graph_is_left_alone():
    result = CheckIndexRangesPass()(_hand_built("input"))
    assert not result.modified


@pytest.mark.stock
def test_ortmodule_refuses_what_torch_refuses_on_either_builder():
    """The torch builder (stock onnxruntime) writes the loss as LogSoftmax + GatherElements,
    which counted -5 from the end; ORT's builder writes SoftmaxCrossEntropyLoss, which read
    past the row.  Both now raise where torch raises, and a valid step still matches torch."""
    builders = ["torch", "ort"] if has_training_ops() else ["torch"]
    for builder in builders:
        torch.manual_seed(0)
        module = SmallLM()
        reference = SmallLM()
        reference.load_state_dict(module.state_dict())
        wrapped = ortpass.ORTModule(module, builder=builder)
        torch.testing.assert_close(wrapped(*_batch()), reference(*_batch()), rtol=1e-5, atol=1e-6)
        for bad, (position, what) in itertools.product((-5, VOCAB), ((1, "label"), (0, "embedding"))):
            batch = list(_batch(seed=1))  # ids, labels
            batch[position][1, 1] = bad
            with pytest.raises(IndexError):
                reference(*batch)
            with pytest.raises(IndexRangeError, match=what):
                wrapped(*batch)
        torch.testing.assert_close(wrapped(*_batch(2)), reference(*_batch(2)), rtol=1e-5, atol=1e-6)
