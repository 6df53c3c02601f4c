"""The ``ortpass`` command end to end on a tiny hand-built model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
from conftest import make_relu_model

from ortpass.cli import main
from ortpass.infra.base import OrtPass

REPO = Path(__file__).resolve().parents[1]


class CliInsertIdentityPass(OrtPass):
    """Puts an Identity in front of the first node."""

    name = "cli-insert-identity"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        first = model.graph.node(0)
        identity = ir.node("Identity", [first.inputs[0]])
        model.graph.insert_before(first, identity)
        first.replace_input_with(0, identity.outputs[0])
        return ir.passes.PassResult(model, True)


class CliFailingPass(OrtPass):
    name = "cli-failing"
    runs_after = {"cli-insert-identity"}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        raise RuntimeError("this pass always fails")


class CliNeedsShapesPass(OrtPass):
    name = "cli-needs-shapes"
    phase = "pre-grad"
    requires_properties = {"shapes"}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, False)


@pytest.fixture(autouse=True)
def registered(isolated_registry):
    for cls in (CliInsertIdentityPass, CliFailingPass, CliNeedsShapesPass):
        isolated_registry[cls.name] = cls


@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "in.onnx"
    ir.save(make_relu_model(), path)
    return path


def op_types(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path)).graph.node]


def test_optimize_writes_output_report_and_dumps(model_file, tmp_path, capsys):
    before = model_file.read_bytes()
    out, report, dumps = tmp_path / "out.onnx", tmp_path / "report.json", tmp_path / "dumps"
    code = main([
        "optimize", str(model_file), "-o", str(out), "--pipeline", "cli-insert-identity",
        "--report", str(report), "--dump-dir", str(dumps),
    ])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert op_types(out) == ["Identity", "Relu"]
    assert model_file.read_bytes() == before
    assert json.loads(report.read_text())["passes"][0]["added"] == {"Identity": 1}
    assert sorted(p.name for p in dumps.iterdir()) == ["01_cli-insert-identity.onnx"]
    assert "cli-insert-identity" in captured.out and "Identity+1" in captured.out  # the table
    assert "[1/1] cli-insert-identity: changed" in captured.err  # progress goes to logging


def test_optimize_writes_the_serialization_the_final_check_accepted(model_file, tmp_path, monkeypatch):
    out, serialized = tmp_path / "out.onnx", []
    real = ir.to_proto
    monkeypatch.setattr(ir, "to_proto", lambda obj: (serialized.append(obj), real(obj))[1])
    assert main(["optimize", str(model_file), "-o", str(out), "--pipeline", "cli-insert-identity"]) == 0
    whole_models = [m for m in serialized if isinstance(m, ir.Model) and len(m.graph)]
    assert len(whole_models) == 1  # by the final check; saving did not serialize again
    assert out.read_bytes() == real(whole_models[0]).SerializeToString()


def test_optimize_refuses_to_overwrite_the_input(model_file, capsys):
    before = model_file.read_bytes()
    spelled_differently = model_file.parent / "." / model_file.name
    for output in (model_file, spelled_differently):
        assert main(["optimize", str(model_file), "-o", str(output), "--pipeline", "cli-insert-identity"]) == 2
        assert "refusing to overwrite" in capsys.readouterr().err
    assert main(["optimize", str(model_file), "--pipeline", "cli-insert-identity"]) == 2
    assert "--in-place" in capsys.readouterr().err
    assert model_file.read_bytes() == before


def test_optimize_refuses_a_report_path_that_is_the_input(model_file, tmp_path, capsys):
    before = model_file.read_bytes()
    args = ["optimize", str(model_file), "-o", str(tmp_path / "o.onnx"), "--pipeline", "cli-insert-identity"]
    assert main(args + ["--report", str(model_file)]) == 2
    assert "--report" in capsys.readouterr().err
    assert model_file.read_bytes() == before


def test_in_place_replaces_the_input(model_file):
    assert main(["optimize", str(model_file), "--in-place", "--pipeline", "cli-insert-identity"]) == 0
    assert op_types(model_file) == ["Identity", "Relu"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no-such-pass", "PipelineSpecError: position 0: unknown pass 'no-such-pass'"),
        ("cli-insert-identity(", "PipelineSpecError"),
        ("cli-insert-identity(level=1)", "has no option 'level'"),
        ("cli-needs-shapes", "PassOrderingError: pass 'cli-needs-shapes' requires 'shapes'"),
    ],
)
def test_a_bad_pipeline_is_bad_usage(model_file, tmp_path, capsys, spec, message):
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(model_file), "-o", str(out), "--pipeline", spec]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_failing_pass_exits_1_naming_it_and_writes_no_model(model_file, tmp_path, capsys):
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    code = main([
        "optimize", str(model_file), "-o", str(out), "--pipeline", "cli-failing,cli-insert-identity",
        "--report", str(report),
    ])
    assert code == 1
    err = capsys.readouterr().err
    assert "pass 'cli-failing' failed: RuntimeError: this pass always fails" in err
    assert err.count("this pass always fails") == 1  # the reason once, not in the progress line too
    assert "[2/2] cli-failing: FAILED, rolled back" in err
    assert not out.exists()
    records = json.loads(report.read_text())["passes"]
    assert [(r["name"], r["error"] is not None) for r in records] == [("cli-insert-identity", False), ("cli-failing", True)]


def test_input_that_is_not_a_model_is_bad_input(tmp_path, capsys):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\xff\xfe not a protobuf")
    for path in (junk, tmp_path / "missing.onnx"):
        assert main(["optimize", str(path), "-o", str(tmp_path / "o.onnx"), "--pipeline", "cli-insert-identity"]) == 2
        assert "ModelLoadError" in capsys.readouterr().err


def test_bad_arguments_are_bad_usage(capsys):
    assert main(["optimize"]) == 2
    assert main(["no-such-command"]) == 2
    err = capsys.readouterr().err
    # One line each, naming the problem and where the usage is.
    assert err.splitlines() == [
        "ortpass optimize: error: the following arguments are required: IN.onnx (see ortpass optimize --help)",
        "ortpass: error: argument COMMAND: invalid choice: 'no-such-command' (choose from 'optimize', 'list-passes', "
        "'report', 'golden') (see ortpass --help)",
    ]


def test_quiet_hides_progress(model_file, tmp_path, capsys):
    assert main(["-q", "optimize", str(model_file), "-o", str(tmp_path / "o.onnx"), "--pipeline", "cli-insert-identity"]) == 0
    assert "[1/1]" not in capsys.readouterr().err


def test_list_passes_shows_declarations_and_source(capsys):
    assert main(["list-passes", "--wide"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "phase", "requires", "provides", "options", "rule", "source"]
    row = next(line for line in lines if line.startswith("cli-needs-shapes"))
    assert row.split() == ["cli-needs-shapes", "pre-grad", "shapes", "-", "-", "-", "test_cli.CliNeedsShapesPass"]


def test_report_on_a_forward_graph_with_no_build_prints_a_summary_and_explains_why_no_analysis(model_file, tmp_path, capsys):
    before = model_file.read_bytes()
    json_path = tmp_path / "r.json"
    assert main(["report", str(model_file), "--json", str(json_path), "--no-build"]) == 2
    captured = capsys.readouterr()
    assert "nodes: 1 (Relu 1)" in captured.out and "x  FLOAT[2,3]" in captured.out
    assert "not a training graph" in captured.err and "ortpass optimize" in captured.err
    assert model_file.read_bytes() == before and not json_path.exists()


def test_report_on_a_forward_graph_it_cannot_build_from_is_bad_input(model_file, tmp_path, capsys):
    """Without --no-build the report builds the training graph; a model without a loss has
    none, which is the input's fault (exit 2), named, and nothing is written."""
    before = model_file.read_bytes()
    json_path = tmp_path / "r.json"
    assert main(["report", str(model_file), "--json", str(json_path)]) == 2
    err = capsys.readouterr().err
    assert "is a forward model" in err and "Traceback" not in err
    assert model_file.read_bytes() == before and not json_path.exists()


