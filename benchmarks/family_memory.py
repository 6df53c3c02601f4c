"""Step peak memory of one training step on every Hugging Face family of the conformance
suite (``tests/test_real_models.py``), with and without recompute: does the default
pipeline's recompute lower the peak on each family (issue #21)?

Each family is built from a config in code (no hub) at a size where the activations pass
recompute's size floor (ORT's 1Mi elements): 2 layers, hidden 256, 4 heads (2 key/value
heads where the family has grouped-query attention), FFN 1024, vocabulary 2048,
positions 512, batch 4, sequence 512, dropout 0.1 everywhere the config has one (SDPA's
attention dropout included). Per-family departures are listed in :data:`FAMILIES`'s
comments and recorded in the JSON. Called as the suite calls them: ``input_ids`` and
``labels`` only, no ``attention_mask``, exported with dynamic batch and sequence.

Two pipelines on the same export: ``ortpass.passes.DEFAULT_PIPELINE`` and the same without
``,recompute(level=1)`` (the suite's ``NO_RECOMPUTE``).  Memory is measured as
``recompute_memory.py`` measures it, with its helpers: a fresh process per configuration
started from a parent that imports only the standard library, glibc
``MALLOC_MMAP_THRESHOLD_=65536``, ORT's CPU arena off, no torch in the measuring process,
step peak = highest RSS during a step above the RSS after setup and a warm-up step.  Only
memory is reported: the step times are recorded in the JSON but the 2 cores are shared.

With ``--budget F`` a third pipeline replaces recompute's level 1 by a memory budget,
``recompute(budget=F)`` (issue #34: recompute without layer boundaries), and two families
outside the suite can be named, where level 1 finds little to recompute: OLMo2 (its RMSNorm
sits on the sublayer's output, before the residual Add) and MobileBERT (``NoNorm``, no
LayerNorm); each row then also gives each configuration's step time (from the memory run:
the 2 cores are shared) and the peak the budget planner predicted.

Usage: ``python benchmarks/family_memory.py [--families gpt2 llama ...] [--layers 2]
[--steps 1] [--budget 0.0]``.  Writes ``family_memory.json`` and ``.md`` next to this script
(a subset of the families writes ``family_memory_subset.*``; another layer count adds
``_layers<N>``, a budget ``_budget``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the recorded results, apart from the scripts
sys.path.insert(0, str(HERE))
import recompute_memory as rm  # noqa: E402  (the sibling benchmark's measuring helpers)

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, BATCH, SEQ, DROPOUT = 256, 4, 2, 1024, 2048, 4, 512, 0.1
LAYERS = int(os.environ.get("ORTPASS_BENCH_LAYERS", "2"))  # --layers N sets it for the children
MIN_ELEMENTS = None  # recompute's default floor
if os.environ.get("ORTPASS_BENCH_TINY") == "1":  # the test suite's smoke run: seconds, not minutes
    HIDDEN, FFN, VOCAB, BATCH, SEQ, MIN_ELEMENTS = 32, 64, 64, 2, 16, 0
NAMES = ["input_ids", "labels"]

# family -> (transformers config class, model class, labels kind, config keywords).
# Labels: "causal" (labels = input_ids), "mlm" (~15% labelled, the rest -100), "seq2seq"
# (other ids as targets).  The same families and settings as the conformance suite's,
# sized up; where a size is the config's own default (GPT-2's and GPT-J's MLP is 4 x
# hidden = FFN, Falcon's too), it is left to the config.
_CAUSAL = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
               num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
               attention_dropout=DROPOUT, use_cache=False)
_TOKENS = dict(bos_token_id=0, eos_token_id=0)
_ENCODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                intermediate_size=FFN, hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT)
FAMILIES: dict[str, tuple[str, str, str, dict]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "causal", dict(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=SEQ,
        resid_pdrop=DROPOUT, embd_pdrop=DROPOUT, attn_pdrop=DROPOUT, use_cache=False, **_TOKENS)),
    # Global then local attention; the config's default window (256).
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", "causal", dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS, intermediate_size=FFN,
        attention_types=[[["global", "local"], 1]], max_position_embeddings=SEQ, embed_dropout=DROPOUT,
        attention_dropout=DROPOUT, resid_dropout=DROPOUT, use_cache=False, **_TOKENS)),
    "opt": ("OPTConfig", "OPTForCausalLM", "causal", dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_dim=FFN,
        word_embed_proj_dim=HIDDEN, max_position_embeddings=SEQ, dropout=DROPOUT, attention_dropout=DROPOUT,
        use_cache=False, pad_token_id=1, **_TOKENS)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "causal", dict(_CAUSAL)),
    "mistral": ("MistralConfig", "MistralForCausalLM", "causal", dict(_CAUSAL)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "causal", dict(_CAUSAL)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "causal", dict(_CAUSAL, head_dim=HIDDEN // HEADS)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "causal", dict(_CAUSAL, pad_token_id=0)),
    # Rotary on half of each head (the suite: 8 of 16).
    "gptj": ("GPTJConfig", "GPTJForCausalLM", "causal", dict(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=SEQ,
        rotary_dim=HIDDEN // HEADS // 2, resid_pdrop=DROPOUT, embd_pdrop=DROPOUT, attn_pdrop=DROPOUT,
        use_cache=False, **_TOKENS)),
    # The config's default multi-query attention: one key/value head.
    "falcon": ("FalconConfig", "FalconForCausalLM", "causal", dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        attention_dropout=DROPOUT, hidden_dropout=DROPOUT, use_cache=False, **_TOKENS)),
    "bert": ("BertConfig", "BertForMaskedLM", "mlm", dict(_ENCODER, max_position_embeddings=SEQ)),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", "mlm", dict(
        _ENCODER, max_position_embeddings=SEQ + 2, pad_token_id=1)),
    "electra": ("ElectraConfig", "ElectraForMaskedLM", "mlm", dict(
        _ENCODER, embedding_size=HIDDEN, max_position_embeddings=SEQ)),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", "mlm", dict(
        _ENCODER, embedding_size=HIDDEN, max_position_embeddings=SEQ)),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", "mlm", dict(
        vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
        max_position_embeddings=SEQ, dropout=DROPOUT, attention_dropout=DROPOUT)),
    "t5": ("T5Config", "T5ForConditionalGeneration", "seq2seq", dict(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS, num_heads=HEADS,
        dropout_rate=DROPOUT, use_cache=False, decoder_start_token_id=0, pad_token_id=0)),
    "bart": ("BartConfig", "BartForConditionalGeneration", "seq2seq", dict(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
        max_position_embeddings=SEQ, dropout=DROPOUT, attention_dropout=DROPOUT, activation_dropout=DROPOUT,
        use_cache=False)),
}

#: Outside the conformance suite: only with ``--budget`` (see the module docstring).
BUDGET_FAMILIES: dict[str, tuple[str, str, str, dict]] = {
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", "causal", dict(_CAUSAL, pad_token_id=1, **_TOKENS)),
    "mobilebert": ("MobileBertConfig", "MobileBertForMaskedLM", "mlm", dict(
        _ENCODER, embedding_size=128, intra_bottleneck_size=128, true_hidden_size=128, max_position_embeddings=SEQ)),
}

CONFIGS = [
    # (key, label)
    ("no_recompute", "default pipeline without recompute"),
    ("default", "default pipeline"),
]
BUDGET = os.environ.get("ORTPASS_BENCH_BUDGET")  # --budget F sets it for the children
if BUDGET is not None:
    CONFIGS.append(("budget", f"default pipeline, recompute(budget={BUDGET}) for level 1"))


def pipelines() -> dict[str, str]:
    """The two pipeline strings, each key's, from the CLI's default (imports ortpass)."""
    from ortpass.passes import DEFAULT_PIPELINE

    default = DEFAULT_PIPELINE
    if MIN_ELEMENTS is not None:  # the tiny run: nothing would pass the default floor
        default = default.replace("recompute(level=1)", f"recompute(level=1,min_elements={MIN_ELEMENTS})")
    no_recompute = DEFAULT_PIPELINE.replace(",recompute(level=1)", "")
    if no_recompute == DEFAULT_PIPELINE or "recompute(" not in default:
        raise RuntimeError(f"the default pipeline no longer holds ',recompute(level=1)': {DEFAULT_PIPELINE}")
    texts = {"no_recompute": no_recompute, "default": default}
    if BUDGET is not None:
        from ortpass.infra.pipeline_text import with_memory_budget

        texts["budget"] = with_memory_budget(DEFAULT_PIPELINE, float(BUDGET))
    return texts


def _batch(labels: str):
    """The suite's batch, at this size: ids clear of the special tokens (0 to 3)."""
    import numpy as np

    rng = np.random.default_rng(1)
    ids = rng.integers(4, VOCAB, (BATCH, SEQ))
    if labels == "causal":
        return ids, ids.copy()
    if labels == "mlm":
        masked = rng.random((BATCH, SEQ)) < 0.15
        masked[:, 0] = True  # never a row without labels
        return ids, np.where(masked, ids, -100)
    return ids, rng.integers(4, VOCAB, (BATCH, SEQ))


