"""One ONNX Runtime installed, and the training build where ORT's gradient builder is
needed (ortpass.training.backend): refused with the way out, never an AttributeError from
deep inside the build.  The tests marked ``stock`` run on stock onnxruntime too (CI runs
them in a second venv); they fake the installed distributions and the training ops."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from ortpass import io
from ortpass.cli import main
from ortpass.errors import OrtpassError
from ortpass.training import backend, build_training_graph

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "golden_models" / "mlp.onnx"  # a forward model with its loss


def fake_installed(monkeypatch, **versions: str) -> None:
    """Make importlib.metadata report exactly these distributions (``onnxruntime_training_cpu=
    "1.19.2"``; underscores for dashes) as installed, and nothing else of ONNX Runtime."""
    installed = {name.replace("_", "-"): version for name, version in versions.items()}
    real = metadata.version

    def version(name: str) -> str:
        if name in installed:
            return installed[name]
        if name in backend.RUNTIME_DISTRIBUTIONS:
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)


@pytest.fixture
def stock(monkeypatch):
    """Stock onnxruntime 1.31.1, alone: no training ops."""
    fake_installed(monkeypatch, onnxruntime="1.31.1")
    monkeypatch.setattr(backend, "has_training_ops", lambda: False)


@pytest.mark.stock
def test_two_runtimes_are_refused_naming_both_and_the_fix(monkeypatch):
    fake_installed(monkeypatch, onnxruntime="1.31.1", onnxruntime_training_cpu="1.19.2")
    assert backend.installed_runtimes() == {"onnxruntime": "1.31.1", "onnxruntime-training-cpu": "1.19.2"}
    with pytest.raises(OrtpassError) as caught:
        backend.check_single_runtime()
    message = str(caught.value)
    assert "onnxruntime 1.31.1 and onnxruntime-training-cpu 1.19.2 are installed together" in message
    assert "pip uninstall -y onnxruntime onnxruntime-training-cpu" in message
    assert '"ortpass[training-cpu]"' in message and '"ortpass[cpu]"' in message


@pytest.mark.stock
@pytest.mark.parametrize("versions", [{"onnxruntime": "1.31.1"}, {"onnxruntime_training_cpu": "1.19.2"}, {}])
def test_one_runtime_or_none_passes_the_check(monkeypatch, versions):
    fake_installed(monkeypatch, **versions)
    backend.check_single_runtime()
    assert len(backend.installed_runtimes()) == len(versions)


@pytest.mark.stock
def test_has_training_ops_says_which_build_imports():
    training = any("training" in name for name in backend.installed_runtimes())
    assert backend.has_training_ops() == training


@pytest.mark.stock
def test_the_training_build_is_required_with_the_way_out(stock):
    with pytest.raises(OrtpassError) as caught:
        backend.require_training_build("the thing")
    assert str(caught.value) == (
        "the thing needs ONNX Runtime's training build (onnxruntime-training-cpu 1.19.2, CPython <= 3.12), but "
        "the installed onnxruntime 1.31.1 is the stock package; on stock onnxruntime build the training graph "
        "from torch: ortpass.training.build_training_graph_from_torch(...) or ORTModule(model) (which picks that "
        "builder itself)"
    )


@pytest.mark.stock
@pytest.mark.parametrize(
    ("versions", "says"),
    [
        ({"onnxruntime_gpu": "1.31.1"}, "the installed onnxruntime 1.31.1 (onnxruntime-gpu) is the stock package"),
        ({}, "no onnxruntime is installed: install one runtime extra"),
        ({"onnxruntime_training_cpu": "1.19.2"}, "onnxruntime-training-cpu 1.19.2 has no GradientGraphBuilder"),
        ({"onnxruntime": "1.31.1", "onnxruntime_training_cpu": "1.19.2"}, "are installed together"),
    ],
)
def test_the_refusal_says_what_is_installed(monkeypatch, versions, says):
    fake_installed(monkeypatch, **versions)
    monkeypatch.setattr(backend, "has_training_ops", lambda: False)
    with pytest.raises(OrtpassError) as caught:
        backend.require_training_build("the thing")
    assert says in str(caught.value)


@pytest.mark.stock
def test_the_training_build_passes(monkeypatch):
    fake_installed(monkeypatch, onnxruntime_training_cpu="1.19.2")
    monkeypatch.setattr(backend, "has_training_ops", lambda: True)
    backend.require_training_build("the thing")


@pytest.mark.stock
@pytest.mark.parametrize("ort_fusions", [True, False])
def test_the_gradient_build_refuses_stock_onnxruntime(stock, ort_fusions):
    with pytest.raises(OrtpassError, match=r"^ortpass.training.build_training_graph \(ORT's .* is the stock package"):
        build_training_graph(io.load(MLP), ort_fusions=ort_fusions)


@pytest.mark.stock
@pytest.mark.parametrize("command", [["optimize", str(MLP), "-o", "OUT"], ["report", str(MLP)]])
def test_the_command_refuses_a_forward_model_on_stock_onnxruntime(stock, command, tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert main([str(out) if arg == "OUT" else arg for arg in command]) == 2
    err = capsys.readouterr().err
    assert f"OrtpassError: ortpass {command[0]} on a forward model" in err
    assert "is the stock package; on stock onnxruntime build the training graph from torch" in err
    assert "Traceback" not in err and "[1/" not in err  # refused before any pass ran
    assert not out.exists()


@pytest.mark.stock
def test_the_command_refuses_two_runtimes(monkeypatch, capsys):
    fake_installed(monkeypatch, onnxruntime="1.31.1", onnxruntime_training_cpu="1.19.2")
    assert main(["list-passes"]) == 2
    assert "are installed together" in capsys.readouterr().err


@pytest.mark.stock
def test_version_names_the_runtime(monkeypatch, capsys):
    fake_installed(monkeypatch, onnxruntime="1.31.1")
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip().endswith("(onnxruntime 1.31.1)")


def test_post_grad_passes_on_a_saved_training_graph_need_no_training_build(tmp_path, monkeypatch):
    train = tmp_path / "train.onnx"
    assert main(["-q", "optimize", str(MLP), "-o", str(train), "--pipeline", "build-training-graph"]) == 0
    monkeypatch.setattr(backend, "has_training_ops", lambda: False)
    out = tmp_path / "out.onnx"
    pipeline = "accumulate-gradients-early,fix-dropout-seed(level=1),recompute(level=1),order-backward-joins"
    assert main(["-q", "optimize", str(train), "-o", str(out), "--pipeline", pipeline]) == 0
    assert out.exists()
