"""Which ``torch.autograd.Function``s (and ``torch.library`` custom ops) a PythonOp may run:
those registered here, those exported in this process, and ortpass's own
(:data:`ortpass.conventions.BUILTIN_FUNCTIONS`).  Nothing a model names is imported unless it
is one of these.  No torch import: models can be inspected without it."""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Any, Iterable

import onnx_ir as ir

from ortpass.conventions import BUILTIN_FUNCTIONS, MS_DOMAIN

__all__ = ["pythonop_func_names", "register_function", "registered_functions", "unregister_function"]

logger = logging.getLogger(__name__)

_PYTHONOP_TYPES = ("PythonOp", "PythonOpGrad")

_lock = threading.RLock()
_functions: dict[str, Any] = {}
_builtins: dict[str, Any] | None = None



def register_function(function: Any) -> Any:
    """Allow the bridge to run ``function`` for the PythonOps naming it; returns ``function``.

    ``function`` is a torch.autograd.Function class (key ``module.QualName``; usable as a
    class decorator) or a ``torch.library.custom_op`` (key ``namespace::name``).
    """
    name = _key(function)
    with _lock:
        existing = _functions.get(name)
        if existing is not None and existing is not function:
            logger.warning("func_name %s now runs %r instead of %r", name, function, existing)
        _functions[name] = function
    return function


def unregister_function(function: Any) -> None:
    """Forget a registration made with :func:`register_function` (no error if absent)."""
    with _lock:
        _functions.pop(_key(function), None)


def _key(function: Any) -> str:
    from ortpass.pythonop.export import qualified_name

    if isinstance(function, str) or isinstance(function, type):
        return qualified_name(function)
    from ortpass.pythonop.custom_op import custom_op_name

    return custom_op_name(function)


def registered_functions() -> dict[str, Any]:
    """Functions the bridge may run: explicit registrations over those exported here, over
    ortpass's own (:data:`ortpass.conventions.BUILTIN_FUNCTIONS`: the density flag, which a
    model keeps when the gather pass did not run, and the fused attention), in whatever
    process runs the model."""
    from ortpass.pythonop.export import exported_functions

    return {**_builtin_functions(), **exported_functions(), **_functions}


def _builtin_functions() -> dict[str, Any]:
    """ortpass's own Functions by func_name, imported from ortpass's modules on first use
    (ortpass's code, so no user registration is needed to run a model that names them)."""
    global _builtins
    if _builtins is None:
        _builtins = {}
        for func_name, where in BUILTIN_FUNCTIONS.items():
            module, _, qualname = where.partition(":")
            _builtins[func_name] = getattr(importlib.import_module(module), qualname)
    return _builtins


def pythonop_func_names(model: ir.Model) -> dict[str, str]:
    """``func_name -> name of the first node calling it`` for every PythonOp(Grad) in ``model``."""
    found: dict[str, str] = {}
    for node in all_nodes(model):
        if node.domain != MS_DOMAIN or node.op_type not in _PYTHONOP_TYPES:
            continue
        attr = node.attributes.get("func_name")
        func_name = attr.as_string() if attr is not None else ""
        found.setdefault(func_name, node.name or f"<unnamed {node.op_type}>")
    return found


def all_nodes(model: ir.Model) -> Iterable[ir.Node]:
    yield from model.graph.all_nodes()
    for function in model.functions.values():
        yield from function.all_nodes()
