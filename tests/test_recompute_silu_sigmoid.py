"""RecomputeSiluSigmoidPass: a gated SiLU's gradient reads its own sigmoid, and the partner's
gradient is used up before the activation's gradient starts.

Built by torch's autograd (the torch builder, which writes SiLU out), so CI runs this file
on the training build and on stock onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

from ortpass.analysis.ort_order import order_gradient_leaves
from ortpass.analysis.partition import is_backward, tag
from ortpass.analysis.step_memory import predict_step_memory
from ortpass.conventions import CREATED_BY_KEY, RECOMPUTE_OF_KEY
from ortpass.passes import RecomputeSiluSigmoidPass
from ortpass.runtime import TrainingSession
from ortpass.runtime.parity import check_parity
from ortpass.testing.models import GatedMLP
from ortpass.testing.profiling import ort_execution_order
from ortpass.training.from_torch import build_training_graph_from_torch

pytestmark = pytest.mark.stock

BATCH, SEQ, HIDDEN, FFN = 4, 32, 16, 64


def _batch() -> dict[str, np.ndarray]:
    return {name: v.numpy() for name, v in GatedMLP(HIDDEN, FFN).example_batch(BATCH, SEQ).items()}


def _training(**kwargs) -> tuple[GatedMLP, ir.Model]:
    torch.manual_seed(0)
    module = GatedMLP(hidden=HIDDEN, ffn=FFN, **kwargs)
    x, target = (torch.from_numpy(v) for v in _batch().values())
    # The input's gradient as well, as in a layer of a model: dU's second reader.
    return module, build_training_graph_from_torch(module, (x.requires_grad_(), target), input_names=["x", "target"])


def _forward_sigmoid(model: ir.Model) -> ir.Node:
    (sigmoid,) = [n for n in model.graph if n.op_type == "Sigmoid" and not is_backward(n)]
    return sigmoid


def _products(model: ir.Model) -> tuple[ir.Node, ir.Node]:
    """(``dU = dY * A``, ``dA = dY * U``): the backward Muls reading the SiLU's output and
    the up projection's."""
    sigmoid = _forward_sigmoid(model)
    (activation,) = [n for n, _ in sigmoid.outputs[0].uses() if n.op_type == "Mul" and not is_backward(n)]
    (gated,) = [n for n, _ in activation.outputs[0].uses() if not is_backward(n)]
    partner = next(v for v in gated.inputs if v is not activation.outputs[0])
    (d_up,) = [n for n, _ in activation.outputs[0].uses() if is_backward(n) and n.op_type == "Mul"]
    (d_act,) = [n for n, _ in partner.uses() if is_backward(n) and n.op_type == "Mul"]
    return d_up, d_act


def _weight_gradient(model: ir.Model, param: str) -> str:
    return next(n.name for n in model.graph for out in n.outputs if out.name == f"{param}_grad")


def _input_gradient_of_up(model: ir.Model, d_up: ir.Node) -> str:
    """The matrix product (``Gemm(dU, W, transB=1)`` as the torch builder writes it) that
    turns ``dU`` into the gradient of the MLP's input."""
    weight_gradient = _weight_gradient(model, "up.weight")
    seen, stack = [], [d_up.outputs[0]]
    while stack:
        for reader, _ in stack.pop().uses():
            if reader.op_type in ("Reshape", "Transpose"):
                stack.append(reader.outputs[0])
            elif reader.op_type in ("MatMul", "Gemm") and reader.name != weight_gradient:
                seen.append(reader.name)
    (name,) = seen
    return name


def test_the_gradient_reads_its_own_sigmoid_and_the_forward_one_dies_in_forward():
    _, model = _training()
    sigmoid = _forward_sigmoid(model)
    assert [n for n, _ in sigmoid.outputs[0].uses() if is_backward(n)]  # the gradient reads it: stashed
    pass_ = RecomputeSiluSigmoidPass()
    assert pass_(model).modified
    assert dict(pass_.stats["counts"]) == {"sigmoids copied": 1, "partner gradients finished first": 1}
    assert not [n for n, _ in sigmoid.outputs[0].uses() if is_backward(n)]
    (copy,) = [n for n in model.graph if n.op_type == "Sigmoid" and is_backward(n)]
    assert copy.inputs[0] is sigmoid.inputs[0]
    assert copy.metadata_props[RECOMPUTE_OF_KEY] == sigmoid.name
    assert copy.metadata_props[CREATED_BY_KEY] == "recompute-silu-sigmoid"
    assert {n.op_type for n, _ in copy.outputs[0].uses()} >= {"Sub", "Mul"}  # torch's silu_backward formula