def test_report_refuses_to_write_over_the_model(model_file, capsys):
    before = model_file.read_bytes()
    assert main(["report", str(model_file), "--plot", str(model_file)]) == 2
    assert "--plot" in capsys.readouterr().err
    assert model_file.read_bytes() == before


def test_the_installed_command_with_a_plugin_pass_from_an_entry_point(model_file, tmp_path):
    """A real process: `python -m ortpass`, with a pass that only an entry point provides."""
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "cli_plugin_pass.py").write_text(textwrap.dedent(
        '''
        import onnx_ir as ir
        from ortpass.infra.base import OrtPass

        class NegateInput(OrtPass):
            """Puts a Neg in front of the first node."""

            def call(self, model):
                first = model.graph.node(0)
                neg = ir.node("Neg", [first.inputs[0]])
                model.graph.insert_before(first, neg)
                first.replace_input_with(0, neg.outputs[0])
                return ir.passes.PassResult(model, True)
        '''
    ))
    dist_info = plugin / "cli_plugin_pass-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: cli-plugin-pass\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[ortpass.passes]\nnegate-input = cli_plugin_pass:NegateInput\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin), str(REPO)]))
    out = tmp_path / "out.onnx"

    def run(*args):
        return subprocess.run([sys.executable, "-m", "ortpass", *args], env=env, capture_output=True, text=True, timeout=120)

    done = run("optimize", str(model_file), "-o", str(out), "--pipeline", "negate-input")
    assert done.returncode == 0, done.stderr
    assert op_types(out) == ["Neg", "Relu"]
    assert "negate-input" in done.stdout
    refused = run("optimize", str(model_file), "-o", str(model_file), "--pipeline", "negate-input")
    assert refused.returncode == 2 and "refusing to overwrite" in refused.stderr


