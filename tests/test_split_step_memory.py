"""What a split step (the loss computed in torch) keeps between its halves: masks as bits
(``ortpass.training.packed_masks``), and the outputs' gradients consumed by the head of
backward before its body runs (``ortpass.training.backward_head``).  Both directions of each
rule, and parity with torch under dropout."""

from __future__ import annotations

import weakref

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from torch import nn

from ortpass import ORTModule
from ortpass.analysis.partition import is_backward, tag
from ortpass.runtime import split_session
from ortpass.training.backward_head import cut_backward_head
from ortpass.training.packed_masks import PACKED_SUFFIX, pack_kept_masks


def _mask_graph(n: int) -> ir.Model:
    """``y = x * m`` in forward, ``dx = dy * m`` in backward, ``m`` a boolean input read on
    both sides: the shape of a kept Dropout mask."""
    graph = helper.make_graph(
        [helper.make_node("Not", ["flip"], ["m"], name="make_mask"),
         helper.make_node("CastLike", ["m", "x"], ["mf"], name="mask_as_x"),
         helper.make_node("Mul", ["x", "mf"], ["y"], name="forward_mul"),
         helper.make_node("CastLike", ["m", "dy"], ["mg"], name="mask_as_dy"),
         helper.make_node("Mul", ["dy", "mg"], ["dx"], name="backward_mul")],
        "g",
        [helper.make_tensor_value_info("flip", TensorProto.BOOL, [n]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [n]),
         helper.make_tensor_value_info("dy", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n]),
         helper.make_tensor_value_info("dx", TensorProto.FLOAT, [n])],
        value_info=[helper.make_tensor_value_info("m", TensorProto.BOOL, [n])],
    )  # fmt: skip
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    for node in model.graph:
        tag(node, "backward" if node.name in ("mask_as_dy", "backward_mul") else "forward")
    return model


@pytest.mark.stock
@pytest.mark.parametrize("n", [1, 8, 13, 64, 1001])
def test_a_kept_mask_is_packed_in_forward_and_unpacked_equal_in_backward(n):
    import onnxruntime

    model = _mask_graph(n)
    assert pack_kept_masks(model) == 1
    forward_ops = [node.op_type for node in model.graph if not is_backward(node)]
    assert "MatMulInteger" in forward_ops
    backward_reader = next(node for node in model.graph if node.name == "mask_as_dy")
    assert backward_reader.inputs[0].name != "m" and backward_reader.inputs[0].dtype == ir.DataType.BOOL
    packed = next(v for node in model.graph for v in node.outputs if v.name == f"m{PACKED_SUFFIX}")
    # The unpacked mask is read back out of the graph to compare it with the forward one.
    model.graph.outputs.extend([backward_reader.inputs[0], packed])
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(n)
    flip = rng.random(n) < 0.3
    x, dy = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    y, dx, unpacked, bits = session.run(None, {"flip": flip, "x": x, "dy": dy})
    np.testing.assert_array_equal(unpacked, ~flip)
    np.testing.assert_array_equal(dx, dy * ~flip)
    assert bits.dtype == np.uint8 and bits.size == -(-n // 8)  # an eighth of the bytes, rounded up


def test_a_mask_read_on_one_side_only_is_not_packed():
    model = _mask_graph(16)
    for node in model.graph:
        tag(node, "forward")
    assert pack_kept_masks(model) == 0
    assert not any(node.op_type == "MatMulInteger" for node in model.graph)


def _backward_graph(reads_seed_only: bool) -> onnx.ModelProto:
    """``dh = dy @ W^T`` (the head: it reads the seed ``dy``), then ``dx = dh * s`` (the body)."""
    nodes = [helper.make_node("Reshape", ["dy", "flat"], ["dy2"], name="seed_view"),
             helper.make_node("MatMul", ["dy2", "wt"], ["dh"], name="head_matmul"),
             helper.make_node("Mul", ["dh", "s" if not reads_seed_only else "dy2"], ["dx"], name="body_mul")]
    graph = helper.make_graph(
        nodes, "bw",
        [helper.make_tensor_value_info("dy", TensorProto.FLOAT, [2, 3, 4]),
         helper.make_tensor_value_info("wt", TensorProto.FLOAT, [4, 4]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, [6, 4])],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [6, 4])],
        initializer=[onnx.numpy_helper.from_array(np.array([6, 4], dtype=np.int64), "flat")],
        value_info=[helper.make_tensor_value_info("dh", TensorProto.FLOAT, [6, 4]),
                    helper.make_tensor_value_info("dy2", TensorProto.FLOAT, [6, 4])],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.stock
def test_backward_is_cut_after_the_nodes_that_read_the_seed_and_the_halves_compute_the_whole():
    import onnxruntime

    whole = _backward_graph(reads_seed_only=False)
    halves = cut_backward_head(whole, ["dy"])
    assert halves is not None and halves.cut == ["dh"]
    assert [n.name for n in halves.head.graph.node] == ["seed_view", "head_matmul"]
    assert [n.name for n in halves.body.graph.node] == ["body_mul"]
    assert "dy" not in {i.name for i in halves.body.graph.input}  # the body never holds the seed
    rng = np.random.default_rng(0)
    feeds = {"dy": rng.standard_normal((2, 3, 4)).astype(np.float32), "wt": rng.standard_normal((4, 4)).astype(np.float32),
             "s": rng.standard_normal((6, 4)).astype(np.float32)}  # fmt: skip

    def run(proto, values):
        session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return dict(zip([o.name for o in proto.graph.output], session.run(None, {i.name: values[i.name] for i in proto.graph.input})))

    (dh,) = run(halves.head, feeds).values()
    np.testing.assert_array_equal(run(halves.body, {**feeds, "dh": dh})["dx"], run(whole, feeds)["dx"])


