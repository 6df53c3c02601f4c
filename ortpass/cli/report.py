"""``ortpass report``: what a model is, the recompute it already has, and the recompute
plans left in it.  The model file is only read.

Rules:

* A forward model (no training-graph record in its metadata) is not refused: its training
  graph is built in memory, by the default pipeline's passes up to and including
  ``build-training-graph`` (:func:`training_graph_pipeline`), and the report says so in
  one line on stderr, with the command that saves that graph.  Why this choice: a report
  is asked for to see what recompute could do to a model, and a forward model is what a
  user has first; the pre-grad passes are included because they change what backward
  stashes (the label gather shrinks the vocabulary projection's activations), so the plans
  shown are those ``ortpass optimize`` would choose from.  ``--no-build`` keeps the old
  refusal, for a script that must not analyse anything but the file it names.  The build
  needs ORT's training build: on stock onnxruntime a forward model is refused (exit 2).
* Recompute already applied is read back from the clones' tags
  (:func:`ortpass.analysis.recompute.find_applied_recompute`) and shown first; the plan
  table then lists what is left, without a Status column: nothing is enabled in a
  read-only report, and a column of "OFF" on a graph the recompute pass already rewrote
  reads as "recompute does nothing".  The plot's baseline says what the graph already
  recomputes instead of "no recompute".
"""

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
from ortpass.cli.commands import refuse_untagged_training_graph, table_width
from ortpass.cli.errors import UsageError
from ortpass.cli.outputs import check_outputs
from ortpass.conventions import op_label
from ortpass.errors import ModelLoadError, PassFailedError, TrainingGraphError, elide
from ortpass.infra.metadata import get_export_info
from ortpass.infra.pipeline_text import parse_pipeline, pipeline
from ortpass.infra.text_table import (
    column_widths,
    detail_lines,
    fits,
    format_table,
    render_row,
    wrap_line,
)
from ortpass.infra.validate import check_model
from ortpass.training.backend import require_training_build

__all__ = ["run_report", "training_graph_pipeline"]

logger = logging.getLogger(__name__)


def run_report(args: argparse.Namespace) -> int:
    width = table_width(args)
    outputs = [(option, Path(path)) for option, path in (("--json", args.json), ("--plot", args.plot)) if path]
    check_outputs([("IN", Path(args.input))], outputs)
    plot_format = _plot_format(Path(args.plot)) if args.plot else None
    model = io.load(args.input)
    _check_report_input(model)
    summary = _model_summary(model)
    print(_format_summary(args.input, summary, width))
    training, built_by = _training_graph(model, args)
    # Imported here: the analysis is heavier than the rest of the command.
    from ortpass.analysis.recompute import (
        find_applied_recompute,
        find_recompute_candidates,
    )

    candidates = find_recompute_candidates(
        training,
        probe_level=args.probe_level,
        layer_boundary=args.layer_boundary,
        dims=_report_dims(model, args.dims),
        min_elements=args.min_elements,
    )
    applied = find_applied_recompute(training, candidates.dims)
    if built_by is not None:  # stdout saved alone still says which graph the tables describe
        print(*wrap_line(f"analysed: its training graph, built in memory by {built_by}", width), sep="\n")
    print()
    print(_applied_text(applied, width))
    print()
    title = "Recompute plans left" if applied else "Recompute plans, none applied yet"
    print(candidates.to_table(width=width, status=False, title=title))
    if args.plot:
        _refuse_missing_dims(candidates)
    budget = _budget_plan(training, args, candidates.dims) if args.budget is not None else None
    if budget is not None:
        print()
        print(budget.to_table(width))
    # Both outputs are made before either is written: a failure leaves neither.
    record = {
        "model": summary,
        "training_graph": {"built_in_memory_by": built_by},
        "recompute_applied": applied.to_dict(),
        "recompute": candidates.to_dict(),
        **({"budget": budget.to_dict()} if budget is not None else {}),
    }
    text = json.dumps(record, indent=2, default=str) + "\n"
    if args.plot:
        baseline = f"as given: {applied.nodes} nodes recomputed already" if applied else "no recompute"
        written = io.write_with(args.plot, lambda tmp: candidates.plot(tmp, baseline=baseline), suffix=f".{plot_format}")
        logger.info("wrote %s (%s)", written, plot_format.upper())
    if args.json:
        logger.info("wrote %s", io.write_file(args.json, text))
    return 0


def _budget_plan(training: ir.Model, args: argparse.Namespace, dims: dict[str, int] | None) -> Any:
    """What ``recompute(budget=...)`` would choose in ``training`` (the pass's analysis:
    every candidate of the graph, no size floor), at the report's dims."""
    from ortpass.analysis.recompute import find_recompute_candidates
    from ortpass.analysis.recompute.budget import plan_for_budget
    from ortpass.analysis.recompute.timing import CostModel

    whole = find_recompute_candidates(training, probe_level=args.probe_level, dims=dims, min_elements=0)
    return plan_for_budget(training, whole, args.budget, CostModel.for_this_machine())


