"""Causal attention on a CPU: ONNX Runtime's kernels against torch's, and what torch's fused
kernel is worth to torch with checkpointing.

The torch builder writes attention as ONNX math (``MatMul``, ``Mul``, the mask's ``Add``,
``Softmax``, ``MatMul``): stock onnxruntime has no gradient kernel for a fused attention, so
the backward needs the probabilities as a tensor anyway.  torch's eager step uses SDPA's
fused (flash) kernel for the forward, its recomputation and the backward.  This measures
how much of LLaMA's step-time gap (``benchmarks/results/hf_memory.md``: ``ORTModule`` on stock
against torch with checkpointing) that kernel is:

1. One causal attention forward at ``hf_memory.py``'s LLaMA shapes (batch 8, 4 heads, seq
   512, head dim 64, float32), 2 threads, the fastest of 10 runs after one warm-up: the
   math subgraph on the installed onnxruntime; ONNX's ``Attention`` (opset 23,
   ``is_causal=1``) where the installed onnxruntime has a CPU kernel for it; torch's SDPA
   with its flash kernel and with its math kernel.  The outputs are compared.
2. torch with ``gradient_checkpointing_enable()`` on ``hf_memory.py``'s LLaMA (4 layers,
   hidden 256, batch 8 x 512), one process, SDPA's flash and math kernels alternating for
   ``--rounds`` rounds, each the fastest of 4 warm steps: the same model, loss and
   recomputation, only the attention kernel differs.
3. The kernels of stock onnxruntime's fused attention (``ortpass.training.stock_attention``)
   at the same shapes, called as onnxruntime-extensions calls them (numpy arrays in and
   out), the fastest of 20: the forward; the backward that runs SDPA again under autograd
   (a call with dropout); the backward from the forward's output and logsumexp (torch's
   flash backward, a call without).

Usage: ``python benchmarks/attention_time.py [--rounds 4]``.  Writes
``attention_time.json`` and ``.md`` next to this script.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the recorded results, apart from the scripts
sys.path.insert(0, str(HERE))
import hf_memory  # noqa: E402  (the model the step-time rows use)
import recompute_memory as rm  # noqa: E402  (record())

THREADS = 2
B, H, S, D = 8, 4, 512, 64
TINY = os.environ.get("ORTPASS_BENCH_TINY") == "1"  # the test suite's smoke run
if TINY:
    B, H, S, D = 2, 2, 16, 8


def _fastest(run, repeats: int = 10) -> float:
    run()  # warm-up: ORT's first run plans its memory, torch's picks kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def _onnx_attention(fused: bool):
    """A one-attention model: ONNX's ``Attention`` op, or the math the torch builder writes."""
    import onnx
    from onnx import helper, numpy_helper

    shape = [B, H, S, D]
    inputs = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape) for name in "qkv"]
    output = [helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, shape)]
    if fused:
        graph = helper.make_graph([helper.make_node("Attention", ["q", "k", "v"], ["o"], is_causal=1)],
                                  "attention", inputs, output)
    else:
        mask = np.triu(np.full((S, S), -np.inf, np.float32), 1)
        nodes = [
            helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
            helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
            helper.make_node("Add", ["scaled", "mask"], ["masked"]),
            helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
            helper.make_node("MatMul", ["probs", "v"], ["o"]),
        ]
        constants = [numpy_helper.from_array(np.array(D**-0.5, np.float32), "scale"),
                     numpy_helper.from_array(mask, "mask")]
        graph = helper.make_graph(nodes, "attention_math", inputs, output, constants)
    opset = 23 if fused else 17  # Attention is new in opset 23
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10 if fused else 8)
    return model.SerializeToString()


