"""Pass options checked against the types their constructors declare.

A pass declares its options once, in its ``__init__`` annotations; :func:`check_options`
reads them with :func:`typing.get_type_hints` and refuses a value of the wrong type before
any pass runs.  Ranges are declared in the annotation too: ``Literal[0, 1, 2]`` for a
closed set, ``Annotated[int, AtLeast(0)]`` for a bound (the aliases below).

The checks are strict where Python is loose, because a pipeline string is typed by a person:
``True`` is not an int (``level=True`` would mean level 1), ``'no'`` is not a bool (it is
truthy), and a str is not a list of names (``params='fc1.weight'`` would be read letter by
letter).  An int is accepted where a float is declared.  An annotation this module cannot
judge (a class no literal can be, an unresolvable name) lets the value through to the
constructor, which decides.

The same annotations describe the options to a person (:func:`describe_options`, what
``ortpass list-passes`` prints): ``level: 0|1|2 = 0``, ``min_elements: int>=0|None = None``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import inspect
import logging
import types
import typing
from typing import Annotated, Any, Literal, Mapping

from ortpass.errors import PipelineSpecError, elide

__all__ = [
    "AtLeast",
    "NonNegativeInt",
    "OptionInfo",
    "ProbeLevelOption",
    "RecomputeLevel",
    "check_options",
    "describe_options",
    "option_types",
    "type_text",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AtLeast:
    """An ``Annotated`` bound: the value must be >= ``minimum``."""

    minimum: int | float

    def check(self, value: Any) -> str | None:
        return None if value >= self.minimum else f"must be at least {self.minimum}"


NonNegativeInt = Annotated[int, AtLeast(0)]
#: ORT's recompute probe levels: 0 basic ops, 1 advanced (see ortpass.analysis.recomputable_ops.ProbeLevel).
ProbeLevelOption = Literal[0, 1]
#: ORTModule's recompute levels: 0 only the plans given, 1 layer-wise, 2 every detected plan.
RecomputeLevel = Literal[0, 1, 2]

_UNJUDGED = object()  # an annotation this module cannot judge


def option_types(cls: type) -> dict[str, Any]:
    """The declared type of each keyword option of pass class ``cls`` ({} if unreadable)."""
    init = cls.__init__
    try:
        hints = typing.get_type_hints(init, include_extras=True)
    except Exception as exc:  # noqa: BLE001 - an unresolvable annotation: leave it to the constructor
        logger.debug("cannot read the option types of %s: %s", cls.__qualname__, exc)
        return {}
    hints.pop("return", None)
    return hints


def check_options(cls: type, options: Mapping[str, Any], where: str) -> None:
    """Refuse an option of ``cls`` whose value does not fit its declared type or range.

    ``where``: names the pass for the message, e.g. ``"pass 'recompute' (position 0)"``.
    """
    declared = option_types(cls)
    for key, value in options.items():
        if key not in declared:
            continue
        problem = _mismatch(value, declared[key])
        if problem is not None:
            hint = ""
            if isinstance(value, str) and _accepts_list(declared[key]):
                hint = f"; for one name write {key}=[{value!r}]"
            raise PipelineSpecError(
                f"{where}: option {key!r} {problem}, not {elide(repr(value))} ({type(value).__name__}){hint}"
            )


def _mismatch(value: Any, annotation: Any) -> str | None:
    """None if ``value`` fits ``annotation``, else what it must be ("must be bool")."""
    verdict = _fits(value, annotation)
    if verdict is True or verdict is _UNJUDGED:
        return None
    if isinstance(verdict, str):
        return verdict
    return f"must be {_describe(annotation)}"


def _fits(value: Any, annotation: Any) -> bool | str | object:
    """True, False, a str saying which bound failed, or _UNJUDGED."""
    if annotation is Any or annotation is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Annotated:
        base = _fits(value, args[0])
        if base is not True:
            return base
        for bound in args[1:]:
            if isinstance(bound, AtLeast):
                problem = bound.check(value)
                if problem is not None:
                    return problem
        return True
    if origin in (typing.Union, types.UnionType):
        verdicts = [_fits(value, member) for member in args]
        if True in verdicts:
            return True
        if any(v is _UNJUDGED for v in verdicts):
            return _UNJUDGED
        return next((v for v in verdicts if isinstance(v, str)), False)
    if origin is Literal:
        return any(value == choice and type(value) is type(choice) for choice in args)
    if annotation is type(None) or annotation is None:
        return value is None
    if annotation is bool:
        return type(value) is bool
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if _is_sequence(origin):
        if not isinstance(value, (list, tuple)):
            return False
        item = args[0] if args else Any
        verdicts = [_fits(v, item) for v in value]
        return _UNJUDGED if any(v is _UNJUDGED for v in verdicts) else all(v is True for v in verdicts)
    if isinstance(annotation, type):
        # A class a pipeline literal cannot be (PlanSpec, os.PathLike): only its instances fit.
        return isinstance(value, annotation)
    return _UNJUDGED


def _is_sequence(origin: Any) -> bool:
    return origin in (list, tuple, collections.abc.Sequence, collections.abc.Iterable, collections.abc.Collection)


def _accepts_list(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, Annotated):
        return any(_accepts_list(a) for a in typing.get_args(annotation))
    return _is_sequence(origin)


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Annotated:
        return _describe(args[0])
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        text = " or ".join(_describe(a) for a in members)
        return f"{text} or None" if len(members) < len(args) else text
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if _is_sequence(origin):
        return f"a list of {_describe(args[0]) if args else 'values'}"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


@dataclasses.dataclass(frozen=True)
class OptionInfo:
    """One option of a pass as a person reads it: ``name: type = default``."""

    name: str
    type: str  # as type_text writes it; "any" where nothing is declared
    default: str | None  # as a pipeline literal; None: the option must be given

    def __str__(self) -> str:
        return f"{self.name}: {self.type}" + ("" if self.default is None else f" = {self.default}")


def describe_options(cls: type) -> list[OptionInfo]:
    """The keyword options of pass class ``cls``, in declaration order, with the types its
    ``__init__`` declares and its defaults ([] for a constructor inspect cannot read)."""
    try:
        parameters = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return []
    declared = option_types(cls)
    options = []
    for p in parameters:
        if p.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            continue
        annotation = declared.get(p.name, p.annotation)
        default = None if p.default is inspect.Parameter.empty else _literal(p.default)
        options.append(OptionInfo(p.name, type_text(annotation), default))
    return options


def _literal(value: Any) -> str:
    """A default as it would be written in a pipeline (an enum member as its value)."""
    if isinstance(value, enum.Enum):
        value = value.value
    return repr(value)


def type_text(annotation: Any) -> str:
    """A declared option type in few characters: ``0|1|2``, ``int>=0``, ``list[str]``,
    ``str|None``; an annotation left as text (unresolvable) is printed as written."""
    if annotation is Any or annotation is inspect.Parameter.empty:
        return "any"
    if isinstance(annotation, str):
        return annotation
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Annotated:
        bounds = [f">={b.minimum}" for b in args[1:] if isinstance(b, AtLeast)]
        return type_text(args[0]) + "".join(bounds)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        text = "|".join(type_text(a) for a in members)
        return f"{text}|None" if len(members) < len(args) else text
    if origin is Literal:
        return "|".join(repr(a) for a in args)
    if _is_sequence(origin):
        return f"list[{type_text(args[0]) if args else 'any'}]"
    if annotation is type(None) or annotation is None:
        return "None"
    return getattr(annotation, "__name__", str(annotation))
