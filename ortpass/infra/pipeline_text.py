"""Pipelines written as text, MLIR style: ``pipeline("a,b(opt=1,name='x'),c")``.

:func:`parse_pipeline` reads the text into :class:`PassSpec` records (a clear
:class:`~ortpass.errors.PipelineSpecError` with the position on bad text);
:func:`pipeline` builds the passes, checks their options, and returns a
:class:`~ortpass.infra.manager.PassManager`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from typing import Any

import onnx_ir as ir

from ortpass.errors import (
    OrtpassError,
    PipelineSpecError,
    elide,
)
from ortpass.infra.manager import PassManager
from ortpass.infra.options import check_options
from ortpass.infra.registry import get_pass

_PASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_OPTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SCALARS = (bool, int, float, str, type(None))
_CLOSING = {"(": ")", "[": "]", "{": "}"}

__all__ = ["PassSpec", "parse_pipeline", "passes_from_text", "passes_of_phase", "pipeline", "without_passes"]


@dataclasses.dataclass(frozen=True)
class PassSpec:
    """One pass of a parsed pipeline: its name, options, and where it starts in the text."""

    name: str
    options: dict[str, Any]
    position: int


class _PipelineParser:
    """Recursive descent over ``name[(key=value, ...)](, name[(...)])*``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, message: str, pos: int | None = None) -> PipelineSpecError:
        where = self.pos if pos is None else pos
        return PipelineSpecError(f"pipeline {_quote_around(self.text, where)}, position {where}: {message}")

    def peek(self) -> str:
        self.skip_space()
        return self.text[self.pos : self.pos + 1]

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def found(self) -> str:
        return repr(self.text[self.pos]) if self.pos < len(self.text) else "the end of the text"

    def match(self, pattern: re.Pattern[str], what: str) -> str:
        self.skip_space()
        m = pattern.match(self.text, self.pos)
        if m is None:
            raise self.error(f"expected {what}, found {self.found()}")
        self.pos = m.end()
        return m.group()

    def parse(self) -> list[PassSpec]:
        if not self.peek():
            raise self.error("the pipeline is empty; name at least one pass")
        specs = [self.parse_pass()]
        while self.peek() == ",":
            self.pos += 1
            specs.append(self.parse_pass())
        if self.peek():
            raise self.error(f"expected ',' between passes, found {self.found()}")
        return specs

    def parse_pass(self) -> PassSpec:
        self.skip_space()
        start = self.pos
        name = self.match(_PASS_NAME, "a pass name")
        options: dict[str, Any] = {}
        if self.peek() == "(":
            self.pos += 1
            if self.peek() == ")":
                self.pos += 1
            else:
                self.parse_options(name, options)
        return PassSpec(name, options, start)

    def parse_options(self, pass_name: str, options: dict[str, Any]) -> None:
        while True:
            self.skip_space()
            key_pos = self.pos
            key = self.match(_OPTION_NAME, f"an option name in pass {pass_name!r}")
            if key in options:
                raise self.error(f"option {key!r} of pass {pass_name!r} is given twice", key_pos)
            if self.peek() != "=":
                raise self.error(f"expected '=' after option {key!r} of pass {pass_name!r}, found {self.found()}")
            self.pos += 1
            options[key] = self.parse_value(pass_name, key)
            nxt = self.peek()
            if nxt not in (",", ")"):
                raise self.error(f"expected ',' or ')' after option {key!r} of pass {pass_name!r}, found {self.found()}")
            self.pos += 1
            if nxt == ")":
                return

    def parse_value(self, pass_name: str, key: str) -> Any:
        self.skip_space()
        start = self.pos
        end = self.value_end(start)
        raw = self.text[start:end].strip()
        if not raw:
            raise self.error(f"option {key!r} of pass {pass_name!r} has no value", start)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise self.error(
                f"option {key!r} of pass {pass_name!r}: {elide(repr(raw))} is not a literal (int, float, True/False, "
                "None, a quoted string, or a [list] of those; quote strings: name='x')",
                start,
            ) from None
        if not _is_option_value(value):
            raise self.error(
                f"option {key!r} of pass {pass_name!r}: {elide(repr(raw))} is a {type(value).__name__}; options take "
                "int, float, bool, None, str, or a list of those",
                start,
            )
        self.pos = end
        return value

    def value_end(self, start: int) -> int:
        """Index where the value starting at ``start`` ends: a ',' or ')' outside quotes and brackets."""
        stack: list[str] = []
        i = start
        while i < len(self.text):
            ch = self.text[i]
            if ch in "'\"":
                i = self.string_end(i)
                continue
            if ch in _CLOSING:
                stack.append(_CLOSING[ch])
            elif stack and ch == stack[-1]:
                stack.pop()
            elif not stack and ch in ",)":
                return i
            i += 1
        if stack:
            raise self.error(f"unbalanced brackets: {stack[-1]!r} expected before the end of the text", start)
        raise self.error("the options are not closed: expected ')' before the end of the text", start)

    def string_end(self, quote_pos: int) -> int:
        quote = self.text[quote_pos]
        i = quote_pos + 1
        while i < len(self.text):
            if self.text[i] == "\\":
                i += 2
                continue
            if self.text[i] == quote:
                return i + 1
            i += 1
        raise self.error(f"unterminated string starting with {quote}", quote_pos)


