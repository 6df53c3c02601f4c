"""The torch bridge: PythonOp / PythonOpGrad on ONNX Runtime 1.19.2 through our Python runners."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
import torch

from ortpass.errors import UnregisteredFunctionError
from ortpass.pythonop import bridge

DROPOUT_P = 0.5  # exact in float32, so the bridge sees the same p as eager torch


class ScaledTanh(torch.autograd.Function):
    """tanh(x * alpha) with a hand-written backward from the saved output."""

    @staticmethod
    def forward(ctx, x, alpha):
        y = torch.tanh(x * alpha)
        ctx.save_for_backward(y)
        ctx.alpha = alpha
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y) * ctx.alpha, None


class MaskedScale(torch.autograd.Function):
    """Dropout inside a Function: draws its mask from torch's RNG and keeps it for backward."""

    @staticmethod
    def forward(ctx, x, p, dims):
        mask = (torch.rand_like(x) >= p).to(x.dtype) / (1 - p)
        ctx.save_for_backward(mask)
        return x * mask, x.sum(dim=dims)

    @staticmethod
    def backward(ctx, grad, grad_sum):
        (mask,) = ctx.saved_tensors
        return grad * mask + grad_sum.unsqueeze(-1), None, None


class _TwoFunctions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(6, 8)
        self.second = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = ScaledTanh.apply(self.first(x), 0.75)
        dropped, summed = MaskedScale.apply(h, DROPOUT_P, (-1,))
        return (self.second(dropped) ** 2).mean() + summed.mean()


def _torch_step(module, x, seed):
    module.zero_grad()
    torch.manual_seed(seed)
    loss = module(x)
    loss.backward()
    return loss.item(), {name: p.grad.numpy().copy() for name, p in module.named_parameters()}


@pytest.fixture(scope="module")
def trained():
    from ortpass.export import export
    from ortpass.runtime import TrainingSession
    from ortpass.training import build_training_graph

    torch.manual_seed(0)
    module = _TwoFunctions()
    x = torch.randn(4, 6)
    model = export(module, (x,), input_names=["x"])
    training = build_training_graph(model)
    return module, x, training, TrainingSession(training)


def _ort_step(session, x, seed):
    torch.manual_seed(seed)  # the Function's dropout runs in torch inside the bridge
    return session.run({"x": x.numpy()})


def test_training_graph_has_both_functions_forward_and_backward(trained):
    _, _, training, _ = trained
    ops = [(n.op_type, n.attributes["func_name"].as_string()) for n in training.graph if n.op_type.startswith("PythonOp")]
    names = {f"{__name__}.ScaledTanh", f"{__name__}.MaskedScale"}
    assert sorted(ops) == sorted([(kind, name) for kind in ("PythonOp", "PythonOpGrad") for name in names])


def test_training_step_matches_torch(trained):
    module, x, _, session = trained
    for seed in (1, 2):
        expected_loss, expected_grads = _torch_step(module, x, seed)
        result = _ort_step(session, x, seed)
        np.testing.assert_allclose(result.loss, expected_loss, rtol=1e-5, atol=1e-6)
        assert set(result.gradients) == set(expected_grads)
        for name, grad in expected_grads.items():
            np.testing.assert_allclose(result.gradients[name], grad, rtol=1e-5, atol=1e-6, err_msg=name)
    assert bridge.live_contexts() == 0  # every forward ctx was freed by its backward


def test_ort_threads_do_not_spin_while_torch_runs_pythonops(trained):
    # A spinning ORT pool thread takes a core from torch's kernels inside each PythonOp
    # (measured +25% step time on HF LLaMA with fused attention; training_options' docstring).
    _, _, _, session = trained
    assert session._session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_dropout_mask_really_depends_on_the_seed(trained):
    # Guards the parity test: with a mask that ignored the seed it would pass trivially.
    _, x, _, session = trained
    assert _ort_step(session, x, 1).loss != pytest.approx(_ort_step(session, x, 2).loss, rel=1e-6)


# -- hand-built models ----------------------------------------------------------------------


class AddScaled(torch.autograd.Function):
    """Never exported: reachable by the bridge only through register_function."""

    @staticmethod
    def forward(ctx, x, scale, shift):
        return x * scale + sum(shift)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None, None


class Explodes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, shift):
        raise RuntimeError("boom from inside the Function")

    @staticmethod
    def backward(ctx, grad):
        return grad


