"""Keep the boolean masks a split step passes from forward to backward as bits, not bytes.

Rule: every BOOL value a forward node produces and a backward node reads (a Dropout's mask,
kept because the backward Dropout that would draw it again cannot, split:
:func:`ortpass.training.split.read_forward_masks`) is packed eight elements to a byte right
after it is made, and unpacked in backward right before it is read:

- forward: ``packed = Cast(MatMulInteger(Reshape(Pad(Cast(mask, uint8), to a multiple of 8),
  [-1, 8]), [[1], [2], [4], ..., [128]]), uint8)`` and ``shape = Shape(mask)``;
- backward: ``mask = Cast(Reshape(Slice(Reshape(Mod(BitShift(packed, [0..7], RIGHT), 2),
  [-1]), 0, ReduceProd(shape)), shape), bool)``.

Bit ``i`` of byte ``k`` is element ``8k + i``, so the unpacked mask is the forward mask,
element for element (the padding is sliced off).  Every op is ai.onnx (opset 11 or older)
with uint8 kernels on ONNX Runtime's CPU provider, in the training build 1.19.2 and stock
1.32 (checked).

Why: a split step's stash lives from forward until the backward half ends.  A GPT-2
layer's attention-dropout mask at batch 8 x 4 heads x 512 x 512 is 8 MiB as bytes, 1 MiB
as bits.  Drawing the mask again from its seed in backward would keep nothing, but an ORT
Dropout's generator advances once per run of its session, so a backward that does not
follow its own forward (two micro-batches summed before one ``backward()``) would draw
another step's mask; a packed mask belongs to its forward run whatever the order.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from ortpass.analysis.partition import is_backward, tag

__all__ = ["PACKED_SUFFIX", "pack_kept_masks"]

logger = logging.getLogger(__name__)

#: After a kept mask's name, in the name of its packed bytes.
PACKED_SUFFIX = "_bits"


def pack_kept_masks(model: ir.Model) -> int:
    """Pack every boolean value kept from forward to backward (the module docstring);
    returns how many.  ``model`` is a training graph with forward/backward tags."""
    graph = model.graph
    outputs = {id(v) for v in graph.outputs}
    kept = [
        value
        for node in graph
        if not is_backward(node)
        for value in node.outputs
        if value.dtype == ir.DataType.BOOL and id(value) not in outputs
        and any(is_backward(user) for user, _ in value.uses())
    ]  # fmt: skip
    # Positions taken once: the nodes inserted below leave the others' order as it was.
    position = {node: k for k, node in enumerate(graph)}.__getitem__
    for mask in kept:
        readers = sorted({user for user, _ in mask.uses() if is_backward(user)}, key=position)
        packed, shape = _pack_after_producer(graph, mask)
        unpacked = _unpack_before(graph, readers[0], mask, packed, shape)
        for user, index in list(mask.uses()):
            if is_backward(user):
                user.replace_input_with(index, unpacked)
    if kept:
        logger.info("%d mask(s) kept from forward to backward as bits", len(kept))
    return len(kept)


def _constant(name: str, array: np.ndarray) -> ir.Node:
    return ir.node("Constant", [], attributes={"value": ir.tensor(array, name=name)}, name=name)


def _typed(value: ir.Value, dtype: ir.DataType, shape: ir.Shape | None) -> ir.Value:
    value.type, value.shape = ir.TensorType(dtype), shape
    return value


def _pack_after_producer(graph: ir.Graph, mask: ir.Value) -> tuple[ir.Value, ir.Value]:
    stem = mask.name
    weights = _constant(f"{stem}_bit_values", (2 ** np.arange(8)).astype(np.uint8).reshape(8, 1))
    flat_shape = _constant(f"{stem}_flat", np.array([-1], dtype=np.int64))
    rows_shape = _constant(f"{stem}_rows", np.array([-1, 8], dtype=np.int64))
    eight = _constant(f"{stem}_eight", np.array(8, dtype=np.int64))
    zero = _constant(f"{stem}_zero", np.array([0], dtype=np.int64))
    shape = ir.node("Shape", [mask], name=f"{stem}_shape")
    size = ir.node("Size", [mask], name=f"{stem}_size")
    # (8 - size % 8) % 8 zeros at the end: Mod twice keeps it in int64 for any size.
    rest = ir.node("Mod", [size.outputs[0], eight.outputs[0]], name=f"{stem}_rest")
    short = ir.node("Sub", [eight.outputs[0], rest.outputs[0]], name=f"{stem}_short")
    pad = ir.node("Mod", [short.outputs[0], eight.outputs[0]], name=f"{stem}_pad")
    pad_1d = ir.node("Reshape", [pad.outputs[0], flat_shape.outputs[0]], name=f"{stem}_pad_1d")
    pads = ir.node("Concat", [zero.outputs[0], pad_1d.outputs[0]], attributes={"axis": 0}, name=f"{stem}_pads")
    as_bytes = ir.node("Cast", [mask], attributes={"to": ir.DataType.UINT8}, name=f"{stem}_bytes")
    flat = ir.node("Reshape", [as_bytes.outputs[0], flat_shape.outputs[0]], name=f"{stem}_flat_bytes")
    padded = ir.node("Pad", [flat.outputs[0], pads.outputs[0]], name=f"{stem}_padded")
    rows = ir.node("Reshape", [padded.outputs[0], rows_shape.outputs[0]], name=f"{stem}_byte_rows")
    summed = ir.node("MatMulInteger", [rows.outputs[0], weights.outputs[0]], name=f"{stem}_bit_sums")
    packed = ir.node("Cast", [summed.outputs[0]], attributes={"to": ir.DataType.UINT8}, name=f"{stem}{PACKED_SUFFIX}")
    nodes = [weights, flat_shape, rows_shape, eight, zero, shape, size, rest, short, pad, pad_1d, pads,
             as_bytes, flat, padded, rows, summed, packed]  # fmt: skip
    for node in nodes:
        tag(node, "forward")
    shape.outputs[0].name = f"{stem}_shape"
    _typed(shape.outputs[0], ir.DataType.INT64, ir.Shape([len(mask.shape)]) if mask.shape is not None else None)
    packed.outputs[0].name = f"{stem}{PACKED_SUFFIX}"
    _typed(packed.outputs[0], ir.DataType.UINT8, ir.Shape([None, 1]))
    graph.insert_after(mask.producer(), nodes)
    return packed.outputs[0], shape.outputs[0]


def _unpack_before(graph: ir.Graph, reader: ir.Node, mask: ir.Value, packed: ir.Value, shape: ir.Value) -> ir.Value:
    stem = f"{mask.name}_unpacked"
    shifts = _constant(f"{stem}_shifts", np.arange(8, dtype=np.uint8))
    two = _constant(f"{stem}_two", np.array(2, dtype=np.uint8))
    flat_shape = _constant(f"{stem}_flat", np.array([-1], dtype=np.int64))
    start = _constant(f"{stem}_start", np.array([0], dtype=np.int64))
    shifted = ir.node("BitShift", [packed, shifts.outputs[0]], attributes={"direction": "RIGHT"}, name=f"{stem}_shifted")
    bits = ir.node("Mod", [shifted.outputs[0], two.outputs[0]], name=f"{stem}_bits")
    flat = ir.node("Reshape", [bits.outputs[0], flat_shape.outputs[0]], name=f"{stem}_flat_bits")
    size = ir.node("ReduceProd", [shape], attributes={"keepdims": 1}, name=f"{stem}_size")
    sliced = ir.node("Slice", [flat.outputs[0], start.outputs[0], size.outputs[0]], name=f"{stem}_sliced")
    shaped = ir.node("Reshape", [sliced.outputs[0], shape], name=f"{stem}_shaped")
    unpacked = ir.node("Cast", [shaped.outputs[0]], attributes={"to": ir.DataType.BOOL}, name=stem)
    nodes = [shifts, two, flat_shape, start, shifted, bits, flat, size, sliced, shaped, unpacked]
    for node in nodes:
        tag(node, "backward")
    unpacked.outputs[0].name = stem
    _typed(unpacked.outputs[0], ir.DataType.BOOL, mask.shape.copy() if mask.shape is not None else None)
    graph.insert_before(reader, nodes)
    return unpacked.outputs[0]
