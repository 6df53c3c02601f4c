"""Transformer layer boundaries (ortpass.analysis.layers) and layer-wise recompute plans."""

import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
import torch

from ortpass.analysis import find_layer_boundaries, find_recompute_candidates, get_partition
from ortpass.export import export
from ortpass.testing.models import GPTDecoder
from ortpass.training import build_training_graph

F32 = onnx.TensorProto.FLOAT


def _decoder_training_graph(layers: int) -> ir.Model:
    """A GPT-like decoder (LayerNorm, causal masked softmax attention, GELU MLP, residuals;
    hidden 32) through export and the gradient build."""
    torch.manual_seed(0)
    module = GPTDecoder(vocab=32, hidden=32, heads=4, layers=layers, max_seq=16, dropout=0.1)
    ids = torch.randint(0, 32, (2, 8))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}}
    forward = export(module, (ids, ids), input_names=["input_ids", "labels"], dynamic_axes=axes)
    return build_training_graph(forward)


@pytest.fixture(scope="module", params=[2, 4])
def decoder(request):
    return request.param, _decoder_training_graph(request.param)


def test_decoder_has_one_boundary_per_layer(decoder):
    layers, model = decoder
    boundaries = find_layer_boundaries(get_partition(model).forward)
    assert len(boundaries) == layers
    # Each is the block's first LayerNorm (ln1); the MLP's ln2 and the final ln_f are not.
    assert [n.name for n in boundaries.nodes] == [f"/blocks.{i}/ln1/LayerNormalization" for i in range(layers)]


def test_layerwise_plans_lie_inside_layers_and_keep_layer_inputs(decoder):
    layers, model = decoder
    everything = find_recompute_candidates(model)
    layerwise = find_recompute_candidates(model, layer_boundary=True)
    assert len(layerwise.layer_boundaries) == layers
    occurrences = [o for p in layerwise.plans for o in p.occurrences]
    assert occurrences and all(o.layer is not None for o in occurrences)
    assert {o.layer for o in occurrences} == set(range(layers))
    boundary_inputs = {n.inputs[0] for n in layerwise.layer_boundaries}
    assert not any(v in boundary_inputs for o in occurrences for v in o.stashed)
    # The unrestricted analysis also finds candidates before the first layer (embeddings).
    outside = [o for p in everything.plans for o in p.occurrences if o.layer is None]
    assert outside
    # Every layer-wise occurrence is one the unrestricted analysis found too.
    unrestricted = {(o.entry, o.cluster, o.type) for p in everything.plans for o in p.occurrences}
    assert {(o.entry, o.cluster, o.type) for o in occurrences} <= unrestricted


def _block(prefix, x, with_attention):
    """LayerNorm -> (Softmax or Relu) -> residual Add; returns nodes and the block output."""
    scale = f"{prefix}_scale"
    nodes = [
        oh.make_node("LayerNormalization", [x, scale], [f"{prefix}_ln"], name=f"{prefix}_ln", axis=-1),
        oh.make_node("Softmax" if with_attention else "Relu", [f"{prefix}_ln"], [f"{prefix}_act"], name=f"{prefix}_act"),
        oh.make_node("Add", [x, f"{prefix}_act"], [f"{prefix}_out"], name=f"{prefix}_add"),
    ]
    return nodes, f"{prefix}_out", oh.make_tensor(scale, F32, [4], [1.0] * 4)


def test_layernorm_rule_on_a_hand_built_graph():
    nodes, inits = [], []
    x = "x"
    for prefix, attention in [("attn0", True), ("mlp0", False), ("attn1", True), ("mlp1", False)]:
        block, x, scale = _block(prefix, x, attention)
        nodes += block
        inits.append(scale)
    final = oh.make_node("LayerNormalization", [x, "attn0_scale"], ["y"], name="ln_f", axis=-1)
    graph = oh.make_graph(
        nodes + [final], "g", [oh.make_tensor_value_info("x", F32, [2, 4])],
        [oh.make_tensor_value_info("y", F32, [2, 4])], inits,
    )
    model = ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))
    forward = list(model.graph)
    boundaries = find_layer_boundaries(forward)
    assert [n.name for n in boundaries.nodes] == ["attn0_ln", "attn1_ln"]
    position = {n.name: i for i, n in enumerate(forward)}
    assert boundaries.layer_of(position["mlp0_add"]) == 0
    assert boundaries.layer_of(position["attn1_act"]) == 1
    # The last layer ends with the last Add of its residual stream (mlp1_add); ln_f is after it.
    assert boundaries.layer_of(position["mlp1_add"]) == 1
    assert boundaries.layer_of(position["ln_f"]) is None
    assert boundaries.is_layer_input(model.graph.node("attn0_ln").inputs[0])
    assert boundaries.is_checkpoint(model.graph.node("attn1_ln").inputs[0])
    assert boundaries.is_checkpoint(model.graph.node("mlp1_add").outputs[0])  # the last layer's output
    assert not boundaries.is_checkpoint(model.graph.node("attn0_add").outputs[0])  # inside layer 0

