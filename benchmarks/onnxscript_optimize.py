"""Benchmark: the ``onnxscript-optimize`` pre-grad pass on ``GPTDecoder``, node counts and
the time of one training step, against the same pipeline without it (ORT, CPU).

Two decoders: the README's (vocab 64, hidden 32, 2 layers, batch 2 x 16) and a larger one
(vocab 1024, hidden 256, 4 layers, batch 8 x 128).  For each, the export runs through
``DEFAULT_PIPELINE`` with and without ``onnxscript-optimize`` in front; reported: nodes of
the export, after the optimizer (and how many of the nodes it removed were Constants
lifted into initializers), after the gradient build and after the whole pipeline, and the
median wall time of a step on one ``TrainingSession`` per graph.  The two sessions take
turns, step by step, so drift on the machine hits both alike.

Results go beside this script: ``onnxscript_optimize.json`` and ``onnxscript_optimize.md``.
Run: ``python3 benchmarks/onnxscript_optimize.py [--steps 30] [--small-only]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

import torch

import ortpass
from ortpass.export import export
from ortpass.passes import DEFAULT_PIPELINE
from ortpass.runtime import TrainingSession
from ortpass.testing.models import GPTDecoder
from ortpass.training import build_training_graph

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the recorded results, apart from the scripts
CONFIGS = {
    "small": dict(model=dict(vocab=64, hidden=32, heads=4, layers=2), batch=2, seq=16),
    "large": dict(model=dict(vocab=1024, hidden=256, heads=8, layers=4, max_seq=128), batch=8, seq=128),
}
NAMES = ["input_ids", "labels"]
DYNAMIC = {name: {0: "batch", 1: "seq"} for name in NAMES}
WARMUP = 3


def run_one(name: str, steps: int) -> dict:
    config = CONFIGS[name]
    torch.manual_seed(0)
    module = GPTDecoder(**config["model"], dropout=0.1)
    ids = torch.randint(0, config["model"]["vocab"], (config["batch"], config["seq"]))
    args = (ids, ids.roll(-1, 1))
    batch = {"input_ids": args[0].numpy(), "labels": args[1].numpy()}
    result: dict = {"config": name, **config}
    sessions = {}
    for variant, text in (("without", DEFAULT_PIPELINE), ("with", f"onnxscript-optimize,{DEFAULT_PIPELINE}")):
        forward = export(module, args, input_names=NAMES, dynamic_axes=DYNAMIC)
        exported = len(forward.graph)
        outcome = ortpass.pipeline(text)(forward)
        records = {record.name: record for record in outcome.report.records}
        entry = {"export_nodes": exported, "training_nodes": records["build-training-graph"].nodes_after,
                 "final_nodes": len(outcome.model.graph), "pipeline_seconds": sum(r.seconds for r in records.values())}
        if "onnxscript-optimize" in records:
            optimize = records["onnxscript-optimize"]
            entry.update(optimized_nodes=optimize.nodes_after, optimizer_seconds=optimize.seconds,
                         constants_lifted=optimize.removed.get("Constant", 0), removed_by_op=optimize.removed,
                         added_by_op=optimize.added)
        # ORT's pre-gradient transformers (the build's ort_fusions) fold shape arithmetic
        # too; without them the optimizer's work shows in the training graph.
        optimized = forward if variant == "without" else _optimized(module, args)
        entry["training_nodes_without_ort_fusions"] = len(build_training_graph(optimized, ort_fusions=False).graph)
        result[variant] = entry
        sessions[variant] = TrainingSession(outcome.model)
    for session in sessions.values():
        for _ in range(WARMUP):
            session.run(batch)
    times = {variant: [] for variant in sessions}
    for _ in range(steps):
        for variant, session in sessions.items():
            start = time.perf_counter()
            session.run(batch)
            times[variant].append(time.perf_counter() - start)
    for variant, samples in times.items():
        result[variant]["step_ms_median"] = 1000 * statistics.median(samples)
        result[variant]["step_ms_min"] = 1000 * min(samples)
    return result


def _optimized(module, args):
    forward = export(module, args, input_names=NAMES, dynamic_axes=DYNAMIC)
    return ortpass.pipeline("onnxscript-optimize")(forward).model


def to_markdown(results: list[dict], steps: int) -> str:
    lines = [
        f"One training step of `GPTDecoder` (dropout 0.1) through `DEFAULT_PIPELINE`, with and without "
        f"`onnxscript-optimize` in front; ORT 1.19.2 CPU, {os.cpu_count()} cores, {platform.python_version()}; "
        f"median (and min) of {steps} steps per graph after {WARMUP} warm-up steps, the two sessions taking turns.  "
        "*Constants lifted*: of the nodes the optimizer removed, the Constant nodes it made initializers.  "
        "*No ORT fusions*: the training graph built with `ort_fusions=False` (ORT's pre-gradient transformers, "
        "which the default build runs, fold the same shape arithmetic).",
        "",
        "| decoder | batch x seq | export nodes | after optimizer | constants lifted | training graph: without | with "
        "| after pipeline: without | with | no ORT fusions: without | with | step ms: without | with | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        without, with_ = r["without"], r["with"]
        lines.append(
            f"| {r['config']} ({r['model']['hidden']} hidden, {r['model']['layers']} layers) | {r['batch']} x {r['seq']} "
            f"| {without['export_nodes']} | {with_['optimized_nodes']} | {with_['constants_lifted']} "
            f"| {without['training_nodes']} | {with_['training_nodes']} | {without['final_nodes']} | {with_['final_nodes']} "
            f"| {without['training_nodes_without_ort_fusions']} | {with_['training_nodes_without_ort_fusions']} "
            f"| {without['step_ms_median']:.2f} ({without['step_ms_min']:.2f}) "
            f"| {with_['step_ms_median']:.2f} ({with_['step_ms_min']:.2f}) "
            f"| {with_['step_ms_median'] / without['step_ms_median']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--small-only", action="store_true")
    args = parser.parse_args()
    names = ["small"] if args.small_only else list(CONFIGS)
    results = [run_one(name, args.steps) for name in names]
    (RESULTS / "onnxscript_optimize.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = to_markdown(results, args.steps)
    (RESULTS / "onnxscript_optimize.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
