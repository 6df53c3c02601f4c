"""The density flag where it survives its pass (issue #21).

``FlagAndPrintDensity`` is ortpass's own identity Function.  It stays in the training graph
when the pipeline has no ``insert-gather-before-sce-loss`` or when
``ORTPASS_PRINT_INPUT_DENSITY=1`` keeps it for printing, and then ORT calls it through the
bridge at every step.  The bridge always knows it, in any process: these tests run in a
fresh interpreter that never exported anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden_models" / "bert_mlm.onnx"

STEP = textwrap.dedent(
    """
    import sys
    import numpy as np
    import onnx_ir as ir
    import ortpass
    from ortpass.runtime import TrainingSession

    model = ir.load(sys.argv[1])
    flags = [n for n in model.graph if n.op_type == "PythonOp"]
    assert flags and all("FlagAndPrintDensity" in n.attributes["func_name"].as_string() for n in flags), flags
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, (4, 32))
    labels = np.where(rng.random((4, 32)) < 0.25, ids, -100)
    step = TrainingSession(model).run({"input_ids": ids, "labels": labels})
    assert np.isfinite(step.loss) and step.gradients
    print("step ok", step.loss)
    """
)


def _fresh(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_flag_kept_by_a_pipeline_without_the_gather_runs_in_a_fresh_process(tmp_path):
    out = tmp_path / "no_gather.onnx"
    optimize = _fresh("-m", "ortpass", "optimize", str(GOLDEN), "-o", str(out),
                      "--pipeline", "build-training-graph,fix-dropout-seed(level=1),recompute(level=1)")
    assert optimize.returncode == 0, optimize.stderr
    step = _fresh("-c", STEP, str(out))
    assert step.returncode == 0, step.stderr
    assert "step ok" in step.stdout


@pytest.mark.slow
def test_flag_kept_for_printing_prints_each_steps_density_in_a_fresh_process(tmp_path):
    out = tmp_path / "printing.onnx"
    env = {"ORTPASS_PRINT_INPUT_DENSITY": "1"}
    optimize = _fresh("-m", "ortpass", "optimize", str(GOLDEN), "-o", str(out), env=env)
    assert optimize.returncode == 0, optimize.stderr
    step = _fresh("-c", STEP, str(out), env=env)
    assert step.returncode == 0, step.stderr
    # The step's own labels (25% drawn above, ~15% at export), printed by the flag.
    assert "label density" in step.stdout and "at export" in step.stdout


def test_the_gather_pass_still_removes_the_flag(tmp_path):
    out = tmp_path / "default.onnx"
    optimize = _fresh("-m", "ortpass", "optimize", str(GOLDEN), "-o", str(out))
    assert optimize.returncode == 0, optimize.stderr
    import onnx

    assert not [n for n in onnx.load(out).graph.node if n.op_type == "PythonOp"]
