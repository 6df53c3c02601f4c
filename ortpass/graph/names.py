"""One allocator of fresh names, so every pass and stage names new values and nodes alike."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["NameAllocator"]


class NameAllocator:
    """Hands out names not yet taken, and takes them.

    ``fresh("x")`` returns ``x`` if free, else ``x_1``, ``x_2``, ...; with
    ``always_number=True`` it returns ``x0``, ``x1``, ... (for dim names such as ``gathered0``).
    """

    def __init__(self, taken: Iterable[str] = ()) -> None:
        self.taken: set[str] = set(taken)

    @classmethod
    def of_graph(cls, graph: ir.Graph) -> NameAllocator:
        """Every name ``graph`` uses taken: its nodes', their outputs', its inputs' and its
        initializers' (one namespace, so a new node or value takes none of them)."""
        nodes = list(graph)
        return cls(
            [n.name for n in nodes if n.name] + [v.name for n in nodes for v in n.outputs if v.name]
            + [v.name for v in graph.inputs if v.name] + list(graph.initializers)
        )  # fmt: skip

    def __contains__(self, name: str) -> bool:
        return name in self.taken

    def take(self, name: str) -> None:
        self.taken.add(name)

    def fresh(self, base: str, *, always_number: bool = False) -> str:
        if always_number:
            n = 0
            while f"{base}{n}" in self.taken:
                n += 1
            name = f"{base}{n}"
        else:
            name, n = base, 0
            while name in self.taken:
                n += 1
                name = f"{base}_{n}"
        self.taken.add(name)
        return name
