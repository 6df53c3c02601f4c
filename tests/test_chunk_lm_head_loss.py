"""ChunkLmHeadLossPass: the LM head and its cross-entropy one vocabulary slice at a time.

Both directions (fires / does not fire, with the reason), parity with torch eager on ORT
(loss and every gradient), no value as wide as the full logits left in the graph, ORT's
real execution order finishing each slice before the next, and bad labels refused as
``SoftmaxCrossEntropyLoss`` refuses them.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir
import pytest
import torch

import ortpass
from ortpass.analysis.partition import get_training_info, is_backward
from ortpass.errors import IndexRangeError
from ortpass.export import export
from ortpass.passes import DEFAULT_PIPELINE, ChunkLmHeadLossPass
from ortpass.runtime import TrainingSession
from ortpass.runtime.parity import check_parity
from ortpass.testing.profiling import ort_execution_order
from ortpass.training import build_training_graph

VOCAB, HIDDEN, BATCH, SEQ, CHUNK = 50, 16, 2, 8, 16  # 4 slices, the last 2 wide
IGNORE = -100


class TinyLM(torch.nn.Module):
    """Embedding, one layer, a head and cross-entropy.  ``head``: "tied" (the embedding's
    weight, GPT-2), "linear" (its own ``nn.Linear``, LLaMA), "biased" (an ``nn.Linear``
    with a bias, BERT's masked-LM decoder), "hidden_by_vocab" (a ``hidden x vocab``
    parameter used as is)."""

    def __init__(self, head: str = "tied", reduction: str = "mean", label_smoothing: float = 0.0, logits_out: bool = False):
        super().__init__()
        self.head_kind, self.reduction, self.label_smoothing, self.logits_out = head, reduction, label_smoothing, logits_out
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.linear = torch.nn.Linear(HIDDEN, VOCAB, bias=head == "biased") if head in ("linear", "biased") else None
        self.by_vocab = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB) * 0.2) if head == "hidden_by_vocab" else None

    def forward(self, ids, labels):
        h = self.norm(torch.tanh(self.fc(self.emb(ids))))
        if self.head_kind == "tied":
            logits = h @ self.emb.weight.T
        elif self.head_kind in ("linear", "biased"):
            logits = self.linear(h)
        else:
            logits = h @ self.by_vocab
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE, reduction=self.reduction,
            label_smoothing=self.label_smoothing,
        )  # fmt: skip
        return (loss, logits) if self.logits_out else loss


def _args(padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    if padded:
        labels[:, -3:] = IGNORE
    return ids, labels


def _training(module: torch.nn.Module, args=None) -> ir.Model:
    torch.manual_seed(0)
    args = args or _args()
    return build_training_graph(export(module, args, input_names=["ids", "labels"]))


def _chunked(module: torch.nn.Module, chunk: int | None = CHUNK) -> tuple[ir.Model, ChunkLmHeadLossPass]:
    pass_ = ChunkLmHeadLossPass(chunk=chunk)
    return pass_(_training(module)).model, pass_


def _widest_float_value(model: ir.Model) -> int:
    """The largest last dim among float values with a row dim (rank >= 2) in the graph."""
    widths = [
        v.shape[-1] for n in model.graph for v in n.outputs
        if v.dtype == ir.DataType.FLOAT and v.shape is not None and v.shape.rank() >= 2 and isinstance(v.shape[-1], int)
        and not (isinstance(v.shape[0], int) and v.shape[0] in (1, HIDDEN, VOCAB))  # weights, biases and their gradients
    ]  # fmt: skip
    return max(widths)


@pytest.mark.parametrize("head", ["tied", "linear", "hidden_by_vocab"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_step_matches_torch_and_holds_no_full_logits(head, reduction):
    torch.manual_seed(0)
    module = TinyLM(head, reduction)
    model, pass_ = _chunked(module)
    assert pass_.stats["counts"]["losses chunked"] == 1
    assert pass_.stats["notes"]["chunked"][0]["slices"] == 4
    ops = {n.op_type for n in model.graph}
    assert not ops & {"SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad"}
    assert _widest_float_value(model) == CHUNK  # never rows x vocab
    check_parity(module, _args(), model, input_names=["ids", "labels"]).assert_ok()


def test_logits_past_floats_exp_range_give_torchs_loss_and_gradients():
    """Each slice's logsumexp subtracts the slice's maximum before ``Exp``: logits in the
    hundreds (exp(89) overflows float32) still give torch's finite loss and gradients."""
    torch.manual_seed(0)
    module = TinyLM("linear")
    with torch.no_grad():
        module.linear.weight.mul_(300.0)
        logits = module.linear(module.norm(torch.tanh(module.fc(module.emb(_args()[0])))))
    assert logits.abs().max() > 200  # the test's premise: exp of the raw logits is inf in float32
    model, pass_ = _chunked(module)
    assert pass_.stats["counts"]["losses chunked"] == 1
    check_parity(module, _args(), model, input_names=["ids", "labels"]).assert_ok()


