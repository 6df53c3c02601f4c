"""The weight gradients' products on ONNX Runtime's CPU: ``Gemm(transA=1)`` against a
``Transpose`` and a ``MatMul``, per product and in stock onnxruntime's LLaMA step.

A linear layer's weight gradient is ``dY^T x`` (torch's ``[out, in]`` layout) over the
batch's rows.  The torch builder writes it ``Gemm(dY, x, transA=1)``, as ORT's own builder
does, so that no ``Transpose`` copies a layer input for one product
(docs/design/torch-builder.md).  ORT's CPU GEMM (MLAS) runs that transposed-A product
slower than a plain one.  This measures by how much, and what the other form would give
the step:

1. Each weight gradient of ``hf_memory.py``'s LLaMA (4096 rows: batch 8 x 512; hidden 256,
   MLP 1024, vocabulary 2048), float32, 2 threads, rounds over the forms in turn, the
   fastest and the median of ``--rounds``: ``Gemm(transA=1)``; ``Transpose`` of the
   narrower operand and ``MatMul`` (and a ``Transpose`` of the product, weight-sized,
   where the narrower is ``x``), with ORT's ``MatmulTransposeFusion`` off, as ortpass's
   sessions over the torch builder's graphs run; torch's ``mm(dY.t(), x)``.  Products
   compared with numpy's in float64.
2. (stock onnxruntime only) ``ORTModule``'s training graph of that LLaMA (its default
   pipeline without ``transposed-gemm-as-matmul``, built here at the first step), run in
   one process by sessions ortpass opens (``open_session``): as built, and after that
   pass, which writes every ``Gemm(transA=1)`` in the second form above (the Transpose
   right after its operand's producer), steps alternating for ``--rounds`` rounds, the
   fastest and the median; ORT's threads spin between kernels there, as in ortpass's
   sessions over graphs without Python ops, and do not in part 1, where they would take the
   cores from torch's product.  Loss and gradients compared.  The step's peak is
   ``hf_memory.py``'s to measure (the ``Transpose`` adds a temporary the size of the
   narrower operand).

Usage: ``python benchmarks/weight_gradient_gemm.py [--rounds 12]`` (the step with stock
onnxruntime's Python: ``.venv-stock/bin/python``).  Writes ``weight_gradient_gemm.json``
and ``.md`` (``_<onnxruntime version>`` for the step run) under ``results/``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
import recompute_memory as rm  # noqa: E402  (record())

THREADS = 2
TINY = os.environ.get("ORTPASS_BENCH_TINY") == "1"  # the test suite's smoke run
ROWS, HIDDEN, MLP, VOCAB = (64, 16, 32, 48) if TINY else (4096, 256, 1024, 2048)
#: (name, columns of dY, columns of x): dW = dY^T x, [dY columns, x columns]
PRODUCTS = [
    ("q, k, v, o projections", HIDDEN, HIDDEN),
    ("gate and up projections", MLP, HIDDEN),
    ("down projection", HIDDEN, MLP),
    ("vocabulary projection", VOCAB, HIDDEN),
]


def _timed(run, rounds_of: dict, name: str) -> None:
    start = time.perf_counter()
    run()
    rounds_of[name].append(time.perf_counter() - start)


def _session(nodes, inputs: dict, disabled: list[str]):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes, "product", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(v.shape)) for n, v in inputs.items()],
        [helper.make_tensor_value_info("dw", TensorProto.FLOAT, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.log_severity_level = 3
    # Spinning ORT threads would take the cores from torch's product right after them.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"],
                                disabled_optimizers=disabled)  # fmt: skip


def transposed_forms(dy: str, x: str, transpose_dy: bool, out: str, prefix: str) -> list:
    """``dY^T x`` as a MatMul after a Transpose of ``dY``, or of ``x`` (then a Transpose of
    the weight-sized product too): ONNX nodes."""
    from onnx import helper

    if transpose_dy:
        return [helper.make_node("Transpose", [dy], [f"{prefix}_dyt"], perm=[1, 0]),
                helper.make_node("MatMul", [f"{prefix}_dyt", x], [out])]  # fmt: skip
    return [helper.make_node("Transpose", [x], [f"{prefix}_xt"], perm=[1, 0]),
            helper.make_node("MatMul", [f"{prefix}_xt", dy], [f"{prefix}_dwt"]),
            helper.make_node("Transpose", [f"{prefix}_dwt"], [out], perm=[1, 0])]  # fmt: skip


def products(rounds: int) -> dict:
    """Part 1: each product in each form (the narrower operand transposed),
    ``{name: {form: {fastest_ms, median_ms, gflops, max_rel_err}}}``."""
    import torch
    from onnx import helper

    torch.set_num_threads(THREADS)
    rng = np.random.default_rng(0)
    results = {}
    for name, dy_cols, x_cols in PRODUCTS:
        dy = rng.standard_normal((ROWS, dy_cols)).astype(np.float32)
        x = rng.standard_normal((ROWS, x_cols)).astype(np.float32)
        feeds = {"dy": dy, "x": x}
        gemm = _session([helper.make_node("Gemm", ["dy", "x"], ["dw"], transA=1)], feeds, [])
        plain = _session(transposed_forms("dy", "x", dy_cols <= x_cols, "dw", "p"), feeds, ["MatmulTransposeFusion"])
        tdy, tx = torch.from_numpy(dy), torch.from_numpy(x)
        forms = {
            "ORT Gemm(transA=1)": lambda: gemm.run(None, feeds)[0],
            "ORT Transpose + MatMul": lambda: plain.run(None, feeds)[0],
            "torch mm(dY.t(), x)": lambda: (tdy.t() @ tx).numpy(),
        }
        exact = dy.astype(np.float64).T @ x.astype(np.float64)
        row, times = {}, {form: [] for form in forms}
        for form, run in forms.items():
            row[form] = {"max_rel_err": float(np.abs(run() - exact).max() / np.abs(exact).max())}  # also a warm-up
        for _ in range(rounds):
            for form, run in forms.items():
                _timed(run, times, form)
        flop = 2.0 * ROWS * dy_cols * x_cols
        for form, ts in times.items():
            row[form].update(fastest_ms=min(ts) * 1e3, median_ms=statistics.median(ts) * 1e3, gflops=flop / min(ts) / 1e9)
        results[f"{name} [{dy_cols} x {x_cols}]"] = row
        print(name, {f: round(r["fastest_ms"], 2) for f, r in row.items()}, flush=True)
    return results


def step(rounds: int) -> dict:
    """Part 2 (stock onnxruntime): the LLaMA step's graph without and with the pass, alternating."""
    import onnx
    import onnx_ir as ir
    import onnxruntime
    import torch

    import hf_memory
    import ortpass
    from ortpass.infra.pipeline_text import without_passes
    from ortpass.passes import DEFAULT_PIPELINE, TransposedGemmAsMatmulPass
    from ortpass.runtime.row_adds import rows_added_after_proto
    from ortpass.runtime.session import open_session

    torch.manual_seed(0)
    seq = 16 if TINY else 512
    model = hf_memory.build_model("llama", seq)
    model.config.use_cache = False
    model.train()
    ids = torch.randint(0, hf_memory.VOCAB, (2 if TINY else hf_memory.BATCH, seq))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    loss_module = hf_memory._loss_module(model)
    with tempfile.TemporaryDirectory(prefix="weight_gradient_gemm_") as cache:
        pipeline = without_passes(DEFAULT_PIPELINE, {"transposed-gemm-as-matmul"})
        wrapped = ortpass.ORTModule(loss_module, cache_dir=cache, pipeline=pipeline)
        wrapped(**batch).backward()  # the first step builds and caches the training graph, without the pass
        (path,) = Path(cache).glob("*.onnx")
        built = onnx.load(path)
    named = [*loss_module.named_parameters(), *loss_module.named_buffers()]  # non-persistent buffers too
    state = {f"module.{k}": v.detach().numpy() for k, v in named}
    feeds = {i.name: (batch[i.name].numpy() if i.name in batch else state[i.name]) for i in built.graph.input}
    rewrite = TransposedGemmAsMatmulPass()
    changed = ir.serde.serialize_model(rewrite(ir.serde.deserialize_model(built)).model)
    count = rewrite.stats["counts"]["gemms written as matmuls"]
    sessions = {}
    for form, proto in (("without the pass (Gemm(transA=1))", built), ("transposed-gemm-as-matmul", changed)):
        # As ortpass's sessions run it: the embedding gradient's ScatterND(add) left to the
        # caller (ORT's CPU kernel loses an update of a repeated row now and then, here).
        proto, _ = rows_added_after_proto(proto)
        sessions[form], _ = open_session(proto, ir.serde.deserialize_model(proto), "cpu")
    outputs = {form: s.run(None, feeds) for form, s in sessions.items()}  # also a warm-up
    first, second = outputs.values()
    times = {form: [] for form in sessions}
    for _ in range(rounds):
        for form, s in sessions.items():
            _timed(lambda s=s: s.run(None, feeds), times, form)
    return {
        "onnxruntime": onnxruntime.__version__,
        "gemms_rewritten": count,
        # each output's largest difference relative to its largest entry: the products sum 4096 rows
        "max_rel_diff_of_outputs": max(float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)) for a, b in zip(first, second)),
        "loss": float(first[0]),
        "forms": {form: {"fastest_s": min(ts), "median_s": statistics.median(ts), "steps": ts} for form, ts in times.items()},
    }


