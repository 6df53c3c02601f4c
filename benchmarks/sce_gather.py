"""Benchmark: one training step of a large-vocabulary loss head, with and without
InsertGatherBeforeSceLossPass, at several label densities, on ONNX Runtime (CPU).

The model is ``Linear(hidden -> vocab)`` + ``CrossEntropyLoss`` on ``rows`` label rows,
exported with ``ortpass.export.export``.  Three training graphs:

- ``without``: the export as is;
- ``before loss``: the pass as ORT placed the gathers, right before the loss;
- ``above projection``: the pass with ``move_above_projection=True``, the logits' gather
  moved above the Linear.

The pass runs with ``force=True`` so that dense batches, which the export probe would not
flag, are measured too.  Each graph runs on one ORT session over batches whose labels are
valid at the given density and -100 elsewhere.

Reported per density: the median wall time of a step (forward + backward), and the time
ORT's profiler attributes to the loss part of the graph -- every node except the Linear's
matmuls and bias reduction: the softmax cross-entropy, its gradient, and what the pass adds
(Sub, NonZero, Squeeze, two ShrunkenGathers and the GatherGrad that scatters the gradient
back).  With the gathers before the loss the Linear costs the same as without; above the
projection, the Linear runs on the valid rows too.

Results go beside this script: ``sce_gather_results.json`` and ``sce_gather_results.md``.
Run: ``python3 benchmarks/sce_gather.py [--rows 8192 --hidden 256 --vocab 32000 --steps 2]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import platform
import statistics
import tempfile
import time

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch
from torch import nn

from ortpass.export import export
from ortpass.export.density import DEFAULT_THRESHOLD
from ortpass.passes.insert_gather_before_sce_loss import InsertGatherBeforeSceLossPass
from ortpass.runtime.session import DISABLED_ORT_OPTIMIZERS
from ortpass.training import build_training_graph, clamp_for_ort

logger = logging.getLogger("benchmarks.sce_gather")

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the recorded results, apart from the scripts
IGNORE_INDEX = -100
DENSITIES = (10, 50, 90, 100)
VARIANTS = ("without", "before loss", "above projection")
SESSION_WARMUP_RUNS = 2
# Nodes of the Linear (forward, weight and input gradients, bias gradient); the rest is the loss.
LINEAR_OPS = frozenset({"Gemm", "MatMul", "FusedMatMul", "Transpose", "ReduceSum", "Identity"})


class LossHead(nn.Module):
    """The last layer of a language model and its loss."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.proj = nn.Linear(hidden, vocab)
        self.loss = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.proj(hidden_states), labels)