def _ort_row(fused: bool, feeds: dict) -> dict:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    try:
        session = ort.InferenceSession(_onnx_attention(fused), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # an onnxruntime without the op (opset 23 needs 1.22 or later)
        return {"not_run": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    output = session.run(None, feeds)[0]
    return {"seconds": _fastest(lambda: session.run(None, feeds)), "output": output}


def _torch_row(backend, tensors) -> dict:
    import torch
    from torch.nn.attention import sdpa_kernel

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(*tensors, is_causal=True)

    output = run().numpy()
    return {"seconds": _fastest(run), "output": output}


def kernels() -> dict:
    """Row name -> fastest seconds (or why not run) and the largest difference to torch's math kernel."""
    import onnxruntime as ort
    import torch
    from torch.nn.attention import SDPBackend

    torch.set_num_threads(THREADS)
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal((B, H, S, D), dtype=np.float32) for name in "qkv"}
    tensors = [torch.from_numpy(feeds[name]) for name in "qkv"]
    rows = {
        f"onnxruntime {ort.__version__}, the torch builder's math ops": _ort_row(False, feeds),
        f"onnxruntime {ort.__version__}, ONNX Attention (opset 23)": _ort_row(True, feeds),
        "torch SDPA, flash kernel": _torch_row(SDPBackend.FLASH_ATTENTION, tensors),
        "torch SDPA, math kernel": _torch_row(SDPBackend.MATH, tensors),
    }
    reference = rows["torch SDPA, math kernel"]["output"]
    for row in rows.values():
        if "output" in row:
            row["max_abs_diff"] = float(np.abs(row.pop("output") - reference).max())
    return rows


def checkpointed_steps(rounds: int) -> dict:
    """torch with checkpointing on hf_memory's LLaMA: the fastest warm step of each round,
    with SDPA's flash kernel and with its math kernel, alternating."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    seq = S if TINY else 512
    model = hf_memory.build_model("llama", seq)
    model.config.use_cache = False
    model.train()
    model.gradient_checkpointing_enable()
    batch = B if TINY else hf_memory.BATCH
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, hf_memory.VOCAB, (batch, seq)))

    def step():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()

    times: dict[str, list[float]] = {"flash": [], "math": []}
    for _ in range(rounds):
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("math", SDPBackend.MATH)):
            with sdpa_kernel(backend):
                times[name].append(_fastest(step, repeats=1 if TINY else 4))
    return times


def python_op_kernels() -> dict:
    """Milliseconds a call of each stock fused-attention kernel, causal, as ORT calls them."""
    import torch

    from ortpass.training import stock_attention

    torch.set_num_threads(THREADS)
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((B, H, S, D), dtype=np.float32) for _ in range(4))

    def call(flash: bool):
        return stock_attention._Attention(0, True, None, False, torch.float32, None, flash=flash)

    out, logsumexp = stock_attention._forward_kernel(call(True))(q, k, v)
    again, from_logsumexp = stock_attention._backward_kernel(call(False)), stock_attention._backward_kernel(call(True))
    difference = max(float(np.abs(a - b).max()) for a, b in zip(again(dout, q, k, v), from_logsumexp(dout, q, k, v, out, logsumexp)))
    REPEATS = 3 if TINY else 20  # noqa: N806  (the backwards' times moved by a third between runs of 10)
    return {
        "forward": _fastest(lambda: stock_attention._forward_kernel(call(True))(q, k, v), REPEATS) * 1e3,
        "backward, SDPA run again under autograd": _fastest(lambda: again(dout, q, k, v), REPEATS) * 1e3,
        "backward from the forward's logsumexp": _fastest(lambda: from_logsumexp(dout, q, k, v, out, logsumexp), REPEATS) * 1e3,
        "max_abs_diff_of_the_backwards": difference,
    }


def markdown(results: dict) -> str:
    lines = [
        "# Causal attention on a CPU: ONNX Runtime's kernels and torch's",
        "",
        f"One causal attention forward, batch {B}, {H} heads, seq {S}, head dim {D}, float32, "
        f"{THREADS} threads, fastest of 10 runs; difference: largest absolute difference to "
        "torch's math kernel. Load average before/after: "
        f"{results['load'][0]:.1f} / {results['load'][1]:.1f}.",
        "",
        "| kernel | ms | max abs diff |",
        "|---|---:|---:|",
    ]
    for name, row in results["kernels"].items():
        if "not_run" in row:
            lines.append(f"| {name} | not run: {row['not_run']} | |")
        else:
            lines.append(f"| {name} | {row['seconds'] * 1e3:.1f} | {row['max_abs_diff']:.1e} |")
    steps = results["checkpointed_steps"]
    lines += [
        "",
        "torch + `gradient_checkpointing_enable()` on `hf_memory.py`'s LLaMA, one process, the "
        "two SDPA kernels alternating; each entry the fastest of 4 warm steps (s):",
        "",
        "| SDPA kernel | " + " | ".join(f"round {i + 1}" for i in range(len(steps["flash"]))) + " |",
        "|---|" + "---:|" * len(steps["flash"]),
    ]
    for name in ("flash", "math"):
        lines.append(f"| {name} | " + " | ".join(f"{t:.2f}" for t in steps[name]) + " |")
    kernels = dict(results.get("python_op_kernels", {}))
    if kernels:
        difference = kernels.pop("max_abs_diff_of_the_backwards")
        lines += [
            "",
            "Stock onnxruntime's fused attention (`fused_attention=True`): its Python-op kernels at the "
            "same shapes, causal, called from numpy arrays as onnxruntime-extensions calls them, fastest "
            f"of 20 (the two backwards' gradients differ by at most {difference:.1e}):",
            "",
            "| kernel | ms a call |",
            "|---|---:|",
            *(f"| {name} | {ms:.1f} |" for name, ms in kernels.items()),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    results = {"kernels": kernels(), "checkpointed_steps": checkpointed_steps(args.rounds),
               "python_op_kernels": python_op_kernels()}
    results["load"] = [load_before, os.getloadavg()[0]]
    rm.record(RESULTS / "attention_time", results, markdown(results))


if __name__ == "__main__":
    main()