def test_backward_is_not_cut_where_every_node_reads_the_seed():
    # The body's Mul reads a view of the seed: it belongs to the head, and nothing is left.
    assert cut_backward_head(_backward_graph(reads_seed_only=True), ["dy"]) is None
    assert cut_backward_head(_backward_graph(reads_seed_only=False), ["not_a_seed"]) is None


class _DropoutHidden(nn.Module):
    """The hidden values after dropout, returned: the test reads each forward's mask off
    them (``h != 0``; the projection is nonzero almost surely)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 32)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


@pytest.mark.stock
def test_two_micro_batches_summed_before_one_backward_each_use_their_forward_mask_like_torch():
    """Backward runs the second micro-batch first: each must still multiply by its own
    forward's mask.  torch's reference applies the masks ORT drew, read off the outputs."""
    torch.manual_seed(0)
    model = _DropoutHidden()
    reference = _DropoutHidden()
    reference.load_state_dict(model.state_dict())
    wrapped = ORTModule(model)
    xs = [torch.randn(n, 12) for n in (5, 7)]
    targets = [torch.randn(n, 32) for n in (5, 7)]
    hidden = [wrapped(x) for x in xs]
    sum(((h - t) ** 2).sum() for h, t in zip(hidden, targets)).backward()
    masks = [h.detach() != 0 for h in hidden]
    assert all(0.2 < m.float().mean() < 0.8 for m in masks)  # dropout did drop
    assert not torch.equal(masks[0][:5], masks[1][:5])
    expected = sum(((reference.fc(x) * m / 0.5 - t) ** 2).sum() for x, m, t in zip(xs, masks, targets))
    expected.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.stock
def test_the_outputs_gradient_is_freed_before_the_body_of_backward_runs(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 40))
    wrapped = ORTModule(model)
    x, labels = torch.randn(6, 8), torch.randint(0, 40, (6,))
    seen: list = []
    freed_when_body_ran: list[bool] = []
    body = split_session.SplitTrainingSession.run_backward_body

    def run_body(self, feeds, stash, head):
        freed_when_body_ran.append(seen[0]() is None)
        return body(self, feeds, stash, head)

    monkeypatch.setattr(split_session.SplitTrainingSession, "run_backward_body", run_body)
    logits = wrapped(x)
    logits.register_hook(lambda g: seen.append(weakref.ref(g)))
    F.cross_entropy(logits, labels).backward()
    assert freed_when_body_ran == [True]
    reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 40))
    reference.load_state_dict(model.state_dict())
    F.cross_entropy(reference(x), labels).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)



def _transpose_graph() -> ir.Model:
    """Forward: ``wt = Transpose(w)`` (a weight), ``ht = Transpose(h)`` (an activation),
    ``y = x @ wt``; backward: ``dx = dy @ Transpose(wt)`` reads ``wt`` and ``ht``."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["h"], name="activation"),
         helper.make_node("Transpose", ["w"], ["wt"], name="weight_t", perm=[1, 0]),
         helper.make_node("Transpose", ["h"], ["ht"], name="activation_t", perm=[1, 0]),
         helper.make_node("MatMul", ["x", "wt"], ["y"], name="forward_matmul"),
         helper.make_node("MatMul", ["dy", "w"], ["dx0"], name="backward_matmul"),
         helper.make_node("Gemm", ["ht", "dy"], ["dw"], name="backward_gemm"),
         helper.make_node("Sum", ["dx0", "wt_read"], ["dx"], name="backward_sum"),
         helper.make_node("ReduceSum", ["wt"], ["wt_read"], name="backward_reads_wt", keepdims=0)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [5, 4]),
         helper.make_tensor_value_info("dy", TensorProto.FLOAT, [3, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5]),
         helper.make_tensor_value_info("dx", TensorProto.FLOAT, [3, 4]),
         helper.make_tensor_value_info("dw", TensorProto.FLOAT, [4, 5])],
    )  # fmt: skip
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    for node in model.graph:
        tag(node, "backward" if node.name.startswith("backward") else "forward")
    return model


def test_a_weights_transpose_is_transposed_again_in_backward_and_an_activations_is_kept():
    from ortpass.training.rederived_stash import rederive_layout_of_inputs

    model = _transpose_graph()
    assert rederive_layout_of_inputs(model) == 1
    nodes = {node.name: node for node in model.graph}
    again = nodes["weight_t_in_backward"]
    assert is_backward(again) and again.inputs[0].name == "w"
    assert nodes["backward_reads_wt"].inputs[0] is again.outputs[0]
    assert nodes["forward_matmul"].inputs[1].name == "wt"  # forward keeps its own
    assert nodes["backward_gemm"].inputs[0].name == "ht"  # an activation's transpose stays kept
    assert rederive_layout_of_inputs(model) == 0  # nothing left that backward reads from forward