def test_ort_uses_up_the_partner_gradient_before_the_activation_gradient(tmp_path):
    _, model = _training()
    # The leaf order the recompute pass writes (HF LLaMA's, where this was found).
    order_gradient_leaves(model.graph, list(model.graph))
    d_up, d_act = _products(model)
    readers = (_weight_gradient(model, "up.weight"), _input_gradient_of_up(model, d_up))
    before = ort_execution_order(model, _batch(), tmp_path)
    # As built, ORT computes dA = dY * U before the up projection's input gradient, which
    # keeps dU alive through the activation's whole gradient.
    assert before.index(readers[1]) > before.index(d_act.name)
    pass_ = RecomputeSiluSigmoidPass()
    assert pass_(model).modified
    after = ort_execution_order(model, _batch(), tmp_path)
    assert max(after.index(r) for r in readers) < after.index(d_act.name)
    copy = next(n.name for n in model.graph if n.op_type == "Sigmoid" and is_backward(n))
    assert after.index(d_up.name) < after.index(copy)  # the forward sigmoid is not held to here


def test_the_predicted_peak_falls_by_a_batch_x_seq_x_ffn_tensor():
    _, model = _training()
    rewritten = RecomputeSiluSigmoidPass()(model.clone()).model
    wide = BATCH * SEQ * FFN * 4
    before, after = predict_step_memory(model).peak_bytes, predict_step_memory(rewritten).peak_bytes
    assert before - after >= wide, (before, after)


def test_training_steps_match_the_unrewritten_graph_and_torch():
    module, model = _training()
    expected = TrainingSession(model.clone()).run(_batch())
    pass_ = RecomputeSiluSigmoidPass()
    rewritten = pass_(model).model
    assert dict(pass_.stats["counts"])["partner gradients finished first"] == 1
    got = TrainingSession(rewritten).run(_batch())
    assert got.loss == expected.loss
    for name, grad in expected.gradients.items():
        np.testing.assert_array_equal(got.gradients[name], grad, err_msg=name)
    args = tuple(torch.from_numpy(v) for v in _batch().values())
    check_parity(module, args, rewritten, input_names=["x", "target"]).assert_ok()


@pytest.mark.parametrize("kwargs", [{"gated": False}, {"act": "gelu"}])
def test_does_not_fire_without_a_gated_silu(kwargs):
    _, model = _training(**kwargs)
    pass_ = RecomputeSiluSigmoidPass()
    assert not pass_(model).modified
    assert not [n for n in model.graph if n.metadata_props.get(CREATED_BY_KEY) == "recompute-silu-sigmoid"]


def test_a_partner_gradient_whose_reader_needs_the_activation_gradient_is_left_alone():
    """By hand: ``dU``'s only reader adds ``dA`` (as Phi-3's fused projection's gradients
    meet in a ``Concat``), so ``dA`` cannot wait for it: a cycle.  Nothing changes, the
    sigmoid copy included (it pays only with the order)."""
    shape = ir.Shape([2, 3])
    gate, up, incoming = (ir.Value(name=n, type=ir.TensorType(ir.DataType.FLOAT), shape=shape) for n in ("g", "u", "dy"))
    sigmoid = ir.node("Sigmoid", [gate], name="sigmoid")
    activation = ir.node("Mul", [gate, sigmoid.outputs[0]], name="act")
    gated = ir.node("Mul", [activation.outputs[0], up], name="gated")
    d_up = ir.node("Mul", [incoming, activation.outputs[0]], name="d_up")
    d_act = ir.node("Mul", [incoming, up], name="d_act")
    one_minus = ir.node("Sub", [ir.val("one", ir.DataType.FLOAT, []), sigmoid.outputs[0]], name="one_minus")
    joined = ir.node("Add", [d_up.outputs[0], d_act.outputs[0]], name="joined")
    chain = ir.node("Mul", [joined.outputs[0], one_minus.outputs[0]], name="chain")
    nodes = [sigmoid, activation, gated, d_up, d_act, one_minus, joined, chain]
    for node in nodes:
        for out in node.outputs:
            out.dtype, out.shape = ir.DataType.FLOAT, shape
        tag(node, "backward" if node.name not in ("sigmoid", "act", "gated") else "forward")
    one = one_minus.inputs[0]
    one.const_value = ir.tensor(np.array(1.0, dtype=np.float32))
    one.shape = ir.Shape([])
    graph = ir.Graph([gate, up, incoming], [gated.outputs[0], chain.outputs[0]], nodes=nodes, initializers=[one], opset_imports={"": 20})
    model = ir.Model(graph, ir_version=10)
    pass_ = RecomputeSiluSigmoidPass()
    assert not pass_(model).modified
    assert [n.name for n in model.graph] == [n.name for n in nodes]
    assert d_act.inputs[0] is incoming and one_minus.inputs[1] is sigmoid.outputs[0]