def test_the_gradient_outputs_keep_their_names():
    module = TinyLM("linear")
    before = get_training_info(_training(module))
    model, _ = _chunked(module)
    assert get_training_info(model) == before
    assert {v.name for v in model.graph.outputs} >= set(before.gradients.values())


def test_the_default_pipeline_with_chunking_matches_torch_and_the_unchunked_step():
    torch.manual_seed(0)
    module = TinyLM("tied")
    forward = export(module, _args(), input_names=["ids", "labels"])
    pipeline = DEFAULT_PIPELINE.replace("build-training-graph,", f"build-training-graph,chunk-lm-head-loss(chunk={CHUNK}),")
    result = ortpass.pipeline(pipeline)(forward)
    assert result.report["chunk-lm-head-loss"].stats["counts"]["losses chunked"] == 1
    chunked, plain = result.model, ortpass.pipeline(DEFAULT_PIPELINE)(forward).model
    check_parity(module, _args(), chunked, input_names=["ids", "labels"]).assert_ok()
    batch = dict(zip(["ids", "labels"], (a.numpy() for a in _args())))
    a, b = TrainingSession(plain).run(batch), TrainingSession(chunked).run(batch)
    np.testing.assert_allclose(a.loss, b.loss, rtol=1e-6)
    for name, gradient in a.gradients.items():  # float32 sums in another order: 1e-6 of the largest entry
        np.testing.assert_allclose(b.gradients[name], gradient, rtol=1e-5, atol=1e-6 * np.abs(gradient).max(), err_msg=name)


def test_ort_finishes_each_slice_before_starting_the_next(tmp_path):
    model, _ = _chunked(TinyLM("tied"))
    batch = dict(zip(["ids", "labels"], (a.numpy() for a in _args())))
    order = ort_execution_order(model, batch, tmp_path)
    prefix = next(n.name for n in model.graph if n.name.endswith("/logits_again0")).removesuffix("logits_again0")
    at = {name: i for i, name in enumerate(order)}
    for i in range(3):
        # slice i's tensors are all read before slice i + 1's logits exist
        done = max(at[f"{prefix}{what}{i}"] for what in ("weight_grad", "hidden_grad_part", "logits_grad"))
        assert done < at[f"{prefix}logits_again{i + 1}"], i
    forward = sorted(range(4), key=lambda i: at[f"{prefix}logits{i}"])
    for first, then in itertools.pairwise(forward):  # forward too: one slice's logits at a time
        assert at[f"{prefix}logsumexp{first}"] < at[f"{prefix}logits{then}"], (first, then)


def test_default_chunk_leaves_a_small_vocabulary_alone():
    model, pass_ = _chunked(TinyLM("tied"), chunk=None)
    assert "losses chunked" not in pass_.stats.get("counts", {})
    (skip,) = pass_.stats["notes"]["skipped"]
    assert "fits one chunk" in skip["reason"]
    assert any(n.op_type == "SoftmaxCrossEntropyLoss" for n in model.graph)


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (TinyLM("tied", reduction="none"), "reduction"),
    ],
    ids=["reduction-none"],
)
def test_does_not_fire_and_says_why(module, reason):
    if module.reduction == "none":
        module.forward = _summed(module.forward)
    _, pass_ = _chunked(module)
    assert not pass_.stats.get("counts", {}).get("losses chunked")
    assert any(reason in s["reason"] for s in pass_.stats["notes"]["skipped"]), pass_.stats


