"""The torch builder (``ortpass.training.build_training_graph_from_torch``): training graphs
from torch's autograd, in standard ONNX ops, recorded as ORT's builder records its own.

Each case builds a small module's graph, runs it on ONNX Runtime (whichever is installed:
CI runs this file with the training build and in a venv holding only stock
``onnxruntime``), and compares with torch eager; or checks a refusal names its cause.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortpass
from ortpass.analysis.partition import get_partition, get_training_info
from ortpass.conventions import BUILDER_KEY, is_onnx_domain
from ortpass.errors import OrtpassError, TrainingGraphError
from ortpass.runtime import SplitTrainingSession, TrainingSession
from ortpass.runtime.parity import check_parity
from ortpass.testing.models import GPTDecoder
from ortpass.training.from_torch import build_training_graph_from_torch

pytestmark = pytest.mark.stock


class _Classifier(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def logits(self, ids):
        return self.head(F.gelu(self.hidden(self.norm(self.embed(ids)))))

    def forward(self, ids, labels):
        return F.cross_entropy(self.logits(ids).flatten(0, 1), labels.flatten())


def _batch(batch=3, seq=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (batch, seq), generator=generator), torch.randint(0, 16, (batch, seq), generator=generator)


def _torch_step(module, *args):
    module.zero_grad()
    loss = module(*args)
    loss.backward()
    return loss.item(), {n: p.grad.numpy().copy() for n, p in module.named_parameters()}


def _build(module, ids, labels, **kwargs):
    return build_training_graph_from_torch(
        module, (ids, labels), input_names=["ids", "labels"], dynamic_axes={"ids": [0, 1], "labels": [0, 1]}, **kwargs
    )


def test_loss_graph_is_standard_onnx_recorded_like_orts_and_trains_like_torch():
    torch.manual_seed(0)
    module = _Classifier()
    ids, labels = _batch()
    model = _build(module, ids, labels)
    info = get_training_info(model)
    assert info.loss == "loss" and model.metadata_props[BUILDER_KEY] == "torch"
    assert set(info.params) == {n for n, _ in module.named_parameters()}
    assert info.gradients == {p: f"{p}_grad" for p in info.params}
    # Backward starts from the value ORT's builder names so, ones, read after the loss.
    seed = next(v for node in model.graph for v in node.outputs if v.name == "loss_grad")
    assert seed.producer().op_type == "Where" and "loss_grad_ones" in model.graph.initializers
    assert all(is_onnx_domain(node.domain) for node in model.graph)  # nothing stock onnxruntime lacks
    partition = get_partition(model)
    assert partition.forward and partition.backward and partition.stashed
    # At other sizes than the trace's: the dims are symbolic.
    for batch, seq in [(3, 5), (2, 7)]:
        ids, labels = _batch(batch, seq, seed=batch)
        expected_loss, expected = _torch_step(module, ids, labels)
        result = TrainingSession(model).run({"ids": ids.numpy(), "labels": labels.numpy()})
        assert result.loss == pytest.approx(expected_loss, rel=1e-6)
        for name, grad in expected.items():
            np.testing.assert_allclose(result.gradients[name], grad, rtol=1e-5, atol=1e-6)


def test_tied_weight_gets_one_gradient_the_sum_of_both_uses():
    torch.manual_seed(0)
    module = _Classifier(tied=True)
    ids, labels = _batch()
    model = _build(module, ids, labels)
    params = get_training_info(model).params
    assert ("embed.weight" in params) != ("head.weight" in params)  # one name for the one tensor
    _, expected = _torch_step(module, ids, labels)
    result = TrainingSession(model).run({"ids": ids.numpy(), "labels": labels.numpy()})
    tied = next(p for p in params if p in ("embed.weight", "head.weight"))
    np.testing.assert_allclose(result.gradients[tied], expected["embed.weight"], rtol=1e-5, atol=1e-6)


class _Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Classifier()

    def forward(self, x, ids):
        return self.inner.logits(ids) + x, x.sum()


def test_outputs_graph_takes_each_outputs_gradient_and_gives_the_inputs():
    """No loss: the seeds are graph inputs; an input that requires grad gets a gradient."""
    torch.manual_seed(0)
    module = _Logits()
    ids, _ = _batch()
    x = torch.randn(3, 5, 16, requires_grad=True)
    model = build_training_graph_from_torch(module, (x, ids), input_names=["x", "ids"], dynamic_axes={"x": [0, 1], "ids": [0, 1]})
    info = get_training_info(model)
    assert info.loss is None
    assert info.seeds == {"output_0": "output_0_grad", "output_1": "output_1_grad"}
    assert info.input_gradients == {"x": "x_grad"}
    seeds = {"output_0": np.random.default_rng(0).standard_normal((3, 5, 16), dtype=np.float32), "output_1": np.float32(0.5)}
    outputs, gradients = SplitTrainingSession(model).run({"x": x.detach().numpy(), "ids": ids.numpy()}, seeds)
    logits, total = module(x, ids)
    torch.autograd.backward([logits, total], [torch.from_numpy(seeds["output_0"]), torch.tensor(0.5)])
    np.testing.assert_allclose(outputs["output_0"], logits.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gradients["x_grad"], x.grad.numpy(), rtol=1e-5, atol=1e-6)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(gradients[f"{name}_grad"], p.grad.numpy(), rtol=1e-5, atol=1e-6)


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 3  # not the derivative: torch.export alone would silently drop this


class _ThroughNumpy(torch.autograd.Function):
    """A custom kernel: the backward runs outside torch's ops."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return torch.from_numpy(grad.numpy() * 2)


