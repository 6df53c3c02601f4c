"""ScatterEmbeddingGradientPass: a tied embedding's rows added into the other part of the
weight's gradient by one ScatterND, both directions, parity on ORT and with torch."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

from ortpass.export import export
from ortpass.passes import ScatterEmbeddingGradientPass
from ortpass.runtime import TrainingSession
from ortpass.runtime.parity import check_parity
from ortpass.training import build_training_graph, build_training_graph_from_torch

VOCAB, HIDDEN, BATCH, SEQ = 12, 8, 2, 16  # 32 ids over 12 rows: rows repeat


class TiedLM(torch.nn.Module):
    """Embedding, a layer and a head reading the embedding's weight; ``twice`` embeds a
    second id tensor with the same table (three parts to the weight's gradient)."""

    def __init__(self, tied: bool = True, twice: bool = False) -> None:
        super().__init__()
        self.tied, self.twice = tied, twice
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids) + (self.emb(labels) if self.twice else 0)
        h = torch.tanh(self.fc(x))
        logits = h @ self.emb.weight.T if self.tied else self.head(h)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _args() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator), torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def _training(module: torch.nn.Module, opset: int = 17) -> ir.Model:
    return build_training_graph(export(module, _args(), input_names=["ids", "labels"], opset=opset))


def test_the_tied_sum_becomes_one_scatter_with_the_same_step():
    torch.manual_seed(0)
    module = TiedLM()
    ids, _ = _args()
    assert len(torch.unique(ids)) < ids.numel()  # repeated rows: the scatter must add them all
    plain = _training(module)
    pass_ = ScatterEmbeddingGradientPass()
    model = pass_(_training(module)).model
    assert pass_.stats["counts"]["embedding gradients scattered"] == 1
    ops = [n.op_type for n in model.graph]
    assert "GatherGrad" not in ops and ops.count("ScatterND") == 1
    scatter = next(n for n in model.graph if n.op_type == "ScatterND")
    assert scatter.outputs[0].name == "emb.weight_grad" and scatter.outputs[0].is_graph_output()
    batch = dict(zip(["ids", "labels"], (a.numpy() for a in _args())))
    a, b = TrainingSession(plain).run(batch), TrainingSession(model).run(batch)
    for name, gradient in a.gradients.items():
        np.testing.assert_allclose(b.gradients[name], gradient, rtol=1e-6, atol=1e-8, err_msg=name)
    check_parity(module, _args(), model, input_names=["ids", "labels"]).assert_ok()


@pytest.mark.parametrize(
    ("module", "opset"),
    [(TiedLM(tied=False), 17), (TiedLM(twice=True), 17), (TiedLM(), 15)],
    ids=["untied", "three-parts", "opset-15-has-no-scatter-reduction"],
)
def test_does_not_fire(module, opset):
    torch.manual_seed(0)
    pass_ = ScatterEmbeddingGradientPass()
    result = pass_(_training(module, opset))
    assert not result.modified
    assert any(n.op_type == "GatherGrad" for n in result.model.graph)


def _from_torch(module: torch.nn.Module) -> ir.Model:
    return build_training_graph_from_torch(module, _args(), input_names=["ids", "labels"])


@pytest.mark.stock
@pytest.mark.parametrize("twice", [False, True], ids=["tied", "three-parts"])
def test_torchs_scatter_into_zeros_becomes_a_scatter_into_the_part(twice):
    """torch's builder: ``Add(part, ScatterND(zeros, ids, dY))`` -> ``ScatterND(part, ids, dY)``;
    with a second embedding of the same table the two scatters chain."""
    torch.manual_seed(0)
    module = TiedLM(twice=twice)
    plain = _from_torch(module)
    pass_ = ScatterEmbeddingGradientPass()
    model = pass_(_from_torch(module)).model
    assert pass_.stats["counts"]["embedding gradients scattered"] == (2 if twice else 1)
    scatters = [n for n in model.graph if n.op_type == "ScatterND"]
    assert len(scatters) == (2 if twice else 1)
    assert scatters[0].inputs[0].producer().op_type == "Gemm"  # the head's weight gradient, no zeros
    assert scatters[-1].outputs[0].name == "emb.weight_grad" and scatters[-1].outputs[0].is_graph_output()
    assert not any(n.op_type == "Add" and n.outputs[0].is_graph_output() for n in model.graph)
    zeros = {n.inputs[0].name for n in plain.graph if n.op_type == "ScatterND"}
    assert zeros and not zeros & set(model.graph.initializers)  # torch folded them to initializers: dropped
    batch = dict(zip(["ids", "labels"], (a.numpy() for a in _args())))
    a, b = TrainingSession(plain).run(batch), TrainingSession(model).run(batch)
    for name, gradient in a.gradients.items():
        np.testing.assert_allclose(b.gradients[name], gradient, rtol=1e-6, atol=1e-7, err_msg=name)
    check_parity(module, _args(), model, input_names=["ids", "labels"]).assert_ok()


@pytest.mark.stock
def test_torch_untied_graph_does_not_fire():
    torch.manual_seed(0)
    result = ScatterEmbeddingGradientPass()(_from_torch(TiedLM(tied=False)))
    assert not result.modified
