"""ExpandFastGeluGradPass: ORT's FastGeluGrad written out in ai.onnx ops, both directions,
equal to ORT's kernel and to torch's tanh-GELU backward, and in the default pipeline on
GPT-2's graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from ortpass.analysis.partition import tag
from ortpass.conventions import MS_DOMAIN
from ortpass.passes import ExpandFastGeluGradPass

SHAPE = [3, 5, 8]
F = onnx.TensorProto.FLOAT


def _gradient_graph(op: str = "FastGeluGrad", side: str = "backward", dtype: int = F, opset: int = 17) -> ir.Model:
    """dy, x (and a bias b for BiasFastGeluGrad_dX) -> ``op`` -> dx, then Neg(dx) -> y, so
    that dx has a reader and is an output."""
    inputs = ["dy", "x", "b"] if op == "BiasFastGeluGrad_dX" else ["dy", "x"]
    graph = oh.make_graph(
        [oh.make_node(op, inputs, ["dx"], domain=MS_DOMAIN, name="grad"), oh.make_node("Neg", ["dx"], ["y"], name="neg")],
        "gelu_grad",
        [oh.make_tensor_value_info("dy", dtype, SHAPE), oh.make_tensor_value_info("x", dtype, SHAPE),
         *([oh.make_tensor_value_info("b", dtype, SHAPE[-1:])] if len(inputs) == 3 else [])],
        [oh.make_tensor_value_info("dx", dtype, SHAPE), oh.make_tensor_value_info("y", dtype, SHAPE)],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset), oh.make_opsetid(MS_DOMAIN, 1)], ir_version=8)
    model = ir.from_proto(proto)
    for node in model.graph:
        tag(node, side)
    return model


def _feeds(bias: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = 3 * rng.standard_normal(SHAPE)
    x.flat[:6] = [-100.0, -12.0, -9.0, 9.0, 12.0, 100.0]  # exp(2u) past float's range on both sides
    feeds = {"dy": rng.standard_normal(SHAPE).astype(np.float32), "x": x.astype(np.float32)}
    if bias:
        feeds["b"] = rng.standard_normal(SHAPE[-1:]).astype(np.float32)
    return feeds


def _run(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["dx", "y"], feeds)


def _torch_gelu_grad(dy: np.ndarray, x: np.ndarray) -> np.ndarray:
    """torch's backward of the tanh GELU, in float64."""
    xt = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    (grad,) = torch.autograd.grad(torch.nn.functional.gelu(xt, approximate="tanh"), xt, torch.from_numpy(dy.astype(np.float64)))
    return grad.numpy()


@pytest.mark.parametrize("op, opset", [("FastGeluGrad", 17), ("BiasFastGeluGrad_dX", 17), ("FastGeluGrad", 10)])
def test_the_gradient_is_written_in_onnx_ops_equal_to_orts_kernel_and_torchs(op, opset):
    """Opset 10: Clip's bounds are attributes there."""
    bias = op == "BiasFastGeluGrad_dX"
    feeds = _feeds(bias)
    kernel_dx, _ = _run(_gradient_graph(op, opset=opset), feeds)
    pass_ = ExpandFastGeluGradPass()
    result = pass_(_gradient_graph(op, opset=opset))
    assert result.modified and pass_.stats["counts"]["gelu gradients expanded"] == 1
    graph = result.model.graph
    assert all(n.domain in ("", "ai.onnx") for n in graph)  # no com.microsoft op left
    assert {"Exp", "Reciprocal", "Mul", "Add"} <= {n.op_type for n in graph}
    assert graph.outputs[0].name == "dx" and graph.outputs[0].producer().op_type == "Mul"
    assert all(n.metadata_props.get("pkg.ortpass.side") == "backward" for n in graph)
    dx, y = _run(result.model, feeds)
    assert np.isfinite(dx).all()
    np.testing.assert_allclose(dx, kernel_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y, -dx)  # the reader reads the new gradient
    x = feeds["x"] + feeds["b"] if bias else feeds["x"]
    exact = _torch_gelu_grad(feeds["dy"], x)
    np.testing.assert_allclose(dx, exact, rtol=1e-5, atol=1e-6)
    assert np.abs(dx - exact).max() <= np.abs(kernel_dx - exact).max()  # no less accurate than ORT's kernel


