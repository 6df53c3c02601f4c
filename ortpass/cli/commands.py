"""The subcommands ``optimize`` and ``golden``, and what every command shares: the width
its tables fit (``list-passes``: :mod:`ortpass.cli.listing`; ``report``:
:mod:`ortpass.cli.report`).

``optimize`` on a training graph: the model's metadata records the gradient build
(:func:`ortpass.analysis.partition.is_training_graph`, its record checked by
:func:`~ortpass.analysis.partition.get_training_info`), so the command assumes the
``training-graph`` property the post-grad passes require, as ``PassManager(assume=...)``
does in Python.  The detection is sound because that record is what the post-grad passes
read to tell forward from backward; a graph without it cannot be run by them at all.  A
pipeline that does not fit the model is refused before any pass runs, naming the way out:
post-grad passes on a forward model, and pre-grad passes or a second gradient build on a
training graph (which ``build-training-graph`` would refuse only after the pre-grad
passes had rewritten the training graph).  Nothing else is assumed: whether a saved
graph's dropouts are seeded for a given set of plans cannot be read from it, so
``recompute`` still needs ``fix-dropout-seed`` beside it.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path
from typing import Sequence

import onnx_ir as ir

from ortpass import io
from ortpass.analysis.partition import get_training_info, is_training_graph
from ortpass.cli.errors import UsageError
from ortpass.cli.outputs import check_outputs, dump_files, plan_files
from ortpass.conventions import SIDE_KEY, TRAINING_GRAPH, TRAINING_KEY
from ortpass.errors import (
    OrtpassError,
    PassFailedError,
    PassOrderingError,
    TrainingGraphError,
)
from ortpass.infra.base import pass_name_of
from ortpass.infra.instruments import ProgressInstrument
from ortpass.infra.manager import PassManager
from ortpass.infra.pipeline_text import passes_from_text
from ortpass.infra.registry import available_passes, get_pass
from ortpass.training.backend import require_training_build

logger = logging.getLogger(__name__)

#: The width of a table when stdout is not a terminal (a pipe, a file, a test).
DEFAULT_WIDTH = 100
#: The narrowest width a table is fitted to (a narrower terminal gets lines that wrap).
MIN_WIDTH = 40


def table_width(args: argparse.Namespace) -> int | None:
    """The characters a table line may take: None with ``--wide`` (whole tables), else the
    terminal's width (``COLUMNS`` where set), :data:`DEFAULT_WIDTH` when not a terminal."""
    if getattr(args, "wide", False):
        return None
    return max(shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns, MIN_WIDTH)


def run_optimize(args: argparse.Namespace) -> int:
    if args.output is None and not args.in_place:
        raise UsageError("no output: give -o OUT.onnx, or --in-place to replace the input")
    output = Path(args.output if args.output is not None else args.input)
    passes = passes_from_text(args.pipeline)
    inputs = [("IN", Path(args.input)), *plan_files(args.pipeline)]
    outputs = [("-o", output)]
    if args.report:
        outputs.append(("--report", Path(args.report)))
    if args.dump_dir and Path(args.dump_dir).is_file():
        raise UsageError(f"--dump-dir {args.dump_dir} is a file, not a directory")
    check_outputs(inputs, outputs, in_place=args.in_place)  # before the model is read

    model = io.load(args.input)
    assume = assumed_properties(model, passes, args.input)
    manager = PassManager(passes, assume=assume, dump_dir=args.dump_dir, instruments=[ProgressInstrument()])
    logger.debug("pipeline %r runs as %s", args.pipeline, manager)
    if args.dump_dir:  # their names follow the order, known once the manager is built
        check_outputs(inputs, outputs + dump_files(manager, Path(args.dump_dir)), in_place=args.in_place)
    try:
        result = manager(model)
    except PassFailedError as exc:
        if args.report and exc.report is not None:
            exc.report.save(args.report)  # what the failing run did, as asked; no model is written
        raise
    print(result.report.to_table(width=table_width(args)))
    io.save(result.model, output, overwrite=True, serialized=result.proto)
    if args.report:
        result.report.save(args.report)
        logger.info("wrote the report to %s", args.report)
    return 0


