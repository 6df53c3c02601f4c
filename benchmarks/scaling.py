"""How ortpass's passes scale with graph size, side by side with ORT 1.19.2's C++ memory optimizer.

Graphs: the GPT-like decoder of ``ortpass.testing.models`` (hidden 64, 4 heads, vocab 128,
batch 2, seq 128, dropout 0.1) at several layer counts, exported and built into a training
graph.  Two flavours:

- ``static``: every dim concrete.  Layers 2, 8, 24, 48 and, to reach ~50k training-graph
  nodes (~91 per layer), 192 and 576;
- ``dynamic``: batch and seq symbolic (``dynamic_axes``), as ORTModule exported; the
  training graph has ~35% more nodes (shape arithmetic) and the recompute analysis
  evaluates symbolic sizes.

For each graph, in a fresh subprocess with a time limit (a configuration that runs past it
is recorded as timed out):

- the whole pipeline from the forward model, through ``ortpass.PassManager`` in its
  default check mode (the checker's rules on the IR for the input and after every pass,
  the onnx checker itself on the output): ``pythonop-shape-inference``,
  ``insert-gather-before-sce-loss``, ``build-training-graph``,
  ``fix-dropout-seed(level=1)``, ``recompute(level=1)``, both with ``min_elements=0``
  (the default floor of 1Mi elements, ORT's, leaves nothing to recompute in graphs this
  narrow; ORT's own analysis reports plans for them, so both sides apply plans), then
  ``replay-dropout-mask`` and ``order-backward-joins`` (the post-grad passes of the CLI's
  default pipeline).  Per pass: the pass's own seconds and the manager's check seconds,
  separately; the final check; the manager's overhead (the input check, copying the
  model, the before/after node diff) is the wall time minus those;
- the post-grad passes alone on the training graph, once in each check mode of
  ``PassManager`` (``full``; ``incremental``: the checker's rules on the IR for the
  input and after each pass, the onnx checker on the output; ``none``): the manager's
  wall time and its check seconds;
- ORT's own optimizer on the graph ORTModule would run (``OrtModuleGraphBuilder``'s
  gradient graph of the same forward nodes): session creation without and with the
  memory optimizer at level 1 (``optimization.memory_optimizer_config`` = a JSON file
  holding ORT's layer-wise type-1 plans, ``optimization.enable_memory_probe_recompute_config``
  = ``"1:1"``); the MemoryOptimizer transformer alone, from the timestamps of ORT's INFO
  log of that session creation (what it adds to a session also counts ORT's other
  transformers running again over the graph it changed, and the difference of two
  session timings is noisy on large graphs; the INFO lines it writes itself are counted
  in its time, which favours ortpass slightly); and ORT's analysis call alone
  (``TrainingAgent.get_serialized_ortmodule_memory_stat``).

Then per pass, over the static graphs: ms per 1k nodes and the exponent of a log-log fit
of seconds against node count (1 = linear).  Results go to ``scaling.json`` and
``scaling.md`` next to this script.

Run: ``python3 benchmarks/scaling.py`` (about 15 minutes on 2 cores); ``--quick`` runs
2 and 8 layers only; ``--limit S`` sets the per-configuration time limit (default 600 s);
``--static-layers`` chooses the static layer counts; ``--ort-max-layers N`` (default 192)
times ORT's side only up to N layers (the 576-layer graph, ~52k training nodes, then
times ortpass alone, in about 2 minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from typing import Iterator

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the recorded results, apart from the scripts

# Up to the training graph: what ORT's own optimizer is given.
TRAINING_PIPELINE = "pythonop-shape-inference,insert-gather-before-sce-loss,build-training-graph"
POST_GRAD_PASSES = ("fix-dropout-seed", "recompute", "replay-dropout-mask", "order-backward-joins")
POST_GRAD_PIPELINE = "fix-dropout-seed(level=1,min_elements=0),recompute(level=1,min_elements=0),replay-dropout-mask,order-backward-joins"
PIPELINE = TRAINING_PIPELINE + "," + POST_GRAD_PIPELINE
STATIC_LAYERS = (2, 8, 24, 48, 192, 576)
DYNAMIC_LAYERS = (2, 8, 24, 48)
BATCH, SEQ = 2, 128
REPEATS = 3


# -- one configuration (runs in a child process) ------------------------------------------


def export_forward(layers: int, dynamic: bool):
    import torch

    from ortpass.export import export
    from ortpass.testing.models import GPTDecoder

    torch.manual_seed(0)
    module = GPTDecoder(vocab=128, hidden=64, heads=4, layers=layers, max_seq=SEQ, dropout=0.1)
    ids = torch.randint(0, 128, (BATCH, SEQ))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}} if dynamic else None
    return export(module, (ids, ids), input_names=["input_ids", "labels"], dynamic_axes=axes)


def time_pipeline(forward) -> dict:
    import ortpass

    manager = ortpass.pipeline(PIPELINE)
    gc.collect()  # so that no earlier garbage is collected inside the timing
    start = time.perf_counter()
    result = manager(forward)
    wall = time.perf_counter() - start
    passes = [
        {
            "pass": r.name,
            "seconds": r.seconds,
            "check_seconds": r.check_seconds,
            "nodes_before": r.nodes_before,
            "nodes_after": r.nodes_after,
            "modified": r.modified,
        }
        for r in result.report.records
    ]
    final_check = result.report.final_check_seconds
    accounted = sum(p["seconds"] + p["check_seconds"] for p in passes) + final_check
    return {
        "wall_seconds": wall,
        "final_check_seconds": final_check,
        "manager_overhead_seconds": wall - accounted,
        "passes": passes,
    }, result.model


CHECK_MODES = ("full", "incremental", "none")


def time_post_grad_by_check_mode(training) -> dict:
    """The post-grad passes alone on the training graph, in each check mode: the
    manager's wall time, the passes' and the checks' seconds (the incremental mode's
    final check included)."""
    import ortpass

    timings = {}
    for mode in CHECK_MODES:
        manager = ortpass.pipeline(POST_GRAD_PIPELINE, assume=["training-graph"], check=mode)
        gc.collect()  # the runs before left cycles the collector would free inside this timing
        start = time.perf_counter()
        report = manager(training).report
        timings[mode] = {
            "wall_seconds": time.perf_counter() - start,
            "pass_seconds": sum(r.seconds for r in report.records),
            "check_seconds": sum(r.check_seconds for r in report.records) + report.final_check_seconds,
        }
    return timings


def time_ort_optimizer(training) -> dict:
    """Session creation without/with ORT's memory optimizer (level 1), and its analysis."""
    import onnxruntime as ort

    sys.path.insert(0, str(HERE))
    from recompute_vs_ort_analysis import forward_model_for_ort, ort_module_gradient_graph, ort_training_agent

    from ortpass.analysis import get_training_info

    params = list(get_training_info(training).params)
    gradient_model, info = ort_module_gradient_graph(forward_model_for_ort(training), params)

    def create(entries: dict[str, str], severity: int = 3):
        options = ort.SessionOptions()
        options.log_severity_level = severity
        for key, value in entries.items():
            options.add_session_config_entry(key, value)
        start = time.perf_counter()
        session = ort.InferenceSession(gradient_model, options, providers=["CPUExecutionProvider"])
        return session, time.perf_counter() - start

    create({})  # warm ORT's one-time initialization so that both timings below are alike
    # Session creation varies by a few ms from run to run: keep the fastest of REPEATS.
    session, plain = min((create({}) for _ in range(REPEATS)), key=lambda pair: pair[1])
    agent = ort_training_agent(session, info)
    with tempfile.TemporaryDirectory() as tmp:
        empty = os.path.join(tmp, "none.json")
        pathlib.Path(empty).write_text("[]")
        start = time.perf_counter()
        _, stats = agent.get_serialized_ortmodule_memory_stat(empty, "1:1", False)
        analysis = time.perf_counter() - start
        plans = sorted(plan for plan in stats if plan.split(":")[1] == "1")
        plan_file = os.path.join(tmp, "plans.json")
        pathlib.Path(plan_file).write_text(json.dumps(plans))
        entries = {
            "optimization.memory_optimizer_config": plan_file,
            "optimization.enable_memory_probe_recompute_config": "1:1",
        }
        optimized = min(create(entries)[1] for _ in range(REPEATS))
        log_file = os.path.join(tmp, "ort.log")
        transformer = []
        for _ in range(REPEATS):
            with _stderr_to(log_file):
                create(entries, severity=1)
            transformer.append(memory_optimizer_seconds(pathlib.Path(log_file).read_text(errors="replace")))
    return {
        "ort_graph_nodes": _count_nodes(gradient_model),
        "session_seconds_without": plain,
        "session_seconds_with": optimized,
        "optimizer_seconds": optimized - plain,
        "analysis_seconds": analysis,
        "transformer_seconds": None if None in transformer else min(transformer),
        "plans": plans,
    }