def test_an_autograd_function_trains_with_its_own_backward():
    class WithFunction(_Classifier):
        def forward(self, ids, labels):
            return _Doubled.apply(super().forward(ids, labels))

    torch.manual_seed(0)
    module = WithFunction()
    ids, labels = _batch()
    model = _build(module, ids, labels)
    assert all(is_onnx_domain(node.domain) for node in model.graph)  # no node of the routing op is left
    expected_loss, expected = _torch_step(module, ids, labels)
    result = TrainingSession(model).run({"ids": ids.numpy(), "labels": labels.numpy()})
    assert result.loss == pytest.approx(expected_loss, rel=1e-6)
    for name, grad in expected.items():  # 3 x the classifier's gradient, not the derivative's 2 x
        np.testing.assert_allclose(result.gradients[name], grad, rtol=1e-5, atol=1e-6)


def test_an_autograd_function_torch_cannot_trace_is_refused_by_name_and_side():
    class WithKernel(_Classifier):
        def forward(self, ids, labels):
            return _ThroughNumpy.apply(super().forward(ids, labels))

    ids, labels = _batch()
    with pytest.raises(TrainingGraphError, match=r"_ThroughNumpy, whose backward torch cannot trace") as info:
        _build(WithKernel(), ids, labels)
    assert "ORT's builder" in str(info.value)


class _Normed(nn.Module):
    def __init__(self, **batch_norm):
        super().__init__()
        self.linear, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4, **batch_norm)

    def forward(self, x):
        return self.bn(self.linear(x)).square().mean()


def test_a_batchnorm_trains_and_its_new_statistics_are_outputs_as_torch_computes_them():
    """The trace functionalizes BatchNorm's running statistics: the graph computes them (by
    torch's own decomposition: torch.onnx's BatchNormalization would normalize by the
    running statistics) and names them in ``buffer_updates``; the module is not changed."""
    from ortpass.training.from_torch import buffer_updates

    torch.manual_seed(0)
    module, x = _Normed(momentum=0.3), torch.randn(6, 4) * 3 + 1
    before = {name: b.clone() for name, b in module.named_buffers()}
    model = build_training_graph_from_torch(module, (x,), input_names=["x"])
    assert all(torch.equal(b, before[name]) for name, b in module.named_buffers())  # the builder's forward left them
    updates = buffer_updates(model)
    assert sorted(updates.values()) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    session = TrainingSession(model, extra_outputs=list(updates))
    result = session.run({"x": x.numpy()})  # the buffers' values as they were: the graph's initializers
    module.zero_grad()
    loss = module(x)  # torch's step updates the buffers
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    np.testing.assert_allclose(result.gradients["linear.weight"], module.linear.weight.grad.numpy(), rtol=1e-5, atol=1e-6)
    for output, buffer in updates.items():
        np.testing.assert_allclose(result.extras[output], module.get_buffer(buffer).numpy(), rtol=1e-5, atol=1e-6)


