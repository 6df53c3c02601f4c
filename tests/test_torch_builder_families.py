"""The torch builder on the Hugging Face families of the real-models suite: the training
graph from torch's autograd (``ORTModule(builder="torch")``, what stock ``onnxruntime``
gets), trained beside torch eager with batch size and sequence length changing every
step, the loss from ``labels`` or computed in torch from the logits, and the default
pipeline's post-grad passes applied (recompute among them; on five families the loss
chunked in narrow vocabulary slices, :data:`CHUNKED`).

CI runs this file twice: in a venv holding only stock ``onnxruntime`` (the ``stock``
marker), every family; and with the training build, three of them (:data:`ON_TRAINING_BUILD`).
The graph is the torch builder's either way; the training build runs it on the same
standard kernels but for the split's ``DropoutGrad``, so three families (causal with a tied
head, causal RMSNorm/rotary, encoder with a biased head) check that runtime, and the
other fourteen would repeat the stock run's work (about 9 of CI's 45 minutes here).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_module_conformance import fewer_on_training_build, train_side_by_side  # noqa: E402
from test_module_families import _batches, _model, loss_from_labels, loss_from_logits  # noqa: E402
from test_real_models import FAMILIES, LAYERS  # noqa: E402

from ortpass.runtime.module import ORTModule  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.stock]

#: The families this file trains when the training build is installed (one: see
#: ``fewer_on_training_build``).
ON_TRAINING_BUILD = ("llama",)


def _families(names, on_training_build=ON_TRAINING_BUILD) -> list:
    return fewer_on_training_build(names, on_training_build)


def _recomputed_nodes(wrapped: ORTModule) -> int:
    """Nodes the recompute pass cloned into the graph the wrapper ran last."""
    return wrapped.transitions.current_graph.report["recompute"].stats["counts"].get("nodes cloned", 0)


#: Families whose run forces chunk-lm-head-loss to narrow slices (the suite's vocabulary of
#: 1000 is one default slice): causal, masked-LM with a biased head, seq2seq heads, BART's
#: ``final_logits_bias`` added to the batch x sequence logits.  The other families run the
#: default pipeline as it is, where the pass finds nothing to chunk.
CHUNKED = ("gpt2", "llama", "bert", "t5", "bart")
#: Families with a SiLU-gated MLP (SwiGLU) of two projections, where recompute-silu-sigmoid
#: fires once a layer (Phi-3's one fused projection has its gradients meet in a Concat).
SWIGLU = ("llama", "mistral", "qwen2")


@pytest.mark.parametrize("name", _families(sorted(FAMILIES)))
def test_shapes_changing_every_step_train_like_torch(name):
    """Every family trains like torch through the default pipeline; those in
    :data:`CHUNKED` with their loss computed in vocabulary slices of 256."""
    from ortpass.passes import DEFAULT_PIPELINE

    pipeline = DEFAULT_PIPELINE.replace("chunk-lm-head-loss,", "chunk-lm-head-loss(chunk=256),") if name in CHUNKED else None
    wrapped = train_side_by_side(_model(name), loss_from_labels, _batches(FAMILIES[name].labels), builder="torch",
                                 pipeline=pipeline)  # fmt: skip
    assert wrapped.graph_builds == 1, wrapped.transitions.transitions  # torch.export's dims: one graph
    assert _recomputed_nodes(wrapped) > 0
    chunked = wrapped.transitions.current_graph.report["chunk-lm-head-loss"].stats["counts"].get("losses chunked", 0)
    assert chunked == (1 if name in CHUNKED else 0)
    finished = wrapped.transitions.current_graph.report["recompute-silu-sigmoid"].stats.get("counts", {})
    assert finished.get("partner gradients finished first", 0) == (LAYERS if name in SWIGLU else 0), finished


@pytest.mark.parametrize("name", _families(["gpt2", "llama", "bert", "bart"]))
def test_loss_computed_in_torch_from_the_logits(name):
    wrapped = train_side_by_side(_model(name), loss_from_logits, _batches(FAMILIES[name].labels), builder="torch")
    assert wrapped.transitions.current_graph.kind == "split"


def _close_to_torch(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = max(expected.abs().max().item(), 1.0)  # relative to the largest logit, absolute below 1
    assert (got - expected).abs().max().item() <= 1e-4 * scale, (got - expected).abs().max().item()


@pytest.mark.parametrize("name", _families(sorted(FAMILIES)))
def test_no_grad_and_eval_calls_compute_like_torch(name):
    """Evaluation as loops make it, each call's graph a forward one in standard ops (no
    PythonOp: stock onnxruntime has none): ``torch.no_grad()`` in training mode with the
    labels, then ``eval()`` with dropout 0.1 (which eval turns off) and the logits only, at
    two sizes."""
    batches = list(_batches(FAMILIES[name].labels))
    model = _model(name)
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, builder="torch")
    ids, labels = batches[0]
    with torch.no_grad():
        got, expected = wrapped(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert got.loss.item() == pytest.approx(expected.loss.item(), rel=1e-4)
    _close_to_torch(got.logits, expected.logits)
    torch.manual_seed(0)
    model = getattr(transformers, FAMILIES[name].model)(FAMILIES[name].config(0.1)).eval()
    reference, evaluated = copy.deepcopy(model), ORTModule(model, builder="torch")
    for ids, labels in batches[1:]:
        inputs = {"input_ids": ids, **({"decoder_input_ids": labels} if FAMILIES[name].labels == "seq2seq" else {})}
        with torch.no_grad():
            _close_to_torch(evaluated(**inputs).logits, reference(**inputs).logits)
    for module in (wrapped, evaluated):
        assert module.graph_builds == 1 and module.transitions.current_graph.kind == "forward"


# The loop's logic, not a family's graph: one family on the training build (47 s saved there).
@pytest.mark.parametrize("name", _families(["gpt2", "llama"]))
def test_evaluation_after_steps_and_an_ema_copy_compute_like_torch(name):
    """The loop of a training script: steps, a no-grad evaluation, and an EMA copy
    (``copy.deepcopy``, frozen, updated from the model) evaluated."""
    batches = list(_batches(FAMILIES[name].labels))
    model = _model(name)
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, builder="torch")
    ema, reference_ema = copy.deepcopy(wrapped).requires_grad_(False), copy.deepcopy(reference).requires_grad_(False)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (wrapped, reference)]  # as train_side_by_side
    for batch in batches[:2]:
        for m, optimizer in zip((wrapped, reference), optimizers):
            loss_from_labels(m, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            for average, source in ((ema, wrapped), (reference_ema, reference)):
                for p, q in zip(average.parameters(), source.parameters()):
                    p.lerp_(q, 0.5)
    ids, labels = batches[2]
    with torch.no_grad():
        got, expected = wrapped(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert got.loss.item() == pytest.approx(expected.loss.item(), rel=1e-4)
    got, expected = ema(input_ids=ids, labels=labels), reference_ema(input_ids=ids, labels=labels)  # frozen: no grad
    assert got.loss.item() == pytest.approx(expected.loss.item(), rel=1e-4)
    _close_to_torch(got.logits, expected.logits)
    assert ema.transitions.current_graph.kind == "forward"
