"""What the command and ``ortpass.io`` write, and only that: atomic replacement, no file
followed through a guessed temporary name, symlinks written through, concurrent writers
leaving one whole file, and nothing left behind by a failure.

The refusals (an output that is an input, a directory, two outputs that are one file)
are rows of the bad-input corpus (tests/test_bad_inputs.py); here are the runs that
succeed and must still leave everything else alone.
"""

from __future__ import annotations

import contextlib
import io as _io
import logging
import multiprocessing
import os
import re
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

from ortpass import io
from ortpass.cli import main

REPO = Path(__file__).resolve().parents[1]
MLP = REPO / "golden_models" / "mlp.onnx"


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = _io.StringIO(), _io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _listing(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


def _state(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


# -- the command ----------------------------------------------------------------------------


def test_an_input_named_like_the_old_temporary_file_survives(tmp_path: Path):
    """The output used to be written to OUT + '.tmp' and renamed: that was the input here."""
    src = tmp_path / "model.onnx.tmp"
    src.write_bytes(MLP.read_bytes())
    before = _state(src)
    code, _, err = _run("optimize", src, "-o", tmp_path / "model.onnx", "--pipeline", "build-training-graph")
    assert code == 0, err
    assert _state(src) == before
    assert _listing(tmp_path) == {"model.onnx.tmp", "model.onnx"}
    assert len(onnx.load(str(tmp_path / "model.onnx")).graph.node) > len(onnx.load(str(MLP)).graph.node)


def test_a_symlink_at_the_old_temporary_name_is_not_followed(tmp_path: Path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "out.onnx.tmp").symlink_to(victim)
    code, _, err = _run("optimize", MLP, "-o", tmp_path / "out.onnx", "--pipeline", "build-training-graph")
    assert code == 0, err
    assert victim.read_text() == "precious\n"
    out = tmp_path / "out.onnx"
    assert out.is_file() and not out.is_symlink()
    assert onnx.load(str(out)).graph.node
    assert _listing(tmp_path) == {"victim.txt", "out.onnx.tmp", "out.onnx"}


def test_in_place_on_a_symlink_writes_the_file_it_points_to(tmp_path: Path):
    real = tmp_path / "real.onnx"
    real.write_bytes(MLP.read_bytes())
    link = tmp_path / "link.onnx"
    link.symlink_to(real)
    code, _, err = _run("optimize", link, "--in-place", "--pipeline", "build-training-graph")
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_bytes() != MLP.read_bytes()
    assert any(n.op_type == "SoftmaxCrossEntropyLossGrad" for n in onnx.load(str(real)).graph.node)
    assert _listing(tmp_path) == {"real.onnx", "link.onnx"}


def test_a_written_file_gets_the_usual_permissions_and_keeps_a_replaced_files(tmp_path: Path):
    umask = os.umask(0o022)
    try:
        fresh = io.write_file(tmp_path / "fresh.txt", "a")
        assert fresh.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0o600
        kept = tmp_path / "kept.txt"
        kept.write_text("old")
        kept.chmod(0o640)
        io.write_file(kept, "new")
        assert kept.read_text() == "new" and kept.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(umask)


def test_a_failed_write_leaves_the_target_as_it_was_and_no_temporary_file(tmp_path: Path):
    target = tmp_path / "t.bin"
    target.write_bytes(b"before")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        io.write_with(target, half_then_fail)
    assert target.read_bytes() == b"before"
    assert _listing(tmp_path) == {"t.bin"}


def test_save_refuses_to_replace_unless_asked(tmp_path: Path):
    model = ir.load(MLP)
    target = tmp_path / "m.onnx"
    target.write_bytes(b"keep")
    with pytest.raises(FileExistsError, match="m.onnx exists; refusing to overwrite it"):
        io.save(model, target)
    assert target.read_bytes() == b"keep" and _listing(tmp_path) == {"m.onnx"}
    io.save(model, target, overwrite=True)
    assert onnx.load(str(target)).graph.node


def _writer(path: str, payload_size: int, count: int, errors) -> None:
    import onnx.helper as oh

    # Each process writes its own model, of a size of its own, ``count`` times.
    graph = oh.make_graph([], f"writer{payload_size}", [], [])
    graph.doc_string = "x" * payload_size
    model = ir.from_proto(oh.make_model(graph))
    try:
        for _ in range(count):
            io.save(model, path, overwrite=True)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        errors.put(f"{type(exc).__name__}: {exc}")


def test_concurrent_writers_leave_one_whole_file(tmp_path: Path):
    """4 processes x 30 saves to one path: no error, and the file is one writer's whole model."""
    target = tmp_path / "same.onnx"
    sizes = [1_000, 50_000, 200_000, 400_000]
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(target), size, 30, errors)) for size in sizes]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs)
    assert errors.empty(), errors.get()
    doc = onnx.load(str(target)).graph.doc_string
    assert doc == "x" * len(doc) and len(doc) in sizes
    assert _listing(tmp_path) == {"same.onnx"}


def _exclusive_writer(path: str, payload_size: int, results) -> None:
    import onnx.helper as oh

    graph = oh.make_graph([], f"writer{payload_size}", [], [])
    graph.doc_string = "x" * payload_size
    try:
        io.save(ir.from_proto(oh.make_model(graph)), path)
        results.put(("saved", payload_size))
    except FileExistsError as exc:
        results.put(("refused", str(exc)))


