"""Fused attention: torch's scaled_dot_product_attention exported as one recomputable PythonOp."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ortpass
import ortpass.training
from ortpass.conventions import (
    BUILTIN_FUNCTIONS,
    DENSITY_FLAG,
    FUSED_ATTENTION,
    FUSED_MASKED_ATTENTION,
)
from ortpass.export import export
from ortpass.export.fused_attention import (
    FusedAttention,
    FusedMaskedAttention,
    fused_attention_export,
)
from ortpass.passes import DEFAULT_PIPELINE
from ortpass.pythonop.export import qualified_name
from ortpass.runtime import TrainingSession

#: The default pipeline, recomputing tensors of any size (the tiny models' are all below
#: the default 1Mi-element floor).
PIPELINE = DEFAULT_PIPELINE.replace("(level=1)", "(level=1, min_elements=0)")
ROOT = Path(__file__).resolve().parents[1]
_TORCH_SDPA = F.scaled_dot_product_attention


def _qkv(seed: int, batch=2, heads=4, seq=8, dim=16, kv_heads=None):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq, dim)
    kv_shape = (batch, kv_heads or heads, seq, dim)
    return [torch.randn(s, generator=g, requires_grad=True) for s in (shape, kv_shape, kv_shape)]


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 3) -> list[torch.Tensor]:
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return list(torch.autograd.grad(out, inputs, grad_out))


def test_func_names_are_the_ones_conventions_declares():
    assert qualified_name(FusedAttention) == FUSED_ATTENTION
    assert qualified_name(FusedMaskedAttention) == FUSED_MASKED_ATTENTION
    assert set(BUILTIN_FUNCTIONS) == {DENSITY_FLAG, FUSED_ATTENTION, FUSED_MASKED_ATTENTION}
    from ortpass.pythonop import bridge

    known = bridge.registered_functions()
    for func_name in BUILTIN_FUNCTIONS:  # each entry names the class whose func_name it is
        assert qualified_name(known[func_name]) == func_name


@pytest.mark.parametrize("causal", [False, True])
def test_unmasked_matches_sdpa_forward_and_backward(causal):
    q, k, v = _qkv(0)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.25)
    actual = FusedAttention.apply(q, k, v, 0.0, causal, 0.25, False)
    torch.testing.assert_close(actual, expected)
    for a, e in zip(_grads(actual, [q, k, v]), _grads(expected, [q, k, v])):
        torch.testing.assert_close(a, e)


def test_grouped_query_attention_matches_sdpa():
    q, k, v = _qkv(1, kv_heads=2)
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True)
    actual = FusedAttention.apply(q, k, v, 0.0, False, 0.25, True)
    for a, e in zip(_grads(actual, [q, k, v]), _grads(expected, [q, k, v])):
        torch.testing.assert_close(a, e)


def test_float_mask_gets_its_gradient_and_bool_mask_none():
    q, k, v = _qkv(2)
    bias = torch.randn(1, 4, 8, 8, requires_grad=True)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.25)
    actual = FusedMaskedAttention.apply(q, k, v, bias, 0.0, 0.25, False)
    for a, e in zip(_grads(actual, [q, k, v, bias]), _grads(expected, [q, k, v, bias])):
        torch.testing.assert_close(a, e)

    keep = torch.ones(8, 8, dtype=torch.bool).tril()
    out = FusedMaskedAttention.apply(q, k, v, keep, 0.0, 0.25, False)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.25))
    # ORT hands bool tensors over DLPack as uint8; the Function reads them as the bool mask.
    torch.testing.assert_close(FusedMaskedAttention.apply(q, k, v, keep.to(torch.uint8), 0.0, 0.25, False), out)


def test_a_causal_bool_mask_runs_the_causal_kernel_and_any_other_mask_is_kept(monkeypatch):
    from ortpass.export import fused_attention

    calls = []

    def spy(*args, **kwargs):
        calls.append((kwargs["attn_mask"], kwargs["is_causal"]))
        return _TORCH_SDPA(*args, **kwargs)

    monkeypatch.setattr(fused_attention, "_torch_sdpa", spy)
    q, k, v = _qkv(5)
    causal = torch.ones(8, 8, dtype=torch.bool).tril().expand(2, 1, 8, 8).contiguous()
    padded = causal.clone()
    padded[1, :, :, 0] = False  # the second sequence's first token is padding
    bias = torch.randn(1, 4, 8, 8)
    for mask, shortcut in ((causal, True), (causal.to(torch.uint8), True), (padded, False), (bias, False)):
        calls.clear()
        out = FusedMaskedAttention.apply(q, k, v, mask, 0.0, 0.25, False)
        grads = _grads(out, [q, k, v])
        assert calls and all((m is None and c) if shortcut else (m is not None and not c) for m, c in calls)
        reference_mask = mask.view(torch.bool) if mask.dtype == torch.uint8 else mask
        expected = _TORCH_SDPA(q, k, v, attn_mask=reference_mask, scale=0.25)
        torch.testing.assert_close(out, expected)
        for a, e in zip(grads, _grads(expected, [q, k, v])):
            torch.testing.assert_close(a, e)


def test_dropout_backward_regenerates_forwards_mask():
    """Backward runs SDPA again from the generator state forward started from, so the
    gradient is SDPA's own for the mask forward drew."""
    q, k, v = _qkv(3)
    torch.manual_seed(7)
    expected = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, scale=0.25)
    expected_grads = _grads(expected, [q, k, v])
    torch.manual_seed(7)
    actual = FusedAttention.apply(q, k, v, 0.3, False, 0.25, False)
    after_forward = torch.get_rng_state()
    actual_grads = _grads(actual, [q, k, v])
    torch.testing.assert_close(actual, expected)
    for a, e in zip(actual_grads, expected_grads):
        torch.testing.assert_close(a, e)
    # Backward's replay leaves the generator where forward left it.
    assert torch.equal(torch.get_rng_state(), after_forward)


