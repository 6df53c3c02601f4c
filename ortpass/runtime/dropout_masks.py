"""The forward Dropout nodes' masks, for parity checks that replay ORT's masks in torch."""

from __future__ import annotations

import onnx_ir as ir

from ortpass.conventions import SIDE_KEY, is_onnx_domain
from ortpass.errors import OrtpassError

__all__ = ["dropout_mask_names", "forward_dropouts", "with_dropout_masks"]


def dropout_mask_names(model: ir.Model) -> list[str]:
    """Mask outputs of the forward Dropout nodes, in graph (= call) order.

    Passes drop the masks nobody reads (``recompute``, ``replay-dropout-mask``): for those
    models, :func:`with_dropout_masks` gives a copy that has them back.
    """
    names = []
    for node in forward_dropouts(model):
        if len(node.outputs) < 2 or not node.outputs[1].name:
            raise OrtpassError(
                f"Dropout {node.name!r} has no mask output (a pass dropped it); use with_dropout_masks(model)"
            )
        names.append(node.outputs[1].name)
    return names


def with_dropout_masks(model: ir.Model) -> tuple[ir.Model, list[str]]:
    """A copy of ``model`` in which every forward Dropout outputs its mask, and the masks'
    names in call order: for parity checks, which replay ORT's masks in torch.

    A forward Dropout draws the same mask whether or not it outputs it (the kernel builds
    the mask to apply it), and its recompute clones and replays draw that same mask again.
    """
    copy = model.clone()
    taken = {v.name for n in copy.graph for v in n.outputs} | {v.name for v in copy.graph.inputs}
    for node in forward_dropouts(copy):
        if len(node.outputs) >= 2 and node.outputs[1].name:
            continue
        node.resize_outputs(2)
        mask = node.outputs[1]
        mask.name = _fresh_name(f"{node.outputs[0].name or node.name}_mask", taken)
        mask.type, mask.shape = ir.TensorType(ir.DataType.BOOL), node.outputs[0].shape
        taken.add(mask.name)
    return copy, dropout_mask_names(copy)


def forward_dropouts(model: ir.Model) -> list[ir.Node]:
    """The forward Dropout nodes, in graph (= call) order."""
    return [
        node
        for node in model.graph
        if node.op_type == "Dropout"
        and is_onnx_domain(node.domain)
        and node.metadata_props.get(SIDE_KEY, "forward") == "forward"
    ]


def _fresh_name(name: str, taken: set[str]) -> str:
    candidate, suffix = name, 0
    while candidate in taken:
        suffix += 1
        candidate = f"{name}_{suffix}"
    return candidate
