"""torch.onnx's decomposition of the joint program, left out where it has nothing to decompose
(``ortpass.training.onnx_decomposition``): the ONNX graph is the same either way, the
program is decomposed as always where torchlib lacks an op, and ``aten.squeeze.dims`` (the
one such op the families' joint programs held) is written as torch computes it."""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import onnx_ir as ir
import pytest
import torch
from torch import nn

from ortpass.runtime import TrainingSession
from ortpass.training import onnx_decomposition
from ortpass.training.from_torch import build_training_graph_from_torch

pytestmark = pytest.mark.stock

LOGGER = "ortpass.training.onnx_decomposition"


class _Gated(nn.Module):
    """A per-position gate broadcast over the features: its gradient sums and squeezes the
    unsqueezed dim (``aten.squeeze.dims`` in the joint program)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.gate = nn.Linear(8, 1)
        self.head = nn.Linear(8, 16)

    def forward(self, ids, labels):
        hidden = self.embed(ids)
        gate = torch.sigmoid(self.gate(hidden).squeeze(-1)).unsqueeze(-1)
        logits = self.head(hidden * gate)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _batch(batch: int, seq: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (batch, seq), generator=generator), torch.randint(0, 16, (batch, seq), generator=generator)


def _build(module: nn.Module) -> ir.Model:
    return build_training_graph_from_torch(module, _batch(3, 5, 0), input_names=["ids", "labels"],
                                           dynamic_axes={"ids": [0, 1], "labels": [0, 1]})  # fmt: skip


def _structure(model: ir.Model) -> list:
    """The graph's nodes with their inputs numbered in order of appearance: equal for two
    graphs that differ in value names only."""
    number: dict[str, int] = {}
    for value in [*model.graph.inputs, *model.graph.initializers.values()]:
        number.setdefault(value.name, len(number))
    nodes = []
    for node in model.graph:
        inputs = tuple(number.get(v.name, v.name) if v is not None else None for v in node.inputs)
        for out in node.outputs:
            number[out.name] = len(number)
        attributes = sorted((name, repr(attr.value)) for name, attr in node.attributes.items())
        nodes.append((node.domain, node.op_type, inputs, len(node.outputs), tuple(attributes)))
    return nodes


@pytest.fixture
def decompositions(monkeypatch):
    """Counts the calls of torch.onnx's own decomposition of a program."""
    from torch.onnx._internal.exporter import _fx_passes

    calls = []
    original = _fx_passes.decompose_with_registry

    def counted(program, registry):
        calls.append(program)
        return original(program, registry)

    monkeypatch.setattr(_fx_passes, "decompose_with_registry", counted)
    return calls


def test_a_joint_program_with_nothing_to_decompose_is_written_as_it_is_the_same_graph(decompositions, monkeypatch, caplog):
    torch.manual_seed(0)
    module = _Gated()
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        model = _build(module)
    assert not decompositions  # torch.onnx's second trace of the joint program left out
    assert any("decomposition left out" in r.getMessage() for r in caplog.records if r.name == LOGGER)
    # torch.onnx decomposing it as before this module: the same ONNX graph.
    monkeypatch.setattr(onnx_decomposition, "decomposing_only_what_needs_it", contextlib.nullcontext)
    monkeypatch.setattr(onnx_decomposition, "translations", dict)
    decomposed = _build(module)
    assert len(decompositions) == 1
    assert _structure(model) == _structure(decomposed)
    # And it trains like torch, at the trace's sizes and others (the dims stay symbolic).
    for batch, seq in [(3, 5), (2, 9)]:
        ids, labels = _batch(batch, seq, seed=batch)
        module.zero_grad()
        loss = module(ids, labels)
        loss.backward()
        result = TrainingSession(model).run({"ids": ids.numpy(), "labels": labels.numpy()})
        assert result.loss == pytest.approx(loss.item(), rel=1e-6)
        for name, param in module.named_parameters():
            np.testing.assert_allclose(result.gradients[name], param.grad.numpy(), rtol=1e-5, atol=1e-6)


class _Squeezed(nn.Module):
    def forward(self, x):
        return torch.ops.aten.squeeze.dims(x, [0, 1, -1]) * 2


def _session(program, table):
    import onnxruntime as ort

    with onnx_decomposition.decomposing_only_what_needs_it():
        exported = torch.onnx.export(program, dynamo=True, optimize=False, verbose=False, custom_translation_table=table)
    session = ort.InferenceSession(exported.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session


@pytest.mark.parametrize("translated", [True, False], ids=["translated", "decomposed"])
def test_squeeze_dims_squeezes_the_listed_dims_of_size_one_and_keeps_the_others(translated, decompositions, caplog):
    x = torch.randn(1, 3, 4, 1, generator=torch.Generator().manual_seed(0))  # dim 1 (3) is listed, not 1
    program = torch.export.export(_Squeezed(), (x,))
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        session = _session(program, onnx_decomposition.translations() if translated else {})
    # Without ortpass's translation, squeeze.dims is in torch.onnx's table: decomposed as always.
    assert len(decompositions) == (0 if translated else 1)
    if not translated:
        assert any("aten.squeeze.dims" in r.getMessage() for r in caplog.records if r.name == LOGGER)
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    expected = _Squeezed()(x)
    assert got.shape == tuple(expected.shape) == (3, 4)
    np.testing.assert_array_equal(got, expected.numpy())