def test_a_cumulative_batchnorm_is_refused_by_name_and_an_eval_one_trains():
    module, x = _Normed(momentum=None), torch.randn(6, 4)
    with pytest.raises(TrainingGraphError, match=r"BatchNorm \['bn'\] in training mode with momentum=None"):
        build_training_graph_from_torch(module, (x,), input_names=["x"])
    module.bn.eval()
    model = build_training_graph_from_torch(module, (x,), input_names=["x"])
    module.zero_grad()
    module(x).backward()
    result = TrainingSession(model).run({"x": x.numpy()})
    np.testing.assert_allclose(result.gradients["linear.weight"], module.linear.weight.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_recompute_on_a_torch_built_graph_keeps_every_gradient_with_dropout():
    """The post-grad passes do not depend on the builder: recompute clones the layers of a
    decoder with dropout, and with the same seeds the step is bitwise the one without."""
    torch.manual_seed(0)
    module = GPTDecoder(vocab=32, hidden=16, heads=2, layers=2, max_seq=16, dropout=0.1)
    ids = torch.randint(0, 32, (2, 8))
    model = build_training_graph_from_torch(
        module, (ids, ids.clone()), input_names=["input_ids", "labels"], dynamic_axes={"input_ids": [0, 1], "labels": [0, 1]}
    )
    dropouts = [node for node in model.graph if node.op_type == "Dropout"]
    assert dropouts
    for seed, node in enumerate(dropouts):  # every mask drawn alike in both sessions
        node.attributes["seed"] = ir.AttrInt64("seed", seed)
    plain_model = model.clone()
    result = ortpass.pipeline("fix-dropout-seed(level=1),recompute(level=1)", assume=["training-graph"])(model)
    assert result.report["recompute"].stats["counts"]["nodes cloned"] > 0
    assert any(node.op_type == "Dropout" and node.name.endswith("_recompute") for node in result.model.graph)
    feeds = {"input_ids": ids.numpy(), "labels": ids.numpy()}
    plain, recomputed = TrainingSession(plain_model, threads=1).run(feeds), TrainingSession(result.model, threads=1).run(feeds)
    assert plain.loss == recomputed.loss
    for name, grad in plain.gradients.items():
        np.testing.assert_array_equal(recomputed.gradients[name], grad, err_msg=name)


def test_a_bad_request_names_the_problem():
    ids, labels = _batch()
    with pytest.raises(TrainingGraphError, match="not among"):
        build_training_graph_from_torch(_Classifier(), (ids, labels), dynamic_axes={"tokens": [0]})
    with pytest.raises(TrainingGraphError, match="output 1 is not a floating-point scalar loss that requires grad"):
        build_training_graph_from_torch(_Logits(), (torch.randn(3, 5, 16), ids), loss=1)  # x.sum(), x without grad
    with pytest.raises(TrainingGraphError, match="no output requires grad"):
        build_training_graph_from_torch(nn.Identity(), (torch.randn(2, 3),))


def test_ortmodule_picks_the_torch_builder_without_the_training_build(monkeypatch):
    import ortpass.training.backend as backend

    monkeypatch.setattr(backend, "has_training_ops", lambda: False)
    assert ortpass.ORTModule(nn.Linear(2, 2)).builder_in_use == "torch"
    monkeypatch.setattr(backend, "has_training_ops", lambda: True)
    assert ortpass.ORTModule(nn.Linear(2, 2)).builder_in_use == "ort"
    from ortpass.training import python_ops

    monkeypatch.setattr(python_ops, "extensions_available", lambda: False)  # stock fused attention needs it
    with pytest.raises(OrtpassError, match="fused_attention=True.*onnxruntime-extensions"):
        ortpass.ORTModule(nn.Linear(2, 2), builder="torch", fused_attention=True)


def test_saved_and_loaded_the_graph_keeps_its_record(tmp_path):
    ids, labels = _batch()
    model = _build(_Classifier(), ids, labels)
    ir.save(model, tmp_path / "train.onnx")
    loaded = ir.load(tmp_path / "train.onnx")
    assert get_training_info(loaded) == get_training_info(model)
    assert len(get_partition(loaded).backward) == len(get_partition(model).backward)


def test_ortmodule_torch_builder_with_frozen_and_eval_blocks_trains_like_torch():
    """A frozen block gets no gradient, an eval block keeps its mode; batch and sequence
    change every step, on one graph."""
    from test_module_conformance import train_side_by_side

    torch.manual_seed(0)
    module = GPTDecoder(vocab=32, hidden=16, heads=2, layers=2, max_seq=16, dropout=0.0)
    module.blocks[0].requires_grad_(False)
    module.blocks[1].eval()
    batches = [torch.randint(0, 32, shape, generator=torch.Generator().manual_seed(k)) for k, shape in enumerate([(2, 8), (3, 7), (4, 8)])]
    wrapped = train_side_by_side(module, lambda model, ids: model(ids, ids.roll(-1, 1)), batches, builder="torch")
    assert wrapped.graph_builds == 1
    assert all(p.grad is None for p in module.blocks[0].parameters())


class TwoSiLUBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up1, self.down1, self.up2, self.down2 = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.down1(F.silu(self.up1(x)))
        return self.down2(F.silu(self.up2(h))).pow(2).mean()


def test_silus_gradient_reads_a_scalar_one_not_a_shared_tensor_of_ones():
    """torch writes SiLU's gradient with ``full_like(x, 1) - sigmoid``, one tensor of ones the
    trace shares between both blocks; the graph subtracts from the scalar instead."""
    torch.manual_seed(0)
    module, x = TwoSiLUBlocks(), torch.randn(4, 8, 16)
    model = build_training_graph_from_torch(module, (x,), input_names=["x"], dynamic_axes={"x": [0, 1]})
    subs = [n for n in model.graph if n.op_type == "Sub" and any(i.name.startswith("sigmoid") for i in n.inputs)]
    assert len(subs) == 2
    for sub in subs:
        one = ir.convenience.get_const_tensor(sub.inputs[0])
        assert one is not None and one.size == 1 and float(one.numpy().reshape(())) == 1.0
    assert not any(n.op_type == "Expand" and ir.convenience.get_const_tensor(n.inputs[0]) is not None
                   and any(u.op_type == "Sub" for u, _ in n.outputs[0].uses()) for n in model.graph)  # fmt: skip
    check_parity(module, (x,), model, input_names=["x"]).assert_ok()


def test_an_expanded_scalar_that_broadcasting_would_not_rebuild_stays():
    """``Expand(2, [4, 3]) + b`` with ``b`` of shape [3]: the sum's shape comes from the Expand."""
    from onnx import TensorProto, helper

    from ortpass.training.joint_onnx import _broadcast_expanded_scalars

    graph = helper.make_graph(
        [helper.make_node("Expand", ["two", "shape"], ["full"]), helper.make_node("Add", ["full", "b"], ["y"]),
         helper.make_node("Mul", ["full", "c"], ["z"])],
        "g",
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [3]), helper.make_tensor_value_info("c", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3]), helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]), helper.make_tensor("shape", TensorProto.INT64, [2], [4, 3])],
        value_info=[helper.make_tensor_value_info("full", TensorProto.FLOAT, [4, 3])],
    )  # fmt: skip
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    _broadcast_expanded_scalars(model.graph)
    add, mul = (next(n for n in model.graph if n.op_type == op) for op in ("Add", "Mul"))
    assert add.inputs[0].name == "full"  # kept: b alone would give shape [3]
    assert mul.inputs[0].name == "two"  # c has the full shape: the scalar broadcasts to it
    assert any(n.op_type == "Expand" for n in model.graph)


