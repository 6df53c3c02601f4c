"""Conformance suite: Hugging Face model families through ortpass's default pipeline (issue #21).

Each family is built from a tiny config (2 layers, hidden 64, vocabulary 1000; batch 2,
sequence 32; no download) and called as a user calls it for training: ``input_ids`` and
``labels`` only, no ``attention_mask``, the attention implementation transformers picks by
default (SDPA).  For each family:

- export with dynamic batch and sequence (``ortpass.export.export``);
- the default pipeline (``ortpass.passes.DEFAULT_PIPELINE``) from Python, and ``ortpass
  optimize`` (in process) on the saved export, which must give the very same step;
- one ORT step at dropout 0: loss and every gradient equal torch eager
  (``check_parity``'s tolerance), each gradient shaped like its parameter;
- recompute applied (clones in the graph), and at dropout 0.1 (attention dropout inside
  SDPA included) loss and gradients bitwise equal with and without recompute, and equal
  to torch with ORT's masks replayed;
- ``ortpass report --plot`` on the result.

Each family exports once per dropout setting (module-scoped fixtures).  The README's
"Supported model families" table lists what each family exercises.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import onnx_ir as ir
import pytest
import torch

transformers = pytest.importorskip("transformers")

import ortpass  # noqa: E402
from ortpass.analysis.partition import get_training_info  # noqa: E402
from ortpass.analysis.recompute import find_recompute_candidates  # noqa: E402
from ortpass.cli import main  # noqa: E402
from ortpass.export import export  # noqa: E402
from ortpass.infra.metadata import get_export_info  # noqa: E402
from ortpass.passes import DEFAULT_PIPELINE  # noqa: E402
from ortpass.runtime import TrainingSession  # noqa: E402
from ortpass.runtime.parity import check_parity  # noqa: E402

# Hugging Face families exported and run through the default pipeline and the CLI: end-to-end.
pytestmark = pytest.mark.slow

VOCAB, HIDDEN, LAYERS, HEADS, FFN, POSITIONS = 1000, 64, 2, 4, 128, 64
BATCH, SEQ = 2, 32
NAMES = ["input_ids", "labels"]
DYNAMIC = {name: {0: "batch", 1: "seq"} for name in NAMES}
NO_RECOMPUTE = DEFAULT_PIPELINE.replace(",recompute(level=1)", "")
assert NO_RECOMPUTE != DEFAULT_PIPELINE


@dataclasses.dataclass(frozen=True)
class Family:
    config: Callable[[float], Any]  # dropout -> config
    model: str  # transformers class name
    labels: str  # "causal" (labels = input_ids), "mlm" (~15% labels, the rest -100), "seq2seq"


def _causal_common(dropout: float) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=POSITIONS,
                attention_dropout=dropout, use_cache=False)


FAMILIES: dict[str, Family] = {
    "gpt2": Family(lambda p: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=POSITIONS,
        resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, use_cache=False, bos_token_id=0, eos_token_id=0,
    ), "GPT2LMHeadModel", "causal"),
    "gpt_neo": Family(lambda p: transformers.GPTNeoConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS, intermediate_size=FFN,
        attention_types=[[["global", "local"], 1]], window_size=16, max_position_embeddings=POSITIONS,
        embed_dropout=p, attention_dropout=p, resid_dropout=p, use_cache=False, bos_token_id=0, eos_token_id=0,
    ), "GPTNeoForCausalLM", "causal"),
    "opt": Family(lambda p: transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_dim=FFN,
        word_embed_proj_dim=HIDDEN, max_position_embeddings=POSITIONS, dropout=p, attention_dropout=p,
        use_cache=False, pad_token_id=1, bos_token_id=0, eos_token_id=0,
    ), "OPTForCausalLM", "causal"),
    "llama": Family(lambda p: transformers.LlamaConfig(**_causal_common(p)), "LlamaForCausalLM", "causal"),
    "mistral": Family(lambda p: transformers.MistralConfig(**_causal_common(p)), "MistralForCausalLM", "causal"),
    "qwen2": Family(lambda p: transformers.Qwen2Config(**_causal_common(p)), "Qwen2ForCausalLM", "causal"),
    "gemma": Family(lambda p: transformers.GemmaConfig(**_causal_common(p), head_dim=HIDDEN // HEADS),
                    "GemmaForCausalLM", "causal"),
    "phi3": Family(lambda p: transformers.Phi3Config(**_causal_common(p), pad_token_id=0), "Phi3ForCausalLM", "causal"),
    "gptj": Family(lambda p: transformers.GPTJConfig(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=POSITIONS, rotary_dim=8,
        resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, use_cache=False, bos_token_id=0, eos_token_id=0,
    ), "GPTJForCausalLM", "causal"),
    "falcon": Family(lambda p: transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        attention_dropout=p, hidden_dropout=p, use_cache=False, bos_token_id=0, eos_token_id=0,
    ), "FalconForCausalLM", "causal"),
    "bert": Family(lambda p: transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=POSITIONS, hidden_dropout_prob=p,
        attention_probs_dropout_prob=p,
    ), "BertForMaskedLM", "mlm"),
    "roberta": Family(lambda p: transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=POSITIONS + 2, hidden_dropout_prob=p,
        attention_probs_dropout_prob=p, pad_token_id=1,
    ), "RobertaForMaskedLM", "mlm"),
    "electra": Family(lambda p: transformers.ElectraConfig(
        vocab_size=VOCAB, embedding_size=HIDDEN, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=POSITIONS,
        hidden_dropout_prob=p, attention_probs_dropout_prob=p,
    ), "ElectraForMaskedLM", "mlm"),
    "albert": Family(lambda p: transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=HIDDEN, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=POSITIONS,
        hidden_dropout_prob=p, attention_probs_dropout_prob=p,
    ), "AlbertForMaskedLM", "mlm"),
    "distilbert": Family(lambda p: transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
        max_position_embeddings=POSITIONS, dropout=p, attention_dropout=p,
    ), "DistilBertForMaskedLM", "mlm"),
    "t5": Family(lambda p: transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS, num_heads=HEADS,
        dropout_rate=p, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
    ), "T5ForConditionalGeneration", "seq2seq"),
    "bart": Family(lambda p: transformers.BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
        max_position_embeddings=POSITIONS, dropout=p, attention_dropout=p, activation_dropout=p, use_cache=False,
    ), "BartForConditionalGeneration", "seq2seq"),
}


class TrainingCall(torch.nn.Module):
    """The call a training loop makes: ``model(input_ids=..., labels=...).loss``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def _batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    # Ids from 4 up: clear of the special tokens (pad 0/1) the families use.
    ids = torch.randint(4, VOCAB, (BATCH, SEQ), generator=generator)
    if kind == "causal":
        return ids, ids.clone()
    if kind == "mlm":
        masked = torch.rand(BATCH, SEQ, generator=generator) < 0.15
        masked[:, 0] = True  # never an all-padding row
        return ids, torch.where(masked, ids, torch.full_like(ids, -100))
    return ids, torch.randint(4, VOCAB, (BATCH, SEQ), generator=generator)


