"""The input schema of a call and the one place that decides graph transitions.

Arguments are bound to ``forward``'s parameter names and flattened with torch's pytree;
the schema (tensor dtypes, ranks and which require grad, the values of non-tensor
leaves, the nesting, the trainable parameters, every submodule's ``training`` flag, and
whether the call is differentiated) decides the graph.  Among the graphs built for one
schema, a call runs the first whose pinned dims (:mod:`ortpass.runtime.module.dims`)
have the call's sizes.  :class:`GraphTransitionManager` says, in the log, why it
exports, loads or switches.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ortpass.errors import OrtpassError
from ortpass.runtime.module.dims import PinnedDims

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
    training: tuple[str, ...]  # the modules in training mode ("" is the module itself)
    differentiable: bool  # grad enabled, and a trainable parameter or an input requires grad
    # (name, dtype and shape) of every parameter and buffer: a graph holds their shapes, and
    # resize_token_embeddings or model.half() needs another
    state: tuple[tuple[str, str], ...] = ()

    def difference(self, previous: InputSchema | None) -> str:
        """Why a graph built for ``previous`` does not serve this schema, in words (every
        difference, joined by ``; ``)."""
        if previous is None:
            return "first call"
        reasons = []
        if self.differentiable != previous.differentiable:
            reasons.append(
                "gradients " + ("needed" if self.differentiable else "not needed (no_grad, or nothing requires grad)")
            )
        if self.training != previous.training:
            to_train = sorted(set(self.training) - set(previous.training))
            to_eval = sorted(set(previous.training) - set(self.training))
            reasons.append(f"modes changed: now training {_modules(to_train)}, now eval {_modules(to_eval)}")
        if self.trainable != previous.trainable:
            added = sorted(set(self.trainable) - set(previous.trainable))
            removed = sorted(set(previous.trainable) - set(self.trainable))
            reasons.append(f"trainable parameters changed: +{added} -{removed}")
        if self.state != previous.state:
            before = dict(previous.state)
            changed = [f"{name} {before.get(name, 'absent')} -> {now}" for name, now in self.state if before.get(name) != now]
            reasons.append(f"parameter or buffer shapes or dtypes changed: {', '.join(changed[:3])}" + (
                f" and {len(changed) - 3} more" if len(changed) > 3 else ""))
        old, new = {p: (k, d) for p, k, d in previous.leaves}, {p: (k, d) for p, k, d in self.leaves}
        if set(new) - set(old) or set(old) - set(new):
            reasons.append(f"arguments changed: new {sorted(set(new) - set(old))}, gone {sorted(set(old) - set(new))}")
        else:
            reasons.extend(
                f"argument {path} changed: {old[path][0]} {old[path][1]} -> {kind} {detail}"
                for path, (kind, detail) in new.items()
                if old[path] != (kind, detail)
            )
        return "; ".join(reasons) or "argument structure changed"


def _modules(paths: list[str]) -> str:
    shown = ["the module" if not p else p for p in paths[:4]]
    return "[" + ", ".join(shown) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "") + "]"


def describe_tensor(t: torch.Tensor) -> str:
    grad = ", requires grad" if t.requires_grad else ""
    return f"{str(t.dtype).removeprefix('torch.')}[rank {t.dim()}{grad}]"


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
        if not isinstance(leaf, (torch.Tensor, *_CONSTANT_TYPES)):
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
    training = tuple(name for name, m in module.named_modules() if m.training)
    wants_grad = bool(trainable) or any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for _, leaf in leaves)
    state = tuple(
        (name, f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
        for name, t in (*module.named_parameters(), *module.named_buffers())
    )
    return InputSchema(str(spec), described, trainable, training, torch.is_grad_enabled() and wants_grad, state)


# -- transitions ------------------------------------------------------------------------------


class GraphTransitionManager:
    """Decides, in one place, whether a call runs the current graph, one built before, or
    a new export; logs every transition with its reason.

    Graphs are kept per schema, each with the dims it is pinned in
    (:class:`~ortpass.runtime.module.dims.PinnedDims`); a call runs the first graph of
    its schema that accepts its sizes.
    """

    def __init__(self) -> None:
        self._graphs: dict[InputSchema, list[tuple[PinnedDims, Any]]] = {}
        # The schema, dims and graph the last call ran: two graphs of one schema can share
        # their dims (a memory budget planned again at a larger batch).
        self.current: tuple[InputSchema, PinnedDims, Any] | None = None
        self.transitions: list[tuple[str, str]] = []  # (action, reason): "export"/"load"/"switch"/"fallback"

    def graph_for(
        self,
        schema: InputSchema,
        tensors: list[torch.Tensor],
        names: list[str],
        build: Callable[[InputSchema], tuple[Any, str, PinnedDims]],
        fits: Callable[[Any, list[torch.Tensor]], bool] | None = None,
    ) -> Any:
        """The graph a call with ``tensors`` runs: the first built for ``schema`` that
        accepts their sizes (and, given ``fits``, that ``fits`` them: a memory budget),
        else a new one from ``build``."""
        built = self._graphs.setdefault(schema, [])
        over_budget = False
        for pinned, graph in built:
            if pinned.accepts(tensors):
                if fits is not None and not fits(graph, tensors):
                    over_budget = True
                    continue
                if self.current is None or self.current[2] is not graph:
                    self.record("switch", f"back to a graph built before: {self._reason(schema, tensors, names)}")
                    self.current = (schema, pinned, graph)
                return graph
        reason = (
            "the graphs built for these inputs would go over the memory budget at these sizes"
            if over_budget
            else self._reason(schema, tensors, names)
        )
        graph, action, pinned = build(schema)
        built.append((pinned, graph))
        self.current = (schema, pinned, graph)
        self.record(action, reason)
        return graph

    def _reason(self, schema: InputSchema, tensors: list[torch.Tensor], names: list[str]) -> str:
        if self.current is None or self.current[0] != schema:
            return schema.difference(self.current[0] if self.current else None)
        return self.current[1].difference(tensors, names)

    @property
    def current_graph(self) -> Any:
        """The graph the last call ran (None before the first)."""
        return None if self.current is None else self.current[2]

    def clear(self) -> None:
        """Forget every graph (their sessions go with them)."""
        self._graphs.clear()
        self.current = None

    def record(self, action: str, reason: str) -> None:
        """Log a transition (``export``, ``load``, ``switch``, ``fallback``) with its reason."""
        self.transitions.append((action, reason))
        logger.info("ORTModule graph %s: %s", action, reason)
