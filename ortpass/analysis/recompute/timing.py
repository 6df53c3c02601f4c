"""What recomputing a subgraph costs in time: FLOPs and bytes per op, priced with
constants measured once on this machine.

Rule: a node costs ``flops * seconds_per_flop + bytes * seconds_per_byte``.  ``flops`` is
``2*M*N*K`` for MatMul / Gemm / FusedMatMul (the output's elements times twice the
reduced dim), ``2 * out * (in_channels/group) * kernel`` for Conv, ``4*B*H*Sq*Sk*D`` for
a registered attention PythonOp (two matmuls over ``q, k, v`` of shape B x H x S x D),
and 0 for every other op; ``bytes`` is what the node reads and writes.  The two constants
come from :func:`calibrate`: ONNX Runtime timing one MatMul and one Add on this machine
(about a second), kept in ``~/.cache/ortpass/cost_model.json`` per ORT version and CPU
count, so each machine measures once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Iterable, Mapping

import onnx_ir as ir

from ortpass.analysis import memory
from ortpass.analysis.recomputable_ops import recomputable_function_of

__all__ = ["CostModel", "calibrate"]

logger = logging.getLogger(__name__)

_MATMULS = {"MatMul", "Gemm", "FusedMatMul", "MatMulInteger"}
_CACHE_ENV = "ORTPASS_CACHE_DIR"


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per FLOP and per byte moved, for one machine."""

    seconds_per_flop: float
    seconds_per_byte: float
    source: str = "given"

    def node_seconds(self, node: ir.Node, dims: Mapping[str, int] | None) -> float:
        flops, moved = node_work(node, dims)
        return flops * self.seconds_per_flop + moved * self.seconds_per_byte

    def seconds(self, nodes: Iterable[ir.Node], dims: Mapping[str, int] | None) -> float:
        return sum(self.node_seconds(node, dims) for node in nodes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def for_this_machine(cls) -> CostModel:
        """The cached calibration of this machine, measured now if there is none."""
        path = _cache_path()
        key = _machine_key()
        try:
            cached = json.loads(path.read_text()).get(key)
        except (OSError, ValueError):
            cached = None
        if isinstance(cached, dict) and {"seconds_per_flop", "seconds_per_byte"} <= cached.keys():
            return cls(float(cached["seconds_per_flop"]), float(cached["seconds_per_byte"]), source=str(path))
        model = calibrate()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                known = json.loads(path.read_text())
            except (OSError, ValueError):
                known = {}
            known[key] = {"seconds_per_flop": model.seconds_per_flop, "seconds_per_byte": model.seconds_per_byte}
            path.write_text(json.dumps(known, indent=1))
        except OSError as exc:  # a read-only home: measure again next time, say so once
            logger.info("cost model not cached (%s): %s", path, exc)
        return model


def node_work(node: ir.Node, dims: Mapping[str, int] | None) -> tuple[float, float]:
    """(FLOPs, bytes read and written) of one run of ``node`` at ``dims``; sizes that are
    unknown there count 0."""
    moved = sum(_nbytes(v, dims) for v in (*node.inputs, *node.outputs) if v is not None)
    return _flops(node, dims), float(moved)


def _nbytes(value: ir.Value, dims: Mapping[str, int] | None) -> int:
    return memory.nbytes_at(value, dims) or 0


def _numel(value: ir.Value | None, dims: Mapping[str, int] | None) -> int:
    if value is None:
        return 0
    return memory.evaluate(memory.symbolic_numel(value), dims) or 0


def _dim(value: ir.Value | None, axis: int, dims: Mapping[str, int] | None) -> int:
    if value is None or value.shape is None or len(value.shape) < abs(axis):
        return 0
    dim = value.shape[axis]
    return dim if isinstance(dim, int) else (dims or {}).get(str(dim.value), 0)


def _flops(node: ir.Node, dims: Mapping[str, int] | None) -> float:
    if not node.outputs:
        return 0.0
    out = _numel(node.outputs[0], dims)
    if node.op_type in _MATMULS and node.inputs:
        transposed = node.op_type == "Gemm" and any(a.name == "transA" and a.value for a in node.attributes.values())
        reduced = _dim(node.inputs[0], 0 if transposed else -1, dims)
        return 2.0 * out * reduced
    if node.op_type == "Conv" and len(node.inputs) > 1:
        weight = node.inputs[1]
        per_output = _numel(weight, dims) // max(_dim(weight, 0, dims), 1)  # in_channels/group x kernel
        return 2.0 * out * per_output
    if recomputable_function_of(node) is not None:
        tensors = [v for v in node.inputs if v is not None and v.shape is not None and len(v.shape) == 4]
        if len(tensors) >= 2:
            q, k = tensors[0], tensors[1]
            return 4.0 * _numel(q, dims) * _dim(k, -2, dims)
    return 0.0


def calibrate(size: int = 512, elements: int = 1 << 22) -> CostModel:
    """Time one ``size``-cubed MatMul and one Add of ``elements`` floats on ONNX Runtime's
    CPU provider (best of five runs each, after a warm-up)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def session(op: str, shape_a: list[int], shape_b: list[int]):
        graph = helper.make_graph(
            [helper.make_node(op, ["a", "b"], ["y"])],
            op,
            [helper.make_tensor_value_info("a", TensorProto.FLOAT, shape_a),
             helper.make_tensor_value_info("b", TensorProto.FLOAT, shape_b)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape_a)],
        )
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        proto.ir_version = min(proto.ir_version, 9)  # readable by ORT 1.19.2
        return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])

    def best(sess, feeds) -> float:
        sess.run(None, feeds)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            sess.run(None, feeds)
            times.append(time.perf_counter() - start)
        return min(times)

    rng = np.random.default_rng(0)
    square = rng.standard_normal((size, size), dtype=np.float32)
    matmul = best(session("MatMul", [size, size], [size, size]), {"a": square, "b": square})
    flat = rng.standard_normal(elements, dtype=np.float32)
    add = best(session("Add", [elements], [elements]), {"a": flat, "b": flat})
    per_byte = add / (3 * 4 * elements)
    # The MatMul's own traffic priced as the Add's, the rest is arithmetic.
    per_flop = max(matmul - per_byte * 3 * 4 * size * size, matmul / 10) / (2 * size**3)
    logger.info("cost model calibrated: %.3g s/FLOP, %.3g s/byte", per_flop, per_byte)
    return CostModel(per_flop, per_byte, source="calibrated")


def _cache_path() -> Path:
    root = os.environ.get(_CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "ortpass")
    return Path(root) / "cost_model.json"


def _machine_key() -> str:
    import onnxruntime as ort

    return f"onnxruntime-{ort.__version__}-{platform.machine()}-cpus{os.cpu_count()}"
