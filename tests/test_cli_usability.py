"""The command's first ten minutes: -v/-q anywhere, list-passes that teaches the options,
report on a forward model and on recompute's own output, post-grad passes on a saved
training graph, tables that fit the terminal, no torch noise, and golden update that
rewrites only what changed.  Each rule is checked both ways."""

from __future__ import annotations

import collections

import contextlib
import io as _io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Literal, Sequence

import onnx
import onnx_ir as ir
import pytest

from ortpass import cli as cli_package
from ortpass.cli import main
from ortpass.conventions import RECOMPUTE_OF_KEY, SIDE_KEY
from ortpass.infra.base import OrtPass
from ortpass.infra.pipeline_text import parse_pipeline
from ortpass.passes import DEFAULT_PIPELINE
from ortpass.infra.options import AtLeast, NonNegativeInt, describe_options, type_text
from ortpass.infra.text_table import MAX_WORD, format_table, wrap_text

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "golden_models"
MLP, BERT = GOLDEN / "mlp.onnx", GOLDEN / "bert_mlm.onnx"


def _run(*argv) -> tuple[int, str, str]:
    out, err = _io.StringIO(), _io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(autouse=True)
def _terminal_of_100_columns(monkeypatch):
    """Not a terminal: tables fit 100 columns (COLUMNS is what a test can set for certain)."""
    monkeypatch.setenv("COLUMNS", "100")


@pytest.fixture(scope="module")
def mlp_training(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mlp") / "mlp.train.onnx"
    code, _, err = _run("optimize", MLP, "-o", out, "--pipeline", "build-training-graph")
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def bert_optimized(tmp_path_factory) -> tuple[Path, dict, str]:
    """The default pipeline's output on the BERT golden model, its report and its table."""
    directory = tmp_path_factory.mktemp("bert")
    out, report = directory / "out.onnx", directory / "report.json"
    code, table, err = _run("optimize", BERT, "-o", out, "--report", report)
    assert code == 0, err
    return out, json.loads(report.read_text()), table


# -- 1. -v/-q before and after the command ---------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "verbosity"),
    [
        (["list-passes"], 0),
        (["-v", "list-passes"], 1),
        (["list-passes", "-v"], 1),
        (["-v", "list-passes", "-v"], 2),
        (["-q", "list-passes", "-v"], 0),
        (["list-passes", "-qq"], -2),
        (["-q", "report", "x.onnx", "-q"], -2),
        (["golden", "check", "-q", "--dir", "nowhere"], -1),
    ],
)
def test_verbose_and_quiet_count_before_and_after_the_command(monkeypatch, argv, verbosity):
    seen = []
    monkeypatch.setattr(cli_package, "configure_logging", lambda v: (seen.append(v), lambda: None)[1])
    main(argv)
    assert seen == [verbosity]


def test_quiet_after_the_command_hides_progress_and_its_absence_does_not(tmp_path):
    args = [MLP, "-o", tmp_path / "o.onnx", "--pipeline", "build-training-graph"]
    code, out, err = _run("optimize", "-q", *args)
    assert code == 0 and "[1/1]" not in err and "build-training-graph" in out  # tables still on stdout
    code, _, err = _run("optimize", *args)
    assert code == 0 and "[1/1] build-training-graph" in err


# -- 2. list-passes: rule, phase, options with types and defaults ---------------------------


class OptionsShownPass(OrtPass):
    """Rule: does nothing, with options.

    This second paragraph is not the rule."""

    name = "options-shown"
    phase = "post-grad"

    def __init__(self, level: Literal[0, 1, 2] = 1, *, names: Sequence[str] | None = None, limit: NonNegativeInt = 8) -> None:
        super().__init__()

    def call(self, model):
        return ir.passes.PassResult(model, False)


class UndocumentedPass(OptionsShownPass):
    name = "undocumented"


@pytest.fixture
def listed_passes(isolated_registry):
    isolated_registry["options-shown"] = OptionsShownPass
    isolated_registry["undocumented"] = UndocumentedPass


