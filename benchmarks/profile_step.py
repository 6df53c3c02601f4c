"""Where ORT's CPU time goes in one training step, per op type, from ORT's own profiler.

Graphs: ``hf_memory.py``'s (HF GPT-2 and LLaMA, 4 layers, hidden 256, 4 heads, vocab 2048,
batch 8, seq 512; ``--seq`` to change it): ORT without recompute, ortpass's default
pipeline, and the default pipeline on the fused-attention export.  Each runs in a session
with glibc's defaults and :class:`ortpass.runtime.TrainingSession`'s options
(``training_options``: no memory reuse or pattern, no thread spinning where PythonOps run
torch; the same disabled optimizers) and ORT's profiler on; after a warm-up step,
``--steps`` steps are profiled and the kernel time (``*_kernel_time`` events) is summed per
op type.
PythonOp and PythonOpGrad time is torch's kernels called through ortpass's bridge.

Usage: ``python benchmarks/profile_step.py [--models gpt2 llama] [--steps 2]``.  Writes
``profile_step.json`` and ``profile_step.md`` next to this script.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the recorded results, apart from the scripts
sys.path.insert(0, str(HERE))
import hf_memory  # noqa: E402  (the graphs and their batch)

KEYS = {"ort": "ORT, no recompute", "ortpass": "ortpass default", "ortpass_fused": "ortpass default, fused attention"}
TOP = 10


def profile(work: Path, key: str, steps: int) -> dict:
    """Kernel microseconds per op type over ``steps`` profiled steps of ``<key>.onnx``."""
    import numpy as np
    import onnx_ir as ir

    # The same ORT load as hf_memory's timing runs (without onnxruntime/__init__, which
    # imports onnxruntime.training and torch's ORTModule machinery), so the profile explains
    # those times (one run of GPT-2's fused step: 2.5-2.8 s a step with the full import,
    # 2.2-2.4 without).
    C, InferenceSession = hf_memory.rm._load_ort()
    from ortpass.pythonop.rng_replay import register_rng_replay_functions
    from ortpass.pythonop import bridge
    from ortpass.runtime.session import disabled_optimizers, training_options

    model = ir.load(work / f"{key}.onnx")
    runs_torch = any(n.op_type == "PythonOp" for n in model.graph)
    if runs_torch:
        register_rng_replay_functions(model)
        bridge.prepare(model)
    options = training_options(C, runs_torch=runs_torch)
    options.enable_profiling = True
    options.profile_file_prefix = str(work / f"profile_{key}")
    session = InferenceSession(
        str(work / f"{key}.onnx"), options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled_optimizers(model)
    )
    feeds = dict(np.load(work / "batch.npz"))
    fetch = [o.name for o in session.get_outputs()]
    session.run(fetch, feeds)  # warm-up, profiled too: its events are dropped below
    for _ in range(steps):
        session.run(fetch, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    warm_events = [e for e in events if e.get("cat") == "Node" and e["ts"] >= runs[1]["ts"]] if len(runs) > 1 else []
    per_op: dict[str, float] = collections.Counter()
    for event in warm_events:
        if event["name"].endswith("_kernel_time"):
            per_op[event["args"]["op_name"]] += event["dur"]
    total_run_us = sum(r["dur"] for r in runs[1:])
    return {"per_op_us": dict(per_op), "kernel_us": sum(per_op.values()), "run_us": total_run_us, "steps": steps}


def run(families: list[str], seq: int, steps: int) -> dict:
    results: dict = {"seq": seq, "steps": steps, "cpus": os.cpu_count(), "families": {}}
    for family in families:
        with tempfile.TemporaryDirectory(prefix=f"profile_{family}_") as tmp:
            work = Path(tmp)
            hf_memory._child("prepare", str(work), family, str(seq))
            results["families"][family] = {key: _child(str(work), key, str(steps)) for key in KEYS}
    return results


def _child(*args: str) -> dict:
    # timing=True: the settings a user runs.  The memory run's glibc mmap threshold makes
    # every tensor an mmap (GPT-2 fused: 3.29 s a profiled step under it, 2.72 s without).
    return hf_memory.rm._run_child(*args, script=__file__, timing=True)


def markdown(results: dict) -> str:
    lines = [
        f"# ORT CPU time per op type in one training step (seq {results['seq']}, {results['cpus']} cores)",
        "",
        f"ORT's profiler, kernel time summed per op type over {results['steps']} warm steps; share of the "
        "kernel time, and the step's wall time from ORT's `model_run` events. Graphs as in hf_memory.py.",
        "",
    ]
    for family, by_key in results["families"].items():
        for key, prof in by_key.items():
            steps = prof["steps"]
            lines += [
                f"## {family}: {KEYS[key]} ({prof['run_us'] / steps / 1e6:.2f} s a step, kernels "
                f"{prof['kernel_us'] / steps / 1e6:.2f} s)",
                "",
                "| op type | ms a step | share |",
                "|---|---:|---:|",
            ]
            ranked = sorted(prof["per_op_us"].items(), key=lambda item: -item[1])
            for op, us in ranked[:TOP]:
                lines.append(f"| {op} | {us / steps / 1e3:.0f} | {us / prof['kernel_us']:.0%} |")
            rest = sum(us for _, us in ranked[TOP:])
            lines += [f"| {len(ranked) - TOP} other types | {rest / steps / 1e3:.0f} | {rest / prof['kernel_us']:.0%} |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        work, key, steps = argv[1:]
        print(json.dumps(profile(Path(work), key, int(steps))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    results = run(args.models, args.seq, args.steps)
    hf_memory.rm.record(RESULTS / "profile_step", results, markdown(results))


if __name__ == "__main__":
    main()