@pytest.mark.parametrize("op", ["FastGeluGrad", "BiasFastGeluGrad_dX"])
def test_at_most_three_temporaries_the_size_of_x_are_alive_at_once_in_orts_order(op):
    """ORT's kernel holds only its output; the expansion's chain is ordered so that ORT's
    walk holds no more than three of its tensors at once (an earlier form held four, and
    raised GPT-2's step peak by three MLP-sized tensors).  The graph's own ``y = -dx``
    holds two, so the peak is the chain's."""
    from ortpass.analysis.step_memory import predict_step_memory

    x_bytes = 4 * int(np.prod(SHAPE))
    assert predict_step_memory(_gradient_graph(op)).peak_bytes == 2 * x_bytes  # dx and y
    expanded = ExpandFastGeluGradPass()(_gradient_graph(op)).model
    assert predict_step_memory(expanded).peak_bytes == 3 * x_bytes


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: _gradient_graph("GeluGrad"), id="erf-gelu-grad"),  # ORT's kernel is fast there
        pytest.param(lambda: _gradient_graph(side="forward"), id="not-backward"),
        pytest.param(lambda: _gradient_graph(dtype=onnx.TensorProto.INT64), id="not-float"),
        pytest.param(lambda: _gradient_graph(dtype=onnx.TensorProto.FLOAT16), id="float16"),  # would overflow
    ],
)
def test_does_not_fire_on_other_gradients(model):
    model = model()
    before = [(n.op_type, n.domain) for n in model.graph]
    result = ExpandFastGeluGradPass()(model)
    assert not result.modified and [(n.op_type, n.domain) for n in result.model.graph] == before


def test_gpt2s_training_graph_has_no_fast_gelu_grad_left_and_trains_like_torch(monkeypatch):
    """HF GPT-2 (gelu_new, which ORT fuses into FastGelu) through ORTModule's default pipeline:
    every layer's gradient is expanded and the step matches torch eager."""
    transformers = pytest.importorskip("transformers")
    import ortpass

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    reference = transformers.GPT2LMHeadModel(config)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 50, (2, 12))
    wrapped = ortpass.ORTModule(model)
    graphs = []
    run = type(wrapped)._run
    monkeypatch.setattr(type(wrapped), "_run", lambda self, graph, tensors: (graphs.append(graph), run(self, graph, tensors))[1])
    loss = wrapped(input_ids=ids, labels=ids).loss
    loss.backward()
    expected = reference(input_ids=ids, labels=ids).loss
    expected.backward()
    (graph,) = graphs
    assert graph.report["expand-fast-gelu-grad"].stats["counts"]["gelu gradients expanded"] == config.n_layer
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("providers", ["cuda", ["CUDAExecutionProvider", "CPUExecutionProvider"]])
def test_ortmodule_leaves_the_expansion_out_of_its_default_pipeline_for_cuda(providers):
    """ORT's CUDA FastGeluGrad is one fused kernel and cuBLAS reads a transposed operand as
    it is: the wrapper's default pipeline for CUDA keeps both, and keeps every other pass;
    on the CPU, and in a pipeline the user wrote, the passes stay.  (The wrapper opens no
    session before its first step.)"""
    import ortpass
    from ortpass.infra.pipeline_text import parse_pipeline
    from ortpass.passes import DEFAULT_PIPELINE

    names = lambda spec: [s.name for s in parse_pipeline(spec)]  # noqa: E731
    on_cuda = names(ortpass.ORTModule(torch.nn.Linear(2, 2), providers=providers).pipeline)
    cpu_only = ("expand-fast-gelu-grad", "transposed-gemm-as-matmul")
    assert on_cuda == [n for n in names(DEFAULT_PIPELINE) if n not in cpu_only]
    for name in cpu_only:
        assert name in names(ortpass.ORTModule(torch.nn.Linear(2, 2)).pipeline)
        assert name in names(ortpass.ORTModule(torch.nn.Linear(2, 2), providers="cpu").pipeline)
    written = "build-training-graph,expand-fast-gelu-grad"
    assert ortpass.ORTModule(torch.nn.Linear(2, 2), pipeline=written, providers=providers).pipeline == written
