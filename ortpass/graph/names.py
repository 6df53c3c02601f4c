"""One allocator of fresh names, so every pass and stage names new values and nodes alike."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["NameAllocator"]


class NameAllocator:
    """Hands out names not yet taken, and takes them.

    ``fresh("x")`` returns ``x`` if free, else ``x_1``, ``x_2``, ...; with
    ``always_number=True`` it returns ``x0``, ``x1``, ... (for dim names such as ``gathered0``).
    """

    def __init__(self, taken: Iterable[str] = ()) -> None:
        self.taken: set[str] = set(taken)

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
