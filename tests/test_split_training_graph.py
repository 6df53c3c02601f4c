"""Training graphs built from outputs, and training graphs split into a forward and a
backward graph (``ortpass.training.split``, ``SplitTrainingSession``): both directions of
each rule, and parity with torch and with the one-graph step."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch
from torch import nn

import ortpass
from ortpass.analysis.partition import get_training_info
from ortpass.errors import OrtpassError, StaticDimsRequired, TrainingGraphError
from ortpass.export import export
from ortpass.passes import DEFAULT_PIPELINE
from ortpass.runtime import SplitTrainingSession, TrainingSession
from ortpass.testing.models import GPTDecoder
from ortpass.training import build_training_graph
from ortpass.analysis.step_memory import predict_step_memory
from ortpass.training.split import read_forward_masks, split_training_graph


class Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _params(module):
    return {name: p.detach().numpy() for name, p in module.named_parameters()}


def test_a_graph_built_from_outputs_takes_their_gradients_and_matches_torch():
    torch.manual_seed(0)
    module, x = Logits(), torch.randn(6, 8, requires_grad=True)
    forward = export(module, (x,), input_names=["x"], loss_name=None, output_names=["logits"], inputs_with_grad=["x"],
                     dynamic_axes={"x": {0: "batch"}})  # fmt: skip
    training = build_training_graph(forward)
    info = get_training_info(training)
    assert info.loss is None and info.seeds == {"logits": "logits_grad"} and info.input_gradients == {"x": "x_grad"}
    assert "logits_grad" in {v.name for v in training.graph.inputs}
    with pytest.raises(OrtpassError, match="run it with ortpass.runtime.SplitTrainingSession"):
        TrainingSession(training)
    seed = torch.randn(3, 5)  # another batch size than the export's
    x3 = torch.randn(3, 8, requires_grad=True)
    outputs, gradients = SplitTrainingSession(training).run({"x": x3.detach().numpy(), **_params(module)}, {"logits": seed.numpy()})
    logits = module(x3)
    logits.backward(seed)
    np.testing.assert_allclose(outputs["logits"], logits.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gradients["x_grad"], x3.grad.numpy(), rtol=1e-5, atol=1e-6)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(gradients[f"{name}_grad"], p.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_the_outputs_to_differentiate_must_be_float_graph_outputs():
    torch.manual_seed(0)
    forward = export(Logits(), (torch.randn(2, 8),), input_names=["x"], loss_name=None, output_names=["logits"])
    with pytest.raises(TrainingGraphError, match=r"output 'nope' to differentiate is not a graph output"):
        build_training_graph(forward, outputs_with_grad=["nope"])
    with pytest.raises(TrainingGraphError, match=r"input 'nope' to differentiate is not a graph input"):
        build_training_graph(forward, inputs_with_grad=["nope"])


def _decoder_graph(dropout: float, pipeline: str = DEFAULT_PIPELINE):
    torch.manual_seed(0)
    module = GPTDecoder(vocab=32, hidden=16, heads=2, layers=2, dropout=dropout)
    ids = torch.randint(0, 32, (2, 8))
    forward = export(module, (ids, ids), input_names=["ids", "labels"])
    return ortpass.pipeline(pipeline)(forward).model, {"ids": ids.numpy(), "labels": ids.numpy()}


def test_a_split_loss_graph_computes_what_the_one_graph_step_computes_with_dropout_recomputed():
    """Dropout 0.1, recomputed: the backward clones read the forward masks instead of
    drawing them again, and give the same gradients as the one graph drawing them."""
    model, batch = _decoder_graph(0.1)
    one = TrainingSession(model).run(batch)
    outputs, gradients = SplitTrainingSession(model).run(batch)
    assert outputs["loss"] == pytest.approx(one.loss, rel=1e-6)
    info = get_training_info(model)
    for param, grad in info.gradients.items():
        np.testing.assert_allclose(gradients[grad], one.gradients[param], rtol=1e-5, atol=1e-7)


def test_backward_dropouts_seeded_like_forward_ones_read_the_forward_mask():
    model, _ = _decoder_graph(0.1)
    clone = model.clone()
    rewritten = read_forward_masks(clone)
    assert rewritten > 0
    assert not any(n.op_type == "Dropout" and n.metadata_props.get("pkg.ortpass.side") == "backward" for n in clone.graph)
    assert sum(n.op_type == "DropoutGrad" for n in clone.graph) >= rewritten
    unseeded, _ = _decoder_graph(0.1, "build-training-graph")  # no recompute, no replay: nothing to pair
    assert read_forward_masks(unseeded.clone()) == 0


def test_in_standard_ops_the_mask_product_is_typed_and_shaped_so_its_memory_is_predicted():
    """Stock onnxruntime's form, ``x * (1 / (1 - ratio)) * CastLike(mask, x)``: the cast mask
    and the scaled input are as large as ``x``, and a step prediction that could not size
    them left them out (GPT-2: 32 MiB each per layer)."""
    model, _ = _decoder_graph(0.1)
    read_forward_masks(model, standard_ops=True)
    products = [n for n in model.graph if "_kept_mask" in (n.name or "")]
    assert products and not any(n.op_type == "DropoutGrad" for n in model.graph)
    for node in products:
        for value in node.outputs:
            assert value.dtype == ir.DataType.FLOAT and value.shape is not None, node.name
    cast = next(n for n in products if n.op_type == "CastLike" and n.inputs[0].dtype == ir.DataType.BOOL)
    assert cast.outputs[0].shape == cast.inputs[0].shape
    assert predict_step_memory(model).unknown == []


def test_the_split_graphs_stash_what_backward_reads_and_nothing_else():
    model, _ = _decoder_graph(0.0)
    graphs = split_training_graph(model)
    forward_outputs = {o.name for o in graphs.forward.graph.output}
    backward_inputs = {i.name for i in graphs.backward.graph.input}
    assert set(graphs.stashed) <= forward_outputs and set(graphs.stashed) <= backward_inputs
    produced_by_forward = {o for n in graphs.forward.graph.node for o in n.output}
    read_by_backward = {i for n in graphs.backward.graph.node for i in n.input}
    assert set(graphs.stashed) == produced_by_forward & read_by_backward
    assert [o.name for o in graphs.backward.graph.output] == graphs.gradients


class Pooled(nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = pool
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.pool(torch.relu(self.conv(x))).mean((2, 3))).square().mean()


@pytest.mark.parametrize(
    "pool, dynamic, named",
    [
        (nn.MaxPool2d(2), {0: "b", 2: "h", 3: "w"}, {"h", "w"}),  # spatial dims: SIGSEGV in MaxPoolGrad
        (nn.AvgPool2d(2), {0: "b"}, {"b"}),  # any dim: SIGFPE in AveragePoolGrad
    ],
)
def test_pools_whose_ort_gradient_crashes_on_dynamic_dims_are_refused_naming_them(pool, dynamic, named):
    forward = export(Pooled(pool), (torch.randn(2, 3, 8, 8),), input_names=["x"], dynamic_axes={"x": dynamic})
    with pytest.raises(StaticDimsRequired, match=r"needs static") as refused:
        build_training_graph(forward)
    assert refused.value.dims == named


def test_pools_build_where_their_dims_are_static():
    module = Pooled(nn.MaxPool2d(2))
    x = torch.randn(2, 3, 8, 8)
    forward = export(module, (x,), input_names=["x"], dynamic_axes={"x": {0: "b"}})  # batch may stay dynamic
    step = TrainingSession(build_training_graph(forward)).run({"x": torch.randn(5, 3, 8, 8).numpy()})
    assert np.isfinite(step.loss)


class FrozenNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).mean((2, 3))).square().mean()


def test_an_inference_batchnorm_is_written_out_and_trains_with_its_running_statistics():
    torch.manual_seed(0)
    module = FrozenNorm()
    with torch.no_grad():
        module.norm.running_mean.uniform_(-1, 1)
        module.norm.running_var.uniform_(0.5, 2)
    module.norm.eval()
    x = torch.randn(4, 3, 8, 8)
    training = build_training_graph(export(module, (x,), input_names=["x"], training=None))
    assert not any("BatchNorm" in n.op_type for n in training.graph)
    step = TrainingSession(training).run({"x": x.numpy()})
    loss = module(x)
    loss.backward()
    assert step.loss == pytest.approx(loss.item(), rel=1e-5)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(step.gradients[name], p.grad.numpy(), rtol=1e-4, atol=1e-6)
    module.norm.train()  # in training mode it stays a BatchNorm (ORT's training kernel)
    training = build_training_graph(export(module, (x,), input_names=["x"], training=None))
    assert any(n.op_type == "BatchNormInternal" for n in training.graph)
