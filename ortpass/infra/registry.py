"""The pass registry: names usable in pipeline strings and on the command line.

Three sources, looked up in this order:
1. passes registered in this process with ``@ortpass.register_pass("name")``;
2. ortpass's built-in passes (``ortpass.passes``);
3. passes that installed packages declare in the entry-point group ``ortpass.passes``
   (``name = "package.module:PassClass"``), loaded only when first asked for.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from typing import Callable, TypeVar

import onnx_ir as ir

from ortpass.errors import PipelineSpecError, elide

__all__ = ["ENTRY_POINT_GROUP", "available_passes", "get_pass", "register_pass"]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "ortpass.passes"

_REGISTRY: dict[str, type[ir.passes.PassBase]] = {}
_builtins_loaded = False

P = TypeVar("P", bound=type)


def register_pass(name: str, *, replace: bool = False) -> Callable[[P], P]:
    """Class decorator making a pass available by ``name`` in pipelines and the CLI."""
    if not name or any(ch in name for ch in ",()= \t\n"):
        raise ValueError(f"invalid pass name {name!r}: use letters, digits, '-', '_' or '.'")

    def decorator(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, ir.passes.PassBase)):
            raise TypeError(f"register_pass({name!r}) needs an onnx_ir.passes.PassBase subclass, got {cls!r}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls and not replace:
            raise ValueError(
                f"pass name {name!r} is already registered to {existing.__module__}.{existing.__qualname__}"
            )
        _REGISTRY[name] = cls
        if not getattr(cls, "name", ""):
            cls.name = name  # type: ignore[attr-defined]
        return cls

    return decorator


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        importlib.import_module("ortpass.passes")


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def get_pass(name: str) -> type[ir.passes.PassBase]:
    """Return the pass class registered under ``name``; PipelineSpecError if there is none."""
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    entry = _entry_points().get(name)
    if entry is not None:
        try:
            cls = entry.load()
        except Exception as exc:
            raise PipelineSpecError(
                f"pass {name!r} from entry point {entry.value!r} (group {ENTRY_POINT_GROUP!r}) "
                f"failed to load: {type(exc).__name__}: {exc}"
            ) from exc
        return register_pass(name, replace=True)(cls)
    known = ", ".join(sorted(available_passes())) or "none"
    raise PipelineSpecError(f"unknown pass {elide(repr(name))}; known passes: {known}")


def available_passes() -> dict[str, str]:
    """Name -> where it comes from, for every pass that can be named."""
    _load_builtins()
    found = {name: f"{cls.__module__}.{cls.__qualname__}" for name, cls in _REGISTRY.items()}
    for name, entry in _entry_points().items():
        found.setdefault(name, f"{entry.value} (entry point)")
    return found
