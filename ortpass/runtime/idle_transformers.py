"""ORT graph transformers that cannot act on a graph, left out of the session over it.

ONNX Runtime runs every transformer of its optimization level when it opens a session, the
level-1 and level-2 ones in up to three rounds, and each run walks the whole graph even
where it changes nothing.  That walk costs more per node as the graph grows: on ortpass's
HF LLaMA training graphs (ORT 1.19.2, one thread) a transformer that changed nothing took
11 ms at 6015 nodes and 55 ms at 11967, and the session took 1.2-1.4 s and 4.5 s.  Most of
those runs are transformers for kinds of graph an ortpass training graph rarely is.

Rule: a transformer whose every rewrite starts at an op of a known set is left out when the
graph ORT is given (its subgraphs and functions included; the split step's halves hold ops
the whole training graph does not) holds none of those ops:

- the quantization transformers (QDQ node units, integer and n-bit MatMuls) start at a
  quantize or dequantize op, an integer MatMul or a quantized kernel;
- the convolution transformers (activation fusions, NCHWc and NHWC layouts) start at a
  convolution, a pooling op, a resize or a BatchNormalization;
- ``RocmBlasAltImpl`` rewrites nodes placed on ROCm only: left out without that provider.

ORT then runs the same graph, and opens the session 19-30% sooner: on those LLaMA graphs,
1.35 -> 1.08 s at 32 layers, 5.20 -> 3.64 s at 64 and 7.00 -> 5.21 s at 80, the graph ORT
optimized byte-identical at every depth (``benchmarks/session_transformers.py``).  ORT
ignores names it does not know, so the list holds the transformers of 1.19.2 and of the
stock releases alike (docs/design/ort-facts.md).
"""

from __future__ import annotations

from typing import Iterable

import onnx

__all__ = ["CONVOLUTION_TRANSFORMERS", "QUANTIZATION_TRANSFORMERS", "idle_transformers"]

#: Transformers that act on quantized graphs only (1.19.2's, and those 1.2x added).
QUANTIZATION_TRANSFORMERS = (
    "EnsureUniqueDQForNodeUnit",
    "DoubleQDQPairsRemover",
    "QDQPropagationTransformer",
    "QDQSelectorActionTransformer",
    "QDQS8ToU8Transformer",
    "QDQFinalCleanupTransformer",
    "MatMulIntegerToFloatFusion",
    "DynamicQuantizeMatMulFusion",
    "MatMulNBitsFusion",
    "WhereDummyDq",
    "WeightBiasQuantization",
)
#: Transformers that start at a convolution, a pooling op, a resize or a BatchNormalization.
CONVOLUTION_TRANSFORMERS = ("ConvActivationFusion", "ConvAddActivationFusion", "NchwcTransformer", "NhwcTransformer")
_CONVOLUTION_OPS = frozenset({
    "Conv", "ConvTranspose", "FusedConv", "NhwcConv", "NhwcFusedConv", "MaxPool", "AveragePool", "LpPool",
    "GlobalMaxPool", "GlobalAveragePool", "GlobalLpPool", "Resize", "Upsample", "BatchNormalization",
})  # fmt: skip
_ROCM_TRANSFORMERS = ("RocmBlasAltImpl",)


def _is_quantized(op_type: str) -> bool:
    """QuantizeLinear, DequantizeLinear, DynamicQuantize*, MatMulInteger, ConvInteger,
    MatMulNBits, the QLinear* kernels, QGemm, QAttention and their kin."""
    return (
        "Quantize" in op_type
        or "Integer" in op_type
        or "NBits" in op_type
        or op_type.startswith(("QLinear", "QGemm", "QAttention", "QOrdered", "QEmbed"))
    )


def _op_types(graph: onnx.GraphProto) -> set[str]:
    types = set()
    for node in graph.node:
        types.add(node.op_type)
        for attr in node.attribute:
            for subgraph in (attr.g,) if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                types |= _op_types(subgraph)
    return types


def idle_transformers(proto: onnx.ModelProto, providers: Iterable[str] = ()) -> list[str]:
    """The ORT transformers that cannot act on ``proto`` (the model a session is given) on
    ``providers`` (see the module docstring for the rule)."""
    op_types = _op_types(proto.graph)
    for function in proto.functions:
        op_types |= {node.op_type for node in function.node}
    idle: list[str] = []
    if not any(_is_quantized(op) for op in op_types):
        idle += QUANTIZATION_TRANSFORMERS
    if not op_types & _CONVOLUTION_OPS:
        idle += CONVOLUTION_TRANSFORMERS
    if "ROCMExecutionProvider" not in set(providers):
        idle += _ROCM_TRANSFORMERS
    return idle
