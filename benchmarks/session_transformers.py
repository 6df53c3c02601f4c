"""ORT's session over ortpass's LLaMA training graphs: what leaving out the idle transformers and numbering the nodes save.

Two things ortpass does to every session it opens shorten ORT's own work there:
``ortpass.runtime.idle_transformers`` leaves out the ORT graph transformers whose rewrites
start at ops the graph does not hold (quantization, convolution, ROCm), and
``ortpass.runtime.node_numbering`` numbers the nodes so that ORT's priority sort keeps few
nodes waiting.  This script measures both where they matter, the first call at depth
(``first_step.py``'s model: HF LLaMA, hidden 256, 4 heads, 2 kv heads, fused attention,
batch 2, seq 128):

- for each depth, ``ORTModule``'s first call builds the training graph into a
  ``cache_dir`` (the graph its session opens);
- each depth's graph is then opened in fresh processes, ``InferenceSession`` with
  ortpass's session options and disabled transformers: as ortpass opens it (``ortpass``),
  in graph order (``not numbered``), and in graph order with every transformer run
  (``all run``), alternating, wall seconds of the session alone, the fastest of
  ``--repeat`` each;
- once per depth each writes the graph ORT optimized (``optimized_model_filepath``), and
  the record says whether they are the same nodes in the same order (their names aside:
  ORT names a fused node after the first node it meets, which can differ).

Results: ``results/session_transformers_<ORT version>.json`` / ``.md``.  Run:
``python3 benchmarks/session_transformers.py`` (the training build; about 5 minutes).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
import recompute_memory as rm  # noqa: E402  (the sibling benchmark's helpers; standard library only at import)

LAYERS = (16, 32, 64, 80)
VARIANTS = ("ortpass", "not numbered", "all run")


def child_build(layers: int, cache_dir: str) -> dict:
    """ORTModule's first call on first_step.py's LLaMA, its graph stored in ``cache_dir``."""
    import torch

    import first_step
    import ortpass

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ids, labels = first_step._batch()
    ortpass.ORTModule(first_step.build_model("llama", layers), cache_dir=cache_dir, threads=1)(ids, labels).backward()
    (graph,) = glob.glob(os.path.join(cache_dir, "*.onnx"))
    return {"graph": graph}


def child_open(path: str, variant: str, optimized_path: str) -> dict:
    """Seconds ORT takes to open a session over ``path`` as ortpass opens it (the numbering
    included); "not numbered" keeps graph order, "all run" also passes only the
    transformers ortpass must disable, not the idle ones."""
    import onnx
    import onnxruntime as ort

    from ortpass.io import load
    from ortpass.runtime.idle_transformers import idle_transformers
    from ortpass.runtime.node_numbering import number_for_ort
    from ortpass.runtime.session import disabled_optimizers, training_options

    model, proto = load(path), onnx.load(path)
    providers = ["CPUExecutionProvider"]
    idle = idle_transformers(proto, providers)
    disabled = disabled_optimizers(model) + ([] if variant == "all run" else idle)
    options = training_options(ort, runs_torch=True)
    options.intra_op_num_threads = 1
    if optimized_path:
        options.optimized_model_filepath = optimized_path
    start = time.perf_counter()  # the numbering and the serialization are the session's to pay
    if variant == "ortpass":
        number_for_ort(proto.graph)
    ort.InferenceSession(proto.SerializeToString(), options, providers=providers, disabled_optimizers=disabled)
    return {"seconds": time.perf_counter() - start, "nodes": len(model.graph), "idle": idle}


def _nodes_without_names(path: str) -> tuple[bytes, ...]:
    """The optimized graph's nodes in order, each without its name, and its initializers."""
    import onnx

    graph = onnx.load(path).graph
    nodes = []
    for node in graph.node:
        node.name = ""
        nodes.append(node.SerializeToString())
    return (*nodes, *(init.SerializeToString() for init in graph.initializer))


def run(layer_counts=LAYERS, repeat: int = 3) -> dict:
    import onnxruntime as ort

    rows = []
    with tempfile.TemporaryDirectory(prefix="session_transformers_") as tmp:
        for layers in layer_counts:
            cache_dir = os.path.join(tmp, f"cache_{layers}")
            graph = rm._run_child("build", str(layers), cache_dir, script=__file__, timing=True)["graph"]
            optimized = {v: os.path.join(tmp, f"optimized_{layers}_{i}.onnx") for i, v in enumerate(VARIANTS)}
            seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for attempt in range(repeat):
                for variant in VARIANTS if attempt % 2 == 0 else reversed(VARIANTS):
                    written = optimized[variant] if attempt == 0 else ""
                    out = rm._run_child("open", graph, variant, written, script=__file__, timing=True)
                    seconds[variant].append(round(out["seconds"], 3))
            same = len({_nodes_without_names(optimized[v]) for v in VARIANTS}) == 1
            row = {"layers": layers, "nodes": out["nodes"], "idle": out["idle"], "same_optimized_graph": same,
                   **{v: min(s) for v, s in seconds.items()}, "runs": seconds}  # fmt: skip
            rows.append(row)
            print(f"{layers:3d} layers {row['nodes']:6d} nodes  " + "  ".join(f"{v} {row[v]:.2f} s" for v in VARIANTS)
                  + f"  same optimized graph: {same}", flush=True)  # fmt: skip
    return {"onnxruntime": ort.__version__, "cpu_model": rm.cpu_model(), "cpus": os.cpu_count(), "repeat": repeat,
            "load": [round(x, 2) for x in os.getloadavg()], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "rows": rows}  # fmt: skip


def markdown(results: dict) -> str:
    lines = [
        f"# ORT {results['onnxruntime']}: the session over LLaMA training graphs, as ortpass opens it and without "
        "its numbering or idle transformers left out",
        "",
        f"Wall seconds of the session alone (with ortpass's numbering and the serialization), one thread, fastest of {results['repeat']} fresh processes a "
        f"variant, alternating; {results['cpus']} cores of {results['cpu_model']}, {results['date']}, load "
        f"{results['load']} at the end. Graphs: `ORTModule`'s first call on first_step.py's LLaMA.",
        "",
        "| layers | training nodes | ortpass s | not numbered s | all run s | numbering saves | both save | "
        "same optimized graph |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in results["rows"]:
        numbering, both = 1 - row["ortpass"] / row["not numbered"], 1 - row["ortpass"] / row["all run"]
        lines.append(f"| {row['layers']} | {row['nodes']} | {row['ortpass']:.2f} | {row['not numbered']:.2f} | "
                     f"{row['all run']:.2f} | {numbering:.0%} | {both:.0%} | "
                     f"{'yes' if row['same_optimized_graph'] else 'NO'} |")  # fmt: skip
    if results["rows"]:
        lines += ["", f"Left out: {', '.join(results['rows'][0]['idle'])}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        kind, *rest = argv[1:]
        out = child_build(int(rest[0]), rest[1]) if kind == "build" else child_open(*rest)
        print(json.dumps(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", type=int, default=list(LAYERS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", help="the record's path without suffix (default results/session_transformers_<ORT version>)")
    args = parser.parse_args(argv)
    results = run(args.layers, args.repeat)
    rm.record(Path(args.out or RESULTS / f"session_transformers_{results['onnxruntime']}"), results, markdown(results))


if __name__ == "__main__":
    main()