def markdown(results: dict) -> str:
    lines = [
        "# The weight gradients' products on ONNX Runtime's CPU",
        "",
        f"dW = dY^T x over {ROWS} rows, float32, {THREADS} threads, {results['cpus']} cores of {results['cpu_model']}, "
        f"onnxruntime {results['onnxruntime']}, {results['rounds']} rounds over the forms in turn; fastest / median ms "
        f"(GFLOP/s at the fastest). Load average before/after: {results['load'][0]:.1f} / {results['load'][1]:.1f}.",
        "",
    ]
    forms = list(next(iter(results["products"].values())))
    lines += ["| product | " + " | ".join(forms) + " |", "|---|" + "---:|" * len(forms)]
    for name, row in results["products"].items():
        cells = [f"{row[f]['fastest_ms']:.1f} / {row[f]['median_ms']:.1f} ({row[f]['gflops']:.0f})" for f in forms]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    worst = max(r["max_rel_err"] for row in results["products"].values() for r in row.values())
    lines += ["", f"Largest error against numpy's float64 product, relative to its largest entry: {worst:.1e}."]
    s = results.get("step")
    if s:
        lines += [
            "",
            f"## HF LLaMA's step on stock onnxruntime ({s['gemms_rewritten']} `Gemm(transA=1)` rewritten by the pass)",
            "",
            "| training graph | fastest s | median s |",
            "|---|---:|---:|",
        ]
        lines += [f"| {form} | {t['fastest_s']:.3f} | {t['median_s']:.3f} |" for form, t in s["forms"].items()]
        lines += ["", f"Outputs (loss {s['loss']:.4f}, every gradient) differ by at most {s['max_rel_diff_of_outputs']:.1e} "
                  "of their largest entry."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import onnxruntime

    from ortpass.training.backend import has_training_ops

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    results = {"cpus": os.cpu_count(), "cpu_model": rm.cpu_model(), "onnxruntime": onnxruntime.__version__,
               "rounds": args.rounds, "products": products(args.rounds)}  # fmt: skip
    if not has_training_ops():
        results["step"] = step(args.rounds)
    results["load"] = [load_before[0], os.getloadavg()[0]]
    stem = "weight_gradient_gemm" + ("" if has_training_ops() else f"_{onnxruntime.__version__}")
    rm.record(RESULTS / stem, results, markdown(results))


if __name__ == "__main__":
    main()