def test_list_passes_shows_rules_phases_and_options_within_the_width(listed_passes):
    code, out, _ = _run("list-passes")
    assert code == 0
    lines = out.splitlines()
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    block = "\n".join(lines[lines.index(next(x for x in lines if x.startswith("options-shown"))):][:6])
    assert "options-shown" in block and "post-grad" in block
    assert "rule: Rule: does nothing, with options." in block and "second paragraph" not in out
    assert "options: level: 0|1|2 = 1" in block
    assert "names: list[str]|None = None" in block and "limit: int>=0 = 8" in block
    assert "source: test_cli_usability.OptionsShownPass" in block  # not built in: where it comes from
    undocumented = lines[lines.index(next(x for x in lines if x.startswith("undocumented"))) + 1]
    assert undocumented.strip() == "rule: -"  # a docstring inherited from its base is not its rule
    recompute = "\n".join(lines[lines.index(next(x for x in lines if x.startswith("recompute "))):][:8])
    assert "Clone the subgraph behind each selected stashed activation into backward." in recompute
    assert "probe_level: 0|1 = 1" in recompute and "min_elements: int>=0|None = None" in recompute
    assert "source:" not in recompute  # built in


def test_list_passes_wide_is_one_line_a_pass(listed_passes):
    code, out, _ = _run("list-passes", "--wide")
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("options-shown"))
    assert "level: 0|1|2 = 1; names: list[str]|None = None; limit: int>=0 = 8" in row
    assert "Rule: does nothing, with options." in row and row.endswith("test_cli_usability.OptionsShownPass")
    assert max(len(line) for line in out.splitlines()) > 100


def test_option_types_are_written_short():
    assert type_text(Literal[0, 1, 2]) == "0|1|2"
    assert type_text(Annotated[int, AtLeast(1)]) == "int>=1"
    assert type_text(Sequence[str] | None) == "list[str]|None"
    assert type_text(str | os.PathLike | None) == "str|PathLike|None"
    options = {o.name: str(o) for o in describe_options(OptionsShownPass)}
    assert options == {"level": "level: 0|1|2 = 1", "names": "names: list[str]|None = None", "limit": "limit: int>=0 = 8"}


# -- 3a. report on a forward model ----------------------------------------------------------


def test_report_on_a_forward_model_builds_its_training_graph_in_memory_and_says_so(tmp_path):
    before = (MLP.read_bytes(), MLP.stat().st_mtime_ns)
    code, out, err = _run("report", MLP, "--min-elements", "0", "--json", tmp_path / "r.json")
    assert code == 0, err
    said = [line for line in err.splitlines() if "is a forward model" in line]
    assert len(said) == 1 and "built from it in memory" in said[0] and "--pipeline" in said[0] and "--no-build" in said[0]
    assert "forward model: not a training graph" in out and "analysed: its training graph, built in memory by" in out
    assert "Gelu+:1:-1" in out
    record = json.loads((tmp_path / "r.json").read_text())
    assert "build-training-graph" in record["training_graph"]["built_in_memory_by"]
    assert (MLP.read_bytes(), MLP.stat().st_mtime_ns) == before
    assert _listing(tmp_path) == {"r.json"}


def test_report_on_a_training_graph_builds_nothing(mlp_training):
    code, out, err = _run("report", mlp_training, "--min-elements", "0")
    assert code == 0, err
    assert "is a forward model" not in err and "built in memory" not in out
    assert "training graph: loss 'loss'" in out and "Gelu+:1:-1" in out


def test_report_with_no_build_refuses_a_forward_model_and_says_how_to_get_a_training_graph(tmp_path):
    code, _, err = _run("report", MLP, "--no-build", "--json", tmp_path / "r.json")
    assert code == 2 and "not a training graph" in err and "--pipeline build-training-graph" in err
    assert _listing(tmp_path) == set()


# -- 3b. report on recompute's output -------------------------------------------------------


def test_report_on_the_default_pipelines_output_shows_the_recompute_applied(bert_optimized, tmp_path):
    out_model, optimize_report, _ = bert_optimized
    stats = next(p for p in optimize_report["passes"] if p["name"] == "recompute")["stats"]["counts"]
    code, out, err = _run("report", out_model, "--json", tmp_path / "r.json")
    assert code == 0, err
    applied = re.search(r"Recompute applied: (\d+) nodes cloned into backward in (\d+) subgraphs, recomputing ([\d,]+) bytes", out)
    assert applied, out
    again = next(p for p in optimize_report["passes"] if p["name"] == "recompute-again-late")["stats"].get("counts", {})
    # What the report reads back from the clones is what the passes said they did: recompute's
    # clones, and the copies recompute-again-late made of some of them, each group by its pass.
    assert int(applied.group(1)) == stats["nodes cloned"] + again.get("nodes copied", 0)
    assert "Recompute plans left" in out and "Status" not in out and " OFF " not in out
    record = json.loads((tmp_path / "r.json").read_text())["recompute_applied"]
    by_pass = collections.defaultdict(lambda: [0, 0])
    for group in record["groups"]:
        by_pass[group["created_by"]][0] += group["nodes"]
        by_pass[group["created_by"]][1] += group["bytes"]
    assert set(by_pass) <= {"recompute", "recompute-again-late"}
    assert by_pass["recompute"] == [stats["nodes cloned"], stats["expected saving bytes"]] and stats["nodes cloned"] > 0
    assert by_pass["recompute-again-late"][0] == again.get("nodes copied", 0)