@contextlib.contextmanager
def _stderr_to(path: str) -> Iterator[None]:
    """Send what is written to file descriptor 2 (ORT's C++ log) to ``path`` meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(target, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(target)
        os.close(saved)


# ORT logs "GraphTransformer <name> modified: <0|1> ..." at INFO when a transformer's
# ApplyImpl returns, before the graph is resolved again.
_TRANSFORMER_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d+) \[I:onnxruntime:.*GraphTransformer (\w+) modified: (\d)"
)


def memory_optimizer_seconds(log: str) -> float | None:
    """How long ORT's MemoryOptimizer transformer ran, from an INFO log of session creation:
    the time from the line of the transformer before it to its own line.  Counted only
    where the one before changed nothing (so no Resolve of the graph falls in between);
    None when no such occurrence is logged."""
    import datetime

    stamps = []
    for line in log.splitlines():
        match = _TRANSFORMER_LINE.match(line)
        if match:
            whole = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            # Seconds and their fraction apart: a float of both loses the nanoseconds.
            stamps.append(((whole, float("0." + match.group(2))), match.group(3), match.group(4) == "1"))
    spans = [
        (after[0] - before[0]) + (after[1] - before[1])
        for (before, _, changed), (after, name, _) in zip(stamps, stamps[1:])
        if name == "MemoryOptimizer" and not changed
    ]
    return sum(spans) if spans else None


def _count_nodes(model_bytes: bytes) -> int:
    import onnx

    return len(onnx.load_from_string(model_bytes).graph.node)


def run_one(layers: int, dynamic: bool, with_ort: bool = True) -> dict:
    start = time.perf_counter()
    forward = export_forward(layers, dynamic)
    export_seconds = time.perf_counter() - start
    pipeline, _ = time_pipeline(forward)
    result = {
        "layers": layers,
        "mode": "dynamic" if dynamic else "static",
        "forward_nodes": len(forward.graph),
        "training_nodes": next(p["nodes_after"] for p in pipeline["passes"] if p["pass"] == "build-training-graph"),
        "export_seconds": export_seconds,
        "pipeline": pipeline,
    }
    # ORT's side creates its session several times; past a few hundred layers that alone
    # outlasts the time limit, so the largest graphs may time ortpass only.
    # ORT's optimizer gets the training graph as build-training-graph made it (recompute
    # drops forward outputs, like Dropout masks, that ORT's gradient builder needs).
    training = training_graph(forward)
    result["post_grad_by_check_mode"] = time_post_grad_by_check_mode(training)
    result["ort"] = time_ort_optimizer(training) if with_ort else None
    return result


def training_graph(forward):
    import ortpass

    return ortpass.pipeline(TRAINING_PIPELINE)(forward).model


# -- the driver -----------------------------------------------------------------------------


def run_child(layers: int, dynamic: bool, limit: float, with_ort: bool = True) -> dict:
    argv = [sys.executable, __file__, "--one", str(layers), "--mode", "dynamic" if dynamic else "static"]
    if not with_ort:
        argv.append("--no-ort")
    base = {"layers": layers, "mode": "dynamic" if dynamic else "static"}
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {**base, "timed_out": True, "limit_seconds": limit}
    if done.returncode != 0:
        return {**base, "error": done.stderr[-2000:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["child_seconds"] = time.perf_counter() - start
    return result


def post_grad_seconds(result: dict) -> float:
    """The post-grad part of the pipeline: passes after the gradient build, with checks."""
    passes = result["pipeline"]["passes"]
    after = [p for p in passes[[p["pass"] for p in passes].index("build-training-graph") + 1 :]]
    return sum(p["seconds"] + p["check_seconds"] for p in after)


def fit_exponent(points: list[tuple[float, float]]) -> float | None:
    """Slope of log(seconds) against log(nodes), least squares."""
    points = [(math.log(n), math.log(s)) for n, s in points if n > 0 and s > 0]
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


def summarize(results: list[dict]) -> dict:
    """Per mode and per timed quantity: ms per 1k training nodes at each size, and the exponent."""
    summary: dict = {}
    for mode in ("static", "dynamic"):
        done = [r for r in results if r["mode"] == mode and "pipeline" in r]
        series: dict[str, list[tuple[float, float]]] = {}
        for r in done:
            n = r["training_nodes"]
            for p in r["pipeline"]["passes"]:
                series.setdefault(f"{p['pass']} (pass)", []).append((n, p["seconds"]))
                series.setdefault(f"{p['pass']} (check)", []).append((n, p["check_seconds"]))
            series.setdefault("final check (onnx checker on the output)", []).append((n, r["pipeline"]["final_check_seconds"]))
            series.setdefault("manager overhead", []).append((n, r["pipeline"]["manager_overhead_seconds"]))
            series.setdefault("post-grad passes + checks", []).append((n, post_grad_seconds(r)))
            for check, timing in r["post_grad_by_check_mode"].items():
                series.setdefault(f"post-grad alone, manager wall, check={check}", []).append((n, timing["wall_seconds"]))
            series.setdefault("whole pipeline (wall)", []).append((n, r["pipeline"]["wall_seconds"]))
            if r["ort"] is not None:
                series.setdefault("ORT memory optimizer (session with - without)", []).append((n, max(r["ort"]["optimizer_seconds"], 1e-6)))
                series.setdefault("ORT analysis call", []).append((n, r["ort"]["analysis_seconds"]))
                if r["ort"].get("transformer_seconds") is not None:
                    series.setdefault("ORT MemoryOptimizer transformer (from its log)", []).append(
                        (n, r["ort"]["transformer_seconds"])
                    )
        summary[mode] = {
            name: {
                "ms_per_1k_nodes": {str(int(n)): 1e6 * s / n for n, s in pts},
                "exponent": fit_exponent(pts),
            }
            for name, pts in series.items()
        }
    return summary


def _check_modes_cell(result: dict) -> str:
    timings = result["post_grad_by_check_mode"]
    return " / ".join(
        f"{1e3 * timings[m]['wall_seconds']:.0f}" + (f" ({1e3 * timings[m]['check_seconds']:.0f})" if m != "none" else "")
        for m in CHECK_MODES
    )


def to_markdown(results: list[dict], summary: dict) -> str:
    lines = ["# Scaling: ortpass pipeline vs ORT 1.19.2's C++ memory optimizer", "",
             f"GPT-like decoder, hidden 64, 4 heads, batch {BATCH}, seq {SEQ}; pipeline `{PIPELINE}`; "
             "2 cores. Times in ms.", ""]
    columns = ["mode", "layers", "training nodes", "ORT graph nodes", *POST_GRAD_PASSES, "post-grad checks",
               "post-grad total", "post-grad alone, manager wall (checks): full / incremental / none",
               "whole pipeline (wall)",
               "ORT optimizer: session + (of a session without)", "ORT MemoryOptimizer transformer",
               "ORT analysis"]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in results:
        if "pipeline" not in r:
            why = f"timed out after {r['limit_seconds']:.0f} s" if r.get("timed_out") else "failed"
            lines.append(f"| {r['mode']} | {r['layers']} | {why} |" + " |" * (len(columns) - 3))
            continue
        by = {p["pass"]: p for p in r["pipeline"]["passes"]}
        checks = sum(by[n]["check_seconds"] for n in POST_GRAD_PASSES)
        pass_cells = " | ".join(f"{1e3 * by[n]['seconds']:.0f}" for n in POST_GRAD_PASSES)
        ort = r["ort"]
        ort_cells = (
            (
                str(ort["ort_graph_nodes"]),
                f"{1e3 * ort['optimizer_seconds']:.0f} (of {1e3 * ort['session_seconds_without']:.0f})",
                "-" if ort.get("transformer_seconds") is None else f"{1e3 * ort['transformer_seconds']:.1f}",
                f"{1e3 * ort['analysis_seconds']:.1f}",
            )
            if ort is not None
            else ("not run", "not run", "not run", "not run")
        )
        lines.append(
            f"| {r['mode']} | {r['layers']} | {r['training_nodes']} | {ort_cells[0]} | "
            f"{pass_cells} | "
            f"{1e3 * checks:.0f} | {1e3 * post_grad_seconds(r):.0f} | {_check_modes_cell(r)} | "
            f"{1e3 * r['pipeline']['wall_seconds']:.0f} | "
            f"{ort_cells[1]} | {ort_cells[2]} | {ort_cells[3]} |"
        )
    for mode, series in summary.items():
        if not series:
            continue
        lines += ["", f"## {mode}: ms per 1k training nodes, and the log-log exponent", ""]
        sizes = sorted({k for s in series.values() for k in s["ms_per_1k_nodes"]}, key=int)
        lines += ["| quantity | " + " | ".join(f"{n} nodes" for n in sizes) + " | exponent |",
                  "|---|" + "---|" * (len(sizes) + 1)]
        for name, s in series.items():
            cells = [f"{s['ms_per_1k_nodes'][n]:.2f}" if n in s["ms_per_1k_nodes"] else "" for n in sizes]
            exponent = f"{s['exponent']:.2f}" if s["exponent"] is not None else "-"
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {exponent} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="static", choices=("static", "dynamic"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="2 and 8 layers only")
    parser.add_argument("--limit", type=float, default=600.0, help="seconds per configuration")
    parser.add_argument("--no-ort", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--ort-max-layers", type=int, default=192, metavar="N",
        help="time ORT's optimizer only up to N layers (default 192; beyond, its repeated session creations outlast the limit)",
    )
    parser.add_argument(
        "--static-layers", type=int, nargs="+", default=list(STATIC_LAYERS),
        help=f"layer counts of the static graphs (default {' '.join(map(str, STATIC_LAYERS))})",
    )
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.mode == "dynamic", with_ort=not args.no_ort)))
        return
    static = (2, 8) if args.quick else tuple(args.static_layers)
    dynamic = (2, 8) if args.quick else DYNAMIC_LAYERS
    results = []
    for mode, layer_counts in (("static", static), ("dynamic", dynamic)):
        for layers in layer_counts:
            result = run_child(layers, mode == "dynamic", args.limit, with_ort=layers <= args.ort_max_layers)
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k not in ("pipeline", "ort")}), flush=True)
    summary = summarize(results)
    markdown = to_markdown(results, summary)
    print(markdown)
    suffix = "_quick" if args.quick else ""
    (RESULTS / f"scaling{suffix}.json").write_text(json.dumps({"results": results, "summary": summary}, indent=1))
    (RESULTS / f"scaling{suffix}.md").write_text(markdown)


if __name__ == "__main__":
    main()
