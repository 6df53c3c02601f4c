"""What one call of a Python op costs: a ``torch.autograd.Function`` run from the graph, on
stock onnxruntime (the torch builder's Python ops, through onnxruntime-extensions) and on
ORT's training build (ORTModule's PythonOp, through ortpass's bridge).

Each side trains, through ``ORTModule``, a module whose step applies a Function that torch
cannot trace (numpy copies forward and backward) to ``x + p`` (``x`` a batch of ``n``
floats, ``p`` a parameter), and the same module with ``(x + p) * 1`` in its place; the
Function's cost is the difference of the two steps' times (fastest of the timed steps, a
forward and a backward call each).  On stock a third row measures the same step with
onnxruntime-extensions' own Python hook, which hands outputs back as lists, in place of
ortpass's, which hands back arrays.  Each side runs in its own interpreter (the training
build is one Python's onnxruntime, stock another's).

Usage: ``python benchmarks/pythonop_call.py [--stock-python P] [--training-python P]``.
Writes ``results/pythonop_call.json`` and ``.md``.  Timings share this machine's cores
with whatever else runs: read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent
SIZES = [1, 1_000, 100_000, 1_000_000]
STEPS = {1: 60, 1_000: 60, 100_000: 30, 1_000_000: 10}
if os.environ.get("ORTPASS_BENCH_TINY") == "1":  # the test suite's smoke run
    SIZES, STEPS = [1, 1_000], {1: 3, 1_000: 3}


def _measure_side(side: str) -> dict:
    import numpy as np
    import torch

    from ortpass.pythonop.shape_inference import register_shape_inferer
    from ortpass.runtime.module import ORTModule

    class NumpyCopy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.from_numpy(x.detach().numpy().copy())

        @staticmethod
        def backward(ctx, grad):
            return torch.from_numpy(grad.numpy().copy())

    register_shape_inferer(NumpyCopy, replace=True)(lambda node, shapes, dtypes: ([shapes[0]], [dtypes[0]]))

    class Step(torch.nn.Module):
        def __init__(self, n: int, through_function: bool):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(n))
            self.through_function = through_function

        def forward(self, x):
            h = x + self.p
            return (NumpyCopy.apply(h) if self.through_function else h * 1.0).sum()

    def step_time(n: int, through_function: bool, rehook=None) -> float:
        torch.manual_seed(0)
        wrapped = ORTModule(Step(n, through_function), builder="torch" if side == "stock" else "ort")
        x = torch.randn(2, n)
        wrapped(x).backward()  # the build and a first run
        if rehook is not None:
            rehook()
        times = []
        for _ in range(STEPS[n]):
            start = time.perf_counter()
            wrapped(x).backward()
            times.append(time.perf_counter() - start)
        return min(times)

    rows = []
    for n in SIZES:
        base, with_function = step_time(n, False), step_time(n, True)
        row = {"elements": 2 * n, "step_without_s": base, "step_with_s": with_function, "call_pair_us": (with_function - base) * 1e6}
        if side == "stock":
            from onnxruntime_extensions import PyOp, _ocos

            lists = step_time(n, True, rehook=lambda: PyOp.install_hooker(_ocos._on_pyop_invocation))
            import onnxruntime_extensions

            from ortpass.training import python_op_kernels

            python_op_kernels._hooked = False  # ortpass's hook back for the next size
            python_op_kernels._install_hook(onnxruntime_extensions)
            row["step_with_lists_s"] = lists
            row["call_pair_lists_us"] = (lists - base) * 1e6
        rows.append(row)
    import onnxruntime

    return {"side": side, "onnxruntime": onnxruntime.__version__, "torch": torch.__version__, "rows": rows}


def _markdown(results: list[dict]) -> str:
    by_side = {r["side"]: r for r in results}
    lines = [
        "# Python op call cost (`benchmarks/pythonop_call.py`)",
        "",
        "One training step through `ORTModule` calls a numpy-copy `torch.autograd.Function` once forward and once "
        "backward on a `[2, n]` float32 tensor; the pair's cost is the step's fastest time minus that of the same "
        "step with `(x + p) * 1` in its place. Stock: the torch builder's Python ops through onnxruntime-extensions "
        f"(onnxruntime {by_side.get('stock', {}).get('onnxruntime', '?')}); training build: ORT's PythonOp through "
        f"ortpass's bridge (onnxruntime-training {by_side.get('training', {}).get('onnxruntime', '?')}). Timings on a "
        "shared 2-core machine: orders of magnitude, not digits.",
        "",
        "| elements | training build: PythonOp pair | stock: Python op pair (arrays, ortpass's hook) | stock: with extensions' list hook | stock step without the Function |",
        "|---:|---:|---:|---:|---:|",
    ]
    stock, training = by_side.get("stock", {}).get("rows", []), by_side.get("training", {}).get("rows", [])
    for k, row in enumerate(stock or training):
        t = training[k] if k < len(training) else {}
        s = stock[k] if k < len(stock) else {}

        def us(value):
            return f"{value:,.0f} us" if value is not None else "-"

        lines.append(
            f"| {row['elements']:,} | {us(t.get('call_pair_us'))} | {us(s.get('call_pair_us'))} | "
            f"{us(s.get('call_pair_lists_us'))} | {us(s.get('step_without_s', 0) * 1e6 if s else None)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["stock", "training"], help="measure one side in this interpreter (JSON to stdout)")
    parser.add_argument("--stock-python", default=str(ROOT / ".venv-stock" / "bin" / "python"))
    parser.add_argument("--training-python", default="python3")
    parser.add_argument("--out", default=str(RESULTS / "pythonop_call"))
    args = parser.parse_args(argv)
    if args.side:
        print(json.dumps(_measure_side(args.side)))
        return
    results = []
    for side, python in (("training", args.training_python), ("stock", args.stock_python)):
        done = subprocess.run([python, __file__, "--side", side], capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"the {side} side failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(_markdown(results))
    print(_markdown(results))


if __name__ == "__main__":
    main()