def _quote_around(text: str, position: int) -> str:
    """``text`` quoted for an error at ``position``: whole if short, else the part around
    the position (a megabyte pipeline must not become a megabyte message)."""
    if len(text) <= 200:
        return repr(text)
    start, end = max(position - 60, 0), min(position + 60, len(text))
    return f"of {len(text)} characters, near {'...' if start else ''}{text[start:end]!r}{'...' if end < len(text) else ''}"


def _is_option_value(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, _SCALARS) for v in value)
    return isinstance(value, _SCALARS)


def parse_pipeline(spec: str) -> list[PassSpec]:
    """Parse pipeline text into pass names and options, without looking the names up."""
    if not isinstance(spec, str):
        raise TypeError(f"a pipeline spec is a str, got {type(spec).__name__}")
    return _PipelineParser(spec).parse()


def _check_options(cls: type, spec: PassSpec) -> None:
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no introspectable constructor: let the call decide
        return
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    for key in spec.options:
        if key not in accepted:
            raise PipelineSpecError(
                f"pass {spec.name!r} (position {spec.position}) has no option {key!r}; "
                f"its options: {', '.join(accepted) or 'none'}"
            )
    check_options(cls, spec.options, f"pass {spec.name!r} (position {spec.position})")


def _construct(spec: PassSpec) -> ir.passes.PassBase:
    try:
        cls = get_pass(spec.name)
    except PipelineSpecError as exc:
        raise PipelineSpecError(f"position {spec.position}: {exc}") from exc
    _check_options(cls, spec)
    try:
        return cls(**spec.options)
    except (TypeError, ValueError, OrtpassError) as exc:  # e.g. a PlanError from recompute(plans=...)
        raise PipelineSpecError(
            f"pass {spec.name!r} (position {spec.position}) rejected its options {elide(repr(spec.options))}: "
            f"{type(exc).__name__}: {elide(str(exc), 400)}"
        ) from exc


def passes_from_text(spec: str) -> list[ir.passes.PassBase]:
    """The passes ``spec`` names, built with their options checked, in the order written
    (no manager: the caller orders them, e.g. once it knows what the input model is)."""
    return [_construct(s) for s in parse_pipeline(spec)]


def passes_of_phase(spec: str, phase: str) -> str:
    """The text of ``spec``'s passes whose ``phase`` is ``phase``, in the order written
    (e.g. the post-grad part of a pipeline, for a training graph built another way)."""
    return ",".join(text for s, text in _pass_texts(spec) if getattr(get_pass(s.name), "phase", "any") == phase)


def _pass_texts(spec: str) -> list[tuple[PassSpec, str]]:
    """Each pass of ``spec`` with its text as written (options included)."""
    specs = parse_pipeline(spec)
    ends = [s.position for s in specs[1:]] + [len(spec)]
    return [(s, spec[s.position : end].strip().rstrip(",").rstrip()) for s, end in zip(specs, ends)]


def without_passes(spec: str, names: set[str] | frozenset[str]) -> str:
    """The text of ``spec`` without the passes named in ``names``, the others as written."""
    return ",".join(text for s, text in _pass_texts(spec) if s.name not in names)


def pipeline(spec: str, **manager_kwargs: Any) -> PassManager:
    """Build a :class:`PassManager` from text such as ``"a,b(opt=1,name='x'),c"``.

    Pass names are looked up with :func:`ortpass.infra.registry.get_pass`; option values are
    Python literals (int, float, True/False, None, quoted strings, and [lists] of those)
    checked against the pass constructor.  ``manager_kwargs`` go to PassManager.
    Raises PipelineSpecError naming the pass, option or text position that is wrong.
    """
    return PassManager(passes_from_text(spec), **manager_kwargs)


#: The options that say which recompute plans to apply: a memory budget replaces them.
_PLAN_OPTIONS = ("plans", "level", "config_file")


def with_memory_budget(spec: str, budget: Any) -> str:
    """``spec`` with its ``recompute`` and ``fix-dropout-seed`` passes choosing their plans
    by the memory ``budget`` (``budget=`` in place of ``plans``, ``level`` and
    ``config_file``; their other options kept).  A ``fix-dropout-seed`` with recompute's
    options is added before a ``recompute`` that has none, since both must choose the same
    subgraphs.  A ``chunk-lm-head-loss`` without a ``chunk`` chooses its slices' width by the
    budget too.  A pipeline without ``recompute`` is refused: nothing in it could spend the
    budget."""
    specs = parse_pipeline(spec)
    if not any(s.name == "recompute" for s in specs):
        raise PipelineSpecError(f"a memory budget needs a recompute pass in the pipeline, and {_quote_around(spec, 0)} has none")
    seeded = any(s.name == "fix-dropout-seed" for s in specs)
    parts = []
    for s, written in _pass_texts(spec):
        if s.name == "chunk-lm-head-loss" and "chunk" not in s.options:
            options = {**s.options, "budget": budget}  # its width too, unless given; logits_last kept
            parts.append("chunk-lm-head-loss(" + ",".join(f"{k}={v!r}" for k, v in options.items()) + ")")
            continue
        if s.name not in ("recompute", "fix-dropout-seed"):
            parts.append(written)
            continue
        options = {k: v for k, v in s.options.items() if k not in _PLAN_OPTIONS}
        options["budget"] = budget
        text = ",".join(f"{k}={v!r}" for k, v in options.items())
        if s.name == "recompute" and not seeded:
            parts.append(f"fix-dropout-seed({text})")  # the same selection options
        parts.append(f"{s.name}({text})")
    return ",".join(parts)
