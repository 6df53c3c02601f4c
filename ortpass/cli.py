"""The ``ortpass`` command: optimize a model with a pipeline, list the passes, report on a
model, check golden models.

Exit codes: 0 success; 2 bad usage or bad input (an argument, a file that is not a model,
a malformed model, a bad pipeline or pass option, a set of passes that cannot be ordered,
an output that would overwrite an input or another output, a model naming a Function
nobody registered); 1 a pass failed (the message names the pass and the reason; no model
is written), or a golden model no longer matches its expectations.

Every output path is checked before any work starts (:func:`_check_outputs`), and every
file is written atomically by :mod:`ortpass.io`, only once the run has succeeded (a
failing run writes only the report asked for; ``--dump-dir`` files are written as the
passes run).

The report table goes to stdout; progress and diagnostics go through ``logging`` to stderr,
one bounded line each (``-v`` for more, ``-q`` for less).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import onnx_ir as ir

from ortpass import io
from ortpass.analysis.partition import get_training_info, is_training_graph
from ortpass.conventions import op_label
from ortpass.errors import (
    ModelLoadError,
    OrtpassError,
    PassFailedError,
    TrainingGraphError,
    UnregisteredFunctionError,
    elide,
)
from ortpass.infra.base import pass_name_of
from ortpass.infra.instruments import ProgressInstrument
from ortpass.infra.metadata import get_export_info
from ortpass.infra.pipeline_text import parse_pipeline, pipeline
from ortpass.infra.registry import available_passes, get_pass
from ortpass.infra.validate import check_model
from ortpass.passes import DEFAULT_PIPELINE

__all__ = ["main"]

logger = logging.getLogger(__name__)

class UsageError(Exception):
    """The command line asks for something the command refuses to do (exit code 2)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage message (2) or --help (0)
        return int(exc.code or 0)
    restore = _configure_logging(args.verbose - args.quiet)
    try:
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


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ortpass", description="Training-graph optimization passes for ONNX Runtime.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more diagnostics (repeatable)")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="fewer diagnostics (repeatable)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    optimize = commands.add_parser("optimize", help="run a pass pipeline on a model and print its report")
    optimize.add_argument("input", metavar="IN.onnx")
    optimize.add_argument("-o", "--output", metavar="OUT.onnx", help="where to write the result (replaced if it exists, unless it is IN)")
    optimize.add_argument("--pipeline", default=DEFAULT_PIPELINE, metavar="SPEC", help=f"passes to run, e.g. \"a,b(opt=1)\" (default: {DEFAULT_PIPELINE})")
    optimize.add_argument("--dump-dir", metavar="DIR", help="write the model after each pass that changed it, as NN_<pass>.onnx")
    optimize.add_argument("--report", metavar="R.json", help="also save the report as JSON (also when a pass fails)")
    optimize.add_argument("--in-place", action="store_true", help="allow the output to replace IN (the default output then)")
    optimize.set_defaults(run=_optimize)

    listing = commands.add_parser("list-passes", help="list the passes a pipeline can name")
    listing.set_defaults(run=_list_passes)

    report = commands.add_parser("report", help="analyse a model (read only): summary and recompute candidates")
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
    report.set_defaults(run=_report)

    golden = commands.add_parser(
        "golden", help="check golden models against their recorded expectations, or update them (runs the case files' code)"
    )
    golden.add_argument("action", choices=("check", "update"), help="check: re-run and diff; update: rewrite the expectations")
    golden.add_argument("names", nargs="*", metavar="NAME", help="golden models to run (default: all)")
    golden.add_argument(
        "--dir", default="golden_models", metavar="DIR",
        help="directory of golden case files, whose Python code is imported and run (default: ./golden_models)",
    )
    golden.set_defaults(run=_golden)
    return parser


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {elide(text, 40)!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {value}")
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


def _configure_logging(verbosity: int) -> Callable[[], None]:
    """Send the package's log records to stderr at the chosen level; return an undo.

    Only the ``ortpass`` logger is configured, and it stops propagating while the command
    runs: importing onnxruntime's training build configures the root logger, which would
    print every line twice.  onnx_ir's own warnings (a model's quirks it works around) are
    held back unless ``-v``: ortpass names what matters about the model itself.  Each
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
    quieted = logging.getLogger("onnx_ir")
    quieted_level = quieted.level
    if verbosity <= 0:
        quieted.setLevel(logging.ERROR)

    def restore() -> None:
        repeats.summarize(handler)
        package_logger.removeHandler(handler)
        package_logger.level, package_logger.propagate = saved
        quieted.setLevel(quieted_level)

    return restore


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


# -- where a command writes ------------------------------------------------------------


def _identity(path: Path) -> tuple:
    """What makes two paths the same file: the inode of one that exists (hard links,
    symlinks, ``./`` and ``..`` all land there), else the real path it would be created at."""
    try:
        st = os.stat(path)  # follows symlinks: writing goes through them (io.real_target)
        return ("inode", st.st_dev, st.st_ino)
    except OSError:
        return ("path", os.path.realpath(path))


def _check_writable(option: str, path: Path) -> None:
    """Refuse, before any work, an output that cannot be a file."""
    target = io.real_target(path)
    if target.is_dir():
        raise UsageError(f"{option} {path} is a directory; give a file name")
    if target.exists() and not target.is_file():
        raise UsageError(f"{option} {path} is not a regular file; refusing to replace it")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) and parent == target.parent:
        raise UsageError(f"{option} {path}: the directory {parent} is not writable")


def _check_outputs(inputs: Sequence[tuple[str, Path]], outputs: Sequence[tuple[str, Path]], *, in_place: bool = False) -> None:
    """Every output must be writable, none may be an input (unless ``-o`` with
    ``--in-place``), and no two outputs may be the same file."""
    seen: dict[tuple, tuple[str, Path]] = {}
    read = {_identity(path): (option, path) for option, path in inputs}
    for option, path in outputs:
        _check_writable(option, path)
        key = _identity(path)
        if key in read and not (in_place and option == "-o"):
            given_as, given = read[key]
            what = "the input model" if given_as == "IN" else f"the {given_as} file {given}"
            hint = " without --in-place" if option == "-o" else ""
            raise UsageError(f"{option} {path} is {what}; refusing to overwrite it{hint}")
        if key in seen:
            other_option, other = seen[key]
            raise UsageError(f"{option} {path} and {other_option} {other} are the same file; give each output its own")
        seen[key] = (option, path)


# -- optimize -------------------------------------------------------------------------


def _optimize(args: argparse.Namespace) -> int:
    if args.output is None and not args.in_place:
        raise UsageError("no output: give -o OUT.onnx, or --in-place to replace the input")
    output = Path(args.output if args.output is not None else args.input)
    manager = pipeline(args.pipeline, dump_dir=args.dump_dir, instruments=[ProgressInstrument()])
    logger.debug("pipeline %r runs as %s", args.pipeline, manager)
    inputs = [("IN", Path(args.input)), *_plan_files(args.pipeline)]
    outputs = [("-o", output)]
    if args.report:
        outputs.append(("--report", Path(args.report)))
    if args.dump_dir:
        outputs += _dump_files(manager, Path(args.dump_dir))
    _check_outputs(inputs, outputs, in_place=args.in_place)

    model = io.load(args.input)
    try:
        result = manager(model)
    except PassFailedError as exc:
        if args.report and exc.report is not None:
            exc.report.save(args.report)  # what the failing run did, as asked; no model is written
        raise
    print(result.report.to_table())
    io.save(result.model, output, overwrite=True, serialized=result.proto)
    if args.report:
        result.report.save(args.report)
        logger.info("wrote the report to %s", args.report)
    return 0


def _plan_files(spec: str) -> list[tuple[str, Path]]:
    """Plan files the pipeline names (``config_file=``): inputs too."""
    return [
        ("config_file", Path(s.options["config_file"]))
        for s in parse_pipeline(spec)
        if isinstance(s.options.get("config_file"), str)
    ]


def _dump_files(manager: Any, directory: Path) -> list[tuple[str, Path]]:
    """Every file ``--dump-dir`` could write: one per pass, and its failed-input file."""
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--dump-dir {directory} is a file, not a directory")
    files = []
    for position, pass_ in enumerate(manager.passes, start=1):
        name = f"{position:02d}_{pass_name_of(pass_)}"
        files += [("--dump-dir", directory / f"{name}.onnx"), ("--dump-dir", directory / f"{name}.failed-input.onnx")]
    return files


# -- list-passes ------------------------------------------------------------------------


def _list_passes(args: argparse.Namespace) -> int:
    del args
    rows = [("name", "phase", "requires", "provides", "source")]
    for name, source in sorted(available_passes().items()):
        try:
            cls = get_pass(name)
        except OrtpassError as exc:
            logger.warning("%s", exc)
            rows.append((name, "?", "?", "?", f"{source} (does not load)"))
            continue
        rows.append(
            (
                name,
                getattr(cls, "phase", "any"),
                ",".join(sorted(getattr(cls, "requires_properties", ()))) or "-",
                ",".join(sorted(getattr(cls, "provides_properties", ()))) or "-",
                source,
            )
        )
    print(_text_table(rows))
    return 0


def _text_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- report -------------------------------------------------------------------------------


def _report(args: argparse.Namespace) -> int:
    outputs = [(option, Path(path)) for option, path in (("--json", args.json), ("--plot", args.plot)) if path]
    _check_outputs([("IN", Path(args.input))], outputs)
    plot_format = _plot_format(Path(args.plot)) if args.plot else None
    model = io.load(args.input)
    _check_report_input(model)
    summary = _model_summary(model)
    print(_format_summary(args.input, summary))
    if not is_training_graph(model):
        raise TrainingGraphError(
            f"{args.input} is not a training graph (its metadata has no forward/backward record from the "
            "gradient build), so there are no stashed activations to analyse; run `ortpass optimize` "
            "with a pipeline that includes build-training-graph first"
        )
    # Imported here: the analysis is heavier than the rest of the command.
    from ortpass.analysis.recompute import find_recompute_candidates

    candidates = find_recompute_candidates(
        model,
        probe_level=args.probe_level,
        layer_boundary=args.layer_boundary,
        dims=_report_dims(model, args.dims),
        min_elements=args.min_elements,
    )
    print()
    print(candidates.to_table())
    if args.plot:
        _refuse_missing_dims(candidates)
    # Both outputs are made before either is written: a failure leaves neither.
    text = json.dumps({"model": summary, "recompute": candidates.to_dict()}, indent=2, default=str) + "\n"
    if args.plot:
        written = io.write_with(args.plot, lambda tmp: candidates.plot(tmp), suffix=f".{plot_format}")
        logger.info("wrote %s (%s)", written, plot_format.upper())
    if args.json:
        logger.info("wrote %s", io.write_file(args.json, text))
    return 0


def _check_report_input(model: ir.Model) -> None:
    """What the pass manager checks on its input: the onnx checker's rules on the IR, and
    ortpass's metadata and attributes, before the analysis reads them."""
    from ortpass.infra.checks import input_check

    try:
        input_check(model)
    except Exception as exc:  # noqa: BLE001 - the checker's verdict, named
        raise ModelLoadError(f"the model fails the onnx checker: {type(exc).__name__}: {elide(str(exc), 600)}") from exc
    check_model(model)


def _plot_format(path: Path) -> str:
    """The image format ``--plot`` writes: its suffix, which matplotlib must know; PNG without one."""
    if not path.suffix:
        return "png"
    from matplotlib.backend_bases import FigureCanvasBase

    known = FigureCanvasBase.get_supported_filetypes()
    fmt = path.suffix[1:].lower()
    if fmt not in known:
        raise UsageError(f"--plot {path}: unknown image format {path.suffix!r}; use one of {', '.join(sorted(known))}")
    return fmt


def _report_dims(model: ir.Model, given: Sequence[tuple[str, int]]) -> dict[str, int] | None:
    """The dims recorded at export with those given by ``--dim`` over them; None if neither."""
    if not given:
        return None
    return {**(get_export_info(model).get("dims") or {}), **dict(given)}


def _refuse_missing_dims(candidates: Any) -> None:
    """The plot needs every stashed size; name the dims still without a value."""
    missing: set[str] = set()
    unsized = []
    for stashed in candidates.stashed:
        if stashed.bytes is not None:
            continue
        if stashed.symbolic_bytes is None:
            unsized.append(stashed.buffer.name)
        else:
            missing |= {str(symbol) for symbol in stashed.symbolic_bytes.free_symbols}
    if missing:
        names = sorted(missing)
        raise UsageError(
            f"--plot needs the size of dim(s) {', '.join(names[:10])}; give each with --dim, e.g. --dim {names[0]}=N"
        )
    if unsized:
        raise UsageError(
            f"--plot needs concrete sizes, but the shape of {len(unsized)} stashed value(s) is unknown "
            f"(e.g. {unsized[0]!r})"
        )


def _model_summary(model: ir.Model) -> dict[str, Any]:
    ops = collections.Counter(
        op_label(n.domain, n.op_type) for n in model.graph.all_nodes()
    )
    summary: dict[str, Any] = {
        "ir_version": model.ir_version,
        "opsets": {domain or "ai.onnx": version for domain, version in model.opset_imports.items()},
        "nodes": sum(ops.values()),
        "ops": dict(ops.most_common()),
        "inputs": {v.name: _describe_value(v) for v in model.graph.inputs},
        "outputs": {v.name: _describe_value(v) for v in model.graph.outputs},
        "initializers": len(model.graph.initializers),
        "training": None,
    }
    if is_training_graph(model):
        info = get_training_info(model)
        summary["training"] = {"loss": info.loss, "params": len(info.params)}
    return summary


def _describe_value(value: ir.Value) -> str:
    dtype = value.dtype.name if value.dtype is not None else "?"
    shape = "[" + ",".join(str(d) for d in value.shape) + "]" if value.shape is not None else "[?]"
    return f"{dtype}{shape}"


def _format_summary(path: str, s: dict[str, Any]) -> str:
    opsets = ", ".join(f"{d} {v}" for d, v in s["opsets"].items())
    lines = [f"model {path}: IR {s['ir_version']}, opsets {opsets}, {s['initializers']} initializers"]
    if s["training"]:
        lines.append(f"training graph: loss {s['training']['loss']!r}, {s['training']['params']} parameters")
    lines.append(f"nodes: {s['nodes']} (" + ", ".join(f"{op} {n}" for op, n in s["ops"].items()) + ")")
    lines += ["inputs:"] + [f"  {name}  {desc}" for name, desc in s["inputs"].items()]
    lines += ["outputs:"] + [f"  {name}  {desc}" for name, desc in s["outputs"].items()]
    return "\n".join(lines)



# -- golden ---------------------------------------------------------------------------


def _golden(args: argparse.Namespace) -> int:
    from ortpass import golden  # imports torch: only this command needs it

    directory = Path(args.dir).resolve()
    if not directory.is_dir():
        raise UsageError(f"golden model directory {directory} does not exist; give one with --dir")
    logger.info("golden: importing and running the case files of %s", directory)
    try:
        if args.action == "update":
            for path in golden.update(args.dir, args.names):
                print(f"wrote {path}")
            return 0
        results = golden.check(args.dir, args.names)
    except (KeyError, FileNotFoundError) as exc:
        raise UsageError(str(exc).strip('"')) from exc
    failed = 0
    for result in results:
        if result.ok:
            print(f"{result.name}: ok")
            continue
        failed += 1
        print(f"{result.name}: {len(result.differences)} differences")
        for line in result.differences:
            print(f"  {line}")
    if failed:
        print(f"{failed} of {len(results)} golden models differ; if the change is intended, run `ortpass golden update NAME`")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
