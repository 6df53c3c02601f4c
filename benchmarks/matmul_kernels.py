"""The matrix products of LLaMA's step: ONNX Runtime's CPU kernels against torch's, shape by shape.

``benchmarks/results/hf_memory.md`` times ``ORTModule`` on stock onnxruntime against torch
with checkpointing on HF LLaMA (4 layers, hidden 256, batch 8 x 512).  Both recompute; the
matrix products are most of either step.  This measures what the same products cost in each
library's kernels, so that a step-time ratio can be split into "more work" and "slower
kernels":

1. ``ORTModule`` builds ``hf_memory.py``'s LLaMA graph on the installed onnxruntime (a
   ``cache_dir`` keeps the graph it ran).
2. That graph runs in a session with ortpass's training options and ORT's profiler, for
   ``--runs`` runs after a warm-up; each ``MatMul``, ``Gemm`` and ``FusedMatMul`` node's
   kernel time and input shapes come from the profile ("in the step").
3. Each distinct product (op, transposes, shapes) runs alone: a one-node ORT session and
   the same product in torch (``mm``/``matmul`` on transposed views), 2 threads, the fastest
   of 10 runs after one warm-up.  The outputs are compared.

The table gives, per product, how many the step runs, their FLOPs (2·M·N·K each), and the
milliseconds a step spends on them at each rate; the totals are the step's matrix products
in ORT's kernels (in the step and alone) and in torch's.

Usage: ``.venv-stock/bin/python benchmarks/matmul_kernels.py [--runs 4]``.  Writes
``matmul_kernels_<onnxruntime version>.json`` and ``.md`` next to this script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the recorded results, apart from the scripts
sys.path.insert(0, str(HERE))
import hf_memory  # noqa: E402  (the model the step-time rows use)
import recompute_memory as rm  # noqa: E402  (record())

THREADS = 2
PRODUCTS = ("MatMul", "Gemm", "FusedMatMul")
SEQ = 16 if os.environ.get("ORTPASS_BENCH_TINY") == "1" else 512


def _fastest(run, repeats: int = 10) -> float:
    run()  # warm-up: ORT's first run plans its memory, torch's picks kernels
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def build_step_graph(work: Path) -> Path:
    """The graph ``ORTModule`` runs for ``hf_memory.py``'s LLaMA step, from its ``cache_dir``."""
    import torch

    import ortpass

    torch.manual_seed(0)
    model = hf_memory.build_model("llama", SEQ)
    model.config.use_cache = False  # ORTModule returns tensors only
    model.train()
    ids = torch.randint(0, hf_memory.VOCAB, (hf_memory.BATCH, SEQ))
    wrapped = ortpass.ORTModule(hf_memory._loss_module(model), cache_dir=work)
    wrapped(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).backward()
    (graph,) = work.glob("*.onnx")
    return graph


def _feeds(proto) -> dict[str, np.ndarray]:
    """Inputs at the benchmark's sizes: token ids for the integer inputs, small weights else."""
    import onnx

    rng = np.random.default_rng(0)
    feeds = {}
    for value in proto.graph.input:
        tensor = value.type.tensor_type
        # A batch input's dims are named (``input_ids_dim0``, ``..._dim1``): batch, then sequence.
        shape = [d.dim_value or (SEQ if d.dim_param.endswith("dim1") else hf_memory.BATCH) for d in tensor.shape.dim]
        if tensor.elem_type == onnx.TensorProto.INT64:
            feeds[value.name] = rng.integers(0, hf_memory.VOCAB, shape).astype(np.int64)
        else:
            feeds[value.name] = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    return feeds


