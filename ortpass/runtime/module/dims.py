"""Which input dims a graph may run at other sizes than those it was exported at.

Every tensor dim is exported dynamic, but a trace can still bake a size into the graph:
Python arithmetic on a shape, a size read from a value whose shape the exporter knew (a
PythonOp's output did this: transformers reshaped attention with ``out.shape[0]``, and
a graph exported at batch 2 mixed samples at batch 3), a branch taken on a size.  Such a
graph runs at another size without an error and computes something else.

So a graph runs only at the sizes it was exported at, except for dims *proven dynamic*:
the module is exported a second time with its dims changed (a dim of size n becomes
n - 1, or 3 where n is 2; dims of equal size change together, so dims that must agree
still do) and the two graphs are compared node by node, every constant included.  Equal
graphs prove the changed dims dynamic.  When they differ, or the second export fails,
each size is tried alone, and the dims whose change changed the graph are *pinned*: a
call at another size of a pinned dim builds another graph.  Dims of size 1 (they may be
broadcast) and dims ORT needs static (:class:`~ortpass.errors.StaticDimsRequired`) are
pinned without trying.

A proof by two sizes cannot see a branch that both sizes take alike (``if seq > 4096``);
torch's tracer has the same blind spot.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Callable, Iterable, Sequence

import onnx_ir as ir
import torch

from ortpass.conventions import DENSITY_FLAG

__all__ = ["Dim", "PinnedDims", "graph_signature", "prove_dynamic_dims"]

logger = logging.getLogger(__name__)

Dim = tuple[int, int]  # (tensor position among the call's tensor arguments, axis)


@dataclasses.dataclass(frozen=True)
class PinnedDims:
    """The dims a graph was built static in, with their sizes, and the dynamic dims that
    hold from size 2 on (``at_least_two``: torch.export assumes a dynamic dim is not 0 or
    1, where broadcasting could differ)."""

    sizes: tuple[tuple[Dim, int], ...] = ()
    at_least_two: tuple[Dim, ...] = ()

    @classmethod
    def of(cls, dims: Iterable[Dim], tensors: Sequence[torch.Tensor], at_least_two: Iterable[Dim] = ()) -> PinnedDims:
        sizes = tuple(sorted((tuple(dim), int(tensors[dim[0]].shape[dim[1]])) for dim in {tuple(d) for d in dims}))
        return cls(sizes, tuple(sorted(tuple(d) for d in at_least_two)))

    @property
    def dims(self) -> frozenset[Dim]:
        return frozenset(dim for dim, _ in self.sizes)

    def accepts(self, tensors: Sequence[torch.Tensor]) -> bool:
        return all(tensors[i].shape[axis] == size for (i, axis), size in self.sizes) and all(
            tensors[i].shape[axis] >= 2 for i, axis in self.at_least_two
        )

    def difference(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> str:
        """The first pinned dim whose size ``tensors`` change, in words."""
        for (i, axis), size in self.sizes:
            if tensors[i].shape[axis] != size:
                return f"{names[i]} dim {axis} is {tensors[i].shape[axis]}, and the graph for {size} is static in it"
        for i, axis in self.at_least_two:
            if tensors[i].shape[axis] < 2:
                return f"{names[i]} dim {axis} is {tensors[i].shape[axis]}, and the graph holds from 2 on"
        return "no pinned dim changed"


def prove_dynamic_dims(
    tensors: Sequence[torch.Tensor],
    pinned: Iterable[Dim],
    signature_at: Callable[[list[torch.Tensor]], list | None],
    reference: list,
) -> set[Dim]:
    """The dims to pin: ``pinned`` and every dim the second export does not prove dynamic.

    ``signature_at(tensors)`` exports at other tensors and returns the graph's
    :func:`graph_signature` (None when the export failed); ``reference`` is the signature
    of the graph exported at ``tensors``.
    """
    pinned = set(pinned) | {(i, a) for i, t in enumerate(tensors) for a in range(t.dim()) if t.shape[a] <= 1}
    groups: dict[int, list[Dim]] = {}
    for i, t in enumerate(tensors):
        for axis in range(t.dim()):
            if (i, axis) not in pinned:
                groups.setdefault(int(t.shape[axis]), []).append((i, axis))
    if not groups:
        return pinned
    if signature_at(_changed(tensors, groups)) == reference:
        logger.info("dims proven dynamic: sizes %s", sorted(groups))
        return pinned
    for size, dims in groups.items():
        if signature_at(_changed(tensors, {size: dims})) != reference:
            logger.info("ORTModule pins the dims of size %d (%s): the export changes with them", size, dims)
            pinned.update(dims)
    return pinned


def _changed(tensors: Sequence[torch.Tensor], groups: dict[int, list[Dim]]) -> list[torch.Tensor]:
    """``tensors`` with each dim of ``groups`` resized: its last slices dropped, or for a
    size of 2 the last one repeated (size 1 may broadcast).  Values stay valid (token
    ids, masks, positions): every slice is one the batch has."""
    changed = [t.detach() for t in tensors]
    for size, dims in groups.items():
        for i, axis in dims:
            t = changed[i]
            if size > 2:
                changed[i] = t.narrow(axis, 0, size - 1)
            else:
                changed[i] = torch.cat([t, t.narrow(axis, size - 1, 1)], dim=axis)
    return [c.contiguous().requires_grad_(t.requires_grad) for c, t in zip(changed, tensors)]


def graph_signature(model: ir.Model, state: set[str]) -> list:
    """The graph as comparable data: every node's op, attributes and wiring, with values
    named by where they come from (a graph input's position, a node output's position,
    a constant's bytes) rather than by name; ``state``: initializers and graph inputs
    compared by name only (parameters and buffers, the same tensors in both exports, with
    or without their values)."""
    ids: dict[ir.Value, tuple] = {
        v: ("state", v.name) if v.name in state else ("input", k) for k, v in enumerate(model.graph.inputs)
    }  # state as inputs: an export without the weights' values (``export(weights=False)``)
    for name, value in model.graph.initializers.items():
        ids[value] = ("state", name) if name in state else ("constant", _digest(value.const_value))
    signature: list = []
    for index, node in enumerate(model.graph):
        for k, out in enumerate(node.outputs):
            ids[out] = ("node", index, k)
        signature.append((
            node.domain, node.op_type, node.overload,
            tuple(sorted((name, _attribute(attr)) for name, attr in node.attributes.items() if not _measured(node, name))),
            tuple(ids.get(v, ("unknown", v.name)) if v is not None else None for v in node.inputs),
        ))  # fmt: skip
    signature.append(tuple(ids.get(v) for v in model.graph.outputs))
    return signature


def _measured(node: ir.Node, attribute: str) -> bool:
    """The density the label probe measured: a record of the sample batch, not a computation."""
    if node.op_type != "PythonOp" or attribute != "input_float_scalars":
        return False
    func_name = node.attributes.get("func_name")
    return func_name is not None and func_name.value == DENSITY_FLAG


def _attribute(attr: ir.Attr) -> object:
    value = attr.value
    if isinstance(value, ir.TensorProtocol):
        return _digest(value)
    if isinstance(value, (list, tuple)):
        return tuple(_digest(v) if isinstance(v, ir.TensorProtocol) else repr(v) for v in value)
    return repr(value)


def _digest(tensor: ir.TensorProtocol | None) -> str:
    if tensor is None:
        return "none"
    return f"{tensor.dtype}{list(tensor.shape)}:" + hashlib.sha256(tensor.tobytes()).hexdigest()[:24]
