"""The subcommands: ``optimize``, ``passes``, ``report`` and ``golden``."""

from __future__ import annotations

import argparse
import collections
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import onnx_ir as ir

from ortpass import io
from ortpass.analysis.partition import get_training_info, is_training_graph
from ortpass.cli.errors import UsageError
from ortpass.cli.outputs import check_outputs, dump_files, plan_files
from ortpass.conventions import op_label
from ortpass.errors import (
    ModelLoadError,
    OrtpassError,
    PassFailedError,
    TrainingGraphError,
    elide,
)
from ortpass.infra.instruments import ProgressInstrument
from ortpass.infra.metadata import get_export_info
from ortpass.infra.pipeline_text import pipeline
from ortpass.infra.registry import available_passes, get_pass
from ortpass.infra.validate import check_model

logger = logging.getLogger(__name__)


def run_optimize(args: argparse.Namespace) -> int:
    if args.output is None and not args.in_place:
        raise UsageError("no output: give -o OUT.onnx, or --in-place to replace the input")
    output = Path(args.output if args.output is not None else args.input)
    manager = pipeline(args.pipeline, dump_dir=args.dump_dir, instruments=[ProgressInstrument()])
    logger.debug("pipeline %r runs as %s", args.pipeline, manager)
    inputs = [("IN", Path(args.input)), *plan_files(args.pipeline)]
    outputs = [("-o", output)]
    if args.report:
        outputs.append(("--report", Path(args.report)))
    if args.dump_dir:
        outputs += dump_files(manager, Path(args.dump_dir))
    check_outputs(inputs, outputs, in_place=args.in_place)

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


def run_list_passes(args: argparse.Namespace) -> int:
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


def run_report(args: argparse.Namespace) -> int:
    outputs = [(option, Path(path)) for option, path in (("--json", args.json), ("--plot", args.plot)) if path]
    check_outputs([("IN", Path(args.input))], outputs)
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


def run_golden(args: argparse.Namespace) -> int:
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