def test_weight_gradients_read_the_activation_gradient_in_place():
    """torch's ``mm(permute(x), dY)`` is written ``Gemm(x, dY, transA=1)``, as ORT's builder
    writes it: no Transpose copies an activation gradient for a weight's gradient."""
    torch.manual_seed(0)
    module, x = TwoSiLUBlocks(), torch.randn(4, 8, 16)
    model = build_training_graph_from_torch(module, (x,), input_names=["x"], dynamic_axes={"x": [0, 1]})
    gradients = get_training_info(model).gradients
    for name in ("up1.weight", "down1.weight", "up2.weight", "down2.weight"):
        producer = next(v for v in model.graph.outputs if v.name == gradients[name]).producer()
        while producer.op_type in ("Reshape", "Transpose") and producer.inputs[0].producer() is not None:
            producer = producer.inputs[0].producer()  # a view or the last transpose of the gradient
        assert producer.op_type == "Gemm" and producer.attributes["transA"].as_int() == 1, (name, producer)
        assert all(v.producer() is None or v.producer().op_type != "Transpose" for v in producer.inputs), name
    check_parity(module, (x,), model, input_names=["x"]).assert_ok()


def test_a_transpose_read_in_place_by_gemm_or_fused_matmul_and_not_where_it_is_read_by_other_ops():
    """Fires: a matrix's transpose (no perm, or [1, 0]) -> Gemm; a batch of square matrices
    transposed (attention's probabilities) -> FusedMatMul; same results on ONNX Runtime.
    Does not fire: a transpose another op reads too, one that moves a batch axis, a batch of
    matrices that are not square, operands of different ranks."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from ortpass.training.joint_onnx import _transposes_read_by_gemm

    def transpose(source, name, perm=(0, 2, 1)):
        return helper.make_node("Transpose", [source], [name], perm=list(perm))

    graph = helper.make_graph(
        [transpose("a", "at", (1, 0)), helper.make_node("MatMul", ["at", "b"], ["y"]), helper.make_node("Relu", ["at"], ["r"]),
         helper.make_node("Transpose", ["e"], ["et"]), helper.make_node("MatMul", ["b", "et"], ["w"]),
         transpose("c", "ct"), helper.make_node("MatMul", ["ct", "d"], ["z"]),
         transpose("k", "kt"), helper.make_node("MatMul", ["ct", "kt"], ["v"]),
         transpose("h", "ht"), helper.make_node("MatMul", ["ht", "d"], ["n"]),
         transpose("c", "cm", (1, 0, 2)), helper.make_node("MatMul", ["cm", "f"], ["m"]),
         transpose("c", "cr"), helper.make_node("MatMul", ["cr", "b"], ["x"])],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
         for n, shape in (("a", [3, 2]), ("b", [3, 4]), ("e", [5, 4]), ("c", [2, 3, 3]), ("d", [2, 3, 4]), ("k", [2, 3, 3]),
                          ("h", [2, 3, 2]), ("f", [3, 3, 4]))],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "r", "w", "z", "v", "n", "m", "x")],
        value_info=[helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
                    for n, shape in (("at", [2, 3]), ("et", [4, 5]), ("ct", [2, 3, 3]), ("kt", [2, 3, 3]), ("ht", [2, 2, 3]),
                                     ("cm", [3, 2, 3]), ("cr", [2, 3, 3]))],
    )  # fmt: skip
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9))
    rng = np.random.default_rng(0)
    feeds = {v.name: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim]).astype(np.float32) for v in graph.input}
    before = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    _transposes_read_by_gemm(model)
    ops = {n.outputs[0].name: n for n in model.graph}
    assert ops["y"].op_type == "MatMul"  # its transpose is read by a Relu too: the copy is made anyway
    assert ops["w"].op_type == "Gemm" and ops["w"].attributes["transB"].as_int() == 1  # no perm: [1, 0] for a matrix
    assert [v.name for v in ops["w"].inputs] == ["b", "e"] and "et" not in ops
    assert ops["z"].op_type == "FusedMatMul" and ops["z"].domain == "com.microsoft"  # a batch of square matrices
    assert ops["z"].attributes["transA"].as_int() == 1 and "transB" not in ops["z"].attributes
    assert ops["v"].op_type == "FusedMatMul" and [v.name for v in ops["v"].inputs] == ["c", "k"]  # both operands
    assert {"transA", "transB"} <= set(ops["v"].attributes) and "ct" not in ops and "kt" not in ops
    assert ops["n"].op_type == "MatMul"  # a batch of 3 x 2 matrices: the Transpose stays
    assert ops["m"].op_type == "MatMul"  # the batch axis moves: not a transpose of each matrix
    assert ops["x"].op_type == "MatMul"  # a batch times one matrix: different ranks
    assert model.opset_imports["com.microsoft"] == 1
    after = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for want, got in zip(before, after):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_every_symbolic_dim_is_spelled_in_the_inputs_dims_and_the_step_is_predicted_exactly():
    """torch.export writes a flattened size as ``s85*s95``; the graph spells it over the
    names ``dynamic_axes`` gives (``batch*seq``), so the export record's dims size every
    value, and the step prediction needs no bound: what ``recompute-again-late`` and a
    memory budget judge by."""
    from ortpass.analysis import memory
    from ortpass.analysis.step_memory import predict_step_memory
    from ortpass.infra.metadata import get_export_info

    torch.manual_seed(0)
    module = GPTDecoder(vocab=32, hidden=16, heads=2, layers=1, max_seq=16, dropout=0.0)
    ids = torch.randint(0, 32, (4, 16))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}}
    model = build_training_graph_from_torch(module, (ids, ids.roll(-1, 1)), input_names=["input_ids", "labels"], dynamic_axes=axes)
    dims = get_export_info(model)["dims"]
    assert dims == {"batch": 4, "seq": 16}
    spelled = {str(d.value) for node in model.graph for v in node.outputs if v.shape is not None
               for d in v.shape if isinstance(d, ir.SymbolicDim) and d.value is not None}  # fmt: skip
    assert "batch*seq" in spelled  # the flattened tokens of the loss
    for text in spelled:
        assert {s.name for s in memory.dim_expr(ir.SymbolicDim(text), unknown_name="").free_symbols} <= set(dims), text
    step = predict_step_memory(model, dims)
    assert step.exact and not step.bounded


def test_a_dim_the_trace_specialized_is_static_not_a_name_any_size_fits():
    """torch.onnx writes a symbol a guard fixed (``Eq(s87, 4)``) as the dim name "4", which
    ONNX Runtime would accept at any size; the torch builder makes it the static 4, and
    renames real symbols inside expressions as before."""
    from ortpass.training.from_torch import _renamed
    from ortpass.analysis import memory

    symbols = {memory.dim_symbol("s85"): memory.dim_symbol("batch")}
    assert _renamed(ir.SymbolicDim("4"), symbols) == 4
    assert _renamed(ir.SymbolicDim("s85"), symbols).value == "batch"
    assert _renamed(ir.SymbolicDim("2*s85"), symbols).value == "2*batch"
    assert _renamed(7, symbols) == 7


def test_two_batchnorms_with_equal_statistics_keep_their_own_inputs():
    """Fresh BatchNorms hold equal running statistics (zeros, ones): torch.onnx's
    optimizer merged equal initializers, and the second BatchNorm then read the first's
    statistics even after they changed (fed by name at every step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    wrapped = ortpass.ORTModule(model, builder="torch")
    x = torch.randn(5, 4)
    torch.testing.assert_close(wrapped(x), model(x))
    with torch.no_grad():
        model[3].running_mean.copy_(torch.randn(4))
        model[3].running_var.copy_(torch.rand(4) + 0.5)
    torch.testing.assert_close(wrapped(x), model(x))


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


def test_forward_graph_inlines_a_functions_forward_and_runs_at_other_sizes():
    """The graph of a call without gradient: standard ops (no PythonOp), the Function's
    forward inlined, eval-mode BatchNorm, the batch dim dynamic."""
    from ortpass.runtime.session import open_session
    from ortpass.training.forward_from_torch import build_forward_graph_from_torch

    class Model(_Normed):
        def forward(self, x):
            return _Doubled.apply(self.bn(self.linear(x))), x.sum()

    torch.manual_seed(0)
    module = Model().eval()
    module.bn.running_mean.fill_(0.5)
    model = build_forward_graph_from_torch(module, (torch.randn(3, 4),), input_names=["x"], dynamic_axes={"x": [0]})
    assert all(is_onnx_domain(node.domain) for node in model.graph)
    assert [v.name for v in model.graph.outputs] == ["output_0", "output_1"]
    session, _ = open_session(ir.to_proto(model), model, None)
    for batch in (2, 5):
        x = torch.randn(batch, 4)
        got = session.run(["output_0", "output_1"], {"x": x.numpy()})
        for value, expected in zip(got, module(x)):
            np.testing.assert_allclose(value, expected.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_forward_graph_refuses_a_forward_that_updates_a_buffer():
    from ortpass.training.forward_from_torch import build_forward_graph_from_torch

    with pytest.raises(TrainingGraphError, match=r"updates buffers \['calls'\]"):
        build_forward_graph_from_torch(_Counting(), (torch.randn(3, 4),), input_names=["x"], dynamic_axes={"x": [0]})