class _Attention(torch.nn.Module):
    def __init__(self, masked: bool):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)
        self.masked = masked

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.proj(x).chunk(3, dim=-1))
        if self.masked:
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.square().mean()


def _pythonops(model) -> list[str]:
    return [n.attributes["func_name"].as_string() for n in model.graph if n.op_type == "PythonOp"]


@pytest.mark.parametrize("masked", [False, True])
def test_export_option_turns_sdpa_into_one_pythonop(masked):
    x = torch.randn(2, 6, 16)
    fused = export(_Attention(masked), (x,), fused_attention=True)
    assert _pythonops(fused) == [FUSED_MASKED_ATTENTION if masked else FUSED_ATTENTION]
    assert not any(n.op_type == "Softmax" for n in fused.graph)
    plain = export(_Attention(masked), (x,))
    assert _pythonops(plain) == []
    assert any(n.op_type == "Softmax" for n in plain.graph)
    assert F.scaled_dot_product_attention is _TORCH_SDPA


def test_export_restores_sdpa_when_the_export_fails():
    original = _TORCH_SDPA

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    with pytest.raises(ortpass.errors.ExportError, match="boom"):
        export(Broken(), (torch.zeros(1),), fused_attention=True)
    assert F.scaled_dot_product_attention is original
    with fused_attention_export():
        assert F.scaled_dot_product_attention is not original
    assert F.scaled_dot_product_attention is original


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


class _Loss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def _step_on_ort(training, batch, seed):
    torch.manual_seed(seed)
    return TrainingSession(training).run({k: v.numpy() for k, v in batch.items()})


def test_gpt2_with_attention_dropout_matches_torch_with_recompute(gpt2):
    """Default pipeline on a fused-attention GPT-2 (attention dropout 0.1): recompute
    applies, and one ORT step equals torch eager from the same generator state, the
    attention dropout's mask included."""
    module = _Loss(gpt2)
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    forward = export(module, tuple(batch.values()), input_names=list(batch), fused_attention=True)
    assert len(_pythonops(forward)) == 2
    result = ortpass.pipeline(PIPELINE)(forward)
    # The gradient build hands the attention's shape inferer to ORT's symbolic inference:
    # a static export stays static through the PythonOps, so savings are bytes, not symbols.
    named = {d.value for n in result.model.graph for o in n.outputs if o.shape for d in o.shape.dims if not isinstance(d, int)}
    assert named <= {None}  # only the RNG states' lengths are unknown, and they are not symbols
    pythonops = [n for n in result.model.graph if n.op_type == "PythonOp"]
    assert len(pythonops) == 4  # each attention and its recompute clone (the mask's And is recomputable)

    step = _step_on_ort(result.model, batch, seed=11)
    torch.manual_seed(11)
    module.zero_grad()
    loss = module(**batch)
    loss.backward()
    assert step.loss == pytest.approx(loss.item(), rel=1e-5)
    for name, param in module.named_parameters():
        expected = param.grad.numpy()
        assert step.gradients[name].shape == expected.shape
        np.testing.assert_allclose(step.gradients[name], expected, rtol=0, atol=1e-5 * max(np.abs(expected).max(), 1e-3))


