"""The rows a session adds into gradients after ORT ran (:mod:`ortpass.training.row_scatter`).

Sessions run the graph with each tied embedding's final ScatterND removed and add the rows
here instead, into the gradient ORT returned: in place, so the weight's gradient exists
once.  ``index_add_`` on dim 0 visits the indices one after another on the CPU, as ORT's
ScatterND kernel visits its updates, so the sums round as ORT's do (tested bitwise in
tests/test_row_scatter.py).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import onnx_ir as ir

from ortpass.errors import OrtpassError
from ortpass.training.row_scatter import RowScatter, defer_row_scatters

__all__ = ["RowAdds", "add_rows", "numpy_tensor", "ortvalue_tensor", "rows_added_after", "rows_added_after_proto"]


def rows_added_after(model: ir.Model) -> tuple[ir.Model, RowAdds]:
    """The graph a session runs for ``model`` (its row scatters removed) and the adds that
    complete its gradients."""
    model, scatters = defer_row_scatters(model)
    return model, RowAdds(scatters)


def rows_added_after_proto(proto: Any) -> tuple[Any, RowAdds]:
    """:func:`rows_added_after` for an ``onnx.ModelProto`` (converted only if it scatters)."""
    if not any(node.op_type == "ScatterND" for node in proto.graph.node):
        return proto, RowAdds([])
    model, adds = rows_added_after(ir.from_proto(proto))
    return (ir.to_proto(model) if adds else proto), adds


class RowAdds:
    """What a session fetches besides what its caller asks, and adds after the run."""

    def __init__(self, scatters: Sequence[RowScatter]) -> None:
        self._by_gradient: dict[str, RowScatter] = {s.gradient: s for s in scatters}

    def __bool__(self) -> bool:
        return bool(self._by_gradient)

    def fetch(self, names: Sequence[str]) -> list[str]:
        """``names`` and the indices and rows their gradients need."""
        extra = [n for name in names if (s := self._by_gradient.get(name)) for n in (s.indices, s.rows)]
        return [*names, *extra]

    def finish(self, names: Sequence[str], values: list[Any], as_tensor: Callable[[Any], Any]) -> list[Any]:
        """The values of ``names`` (the head of ``values``, fetched with :meth:`fetch`), each
        gradient's rows added in place; ``as_tensor`` views a value as a torch tensor."""
        by_name = dict(zip(self.fetch(names), values))
        for name in names:
            scatter = self._by_gradient.get(name)
            if scatter is not None:
                add_rows(as_tensor(by_name[name]), as_tensor(by_name[scatter.indices]), as_tensor(by_name[scatter.rows]), name)
        return values[: len(names)]


def add_rows(gradient: Any, indices: Any, rows: Any, name: str = "gradient") -> None:
    """``gradient[indices[..., 0]] += rows`` in place (torch tensors), repeated indices added
    one after another; negative indices count from the end, as ScatterND's do."""
    import torch

    index = indices.reshape(-1).long()
    size = gradient.shape[0]
    if index.numel() and (int(index.min()) < -size or int(index.max()) >= size):
        raise OrtpassError(f"{name}: a row index is out of range for {size} rows")
    index = torch.where(index < 0, index + size, index)
    gradient.index_add_(0, index, rows.reshape(index.numel(), *gradient.shape[1:]))


def numpy_tensor(array: Any) -> Any:
    """A torch view of a numpy array (what ``InferenceSession.run`` returns)."""
    import torch

    return torch.from_numpy(array)


def ortvalue_tensor(value: Any) -> Any:
    """A torch view of a C-level OrtValue's memory (DLPack)."""
    import torch

    return torch.utils.dlpack.from_dlpack(value.to_dlpack())
