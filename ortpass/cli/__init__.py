"""The ``ortpass`` command: optimize a model with a pipeline, list the passes, report on a
model, check golden models.

Exit codes: 0 success; 2 bad usage or bad input (an argument, a file that is not a model,
a malformed model, a bad pipeline or pass option, a set of passes that cannot be ordered,
an output that would overwrite an input or another output, a model naming a Function
nobody registered) or a runtime that cannot do it (two ONNX Runtimes installed, a training
graph to build on stock onnxruntime); 1 a pass failed (the message names the pass and the
reason; no model is written), or a golden model no longer matches its expectations.

Every output path is checked before any work starts (:func:`ortpass.cli.outputs.check_outputs`), and every
file is written atomically by :mod:`ortpass.io`, only once the run has succeeded (a
failing run writes only the report asked for; ``--dump-dir`` files are written as the
passes run).

Tables go to stdout, fitted to the terminal's width (100 columns when stdout is not a
terminal; ``--wide`` prints them whole); progress and diagnostics go through ``logging``
to stderr, one bounded line each (``-v`` for more, ``-q`` for less, before or after the
command's name: they count together).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, NoReturn, Sequence

from ortpass import __version__
from ortpass.cli.commands import run_golden, run_optimize
from ortpass.cli.errors import UsageError
from ortpass.cli.listing import run_list_passes
from ortpass.cli.log_output import configure_logging
from ortpass.cli.report import run_report
from ortpass.errors import (
    OrtpassError,
    PassFailedError,
    UnregisteredFunctionError,
    elide,
)
from ortpass.passes import DEFAULT_PIPELINE
from ortpass.training.backend import check_single_runtime, installed_runtimes

__all__ = ["main"]

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage message (2) or --help (0)
        return int(exc.code or 0)
    # -v and -q count wherever they are given, before the command or after it.
    restore = configure_logging(args.verbose + args.verbose_after - args.quiet - args.quiet_after)
    try:
        check_single_runtime()  # two runtimes unpacked over each other fail anywhere, obscurely
        return args.run(args)
    except PassFailedError as exc:
        if isinstance(exc.__cause__, UnregisteredFunctionError):
            # The model names a Function this process has not registered (and the command
            # cannot register one): bad input, not a broken pass.
            logger.error("%s: %s", type(exc.__cause__).__name__, exc.__cause__)
            return 2
        logger.error("%s", exc)
        return 1
    except (OrtpassError, UsageError, OSError) as exc:
        logger.error("%s: %s", type(exc).__name__, exc)
        return 2
    except KeyboardInterrupt:
        logger.error("interrupted; nothing was written but what the log above says")
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug: one line, the traceback with -v
        logger.error("internal error (a bug in ortpass; -v shows the traceback): %s: %s", type(exc).__name__, exc)
        logger.debug("traceback", exc_info=exc)
        return 1
    finally:
        restore()


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported in one line (not the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _verbosity(suffix: str = "") -> argparse.ArgumentParser:
    """-v/-q, for the main parser and (counted apart: a subparser's defaults would
    overwrite the main parser's counts) for every command."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("-v", "--verbose", action="count", default=0, dest="verbose" + suffix, help="more diagnostics (repeatable)")
    options.add_argument("-q", "--quiet", action="count", default=0, dest="quiet" + suffix, help="fewer diagnostics (repeatable)")
    return options


def _add_wide(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--wide", action="store_true",
        help="print tables whole, one line a row (default: fitted to the terminal's width, 100 columns when not a terminal)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ortpass", description="Training-graph optimization passes for ONNX Runtime.", parents=[_verbosity()])
    runtimes = ", ".join(f"{name} {version}" for name, version in installed_runtimes().items()) or "no onnxruntime"
    parser.add_argument("--version", action="version", version=f"ortpass {__version__} ({runtimes})")
    after = _verbosity("_after")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return commands.add_parser(name, parents=[after], **kwargs)

    optimize = command("optimize", help="run a pass pipeline on a model and print its report")
    optimize.add_argument("input", metavar="IN.onnx")
    optimize.add_argument("-o", "--output", metavar="OUT.onnx", help="where to write the result (replaced if it exists, unless it is IN)")
    optimize.add_argument("--pipeline", default=DEFAULT_PIPELINE, metavar="SPEC", help=f"passes to run, e.g. \"a,b(opt=1)\" (default: {DEFAULT_PIPELINE})")
    optimize.add_argument("--dump-dir", metavar="DIR", help="write the model after each pass that changed it, as NN_<pass>.onnx")
    optimize.add_argument("--report", metavar="R.json", help="also save the report as JSON (also when a pass fails)")
    optimize.add_argument("--in-place", action="store_true", help="allow the output to replace IN (the default output then)")
    _add_wide(optimize)
    optimize.set_defaults(run=run_optimize)

    listing = command("list-passes", help="list the passes a pipeline can name: phase, rule, options")
    _add_wide(listing)
    listing.set_defaults(run=run_list_passes)

    report = command("report", help="analyse a model (read only): summary, recompute applied, recompute plans left")
    report.add_argument("input", metavar="IN.onnx")
    report.add_argument("--json", metavar="R.json", help="save the summary and the analysis as JSON")
    report.add_argument("--plot", metavar="P.png", help="plot the recompute candidates (the format follows the suffix; none: PNG)")
    report.add_argument(
        "--probe-level", type=int, choices=(0, 1), default=1, metavar="{0,1}",
        help="recompute probe level, as ORT's: 0 basic ops, 1 also MatMul/Softmax/LayerNorm (default 1)",
    )
    report.add_argument(
        "--min-elements", type=_non_negative_int, default=1 << 20, metavar="N",
        help="skip all-static stashed tensors smaller than this, as ORT does (default 1048576)",
    )
    report.add_argument(
        "--dim", action="append", type=_dim, default=[], metavar="NAME=N", dest="dims",
        help="size of a symbolic dim to evaluate sizes at (repeatable; overrides the dims recorded at export)",
    )
    report.add_argument("--layer-boundary", action="store_true", help="group candidates by layer boundary")
    report.add_argument(
        "--budget", type=_budget, metavar="B",
        help="also plan recompute for a step-peak budget: bytes (1073741824, 300MiB, 6GB) or a fraction "
        "between recomputing every candidate (0.0) and nothing (1.0); prints the choice and the predicted peaks",
    )
    report.add_argument(
        "--no-build", action="store_true",
        help="refuse a forward model (exit 2) instead of analysing the training graph built from it in memory",
    )
    _add_wide(report)
    report.set_defaults(run=run_report)

    golden = command(
        "golden", help="check golden models against their recorded expectations, or update them (runs the case files' code)"
    )
    golden.add_argument("action", choices=("check", "update"), help="check: re-run and diff; update: rewrite the expectations")
    golden.add_argument("names", nargs="*", metavar="NAME", help="golden models to run (default: all)")
    golden.add_argument(
        "--dir", default="golden_models", metavar="DIR",
        help="directory of golden case files, whose Python code is imported and run (default: ./golden_models)",
    )
    golden.set_defaults(run=run_golden)
    return parser


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {elide(text, 40)!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {value}")
    return value


def _budget(text: str) -> int | float | str:
    """A memory budget as the recompute pass takes it: an int (bytes), a float (a fraction)
    or a size with a unit; checked here so that a bad one is a usage error."""
    from ortpass.analysis.recompute.budget import parse_budget
    from ortpass.errors import PlanError

    value: int | float | str = text
    for kind in (int, float):
        try:
            value = kind(text)
            break
        except ValueError:
            continue
    try:
        parse_budget(value)
    except PlanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return value


def _dim(text: str) -> tuple[str, int]:
    name, sep, size = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=N, not {elide(text, 40)!r}")
    try:
        value = int(size)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the size of dim {name.strip()!r} is not an integer: {elide(size, 40)!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the size of dim {name.strip()!r} must be positive, not {value}")
    return name.strip(), value


# -- where a command writes ------------------------------------------------------------


# -- optimize -------------------------------------------------------------------------


# -- list-passes ------------------------------------------------------------------------


# -- report -------------------------------------------------------------------------------


# -- golden ---------------------------------------------------------------------------


if __name__ == "__main__":
    raise SystemExit(main())
