"""What an export must leave as it found it, and the BatchNorm statistics a step updates.

Exporting runs the module's forward once (tracing), in the mode each submodule is in.
That forward has side effects torch's own forward would have: a training BatchNorm
updates its running statistics and ``num_batches_tracked``, and dropout draws from
torch's generator.  An export is not a training step, so :func:`export_side_effects_undone`
puts back every buffer, every submodule's ``training`` flag and torch's generators.

A step on ORT then updates the statistics as torch's forward does: the training graph's
``BatchNormInternal`` keeps the batch mean and inverse standard deviation it normalized
with (``saved_mean``, ``saved_inv_std``, outputs 3 and 4), and :class:`BatchNormUpdate`
applies torch's rule to the module's buffers, ``num_batches_tracked`` and a ``momentum``
of None (a cumulative average) included.  ORT's own running-statistics outputs are not
used: the running variance torch keeps is the *unbiased* batch variance
(``var * n / (n - 1)``), and a momentum of None changes every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterator

import onnx_ir as ir
import torch

from ortpass.analysis.partition import tag
from ortpass.conventions import MS_DOMAIN
from ortpass.errors import OrtpassError

logger = logging.getLogger(__name__)

__all__ = [
    "BatchNormUpdate",
    "BufferCopy",
    "SideEffects",
    "expose_batch_norm_statistics",
    "export_side_effects_undone",
    "running_stat_buffers",
    "state_update_from",
]


@dataclasses.dataclass
class SideEffects:
    """What a body changed: the names of the parameters and buffers it wrote to."""

    changed: list[str] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def export_side_effects_undone(module: torch.nn.Module) -> Iterator[SideEffects]:
    """Run the body, then restore every buffer it wrote to, every submodule's ``training``
    flag and torch's random generators as they were before it.  The yielded record names
    the parameters and buffers the body wrote to (a parameter is not restored: keeping a
    copy of every weight for that would double the memory)."""
    modes = [(m, m.training) for m in module.modules()]
    state = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    versions = [t._version for _, t in state]
    buffers = {id(b): b.detach().clone() for b in module.buffers()}
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    effects = SideEffects()
    try:
        with torch.random.fork_rng(devices=devices):
            yield effects
    finally:
        for m, training in modes:
            m.training = training
        for (name, tensor), version in zip(state, versions):
            before = buffers.get(id(tensor))
            # A BatchNorm kernel writes its running statistics without bumping the
            # version counter: buffers are compared by value.
            if tensor._version == version and (before is None or torch.equal(tensor, before)):
                continue
            if name not in effects.changed:
                effects.changed.append(name)
            if before is not None:
                with torch.no_grad():
                    tensor.copy_(before)


def _tracked_batch_norms(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.modules.batchnorm._BatchNorm]]:
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats:
            yield name, m


def running_stat_buffers(module: torch.nn.Module) -> set[str]:
    """The buffers a forward of ``module`` updates as torch's BatchNorm does (training,
    tracking running statistics): a step updates them, no other buffer."""
    names = set()
    for name, bn in _tracked_batch_norms(module):
        prefix = f"{name}." if name else ""
        names.update(f"{prefix}{b}" for b in ("running_mean", "running_var", "num_batches_tracked"))
    return names


@dataclasses.dataclass(frozen=True)
class BatchNormUpdate:
    """One training BatchNorm's statistics update: the module path and the graph outputs
    that hold the batch mean, the inverse standard deviation and the element count per
    channel the graph normalized with."""

    module: str
    mean: str
    inv_std: str
    count: str

    def apply(self, root: torch.nn.Module, mean: torch.Tensor, inv_std: torch.Tensor, count: torch.Tensor) -> None:
        """Update the BatchNorm's buffers from one step's statistics, as torch's forward does."""
        bn = root.get_submodule(self.module)
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
            n = int(count) // mean.numel()
            variance = inv_std.double().pow(-2) - bn.eps  # the biased variance the graph normalized with
            unbiased = variance * (n / (n - 1)) if n > 1 else variance
            bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype), alpha=factor)
            bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype), alpha=factor)

    def outputs(self) -> tuple[str, ...]:
        """The graph outputs :meth:`apply` takes, in order."""
        return (self.mean, self.inv_std, self.count)

    def to_list(self) -> list[str]:
        return [self.module, self.mean, self.inv_std, self.count]


@dataclasses.dataclass(frozen=True)
class BufferCopy:
    """A buffer whose new value the graph computes (the torch builder's: AOTAutograd
    functionalizes BatchNorm's running statistics and ``num_batches_tracked``, by torch's
    own formulas): copied into the module after the step."""

    buffer: str
    output: str

    def outputs(self) -> tuple[str, ...]:
        return (self.output,)

    def apply(self, root: torch.nn.Module, value: torch.Tensor) -> None:
        with torch.no_grad():
            root.get_buffer(self.buffer).copy_(value)

    def to_list(self) -> dict[str, str]:
        return {"buffer": self.buffer, "output": self.output}


def state_update_from(entry: list | dict) -> BatchNormUpdate | BufferCopy:
    """The update a cache entry's ``to_list()`` describes."""
    return BufferCopy(**entry) if isinstance(entry, dict) else BatchNormUpdate(*entry)


def expose_batch_norm_statistics(model: ir.Model, module: torch.nn.Module, prefix: str) -> list[BatchNormUpdate]:
    """Make the statistics of every training BatchNorm of ``module`` outputs of ``model``
    (a training graph whose state inputs are named ``prefix`` + the buffer's name)."""
    wanted = {f"{prefix}{name}.running_mean" if name else f"{prefix}running_mean": name
              for name, _ in _tracked_batch_norms(module)}  # fmt: skip
    updates = []
    for node in list(model.graph):
        if node.op_type != "BatchNormInternal" or node.domain != MS_DOMAIN or len(node.inputs) < 4:
            continue
        running_mean = node.inputs[3]
        if running_mean is None or running_mean.name not in wanted:
            continue
        if len(node.outputs) < 5:
            raise OrtpassError(f"BatchNorm {wanted[running_mean.name]!r}: the graph keeps no batch statistics")
        size = ir.Node("", "Size", [node.inputs[0]], name=f"{node.name}_element_count")
        tag(size, "forward")
        size.outputs[0].name = f"{node.name}_element_count"
        size.outputs[0].type, size.outputs[0].shape = ir.TensorType(ir.DataType.INT64), ir.Shape([])
        model.graph.insert_after(node, size)
        mean, inv_std = node.outputs[3], node.outputs[4]
        model.graph.outputs.extend(v for v in (mean, inv_std, size.outputs[0]) if not v.is_graph_output())
        updates.append(BatchNormUpdate(wanted.pop(running_mean.name), mean.name, inv_std.name, size.outputs[0].name))
    if wanted:
        raise OrtpassError(
            f"BatchNorm {sorted(wanted.values())} in training mode: the training graph has no BatchNormInternal "
            "reading its running statistics, so they could not be updated as torch does"
        )
    return updates
