"""Text tables that fit a width: columns padded to their widest cell, long cells wrapped.

Rule: without a width (``width=None``, what ``--wide`` and the Python API print by
default) a table is printed whole, one line per row, each column as wide as its widest
cell.  With a width, the columns that may wrap give up characters, the widest column
first, until every line fits or each is down to its longest word (at least
:data:`MIN_COLUMN`, at most :data:`MAX_WORD` characters; a table that still does not fit
then runs past the width rather than lose text).  A cell is cut after a separator where
it can be -- a space, ``,``, ``;``, ``/``, or a ``+`` or ``-`` joining two words -- so
plan strings and op lists break between ops and pass names between words; a run with
no place to break is cut at the width.  Nothing is abbreviated: every character of the
wide table is still printed, so a plan string can be read whole (``--wide`` prints it on
one line, to copy).

Detail lines (:func:`detail_lines`) are the other way to fit: what does not fit in a row
goes under it, indented, wrapped at the width with a hanging indent.
"""

from __future__ import annotations

import logging
import re
from typing import Collection, Sequence

__all__ = ["MIN_COLUMN", "column_widths", "detail_lines", "fits", "format_table", "render_row", "rule_line", "wrap_line", "wrap_text"]

logger = logging.getLogger(__name__)

#: The narrowest a wrapped column gets (narrower, a cell would be more lines than words).
MIN_COLUMN = 10
#: The longest word a wrapped column keeps whole (a longer one, a value name, is cut).
MAX_WORD = 30
#: Spaces between columns.
GAP = "  "
# Where a cell may break: after a run of spaces, commas, semicolons or slashes, and after a
# "+" or "-" between a word and a letter ("MatMul+|Add+", "shape-|inference"), but not in
# "Reshape+27", "(+17 types" or ":1:-1", where the sign belongs to the number.
_BREAK = re.compile(r"(?<=[ ,;/])(?=[^ ,;/])|(?<=[\w)][+-])(?=[A-Za-z])")


def wrap_text(text: str, width: int) -> list[str]:
    """``text`` cut into lines of at most ``width`` characters, after separators where it
    can be (see the module docstring); one empty line for an empty text."""
    width = max(width, 1)
    if len(text) <= width:
        return [text]
    lines: list[str] = []
    line = ""
    for token in (t for t in _BREAK.split(text) if t):
        if len(line) + len(token.rstrip()) <= width:
            line += token
            continue
        if line.strip():
            lines.append(line.rstrip())
        line = token
        while len(line.rstrip()) > width:  # a run without separators: cut it at the width
            lines.append(line[:width])
            line = line[width:]
    if line.strip() or not lines:
        lines.append(line.rstrip())
    return lines


def _floor(cells: Sequence[str], natural: int) -> int:
    """How narrow a wrapped column gets: its longest word, so that words are not cut (up
    to :data:`MAX_WORD`, a longer word is cut), and at least :data:`MIN_COLUMN`."""
    longest = max((len(t.rstrip()) for cell in cells for t in _BREAK.split(cell)), default=0)
    return min(natural, max(MIN_COLUMN, min(longest, MAX_WORD)))


def _fitted_widths(rows: Sequence[Sequence[str]], natural: list[int], wrap: Collection[int], room: int) -> list[int]:
    """Column widths whose sum fits ``room``, taking from the widest wrappable column first."""
    widths = list(natural)
    floors = [_floor([row[c] for row in rows], w) if c in wrap else w for c, w in enumerate(widths)]
    excess = sum(widths) - room
    while excess > 0:
        shrinkable = [c for c in range(len(widths)) if widths[c] > floors[c]]
        if not shrinkable:
            break  # as narrow as the floors allow: the table runs past the width
        widest = max(shrinkable, key=lambda c: widths[c])
        widths[widest] -= 1
        excess -= 1
    return widths


def column_widths(
    rows: Sequence[Sequence[str]], *, width: int | None = None, wrap: Collection[int] | None = None, indent: str = ""
) -> list[int]:
    """Each column's width: its widest cell, less what fitting ``width`` takes (see the
    module docstring); ``wrap``: the columns that may give up characters (default: all)."""
    columns = len(rows[0])
    natural = [max(len(row[c]) for row in rows) for c in range(columns)]
    if width is None:
        return natural
    room = width - len(indent) - len(GAP) * (columns - 1)
    return _fitted_widths(rows, natural, range(columns) if wrap is None else set(wrap), room)


def render_row(row: Sequence[str], widths: Sequence[int], *, right: Collection[int] = (), indent: str = "") -> list[str]:
    """The lines of one row at ``widths``: one, or more where a cell wraps."""
    cells = [wrap_text(cell, w) if len(cell) > w else [cell] for cell, w in zip(row, widths)]
    lines = []
    for part in range(max(len(c) for c in cells)):
        texts = [c[part] if part < len(c) else "" for c in cells]
        padded = [t.rjust(w) if c in right else t.ljust(w) for c, (t, w) in enumerate(zip(texts, widths))]
        lines.append((indent + GAP.join(padded)).rstrip())
    return lines


def rule_line(widths: Sequence[int], *, indent: str = "") -> str:
    """The dashed line under a header."""
    return indent + GAP.join("-" * w for w in widths)


def format_table(
    rows: Sequence[Sequence[str]],
    *,
    width: int | None = None,
    right: Collection[int] = (),
    wrap: Collection[int] | None = None,
    indent: str = "",
    rule: bool = True,
) -> list[str]:
    """The lines of a table whose first row is the header (a dashed rule under it unless
    ``rule`` is false).

    ``right``: columns aligned right (numbers).  ``wrap``: the columns that may wrap when
    ``width`` is given (default: all).  ``indent`` prefixes every line and counts in the
    width.  Trailing spaces are stripped.
    """
    if not rows:
        return []
    widths = column_widths(rows, width=width, wrap=wrap, indent=indent)
    lines = render_row(rows[0], widths, right=right, indent=indent)
    if rule:
        lines.append(rule_line(widths, indent=indent))
    for row in rows[1:]:
        lines += render_row(row, widths, right=right, indent=indent)
    return lines


def detail_lines(label: str, text: str, *, width: int | None, indent: str = "    ") -> list[str]:
    """``label: text`` under a table row: indented, and wrapped at ``width`` with the
    continuation lines aligned after the label."""
    head = f"{indent}{label}: " if label else indent
    if width is None:
        return [head + text]
    parts = wrap_text(text, max(width - len(head), MIN_COLUMN))
    return [head + parts[0]] + [" " * len(head) + part for part in parts[1:]]


def wrap_line(text: str, width: int | None, *, hang: str = "  ") -> list[str]:
    """A line of prose cut at ``width``, its continuation lines indented by ``hang``."""
    if width is None or len(text) <= width:
        return [text]
    first, *rest = wrap_text(text, width)
    return [first, *(hang + line for line in wrap_text(" ".join(rest), max(width - len(hang), 1)))]


def fits(lines: Sequence[str], width: int | None) -> bool:
    """Whether every line is at most ``width`` characters (always, without a width)."""
    return width is None or all(len(line) <= width for line in lines)