def child_prepare(work: Path, family: str) -> dict:
    """Export ``family`` once, run both pipelines on it, save ``<key>.onnx`` and the batch."""
    import numpy as np
    import onnx_ir as ir
    import torch
    import transformers

    import ortpass
    from ortpass.export import export

    config_class, model_class, labels, keywords = {**FAMILIES, **BUDGET_FAMILIES}[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**keywords))

    class TrainingCall(torch.nn.Module):  # what a training loop calls
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, labels):
            return self.model(input_ids=input_ids, labels=labels).loss

    ids, targets = _batch(labels)
    np.savez(work / "batch.npz", input_ids=ids, labels=targets)
    dynamic = {name: {0: "batch", 1: "seq"} for name in NAMES}
    start = time.perf_counter()
    forward = export(TrainingCall(), (torch.from_numpy(ids), torch.from_numpy(targets)), input_names=NAMES,
                     dynamic_axes=dynamic)
    info: dict = {"export_seconds": time.perf_counter() - start, "parameters": sum(p.numel() for p in model.parameters()),
                  "nodes": {}, "recompute": {}}
    for key, text in pipelines().items():
        result = ortpass.pipeline(text)(forward)
        ir.save(result.model, work / f"{key}.onnx")
        info["nodes"][key] = len(result.model.graph)
        info["recompute"][key] = dict(result.report["recompute"].stats.get("counts", {})) if key != "no_recompute" else {}
    return info


