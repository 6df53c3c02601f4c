"""ORTModule: the drop-in wrapper trains as torch eager does, and builds graphs only when
the input schema says it must."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import ortpass
from ortpass.errors import OrtpassError
from ortpass.runtime.module import ORTModule, to_ortvalue as _to_ortvalue
from ortpass.testing.models import GPTDecoder

REPO = Path(__file__).resolve().parent.parent
VOCAB, BATCH, SEQ = 1000, 2, 32


def _param_error(p: torch.Tensor, ref: torch.Tensor) -> float:
    """max|p - ref| relative to max|ref|, absolute below 1: attention's key biases get an
    analytically zero gradient, so they start at zero and move by rounding noise only."""
    return ((p - ref).abs().max() / max(ref.abs().max().item(), 1.0)).item()


def _hf_model(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    if kind == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=VOCAB,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def _batches(kind: str, steps: int):
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        # From 0, BERT's padding_idx: its padding row gets no gradient from the lookup.
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        if kind == "decoder":
            yield (ids % 64, (ids % 64).roll(-1, 1)), {}
        elif kind == "bert":
            yield (), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        else:
            yield (), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids, "use_cache": False}


def _loss(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


def _train_alongside_torch(model: nn.Module, kind: str, steps: int, **options) -> ORTModule:
    """``steps`` AdamW steps of ``ORTModule(model, **options)`` and of a copy in torch eager:
    the loss equal at every step (1e-4 relative), the parameters after them (1e-4)."""
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, **options)
    # eps 1e-6: Adam divides by sqrt(v) + eps, and a gradient that is rounding noise (key
    # biases) would otherwise be scaled up to full-size steps in both runs, differently.
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, eps=1e-6)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    for step, (args, kwargs) in enumerate(_batches(kind, steps)):
        loss = _loss(wrapped(*args, **kwargs))
        expected = _loss(reference(*args, **kwargs))
        assert loss.item() == pytest.approx(expected.item(), rel=1e-4), f"step {step}"
        for opt, value in ((optimizer, loss), (reference_optimizer, expected)):
            value.backward()
            opt.step()
            opt.zero_grad()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert _param_error(p.detach(), ref.detach()) <= 1e-4, name
    return wrapped


@pytest.mark.parametrize(
    "kind", ["decoder", pytest.param("gpt2", marks=pytest.mark.slow), "llama", pytest.param("bert", marks=pytest.mark.slow)]
)
def test_fifty_adamw_steps_match_torch_eager(kind):
    torch.manual_seed(0)
    model = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, dropout=0.0) if kind == "decoder" else _hf_model(kind)
    assert _train_alongside_torch(model, kind, 50).graph_builds == 1


def test_fused_attention_trains_like_torch_eager(monkeypatch):
    """ORTModule's default, fused_attention="auto": LLaMA's attention has no dropout, so it
    runs as torch's SDPA kernel inside the graph; ten AdamW steps on tiny LLaMA
    (grouped-query attention) follow torch eager."""
    import ortpass.export

    exported = []
    real_export = ortpass.export.export

    def spying_export(*args, **kwargs):
        model = real_export(*args, **kwargs)
        exported.append(sum(n.op_type == "PythonOp" for n in model.graph))
        return model

    monkeypatch.setattr(ortpass.export, "export", spying_export)
    _train_alongside_torch(_hf_model("llama"), "llama", 10)
    # one attention PythonOp per layer, in the export and in the second export at other
    # sizes that proves its batch and sequence dims dynamic
    assert exported == [2, 2]


def test_a_bad_fused_attention_value_is_refused_when_wrapping():
    with pytest.raises(OrtpassError, match="fused_attention must be True, False or 'auto', not 'on'"):
        ORTModule(nn.Linear(2, 2), fused_attention="on")


def test_the_output_structure_comes_back_with_torch_tensors():
    model = _hf_model("gpt2")
    (_, kwargs) = next(_batches("gpt2", 1))
    output = ORTModule(copy.deepcopy(model))(**kwargs)
    expected = model(**kwargs)
    assert type(output) is type(expected) and list(output.keys()) == ["loss", "logits"]
    assert output.loss.requires_grad and output.logits.requires_grad  # as torch returns them
    torch.testing.assert_close(output.logits, expected.logits.detach(), rtol=1e-4, atol=1e-5)
    # The step differentiates the loss only: a gradient into the logits is refused, by name.
    with pytest.raises(OrtpassError, match=r"a gradient reached output logits.*differentiate='outputs'"):
        (output.loss + output.logits.sum()).backward()


def _decoder_batch(batch: int = 8, seq: int = 16, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (batch, seq), generator=generator)
    return ids, ids.roll(-1, 1)


def test_gradient_accumulation_over_four_micro_batches_equals_the_whole_batch():
    torch.manual_seed(0)
    model = ORTModule(GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, dropout=0.0))
    ids, labels = _decoder_batch()
    model(ids, labels).backward()
    whole = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    hook_calls = []
    first = next(model.parameters())
    first.register_hook(lambda grad: hook_calls.append(grad.shape))
    for micro_ids, micro_labels in zip(ids.chunk(4), labels.chunk(4)):
        (model(micro_ids, micro_labels) / 4).backward()
    assert len(hook_calls) == 4  # the parameter's hooks run on every micro-batch
    for name, p in model.named_parameters():
        assert ((p.grad - whole[name]).abs().max() / whole[name].abs().max()).item() <= 1e-5, name
    assert model.graph_builds == 1  # batch 8, then batch 2: every dim is dynamic


class LoraLinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.down = nn.Parameter(torch.randn(rank, base.in_features) * 0.02)
        self.up = nn.Parameter(torch.randn(base.out_features, rank) * 0.02)

    def forward(self, x):
        return self.base(x) + x @ self.down.t() @ self.up.t()


def _lora_decoder() -> nn.Module:
    torch.manual_seed(0)
    model = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, dropout=0.0)
    model.requires_grad_(False)
    for block in model.blocks:
        block.attn.qkv = LoraLinear(block.attn.qkv)
        block.fc_in = LoraLinear(block.fc_in)
    return model


def test_a_frozen_base_gets_no_gradient_and_its_new_values_are_used():
    model = _lora_decoder()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    ids, labels = _decoder_batch(2)
    loss = wrapped(ids, labels)
    loss.backward()
    expected = reference(ids, labels)
    expected.backward()
    graph = wrapped.transitions.current_graph
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(graph.params) == trainable and len(graph.gradient_outputs) == len(trainable) == 8
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        if p.requires_grad:
            assert ((p.grad - ref.grad).abs().max() / ref.grad.abs().max()).item() <= 1e-5, name
        else:
            assert p.grad is None, name
    # The frozen weights are fed every step, not baked into the graph.
    with torch.no_grad():
        for module in (model, reference):
            module.head.weight.mul_(2.0)
    assert wrapped(ids, labels).item() == pytest.approx(reference(ids, labels).item(), rel=1e-5)
    assert wrapped(ids, labels).item() != pytest.approx(loss.item(), rel=1e-3)
    assert wrapped.graph_builds == 1


def test_transitions_re_export_only_when_the_schema_changes(caplog):
    torch.manual_seed(0)
    model = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, dropout=0.0)
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    with caplog.at_level(logging.INFO, logger="ortpass.runtime.module"):
        wrapped(*_decoder_batch(2, 16))
        wrapped(*_decoder_batch(2, 24))  # a new sequence length: same graph
        wrapped(*_decoder_batch(3, 8))  # and a new batch size
        assert wrapped.graph_builds == 1
        ids, labels = _decoder_batch(2, 16)
        wrapped(ids, labels=labels)  # labels by keyword binds to the same argument
        assert wrapped.graph_builds == 1
        wrapped.eval()
        with torch.no_grad():
            loss = wrapped(ids, labels)
        assert loss.item() == pytest.approx(reference.eval()(ids, labels).item(), rel=1e-5)
        assert not loss.requires_grad and not model.training  # the eval export left the module in eval
        wrapped.train()
        wrapped(ids, labels)
        model.head.bias.requires_grad_(False)
        wrapped(ids, labels)
    assert wrapped.graph_builds == 3
    assert [action for action, _ in wrapped.transitions.transitions] == ["export", "export", "switch", "export"]
    reasons = [reason for _, reason in wrapped.transitions.transitions]
    assert reasons[0] == "first call"
    assert "gradients not needed" in reasons[1] and "modes changed: now training [], now eval [the module" in reasons[1]
    assert "gradients needed" in reasons[2] and "now training [the module" in reasons[2]
    assert "trainable parameters changed" in reasons[3] and "head.bias" in reasons[3]
    assert sum("ORTModule graph" in r.getMessage() for r in caplog.records) == 4


class KeywordModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x, target, scale=None, extra=None):
        y = self.linear(x)
        if scale is not None:
            y = y * scale
        if extra is not None:
            y = y + extra["bias"]
        return {"loss": nn.functional.mse_loss(y, target), "y": y}


def test_a_new_dtype_is_a_new_schema():
    from ortpass.runtime.module import bind_arguments, flatten_arguments, input_schema

    model = KeywordModel()

    def schema(*args):
        leaves, spec = flatten_arguments(model, bind_arguments(model, args, {}))
        return input_schema(model, leaves, spec)

    x = torch.randn(3, 8)
    assert schema(x, x) == schema(torch.randn(5, 8), x)
    assert schema(x.double(), x).difference(schema(x, x)) == "argument x changed: tensor float32[rank 2] -> tensor float64[rank 2]"


def test_a_new_keyword_argument_or_a_new_rank_re_exports_and_says_why():
    torch.manual_seed(0)
    model = KeywordModel()
    wrapped = ORTModule(model)
    x, target = torch.randn(3, 8), torch.randn(3, 4)
    wrapped(x, target)
    wrapped(x, target, scale=2.0)
    out = wrapped(x, target, scale=2.0, extra={"bias": torch.ones(4)})
    wrapped(x, target, scale=3.0, extra={"bias": torch.ones(4)})
    wrapped(x, target, scale=3.0, extra={"bias": torch.ones(1, 4)})
    reasons = [reason for _, reason in wrapped.transitions.transitions]
    assert wrapped.graph_builds == 5
    assert "new ['scale']" in reasons[1]
    assert "new [\"extra['bias']\"]" in reasons[2]
    assert "argument scale changed: constant 2.0 -> constant 3.0" in reasons[3]
    assert "argument extra['bias'] changed: tensor float32[rank 1] -> tensor float32[rank 2]" in reasons[4]
    expected = model(x, target, scale=2.0, extra={"bias": torch.ones(4)})
    assert set(out) == {"loss", "y"}
    torch.testing.assert_close(out["y"], expected["y"].detach())
    torch.testing.assert_close(out["loss"], expected["loss"].detach())


def test_torch_checkpoint_is_exported_as_a_plain_call_and_noticed_once(caplog):
    torch.manual_seed(0)
    model = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, dropout=0.0, checkpoint=True)
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    ids, labels = _decoder_batch(2)
    with caplog.at_level(logging.WARNING, logger="ortpass.runtime.module"), pytest.warns(UserWarning, match="recompute"):
        loss = wrapped(ids, labels)
        wrapped.eval()
        wrapped(ids, labels)
    notices = [r.getMessage() for r in caplog.records if "checkpoint" in r.getMessage()]
    assert len(notices) == 1 and "recompute(level=1)" in notices[0]
    assert loss.item() == pytest.approx(reference(ids, labels).item(), rel=1e-5)


def test_transformers_gradient_checkpointing_exports():
    model = _hf_model("gpt2")
    model.gradient_checkpointing_enable()
    reference = copy.deepcopy(model)
    (_, kwargs) = next(_batches("gpt2", 1))
    with pytest.warns(UserWarning, match="gradient checkpointing of GPT2LMHeadModel"):
        loss = ORTModule(model)(**kwargs).loss
    assert model.transformer.h[0].gradient_checkpointing  # restored after the export
    assert loss.item() == pytest.approx(reference(**kwargs).loss.item(), rel=1e-5)


# -- errors -----------------------------------------------------------------------------------


class ReturnsString(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x):
        return {"loss": self.linear(x).mean(), "note": "hello"}


class UpdatesItself(ReturnsString):
    def forward(self, x):
        with torch.no_grad():
            self.linear.bias.add_(0.0)
        return self.linear(x).mean()


def test_what_cannot_be_wrapped_is_refused_by_name():
    x = torch.randn(2, 4)
    with pytest.raises(OrtpassError, match=r"returned note = str"):
        ORTModule(ReturnsString())(x)
    with pytest.raises(OrtpassError, match=r"argument x of ReturnsString is a object"):
        ORTModule(ReturnsString())(object())
    with pytest.raises(OrtpassError, match=r"ReturnsString.forward does not take these arguments"):
        ORTModule(ReturnsString())(x, x)
    with pytest.raises(OrtpassError, match=r"UpdatesItself.forward updates \['linear.bias'\] in place"):
        ORTModule(UpdatesItself())(torch.randn(2, 4))
    with pytest.raises(OrtpassError, match=r"wraps a torch.nn.Module"):
        ORTModule(lambda x: x)


def test_batches_and_parameters_reach_ort_without_copies():
    for tensor in (torch.randn(3, 4), torch.randint(0, 5, (2, 3)), torch.tensor([True, False])):
        assert _to_ortvalue(tensor).data_ptr() == tensor.data_ptr()


def test_ortpass_exposes_the_wrapper_lazily():
    code = "import sys, ortpass; assert 'torch' not in sys.modules; print(ortpass.ORTModule.__module__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ortpass.runtime.module"
    assert ortpass.ORTModule is ORTModule


# -- the on-disk cache ------------------------------------------------------------------------

_CACHE_RUN = textwrap.dedent(
    """
    import json, sys, torch
    from ortpass import ORTModule
    from ortpass.testing.models import GPTDecoder

    cache_dir, mode = sys.argv[1], sys.argv[2]
    if mode == "load":  # this process must build no graph
        def refuse(*args, **kwargs):
            raise AssertionError("exported in the process that should load")
        torch.onnx.export = refuse
    torch.manual_seed(0)
    model = ORTModule(GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, dropout=0.0), cache_dir=cache_dir, threads=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for seq in (16, 12, 16):
        ids = torch.arange(2 * seq).reshape(2, seq) % 64
        loss = model(ids, ids.roll(-1, 1))
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        losses.append(loss.item())
    print(json.dumps({"losses": losses, "builds": model.graph_builds, "transitions": model.transitions.transitions}))
    """
)


def _run_cache_process(cache_dir: Path, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _CACHE_RUN, str(cache_dir), mode], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_loads_the_cached_graph_and_gives_identical_losses(tmp_path):
    first = _run_cache_process(tmp_path, "export")
    assert first["builds"] == 1 and first["transitions"] == [["export", "first call"]]
    assert len(list(tmp_path.glob("*.onnx"))) == 1 and len(list(tmp_path.glob("*.json"))) == 1
    second = _run_cache_process(tmp_path, "load")
    assert second["builds"] == 0 and second["transitions"] == [["load", "first call"]]
    assert second["losses"] == first["losses"]


def test_a_stale_or_foreign_cache_entry_is_never_used(tmp_path):
    torch.manual_seed(0)
    ids, labels = _decoder_batch(2)
    first = ORTModule(GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, dropout=0.0), cache_dir=tmp_path)
    first(ids, labels)
    assert first.transitions.transitions[0][0] == "export"
    # Another parameter shape, another pipeline: other keys, so a new export each.
    other_shape = ORTModule(GPTDecoder(vocab=64, hidden=32, heads=4, layers=3, dropout=0.0), cache_dir=tmp_path)
    other_shape(ids, labels)
    assert other_shape.graph_builds == 1
    other_pipeline = ORTModule(
        GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, dropout=0.0), cache_dir=tmp_path,
        pipeline="build-training-graph",
    )  # fmt: skip
    other_pipeline(ids, labels)
    assert other_pipeline.graph_builds == 1
    same = ORTModule(GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, dropout=0.0), cache_dir=tmp_path)
    same(ids, labels)
    assert same.graph_builds == 0
    # An entry whose recorded key is not this one (a collision, a tampered file) is not used.
    for meta in tmp_path.glob("*.json"):
        entry = json.loads(meta.read_text())
        entry["key"]["versions"]["torch"] = "0.0"
        meta.write_text(json.dumps(entry))
    again = ORTModule(GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, dropout=0.0), cache_dir=tmp_path)
    again(ids, labels)
    assert again.graph_builds == 1


def test_the_cache_key_follows_ortpass_source_not_only_its_version(tmp_path, monkeypatch):
    from ortpass.runtime.module import cache

    package = tmp_path / "package"
    (package / "passes").mkdir(parents=True)
    (package / "passes" / "a.py").write_text("RULE = 1\n")
    first = cache.source_digest(package)
    assert cache.source_digest(package) == first
    (package / "passes" / "a.py").write_text("RULE = 2\n")  # an editable install's edit
    edited = cache.source_digest(package)
    (package / "b.py").write_text("")
    assert len({first, edited, cache.source_digest(package)}) == 3

    torch.manual_seed(0)
    ids, labels = _decoder_batch(2)
    entries = tmp_path / "cache"

    def builds() -> int:
        wrapped = ORTModule(GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, dropout=0.0), cache_dir=entries)
        wrapped(ids, labels)
        return wrapped.graph_builds

    assert builds() == 1
    monkeypatch.setattr(cache, "ortpass_source_digest", lambda: "edited")  # same version, other code
    assert builds() == 1
    monkeypatch.undo()
    assert builds() == 0


@pytest.mark.slow
def test_the_training_benchmark_runs_on_a_tiny_model(monkeypatch):
    import importlib.util

    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")
    spec = importlib.util.spec_from_file_location("bench_train_wrapper", REPO / "benchmarks" / "train_wrapper.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.SEQ == 16
    results = bench.run(1, ["wrapper", "session", "lora_frozen"])
    configs = results["configs"]
    assert set(configs) == {"wrapper", "session", "lora_frozen"}
    assert configs["lora_frozen"]["trainable_parameters"] < configs["wrapper"]["trainable_parameters"]
    assert all(c["step_seconds"] > 0 for c in configs.values())
    assert "Wrapper step time over the bare session" in bench.markdown(results)


def test_gradients_become_grad_without_a_copy(monkeypatch):
    from ortpass.runtime import module as module_module

    handed = []
    backward = module_module.LossStep.backward

    def recording_backward(ctx, grad_loss, *rest):
        gradients = backward(ctx, grad_loss, *rest)
        handed.extend(g.data_ptr() for g in gradients[2:])
        return gradients

    monkeypatch.setattr(module_module.LossStep, "backward", staticmethod(recording_backward))
    wrapped = ORTModule(GPTDecoder(vocab=64, hidden=32, heads=4, layers=1, dropout=0.0))
    wrapped(*_decoder_batch(2)).backward()
    graph = wrapped.transitions.current_graph
    params = dict(wrapped.module.named_parameters())
    assert [params[name].grad.data_ptr() for name in graph.params] == handed  # ORT's buffers are .grad