def training_graph_pipeline() -> str:
    """The default pipeline's text up to and including ``build-training-graph``: what
    ``ortpass optimize`` runs before its post-grad passes."""
    from ortpass.passes import DEFAULT_PIPELINE

    specs = parse_pipeline(DEFAULT_PIPELINE)
    last = next((i for i, s in enumerate(specs) if s.name == "build-training-graph"), None)
    if last is None or last + 1 == len(specs):
        return DEFAULT_PIPELINE if last is not None else "build-training-graph"
    return DEFAULT_PIPELINE[: specs[last + 1].position].rstrip().rstrip(",")


def _training_graph(model: ir.Model, args: argparse.Namespace) -> tuple[ir.Model, str | None]:
    """The model itself if it is a training graph, else the one built from it in memory
    (see the module docstring), and the pipeline that built it (None: given)."""
    if is_training_graph(model):
        return model, None
    refuse_untagged_training_graph(model, args.input)
    if args.no_build:
        raise TrainingGraphError(
            f"{args.input} is not a training graph (its metadata has no forward/backward record from the "
            "gradient build), so there are no stashed activations to analyse; without --no-build the report "
            f"builds one in memory, or save one with `ortpass optimize {args.input} -o train.onnx "
            "--pipeline build-training-graph`"
        )
    require_training_build("ortpass report on a forward model (it builds the training graph in memory)")
    spec = training_graph_pipeline()
    logger.warning(
        "%s is a forward model, not a training graph: analysing the training graph built from it in memory by "
        "the default pipeline up to build-training-graph (to save it: ortpass optimize %s -o train.onnx "
        "--pipeline \"%s\"; --no-build refuses a forward model instead)",
        args.input, args.input, spec,
    )  # fmt: skip
    try:
        return pipeline(spec)(model).model, spec
    except PassFailedError as exc:
        # The report's input is what cannot be analysed (exit 2); `optimize` names the
        # failing pass itself (exit 1), since building is the work it was asked to do.
        raise TrainingGraphError(
            f"{args.input} is a forward model, and building its training graph for the analysis failed: {exc}"
        ) from exc


def _applied_text(applied: Any, width: int | None) -> str:
    """What the graph already recomputes, by op chain; a line saying so where nothing.
    Where the table does not fit the width, each op chain goes on lines under its row."""
    if not applied:
        return "Recompute applied: none (no node of this graph is tagged as a recompute clone)"
    total = "?" if applied.bytes is None else f"{applied.bytes:,}"
    head = (
        f"Recompute applied: {applied.nodes} nodes cloned into backward in {applied.subgraphs} subgraphs, "
        f"recomputing {total} bytes of stashed activations (read from the clones' tags)"
    )
    header = ("", "Freq", "Nodes", "Recomputed(B)", "Recomputed Symbolic(Bytes)", "By", "Ops (graph order)")
    rows = [
        (
            f" - {i}", str(g.subgraphs), str(g.nodes), "?" if g.bytes is None else f"{g.bytes:,}",
            "?" if g.symbolic_bytes is None else str(g.symbolic_bytes), g.created_by, g.chain,
        )
        for i, g in enumerate(applied.groups, 1)
    ]  # fmt: skip
    lines = format_table([header, *rows], rule=False)
    if not fits(lines, width):
        widths = column_widths([header[:-1], *(row[:-1] for row in rows)], width=width, wrap={4})
        lines = render_row(header[:-1], widths)
        for row in rows:
            lines += render_row(row[:-1], widths) + detail_lines("ops", row[-1], width=width, indent=" " * 6)
    return "\n".join([*wrap_line(head, width), *lines])


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


def _format_summary(path: str, s: dict[str, Any], width: int | None) -> str:
    opsets = ", ".join(f"{d} {v}" for d, v in s["opsets"].items())
    lines = [f"model {path}: IR {s['ir_version']}, opsets {opsets}, {s['initializers']} initializers"]
    if s["training"]:
        lines.append(f"training graph: loss {s['training']['loss']!r}, {s['training']['params']} parameters")
    else:
        lines.append("forward model: not a training graph")
    lines.append(f"nodes: {s['nodes']} (" + ", ".join(f"{op} {n}" for op, n in s["ops"].items()) + ")")
    lines = [part for line in lines for part in wrap_line(line, width)]  # the op list: hundreds of characters
    lines += ["inputs:"] + [f"  {name}  {desc}" for name, desc in s["inputs"].items()]
    lines += ["outputs:"] + [f"  {name}  {desc}" for name, desc in s["outputs"].items()]
    return "\n".join(lines)