def padded_labels(rows: int, vocab: int, density: int, rng: np.random.Generator) -> np.ndarray:
    """Labels valid at exactly ``density`` percent of the rows (random positions)."""
    labels = np.full(rows, IGNORE_INDEX, dtype=np.int64)
    valid = rng.choice(rows, size=rows * density // 100, replace=False)
    labels[valid] = rng.integers(0, vocab, size=valid.size)
    return labels


def training_graphs(rows: int, hidden: int, vocab: int) -> dict[str, ir.Model]:
    torch.manual_seed(0)
    module = LossHead(hidden, vocab)
    sample = (torch.randn(rows, hidden), torch.from_numpy(padded_labels(rows, vocab, 50, np.random.default_rng(0))))
    # No probe: the benchmark decides per variant whether the pass runs.
    forward = export(module, sample, input_names=["hidden_states", "labels"], density_threshold=None)
    graphs = {"without": build_training_graph(forward)}
    for variant, move in (("before loss", False), ("above projection", True)):
        model = ir.from_proto(ir.to_proto(forward))
        pass_ = InsertGatherBeforeSceLossPass(force=True, move_above_projection=move)
        pass_(model)
        if pass_.stats["counts"].get("gathers moved above the projection", 0) != int(move):
            raise RuntimeError(f"the pass did not rewrite the loss head as expected: {pass_.stats}")
        graphs[variant] = build_training_graph(model)
    return graphs


class ProfiledSession:
    """An ORT session over a training graph that profiles its nodes."""

    def __init__(self, model: ir.Model, profile_dir: str, tag: str):
        proto = ir.to_proto(model)
        clamp_for_ort(proto)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(profile_dir, tag)
        self.session = ort.InferenceSession(
            proto.SerializeToString(), options, providers=["CPUExecutionProvider"],
            disabled_optimizers=list(DISABLED_ORT_OPTIMIZERS),
        )  # fmt: skip
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.op_types = {node.name: node.op_type for node in proto.graph.node}

    def step(self, feeds: dict[str, np.ndarray]) -> tuple[float, float, list[np.ndarray]]:
        """Wall ms, CPU ms (all threads of this process) and the outputs of one step."""
        wall, cpu = time.perf_counter(), time.process_time()
        values = self.session.run(self.outputs, feeds)
        return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3, values

    def loss_part_ms_per_run(self) -> list[float]:
        """Per run (in order), the kernel time of the nodes outside the Linear, in ms."""
        with open(self.session.end_profiling()) as f:
            events = json.load(f)
        runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
        totals = [0.0] * len(runs)
        for event in events:
            if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
                continue
            op_type = event.get("args", {}).get("op_name") or self.op_types.get(event["name"][: -len("_kernel_time")])
            if op_type in LINEAR_OPS:
                continue
            index = next((i for i, (begin, end) in enumerate(runs) if begin <= event["ts"] <= end), None)
            if index is not None:
                totals[index] += event["dur"] / 1e3
        return totals


def measure(args: argparse.Namespace) -> list[dict]:
    graphs = training_graphs(args.rows, args.hidden, args.vocab)
    rng = np.random.default_rng(1)
    hidden_states = rng.standard_normal((args.rows, args.hidden)).astype(np.float32)
    batches = {d: {"hidden_states": hidden_states, "labels": padded_labels(args.rows, args.vocab, d, rng)} for d in DENSITIES}
    results = {d: {"density": d, "flagged_at_export": d < DEFAULT_THRESHOLD} for d in DENSITIES}
    with tempfile.TemporaryDirectory() as profile_dir:
        for variant, model in graphs.items():
            session = ProfiledSession(model, profile_dir, variant.replace(" ", "_"))
            # ORT plans its memory on the first run and allocates the plan on the second:
            # two runs on the largest batch let the arena reach full size before any timing.
            for _ in range(SESSION_WARMUP_RUNS):
                session.step(batches[max(DENSITIES)])
            timed_runs = []  # indices of the timed runs among all runs, for the profile
            run_index = SESSION_WARMUP_RUNS
            for density in DENSITIES:
                step_ms, cpu_ms, losses = [], [], []
                for step in range(args.warmup + args.steps):
                    ms, cpu, values = session.step(batches[density])
                    if step >= args.warmup:
                        step_ms.append(ms)
                        cpu_ms.append(cpu)
                        timed_runs.append((density, run_index))
                        losses.append(float(values[0]))
                    run_index += 1
                results[density][f"step_ms_{variant}"] = statistics.median(step_ms)
                # CPU time is less disturbed than wall time when other jobs share the cores.
                results[density][f"step_cpu_ms_{variant}"] = statistics.median(cpu_ms)
                results[density][f"loss_{variant}"] = losses[0]
                logger.info("%s pass, density %d%%: %.0f ms/step", variant, density, statistics.median(step_ms))
            per_run = session.loss_part_ms_per_run()
            for density in DENSITIES:
                loss_ms = [per_run[i] for d, i in timed_runs if d == density]
                results[density][f"loss_part_ms_{variant}"] = statistics.median(loss_ms)
            del session  # one large session alive at a time: each holds GBs of activations
    rows = []
    for density in DENSITIES:
        r = results[density]
        for variant in VARIANTS[1:]:
            r[f"step_ratio_{variant}"] = r[f"step_ms_{variant}"] / r["step_ms_without"]
            r[f"step_cpu_ratio_{variant}"] = r[f"step_cpu_ms_{variant}"] / r["step_cpu_ms_without"]
            r[f"loss_part_ratio_{variant}"] = r[f"loss_part_ms_{variant}"] / r["loss_part_ms_without"]
            # Same batch, same weights: the loss must agree whatever the graph.
            r[f"loss_abs_diff_{variant}"] = abs(r[f"loss_{variant}"] - r["loss_without"])
        rows.append(r)
    return rows


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"One training step (forward + backward) of Linear({args.hidden} -> {args.vocab}) + CrossEntropyLoss "
        f"on {args.rows} label rows, ORT {ort.__version__} CPU, {os.cpu_count()} cores; median of {args.steps} "
        f"step(s) after {SESSION_WARMUP_RUNS} warm-up runs per session and {args.warmup} per density.  *before loss*: the gathers where ORT put them; *above "
        "projection*: `move_above_projection=True`.  Ratios are over *without* (< 1 is faster).  "
        "*Loss part*: ORT-profiled kernel time of every node except the Linear's matmuls and bias reduction.  "
        "CPU-time ratios use the process's CPU time, less sensitive to other jobs on the machine.",
        "",
        "| label density | flagged at export | step ms: without | before loss | above projection "
        "| step ratio: before loss | above projection | CPU-time ratio: before loss | above projection "
        "| loss part ms: without | before loss | above projection |",
        "|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [f"{r['density']}%", "yes" if r["flagged_at_export"] else "no"]
        cells += [f"{r[f'step_ms_{v}']:.0f}" for v in VARIANTS]
        cells += [f"{r[f'step_ratio_{v}']:.2f}" for v in VARIANTS[1:]]
        cells += [f"{r[f'step_cpu_ratio_{v}']:.2f}" for v in VARIANTS[1:]]
        cells += [f"{r[f'loss_part_ms_{v}']:.0f}" for v in VARIANTS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=1, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per density (after the session's own)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="directory for the result files")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("ortpass").setLevel(logging.WARNING)

    started = time.perf_counter()
    rows = measure(args)
    table = markdown(rows, args)
    print(table)
    record = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "onnxruntime": ort.__version__},
        "seconds": round(time.perf_counter() - started, 1),
        "results": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sce_gather_results.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / "sce_gather_results.md").write_text(table)
    print(f"wrote {args.out / 'sce_gather_results.json'} and .md ({record['seconds']} s)")


if __name__ == "__main__":
    main()