def _inference_model(func_name: str) -> onnx.ModelProto:
    node = oh.make_node(
        "PythonOp",
        ["x"],
        ["y_ctx", "y"],
        name="add_scaled",
        domain="com.microsoft",
        func_name=func_name,
        input_convention="dcc",
        input_requires_grads=[0, 0, 0],
        input_tensor_types=[onnx.TensorProto.FLOAT],
        input_tensor_ranks=[2],
        output_tensor_types=[onnx.TensorProto.FLOAT],
        output_tensor_ranks=[2],
        input_float_scalars=[3.0],
        input_float_scalar_positions=[1],
        input_int_tuples=[1, 2],
        input_int_tuple_positions=[2],
        input_int_tuple_begins=[0],
        training_mode=0,
    )
    graph = oh.make_graph(
        [node],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
    )
    return oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)], ir_version=8
    )


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    bridge.prepare(ir.from_proto(proto))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(["y"], {"x": x})[0]


def test_registered_function_runs_with_constants_rebuilt_from_attributes():
    bridge.register_function(AddScaled)
    try:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        y = _run(_inference_model(f"{__name__}.AddScaled"), x)
        np.testing.assert_array_equal(y, x * 3.0 + 3)  # scale 3.0, shift (1, 2)
    finally:
        bridge.unregister_function(AddScaled)


def test_unregistered_function_fails_naming_it_and_imports_nothing():
    func_name = "ortpass_nonexistent_pkg.layers.Secret"
    with pytest.raises(UnregisteredFunctionError) as info:
        bridge.prepare(ir.from_proto(_inference_model(func_name)))
    assert func_name in str(info.value) and "add_scaled" in str(info.value)
    assert "ortpass_nonexistent_pkg" not in sys.modules


def test_failing_function_fails_the_run_and_keeps_its_exception():
    bridge.register_function(Explodes)
    try:
        with pytest.raises(Exception, match="PythonOp"):
            _run(_inference_model(f"{__name__}.Explodes"), np.ones((2, 3), np.float32))
        error = bridge.last_runner_error()
        assert isinstance(error, RuntimeError) and "boom" in str(error)
    finally:
        bridge.unregister_function(Explodes)


class _NoCxxRuntime:
    """A ctypes.CDLL stand-in: the process's global scope without ``_Znwm`` (torch 2.14's
    CUDA wheel loads libstdc++ with local binding), and, with ``libstdcxx=False``, no
    libstdc++ to open either."""

    def __init__(self, libstdcxx: bool):
        import ctypes

        self.libstdcxx = libstdcxx
        self.real = ctypes.CDLL  # bridge.ctypes is this module: keep the real one before patching

    def __call__(self, name):
        if name is None:
            return object()  # no _Znwm attribute
        if not self.libstdcxx:
            raise OSError(f"{name}: cannot open shared object file")
        return self.real(name)


def test_operator_new_is_found_in_libstdcxx_when_the_global_scope_lacks_it(monkeypatch):
    import ctypes

    monkeypatch.setattr(bridge.ctypes, "CDLL", _NoCxxRuntime(libstdcxx=True))
    found = bridge._find_operator_new()
    assert ctypes.cast(found, ctypes.c_void_p).value == ctypes.cast(ctypes.CDLL("libstdc++.so.6")._Znwm, ctypes.c_void_p).value


def test_no_cxx_runtime_at_all_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(bridge.ctypes, "CDLL", _NoCxxRuntime(libstdcxx=False))
    with pytest.raises(RuntimeError, match=r"no C\+\+ operator new \(_Znwm\)"):
        bridge._find_operator_new()


@pytest.mark.stock
def test_a_runtime_without_pythonop_kernels_is_named_with_the_function(monkeypatch):
    """Stock onnxruntime has no runner hooks: the error names the Function and the runtime,
    not a missing attribute of ORT's bindings (on the training build the hooks are hidden)."""
    from onnxruntime.capi import _pybind_state as C

    from ortpass.errors import OrtpassError

    monkeypatch.delattr(C, "register_forward_runner", raising=False)
    func_name = f"{__name__}.AddScaled"
    with pytest.raises(OrtpassError, match="has no PythonOp kernel") as info:
        bridge.prepare(ir.from_proto(_inference_model(func_name)))
    assert func_name in str(info.value) and "training build" in str(info.value)