def run(families: list[str], steps: int) -> dict:
    results: dict = {
        "model": {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS, "ffn": FFN, "vocab": VOCAB,
                  "positions": SEQ, "batch": BATCH, "seq": SEQ, "dropout": DROPOUT, "min_elements": MIN_ELEMENTS},
        "configs": {family: dict(zip(("config", "model", "labels", "keywords"), {**FAMILIES, **BUDGET_FAMILIES}[family]))
                    for family in families},
        "budget": BUDGET,
        "cpus": os.cpu_count(),
        "steps_after_warm_up": steps,
        "load_average_before": os.getloadavg(),
        "families": {},
    }
    start = time.perf_counter()
    for family in families:
        with tempfile.TemporaryDirectory(prefix=f"family_memory_{family}_") as tmp:
            work = Path(tmp)
            print(f"[{family}] exporting, running both pipelines", flush=True)
            entry = {"prepare": _child("prepare", str(work), family), "configs": {}}
            for key, label in CONFIGS:
                measured = _child("ort", str(work), key, str(steps))
                if measured["torch_imported"]:
                    raise RuntimeError(f"{family} {key}: torch was imported in the ORT child; the memory would be wrong")
                entry["configs"][key] = {"label": label, **measured}
                print(f"    {label}: step peak {measured['step_peak_mib']:.0f} MiB", flush=True)
            results["families"][family] = entry
    results["wall_seconds"] = time.perf_counter() - start
    results["load_average_after"] = os.getloadavg()
    return results


def _child(*args: str) -> dict:
    return rm._run_child(*args, script=__file__)


