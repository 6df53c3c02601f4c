"""Kernel scratch on ONNX Runtime's CPU provider: the memory an op allocates while it runs,
beyond its outputs.

ortpass predicts a training step's peak from the sizes of the values the graph holds
(``ortpass.analysis.step_memory``); most CPU kernels allocate nothing else, a few allocate
temporaries as large as their tensors, and at the peak those count.  This measures each
op of interest alone: a one-node model, its inputs fed as OrtValues, its outputs kept as
OrtValues (no copy into numpy), run once to warm up and once measured in a fresh process
(glibc ``MALLOC_MMAP_THRESHOLD_=65536``, ORT's arena off, as ``recompute_memory.py``
measures a step): scratch = peak RSS during the run above the RSS before it, minus the
outputs' bytes.  The shapes are those of the benchmarks' models (batch 8, seq 512, hidden
256, 4 heads, vocabulary 2048).

Usage: ``python benchmarks/kernel_scratch.py``.  Writes ``kernel_scratch[_<ort version>].json``
and ``.md`` next to this script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the recorded results, apart from the scripts
sys.path.insert(0, str(HERE))
import recompute_memory as rm  # noqa: E402  (the sibling benchmark's measuring helpers)

MIB = 1 << 20
B, H, S, D, V = 8, 4, 512, 256, 2048
if os.environ.get("ORTPASS_BENCH_TINY") == "1":  # the test suite's smoke run
    B, H, S, D, V = 2, 2, 64, 32, 64

# (name, domain, op, inputs [(name, dtype, shape)], attributes, outputs [(name, dtype, shape)], what the scratch is measured against)
FLOAT, BOOL, INT64 = "float", "bool", "int64"
ROWS = B * S
CASES = [
    ("Where, mask broadcast over batch and heads", "", "Where",
     [("c", BOOL, [1, 1, S, S]), ("x", FLOAT, [B, H, S, S]), ("y", FLOAT, [])], {}, [("z", FLOAT, [B, H, S, S])], "output"),
    ("Where, mask broadcast over heads", "", "Where",
     [("c", BOOL, [B, 1, S, S]), ("x", FLOAT, [B, H, S, S]), ("y", FLOAT, [])], {}, [("z", FLOAT, [B, H, S, S])], "output"),
    ("Where, no broadcast", "", "Where",
     [("c", BOOL, [B, H, S, S]), ("x", FLOAT, [B, H, S, S]), ("y", FLOAT, [B, H, S, S])], {}, [("z", FLOAT, [B, H, S, S])], "output"),
    ("SoftmaxCrossEntropyLoss, rows x vocabulary", "", "SoftmaxCrossEntropyLoss",
     [("logits", FLOAT, [ROWS, V]), ("labels", INT64, [ROWS])], {"reduction": "mean"}, [("loss", FLOAT, []), ("log_prob", FLOAT, [ROWS, V])], "input 0"),
    ("SoftmaxCrossEntropyLoss, without log_prob", "", "SoftmaxCrossEntropyLoss",
     [("logits", FLOAT, [ROWS, V]), ("labels", INT64, [ROWS])], {"reduction": "mean"}, [("loss", FLOAT, [])], "input 0"),
    ("SoftmaxCrossEntropyLossGrad", "com.microsoft", "SoftmaxCrossEntropyLossGrad",
     [("dloss", FLOAT, []), ("log_prob", FLOAT, [ROWS, V]), ("labels", INT64, [ROWS])], {"reduction": "mean"}, [("dlogits", FLOAT, [ROWS, V])], "input 1"),
    ("LayerNormalizationGrad", "com.microsoft", "LayerNormalizationGrad",
     [("dy", FLOAT, [B, S, D]), ("x", FLOAT, [B, S, D]), ("scale", FLOAT, [D]), ("mean", FLOAT, [B, S, 1]), ("inv_std", FLOAT, [B, S, 1])],
     {"axis": -1}, [("dx", FLOAT, [B, S, D]), ("dscale", FLOAT, [D]), ("dbias", FLOAT, [D])], "input 1"),
    ("SimplifiedLayerNormalizationGrad", "com.microsoft", "SimplifiedLayerNormalizationGrad",
     [("dy", FLOAT, [B, S, D]), ("x", FLOAT, [B, S, D]), ("scale", FLOAT, [D]), ("inv_std", FLOAT, [B, S, 1])],
     {"axis": -1}, [("dx", FLOAT, [B, S, D]), ("dscale", FLOAT, [D])], "input 1"),
    ("Softmax", "", "Softmax", [("x", FLOAT, [B, H, S, S])], {"axis": -1}, [("y", FLOAT, [B, H, S, S])], "output"),
    ("SoftmaxGrad_13", "com.microsoft", "SoftmaxGrad_13",
     [("dy", FLOAT, [B, H, S, S]), ("y", FLOAT, [B, H, S, S])], {"axis": -1}, [("dx", FLOAT, [B, H, S, S])], "output"),
    ("MatMul, attention scores", "", "MatMul",
     [("q", FLOAT, [B, H, S, D // H]), ("k", FLOAT, [B, H, D // H, S])], {}, [("s", FLOAT, [B, H, S, S])], "output"),
    ("Gemm", "", "Gemm", [("a", FLOAT, [ROWS, D]), ("b", FLOAT, [D, 4 * D])], {}, [("c", FLOAT, [ROWS, 4 * D])], "output"),
    ("LayerNormalization", "", "LayerNormalization",
     [("x", FLOAT, [B, S, D]), ("scale", FLOAT, [D]), ("bias", FLOAT, [D])], {"axis": -1}, [("y", FLOAT, [B, S, D])], "output"),
    ("DropoutGrad", "com.microsoft", "DropoutGrad",
     [("dy", FLOAT, [B, H, S, S]), ("mask", BOOL, [B, H, S, S]), ("ratio", FLOAT, [])], {}, [("dx", FLOAT, [B, H, S, S])], "output"),
]

_DTYPES = {FLOAT: 1, BOOL: 9, INT64: 7}
_ELEMENT = {FLOAT: 4, BOOL: 1, INT64: 8}


def _nbytes(dtype: str, shape: list[int]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * _ELEMENT[dtype]


def _model(case) -> bytes:
    from onnx import helper

    _, domain, op, inputs, attrs, outputs, _ = case
    graph = helper.make_graph(
        [helper.make_node(op, [n for n, _, _ in inputs], [n for n, _, _ in outputs], domain=domain or None, **attrs)],
        "one",
        [helper.make_tensor_value_info(n, _DTYPES[t], s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, _DTYPES[t], s) for n, t, s in outputs],
    )
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()


def child(index: int) -> dict:
    import numpy as np

    case = CASES[index]
    C, InferenceSession = rm._load_ort()
    session = InferenceSession(_model(case), rm._ort_training_options(C), providers=["CPUExecutionProvider"])
    device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    rng = np.random.default_rng(0)
    arrays = {}
    for name, dtype, shape in case[3]:
        if dtype == FLOAT:
            arrays[name] = rng.standard_normal(shape).astype(np.float32)
        elif dtype == BOOL:
            arrays[name] = rng.random(shape) < 0.5
        else:
            arrays[name] = rng.integers(0, V, shape)
    feeds = {name: C.OrtValue.ortvalue_from_numpy(a, device) for name, a in arrays.items()}
    names = [name for name, _, _ in case[5]]

    def run():
        return session._sess.run_with_ort_values(feeds, names, C.RunOptions())

    run()
    rm._reset_peak()
    before = rm._rss_bytes()
    kept = run()  # noqa: F841  (the outputs stay alive until the peak is read)
    peak = rm._peak_bytes() - before
    return {"peak_bytes": peak}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        print(json.dumps(child(int(argv[1]))))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    rows = []
    for index, case in enumerate(CASES):
        name, domain, op, inputs, _, outputs, against = case
        proc = subprocess.run([sys.executable, __file__, "--child", str(index)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            if "not a registered function/op" in proc.stderr or "NOT_IMPLEMENTED" in proc.stderr:  # a training op stock ORT lacks
                print(f"{name:48s} not in this onnxruntime", flush=True)
                continue
            raise RuntimeError(f"{name} failed:\n{proc.stderr[-2000:]}")
        peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]
        out = sum(_nbytes(t, s) for _, t, s in outputs)
        reference = _nbytes(*outputs[0][1:]) if against == "output" else _nbytes(*inputs[int(against.split()[1])][1:])
        scratch = max(peak - out, 0)
        rows.append({"case": name, "op": f"{domain or 'ai.onnx'}::{op}", "outputs_mib": out / MIB, "peak_mib": peak / MIB,
                     "scratch_mib": scratch / MIB, "against": against, "scratch_ratio": scratch / reference})
        print(f"{name:48s} outputs {out / MIB:7.2f} MiB  peak {peak / MIB:7.2f}  scratch {scratch / MIB:7.2f} "
              f"= {scratch / reference:.2f} x {against}", flush=True)
    from importlib.metadata import version

    ort_version = next((version(d) for d in ("onnxruntime-training-cpu", "onnxruntime-training", "onnxruntime") if _installed(d)), "?")
    results = {"onnxruntime": ort_version, "cpus": os.cpu_count(), "shapes": {"batch": B, "heads": H, "seq": S, "hidden": D, "vocab": V}, "rows": rows}
    lines = [
        f"# Kernel scratch on ONNX Runtime {ort_version} (CPU provider, {os.cpu_count()} cores)",
        "",
        "Peak RSS of one op's run above the RSS before it, minus its outputs (`benchmarks/kernel_scratch.py`).",
        "",
        "| case | op | outputs MiB | peak MiB | scratch MiB | scratch / tensor |",
        "|---|---|---:|---:|---:|---|",
    ]
    lines += [f"| {r['case']} | {r['op']} | {r['outputs_mib']:.2f} | {r['peak_mib']:.2f} | {r['scratch_mib']:.2f} | "
              f"{r['scratch_ratio']:.2f} x {r['against']} |" for r in rows]
    if os.environ.get("ORTPASS_BENCH_TINY") != "1":
        stem = f"kernel_scratch_{ort_version}"
        (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=1))
        (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
        return True
    except PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
