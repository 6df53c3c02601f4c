"""The module's parameters and buffers in its graph: given to an export made without
their values, made graph inputs before the pipeline (ORT's fusions then cannot fold a
frozen weight into a constant), and their values dropped once it ran (the session is fed
them every step)."""

from __future__ import annotations

import onnx_ir as ir
import torch

__all__ = ["attach_state", "state_to_inputs", "strip_state_values"]


def attach_state(model: ir.Model, tensors: dict[str, torch.Tensor]) -> None:
    """Give the graph inputs an export without weights made of the module's parameters and
    buffers (``tensors``, by their names in the graph) those tensors as initializers, shared
    with torch, not copied (:class:`onnx_ir.tensor_adapters.TorchTensor`)."""
    from onnx_ir.tensor_adapters import TorchTensor

    for value in model.graph.inputs:
        tensor = tensors.get(value.name or "")
        if tensor is not None and value.const_value is None:
            value.const_value = TorchTensor(tensor.detach(), name=value.name)
            model.graph.register_initializer(value)


def state_to_inputs(model: ir.Model, state_names: set[str]) -> None:
    """Make every parameter and buffer a graph input (ORT's fusions then cannot fold a
    frozen weight into a constant); :func:`strip_state_values` drops their values afterwards."""
    inputs = {v.name for v in model.graph.inputs}
    for name, value in model.graph.initializers.items():
        if name in state_names and name not in inputs:
            model.graph.inputs.append(value)


def strip_state_values(model: ir.Model, state_names: set[str]) -> list[str]:
    """Drop the values of parameters and buffers: the session gets them fed every step."""
    stripped = []
    for name in list(model.graph.initializers):
        if name in state_names:
            value = model.graph.initializers.pop(name)
            value.const_value = None
            stripped.append(name)
    return stripped