def assumed_properties(model: ir.Model, passes: Sequence[ir.passes.PassBase], name: str) -> frozenset[str]:
    """The properties ``model`` has before any pass: ``training-graph`` for a training
    graph.  Refuses a pipeline that does not fit the model (see the module docstring)."""
    builders = [pass_name_of(p) for p in passes if TRAINING_GRAPH in getattr(p, "provides_properties", ())]
    phases = {pass_name_of(p): getattr(p, "phase", "any") for p in passes}
    refuse_untagged_training_graph(model, name)
    if not is_training_graph(model):
        post = [n for n, phase in phases.items() if phase == "post-grad"]
        if post and not builders:
            raise PassOrderingError(
                f"{name} is a forward model, not a training graph (its metadata has no record of the gradient "
                f"build), and {_passes_run(post)} on a training graph: add build-training-graph to the "
                f"pipeline, or give a training graph (`ortpass optimize {name} -o train.onnx --pipeline "
                "build-training-graph` saves one)"
            )
        _refuse_unprovided(passes, set())
        if builders:  # before any pass runs: stock onnxruntime has no gradient builder
            require_training_build(f"ortpass optimize on a forward model ({_names(builders)} builds its training graph)")
        return frozenset()
    get_training_info(model)  # a malformed record is refused here, named
    example = 'e.g. --pipeline "fix-dropout-seed(level=1),recompute(level=1)"'
    if builders:
        raise PassOrderingError(
            f"{name} is a training graph already (its metadata records the gradient build), and the pipeline "
            f"builds one ({_names(builders)}); give the forward model, or only post-grad passes, {example}"
        )
    pre = [n for n, phase in phases.items() if phase == "pre-grad"]
    if pre:
        raise PassOrderingError(
            f"{name} is a training graph already (its metadata records the gradient build), and "
            f"{_passes_run(pre)} on the forward model, before build-training-graph: run the pipeline on the "
            "forward model, or leave them out"
        )
    _refuse_unprovided(passes, {TRAINING_GRAPH})
    logger.info("%s is a training graph (its metadata records the gradient build): the passes run on it as it is", name)
    return frozenset({TRAINING_GRAPH})


def refuse_untagged_training_graph(model: ir.Model, name: str) -> None:
    """Refuse a model whose nodes the gradient build tagged forward/backward but whose
    training-graph record is gone (edited, or damaged): it is neither a forward model to
    build from nor a training graph the post-grad passes can read."""
    if is_training_graph(model):
        return
    if any(SIDE_KEY in node.metadata_props for node in model.graph.all_nodes()):
        raise TrainingGraphError(
            f"{name} has nodes the gradient build tagged ({SIDE_KEY!r} node metadata) but no training-graph "
            f"record ({TRAINING_KEY!r} model metadata): the record was removed or damaged; save the training "
            "graph again from the forward model"
        )


def _refuse_unprovided(passes: Sequence[ir.passes.PassBase], assumed: set[str]) -> None:
    """A requirement nothing in the pipeline provides, named with the registered passes
    that provide it (the manager's own message suggests ``assume=``, which is Python's)."""
    provided = assumed | {prop for p in passes for prop in getattr(p, "provides_properties", ())}
    for pass_ in passes:
        for prop in sorted(set(getattr(pass_, "requires_properties", ())) - provided):
            providers = [n for n in sorted(available_passes()) if prop in _provides(n)]
            add = f"add {_names(providers)} to the pipeline" if providers else "no registered pass provides it"
            raise PassOrderingError(
                f"pass {pass_name_of(pass_)!r} requires {prop!r}, which no pass in the pipeline provides: {add}"
                + (' (with the same plan options, e.g. --pipeline "fix-dropout-seed(level=1),recompute(level=1)")'
                   if pass_name_of(pass_) == "recompute" else "")
            )  # fmt: skip


def _provides(name: str) -> frozenset[str]:
    try:
        return frozenset(getattr(get_pass(name), "provides_properties", ()))
    except OrtpassError:  # a plugin that does not load provides nothing here
        return frozenset()


def _names(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _passes_run(names: Sequence[str]) -> str:
    return f"pass {names[0]!r} runs" if len(names) == 1 else f"passes {_names(names)} run"


def run_golden(args: argparse.Namespace) -> int:
    from ortpass import golden  # imports torch: only this command needs it

    directory = Path(args.dir).resolve()
    if not directory.is_dir():
        raise UsageError(f"golden model directory {directory} does not exist; give one with --dir")
    logger.info("golden: importing and running the case files of %s", directory)
    try:
        if args.action == "update":
            _print_updates(golden.update(args.dir, args.names))
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


def _print_updates(updates: Sequence[object]) -> None:
    """One line a golden model: what was rewritten and why, or that nothing changed beyond
    the check's tolerance; then the totals."""
    for update in updates:
        kept = ", ".join(p.name for p in update.unchanged)
        if not update.changed:
            print(f"{update.name}: unchanged (nothing differs beyond the check's tolerance; kept {kept})")
            continue
        print(
            f"{update.name}: rewrote {', '.join(p.name for p in update.written)}"
            + (f", kept {kept}" if kept else "")
            + f" ({len(update.differences)} difference{'s' if len(update.differences) != 1 else ''} beyond the "
            "check's tolerance)"
        )
        for line in update.differences:
            print(f"  {line}")
    rewritten = [u.name for u in updates if u.changed]
    unchanged = [u.name for u in updates if not u.changed]
    print(
        f"golden update: {len(rewritten)} rewritten ({', '.join(rewritten) or 'none'}), "
        f"{len(unchanged)} unchanged ({', '.join(unchanged) or 'none'})"
    )
