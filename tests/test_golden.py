"""Issue 8: golden models through the full pipeline, and readable diffs when a pass changes."""

import json
import shutil
from pathlib import Path

import pytest

from ortpass import golden
from ortpass.cli import main

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden_models"
NAMES = sorted(golden.discover(GOLDEN_DIR))


def test_every_golden_model_has_expectations_and_a_small_bundled_export():
    assert NAMES, "no golden models found"
    for name in NAMES:
        assert (GOLDEN_DIR / f"{name}{golden.EXPECTED_SUFFIX}").is_file(), name
        onnx_file = GOLDEN_DIR / f"{name}.onnx"
        assert onnx_file.is_file() and onnx_file.stat().st_size < 1_000_000, name


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_golden_model_matches_its_expectations(name):
    (result,) = golden.check(GOLDEN_DIR, [name])
    assert result.ok, "\n".join(result.differences)


@pytest.mark.slow
@pytest.mark.stock
def test_the_torch_builders_golden_model_holds_on_either_runtime():
    """The torch builder's golden case needs no training build: on stock onnxruntime (CI's
    second venv) its recorded step holds as on the training build."""
    (result,) = golden.check(GOLDEN_DIR, ["gpt_decoder_torch"])
    assert result.ok, "\n".join(result.differences)


def test_compare_reports_each_difference_on_its_own_line():
    expected = {
        "ops": {"03 recompute": {"Gelu": 4, "Add": 2}},
        "passes": {"recompute": {"modified": True, "counts": {"subgraphs recomputed": 3}}},
        "step": {"rtol": 1e-4, "loss": 2.0, "gradients": {"w": {"l2": 1.0}}},
    }
    actual = {
        "ops": {"03 recompute": {"Gelu": 2, "Add": 2, "Mul": 1}},
        "passes": {"recompute": {"modified": False, "counts": {}}},
        "step": {"rtol": 1e-4, "loss": 2.00001, "gradients": {"w": {"l2": 1.5}}},
    }
    lines = golden.compare(expected, actual)
    assert "ops.03 recompute.Gelu: expected 4, got 2" in lines
    assert "ops.03 recompute.Mul: new, 1" in lines
    assert "passes.recompute.modified: expected true, got false" in lines
    assert "passes.recompute.counts.subgraphs recomputed: expected 3, now missing" in lines
    assert any(line.startswith("step.gradients.w.l2: expected 1, got 1.5") for line in lines)
    # 5e-6 relative on the loss is inside rtol 1e-4: not a difference.
    assert not any(line.startswith("step.loss") for line in lines)
    assert len(lines) == 5


def test_compare_of_equal_records_is_empty():
    record = {"ops": {"export": {"Gemm": 2}}, "step": {"rtol": 1e-4, "loss": 1.25}}
    assert golden.compare(record, json.loads(json.dumps(record))) == []


def test_a_deliberately_changed_pass_shows_up_as_a_clear_diff(tmp_path, capsys):
    # Copy a golden model, and change its pipeline the way a regression in a pass would:
    # recompute no longer runs, so fewer nodes, no clones, different stats.
    shutil.copy(GOLDEN_DIR / "gpt_decoder.py", tmp_path / "gpt_decoder.py")
    shutil.copy(GOLDEN_DIR / "gpt_decoder.expected.json", tmp_path / "gpt_decoder.expected.json")
    case_file = tmp_path / "gpt_decoder.py"
    case_file.write_text(case_file.read_text().replace(",recompute(level=1)", ",recompute(level=0)"))
    assert main(["golden", "check", "gpt_decoder", "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "gpt_decoder: " in out and "differences" in out
    assert "passes.recompute.modified: expected true, got false" in out
    assert "ortpass golden update NAME" in out


def test_update_writes_only_when_asked_and_check_then_passes(tmp_path):
    shutil.copy(GOLDEN_DIR / "mlp.py", tmp_path / "mlp.py")
    assert main(["golden", "check", "--dir", str(tmp_path)]) == 1  # nothing recorded yet
    assert not (tmp_path / "mlp.expected.json").exists()
    assert main(["golden", "update", "mlp", "--dir", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "mlp.expected.json").read_text())
    assert record["step"]["torch_parity"]["max_relative_error"] <= 1e-5
    assert (tmp_path / "mlp.onnx").is_file()
    assert main(["golden", "check", "mlp", "--dir", str(tmp_path)]) == 0


def test_unknown_golden_name_is_a_usage_error(capsys):
    assert main(["golden", "check", "no_such_model", "--dir", str(GOLDEN_DIR)]) == 2
