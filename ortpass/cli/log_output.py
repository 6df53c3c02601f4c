"""How the command line prints log records: one line each, bounded, a repeated warning
printed once with a count."""

from __future__ import annotations

import collections
import logging
import sys
from typing import Callable

from ortpass.errors import (
    elide,
)

logger = logging.getLogger(__name__)


def configure_logging(verbosity: int) -> Callable[[], None]:
    """Send the package's log records to stderr at the chosen level; return an undo.

    Only the ``ortpass`` logger is configured, and it stops propagating while the command
    runs: importing onnxruntime's training build configures the root logger, which would
    print every line twice.  The warnings of the loggers in :data:`QUIETED` are held back
    unless ``-v``: onnx_ir's (a model's quirks it works around: ortpass names what matters
    about the model itself), and torch's C++-extension builder's, which warns "No CUDA
    runtime is found, using CUDA_HOME=..." on a machine without a GPU whenever anything
    imports ONNX Runtime's training build (its validation imports ORTModule, which imports
    torch.utils.cpp_extension; ortpass builds no extension).  Each
    line is one line, at most :data:`MAX_LINE` characters, and a warning that repeats is
    printed once and counted at the end.  The undo restores the loggers, so calling main()
    from Python (tests, notebooks) leaves the caller's logging as it was.
    """
    levels = {-2: logging.ERROR, -1: logging.WARNING, 0: logging.INFO}
    level = levels.get(verbosity, logging.DEBUG if verbosity > 0 else logging.CRITICAL)
    package_logger = logging.getLogger("ortpass")
    saved = (package_logger.level, package_logger.propagate)
    handler = logging.StreamHandler(sys.stderr)
    fmt = "ortpass: %(message)s" if verbosity <= 0 else "ortpass: %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(_OneLineFormatter(fmt, bounded=verbosity <= 0))
    repeats = _RepeatFilter()
    handler.addFilter(repeats)
    package_logger.addHandler(handler)
    package_logger.setLevel(level)
    package_logger.propagate = False
    quieted = [logging.getLogger(name) for name in QUIETED]
    quieted_levels = [q.level for q in quieted]
    if verbosity <= 0:
        for q in quieted:
            q.setLevel(logging.ERROR)

    def restore() -> None:
        repeats.summarize(handler)
        package_logger.removeHandler(handler)
        package_logger.level, package_logger.propagate = saved
        for q, q_level in zip(quieted, quieted_levels):
            q.setLevel(q_level)

    return restore


#: Loggers whose warnings only -v shows (see configure_logging).
QUIETED = ("onnx_ir", "torch.utils.cpp_extension")

#: The longest line the command prints to stderr without -v.
MAX_LINE = 2000


class _OneLineFormatter(logging.Formatter):
    """One line a record (a message that spans lines, as ORT's do, is joined), cut to
    :data:`MAX_LINE` characters unless ``-v``."""

    def __init__(self, fmt: str, *, bounded: bool) -> None:
        super().__init__(fmt)
        self.bounded = bounded

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if not self.bounded:
            return text
        return elide(" ".join(text.split()), MAX_LINE)


class _RepeatFilter(logging.Filter):
    """Lets a warning through the first time; counts the repeats (100,000 duplicate plans
    must not print 100,000 lines)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[tuple[int, str]] = collections.Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.levelno >= logging.ERROR:
            return True
        key = (record.levelno, record.getMessage())
        self.seen[key] += 1
        return self.seen[key] == 1

    def summarize(self, handler: logging.Handler) -> None:
        for (level, message), count in self.seen.items():
            if count > 1:
                record = logging.LogRecord("ortpass", level, __file__, 0, "%s (repeated %d more times)", (message, count - 1), None)
                handler.emit(record)  # emit, not handle: past this filter