def test_auto_fuses_the_calls_without_dropout_and_the_large_ones(gpt2, monkeypatch):
    """``fused_attention="auto"`` (ORTModule's default): GPT-2's attention dropout 0.1
    keeps the decomposition while its attention is small; the same model with attention
    dropout 0, or with an attention of AUTO_DROPOUT_BYTES or more, gets the PythonOps."""
    from ortpass.export import fused_attention

    module = _Loss(gpt2)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = (ids, torch.ones_like(ids), ids)
    names = ["input_ids", "attention_mask", "labels"]
    assert _pythonops(export(module, batch, input_names=names, fused_attention="auto")) == []
    assert len(_pythonops(export(module, batch, input_names=names, fused_attention=True))) == 2
    without = copy.deepcopy(gpt2)
    for block in without.transformer.h:
        block.attn.attn_dropout.p = 0.0  # what GPT2Attention passes to SDPA as dropout_p
    fused = export(_Loss(without), batch, input_names=names, fused_attention="auto")
    assert len(_pythonops(fused)) == 2
    # (batch 2, heads, 16, 16) float: the threshold at exactly its size fuses, one byte more does not.
    attention = 2 * gpt2.config.n_head * 16 * 16 * 4
    monkeypatch.setattr(fused_attention, "AUTO_DROPOUT_BYTES", attention + 1)
    assert _pythonops(export(module, batch, input_names=names, fused_attention="auto")) == []
    monkeypatch.setattr(fused_attention, "AUTO_DROPOUT_BYTES", attention)
    assert len(_pythonops(export(module, batch, input_names=names, fused_attention="auto"))) == 2


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_fused_attention_value_is_refused_by_name(gpt2, value):
    with pytest.raises(ortpass.errors.ExportError, match="fused_attention must be True, False or 'auto'"):
        export(_Loss(gpt2), (torch.zeros(1, 4, dtype=torch.long),) * 3, fused_attention=value)


@pytest.mark.slow
def test_a_fresh_process_runs_fused_attention_without_registering_anything(tmp_path, gpt2):
    """ortpass's own Functions are known to the bridge and the analysis by func_name, so
    `ortpass optimize` and a session in a new process need no user registration."""
    module = _Loss(gpt2)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    forward = export(module, tuple(batch.values()), input_names=list(batch), fused_attention=True)
    path = tmp_path / "fused.onnx"
    ortpass.io.save(forward, path)
    np.savez(tmp_path / "batch.npz", **{k: v.numpy() for k, v in batch.items()})
    script = f"""
import numpy as np, ortpass, ortpass.io
from ortpass.passes import DEFAULT_PIPELINE
from ortpass.runtime import TrainingSession
result = ortpass.pipeline(DEFAULT_PIPELINE)(ortpass.io.load({str(path)!r}))
clones = sum(n.op_type == "PythonOp" for n in result.model.graph)
step = TrainingSession(result.model).run(dict(np.load({str(tmp_path / 'batch.npz')!r})))
print(clones, np.isfinite(step.loss))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=str(tmp_path),
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    pythonops, finite = proc.stdout.split()[-2:]
    assert int(pythonops) >= 2 and finite == "True"


def test_a_pythonop_whose_last_input_has_no_gradient_trains_on_ort():
    """The masked attention's last tensor input (a bool mask) gets no gradient: ORT's
    builder leaves that PythonOpGrad output unnamed, and serialization would drop it."""
    torch.manual_seed(0)
    module = _Attention(masked=True)
    x = torch.randn(2, 6, 16)
    training = ortpass.training.build_training_graph(export(module, (x,), fused_attention=True))
    grad_node = next(n for n in training.graph if n.op_type == "PythonOpGrad")
    assert len(grad_node.outputs) == 4 and all(o.name for o in grad_node.outputs)
    step = TrainingSession(training).run({"input_0": x.numpy()})
    loss = module(x)
    loss.backward()
    assert step.loss == pytest.approx(loss.item(), rel=1e-6)
    for name, param in module.named_parameters():
        np.testing.assert_allclose(step.gradients[name], param.grad.numpy(), rtol=1e-5, atol=1e-7)


class _CausalBlock(torch.nn.Module):
    """Projections around a causal SDPA with attention dropout, no mask tensor."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.proj(x).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.2)
        return self.out(attended.transpose(1, 2).flatten(-2)).square().mean()


