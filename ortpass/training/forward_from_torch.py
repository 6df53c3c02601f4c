"""The torch builder's forward-only graph: what a call without gradient runs (evaluation
under ``torch.no_grad``, a frozen copy such as an EMA model's), in standard ONNX ops.

The rule: the same trace as the training graph's forward, without the backward.
``torch.export`` traces the module (the sizes named dynamic symbolic, SDPA as its math, as
:mod:`ortpass.training.from_torch` traces it), torch's core ATen decompositions and the
builder's own are applied, and ``torch.onnx`` writes the program with the fixes the joint
graph gets (:func:`ortpass.training.joint_onnx.joint_to_onnx`).  So nothing in the graph
needs ONNX Runtime's training build: ortpass's TorchScript export writes fused attention
and every ``torch.autograd.Function`` as a PythonOp, which stock ``onnxruntime`` has no
kernel for.  A Function's forward is inlined here; without a gradient its backward is
never needed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import onnx_ir as ir
import torch

from ortpass.errors import TrainingGraphError
from ortpass.training.from_torch import _INNER, _dynamic_shapes, _export, _name_dims, _probe_outputs, _shown
from ortpass.training.joint_decompositions import joint_decompositions
from ortpass.training.joint_onnx import _rename_state, joint_to_onnx, name_outputs

__all__ = ["build_forward_graph_from_torch"]

logger = logging.getLogger(__name__)


def build_forward_graph_from_torch(
    module: torch.nn.Module,
    args: Sequence[torch.Tensor],
    *,
    input_names: Sequence[str],
    dynamic_axes: Mapping[str, Mapping[int, str] | Sequence[int]] | None = None,
) -> ir.Model:
    """Trace ``module(*args)`` (flat tensors in, a tensor or tuple of tensors out) and
    return its forward graph: inputs ``input_names``, outputs ``output_<k>``, parameters
    and buffers initializers named by their ``state_dict`` names.  ``dynamic_axes`` as
    :func:`~ortpass.training.from_torch.build_training_graph_from_torch` takes them (a
    dynamic dim holds from size 2 on).

    Raises:
        TrainingGraphError: a forward that updates buffers (a graph without outputs for
            them would lose the update), or a failed trace (with torch's reason).
    """
    args, names = tuple(args), list(input_names)
    if len(names) != len(args):
        raise TrainingGraphError(f"{len(names)} input names for {len(args)} inputs")
    module = _Flat(module)
    # One eager call first, as the training graph's build makes: torch.export undoes what
    # the module records on itself while traced (ORTModule's view records the output's
    # structure), and the eager call leaves it.
    _probe_outputs(module, args)
    program = _export(module, args, _dynamic_shapes(names, args, dynamic_axes or {}))
    try:
        with joint_decompositions():  # the table the joint trace applies, so both forwards are alike
            from torch._decomp import core_aten_decompositions

            program = program.run_decompositions(core_aten_decompositions())
    except Exception as exc:
        raise TrainingGraphError(f"torch could not decompose the forward of {_shown(module)}: {exc}") from exc
    # Functionalized: an in-place update of a buffer is now an output of its new value.
    mutated = sorted(b.removeprefix(f"{_INNER}.") for b in program.graph_signature.buffers_to_mutate.values())
    if mutated:
        raise TrainingGraphError(
            f"{_shown(module)}.forward updates buffers {mutated} in place; a graph run without gradient returns "
            "no new values for them (BatchNorm's statistics in training mode get a training graph)"
        )
    model = joint_to_onnx(program, names)
    _rename_state(model.graph, _INNER)
    name_outputs(model.graph, [f"output_{k}" for k in range(len(model.graph.outputs))])
    _name_dims(model, names, args, dynamic_axes or {})
    logger.info("built forward graph from torch: %d nodes", len(model.graph))
    return model


class _Flat(torch.nn.Module):
    """``module`` called with the tensors as separate arguments (what the trace's dynamic
    shapes describe); its state names get the prefix ``inner.``, dropped in the graph."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        setattr(self, _INNER, module)
        self.training = module.training

    def forward(self, *tensors: torch.Tensor):
        return getattr(self, _INNER)(*tensors)