def test_report_on_a_graph_without_recompute_says_none_was_applied(mlp_training):
    code, out, err = _run("report", mlp_training, "--min-elements", "0")
    assert code == 0, err
    assert "Recompute applied: none" in out and "Recompute plans, none applied yet" in out
    assert "Status" not in out and " OFF " not in out


def test_the_plot_baseline_says_what_the_graph_already_recomputes(bert_optimized, mlp_training, tmp_path, monkeypatch):
    from ortpass.analysis.recompute import RecomputeReport

    baselines = []
    monkeypatch.setattr(RecomputeReport, "plot", lambda self, path, plans=None, *, baseline: (baselines.append(baseline), path)[1])
    dims = ["--dim", "valid_label_count_0=8", "--dim", "batch=4", "--dim", "seq=32"]
    assert _run("report", bert_optimized[0], "--min-elements", "0", "--plot", tmp_path / "a.png", *dims)[0] == 0
    assert _run("report", mlp_training, "--min-elements", "0", "--plot", tmp_path / "b.png")[0] == 0
    assert baselines[0].startswith("as given: ") and "recomputed already" in baselines[0]
    assert baselines[1] == "no recompute"


# -- 4. post-grad passes on a saved training graph --------------------------------------------


def test_post_grad_passes_run_on_a_saved_training_graph(mlp_training, tmp_path):
    out = tmp_path / "out.onnx"
    code, table, err = _run("optimize", mlp_training, "-o", out, "--pipeline", "fix-dropout-seed,recompute(plans=['Gelu+:1:-1'])")
    assert code == 0, err
    assert "is a training graph (its metadata records the gradient build)" in err and "assume" not in err
    clones = [n for n in ir.load(out).graph if RECOMPUTE_OF_KEY in n.metadata_props]
    assert [n.op_type for n in clones] == ["Gelu"] and "recompute" in table


def test_recompute_alone_on_a_training_graph_names_the_pass_it_needs_not_assume(mlp_training, tmp_path):
    code, _, err = _run("optimize", mlp_training, "-o", tmp_path / "out.onnx", "--pipeline", "recompute(level=1)")
    assert code == 2 and "add 'fix-dropout-seed' to the pipeline" in err and "assume" not in err
    assert _listing(tmp_path) == set()


def test_post_grad_passes_on_a_forward_model_are_still_refused_with_the_way_out(tmp_path):
    code, _, err = _run("optimize", MLP, "-o", tmp_path / "out.onnx", "--pipeline", "fix-dropout-seed,recompute(level=1)")
    assert code == 2 and "is a forward model, not a training graph" in err and "add build-training-graph" in err
    assert "assume" not in err and _listing(tmp_path) == set()


def test_the_default_pipeline_on_a_training_graph_is_refused_before_any_pass_runs(mlp_training, tmp_path):
    before = mlp_training.read_bytes()
    code, out, err = _run("optimize", mlp_training, "-o", tmp_path / "out.onnx")
    assert code == 2 and "is a training graph already" in err and "[1/" not in err and out == ""
    assert mlp_training.read_bytes() == before and _listing(tmp_path) == set()


def test_a_training_graph_is_detected_by_its_record_not_by_its_tags(mlp_training, tmp_path):
    """Tags alone (the record removed) are a damaged graph, refused, not run as either kind."""
    model = ir.load(mlp_training)
    assert any(SIDE_KEY in n.metadata_props for n in model.graph)
    from ortpass.conventions import TRAINING_KEY

    del model.metadata_props[TRAINING_KEY]
    damaged = tmp_path / "damaged.onnx"
    ir.save(model, damaged)
    code, _, err = _run("optimize", damaged, "-o", tmp_path / "out.onnx", "--pipeline", "fix-dropout-seed,recompute(level=1)")
    assert code == 2 and "no training-graph record" in err


# -- 5. tables fit the terminal ---------------------------------------------------------------


