"""``ortpass list-passes``: every pass a pipeline can name, with what a person needs to
write it: its phase, the properties it requires and provides, its rule in one line (the
first paragraph of its docstring), and its options with their types and defaults (read
from its ``__init__``, as the pipeline checks them: :mod:`ortpass.infra.options`).

Where the table fits the width it is one row a pass; where it does not (at 100 columns it
never does: the options alone are wider), the rule, the options and, for a pass that is
not built in, where it comes from go on lines under its row.
"""

from __future__ import annotations

import argparse
import inspect
import logging
from typing import Any

from ortpass.cli.commands import table_width
from ortpass.errors import OrtpassError
from ortpass.infra.options import describe_options
from ortpass.infra.registry import available_passes, get_pass
from ortpass.infra.text_table import (
    column_widths,
    detail_lines,
    fits,
    format_table,
    render_row,
    rule_line,
)

__all__ = ["list_passes_text", "run_list_passes"]

logger = logging.getLogger(__name__)

_HEADER = ("name", "phase", "requires", "provides", "options", "rule", "source")
_SHORT = 4  # name .. provides: the columns of the narrow table
_BUILTIN = "ortpass.passes."  # where a pass without a "source" line under its row comes from


def run_list_passes(args: argparse.Namespace) -> int:
    print(list_passes_text(table_width(args)))
    return 0


def list_passes_text(width: int | None) -> str:
    """The pass table at ``width`` characters (None: one row a pass, however wide)."""
    rows = [_row(name, source) for name, source in sorted(available_passes().items())]
    wide = format_table([_HEADER] + [_wide_cells(r) for r in rows])
    if fits(wide, width):
        return "\n".join(wide)
    widths = column_widths([_HEADER[:_SHORT]] + [_wide_cells(r)[:_SHORT] for r in rows], width=width)
    lines = [*render_row(_HEADER[:_SHORT], widths), rule_line(widths)]
    for row in rows:
        lines += render_row(_wide_cells(row)[:_SHORT], widths)
        lines += detail_lines("rule", row["rule"], width=width)
        options = row["options"] or ["none"]
        lines += detail_lines("options", options[0], width=width)
        for option in options[1:]:
            lines += detail_lines("", option, width=width, indent=" " * len("    options: "))
        if not row["source"].startswith(_BUILTIN):
            lines += detail_lines("source", row["source"], width=width)
    return "\n".join(lines)


def _row(name: str, source: str) -> dict[str, Any]:
    try:
        cls = get_pass(name)
    except OrtpassError as exc:  # a plugin that does not import: listed, and the reason logged
        logger.warning("%s", exc)
        return {"name": name, "phase": "?", "requires": "?", "provides": "?", "options": [], "rule": "?",
                "source": f"{source} (does not load)"}  # fmt: skip
    return {
        "name": name,
        "phase": getattr(cls, "phase", "any"),
        "requires": ",".join(sorted(getattr(cls, "requires_properties", ()))) or "-",
        "provides": ",".join(sorted(getattr(cls, "provides_properties", ()))) or "-",
        "options": [str(option) for option in describe_options(cls)],
        "rule": rule_of(cls),
        "source": source,
    }


def _wide_cells(row: dict[str, Any]) -> tuple[str, ...]:
    return (row["name"], row["phase"], row["requires"], row["provides"], "; ".join(row["options"]) or "-",
            row["rule"], row["source"])  # fmt: skip


def rule_of(cls: type) -> str:
    """A pass's rule in one line: the first paragraph of its docstring (reStructuredText's
    double backquotes made single), or ``-`` for a pass without one."""
    doc = inspect.getdoc(cls) if cls.__doc__ else None  # not a docstring inherited from a base
    if not doc:
        return "-"
    return " ".join(doc.split("\n\n", 1)[0].split()).replace("``", "`")
