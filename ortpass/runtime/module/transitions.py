"""The input schema of a call and the one place that decides graph transitions.

Arguments are bound to ``forward``'s parameter names and flattened with torch's pytree;
the schema (tensor dtypes and ranks, the values of non-tensor leaves, the nesting, the
trainable parameters, ``training``) decides the graph, and :class:`GraphTransitionManager`
says, in the log, why it exports, loads or switches.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ortpass.errors import OrtpassError

__all__ = ["GraphTransitionManager", "InputSchema", "bind_arguments", "flatten_arguments", "input_schema"]

logger = logging.getLogger(__name__)

#: Python values the exporter bakes into the graph as constants (part of the schema).
_CONSTANT_TYPES = (bool, int, float, str, type(None))


# -- the input schema -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InputSchema:
    """What decides the graph: two calls with equal schemas run the same graph."""

    structure: str  # the pytree spec of the bound arguments
    leaves: tuple[tuple[str, str, str], ...]  # (argument path, "tensor"/"constant", dtype+rank or repr)
    trainable: tuple[str, ...]
    training: bool

    def difference(self, previous: InputSchema | None) -> str:
        """Why a graph built for ``previous`` does not serve this schema, in words."""
        if previous is None:
            return "first call"
        if self.training != previous.training:
            return f"training changed {previous.training} -> {self.training} ({'train' if self.training else 'eval'} graph)"
        if self.trainable != previous.trainable:
            added = sorted(set(self.trainable) - set(previous.trainable))
            removed = sorted(set(previous.trainable) - set(self.trainable))
            return f"trainable parameters changed: +{added} -{removed}"
        old, new = {p: (k, d) for p, k, d in previous.leaves}, {p: (k, d) for p, k, d in self.leaves}
        if set(new) - set(old) or set(old) - set(new):
            return f"arguments changed: new {sorted(set(new) - set(old))}, gone {sorted(set(old) - set(new))}"
        for path, (kind, detail) in new.items():
            if old[path] != (kind, detail):
                return f"argument {path} changed: {old[path][0]} {old[path][1]} -> {kind} {detail}"
        return "argument structure changed"


def describe_tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}[rank {t.dim()}]"


def path_name(path: tuple) -> str:
    """``extra['bias']`` for the arguments' paths (the first key is a parameter name)."""
    if path and isinstance(path[0], pytree.MappingKey):
        return f"{path[0].key}{pytree.keystr(path[1:])}"
    return pytree.keystr(path).lstrip(".")


def bind_arguments(module: torch.nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """The call's arguments by parameter name of ``module.forward``."""
    try:
        return inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise OrtpassError(f"{type(module).__name__}.forward does not take these arguments: {exc}") from exc


def flatten_arguments(module: torch.nn.Module, bound: inspect.BoundArguments) -> tuple[list[tuple[str, Any]], Any]:
    """(argument path, leaf) pairs and the pytree spec; refuses leaves the exporter cannot see."""
    with_paths, spec = pytree.tree_flatten_with_path(dict(bound.arguments))
    leaves = []
    for path, leaf in with_paths:
        name = path_name(path)
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                raise OrtpassError(
                    f"argument {name} of {type(module).__name__} requires grad: ORTModule computes gradients "
                    "for the module's parameters only; pass it detached"
                )
        elif not isinstance(leaf, _CONSTANT_TYPES):
            raise OrtpassError(
                f"argument {name} of {type(module).__name__} is a {type(leaf).__name__}, which the ONNX exporter "
                "cannot see: pass tensors, Python scalars, strings or None, nested in tuples, lists and dicts"
            )
        leaves.append((name, leaf))
    return leaves, spec


def input_schema(module: torch.nn.Module, leaves: list[tuple[str, Any]], spec: Any) -> InputSchema:
    described = tuple(
        (name, "tensor", describe_tensor(leaf)) if isinstance(leaf, torch.Tensor) else (name, "constant", repr(leaf))
        for name, leaf in leaves
    )
    trainable = tuple(name for name, p in module.named_parameters() if p.requires_grad)
    return InputSchema(str(spec), described, trainable, module.training)


# -- transitions ------------------------------------------------------------------------------


class GraphTransitionManager:
    """Decides, in one place, whether a call runs the current graph, one built before, or
    a new export; logs every transition with its reason."""

    def __init__(self) -> None:
        self._graphs: dict[InputSchema, Any] = {}
        self.current: InputSchema | None = None
        self.transitions: list[tuple[str, str]] = []  # (action, reason): "export"/"load"/"switch"

    def graph_for(self, schema: InputSchema, build: Callable[[InputSchema], tuple[Any, str]]) -> Any:
        if schema == self.current:
            return self._graphs[schema]
        reason = schema.difference(self.current)
        if schema in self._graphs:
            self._record("switch", f"back to a graph built before: {reason}")
        else:
            graph, action = build(schema)
            self._graphs[schema] = graph
            self._record(action, reason)
        self.current = schema
        return self._graphs[schema]

    def _record(self, action: str, reason: str) -> None:
        self.transitions.append((action, reason))
        logger.info("ORTModule graph %s: %s", action, reason)