def test_optimize_table_fits_the_terminal_and_wide_prints_it_whole(bert_optimized, tmp_path):
    _, _, table = bert_optimized
    assert all(len(line) <= 100 for line in table.splitlines()), max(table.splitlines(), key=len)
    assert "    added: " in table and "    stats: " in table  # what did not fit, under its row
    code, wide, err = _run("optimize", BERT, "-o", tmp_path / "o.onnx", "--wide")
    assert code == 0, err
    rows = [line for line in wide.splitlines() if re.match(r"\s*\d+ ", line)]
    assert len(rows) == len(parse_pipeline(DEFAULT_PIPELINE)) and max(len(line) for line in wide.splitlines()) > 100  # one row per default pass
    assert not any(line.startswith("    added: ") for line in wide.splitlines())


def test_report_fits_the_terminal_and_wide_keeps_each_plan_on_one_line(bert_optimized):
    out_model = bert_optimized[0]
    code, out, err = _run("report", out_model, "--min-elements", "0")
    assert code == 0, err
    assert all(len(line) <= 100 for line in out.splitlines()), max(out.splitlines(), key=len)
    code, wide, _ = _run("report", out_model, "--min-elements", "0", "--wide")
    longest_plan = max(re.findall(r"\S+:1:-1", wide), key=len)
    assert len(longest_plan) > 100 and longest_plan not in out  # wrapped in the fitted one
    assert _wrapped_cell(out, longest_plan[:20]) == longest_plan  # ... with nothing lost


def _wrapped_cell(table: str, start: str) -> str:
    """The cell that begins with ``start``, its wrapped lines joined back together."""
    lines = table.splitlines()
    plans = next(i for i, line in enumerate(lines) if line.startswith("Recompute plans"))
    row = next(i for i, line in enumerate(lines) if start in line and i > plans)
    column = lines[row].index(start)
    parts = [lines[row][column:].split()[0]]
    for line in lines[row + 1 :]:
        if line[:column].strip() or not line.strip():
            break
        parts.append(line[column:].split()[0])
    return "".join(parts)


def test_the_terminal_width_is_followed(monkeypatch, listed_passes):
    monkeypatch.setenv("COLUMNS", "72")
    out = _run("list-passes")[1]
    assert all(len(line) <= 72 for line in out.splitlines())
    assert max(len(line) for line in out.splitlines()) > 60


def test_the_pass_table_moves_what_does_not_fit_under_each_row_and_keeps_the_whole_table_otherwise():
    from ortpass.infra.report import PassRecord, PassReport

    ops = {f"Op{i}": i for i in range(1, 9)}
    report = PassReport([
        PassRecord(1, "a-pass-with-a-long-name", 0.01, 0.001, True, 10, 18, added=ops, stats={"counts": {"rewrites": 8}}),
        PassRecord(2, "failing", 0.02, 0.0, False, 18, 18, error="RuntimeError: " + "it broke " * 20),
    ])  # fmt: skip
    whole = report.to_table()
    assert len(whole.splitlines()) == 2 + 2 + 1 and max(len(line) for line in whole.splitlines()) > 100
    narrow = report.to_table(width=80)
    lines = narrow.splitlines()
    assert all(len(line) <= 80 for line in lines) and lines[-1] == whole.splitlines()[-1]
    assert lines[0].split() == ["#", "pass", "ms", "check", "ms", "changed", "nodes"]
    assert "    added: Op8+8 Op7+7" in narrow and "    stats: rewrites=8" in narrow
    error = [line for line in lines if line.startswith("    error: RuntimeError: it broke")]
    assert error and " ".join(narrow.split()).count("it broke") == 20  # wrapped, none lost
    assert report.to_table(width=1000) == whole  # it fits: the whole table


def test_wrapping_breaks_between_ops_and_never_inside_a_count():
    assert wrap_text("MatMul+Add+Reshape+:1:-1", 13) == ["MatMul+Add+", "Reshape+:1:-1"]
    assert wrap_text("Reshape+27 Identity+20 (+17 types, +45)", 12) == ["Reshape+27", "Identity+20", "(+17 types,", "+45)"]
    long_name = "x" * (MAX_WORD + 5)
    lines = format_table([("a", "b"), ("1", long_name)], width=20)
    # Cut at MAX_WORD, not narrower: a table too narrow for its words runs past the width.
    assert max(len(line) for line in lines) == len("1  ") + MAX_WORD and "".join(lines).count("x") == len(long_name)
    assert format_table([("a", "b"), ("1", long_name)]) == ["a  b", "-  " + "-" * len(long_name), "1  " + long_name]


