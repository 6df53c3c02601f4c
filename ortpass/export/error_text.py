"""Error text from torch, without the values of any tensor.

The rule: an ortpass error never quotes a tensor's values.  torch's own messages sometimes
do: the tracer's "Cannot insert a Tensor that requires grad as a constant" prints the
whole tensor after ``Tensor:`` (a 32000 x 768 embedding is megabytes of text), and
messages built with an f-string quote ``tensor([...])`` reprs.  :func:`without_tensor_values`
replaces each such dump with its shape and type, and cuts what is left to a few lines'
length (:func:`ortpass.errors.elide`), so the message names the problem and stays short.
"""

from __future__ import annotations

import logging
import re

from ortpass.errors import elide

__all__ = ["MAX_CAUSE", "without_tensor_values"]

logger = logging.getLogger(__name__)

#: Longest text of an underlying error an ortpass error quotes (cut in the middle beyond).
MAX_CAUSE = 2000

# The end of a C++ tensor print: ``[ torch.FloatTensor{32,16} ]``, ``[ CPUFloatType{4} ]``.
_CPP_TENSOR_END = re.compile(r"\[ (?:torch\.)?(\w+?)(?:Tensor|Type)\{([\d,]*)\} \]")
# The lines before it: numbers, ``Columns 1 to 10``, ``(1,.,.) =`` slice headers.
_CPP_TENSOR_LINE = re.compile(r"^(?:Columns \d+ to \d+)?[\s\d.eE+\-,:()=naif]*$")
_PY_TENSOR_START = re.compile(r"(?:Parameter containing:\s*)?\b(?:tensor|Parameter)\(")


def without_tensor_values(text: str, limit: int = MAX_CAUSE) -> str:
    """``text`` with every printed tensor replaced by ``<tensor of shape ...>``, then cut to
    about ``limit`` characters."""
    cleaned = _without_python_reprs(_without_cpp_prints(text))
    if cleaned != text:
        logger.debug("left tensor values out of an error message (%d -> %d characters)", len(text), len(cleaned))
    return elide(cleaned, limit)


def _without_cpp_prints(text: str) -> str:
    """Each ``<values>\\n[ torch.FloatTensor{32,16} ]`` as ``<FloatTensor of shape [32, 16]>``."""
    out: list[str] = []
    position = 0
    for match in _CPP_TENSOR_END.finditer(text):
        before = text[position : match.start()]
        lines = before.split("\n")
        while lines and _CPP_TENSOR_LINE.match(lines[-1]):  # the value lines right before the marker
            lines.pop()
        shape = ", ".join(d for d in match.group(2).split(",") if d)
        out.append("\n".join([*lines, f"<{match.group(1)} tensor of shape [{shape}], values left out>"]))
        position = match.end()
    out.append(text[position:])
    return "".join(out)


def _without_python_reprs(text: str) -> str:
    """Each ``tensor([...], dtype=...)`` (or ``Parameter containing: tensor(...)``) as
    ``tensor(<values left out>)``."""
    out: list[str] = []
    position = 0
    while (match := _PY_TENSOR_START.search(text, position)) is not None:
        end = _closing_parenthesis(text, match.end())
        if end is None:  # cut off: the rest is the tensor
            out.append(text[position : match.start()] + "tensor(<values left out>)")
            return "".join(out)
        out.append(text[position : match.start()] + "tensor(<values left out>)")
        position = end + 1
    out.append(text[position:])
    return "".join(out)


def _closing_parenthesis(text: str, start: int) -> int | None:
    depth = 1
    for index in range(start, len(text)):
        if text[index] == "(":
            depth += 1
        elif text[index] == ")":
            depth -= 1
            if depth == 0:
                return index
    return None