def _summed(forward):
    def call(ids, labels):
        return forward(ids, labels).sum()

    return call


@pytest.mark.parametrize("head", ["tied", "linear"])
def test_returned_logits_are_sliced_not_computed_again(head):
    """A module that returns its logits (Hugging Face's do) computes them whole anyway: the
    chunked loss slices them, and only the returned logits are vocabulary-wide."""
    torch.manual_seed(0)
    module = TinyLM(head, logits_out=True)
    plain = _training(module)
    model, pass_ = _chunked(module)
    assert pass_.stats["counts"]["losses chunked"] == 1
    logits_output = next(v for v in model.graph.outputs if v.shape is not None and v.shape.rank() == 3)
    wide = [
        v for n in model.graph for v in n.outputs
        if v.dtype == ir.DataType.FLOAT and v.shape is not None and v.shape.rank() >= 2 and v.shape[-1] == VOCAB
        and v.shape[0] != HIDDEN  # not the weight's gradient
    ]  # fmt: skip
    assert {v.producer().op_type for v in wide} <= {"MatMul", "Gemm", "Reshape"}  # the head's own output, and its rows
    assert logits_output in wide
    assert sum(v.producer().op_type in ("MatMul", "Gemm") for v in wide) == 1  # no second head
    batch = dict(zip(["ids", "labels"], (a.numpy() for a in _args())))
    a, b = TrainingSession(plain).run(batch), TrainingSession(model).run(batch)
    np.testing.assert_allclose(b.loss, a.loss, rtol=1e-6)
    for name, gradient in a.gradients.items():  # float32 sums in another order: 1e-6 of the largest entry
        np.testing.assert_allclose(b.gradients[name], gradient, rtol=1e-5, atol=1e-6 * np.abs(gradient).max(), err_msg=name)
    with torch.no_grad():
        loss, _ = module(*_args())
    np.testing.assert_allclose(b.loss, loss.numpy(), rtol=1e-5)


def _vocab_wide_products(model: ir.Model) -> list[ir.Node]:
    """Forward MatMul/Gemm nodes whose output is as wide as the vocabulary: the heads."""
    return [
        n for n in model.graph
        if n.op_type in ("MatMul", "Gemm", "FusedMatMul") and not is_backward(n) and n.outputs[0].shape is not None
        and n.outputs[0].shape[-1] == VOCAB
    ]  # fmt: skip


@pytest.mark.parametrize("head", ["tied", "linear", "hidden_by_vocab"])
def test_logits_last_computes_the_returned_logits_after_backward(head, tmp_path):
    """With ``logits_last`` the loss is chunked from the hidden rows and the returned logits
    come from a head of their own that ORT runs after every backward node, so the full
    logits are alive only at the step's end.  Loss, gradients and logits are the unchunked
    graph's and torch's."""
    torch.manual_seed(0)
    module = TinyLM(head, logits_out=True)
    plain = _training(module)
    pass_ = ChunkLmHeadLossPass(chunk=CHUNK, logits_last=True)
    model = pass_(_training(module)).model
    assert pass_.stats["counts"]["losses chunked"] == 1
    assert pass_.stats["notes"]["chunked"][0]["returned_logits"] == "computed after backward"
    (late,) = _vocab_wide_products(model)  # the original head is gone: the loss does not read it
    assert late.name.endswith("/logits_again")
    assert late.outputs[0].is_graph_output()  # no view after it: ORT would copy a view it returns
    batch = dict(zip(["ids", "labels"], (a.numpy() for a in _args())))
    order = ort_execution_order(model, batch, tmp_path)
    at = {name: i for i, name in enumerate(order)}
    ran_backward = [at[n.name] for n in model.graph if is_backward(n) and n.name in at]
    assert len(ran_backward) > 20 and at[late.name] > max(ran_backward)
    logits_name = next(v.name for v in model.graph.outputs if v.shape is not None and v.shape.rank() == 3)
    a = TrainingSession(plain, extra_outputs=[logits_name]).run(batch)
    b = TrainingSession(model, extra_outputs=[logits_name]).run(batch)
    np.testing.assert_allclose(b.loss, a.loss, rtol=1e-6)
    np.testing.assert_array_equal(b.extras[logits_name], a.extras[logits_name])
    for name, gradient in a.gradients.items():  # float32 sums in another order: 1e-6 of the largest entry
        np.testing.assert_allclose(b.gradients[name], gradient, rtol=1e-5, atol=1e-6 * np.abs(gradient).max(), err_msg=name)
    with torch.no_grad():
        loss, logits = module(*_args())
    np.testing.assert_allclose(b.loss, loss.numpy(), rtol=1e-5)
    np.testing.assert_allclose(b.extras[logits_name], logits.numpy(), rtol=1e-5, atol=1e-6)


