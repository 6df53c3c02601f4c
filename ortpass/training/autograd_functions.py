"""``torch.autograd.Function`` calls taken into the torch builder's joint graph, forward and
backward, as torch traces them.

``torch.export`` (torch 2.14, strict or not) inlines a Function's forward and drops its
backward: the joint trace would differentiate the forward's ops, a silently wrong gradient
wherever the Function's backward is not the forward's own derivative (BLOOM's
``GeLUFunction``, a clipped or reversed gradient).  The rule here: while the builder
traces, every ``Function.apply`` becomes one node of the op ``ortpass_function::apply``
(its tensors, and the number of the call, which keeps everything else), so
``torch.export`` keeps the call whole.  The op's autograd kernel applies the Function
itself; the joint trace (AOTAutograd) runs that kernel, so the Function's forward is traced
into the forward and, when the trace differentiates, its own ``backward`` into the
backward, each as the torch code it is.  The op leaves no node of its own in the joint
graph.

A Function whose forward or backward torch cannot trace (a custom kernel, numpy, a branch
on a tensor's value) is built again as opaque (:func:`retrying_untraceable`): its calls
become Python ops that run it in eager torch (:mod:`ortpass.training.python_ops`), which
stock onnxruntime runs through ``onnxruntime-extensions``.  Without that package, or for a
Function a Python op cannot carry either, the build fails with
:class:`~ortpass.errors.TrainingGraphError` naming the Function and the side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

from ortpass.errors import TrainingGraphError
from ortpass.training import python_ops

logger = logging.getLogger(__name__)

__all__ = ["FunctionCalls", "functions_taken_into_the_graph", "retrying_untraceable"]

_NAMESPACE = "ortpass_function"
_Function = torch.autograd.Function
_ORIGINAL_APPLY = _Function.__dict__["apply"]  # a classmethod descriptor (C in torch >= 2.10)
_TENSOR = object()  # a template's placeholder for a tensor the op carries


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    return _ORIGINAL_APPLY.__get__(None, cls)(*args, **kwargs)


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclasses.dataclass
class _Call:
    """One ``Function.apply`` call as traced: what the op's tensors go back into."""

    function: type
    template: list[Any]  # the flat arguments, _TENSOR where the op carries a tensor
    spec: Any  # pytree spec of (args, kwargs)
    as_tuple: bool = True  # whether the Function returned a tuple (known once it ran)

    def arguments(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
        feed = iter(tensors)
        leaves = [next(feed) if leaf is _TENSOR else leaf for leaf in self.template]
        return pytree.tree_unflatten(leaves, self.spec)


@dataclasses.dataclass
class FunctionCalls:
    """The Functions one build took into its graph, and the first that torch could not trace."""

    applied: list[str] = dataclasses.field(default_factory=list)
    failed: tuple[str, str, BaseException] | None = None  # (Function, "forward"/"backward"/"opaque", error)
    numbers: list[int] = dataclasses.field(default_factory=list)
    # Functions run as Python ops, each with why: (the side torch could not trace, its error).
    opaque: Mapping[type, tuple[str, BaseException]] = dataclasses.field(default_factory=dict)
    forward_only: bool = False  # a graph without backward: Functions inlined, the opaque ones keep no ctx
    failed_class: type | None = None

    def refuse_untraceable(self, shown: str) -> None:
        """Raise naming the Function whose trace failed, if one did."""
        if self.failed is None:
            return
        name, side, exc = self.failed
        cause, why = exc, ""
        if side == "opaque":  # it failed as a Python op too
            side, cause = self.opaque[self.failed_class]
            why = f" It would run as a Python op, but: {exc}."
        elif not python_ops.extensions_available():
            why = " On stock onnxruntime, pip install onnxruntime-extensions to run it as a Python op."
        raise TrainingGraphError(
            f"{shown} applies torch.autograd.Function {name}, whose {side} torch cannot trace "
            f"({type(cause).__name__}: {_first_line(cause)}): a custom kernel, numpy, or a branch on a tensor's value "
            f"runs outside torch's ops. The torch builder takes a Function into the graph as torch traces it.{why} "
            "ORT's builder (onnxruntime-training) runs it as a PythonOp, or use ORTModule(fallback='torch')"
        ) from exc


_calls: dict[int, _Call] = {}
_numbers = itertools.count()
_local = threading.local()  # .build: the FunctionCalls of the build tracing in this thread


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


def _note_failure(cls: type, side: str, exc: BaseException) -> None:
    build = getattr(_local, "build", None)
    if build is not None and build.failed is None:
        build.failed = (qualified(cls), side, exc)
        build.failed_class = cls


@functools.cache
def _library() -> torch.library.Library:
    library = torch.library.Library(_NAMESPACE, "FRAGMENT")
    library.define("apply(Tensor[] tensors, int call) -> Tensor[]")
    # Autograd: the Function applied as it is, so a trace that differentiates meets its backward.
    library.impl("apply", _run, "Autograd")
    torch.library.register_fake(f"{_NAMESPACE}::apply", _fake, lib=library)
    return library


def _run(tensors: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    entry = _calls[call]
    args, kwargs = entry.arguments(list(tensors))
    try:
        output = _apply(_with_backward_noted(entry.function), *args, **kwargs)
    except Exception as exc:
        _note_failure(entry.function, "forward", exc)
        raise
    entry.as_tuple = isinstance(output, tuple)
    outputs = list(output) if entry.as_tuple else [output]
    wrong = [type(o).__name__ for o in outputs if not isinstance(o, torch.Tensor)]
    if wrong:
        exc = TypeError(f"it returns {wrong[0]} among its outputs; the torch builder takes Functions that return tensors")
        _note_failure(entry.function, "forward", exc)
        raise exc
    return outputs


def _fake(tensors: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    with torch.no_grad():
        return [o.clone() for o in _run(tensors, call)]


@functools.cache
def _with_backward_noted(cls: type) -> type:
    """A subclass of ``cls`` whose backward notes a failure as the Function's own."""
    method = "vjp" if cls.vjp is not _Function.vjp and cls.backward is _Function.backward else "backward"
    original = getattr(cls, method)

    def noted(ctx: Any, *grads: Any) -> Any:
        try:
            return original(ctx, *grads)
        except Exception as exc:
            _note_failure(cls, "backward", exc)
            raise

    attributes = {method: staticmethod(noted), "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    return type(cls.__name__, (cls,), attributes)


def _routed_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    build = getattr(_local, "build", None)
    if build is None or getattr(_local, "inside", False):
        return _apply(cls, *args, **kwargs)
    build.applied.append(qualified(cls))
    if cls in build.opaque:
        try:
            return python_ops.opaque_apply(cls, args, kwargs, keep_context=not build.forward_only)
        except python_ops.OpaqueFunctionError as exc:
            _note_failure(cls, "opaque", exc)
            raise
    if build.forward_only:  # inlined, as torch.export traces it; a failure names the Function
        try:
            return _apply(cls, *args, **kwargs)
        except Exception as exc:
            _note_failure(cls, "forward", exc)
            raise
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if not tensors:  # nothing to differentiate: its forward is the whole story
        return _apply(cls, *args, **kwargs)
    number = next(_numbers)
    _calls[number] = _Call(cls, [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)
    build.numbers.append(number)
    _library()
    _local.inside = True  # a Function applied inside another one's forward is traced with it
    try:
        outputs = torch.ops.ortpass_function.apply(tensors, number)
    finally:
        _local.inside = False
    return tuple(outputs) if _calls[number].as_tuple else outputs[0]


@contextlib.contextmanager
def functions_taken_into_the_graph(
    opaque: Mapping[type, tuple[str, BaseException]] | None = None, forward_only: bool = False
) -> Iterator[FunctionCalls]:
    """One build's scope: the Function calls routed while it is open (``Function.apply``
    is routed only inside :func:`routing`, around ``torch.export``) are kept until it
    closes, for the joint trace to run: the program torch.export returns names each call
    by its number."""
    build = FunctionCalls(opaque=opaque or {}, forward_only=forward_only)
    previous = getattr(_local, "build", None)
    _local.build = build
    try:
        yield build
    finally:
        _local.build = previous
        for number in build.numbers:
            _calls.pop(number, None)


@contextlib.contextmanager
def routing() -> Iterator[None]:
    """While open (``torch.export``'s trace), ``Function.apply`` goes through the op."""
    _Function.apply = classmethod(_routed_apply)
    try:
        yield
    finally:
        _Function.apply = _ORIGINAL_APPLY


_Built = TypeVar("_Built")


def retrying_untraceable(build: Callable[[FunctionCalls], _Built], *, forward_only: bool = False) -> _Built:
    """``build(functions)`` inside :func:`functions_taken_into_the_graph`, again with each
    Function whose trace failed made opaque (a Python op), while onnxruntime-extensions is
    there to run it; one that fails as opaque too, or without it, raises as it did."""
    opaque: dict[type, tuple[str, BaseException]] = {}
    while True:
        with functions_taken_into_the_graph(dict(opaque), forward_only) as functions:
            try:
                return build(functions)
            except TrainingGraphError:
                cls, failed = functions.failed_class, functions.failed
                if cls is None or failed is None or cls in opaque or not python_ops.extensions_available():
                    raise
        logger.info("torch.autograd.Function %s: torch cannot trace its %s, it runs as a Python op", qualified(cls), failed[1])
        opaque[cls] = (failed[1], failed[2])
