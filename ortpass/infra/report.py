"""What a pipeline run did: one :class:`PassRecord` per pass, gathered in a
:class:`PassReport` (table, JSON), and the :class:`ManagerResult` carrying it."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import onnx
import onnx_ir as ir

from ortpass.infra.text_table import (
    column_widths,
    detail_lines,
    fits,
    format_table,
    render_row,
    rule_line,
)
from ortpass.io import write_file


@dataclasses.dataclass
class PassRecord:
    """What one pass did.  ``added``/``removed`` count nodes by op type
    (``domain::Op`` outside the default domain); ``stats`` is the pass's own statistics."""

    position: int
    name: str
    seconds: float = 0.0
    check_seconds: float = 0.0
    modified: bool = False
    nodes_before: int = 0
    nodes_after: int = 0
    added: dict[str, int] = dataclasses.field(default_factory=dict)
    removed: dict[str, int] = dataclasses.field(default_factory=dict)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    dump_path: str | None = None
    # For a failed pass, seconds/added/removed/stats describe the attempt that was rolled back.

    @property
    def failed(self) -> bool:
        return self.error is not None

__all__ = ["ManagerResult", "PassRecord", "PassReport", "stats_of"]


@dataclasses.dataclass
class PassReport:
    """Per-pass records of one pass-manager run, in the order the passes ran."""

    records: list[PassRecord] = dataclasses.field(default_factory=list)
    #: The onnx checker on the model the run returned (the incremental mode's last check).
    final_check_seconds: float = 0.0

    @property
    def modified(self) -> bool:
        return any(r.modified and not r.failed for r in self.records)

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds + r.check_seconds for r in self.records) + self.final_check_seconds

    def __getitem__(self, name: str) -> PassRecord:
        """The record of the first pass called ``name``."""
        for record in self.records:
            if record.name == name:
                return record
        raise KeyError(f"no pass named {name!r} in this report; passes: {[r.name for r in self.records]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "passes": [dataclasses.asdict(r) for r in self.records],
            "final_check_seconds": self.final_check_seconds,
            "total_seconds": self.total_seconds,
            "modified": self.modified,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PassReport:
        return cls([PassRecord(**r) for r in data["passes"]], data.get("final_check_seconds", 0.0))

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> PassReport:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        write_file(path, self.to_json() + "\n")

    def to_table(self, width: int | None = None) -> str:
        """A fixed-width text table, one row per pass, and a total line.

        ``width``: the characters a line may take (the command gives the terminal's).  The
        whole table is printed where it fits; where it does not, each pass's row keeps
        the short columns and its nodes added and removed, statistics or error go on
        lines under it, wrapped at the width (:mod:`ortpass.infra.text_table`).  None
        (the default): the whole table, however wide.
        """
        rows = [_HEADER] + [_table_row(r) for r in self.records]
        lines = format_table(rows, right=_NUMERIC)
        if not fits(lines, width):
            lines = self._narrow_lines(width)
        return "\n".join([*lines, self._total_line()])

    def _narrow_lines(self, width: int | None) -> list[str]:
        """The short columns as a table, the long ones as detail lines under each row."""
        short = len(_HEADER) - 3  # up to "nodes"; added, removed and stats go under the row
        rows = [_table_row(r) for r in self.records]
        widths = column_widths([_HEADER[:short]] + [row[:short] for row in rows], width=width)
        lines = [*render_row(_HEADER[:short], widths, right=_NUMERIC), rule_line(widths)]
        for record, row in zip(self.records, rows):
            lines += render_row(row[:short], widths, right=_NUMERIC)
            added, removed, stats = row[short:]
            for label, text in (("added", added), ("removed", removed), ("error" if record.failed else "stats", stats)):
                if text != "-":
                    lines += detail_lines(label, text, width=width)
        return lines

    def _total_line(self) -> str:
        if not self.records:
            return "total: no passes ran"
        first, last = self.records[0], self.records[-1]
        nodes_after = last.nodes_before if last.failed else last.nodes_after
        final_check = f" (final check {self.final_check_seconds * 1000:.1f})" if self.final_check_seconds else ""
        return (
            f"total: {len(self.records)} passes, {self.total_seconds * 1000:.1f} ms{final_check}, "
            f"nodes {first.nodes_before} -> {nodes_after}"
        )

    def __str__(self) -> str:
        return self.to_table()


_HEADER = ("#", "pass", "ms", "check ms", "changed", "nodes", "added", "removed", "stats")
_NUMERIC = {0, 2, 3}  # right-aligned


def _table_row(r: PassRecord) -> tuple[str, ...]:
    changed = "FAILED" if r.failed else ("yes" if r.modified else "no")
    nodes = f"{r.nodes_before}" if r.failed else f"{r.nodes_before} -> {r.nodes_after}"
    return (
        str(r.position),
        r.name,
        f"{r.seconds * 1000:.1f}",
        f"{r.check_seconds * 1000:.1f}",
        changed,
        nodes,
        _format_counts(r.added, "+"),
        _format_counts(r.removed, "-"),
        " ".join(r.error.split()) if r.error else _format_stats(r.stats),  # one line per row
    )


#: Op types listed per table cell; a gradient build adds dozens (the JSON report has all).
_TABLE_OPS = 6


def _format_counts(counts: dict[str, int], sign: str) -> str:
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    cell = " ".join(f"{op}{sign}{n}" for op, n in ranked[:_TABLE_OPS])
    if len(ranked) > _TABLE_OPS:
        rest = ranked[_TABLE_OPS:]
        cell += f" (+{len(rest)} types, {sign}{sum(n for _, n in rest)})"
    return cell or "-"


def _format_stats(stats: dict[str, Any]) -> str:
    parts = [f"{key}={value}" for key, value in stats.get("counts", {}).items()]
    parts += [f"{key}: {len(values)} noted" for key, values in stats.get("notes", {}).items()]
    return "; ".join(parts) or "-"


@dataclasses.dataclass
class ManagerResult(ir.passes.PassResult):
    """An onnx_ir PassResult that also carries the manager's report, and ``model``
    serialized as the run's last onnx checker accepted it (None where no check serialized
    the model returned): saving it spares serializing the model again."""

    report: PassReport
    proto: onnx.ModelProto | None = None


def stats_of(pass_: ir.passes.PassBase) -> dict[str, Any]:
    """A copy of the statistics ``pass_`` recorded in its latest run, as JSON can hold them."""
    stats = getattr(pass_, "stats", None)
    if not isinstance(stats, dict):
        return {}
    # A JSON round trip copies the statistics (the pass resets them on its next run) and
    # makes them serializable; values JSON cannot hold are written as their str().
    return json.loads(json.dumps(stats, default=str))