class ArgmaxLM(TinyLM):
    """Returns the loss and each position's most likely token: a forward node reads the logits."""

    def forward(self, ids, labels):
        loss, logits = TinyLM.forward(self, ids, labels)
        return loss, logits.argmax(-1)


@pytest.mark.parametrize("module", [ArgmaxLM("linear", logits_out=True), TinyLM("biased", logits_out=True)], ids=["argmax", "biased"])
def test_logits_last_slices_logits_a_forward_node_reads_or_a_bias_completes(module):
    """Logits read in forward (an argmax) are computed before the loss anyway; batch x
    sequence logits with a bias would take an ``Add`` after the product, whose output ORT
    allocates beside it: ``logits_last`` leaves them where they are, and the chunked loss
    slices them."""
    torch.manual_seed(0)
    pass_ = ChunkLmHeadLossPass(chunk=CHUNK, logits_last=True)
    model = pass_(_training(module)).model
    assert pass_.stats["counts"]["losses chunked"] == 1
    assert pass_.stats["notes"]["chunked"][0]["returned_logits"] == "sliced"
    (head,) = _vocab_wide_products(model)
    assert not head.name.endswith("/logits_again")


def _sparse_args(seed: int = 1, batch: int = BATCH, seq: int = SEQ, valid: float = 0.4) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels mostly ``ignore_index`` (padding, or a masked LM's unmasked tokens): the export
    then routes them through the density flag, and the valid rows are gathered before the loss."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    labels[torch.rand(batch, seq, generator=generator) >= valid] = IGNORE
    return ids, labels


@pytest.mark.parametrize("logits_out", [False, True], ids=["loss-only", "logits-returned"])
@pytest.mark.parametrize("head", ["tied", "linear", "biased", "hidden_by_vocab"])
def test_valid_rows_gathered_before_the_loss_are_chunked_and_match_torch(head, logits_out):
    """With most labels ignored the loss reads the valid rows through a ShrunkenGather below
    the head's Reshape and bias: the chunked loss gathers those rows itself (of the hidden
    states, or of each slice of the returned logits), holds no rows x vocabulary value,
    and scatters the rows' gradient back.  Loss and gradients are torch's, at the export's
    batch and at another batch with another number of valid rows."""
    torch.manual_seed(0)
    module = TinyLM(head, logits_out=logits_out)
    names = ["ids", "labels"]
    dynamic = {name: {0: "batch", 1: "seq"} for name in names}
    forward = export(module, _sparse_args(), input_names=names, dynamic_axes=dynamic)
    pipeline = "insert-gather-before-sce-loss,build-training-graph"
    plain = ortpass.pipeline(pipeline)(forward).model
    assert any(n.op_type == "ShrunkenGather" and n.outputs[0].shape[-1] == VOCAB for n in plain.graph), "no gather below the head"
    result = ortpass.pipeline(f"{pipeline},chunk-lm-head-loss(chunk={CHUNK})")(forward)
    model, stats = result.model, result.report["chunk-lm-head-loss"].stats
    assert stats["counts"]["losses chunked"] == 1, stats
    wide = [
        v for n in model.graph for v in n.outputs
        if v.dtype == ir.DataType.FLOAT and v.shape is not None and v.shape.rank() >= 2 and v.shape[-1] == VOCAB
        and v.shape[0] not in (HIDDEN, 1)  # the weight's and the bias's gradients
    ]  # fmt: skip
    assert {v.producer().op_type for v in wide} <= ({"MatMul", "Gemm", "Add", "Reshape"} if logits_out else set())
    for args in (_sparse_args(), _sparse_args(seed=5, batch=3, seq=6, valid=0.2)):
        check_parity(module, args, model, input_names=names).assert_ok()
        batch = dict(zip(names, (a.numpy() for a in args)))
        a, b = TrainingSession(plain).run(batch), TrainingSession(model).run(batch)
        np.testing.assert_allclose(b.loss, a.loss, rtol=1e-6)
        for name, gradient in a.gradients.items():
            np.testing.assert_allclose(b.gradients[name], gradient, rtol=1e-5, atol=1e-6 * np.abs(gradient).max(), err_msg=name)


def test_label_smoothing_is_refused_at_export():
    """torch.onnx's exporter refuses a smoothed cross-entropy, so it never reaches the pass."""
    with pytest.raises(ortpass.errors.ExportError, match="label_smoothing"):
        _training(TinyLM("tied", label_smoothing=0.1))


class ZLossLM(TinyLM):
    """Cross-entropy plus a z-loss on the logits' logsumexp (PaLM's auxiliary loss), written
    out: ORT 1.19.2's gradient of ReduceLogSumExp writes an invalid Unsqueeze at opset 13+."""

    def forward(self, ids, labels):
        loss, logits = TinyLM.forward(self, ids, labels)
        return loss + 1e-2 * torch.log(torch.exp(logits).sum(dim=-1)).pow(2).mean()


def test_a_z_loss_leaves_the_loss_unchunked():
    """The cross-entropy is then one term of the training loss, and the logits are read by
    the other: the pass leaves both alone."""
    torch.manual_seed(0)
    module = ZLossLM("tied", logits_out=True)
    model, pass_ = _chunked(module)
    assert not pass_.stats.get("counts", {}).get("losses chunked")
    assert [s["reason"] for s in pass_.stats["notes"]["skipped"]] == ["not the training graph's loss"]
    check_parity(module, _args(), model, input_names=["ids", "labels"]).assert_ok()


@pytest.mark.parametrize("bad", [VOCAB + 3, -5])
def test_a_label_outside_the_vocabulary_fails_as_in_torch(bad):
    """torch refuses such a label; ORT 1.19.2's SoftmaxCrossEntropyLoss returns a loss
    without a word (measured: 8.92 for label 53 of 50).  The chunked loss refuses it in the
    Gather of the label's weight row, as an IndexRangeError (an IndexError) with ORT's
    message and the index in it."""
    module = TinyLM("tied")
    model, _ = _chunked(module)
    ids, labels = _args()
    labels[0, 0] = bad
    with pytest.raises(IndexError, match="out of bounds"):
        module(ids, labels)
    with pytest.raises(IndexRangeError, match=rf"a label outside \[0, {VOCAB}\) that is not ignore_index {IGNORE}(.|\n)*idx={VOCAB if bad < 0 else bad} must be within"):
        TrainingSession(model).run({"ids": ids.numpy(), "labels": labels.numpy()})


def test_all_labels_ignored_gives_torchs_nan_loss_and_zero_gradients():
    """torch's mean over no label is NaN; ORT's SoftmaxCrossEntropyLoss gives 0."""
    module = TinyLM("tied")
    model, _ = _chunked(module)
    ids, labels = _args()
    labels[:] = IGNORE
    assert torch.isnan(module(ids, labels))
    result = TrainingSession(model).run({"ids": ids.numpy(), "labels": labels.numpy()})
    assert np.isnan(result.loss)
    for name, gradient in result.gradients.items():
        assert not np.any(gradient), name


def test_the_default_chunk_holds_32_mib_of_logits_at_the_graphs_rows():
    from ortpass.analysis.chunk_width import default_columns

    assert default_columns(1024, ir.DataType.FLOAT) == 8192  # GPT-2, batch 2 x 512
    assert default_columns(4096, ir.DataType.FLOAT) == 2048
    assert default_columns(4096, ir.DataType.DOUBLE) == 1024
    assert default_columns(10**6, ir.DataType.FLOAT) == 256  # never narrower
    assert default_columns(ir.SymbolicDim("rows"), ir.DataType.FLOAT) == 8192  # no dims to count them
    rows = ir.SymbolicDim("batch*seq")  # the export's dims count symbolic rows
    assert default_columns(rows, ir.DataType.FLOAT, {"batch": 2, "seq": 2048}) == 2048
    assert default_columns(rows, ir.DataType.FLOAT, {"batch": 2}) == 8192


class OutputLM(TinyLM):
    """Returns ``{"loss", "logits"}``, as a Hugging Face model's output carries both."""

    def forward(self, ids, labels):
        loss, logits = TinyLM.forward(self, ids, labels)
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize(
    ("logits_out", "logits_last"), [(False, False), (True, False), (True, True)],
    ids=["loss-only", "logits-returned", "logits-last"],
)
def test_ortmodule_trains_like_torch_with_the_loss_chunked_as_batch_and_sequence_change(logits_out, logits_last, monkeypatch):
    """Every step's loss, logits and gradients are torch's while the batch and the sequence
    change, and every graph ORTModule built for them has its loss chunked."""
    import copy

    torch.manual_seed(0)
    module = OutputLM("tied", logits_out=True) if logits_out else TinyLM("tied")
    reference = copy.deepcopy(module)
    last = ", logits_last=True" if logits_last else ""
    pipeline = DEFAULT_PIPELINE.replace("chunk-lm-head-loss,", f"chunk-lm-head-loss(chunk={CHUNK}{last}),")
    wrapped = ortpass.ORTModule(module, pipeline=pipeline)
    graphs = []
    run = type(wrapped)._run
    monkeypatch.setattr(type(wrapped), "_run", lambda self, graph, tensors: (graphs.append(graph), run(self, graph, tensors))[1])
    generator = torch.Generator().manual_seed(2)
    for batch, seq, padding in ((3, 5, 0.6), (2, 8, 0.05), (1, 12, 0.3), (2, 8, 0.5)):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
        labels = torch.randint(0, VOCAB, (batch, seq), generator=generator)
        # Padding, above and below the 10% at which the export gathers the valid rows before
        # the loss (decided at the first step's export; the graph serves every shape after).
        labels[torch.rand(batch, seq, generator=generator) < padding] = IGNORE
        for m in (wrapped, reference):
            m.zero_grad(set_to_none=True)
        ours, theirs = wrapped(ids, labels), reference(ids, labels)
        if logits_out:
            torch.testing.assert_close(ours["logits"], theirs["logits"], rtol=1e-5, atol=1e-6)
            ours, theirs = ours["loss"], theirs["loss"]
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        ours.backward()
        theirs.backward()
        for (name, p), q in zip(wrapped.module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert graphs and all(g.report["chunk-lm-head-loss"].stats.get("counts", {}).get("losses chunked") == 1 for g in graphs), [g.report["chunk-lm-head-loss"].stats for g in graphs]
    said = {g.report["chunk-lm-head-loss"].stats["notes"]["chunked"][0]["returned_logits"] for g in graphs}
    assert said == {"computed after backward" if logits_last else "sliced" if logits_out else "not returned"}
    gathered = [g.report["insert-gather-before-sce-loss"].stats.get("counts", {}).get("losses rewritten") for g in graphs]
    assert 1 in gathered, gathered


# -- the torch builder (stock onnxruntime) ------------------------------------------------------


def _from_torch(module: torch.nn.Module, args=None) -> ir.Model:
    from ortpass.training import build_training_graph_from_torch

    torch.manual_seed(0)
    dynamic = {name: {0: "batch", 1: "seq"} for name in ("ids", "labels")}
    return build_training_graph_from_torch(module, args or _args(), input_names=["ids", "labels"], dynamic_axes=dynamic)


@pytest.mark.stock
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("head", ["tied", "linear", "biased", "hidden_by_vocab"])
def test_the_torch_builders_loss_is_chunked_and_matches_torch(head, reduction):
    """The torch builder writes cross-entropy as LogSoftmax, GatherElements and arithmetic,
    not SoftmaxCrossEntropyLoss: the pass recognizes that chain as the same loss."""
    torch.manual_seed(0)
    module = TinyLM(head, reduction)
    pass_ = ChunkLmHeadLossPass(chunk=CHUNK)
    model = pass_(_from_torch(module)).model
    assert pass_.stats["counts"]["losses chunked"] == 1, pass_.stats
    assert "LogSoftmax" not in {n.op_type for n in model.graph}
    # The chunked loss reads the label's column with GatherElements; the builder's loss did too.
    assert all("_chunked/" in n.name for n in model.graph if n.op_type == "GatherElements")
    assert _widest_float_value(model) == CHUNK
    for args in (_args(), _sparse_args(seed=4, batch=3, seq=5)):
        check_parity(module, args, model, input_names=["ids", "labels"]).assert_ok()


class ScaledSumLM(TinyLM):
    """A summed loss divided by a number that is not the count of valid labels (Hugging
    Face's ``num_items_in_batch``): not a mean, so not the chain the pass rewrites."""

    def forward(self, ids, labels):
        return super().forward(ids, labels) / 7.0


@pytest.mark.stock
def test_a_sum_divided_by_another_count_is_left_alone():
    module = ScaledSumLM("tied", "sum")
    pass_ = ChunkLmHeadLossPass(chunk=CHUNK)
    result = pass_(_from_torch(module))
    assert not result.modified and "losses chunked" not in pass_.stats.get("counts", {})
    check_parity(module, _args(), result.model, input_names=["ids", "labels"]).assert_ok()


@pytest.mark.stock
@pytest.mark.parametrize("logits_last", [False, True], ids=["loss-only", "logits-last"])
def test_ortmodule_on_the_torch_builder_trains_like_torch_with_the_loss_chunked(logits_last):
    import copy

    torch.manual_seed(0)
    module = OutputLM("linear", logits_out=True) if logits_last else TinyLM("linear")
    reference = copy.deepcopy(module)
    last = ", logits_last=True" if logits_last else ""
    pipeline = DEFAULT_PIPELINE.replace("chunk-lm-head-loss,", f"chunk-lm-head-loss(chunk={CHUNK}{last}),")
    wrapped = ortpass.ORTModule(module, pipeline=pipeline, builder="torch")
    generator = torch.Generator().manual_seed(3)
    for batch, seq in ((2, 8), (3, 5), (1, 12)):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
        labels = torch.randint(0, VOCAB, (batch, seq), generator=generator)
        labels[0, 0] = IGNORE
        for m in (wrapped, reference):
            m.zero_grad(set_to_none=True)
        ours, theirs = wrapped(ids, labels), reference(ids, labels)
        if logits_last:
            torch.testing.assert_close(ours["logits"], theirs["logits"], rtol=1e-5, atol=1e-6)
            ours, theirs = ours["loss"], theirs["loss"]
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        ours.backward()
        theirs.backward()
        for (name, p), q in zip(wrapped.module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    labels[0, 1] = VOCAB + 3
    with pytest.raises(IndexError, match=f"outside \\[0, {VOCAB}\\)"):
        wrapped(ids, labels)


@pytest.mark.stock
def test_logits_last_on_the_torch_builder_runs_the_head_after_backward(tmp_path):
    torch.manual_seed(0)
    module = TinyLM("tied", logits_out=True)
    pass_ = ChunkLmHeadLossPass(chunk=CHUNK, logits_last=True)
    model = pass_(_from_torch(module)).model
    assert pass_.stats["notes"]["chunked"][0]["returned_logits"] == "computed after backward"
    (late,) = _vocab_wide_products(model)
    assert late.outputs[0].is_graph_output()  # the builder's Reshape to batch x sequence is not after it
    batch = dict(zip(["ids", "labels"], (a.numpy() for a in _args())))
    order = ort_execution_order(model, batch, tmp_path)
    at = {name: i for i, name in enumerate(order)}
    ran_backward = [at[n.name] for n in model.graph if is_backward(n) and n.name in at]
    assert len(ran_backward) > 20 and at[late.name] > max(ran_backward)


# -- the slices' width under a memory budget -------------------------------------------------------


WIDE_VOCAB = 2048  # 2 MiB of logits at 4 x 64 rows, far more than the rest of the step


class WideVocabLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(WIDE_VOCAB, HIDDEN)
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, WIDE_VOCAB, bias=False)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.fc(self.emb(ids))))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, WIDE_VOCAB), labels.reshape(-1), ignore_index=IGNORE)


