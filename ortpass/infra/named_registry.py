"""One thread-safe name -> item registry, the shape of every registry ortpass keeps (pass
exporters, shape inferers, symbolics, exported and runnable Functions)."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

__all__ = ["NamedRegistry"]

T = TypeVar("T")


class NamedRegistry(Generic[T]):
    """Items by name.  ``what`` names an item for errors, e.g. ``"a shape inferer"``."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._items: dict[str, T] = {}
        self._lock = threading.Lock()

    def add(self, name: str, item: T, *, replace: bool = False) -> T:
        """Register ``item`` under ``name``; another item there already is refused unless
        ``replace``.  Returns ``item`` (so this serves decorators)."""
        with self._lock:
            existing = self._items.get(name)
            if existing is not None and existing is not item and not replace:
                raise ValueError(f"{self.what} is already registered for {name}: {existing!r}")
            self._items[name] = item
        return item

    def remove(self, name: str) -> None:
        """Forget ``name`` (no error if absent)."""
        with self._lock:
            self._items.pop(name, None)

    def get(self, name: str) -> T | None:
        return self._items.get(name)

    def snapshot(self) -> dict[str, T]:
        """A copy of the registry, name -> item."""
        with self._lock:
            return dict(self._items)