def rows(results: dict) -> list[dict]:
    """One row per family: both peaks, the reduction, the clones."""
    table = []
    for family, entry in results["families"].items():
        without = entry["configs"]["no_recompute"]["step_peak_mib"]
        with_ = entry["configs"]["default"]["step_peak_mib"]
        table.append({
            "family": family,
            "peak_without_mib": without,
            "peak_with_mib": with_,
            "reduction_percent": 100 * (without - with_) / without if without > 0 else 0.0,
            "clones": entry["prepare"]["recompute"]["default"].get("nodes cloned", 0),
            "ort_recompute_nodes": entry["configs"]["default"]["ort_recompute_nodes"],
        })
        if "budget" in entry["configs"]:
            counts = entry["prepare"]["recompute"]["budget"]
            table[-1].update(
                peak_budget_mib=entry["configs"]["budget"]["step_peak_mib"],
                predicted_budget_mib=counts.get("predicted peak bytes", 0) / 2**20,
                budget_clones=counts.get("nodes cloned", 0),
                **{f"step_seconds_{key}": entry["configs"][key]["step_seconds"] for key in ("no_recompute", "default", "budget")},
            )
    return table


def markdown(results: dict) -> str:
    m = results["model"]
    lines = [
        "# Hugging Face families: step peak memory with and without recompute",
        "",
        f"{m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads ({m['kv_heads']} key/value heads where the "
        f"family groups them), FFN {m['ffn']}, vocab {m['vocab']}, batch {m['batch']}, seq {m['seq']}, dropout "
        f"{m['dropout']}; no attention_mask, dynamic batch and sequence; one training step on ORT (CPU, "
        f"{results['cpus']} cores). Step peak above the RSS after setup and a warm-up step, each configuration in "
        "a fresh process (`recompute_memory.py`'s measurement). Without recompute: `DEFAULT_PIPELINE` less "
        "`,recompute(level=1)`; clones: the nodes recompute cloned (the ones ORT kept after its optimizers in "
        f"brackets). Run time {results['wall_seconds'] / 60:.1f} min; load average before/after "
        f"{results['load_average_before'][0]:.1f} / {results['load_average_after'][0]:.1f}.",
        "",
        "| family | peak without recompute MiB | peak with MiB | reduction % | clones |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows(results):
        lines.append(
            f"| {row['family']} | {row['peak_without_mib']:.0f} | {row['peak_with_mib']:.0f} | "
            f"{row['reduction_percent']:.0f} | {row['clones']} ({row['ort_recompute_nodes']}) |"
        )
    if results.get("budget") is not None:
        lines += [
            "",
            f"With `recompute(budget={results['budget']})` in place of level 1 (step peak MiB / step s, from the memory "
            "run; the budget's peak as its planner predicted it in brackets):",
            "",
            "| family | without recompute | level 1 | budget | budget's clones |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['family']} | {r['peak_without_mib']:.0f} / {r['step_seconds_no_recompute']:.2f} | "
            f"{r['peak_with_mib']:.0f} / {r['step_seconds_default']:.2f} | {r['peak_budget_mib']:.0f} / "
            f"{r['step_seconds_budget']:.2f} ({r['predicted_budget_mib']:.0f}) | {r['budget_clones']} |"
            for r in rows(results)
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        kind, work, *rest = argv[1:]
        if kind == "prepare":
            out = child_prepare(Path(work), rest[0])
        else:
            out = rm.child_ort(Path(work), rest[0], int(rest[1]))
        print(json.dumps(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=[*FAMILIES, *BUDGET_FAMILIES])
    parser.add_argument("--steps", type=int, default=1, help="steps after the warm-up (the first is measured)")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--budget", type=float, help="add recompute(budget=F) in place of level 1, a fraction in [0, 1]")
    args = parser.parse_args(argv)
    budget = None if args.budget is None else str(args.budget)
    if args.layers != LAYERS or budget != BUDGET:  # the configs are built at import: start again
        os.environ["ORTPASS_BENCH_LAYERS"] = str(args.layers)
        if budget is not None:
            os.environ["ORTPASS_BENCH_BUDGET"] = budget
        os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv])
    if any(family in BUDGET_FAMILIES for family in args.families) and BUDGET is None:
        parser.error(f"{', '.join(BUDGET_FAMILIES)} are measured with --budget only (they are not in the conformance suite)")
    results = run(args.families, args.steps)
    stem = "family_memory" if args.families == list(FAMILIES) else "family_memory_subset"
    if LAYERS != 2:
        stem += f"_layers{LAYERS}"
    if BUDGET is not None:
        stem += "_budget"
    rm.record(RESULTS / stem, results, markdown(results))


if __name__ == "__main__":
    main()
