"""AccumulateGradientsEarlyPass: the parts of a tied weight's gradient run when their inputs exist."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from ortpass.export import export
from ortpass.passes import AccumulateGradientsEarlyPass
from ortpass.runtime import TrainingSession
from ortpass.testing.profiling import ort_execution_order
from ortpass.training import build_training_graph

VOCAB, HIDDEN, BATCH, SEQ = 32, 16, 2, 8


class TiedLM(torch.nn.Module):
    """Embedding, two layers, and a head that reuses the embedding's weight (GPT-2 style)."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.fc1, self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = None if tied else torch.nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.1)

    def forward(self, ids, labels):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(self.emb(ids)))))
        weight = self.emb.weight if self.head is None else self.head
        return torch.nn.functional.cross_entropy((h @ weight.T).reshape(-1, VOCAB), labels.reshape(-1))


def _training(tied: bool = True) -> ir.Model:
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return build_training_graph(export(TiedLM(tied), (ids, ids), input_names=["ids", "labels"]))


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"ids": rng.integers(0, VOCAB, (BATCH, SEQ)), "labels": rng.integers(0, VOCAB, (BATCH, SEQ))}


def _head_part(model: ir.Model) -> tuple[ir.Value, str, str]:
    """The head's part of emb.weight's gradient, the node of its chain that reads the logits'
    gradient (under the part's Transpose), and the embedding's GatherGrad."""
    accumulate = next(n for n in model.graph if n.op_type == "Sum" and n.outputs[0].name == "emb.weight_grad")
    gather = next(v.producer() for v in accumulate.inputs if v.producer().op_type == "GatherGrad")
    part = next(v for v in accumulate.inputs if v.producer() is not gather)
    reader = part.producer()
    while len(reader.inputs) == 1:  # the Transpose of weight.T's gradient
        reader = reader.inputs[0].producer()
    return part, reader.name, gather.name


def test_the_head_part_runs_before_the_embedding_gradient_on_ort(tmp_path):
    model = _training()
    part, head, gather = _head_part(model)
    before = ort_execution_order(model, _batch(), tmp_path)
    assert before.index(head) > before.index(gather)  # the walk reaches it only from the Sum, at the end
    pass_ = AccumulateGradientsEarlyPass()
    assert pass_(model).modified
    assert dict(pass_.stats["counts"]) == {"parts computed early": 1}
    where = next(n for n in model.graph if n.op_type == "Where")
    assert where.inputs[1].producer().inputs[0] is part
    after = ort_execution_order(model, _batch(), tmp_path)
    assert after.index(head) < after.index(gather)
    fc1_grad = next(n.name for n in model.graph for out in n.outputs if out.name == "fc1.weight_grad")
    assert after.index(head) < after.index(fc1_grad)  # before the layers' backward, not just before the end


def test_training_steps_are_bitwise_the_same_on_ort():
    expected = TrainingSession(_training()).run(_batch())
    model = AccumulateGradientsEarlyPass()(_training()).model
    got = TrainingSession(model).run(_batch())
    assert got.loss == expected.loss
    for name, grad in expected.gradients.items():
        np.testing.assert_array_equal(got.gradients[name], grad, err_msg=name)


def test_does_not_fire_without_a_weight_used_twice():
    model = _training(tied=False)
    before = ir.to_proto(model).SerializeToString()
    assert not AccumulateGradientsEarlyPass()(model).modified
    assert ir.to_proto(model).SerializeToString() == before


def test_leaves_a_part_whose_dtype_differs():
    model = _training()
    part, _, _ = _head_part(model)
    part.dtype = ir.DataType.DOUBLE  # as a mixed-precision graph could declare it
    before = ir.to_proto(model).SerializeToString()
    assert not AccumulateGradientsEarlyPass()(model).modified
    assert ir.to_proto(model).SerializeToString() == before