def _wide_args() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return tuple(torch.randint(0, WIDE_VOCAB, (4, 64), generator=generator) for _ in range(2))


def _budget_pipeline(module: torch.nn.Module, budget):
    from ortpass.infra.pipeline_text import with_memory_budget

    forward = export(module, _wide_args(), input_names=["ids", "labels"])
    return ortpass.pipeline(with_memory_budget(DEFAULT_PIPELINE, budget))(forward)


def _budget_run(module: torch.nn.Module, budget, field: str):
    """The pipeline's result under ``budget``, the pass's ``budget`` note, and ``field`` of
    each ``chunked`` note."""
    result = _budget_pipeline(module, budget)
    stats = result.report["chunk-lm-head-loss"].stats
    (note,) = stats["notes"]["budget"]
    return result, note, [c[field] for c in stats["notes"].get("chunked", [])]


def test_a_memory_budget_narrows_the_slices_only_as_far_as_it_needs():
    from ortpass.analysis.step_memory import predict_step_memory

    def run(budget):
        return _budget_run(module, budget, "chunk")

    torch.manual_seed(0)
    module = WideVocabLM()
    _, loose, widths = run("1GiB")  # the default width: one slice, nothing chunked
    assert loose["halvings"] == 0 and widths == []
    _, half, widths = run(loose["lowest_peak_bytes"] - 1)  # just under recompute's lowest with the whole logits
    assert half["halvings"] == 1 and widths == [WIDE_VOCAB // 2]
    assert half["lowest_peak_bytes"] < loose["lowest_peak_bytes"]
    budget = half["lowest_peak_bytes"] - 1  # just under it with two slices
    result, quarter, widths = run(budget)
    assert quarter["halvings"] == 2 and widths == [WIDE_VOCAB // 4]
    assert predict_step_memory(result.model).peak_bytes <= budget
    check_parity(module, _wide_args(), result.model, input_names=["ids", "labels"]).assert_ok()


class WideOutputLM(WideVocabLM):
    """Returns the loss and the logits, as a Hugging Face model's output carries both."""

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.fc(self.emb(ids))))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, WIDE_VOCAB), labels.reshape(-1), ignore_index=IGNORE)
        return loss, logits


