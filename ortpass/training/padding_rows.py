"""Keep an embedding's padding row out of its lookup's gradient, as torch does.

``F.embedding(indices, weight, padding_idx=p)`` (``nn.Embedding(padding_idx=p)``) gives
row ``p`` of the weight nothing from the lookup: the rows of the output's gradient whose
index is ``p`` are left out of the weight's gradient.  The ONNX export is a plain
``Gather``, and ORT 1.19.2's ``GatherGrad`` scatters every row of the output's gradient,
row ``p`` included (measured, docs/design/ort-facts.md): Marian and Pegasus, whose
decoders start every sequence with the pad token, and BERT on any padded batch trained
their padding rows every step.

``ortpass.export`` records the padding row of each embedding Gather (model metadata
``pkg.ortpass.padding_idx``, by the Gather's output name).  After ORT's gradient builder,
the gradient reaching that Gather's ``GatherGrad`` becomes
``Where(Unsqueeze(Equal(indices, p)), 0, dY)``: ``Where`` rather than a multiply by a 0/1
mask, so that an inf or NaN in a padding row's gradient is dropped as torch drops it.
Only the lookup's share is masked: a weight read elsewhere too (an output projection tied
to the embedding) keeps that use's gradient in row ``p``, which ORT adds to the
GatherGrad's after it.  The new nodes are not forward nodes, so the build tags them
backward.
"""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir

from ortpass.conventions import MAX_ORT_OPSET, MS_DOMAIN, is_onnx_domain
from ortpass.errors import TrainingGraphError
from ortpass.infra.metadata import get_padding_indices
from ortpass.training.shapes import known_shapes

__all__ = ["mask_padding_rows"]

logger = logging.getLogger(__name__)

# Unsqueeze takes negative axes from opset 11, which the mask needs: the rank of the
# indices may be unknown, the weight's never is.
_MIN_OPSET = 11


def mask_padding_rows(proto: onnx.ModelProto, model: ir.Model) -> int:
    """Mask the padding rows of the gradient reaching each recorded Gather's ``GatherGrad``
    in the training graph ``proto``; ``model`` is the forward model, whose metadata holds
    the record.  Returns how many GatherGrads were masked.

    A recorded Gather without a GatherGrad is one whose weight gets no gradient (frozen).

    Raises:
        TrainingGraphError: a recorded Gather is gone from the graph (an ORT fusion took
            it), its gradient is not a GatherGrad of its indices, a type or rank the mask
            needs is unknown, or the opset is older than 11.
    """
    padding = get_padding_indices(model)
    if not padding:
        return 0
    gathers = {
        node.output[0]: node
        for node in proto.graph.node
        if node.op_type == "Gather" and is_onnx_domain(node.domain) and node.output
    }
    missing = sorted(set(padding) - set(gathers))
    if missing:
        raise TrainingGraphError(
            f"the embedding Gather(s) computing {missing} have a padding row but are not in the graph ONNX Runtime "
            "built (a fusion replaced them): their padding rows would get a gradient torch does not give them"
        )
    grad_nodes = _gather_grads(proto, {gathers[name].name: (gathers[name], row) for name, row in padding.items()})
    opset = next((o.version for o in proto.opset_import if is_onnx_domain(o.domain)), MAX_ORT_OPSET)
    if grad_nodes and opset < _MIN_OPSET:
        raise TrainingGraphError(
            f"embeddings with padding_idx need ai.onnx opset {_MIN_OPSET} or newer to keep their padding rows "
            f"out of the gradient, and the model has {opset}; export with a newer opset"
        )
    types, shapes = _elem_types(proto), known_shapes(proto)
    masked = 0
    for grad_node, gather, row in grad_nodes:
        new_nodes, new_initializers = _mask(grad_node, gather, row, types, shapes, opset)
        position = list(proto.graph.node).index(grad_node)
        for offset, new in enumerate(new_nodes):
            proto.graph.node.insert(position + offset, new)
        proto.graph.initializer.extend(new_initializers)
        masked += 1
        logger.info(
            "kept padding row %d of %r out of the gradient of Gather %r (ONNX Runtime's GatherGrad ignores padding_idx)",
            row, gather.input[0], gather.name,
        )
    return masked