def products_in_step(graph: Path, runs: int) -> dict:
    """Every matrix product's kernel time in ``runs`` profiled runs of the step's graph,
    summed per (op, transposes, input shapes); ``nodes``: the graph's product nodes."""
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort

    from ortpass.runtime.session import open_session, training_options

    proto = onnx.load(graph)
    model = ir.from_proto(proto)
    options = training_options(ort, runs_torch=False)
    options.intra_op_num_threads = THREADS
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as profiles:
        options.profile_file_prefix = str(Path(profiles) / "step")
        # The graph ORT runs: its fusions make product nodes (FusedMatMul) the given graph lacks.
        options.optimized_model_filepath = str(Path(profiles) / "optimized.onnx")
        session, _ = open_session(proto, model, "cpu", session_options=options)
        attributes = {node.name: {a.name: a.i for a in node.attribute if a.name.startswith("trans")}
                      for node in onnx.load(options.optimized_model_filepath).graph.node if node.op_type in PRODUCTS}
        feeds = _feeds(proto)
        for _ in range(runs + 1):  # the first, a warm-up, is left out below
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    step_runs = [e for e in events if e.get("name") == "model_run"][1:]  # the first is the warm-up
    first = step_runs[0]["ts"]
    products: dict[str, dict] = {}
    for event in events:
        args = event.get("args", {})
        if (event.get("cat") != "Node" or not event["name"].endswith("_kernel_time") or event["ts"] < first
                or args.get("op_name") not in PRODUCTS):
            continue
        shapes = [list(next(iter(d.values()))) for d in args["input_type_shape"]]
        node = event["name"][: -len("_kernel_time")]
        key = _key(args["op_name"], attributes.get(node, {}), shapes)
        entry = products.setdefault(key, {"op": args["op_name"], "trans": attributes.get(node, {}), "shapes": shapes,
                                          "calls": 0, "seconds": 0.0})
        entry["calls"] += 1
        entry["seconds"] += event["dur"] / 1e6
    for entry in products.values():
        entry["per_step"] = entry["calls"] / len(step_runs)
        entry["step_ms"] = 1e3 * entry["seconds"] / len(step_runs)
        entry["gflop"] = _flop(entry["op"], entry["trans"], entry["shapes"]) / 1e9
    return {"products": dict(sorted(products.items(), key=lambda kv: -kv[1]["step_ms"])),
            "nodes": len(attributes), "runs": len(step_runs)}


def _key(op: str, trans: dict, shapes: list) -> str:
    flags = ",".join(f"{k}={v}" for k, v in sorted(trans.items()) if v)
    return f"{op}({flags}) {' x '.join(str(tuple(s)) for s in shapes[:2])}"


def _operands(trans: dict, shapes: list) -> tuple[list, list]:
    """The two operands' shapes as multiplied, after the op's transposes."""
    a, b = list(shapes[0]), list(shapes[1])
    if trans.get("transA"):
        a[-2], a[-1] = a[-1], a[-2]
    if trans.get("transB"):
        b[-2], b[-1] = b[-1], b[-2]
    return a, b


