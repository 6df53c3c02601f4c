"""Sessions take a saved training graph's path as well as the model, and document every argument."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from ortpass.errors import ModelLoadError, OrtpassError
from ortpass.export import export
from ortpass.io import save
from ortpass.runtime import SplitTrainingSession, TrainingSession
from ortpass.testing.models import MLP
from ortpass.training import build_training_graph


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A training graph, the path it is saved at, and a batch."""
    torch.manual_seed(0)
    module = MLP(d_in=8, hidden=16, classes=5)
    batch = {"x": torch.randn(6, 8).numpy(), "labels": np.array([1, 2, 0, 4, 0, 3])}
    training = build_training_graph(export(module, tuple(torch.from_numpy(v) for v in batch.values()), input_names=list(batch)))
    path = tmp_path_factory.mktemp("session") / "training.onnx"
    save(training, path)
    return training, path, batch


@pytest.mark.parametrize("as_type", [str, Path], ids=["str", "PathLike"])
def test_training_session_runs_a_saved_graph_from_its_path(saved, as_type):
    training, path, batch = saved
    expected = TrainingSession(training, threads=1).run(batch)
    got = TrainingSession(as_type(path), threads=1).run(batch)
    assert got.loss == expected.loss
    assert got.gradients.keys() == expected.gradients.keys()
    assert all(np.array_equal(got.gradients[name], expected.gradients[name]) for name in expected.gradients)


def test_split_session_runs_a_saved_graph_from_its_path(saved):
    training, path, batch = saved
    outputs, gradients = SplitTrainingSession(str(path), threads=1).run(batch)
    expected_outputs, expected_gradients = SplitTrainingSession(training, threads=1).run(batch)
    assert np.array_equal(outputs["loss"], expected_outputs["loss"])
    assert all(np.array_equal(gradients[name], expected_gradients[name]) for name in expected_gradients)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="no_such.onnx: no such file"):
        TrainingSession(tmp_path / "no_such.onnx")


def test_a_forward_model_file_is_refused_as_not_a_training_graph(saved, tmp_path):
    training, _, _ = saved
    forward = tmp_path / "forward.onnx"
    proto = onnx.helper.make_model(onnx.helper.make_graph([], "empty", [], []))
    onnx.save(proto, str(forward))
    with pytest.raises(OrtpassError, match="not a training graph"):
        TrainingSession(forward)


def test_other_model_types_are_refused_with_the_way_out(saved):
    training, path, _ = saved
    with pytest.raises(OrtpassError, match=r"not a onnx\.onnx_ml_pb2\.ModelProto.*onnx_ir\.from_proto"):
        TrainingSession(onnx.load(str(path)))
    with pytest.raises(OrtpassError, match="saved model's path"):
        SplitTrainingSession(b"training.onnx")


def _documented(cls) -> set[str]:
    """Names the ``Args:`` section of ``cls``'s docstring describes (``a, b: ...`` lines too)."""
    args = inspect.getdoc(cls).split("Args:", 1)[1]
    names = set()
    for line in args.splitlines():
        match = re.match(r"    ([a-z_]+(?:, [a-z_]+)*):", line)
        if match:
            names.update(match.group(1).split(", "))
    return names


@pytest.mark.parametrize("cls", [TrainingSession, SplitTrainingSession])
def test_every_session_argument_is_documented(cls):
    parameters = set(inspect.signature(cls.__init__).parameters) - {"self"}
    assert {"model", "providers"} <= parameters
    assert parameters - _documented(cls) == set()


def test_the_documentation_check_sees_a_missing_entry():
    class Lost:
        """A class.

        Args:
            model: a model.
        """

        def __init__(self, model, providers=None): ...

    assert {"model", "providers"} - _documented(Lost) == {"providers"}
