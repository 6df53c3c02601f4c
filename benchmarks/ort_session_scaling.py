"""ONNX Runtime's session creation against the graph's size, on graphs ortpass never touched.

The first call's ``ORT session`` phase grows faster than the training graph's node count
(``first_step.py``: 1.85 -> 8.0 s from 40 to 80 LLaMA layers, 4.3x for 2x the nodes).
This script asks whether that is the graph ortpass hands over or ORT itself: it builds,
with onnx's helpers alone, two graphs at doubling sizes and times ``InferenceSession``
on each, CPU seconds (``time.process_time``), one thread, the best of ``--repeat``:

- **chain**: ``n`` Relu nodes, each reading the one before;
- **forward-backward**: ``n`` Relu nodes, then ``n`` Mul nodes in reverse order, the
  ``i``-th reading the ``i``-th Relu's output: every forward value lives until its
  backward reader, as a training graph's stash does.

each with ORT's optimizers off (``ORT_DISABLE_ALL``) and at its default level, memory
reuse and patterns off (as ortpass's training sessions run).  Results go to
``results/ort_session_scaling_<ORT version>.json`` / ``.md``.  Run:
``python3 benchmarks/ort_session_scaling.py`` (under a minute); any ORT build works
(the training build 1.19.2 and stock 1.32 were both recorded).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
import recompute_memory as rm  # noqa: E402  (the sibling benchmark's helpers; standard library only at import)

SIZES = (1500, 3000, 6000, 12000)
SHAPES = ("chain", "forward-backward")


def graph_bytes(shape: str, n: int) -> bytes:
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", [f"f{i - 1}" if i else "x"], [f"f{i}"]) for i in range(n)]
    last = f"f{n - 1}"
    if shape == "forward-backward":
        for i in reversed(range(n)):
            nodes.append(helper.make_node("Mul", [last, f"f{i}"], [f"b{i}"]))
            last = f"b{i}"
    graph = helper.make_graph(
        nodes, shape, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info(last, TensorProto.FLOAT, [4])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return model.SerializeToString()


def session_seconds(data: bytes, optimized: bool, repeat: int) -> float:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.enable_mem_reuse = False
    options.enable_mem_pattern = False
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        best = min(best, time.process_time() - start)
    return best


def run(sizes=SIZES, repeat: int = 3) -> dict:
    import onnxruntime as ort

    rows = []
    for shape in SHAPES:
        for n in sizes:
            data = graph_bytes(shape, n)
            nodes = n if shape == "chain" else 2 * n
            row = {"shape": shape, "nodes": nodes}
            for optimized in (False, True):
                row["default" if optimized else "optimizers off"] = round(session_seconds(data, optimized, repeat), 4)
            rows.append(row)
            print(row, flush=True)
    return {"onnxruntime": ort.__version__, "cpu_model": rm.cpu_model(), "cpus": os.cpu_count(), "repeat": repeat,
            "load": [round(x, 2) for x in os.getloadavg()], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "rows": rows}  # fmt: skip


def markdown(results: dict) -> str:
    lines = [
        f"# ORT {results['onnxruntime']}: session creation against the graph's size",
        "",
        f"CPU seconds, one thread, best of {results['repeat']}; {results['cpus']} cores of {results['cpu_model']}, "
        f"{results['date']}, load {results['load']}. `x` is the growth from the size before (2x the nodes).",
        "",
        "| graph | nodes | optimizers off s | x | default level s | x |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    before: dict[str, dict] = {}
    for row in results["rows"]:
        prev = before.get(row["shape"])
        cells = []
        for key in ("optimizers off", "default"):
            growth = f"{row[key] / prev[key]:.1f}" if prev and prev[key] > 0 else ""
            cells += [f"{row[key]:.3f}", growth]
        lines.append(f"| {row['shape']} | {row['nodes']} | " + " | ".join(cells) + " |")
        before[row["shape"]] = row
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", help="the record's path without suffix (default results/ort_session_scaling_<ORT version>)")
    args = parser.parse_args(argv)
    results = run(args.sizes, args.repeat)
    rm.record(Path(args.out or RESULTS / f"ort_session_scaling_{results['onnxruntime']}"), results, markdown(results))


if __name__ == "__main__":
    main()