def _flop(op: str, trans: dict, shapes: list) -> float:
    a, b = _operands(trans, shapes)
    batch = float(np.prod(np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])))) if len(a) > 2 or len(b) > 2 else 1.0
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def alone(entry: dict) -> dict:
    """One product in a one-node ORT session and in torch, the fastest of 10 runs each."""
    import onnx
    import onnxruntime as ort
    import torch
    from onnx import helper

    op, trans, shapes = entry["op"], entry["trans"], entry["shapes"]
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes[:2])
    attributes = {k: v for k, v in trans.items() if v}
    node = helper.make_node(op, ["a", "b"], ["y"], domain="com.microsoft" if op == "FusedMatMul" else "", **attributes)
    graph = helper.make_graph([node], "product", [
        helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, list(a.shape)),
        helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, list(b.shape)),
    ], [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    # ORT's threads would spin for the next kernel while torch's ran, taking a core from them.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    proto = helper.make_model(graph, opset_imports=opsets, ir_version=8)  # 1.19.2 reads up to IR 10
    session = ort.InferenceSession(proto.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    feeds = {"a": a, "b": b}
    torch.set_num_threads(THREADS)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    ta = ta.transpose(-1, -2) if trans.get("transA") else ta
    tb = tb.transpose(-1, -2) if trans.get("transB") else tb
    expected = torch.matmul(ta, tb).numpy()
    got = session.run(None, feeds)[0]
    return {
        "ort_ms": 1e3 * _fastest(lambda: session.run(None, feeds)),
        "torch_ms": 1e3 * _fastest(lambda: torch.matmul(ta, tb)),
        "max_abs_diff": float(np.abs(got - expected).max()),
        "scale": float(np.abs(expected).max()),
    }


def run(runs: int) -> dict:
    import onnxruntime as ort
    import torch

    load_before = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory() as work:
        step = products_in_step(build_step_graph(Path(work)), runs)
    for entry in step["products"].values():
        entry.update(alone(entry))
    return {"onnxruntime": ort.__version__, "torch": torch.__version__, "threads": THREADS, "seq": SEQ,
            "batch": hf_memory.BATCH, "cpu": rm.cpu_model(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load": [load_before, round(os.getloadavg()[0], 2)], **step}


def totals(results: dict) -> dict:
    """The step's matrix products: milliseconds at each rate and GFLOP, a step's worth."""
    rows = results["products"].values()
    return {
        "gflop": sum(r["gflop"] * r["per_step"] for r in rows),
        "in_step_ms": sum(r["step_ms"] for r in rows),
        "ort_alone_ms": sum(r["ort_ms"] * r["per_step"] for r in rows),
        "torch_ms": sum(r["torch_ms"] * r["per_step"] for r in rows),
        "calls": sum(r["per_step"] for r in rows),
    }


def markdown(results: dict) -> str:
    total = totals(results)
    rate = lambda gflop, ms: f"{1e3 * gflop / ms:.0f}" if ms > 0 else "-"  # noqa: E731
    lines = [
        f"# LLaMA's step, matrix products: onnxruntime {results['onnxruntime']}'s CPU kernels against torch "
        f"{results['torch']}'s",
        "",
        f"`hf_memory.py`'s LLaMA ({hf_memory.LAYERS} layers, hidden {hf_memory.HIDDEN}, batch {results['batch']} x {results['seq']}), the graph "
        f"`ORTModule` builds on this onnxruntime; {results['cpu']}, {results['threads']} threads, {results['date']}, "
        f"load average before/after {results['load'][0]} / {results['load'][1]}. \"In the step\": ORT's profiler over "
        f"{results['runs']} runs of the step's graph (ortpass's session options); \"alone\": the product alone, a "
        "one-node ORT session and torch's `matmul` on the same (transposed) operands, fastest of 10. "
        "ms are a step's worth (calls x time); GF/s = FLOPs / time.",
        "",
        "| product | calls a step | GFLOP a step | in the step ms (GF/s) | ORT alone ms (GF/s) | torch ms (GF/s) "
        "| max abs diff / scale |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, r in results["products"].items():
        gflop = r["gflop"] * r["per_step"]
        ort_ms, torch_ms = r["ort_ms"] * r["per_step"], r["torch_ms"] * r["per_step"]
        lines.append(
            f"| `{key}` | {r['per_step']:g} | {gflop:.2f} | {r['step_ms']:.1f} ({rate(gflop, r['step_ms'])}) "
            f"| {ort_ms:.1f} ({rate(gflop, ort_ms)}) | {torch_ms:.1f} ({rate(gflop, torch_ms)}) "
            f"| {r['max_abs_diff']:.1e} / {r['scale']:.1e} |"
        )
    lines.append(
        f"| **all** | {total['calls']:g} | {total['gflop']:.1f} | {total['in_step_ms']:.0f} "
        f"({rate(total['gflop'], total['in_step_ms'])}) | {total['ort_alone_ms']:.0f} "
        f"({rate(total['gflop'], total['ort_alone_ms'])}) | {total['torch_ms']:.0f} "
        f"({rate(total['gflop'], total['torch_ms'])}) | |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="profiled runs of the step's graph (default 4)")
    args = parser.parse_args(argv)
    results = run(args.runs)
    rm.record(RESULTS / f"matmul_kernels_{results['onnxruntime']}", results, markdown(results))


if __name__ == "__main__":
    main()
