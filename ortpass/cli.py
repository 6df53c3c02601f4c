"""The ``ortpass`` command: optimize a model with a pipeline, list the passes, report on a
model, check golden models.

Exit codes: 0 success; 2 bad usage or bad input (a file that is not a model, a bad pipeline,
a set of passes that cannot be ordered, an output that would overwrite the input); 1 a pass
failed (the message names the pass and the reason; nothing is written), or a golden model
no longer matches its expectations.

The report table goes to stdout; progress and diagnostics go through ``logging`` to stderr
(``-v`` for more, ``-q`` for less).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import onnx_ir as ir

from ortpass import io
from ortpass.analysis.partition import get_training_info, is_training_graph
from ortpass.errors import OrtpassError, PassFailedError
from ortpass.instruments import ProgressInstrument
from ortpass.manager import pipeline
from ortpass.registry import available_passes, get_pass

__all__ = ["DEFAULT_PIPELINE", "main"]

logger = logging.getLogger(__name__)

#: What ``ortpass optimize`` runs without ``--pipeline``: every built-in pass (the manager
#: orders them from their declarations), recompute at ORTModule's layer-wise level 1 with
#: the masks forward would still keep replayed and backward joins ordered for memory
#: (benchmarks/recompute_memory.py), and the label gather above the vocabulary projection
#: (faster on CPU at every flagged density; benchmarks/sce_gather.py).
DEFAULT_PIPELINE = (
    "pythonop-shape-inference,insert-gather-before-sce-loss(move_above_projection=True),build-training-graph,"
    "fix-dropout-seed(level=1),recompute(level=1),replay-dropout-mask,order-backward-joins"
)


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
        logger.error("%s", exc)
        return 1
    except (OrtpassError, UsageError, OSError) as exc:
        logger.error("%s: %s", type(exc).__name__, exc)
        return 2
    finally:
        restore()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ortpass", description="Training-graph optimization passes for ONNX Runtime.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more diagnostics (repeatable)")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="fewer diagnostics (repeatable)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    optimize = commands.add_parser("optimize", help="run a pass pipeline on a model and print its report")
    optimize.add_argument("input", metavar="IN.onnx")
    optimize.add_argument("-o", "--output", metavar="OUT.onnx", help="where to write the result (replaced if it exists, unless it is IN)")
    optimize.add_argument("--pipeline", default=DEFAULT_PIPELINE, metavar="SPEC", help=f"passes to run, e.g. \"a,b(opt=1)\" (default: {DEFAULT_PIPELINE})")
    optimize.add_argument("--dump-dir", metavar="DIR", help="write the model after each pass that changed it, as NN_<pass>.onnx")
    optimize.add_argument("--report", metavar="R.json", help="also save the report as JSON")
    optimize.add_argument("--in-place", action="store_true", help="allow the output to replace IN (the default output then)")
    optimize.set_defaults(run=_optimize)

    listing = commands.add_parser("list-passes", help="list the passes a pipeline can name")
    listing.set_defaults(run=_list_passes)

    report = commands.add_parser("report", help="analyse a model (read only): summary and recompute candidates")
    report.add_argument("input", metavar="IN.onnx")
    report.add_argument("--json", metavar="R.json", help="save the summary and the analysis as JSON")
    report.add_argument("--plot", metavar="P.png", help="plot the recompute candidates")
    report.add_argument("--probe-level", type=int, default=1, metavar="N", help="recompute probe level, as ORT's (default 1)")
    report.add_argument(
        "--min-elements", type=int, default=1 << 20, metavar="N",
        help="skip all-static stashed tensors smaller than this, as ORT does (default 1048576)",
    )
    report.add_argument("--layer-boundary", action="store_true", help="group candidates by layer boundary")
    report.set_defaults(run=_report)

    golden = commands.add_parser("golden", help="check golden models against their recorded expectations, or update them")
    golden.add_argument("action", choices=("check", "update"), help="check: re-run and diff; update: rewrite the expectations")
    golden.add_argument("names", nargs="*", metavar="NAME", help="golden models to run (default: all)")
    golden.add_argument("--dir", default="golden_models", metavar="DIR", help="directory of golden case files (default: golden_models)")
    golden.set_defaults(run=_golden)
    return parser


def _configure_logging(verbosity: int) -> Callable[[], None]:
    """Send the package's log records to stderr at the chosen level; return an undo.

    Only the ``ortpass`` logger is configured, and it stops propagating while the command
    runs: importing onnxruntime's training build configures the root logger, which would
    print every line twice.  The undo restores the logger, so calling main() from Python
    (tests, notebooks) leaves the caller's logging as it was.
    """
    levels = {-2: logging.ERROR, -1: logging.WARNING, 0: logging.INFO}
    level = levels.get(verbosity, logging.DEBUG if verbosity > 0 else logging.CRITICAL)
    package_logger = logging.getLogger("ortpass")
    saved = (package_logger.level, package_logger.propagate)
    handler = logging.StreamHandler(sys.stderr)
    fmt = "ortpass: %(message)s" if verbosity <= 0 else "ortpass: %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    package_logger.addHandler(handler)
    package_logger.setLevel(level)
    package_logger.propagate = False

    def restore() -> None:
        package_logger.removeHandler(handler)
        package_logger.level, package_logger.propagate = saved

    return restore


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    a, b = Path(a), Path(b)
    if a.exists() and b.exists():
        return os.path.samefile(a, b)  # also catches links to the same file
    return a.resolve() == b.resolve()


def _refuse_writing_over(model_path: str, *others: tuple[str, str | None]) -> None:
    for option, path in others:
        if path is not None and _same_file(model_path, path):
            raise UsageError(f"{option} {path} is the input model; refusing to overwrite it")


# -- optimize -------------------------------------------------------------------------


def _optimize(args: argparse.Namespace) -> int:
    output = args.output
    if output is None:
        if not args.in_place:
            raise UsageError("no output: give -o OUT.onnx, or --in-place to replace the input")
        output = args.input
    elif _same_file(args.input, output) and not args.in_place:
        raise UsageError(f"-o {output} is the input model; refusing to overwrite it without --in-place")
    _refuse_writing_over(args.input, ("--report", args.report))

    model = io.load(args.input)
    manager = pipeline(args.pipeline, dump_dir=args.dump_dir, instruments=[ProgressInstrument()])
    logger.debug("pipeline %r runs as %s", args.pipeline, manager)
    try:
        result = manager(model)
    except PassFailedError as exc:
        if args.report and exc.report is not None:
            exc.report.save(args.report)
        raise
    print(result.report.to_table())
    io.save(result.model, output, overwrite=True, serialized=result.proto)
    if args.report:
        result.report.save(args.report)
        logger.info("wrote the report to %s", args.report)
    return 0


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
    _refuse_writing_over(args.input, ("--json", args.json), ("--plot", args.plot))
    model = io.load(args.input)
    summary = _model_summary(model)
    print(_format_summary(args.input, summary))
    if not is_training_graph(model):
        logger.error(
            "%s is not a training graph (its metadata has no forward/backward record from the "
            "gradient build), so there are no stashed activations to analyse; run `ortpass optimize` "
            "with a pipeline that includes build-training-graph first",
            args.input,
        )
        return 2
    # Imported here: the analysis is heavier than the rest of the command.
    from ortpass.analysis.recompute import find_recompute_candidates

    candidates = find_recompute_candidates(
        model,
        probe_level=args.probe_level,
        layer_boundary=args.layer_boundary,
        dims=None,
        min_elements=args.min_elements,
    )
    print()
    print(candidates.to_table())
    if args.json:
        Path(args.json).write_text(json.dumps({"model": summary, "recompute": candidates.to_dict()}, indent=2, default=str) + "\n")
        logger.info("wrote %s", args.json)
    if args.plot:
        candidates.plot(args.plot)
        logger.info("wrote %s", args.plot)
    return 0


def _model_summary(model: ir.Model) -> dict[str, Any]:
    ops = collections.Counter(
        n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}" for n in model.graph.all_nodes()
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


if __name__ == "__main__":
    raise SystemExit(main())


# -- golden ---------------------------------------------------------------------------


def _golden(args: argparse.Namespace) -> int:
    from ortpass import golden  # imports torch: only this command needs it

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
