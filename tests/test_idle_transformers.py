"""ORT transformers that cannot act on a graph are left out of its session, and only those:
the graph ORT runs is the same, and a graph with the ops a transformer starts at keeps it."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from ortpass.runtime.idle_transformers import CONVOLUTION_TRANSFORMERS, QUANTIZATION_TRANSFORMERS, idle_transformers
from ortpass.runtime.session import DISABLED_ORT_OPTIMIZERS, disabled_optimizers

pytestmark = pytest.mark.stock

ort = pytest.importorskip("onnxruntime")


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8  # readable by ORT 1.19.2
    return proto


def _float_model() -> onnx.ModelProto:
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.arange(16, dtype=np.float32) / 16)
    return _model(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [w],
    )


def _conv_relu_model() -> onnx.ModelProto:
    w = helper.make_tensor("w", TensorProto.FLOAT, [2, 1, 3, 3], np.linspace(-1, 1, 18, dtype=np.float32))
    return _model(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 5, 5])],
        [w],
    )


def _qdq_matmul_model() -> onnx.ModelProto:
    """x -> Q -> DQ -> MatMul(DQ(w)) -> Q -> DQ: a QDQ node unit ORT turns into a quantized MatMul."""
    scale = helper.make_tensor("s", TensorProto.FLOAT, [], [0.05])
    zero = helper.make_tensor("z", TensorProto.UINT8, [], [128])
    wq = helper.make_tensor("wq", TensorProto.UINT8, [4, 4], np.arange(120, 136, dtype=np.uint8))
    return _model(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
            helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
            helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["wd"]),
            helper.make_node("MatMul", ["xd", "wd"], ["h"]),
            helper.make_node("QuantizeLinear", ["h", "s", "z"], ["hq"]),
            helper.make_node("DequantizeLinear", ["hq", "s", "z"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [scale, zero, wq],
    )


def _optimized(proto: onnx.ModelProto, disabled: list[str], tmp_path, name: str) -> onnx.ModelProto:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"],
                         disabled_optimizers=disabled)  # fmt: skip
    return onnx.load(str(tmp_path / f"{name}.onnx"))


def test_a_float_graph_leaves_out_the_quantization_convolution_and_rocm_transformers():
    idle = idle_transformers(_float_model())
    assert set(QUANTIZATION_TRANSFORMERS) <= set(idle)
    assert set(CONVOLUTION_TRANSFORMERS) <= set(idle)
    assert "RocmBlasAltImpl" in idle
    assert "RocmBlasAltImpl" not in idle_transformers(_float_model(), ["ROCMExecutionProvider"])


def test_a_graph_with_the_ops_a_transformer_starts_at_keeps_it():
    quantized = idle_transformers(_qdq_matmul_model())
    assert not set(QUANTIZATION_TRANSFORMERS) & set(quantized)
    assert set(CONVOLUTION_TRANSFORMERS) <= set(quantized)
    convolution = idle_transformers(_conv_relu_model())
    assert not set(CONVOLUTION_TRANSFORMERS) & set(convolution)
    assert set(QUANTIZATION_TRANSFORMERS) <= set(convolution)


def test_an_op_in_a_subgraph_keeps_its_transformers():
    quantized = _qdq_matmul_model()
    branch = helper.make_graph(list(quantized.graph.node), "branch", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    wrapper = _model(
        [helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)],
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, []), *quantized.graph.input],
        list(quantized.graph.output),
        list(quantized.graph.initializer),
    )
    assert not set(QUANTIZATION_TRANSFORMERS) & set(idle_transformers(wrapper))


def test_the_session_is_told_what_the_graph_it_gets_can_use(monkeypatch):
    """open_session decides from the proto ORT is given, not from the model it came from:
    the split step's halves hold ops (packed masks' MatMulInteger) the whole graph lacks."""
    from ortpass.runtime import session as session_module

    told = {}

    def inference_session(data, options, providers, disabled_optimizers):
        told["disabled"] = disabled_optimizers

    monkeypatch.setattr(ort, "InferenceSession", inference_session)
    whole = ir.serde.deserialize_model(_float_model())
    session_module.open_session(_qdq_matmul_model(), whole, "cpu")
    assert set(DISABLED_ORT_OPTIMIZERS) <= set(told["disabled"])
    assert not set(QUANTIZATION_TRANSFORMERS) & set(told["disabled"])
    assert set(CONVOLUTION_TRANSFORMERS) <= set(told["disabled"])
    session_module.open_session(_float_model(), whole, "cpu")
    assert set(QUANTIZATION_TRANSFORMERS) <= set(told["disabled"])


def test_the_graph_ort_runs_is_the_same_without_the_idle_transformers(tmp_path):
    proto = _float_model()
    idle = idle_transformers(proto)
    plain = _optimized(proto, list(DISABLED_ORT_OPTIMIZERS), tmp_path, "plain")
    fewer = _optimized(proto, [*DISABLED_ORT_OPTIMIZERS, *idle], tmp_path, "fewer")
    assert plain.graph.SerializeToString() == fewer.graph.SerializeToString()


def test_the_transformers_kept_for_quantized_and_convolution_graphs_do_act_there(tmp_path):
    """Where the ops are, the transformers left in rewrite the graph (so leaving them out
    elsewhere is what saves their walk, and the names are ones this ORT knows)."""
    for proto, family in ((_qdq_matmul_model(), QUANTIZATION_TRANSFORMERS), (_conv_relu_model(), CONVOLUTION_TRANSFORMERS)):
        kept = _optimized(proto, list(DISABLED_ORT_OPTIMIZERS), tmp_path, "kept")
        left_out = _optimized(proto, [*DISABLED_ORT_OPTIMIZERS, *family], tmp_path, "left_out")
        assert [n.op_type for n in kept.graph.node] != [n.op_type for n in left_out.graph.node], family


_VERBOSE_SESSION = textwrap.dedent("""
    import sys, onnxruntime as ort
    options = ort.SessionOptions()
    options.log_severity_level = 0
    ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"], disabled_optimizers=sys.argv[2:])
""")


def _transformer_runs(path, disabled: list[str]) -> list[str]:
    """The transformers ORT ran opening a session, from its verbose log."""
    done = subprocess.run([sys.executable, "-c", _VERBOSE_SESSION, str(path), *disabled],
                          capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    return re.findall(r"GraphTransformer (\w+) modified", done.stdout + done.stderr)


def test_ort_runs_the_idle_transformers_fewer_times(tmp_path):
    path = tmp_path / "float.onnx"
    onnx.save(_float_model(), str(path))
    idle = idle_transformers(_float_model())
    before = _transformer_runs(path, list(DISABLED_ORT_OPTIMIZERS))
    after = _transformer_runs(path, [*DISABLED_ORT_OPTIMIZERS, *idle])
    idle_before = [name for name in before if name in idle]
    idle_after = [name for name in after if name in idle]
    assert len(idle_before) >= 8, before  # ORT's log names them: the names are right
    # EnsureUniqueDQForNodeUnit runs once before the filtered rounds, whatever the list.
    assert set(idle_after) <= {"EnsureUniqueDQForNodeUnit"} and len(idle_after) <= 1, idle_after
    assert len(after) < len(before)