def _gather_grads(
    proto: onnx.ModelProto, recorded: dict[str, tuple[onnx.NodeProto, int]]
) -> list[tuple[onnx.NodeProto, onnx.NodeProto, int]]:
    """``(GatherGrad, Gather, row)`` for each recorded Gather whose weight gets a gradient.

    ORT's builder names the nodes it emits for forward node ``F`` ``<F>_Grad/...``, and
    differentiates a Gather as ``GatherGrad(Shape(data), indices, dY)``.
    """
    found: dict[str, onnx.NodeProto] = {}
    differentiated: set[str] = set()
    for node in proto.graph.node:
        owner = node.name.split("_Grad/", 1)[0] if "_Grad/" in node.name else None
        if owner not in recorded:
            continue
        differentiated.add(owner)
        gather = recorded[owner][0]
        if node.op_type == "GatherGrad" and node.domain == MS_DOMAIN and node.input[1] == gather.input[1]:
            found[owner] = node
    unmatched = sorted(differentiated - set(found))
    if unmatched:
        raise TrainingGraphError(
            f"ONNX Runtime's gradient of the embedding Gather(s) {unmatched} is not the GatherGrad of their indices "
            "that ortpass masks: their padding rows would get a gradient torch does not give them"
        )
    return [(found[owner], *recorded[owner]) for owner in sorted(found)]


def _mask(
    grad_node: onnx.NodeProto,
    gather: onnx.NodeProto,
    row: int,
    types: dict[str, int],
    shapes: dict[str, list],
    opset: int,
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Nodes and initializers computing ``Where(Unsqueeze(Equal(indices, row)), 0, dY)``
    for ``grad_node``'s third input, which they replace."""
    data, indices = gather.input[0], gather.input[1]
    grad_type = types.get(gather.output[0]) or types.get(data)
    weight_shape = shapes.get(data)
    if grad_type is None or weight_shape is None:
        raise TrainingGraphError(
            f"the type or rank of {data!r}, the weight of embedding Gather {gather.name!r}, is unknown: its padding "
            f"row {row} cannot be kept out of the gradient"
        )
    stem = f"{grad_node.name}/ortpass_padding"
    nodes: list[onnx.NodeProto] = []
    index_type = types.get(indices)
    if index_type not in (onnx.TensorProto.INT32, onnx.TensorProto.INT64):
        # Unknown here: compare the indices as int64, which holds both kinds.
        nodes.append(onnx.helper.make_node("Cast", [indices], [f"{stem}/indices"], name=f"{stem}/Cast", to=onnx.TensorProto.INT64))
        indices, index_type = f"{stem}/indices", onnx.TensorProto.INT64
    initializers = [
        onnx.helper.make_tensor(f"{stem}/row", index_type, [], [row]),
        onnx.helper.make_tensor(f"{stem}/zero", grad_type, [], [0]),
    ]
    is_padding = f"{stem}/is_padding"
    nodes.append(onnx.helper.make_node("Equal", [indices, f"{stem}/row"], [is_padding], name=f"{stem}/Equal"))
    # dY is indices.shape + weight.shape[1:]: one trailing axis per weight axis after the
    # first lines the mask up with it (negative, since the indices' rank may be unknown).
    axes = list(range(-1, -len(weight_shape), -1))
    if axes:
        unsqueezed = f"{stem}/is_padding_row"
        if opset >= 13:
            initializers.append(onnx.helper.make_tensor(f"{stem}/axes", onnx.TensorProto.INT64, [len(axes)], axes))
            nodes.append(onnx.helper.make_node("Unsqueeze", [is_padding, f"{stem}/axes"], [unsqueezed], name=f"{stem}/Unsqueeze"))
        else:
            nodes.append(onnx.helper.make_node("Unsqueeze", [is_padding], [unsqueezed], name=f"{stem}/Unsqueeze", axes=axes))
        is_padding = unsqueezed
    masked = f"{grad_node.input[2]}_ortpass_padding_masked"
    nodes.append(onnx.helper.make_node("Where", [is_padding, f"{stem}/zero", grad_node.input[2]], [masked], name=f"{stem}/Where"))
    grad_node.input[2] = masked
    return nodes, initializers


def _elem_types(proto: onnx.ModelProto) -> dict[str, int]:
    """Known element types by value name (ONNX ``TensorProto`` data types)."""
    types = {
        info.name: info.type.tensor_type.elem_type
        for info in (*proto.graph.input, *proto.graph.value_info, *proto.graph.output)
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type
    }
    types.update((init.name, init.data_type) for init in proto.graph.initializer)
    return types