def test_writers_that_must_not_replace_leave_the_first_file_whole(tmp_path: Path):
    """4 processes save to one new path without overwrite: one succeeds, the others are told."""
    target = tmp_path / "new.onnx"
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_exclusive_writer, args=(str(target), size, results)) for size in (10, 2_000, 90_000, 300_000)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    outcomes = [results.get(timeout=10) for _ in procs]
    saved = [size for verdict, size in outcomes if verdict == "saved"]
    assert len(saved) == 1, outcomes
    assert all(re.search(r"new\.onnx exists; refusing to overwrite it", text) for verdict, text in outcomes if verdict == "refused")
    assert onnx.load(str(target)).graph.doc_string == "x" * saved[0]
    assert _listing(tmp_path) == {"new.onnx"}


# -- report --dim on the golden BERT after optimize (issue #21) -----------------------------


@pytest.fixture(scope="module")
def bert_training(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bert") / "bert_mlm.train.onnx"
    code, _, err = _run("optimize", REPO / "golden_models" / "bert_mlm.onnx", "-o", out)
    assert code == 0, err
    return out


def test_report_plot_names_a_missing_dim_and_takes_it_from_dim(bert_training: Path, tmp_path: Path):
    png = tmp_path / "timeline.png"
    before = _state(bert_training)
    code, _, err = _run("report", bert_training, "--plot", png)
    assert code == 2 and "Traceback" not in err
    found = re.search(r"--plot needs the size of dim\(s\) (\S+); give each with --dim, e.g. --dim (\S+)=N", err)
    assert found, err
    missing = found.group(1).split(",")
    assert not png.exists()

    dims = [a for name in missing for a in ("--dim", f"{name}=20")]
    code, out, err = _run("report", bert_training, "--plot", png, "--min-elements", "0", *dims)
    model = ir.load(bert_training)
    stashed_without_shape = _stashed_without_shape(model)
    if stashed_without_shape:
        # The graph itself does not say how big a stashed value is: named, exit 2, no file.
        assert code == 2 and re.search(r"the shape of \d+ stashed value\(s\) is unknown \(e\.g\. '.+'\)", err), err
        assert not png.exists()
    else:
        assert code == 0, err
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert all(f"{name}=20" in out for name in missing)
    assert _state(bert_training) == before


def _stashed_without_shape(model: ir.Model) -> list[str]:
    from ortpass.analysis.partition import get_partition

    return [v.name for v in get_partition(model).stashed if v.shape is None]


def test_dim_overrides_the_exported_dims(bert_training: Path, tmp_path: Path):
    report = tmp_path / "r.json"
    code, _, err = _run("report", bert_training, "--json", report, "--dim", "batch=3")
    assert code == 0, err
    import json

    dims = json.loads(report.read_text())["recompute"]["dims"]
    assert dims["batch"] == 3 and dims["seq"] == 32  # seq as recorded at export


# -- messages: bounded, and repeated warnings counted -----------------------------------------


def test_duplicate_plans_warn_once_with_a_count(tmp_path: Path):
    plans = ",".join(["Tile+:1:-1"] * 2000)
    spec = f"build-training-graph,fix-dropout-seed,recompute(plans='{plans}')"
    code, _, err = _run("optimize", MLP, "-o", tmp_path / "o.onnx", "--pipeline", spec)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "matches no candidate" in line]
    assert lines == [
        "ortpass: recompute plan Tile+:1:-1 matches no candidate in this graph",
        "ortpass: recompute plan Tile+:1:-1 matches no candidate in this graph (repeated 1999 more times)",
    ]


def test_the_command_leaves_the_callers_logging_as_it_was():
    logger = logging.getLogger("onnx_ir")
    level = logger.level
    _run("list-passes")
    assert logging.getLogger("onnx_ir").level == level
    assert not logging.getLogger("ortpass").handlers


# -- golden: which folder's code runs ---------------------------------------------------------


def test_golden_without_dir_runs_only_the_current_directorys_cases_and_names_it(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _run("golden", "check")
    assert code == 2 and "golden model directory" in err and "give one with --dir" in err
    cases = tmp_path / "golden_models"
    cases.mkdir()
    (cases / "ran.py").write_text("import pathlib\npathlib.Path('marker').write_text('ran')\n")
    code, _, err = _run("golden", "check")
    assert code == 2 and "defines no case() function" in err
    assert f"importing and running the case files of {cases}" in err
    assert (tmp_path / "marker").read_text() == "ran"  # that folder's code, and it ran


@pytest.fixture(scope="module")
def mlp_training(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mlp") / "mlp.train.onnx"
    code, _, err = _run("optimize", MLP, "-o", out, "--pipeline", "build-training-graph")
    assert code == 0, err
    return out


@pytest.mark.parametrize(("name", "magic"), [("pd", b"\x89PNG"), ("timeline.svg", b"<?xml")])
def test_plot_writes_exactly_the_path_given_in_the_format_of_its_suffix(mlp_training: Path, tmp_path: Path, name, magic):
    """Without a suffix matplotlib would have added '.png' and written another file."""
    code, _, err = _run("report", mlp_training, "--min-elements", "0", "--plot", tmp_path / name)
    assert code == 0, err
    assert (tmp_path / name).read_bytes().startswith(magic)
    assert _listing(tmp_path) == {name}