_CAUSAL_BLOCK_RECOMPUTE = (
    "pythonop-shape-inference,build-training-graph,fix-dropout-seed(min_elements=0),"
    "recompute(plans='Transpose+MatMul+Add+Split+Reshape+Transpose+Reshape+Transpose+Reshape+Transpose+PythonOp+:1:-1',"
    " min_elements=0)"
)


def _sdpa_calls(monkeypatch) -> list[bool]:
    """Record, per attention the fused Functions compute (torch's SDPA, or a block of
    ortpass.export.attention_blocks where dropout runs on the CPU), whether it built a graph."""
    import ortpass.export.attention_blocks as blocks
    import ortpass.export.fused_attention as fused

    calls = []

    def counting(compute):
        def run(*args, **kwargs):
            out = compute(*args, **kwargs)
            calls.append(out.grad_fn is not None)
            return out

        return run

    monkeypatch.setattr(fused, "_torch_sdpa", counting(_TORCH_SDPA))
    monkeypatch.setattr(blocks, "_block", counting(blocks._block))
    return calls


def _assert_matches_torch_eager(step, module, x, seed):
    """The ORT step's loss and gradients equal a torch eager step's from the same seed."""
    torch.manual_seed(seed)
    loss = module(x)
    loss.backward()
    assert step.loss == pytest.approx(loss.item(), rel=1e-6)
    for name, param in module.named_parameters():
        np.testing.assert_allclose(step.gradients[name], param.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_recomputed_attention_replays_its_dropout_mask(monkeypatch):
    """The attention PythonOp recomputed in backward (RNG state replayed): its clone's ctx
    feeds PythonOpGrad, and the gradients equal torch eager's from the same seed, so the
    clone drew forward's mask.  The clone keeps SDPA's autograd graph, so backward runs no
    third forward: SDPA runs twice a step, once without a graph and once with one."""
    torch.manual_seed(0)
    module = _CausalBlock()
    x = torch.randn(2, 6, 16)
    forward = export(module, (x,), fused_attention=True)
    result = ortpass.pipeline(_CAUSAL_BLOCK_RECOMPUTE)(forward)
    pythonops = [n for n in result.model.graph if n.op_type == "PythonOp"]
    assert len(pythonops) == 2 and pythonops[0].attributes["training_mode"].as_int() == 0
    calls = _sdpa_calls(monkeypatch)
    step = _step_on_ort(result.model, {"input_0": x}, seed=5)
    assert calls == [False, True]
    _assert_matches_torch_eager(step, module, x, seed=5)


def test_attention_trained_without_recompute_runs_forward_again_in_backward(monkeypatch):
    """Without recompute the forward PythonOp keeps only its inputs and its dropout mask
    as bits (no seq x seq float tensor waits for backward), and backward runs the
    attention again with that mask: the gradients equal torch eager's."""
    torch.manual_seed(0)
    module = _CausalBlock()
    x = torch.randn(2, 6, 16)
    forward = export(module, (x,), fused_attention=True)
    training = ortpass.pipeline("pythonop-shape-inference,build-training-graph")(forward).model
    calls = _sdpa_calls(monkeypatch)
    step = _step_on_ort(training, {"input_0": x}, seed=5)
    assert calls == [False, True]  # forward without a graph; backward's re-run with one
    _assert_matches_torch_eager(step, module, x, seed=5)