@dataclasses.dataclass
class Exported:
    name: str
    module: TrainingCall
    args: tuple[torch.Tensor, torch.Tensor]
    forward: ir.Model
    trained: ir.Model  # the default pipeline's result
    report: Any

    @property
    def feeds(self) -> dict[str, torch.Tensor]:
        return dict(zip(NAMES, self.args))


def _export(name: str, dropout: float) -> Exported:
    family = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, family.model)(family.config(dropout))
    module = TrainingCall(model)
    args = _batch(family.labels)
    forward = export(module, args, input_names=NAMES, dynamic_axes=DYNAMIC)
    result = ortpass.pipeline(DEFAULT_PIPELINE)(forward)
    return Exported(name, module, args, forward, result.model, result.report)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def exported(request) -> Exported:
    return _export(request.param, 0.0)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def exported_with_dropout(request) -> Exported:
    return _export(request.param, 0.1)


def test_export_has_dynamic_batch_and_sequence(exported):
    for value in exported.forward.graph.inputs:
        assert [str(d) for d in value.shape] == ["batch", "seq"], (value.name, value.shape)


def test_default_pipeline_step_matches_torch(exported):
    parity = check_parity(exported.module, exported.args, exported.trained, input_names=NAMES)
    parity.assert_ok()
    parameters = dict(exported.module.named_parameters())
    gradients = parity.ort.gradients
    assert set(gradients) == set(get_training_info(exported.trained).params)
    for name, gradient in gradients.items():
        assert gradient.shape == tuple(parameters[name].shape), name
    # Every parameter torch gives a gradient gets one from ORT too.
    assert set(parity.torch_gradients) <= set(gradients)


# chunk-lm-head-loss fires by default only where the logits outgrow one slice (8192
# vocabulary columns at symbolic rows); these slices are narrow enough for vocabulary 1000.
CHUNKED = DEFAULT_PIPELINE.replace("chunk-lm-head-loss,", "chunk-lm-head-loss(chunk=256),")
assert CHUNKED != DEFAULT_PIPELINE


def test_chunked_head_and_loss_match_torch(exported):
    result = ortpass.pipeline(CHUNKED)(exported.forward)
    stats = result.report["chunk-lm-head-loss"].stats
    assert stats["counts"]["losses chunked"] == 1, stats
    assert not any(n.op_type == "SoftmaxCrossEntropyLoss" for n in result.model.graph)
    check_parity(exported.module, exported.args, result.model, input_names=NAMES).assert_ok()


