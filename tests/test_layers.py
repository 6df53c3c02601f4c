"""Transformer layer boundaries (ortpass.analysis.layers) and layer-wise recompute plans."""

import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
import torch

from ortpass.analysis import (
    find_layer_boundaries,
    find_recompute_candidates,
    get_partition,
)
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



@pytest.mark.parametrize("square", ["Pow", "Mul", "Mul of two values"])
def test_an_rmsnorm_written_out_is_a_boundary_by_its_square_read_by_a_reduce_mean(square):
    """torch's RMSNorm, ``x * (mean(x ** 2) + eps) ** -0.5``, starts a layer when its square
    is ``Pow(x, 2)`` (torch.onnx's) or ``Mul(x, x)`` (the torch builder's); a ``Mul`` of
    two values read by a ``ReduceMean`` is no square, and no boundary."""
    other = "x" if square != "Mul of two values" else "y_in"
    first = (oh.make_node("Pow", ["x", "two"], ["sq"], name="norm_square") if square == "Pow"
             else oh.make_node("Mul", ["x", other], ["sq"], name="norm_square"))  # fmt: skip
    nodes = [
        first,
        oh.make_node("ReduceMean", ["sq", "axes"], ["ms"], name="norm_mean", keepdims=1),
        oh.make_node("Add", ["ms", "eps"], ["ms_eps"], name="norm_eps"),
        oh.make_node("Pow", ["ms_eps", "minus_half"], ["rstd"], name="norm_rstd"),
        oh.make_node("Mul", ["x", "rstd"], ["normed"], name="norm_out"),
        oh.make_node("Softmax", ["normed"], ["attn"], name="attn"),
        oh.make_node("Add", ["x", "attn"], ["y"], name="residual"),
    ]
    constants = [oh.make_tensor("two", F32, [], [2.0]), oh.make_tensor("eps", F32, [], [1e-6]),
                 oh.make_tensor("minus_half", F32, [], [-0.5]), oh.make_tensor("axes", onnx.TensorProto.INT64, [1], [-1])]  # fmt: skip
    inputs = [oh.make_tensor_value_info("x", F32, [2, 4]), oh.make_tensor_value_info("y_in", F32, [2, 4])]
    graph = oh.make_graph(nodes, "g", inputs, [oh.make_tensor_value_info("y", F32, [2, 4])], constants)
    model = ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]))
    boundaries = find_layer_boundaries(list(model.graph))
    expected = [] if square == "Mul of two values" else ["norm_square"]
    assert [n.name for n in boundaries.nodes] == expected

def _post_ln_block(prefix, x, with_attention):
    """Post-LN block (BERT): (Softmax or Relu) -> residual Add -> LayerNorm; returns nodes
    and the block output (the LayerNorm's)."""
    scale = f"{prefix}_scale"
    nodes = [
        oh.make_node("Softmax" if with_attention else "Relu", [x], [f"{prefix}_act"], name=f"{prefix}_act"),
        oh.make_node("Add", [x, f"{prefix}_act"], [f"{prefix}_sum"], name=f"{prefix}_add"),
        oh.make_node("LayerNormalization", [f"{prefix}_sum", scale], [f"{prefix}_ln"], name=f"{prefix}_ln", axis=-1),
    ]
    return nodes, f"{prefix}_ln", oh.make_tensor(scale, F32, [4], [1.0] * 4)


def _post_ln_model(blocks, *, dropout_after_embedding=True) -> ir.Model:
    """Embedding LayerNorm (and Dropout) -> post-LN blocks -> a head (MatMul) that reads the
    last block's LayerNorm."""
    inits = [oh.make_tensor("emb_scale", F32, [4], [1.0] * 4), oh.make_tensor("head_w", F32, [4, 4], [0.5] * 16)]
    nodes = [oh.make_node("LayerNormalization", ["x", "emb_scale"], ["emb_ln"], name="emb_ln", axis=-1)]
    x = "emb_ln"
    if dropout_after_embedding:
        nodes.append(oh.make_node("Dropout", [x], ["emb_drop"], name="emb_drop"))
        x = "emb_drop"
    for prefix, attention in blocks:
        block, x, scale = _post_ln_block(prefix, x, attention)
        nodes += block
        inits.append(scale)
    nodes.append(oh.make_node("MatMul", [x, "head_w"], ["y"], name="head"))
    graph = oh.make_graph(
        nodes, "g", [oh.make_tensor_value_info("x", F32, [2, 4])], [oh.make_tensor_value_info("y", F32, [2, 4])], inits
    )
    return ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))