# -- 6. no torch warning ------------------------------------------------------------------------


def _subprocess(*args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ortpass", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_no_cuda_home_warning_from_torch_unless_verbose(tmp_path):
    """Importing ONNX Runtime's training build imports torch.utils.cpp_extension, which warns
    when CUDA_HOME names a directory and no GPU is there."""
    import torch

    env = dict(os.environ, CUDA_HOME=str(tmp_path), PYTHONPATH=str(REPO))
    args = ["optimize", str(MLP), "-o", str(tmp_path / "o.onnx"), "--pipeline", "build-training-graph"]
    for quiet in ([], ["-qq"]):
        done = _subprocess(*quiet, *args, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr
        assert "No CUDA runtime" not in done.stderr and "cpp_extension" not in done.stderr
    listing = _subprocess("list-passes", cwd=tmp_path, env=env)
    assert listing.returncode == 0 and listing.stderr == ""
    if not torch.cuda.is_available():  # the warning exists, and -v shows it
        shown = _subprocess("-v", *args, cwd=tmp_path, env=env)
        assert "No CUDA runtime is found" in shown.stderr


def test_list_passes_imports_neither_torch_nor_onnxruntime():
    code = (
        "import sys\nfrom ortpass.cli import main\nmain(['list-passes'])\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'onnxruntime'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "[]", done.stderr


# -- 7. golden update rewrites only what changed -------------------------------------------------


@pytest.fixture
def golden_copy(tmp_path) -> Path:
    for suffix in (".py", ".expected.json", ".onnx"):
        shutil.copy2(GOLDEN / f"mlp{suffix}", tmp_path / f"mlp{suffix}")
    return tmp_path


def _state(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir()) if p.is_file()}


def test_golden_update_with_nothing_changed_leaves_every_file_as_it_was(golden_copy):
    before = _state(golden_copy)
    code, out, err = _run("golden", "update", "mlp", "--dir", golden_copy)
    assert code == 0, err
    assert _state(golden_copy) == before
    assert "mlp: unchanged" in out and "0 rewritten (none), 1 unchanged (mlp)" in out


def test_golden_update_rewrites_what_changed_and_keeps_noise_within_tolerance(golden_copy):
    expected_path = golden_copy / "mlp.expected.json"
    recorded = json.loads(expected_path.read_text())
    name, grad = next(iter(recorded["step"]["gradients"].items()))
    grad["l2"] *= 1 + 1e-9  # noise, within rtol
    recorded["ops"]["export"]["Gemm"] += 1  # a real difference
    expected_path.write_text(json.dumps(recorded, indent=2) + "\n")
    onnx_before = _state(golden_copy)["mlp.onnx"]
    code, out, err = _run("golden", "update", "mlp", "--dir", golden_copy)
    assert code == 0, err
    rewritten = json.loads(expected_path.read_text())
    assert rewritten["ops"]["export"]["Gemm"] == recorded["ops"]["export"]["Gemm"] - 1
    assert rewritten["step"]["gradients"][name]["l2"] == grad["l2"]  # the recorded value kept
    assert _state(golden_copy)["mlp.onnx"] == onnx_before  # the export did not change
    assert "mlp: rewrote mlp.expected.json, kept mlp.onnx (1 difference beyond the check's tolerance)" in out
    assert "ops.export.Gemm: expected" in out and "1 rewritten (mlp)" in out


def test_golden_update_rewrites_the_export_when_the_model_changed_but_not_for_the_producer(golden_copy):
    onnx_path = golden_copy / "mlp.onnx"
    proto = onnx.load(str(onnx_path))
    proto.producer_version = "0.0.1-elsewhere"
    onnx.save(proto, str(onnx_path))
    before = _state(golden_copy)
    assert _run("golden", "update", "mlp", "--dir", golden_copy)[0] == 0
    assert _state(golden_copy) == before  # only the producer differs: not a change
    proto.graph.node[0].name = "renamed"
    onnx.save(proto, str(onnx_path))
    code, out, _ = _run("golden", "update", "mlp", "--dir", golden_copy)
    assert code == 0 and "rewrote mlp.onnx" in out
    assert onnx.load(str(onnx_path)).graph.node[0].name != "renamed"
    assert _state(golden_copy)["mlp.expected.json"] == before["mlp.expected.json"]


def _listing(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}
