"""Inference-mode BatchNormalization, written out before ORT's gradient build.

ORT 1.19.2's pre-gradient transformers replace every ``BatchNormalization`` by
``BatchNormInternal`` in training mode, whatever its ``training_mode``: a BatchNorm the
user froze with ``eval()`` inside a training model (fine-tuning does this) would be
normalized with the batch's statistics instead of its running ones, silently (measured:
the loss of a small CNN moved from 2.5366 to 2.5383; docs/design/ort-facts.md).

Rule: ``Y = BatchNormalization(X, scale, B, mean, var)`` with ``training_mode`` absent or 0
becomes ``Y = X * a + b`` with ``a = scale / sqrt(var + epsilon)`` and ``b = B - mean * a``
reshaped to ``[C, 1, ...]``: the arithmetic torch's own CPU inference kernel does
(``alpha``, ``beta``), which ORT differentiates with its elementwise gradients.
"""

from __future__ import annotations

import logging

import onnx
import onnx.helper as oh

from ortpass.conventions import is_onnx_domain
from ortpass.errors import TrainingGraphError

__all__ = ["decompose_inference_batch_norms"]

logger = logging.getLogger(__name__)


def decompose_inference_batch_norms(proto: onnx.ModelProto) -> int:
    """Rewrite every inference-mode BatchNormalization of ``proto`` in place (its input's
    rank must be known: run after shape inference); returns how many."""
    declared = (*proto.graph.input, *proto.graph.value_info)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in declared if v.type.tensor_type.HasField("shape")}
    types = {v.name: v.type.tensor_type.elem_type for v in declared}
    types.update((t.name, t.data_type) for t in proto.graph.initializer)
    nodes, count = [], 0
    for node in proto.graph.node:
        if node.op_type != "BatchNormalization" or not is_onnx_domain(node.domain) or _training(node):
            nodes.append(node)
            continue
        rank = ranks.get(node.input[0])
        if rank is None:
            raise TrainingGraphError(f"BatchNormalization {node.name!r}: the rank of its input {node.input[0]!r} is unknown")
        nodes.extend(_arithmetic(node, rank, types.get(node.input[4]) or onnx.TensorProto.FLOAT))
        count += 1
    if count:
        del proto.graph.node[:]
        proto.graph.node.extend(nodes)
        logger.info("wrote out %d inference-mode BatchNormalization(s)", count)
    return count


def _training(node: onnx.NodeProto) -> bool:
    return any(a.name == "training_mode" and a.i for a in node.attribute)


def _arithmetic(node: onnx.NodeProto, rank: int, stat_type: int) -> list[onnx.NodeProto]:
    x, scale, bias, mean, var = node.input[:5]
    epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
    stem = node.name or node.output[0]

    def name(part: str) -> str:
        return f"{stem}_inference_{part}"

    shape = oh.make_tensor(name("shape_value"), onnx.TensorProto.INT64, [rank - 1], [-1] + [1] * (rank - 2))
    eps = oh.make_tensor(name("epsilon_value"), stat_type, [], [epsilon])
    return [
        oh.make_node("Constant", [], [name("epsilon")], name=name("epsilon"), value=eps),
        oh.make_node("Add", [var, name("epsilon")], [name("var_eps")], name=name("var_eps")),
        oh.make_node("Sqrt", [name("var_eps")], [name("std")], name=name("std")),
        oh.make_node("Div", [scale, name("std")], [name("alpha")], name=name("alpha")),
        oh.make_node("Mul", [mean, name("alpha")], [name("mean_alpha")], name=name("mean_alpha")),
        oh.make_node("Sub", [bias, name("mean_alpha")], [name("beta")], name=name("beta")),
        oh.make_node("Constant", [], [name("shape")], name=name("shape"), value=shape),
        oh.make_node("Reshape", [name("alpha"), name("shape")], [name("alpha_c")], name=name("alpha_c")),
        oh.make_node("Reshape", [name("beta"), name("shape")], [name("beta_c")], name=name("beta_c")),
        oh.make_node("Mul", [x, name("alpha_c")], [name("scaled")], name=name("scaled")),
        oh.make_node("Add", [name("scaled"), name("beta_c")], [node.output[0]], name=name("output")),
    ]
