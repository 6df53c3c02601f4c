"""The torch builder on the Hugging Face families of the real-models suite: the training
graph from torch's autograd (``ORTModule(builder="torch")``, what stock ``onnxruntime``
gets), trained beside torch eager with batch size and sequence length changing every
step, the loss from ``labels`` or computed in torch from the logits, and the default
pipeline's post-grad passes applied (recompute among them).

CI runs this file twice: in a venv holding only stock ``onnxruntime`` (the ``stock``
marker), every family; and with the training build, three of them (:data:`ON_TRAINING_BUILD`).
The graph is the torch builder's either way; the training build runs it on the same
standard kernels but for the split's ``DropoutGrad``, so three families (causal with a tied
head, causal RMSNorm/rotary, encoder with a biased head) check that runtime, and the
other fourteen would repeat the stock run's work (about 9 of CI's 45 minutes here).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_module_conformance import train_side_by_side  # noqa: E402
from test_module_families import _batches, _model, loss_from_labels, loss_from_logits  # noqa: E402
from test_real_models import FAMILIES  # noqa: E402

from ortpass.runtime.module import ORTModule  # noqa: E402
from ortpass.training.backend import has_training_ops  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.stock]

#: The families this file trains when the training build is installed.
ON_TRAINING_BUILD = ("gpt2", "llama", "bert")


def _families(names) -> list:
    """``names``, those outside :data:`ON_TRAINING_BUILD` skipped on the training build."""
    if not has_training_ops():
        return list(names)
    skip = pytest.mark.skip(reason="the training build trains three families; CI's stock venv trains them all")
    return [name if name in ON_TRAINING_BUILD else pytest.param(name, marks=skip) for name in names]


def _recomputed_nodes(wrapped: ORTModule) -> int:
    """Nodes the recompute pass cloned into the graph the wrapper ran last."""
    return wrapped.transitions.current_graph.report["recompute"].stats["counts"].get("nodes cloned", 0)


@pytest.mark.parametrize("name", _families(sorted(FAMILIES)))
def test_shapes_changing_every_step_train_like_torch(name):
    wrapped = train_side_by_side(_model(name), loss_from_labels, _batches(FAMILIES[name].labels), builder="torch")
    assert wrapped.graph_builds == 1, wrapped.transitions.transitions  # torch.export's dims: one graph
    assert _recomputed_nodes(wrapped) > 0


@pytest.mark.parametrize("name", _families(["gpt2", "llama", "bert", "bart"]))
def test_loss_computed_in_torch_from_the_logits(name):
    wrapped = train_side_by_side(_model(name), loss_from_logits, _batches(FAMILIES[name].labels), builder="torch")
    assert wrapped.transitions.current_graph.kind == "split"


@pytest.mark.parametrize("name", _families(["gpt2", "llama", "bert", "t5", "bart"]))
def test_the_loss_chunked_in_vocabulary_slices_trains_like_torch(name):
    """chunk-lm-head-loss recognizes the torch builder's LogSoftmax chain: forced to
    narrow slices on the suite's vocabulary of 1000, every family here trains like torch
    (causal, masked-LM with a biased head, seq2seq heads, BART's ``final_logits_bias``
    added to the batch x sequence logits; the logits returned)."""
    from ortpass.passes import DEFAULT_PIPELINE

    pipeline = DEFAULT_PIPELINE.replace("chunk-lm-head-loss,", "chunk-lm-head-loss(chunk=256),")
    wrapped = train_side_by_side(_model(name), loss_from_labels, _batches(FAMILIES[name].labels), builder="torch", pipeline=pipeline)
    stats = wrapped.transitions.current_graph.report["chunk-lm-head-loss"].stats
    assert stats["counts"].get("losses chunked") == 1, stats