def test_a_budget_computes_returned_logits_after_backward_before_narrowing_the_slices():
    """Under a budget recompute cannot meet with the returned logits sliced, they are
    computed after backward first, and the slices narrow only if that is not enough."""

    def run(budget):
        return _budget_run(module, budget, "returned_logits")

    torch.manual_seed(0)
    module = WideOutputLM()
    _, loose, returned = run("1GiB")
    assert loose["halvings"] == 0 and not loose["logits_last"] and returned == []  # one slice: nothing chunked
    _, first, returned = run(loose["lowest_peak_bytes"] - 1)
    assert first["logits_last"] and returned == ["computed after backward"]
    assert first["lowest_peak_bytes"] < loose["lowest_peak_bytes"]
    budget = first["lowest_peak_bytes"] - 1  # under what computing them last reaches at that width
    result, narrower, returned = run(budget)
    assert narrower["logits_last"] and narrower["halvings"] > first["halvings"] and returned == ["computed after backward"]
    check_parity(module, _wide_args(), result.model, input_names=["ids", "labels"]).assert_ok()


def test_a_budget_no_width_meets_is_refused_by_recompute_naming_the_lowest_peak():
    from ortpass.errors import PassFailedError

    with pytest.raises(PassFailedError, match="smallest step peak recompute reaches"):
        _budget_pipeline(WideVocabLM(), 1024)


def test_a_width_and_a_budget_together_are_refused():
    from ortpass.errors import PlanError

    with pytest.raises(PlanError, match="not both"):
        ChunkLmHeadLossPass(chunk=512, budget="1GiB")