def test_cli_optimize_gives_the_same_step(exported, tmp_path):
    source, target = tmp_path / f"{exported.name}.onnx", tmp_path / f"{exported.name}.train.onnx"
    ir.save(exported.forward, source)
    assert main(["-q", "optimize", str(source), "-o", str(target)]) == 0
    # One thread: bitwise reproducible (GatherGrad sums in thread order otherwise).
    from_cli = TrainingSession(ir.load(target), threads=1).run(exported.feeds)
    from_python = TrainingSession(exported.trained, threads=1).run(exported.feeds)
    assert from_cli.loss == from_python.loss
    for name, gradient in from_python.gradients.items():
        np.testing.assert_array_equal(from_cli.gradients[name], gradient, err_msg=name)


def test_recompute_applies(exported):
    stats = next(record for record in exported.report.records if record.name == "recompute").stats
    assert stats["counts"]["nodes cloned"] > 0, stats["counts"]
    assert any(node.name.endswith("_recompute") for node in exported.trained.graph)


def test_report_plot(exported, tmp_path):
    model_path, plot = tmp_path / "trained.onnx", tmp_path / "timeline.png"
    ir.save(exported.trained, model_path)
    data_dependent = _valid_label_dims(exported)
    # MLM labels are gathered, and the gathered rows keep the gather's dim name.
    assert bool(data_dependent) == (FAMILIES[exported.name].labels == "mlm")
    # The rows left after the label gather are counted at run time; the plot needs that count.
    dim_options = [f"--dim={name}={value}" for name, value in data_dependent.items()]
    if not data_dependent or _cli_takes_dims():
        assert main(["-q", "report", str(model_path), "--plot", str(plot), "--min-elements", "0", *dim_options]) == 0
    else:
        # A command line without `report --dim`: the table from it (it needs no value), the
        # plot from Python.
        assert main(["-q", "report", str(model_path), "--min-elements", "0"]) == 0
        dims = {**get_export_info(exported.trained)["dims"], **data_dependent}
        find_recompute_candidates(exported.trained, dims=dims, min_elements=0).plot(plot)
    assert plot.stat().st_size > 1000


def _cli_takes_dims() -> bool:
    from ortpass.cli import _parser

    try:
        _parser().parse_args(["report", "model.onnx", "--dim", "n=1"])
    except SystemExit:
        return False
    return True


def _valid_label_dims(exported: Exported) -> dict[str, int]:
    """The dims counting the rows the label gather keeps, each with this batch's count."""
    valid = int((exported.args[1] != -100).sum())
    symbols = {
        dim.value
        for node in exported.trained.graph
        for value in node.outputs
        if value.shape is not None
        for dim in value.shape
        if isinstance(dim, ir.SymbolicDim) and dim.value is not None
    }
    # The dim the label gather names (the gradient build keeps that name).
    return {s: valid for s in symbols if s.startswith("valid_label_count_")}


def test_recompute_is_bitwise_exact_with_dropout(exported_with_dropout):
    exported = exported_with_dropout
    assert any(node.op_type == "Dropout" for node in exported.trained.graph)
    without = ortpass.pipeline(NO_RECOMPUTE)(exported.forward).model
    assert not any(node.name.endswith("_recompute") for node in without.graph)
    with_recompute = TrainingSession(exported.trained, threads=1).run(exported.feeds)
    plain = TrainingSession(without, threads=1).run(exported.feeds)
    assert with_recompute.loss == plain.loss
    for name, gradient in plain.gradients.items():
        np.testing.assert_array_equal(with_recompute.gradients[name], gradient, err_msg=name)


def test_dropout_step_matches_torch_with_masks_replayed(exported_with_dropout):
    exported = exported_with_dropout
    check_parity(exported.module, exported.args, exported.trained, input_names=NAMES).assert_ok()


def test_unsupported_family_fails_naming_the_op_the_module_and_the_way_out():
    # Mixtral's expert routing counts tokens per expert with torch.histc, which the
    # TorchScript exporter cannot convert (and whose data-dependent expert loop tracing
    # would freeze); the README's family table quotes this error.
    config = transformers.MixtralConfig(**_causal_common(0.0), num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    module = TrainingCall(transformers.MixtralForCausalLM(config))
    with pytest.raises(ortpass.errors.ExportError) as failure:
        export(module, _batch("causal"), input_names=NAMES, dynamic_axes=DYNAMIC)
    message = str(failure.value)
    assert "Exporting the operator 'aten::histc'" in message
    assert "in model.model.layers.0.mlp.experts (MixtralExperts)" in message  # the module that called it
    assert "ortpass.export.register_symbolic('aten::histc')" in message


def test_decoder_with_its_default_kv_cache_matches_torch():
    # use_cache=True (the config default): the keys come out of a DynamicCache, and
    # tracing loses their head size, which the grouped-query SDPA export reads.
    config = FAMILIES["llama"].config(0.0)
    config.use_cache = True
    torch.manual_seed(0)
    module = TrainingCall(transformers.LlamaForCausalLM(config))
    args = _batch("causal")
    trained = ortpass.pipeline(DEFAULT_PIPELINE)(export(module, args, input_names=NAMES, dynamic_axes=DYNAMIC)).model
    check_parity(module, args, trained, input_names=NAMES).assert_ok()