def test_report_on_a_real_training_graph_prints_plans_and_plots_without_touching_it(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setenv("COLUMNS", "100")  # the plan table's width: pytest-xdist's workers set 80

    from ortpass.export import export
    from ortpass.testing.models import GPTDecoder
    from ortpass.training import build_training_graph

    torch.manual_seed(0)
    module = GPTDecoder(vocab=32, hidden=32, heads=4, layers=2, max_seq=16, dropout=0.1)
    ids = torch.randint(0, 32, (2, 16))
    training = build_training_graph(export(module, (ids, ids), input_names=["input_ids", "labels"]))
    model_file = tmp_path / "train.onnx"
    ir.save(training, model_file)
    before = (model_file.read_bytes(), model_file.stat().st_mtime_ns)
    png, report = tmp_path / "timeline.png", tmp_path / "report.json"

    # A model this small is under ORT's 1Mi-element floor: lower it to see its plans.
    args = ["report", str(model_file), "--layer-boundary", "--min-elements", "0", "--plot", str(png), "--json", str(report)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "training graph: loss 'loss', 30 parameters" in out
    assert "LayerNormalization+:1:-1" in out and "2 layer boundaries" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(p["plan"] == "Dropout+:1:-1" for p in json.loads(report.read_text())["recompute"]["plans"])
    assert (model_file.read_bytes(), model_file.stat().st_mtime_ns) == before


def test_report_with_a_budget_prints_the_choice_and_records_it(tmp_path, capsys):
    import torch

    from ortpass.analysis.step_memory import predict_step_memory
    from ortpass.export import export
    from ortpass.testing.models import GPTDecoder
    from ortpass.training import build_training_graph

    torch.manual_seed(0)
    module = GPTDecoder(vocab=32, hidden=32, heads=4, layers=2, max_seq=16, dropout=0.1)
    ids = torch.randint(0, 32, (2, 16))
    training = build_training_graph(export(module, (ids, ids), input_names=["input_ids", "labels"]))
    model_file, report = tmp_path / "train.onnx", tmp_path / "report.json"
    ir.save(training, model_file)
    assert main(["report", str(model_file), "--budget", "0.0", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "memory budget 0.0: predicted step peak" in out and "subgraphs recomputed" in out
    plan = json.loads(report.read_text())["budget"]
    assert plan["peak_without_recompute_bytes"] == predict_step_memory(training).peak_bytes
    # Budget 0.0 targets the lowest peak the planner's samples found, and the plan meets it; the
    # bisection below that sample can land lower (the peak is not monotone in the prefix, and
    # which prefix depends on this machine's cost model: 151812 against 155012 bytes on one).
    assert plan["target_bytes"] == plan["peak_recomputing_everything_bytes"] < plan["peak_without_recompute_bytes"]
    assert plan["predicted_peak_bytes"] <= plan["target_bytes"]
    assert plan["chosen"] and all(c["seconds"] > 0 for c in plan["chosen"])
    # A budget is checked as an argument: a bad one is a usage error naming it.
    assert main(["report", str(model_file), "--budget", "lots"]) == 2
    assert "memory budget 'lots' is not a size" in capsys.readouterr().err
    # One no recompute reaches is refused as bad input, naming the lowest peak.
    assert main(["report", str(model_file), "--budget", "1"]) == 2
    assert "smallest step peak recompute reaches" in capsys.readouterr().err