@pytest.mark.parametrize("dropout_after_embedding", [True, False])
def test_post_ln_rule_finds_one_boundary_per_block(dropout_after_embedding):
    blocks = [("attn0", True), ("mlp0", False), ("attn1", True), ("mlp1", False)]
    model = _post_ln_model(blocks, dropout_after_embedding=dropout_after_embedding)
    forward = list(model.graph)
    boundaries = find_layer_boundaries(forward)
    # The embedding LayerNorm opens layer 0, the one closing layer 0 (mlp0_ln) opens layer
    # 1; attn*_ln (before the MLP) and mlp1_ln (read by the head only) open nothing.
    assert [n.name for n in boundaries.nodes] == ["emb_ln", "mlp0_ln"]
    position = {n.name: i for i, n in enumerate(forward)}
    assert boundaries.layer_of(position["attn0_act"]) == 0
    assert boundaries.layer_of(position["mlp0_add"]) == 0
    assert boundaries.layer_of(position["attn1_act"]) == 1
    assert boundaries.layer_of(position["mlp1_ln"]) == 1  # the last layer ends with its LayerNorm
    assert boundaries.layer_of(position["head"]) is None
    stream = "emb_drop" if dropout_after_embedding else "emb_ln"
    layer_0_input = model.graph.node(stream).outputs[0]
    assert boundaries.is_layer_input(layer_0_input)
    assert boundaries.is_layer_input(model.graph.node("mlp0_ln").outputs[0])
    assert not boundaries.is_layer_input(model.graph.node("attn0_ln").outputs[0])
    assert boundaries.last_output is model.graph.node("mlp1_ln").outputs[0]
    assert boundaries.is_checkpoint(boundaries.last_output)


def test_post_ln_rule_needs_attention_in_the_block():
    model = _post_ln_model([("mlp0", False), ("mlp1", False)])
    assert len(find_layer_boundaries(list(model.graph))) == 0


def test_post_ln_rule_adds_nothing_to_a_pre_ln_decoder(decoder):
    """No LayerNorm output of a pre-LN decoder is read by an Add, so the counts stay."""
    layers, model = decoder
    forward = get_partition(model).forward
    boundaries = find_layer_boundaries(forward)
    assert len(boundaries) == layers
    assert all(boundaries.is_layer_input(n.inputs[0]) for n in boundaries.nodes)


def test_layerwise_recompute_that_finds_no_layer_warns_with_the_way_out(caplog):
    import logging

    import ortpass
    from ortpass.testing.models import MLP

    torch.manual_seed(0)
    module = MLP(d_in=8, hidden=16, classes=5)
    x, labels = torch.randn(6, 8), torch.tensor([1, 2, 0, 4, 0, 3])
    axes = {"x": {0: "batch"}, "labels": {0: "batch"}}
    forward = export(module, (x, labels), input_names=["x", "labels"], dynamic_axes=axes)
    with caplog.at_level(logging.WARNING, logger="ortpass.passes.recompute"):
        result = ortpass.pipeline("build-training-graph,fix-dropout-seed(level=1),recompute(level=1)")(forward)
    assert not any(n.op_type for n in result.model.graph if n.name.endswith("_recompute"))
    (record,) = [r for r in caplog.records if r.name == "ortpass.passes.recompute"]
    assert record.levelno == logging.WARNING
    assert "found no layer boundary" in record.getMessage() and "recompute(plans=...)" in record.getMessage()


def test_layerwise_recompute_under_the_size_floor_warns_with_the_way_out(caplog):
    import logging

    import ortpass

    torch.manual_seed(0)
    module = GPTDecoder(vocab=32, hidden=32, heads=4, layers=2, max_seq=16, dropout=0.0)
    ids = torch.randint(0, 32, (2, 8))
    forward = export(module, (ids, ids), input_names=["input_ids", "labels"])  # static: every tensor tiny
    with caplog.at_level(logging.WARNING, logger="ortpass.passes.recompute"):
        ortpass.pipeline("build-training-graph,fix-dropout-seed(level=1),recompute(level=1)")(forward)
    (record,) = [r for r in caplog.records if r.name == "ortpass.passes.recompute"]
    message = record.getMessage()
    assert "2 layer boundaries found" in message and "smaller than 1048576 elements" in message
    assert "min_elements=N" in message and "dynamic axes" in message
