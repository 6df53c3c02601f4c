"""Step peak memory and warm step time at real width, where the vocabulary dominates
(issue #35, "large vocabularies"): ``ortpass.ORTModule`` with and without the passes that
chunk the LM head's loss and scatter the embedding's gradient, against torch with
transformers' ``gradient_checkpointing_enable()``, alone and with Cut Cross-Entropy.

Models, from configs in code (no hub), weights from ``torch.manual_seed(0)``:

- GPT-2 small: ``GPT2LMHeadModel``, 12 layers, hidden 768, 12 heads, vocab 50257, the
  config's own dropout (0.1 on embeddings, residuals and attention);
- LLaMA-like with LLaMA-3's vocabulary: ``LlamaForCausalLM``, 4 layers, hidden 512, 8
  heads (8 KV heads), MLP 1376, vocab 128256, no dropout.

Batch 2, seq 512 (``--seq 2048`` for the long sequence); ``input_ids`` drawn from
``np.random.default_rng(0)`` over the vocabulary, ``attention_mask`` of ones, ``labels =
input_ids``.  A prepare child saves the weights (``state_dict``) and the batch; every
configuration child loads them, so all see the same weights and batch.  One step:
``p.grad = None`` for every parameter (``optimizer.zero_grad()``: the step allocates its
gradients, in torch and in the wrapper alike), ``loss = model(**batch).loss``,
``loss.backward()``; the first step's loss is recorded.  The loop keeps the loss alone,
as Hugging Face's Trainer does, so torch frees the logits before backward; with
``--keep-output`` it holds the model's whole output through ``backward()``, as
``outputs = model(**batch); outputs.loss.backward()`` does.

Configurations: ORTModule with ortpass's default pipeline (the graph returns the logits
too, as Hugging Face's output carries them); the same without ``chunk-lm-head-loss`` and
``scatter-embedding-gradient``; ORTModule over a module that returns the loss alone (no
logits to return); ORTModule with ``chunk-lm-head-loss(logits_last=True)`` (the returned
logits computed again after backward); ORTModule with the loss computed by the loop from
the returned logits (``wrapper_split``, issue #60: forward and backward run as two graphs,
the loss in torch as transformers computes it, :func:`causal_lm_loss`); torch + checkpointing; torch +
checkpointing with the loss computed by Cut Cross-Entropy (``cut-cross-entropy``, its
``torch_compile`` implementation: the Triton one needs a GPU) from the base model's
hidden states; its compile time (the first step) is kept apart as ``compile_seconds``.
Liger's fused linear cross-entropy is not a row: its kernels are Triton-only
(:data:`LIGER_NOTE`).

Memory is measured as ``recompute_memory.py`` measures it (its helpers are used here): a
fresh process per configuration started from a parent that imports only the standard
library, glibc ``MALLOC_MMAP_THRESHOLD_=65536``, step peak = highest RSS during a step
above the RSS after setup and a warm-up step.  In that memory run ORTModule's sessions
run with ORT's CPU arena and prepacking off (as ``recompute_memory``'s ORT children:
with the arena on, the warm-up step leaves the step's peak held in the arena and the step
peak reads near 0).  Step time comes from a second fresh process per configuration with
the settings a user runs (glibc's defaults, ORTModule's own session options); it loads the
graph the memory run built from ORTModule's ``cache_dir`` instead of exporting again.
With ``--rounds R`` (default 3) every row is timed R times, in rounds over all rows whose
order alternates, and keeps its fastest: this machine's step times drift by 10-30% over
tens of minutes, and rows timed once each, one after another, carried that drift into
their ratios.

``--masked-prompt F`` sets the labels of the first fraction ``F`` of each row to -100, as
instruction tuning masks the prompt: the export then gathers the valid label rows before
the loss.

Usage: ``python benchmarks/hf_memory.py --real-width [--models gpt2 llama] [--seq 512]
[--steps 4] [--rounds 3] [--masked-prompt F] [--keep-output] [--loss-in-torch] [--only KEY ...]`` (or
this script with the same arguments); ``--loss-in-torch`` runs ``wrapper_split`` and ``torch_ckpt``
alone.  Writes ``hf_memory_real_width[_seq<N>][_masked<P>][_kept][_loss_in_torch].json`` and ``.md`` next to
this script (``_<model>`` added for one model alone, ``_stock`` when run with stock
onnxruntime, where ORTModule builds the gradient with torch); ``--only`` and ``ORTPASS_BENCH_TINY=1`` (the smoke run: 2 layers,
hidden 64, vocab 3000, seq 64) print and record nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the recorded results, apart from the scripts
sys.path.insert(0, str(HERE))
import recompute_memory as rm  # the sibling benchmark's measuring helpers, found through sys.path

BATCH, SEQS = 2, (512, 2048)
GPT2 = {"layers": 12, "hidden": 768, "heads": 12, "vocab": 50257}
LLAMA = {"layers": 4, "hidden": 512, "heads": 8, "vocab": 128256, "mlp": 1376}
TINY = os.environ.get("ORTPASS_BENCH_TINY") == "1"  # the test suite's smoke run
TINY_SEQ = 64
if TINY:
    GPT2 = {"layers": 2, "hidden": 64, "heads": 2, "vocab": 3000}
    LLAMA = {"layers": 2, "hidden": 64, "heads": 2, "vocab": 3000, "mlp": 128}

# The rows --loss-in-torch runs: the loop's own loss against torch's checkpointing (issue #60).
LOSS_IN_TORCH = ("wrapper_split", "torch_ckpt")
# The passes wrapper_unchunked leaves out of the default pipeline (issue #35).
VOCAB_PASSES = ("chunk-lm-head-loss", "scatter-embedding-gradient")
# Losses of the first step agree where they differ by at most this, relatively.
LOSS_RTOL = 1e-4

CONFIGS = [
    # (key, label, kind)
    ("wrapper", "ortpass.ORTModule, default pipeline", "wrapper"),
    ("wrapper_unchunked", "ortpass.ORTModule, without chunk-lm-head-loss and scatter-embedding-gradient", "wrapper"),
    ("wrapper_loss_only", "ortpass.ORTModule over a module that returns the loss only", "wrapper"),
    ("wrapper_logits_last", "ortpass.ORTModule, chunk-lm-head-loss(logits_last=True): the returned logits computed after backward", "wrapper"),
    ("wrapper_split", "ortpass.ORTModule, loss computed in torch from the logits", "wrapper"),
    ("torch_ckpt", "torch + gradient_checkpointing_enable()", "torch"),
    ("torch_ckpt_cce", "torch + checkpointing + Cut Cross-Entropy (torch_compile impl)", "torch"),
]

# Tried on this CPU machine (2 cores, no GPU) with liger-kernel 0.8.5 installed --no-deps
# (torch unchanged), then uninstalled: the import works, the first kernel launch does not.
LIGER_NOTE = (
    "Liger (liger-kernel 0.8.5, `LigerFusedLinearCrossEntropyLoss`) is not a row: its kernels are Triton-only, "
    "and Triton has no CPU backend. It imports on CPU, but a call on CPU tensors fails at the first kernel "
    "launch: `RuntimeError: 0 active drivers ([]). There should only be one.`"
)


# -- pipelines ---------------------------------------------------------------------------------


def remove_pass(spec: str, name: str) -> str:
    """``spec`` without the pass ``name`` (written with or without ``(...)`` options).
    Raises ValueError where ``spec`` does not name it."""
    from ortpass.infra.pipeline_text import parse_pipeline

    specs = parse_pipeline(spec)  # options may hold commas: split where the parser does
    ends = [s.position for s in specs[1:]] + [len(spec)]
    kept = [spec[s.position : end].strip().rstrip(",") for s, end in zip(specs, ends) if s.name != name]
    if len(kept) == len(specs):
        raise ValueError(f"the pipeline has no pass {name!r}: {spec}")
    return ",".join(kept)


def unchunked_pipeline() -> tuple[str, list[str]]:
    """The default pipeline without :data:`VOCAB_PASSES`, and which of them it held."""
    from ortpass.passes import DEFAULT_PIPELINE

    pipeline = DEFAULT_PIPELINE
    for name in VOCAB_PASSES:
        pipeline = remove_pass(pipeline, name)
    return pipeline, list(VOCAB_PASSES)


def logits_last_pipeline() -> str:
    """The default pipeline with ``chunk-lm-head-loss(logits_last=True)``."""
    from ortpass.passes import DEFAULT_PIPELINE

    if "chunk-lm-head-loss," not in DEFAULT_PIPELINE:
        raise ValueError(f"the default pipeline has no plain chunk-lm-head-loss: {DEFAULT_PIPELINE}")
    return DEFAULT_PIPELINE.replace("chunk-lm-head-loss,", "chunk-lm-head-loss(logits_last=True),")


# -- children ----------------------------------------------------------------------------------


def build_model(family: str, seq: int):
    import transformers

    if family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=GPT2["layers"], n_embd=GPT2["hidden"], n_head=GPT2["heads"], vocab_size=GPT2["vocab"],
            n_positions=seq, bos_token_id=0, eos_token_id=0, use_cache=False,
        )
        return transformers.GPT2LMHeadModel(config)
    if family == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=LLAMA["layers"], hidden_size=LLAMA["hidden"], num_attention_heads=LLAMA["heads"],
            num_key_value_heads=LLAMA["heads"], intermediate_size=LLAMA["mlp"], vocab_size=LLAMA["vocab"],
            max_position_embeddings=seq, bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False,
        )
        return transformers.LlamaForCausalLM(config)
    raise ValueError(f"unknown model family {family!r}: gpt2 or llama")


def child_prepare(work: Path, family: str, seq: int, prompt: int = 0) -> dict:
    """Draw the weights and the batch every configuration child loads; the first ``prompt``
    labels of each row are -100 (a masked prompt, as in instruction tuning)."""
    import numpy as np
    import torch

    torch.manual_seed(0)
    model = build_model(family, seq)
    vocab = model.config.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, (BATCH, seq))
    labels = ids.copy()
    labels[:, :prompt] = -100
    np.savez(work / "batch.npz", input_ids=ids, attention_mask=np.ones_like(ids), labels=labels)
    torch.save(model.state_dict(), work / "weights.pt")
    config = model.config
    dropouts = [getattr(config, n, 0.0) or 0.0 for n in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout")]
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "dropout": max(dropouts),
        "versions": {"torch": torch.__version__},
    }


def _load(work: Path, family: str, seq: int):
    """The prepared model (train mode) and batch."""
    import numpy as np
    import torch

    model = build_model(family, seq)
    model.load_state_dict(torch.load(work / "weights.pt"))
    model.train()
    batch = {k: torch.from_numpy(v) for k, v in np.load(work / "batch.npz").items()}
    return model, batch


def _measure(step, steps: int) -> dict:
    """``recompute_memory._measure``, with the warm-up step's duration (export or graph load
    for the wrapper, compilation for CCE) kept as ``warmup_seconds``."""
    durations: list[float] = []

    def timed():
        if durations:
            step()
            return
        start = time.perf_counter()
        step()
        durations.append(time.perf_counter() - start)

    result = rm._measure(timed, steps)
    result["warmup_seconds"] = durations[0]
    return result


def _training_step(model, forward, losses: list[float], keep_output: bool = False):
    """One step of a training loop over ``forward()``, which returns the model's output (a
    Hugging Face output with ``loss``, or the loss itself).  The loop keeps the loss alone
    through ``backward()``, as Hugging Face's Trainer does; with ``keep_output`` it holds the
    whole output (the logits too) until ``backward()`` returns, as
    ``outputs = model(**batch); outputs.loss.backward()`` does."""

    def step():
        for p in model.parameters():
            p.grad = None  # what optimizer.zero_grad() does: the step allocates its gradients
        output = forward()
        loss = getattr(output, "loss", output)
        if not keep_output:
            output = None
        loss.backward()
        losses.append(float(loss))
        del output

    return step


def _sessions_without_arena() -> list[bool]:
    """In the memory run, ORTModule's sessions get ORT's CPU arena and prepacking off (module
    docstring); the timing run keeps ORTModule's own options.  The list grows by one per
    session so opened (the record shows the patch took)."""
    opened: list[bool] = []
    if rm.TIMING_RUN:
        return opened
    from ortpass.runtime import session

    user_options = session.training_options

    def memory_run_options(ort, *, runs_torch: bool):
        options = user_options(ort, runs_torch=runs_torch)
        options.enable_cpu_mem_arena = False
        options.add_session_config_entry("session.disable_prepacking", "1")
        opened.append(True)
        return options

    session.training_options = memory_run_options  # open_session reads the module global
    return opened


def _LossOnly(model):
    """The model behind a module that returns its loss alone: the graph then need not
    return the logits, which Hugging Face's output carries (and ORTModule must compute)."""
    import torch

    class LossOnly(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, labels):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    return LossOnly()


def child_wrapper(work: Path, family: str, seq: int, key: str, steps: int, keep_output: bool = False) -> dict:
    import torch

    import ortpass

    without_arena = _sessions_without_arena()
    model, batch = _load(work, family, seq)
    removed: list[str] = []
    pipeline = None  # ORTModule's default
    if key == "wrapper_unchunked":
        pipeline, removed = unchunked_pipeline()
    if key == "wrapper_loss_only":
        model = _LossOnly(model)
    if key == "wrapper_logits_last":
        pipeline = logits_last_pipeline()
    # One cache per row: the timing run loads the graph the memory run built.
    wrapped = ortpass.ORTModule(model, pipeline=pipeline, cache_dir=work / f"cache_{family}_{key}")
    said = _pass_messages("insert_gather_before_sce_loss", "chunk_lm_head_loss")
    losses: list[float] = []
    forward = lambda: wrapped(**batch)  # noqa: E731
    if key == "wrapper_split":  # the module returns the logits; the loop computes the loss
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        forward = lambda: causal_lm_loss(wrapped(**inputs).logits, batch["labels"])  # noqa: E731
    step = _training_step(wrapped, forward, losses, keep_output)
    torch.manual_seed(0)
    result = _measure(step, steps)
    result.update(loss=losses[0], graph_builds=wrapped.graph_builds, pipeline=wrapped.pipeline,
                  removed_passes=removed, sessions_without_arena=len(without_arena),
                  torch_threads=torch.get_num_threads(), loss_passes_said=said)
    return result


def causal_lm_loss(logits, labels):
    """The loss a loop computes from a causal LM's logits, as transformers' own
    (``ForCausalLMLoss``): the labels shifted left with -100 appended, so that the logits
    are not copied, and the mean cross-entropy over the valid positions."""
    import torch

    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten(), ignore_index=-100)


def _pass_messages(*modules: str) -> list[str]:
    """What the loss passes log while the graph is built (a label gather inserted, a loss
    chunked or skipped and why), kept in the record: which path each row took."""
    import logging

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    for module in modules:
        logger = logging.getLogger(f"ortpass.passes.{module}")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(Keep())
    return said


def child_torch(work: Path, family: str, seq: int, key: str, steps: int, keep_output: bool = False) -> dict:
    if key != "torch_ckpt_cce":
        return _torch_ckpt(work, family, seq, steps, keep_output)
    try:
        return _torch_ckpt_cce(work, family, seq, steps)  # its forward's output is the loss
    except Exception as exc:  # noqa: BLE001  the table shows "not run: <reason>"; the other rows still run
        return {"error": f"{type(exc).__name__}: {exc}"[:800]}


def _torch_ckpt(work: Path, family: str, seq: int, steps: int, keep_output: bool = False) -> dict:
    import torch

    model, batch = _load(work, family, seq)
    model.gradient_checkpointing_enable()
    losses: list[float] = []
    step = _training_step(model, lambda: model(**batch), losses, keep_output)
    torch.manual_seed(0)  # the same dropout draws as the CCE row's first step
    result = _measure(step, steps)
    result.update(loss=losses[0], torch_threads=torch.get_num_threads())
    return result


def _torch_ckpt_cce(work: Path, family: str, seq: int, steps: int) -> dict:
    # A fresh Inductor cache per run, so that the first step's time is a cold compile
    # (the memory run's compile would otherwise warm the timing run's).
    run = "timing" if rm.TIMING_RUN else "memory"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor_{family}_{run}")
    import importlib.metadata

    import torch
    from cut_cross_entropy import linear_cross_entropy

    model, batch = _load(work, family, seq)
    model.gradient_checkpointing_enable()
    base = model.transformer if family == "gpt2" else model.model
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def forward():
        hidden = base(**inputs).last_hidden_state
        # shift=True (a bool in 25.1.1): position i predicts label i + 1, as HF's loss.
        return linear_cross_entropy(hidden, model.lm_head.weight, batch["labels"], shift=True,
                                    impl="torch_compile", reduction="mean")

    torch.manual_seed(0)
    with torch.no_grad():
        hf_loss = float(model(**batch).loss)  # HF's loss on the same weights and dropout draws
    losses: list[float] = []
    step = _training_step(model, forward, losses)
    torch.manual_seed(0)
    result = _measure(step, steps)
    print(f"CCE loss {losses[0]:.6f}, HF loss {hf_loss:.6f}", file=sys.stderr)
    result.update(loss=losses[0], hf_loss=hf_loss, compile_seconds=result["warmup_seconds"],
                  cce_version=importlib.metadata.version("cut-cross-entropy"), torch_threads=torch.get_num_threads())
    return result


# -- the parent (standard library only) --------------------------------------------------------


def _child(*args: str) -> dict:
    return rm._run_child(*args, script=__file__)


def _config(key: str, *args: str) -> dict:
    """``recompute_memory._run_config``: a memory run, then a timing run; a CCE child that
    reports an error (or dies) gives that error instead of failing the benchmark."""
    try:
        memory = _child(*args)
        if "error" in memory:
            return memory
        timing = rm._run_child(*args, script=__file__, timing=True)
        if "error" in timing:
            return timing
    except RuntimeError as exc:
        if key != "torch_ckpt_cce":
            raise
        return {"error": str(exc).strip().splitlines()[-1][:800]}
    times = {k: timing[k] for k in ("step_seconds", "step_seconds_median", "step_seconds_all", "warmup_seconds")}
    extra = {k: timing[k] for k in ("compile_seconds", "graph_builds") if k in timing}
    return {**memory, **times, **{f"timing_run_{k}": v for k, v in extra.items()},
            "memory_run_step_seconds": memory["step_seconds"], "memory_run_warmup_seconds": memory["warmup_seconds"]}


def _versions() -> dict:
    import importlib.metadata

    def version(*distributions: str) -> str | None:
        for name in distributions:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                pass
        return None

    versions = {name: version(name) for name in ("torch", "transformers", "onnxruntime", "cut-cross-entropy")}
    # The training build installs as either name (the CPU wheel is onnxruntime-training-cpu).
    versions["onnxruntime-training"] = version("onnxruntime-training", "onnxruntime-training-cpu")
    return versions


def run(families: list[str], seq: int, steps: int, only: list[str] | None = None, prompt: int = 0,
        rounds: int = 1, keep_output: bool = False) -> dict:
    """Every configuration (or those in ``only``) of each family: a memory run, then
    ``rounds`` timing runs in alternating order (``recompute_memory.more_timing_rounds``)."""
    results: dict = {
        "masked_prompt": prompt,
        "keep_output": keep_output,
        "models": {"gpt2": GPT2, "llama": LLAMA},
        "batch": BATCH,
        "seq": seq,
        "tiny": TINY,
        "cpus": os.cpu_count(),
        "cpu_model": rm.cpu_model(),
        "steps_timed": steps,
        "timing_rounds": rounds,
        "versions": _versions(),
        "load_average_before": os.getloadavg(),
        "families": {},
    }
    for family in families:
        with tempfile.TemporaryDirectory(prefix=f"hf_memory_real_width_{family}_") as tmp:
            work = Path(tmp)
            print(f"[{family}] preparing weights and batch", flush=True)
            entry = {"prepare": _child("prepare", str(work), family, str(seq), str(prompt)), "configs": {}}
            timers = {}
            for key, label, kind in CONFIGS:
                if only and key not in only:
                    continue
                print(f"[{family}] {label}", flush=True)
                args = (kind, str(work), family, str(seq), key, str(steps), *(["keep"] if keep_output else []))
                measured = _config(key, *args)
                entry["configs"][key] = {"label": label, **measured}
                timers[key] = functools.partial(rm._run_child, *args, script=__file__, timing=True)
                print(f"    {_cell(entry['configs'][key])}", flush=True)
            rm.more_timing_rounds(entry["configs"], timers, rounds)
            results["families"][family] = entry
    results["load_average_after"] = os.getloadavg()
    return results


# -- the record --------------------------------------------------------------------------------


def _runtime(results: dict) -> str:
    versions = results["versions"]
    if versions.get("onnxruntime-training"):
        return f"onnxruntime-training {versions['onnxruntime-training']} (ORT's gradient builder)"
    return f"stock onnxruntime {versions.get('onnxruntime')} (the gradient built by torch)"


def _masked(results: dict) -> str:
    prompt = results.get("masked_prompt", 0)
    return f", the first {prompt} of each row -100 (a masked prompt)" if prompt else ""


def _loop(results: dict) -> str:
    if results.get("keep_output"):
        return ("the loop holds the model's output (the logits too) through backward, as "
                "`outputs = model(**batch); outputs.loss.backward()` does")
    return "the loop keeps the loss alone through backward, as Hugging Face's Trainer does"


def _cell(cfg: dict | None) -> str:
    if cfg is None:
        return "not run"
    if "error" in cfg:
        return f"not run: {cfg['error'].replace('|', '/')}"
    return f"{cfg['step_peak_mib']:.0f} / {cfg['step_seconds']:.2f}"


def markdown(results: dict) -> str:
    g, lm = results["models"]["gpt2"], results["models"]["llama"]
    lines = [
        f"# Real-width Hugging Face models: step peak memory and warm step time (seq {results['seq']})",
        "",
        (f"GPT-2: {g['layers']} layers, hidden {g['hidden']}, {g['heads']} heads, vocab {g['vocab']}, dropout 0.1. "
        f"LLaMA: {lm['layers']} layers, hidden {lm['hidden']}, {lm['heads']} heads, MLP {lm['mlp']}, vocab "
        f"{lm['vocab']} (LLaMA-3's). Batch {results['batch']}, seq {results['seq']}, attention_mask of ones, labels = "
        f"input_ids{_masked(results)}; {_runtime(results)}; {_loop(results)}; one training step on CPU ({results['cpus']} cores of {results.get('cpu_model', 'an unrecorded CPU')}), gradients allocated by the step. Step peak "
        "above the RSS after setup and a warm-up step, each configuration in a fresh process (glibc mmap threshold "
        f"64 KiB, ORT's arena off); step time: fastest of {results['steps_timed']} warm steps in another fresh process "
        f"with the settings a user runs, the fastest of {results.get('timing_rounds', 1)} such processes a row, timed "
        "in rounds over every row in alternating order. Load average before/after: "
        f"{results['load_average_before'][0]:.1f} / {results['load_average_after'][0]:.1f}."),
        "",
    ]
    families = list(results["families"])
    lines.append("| configuration | " + " | ".join(f"{f}: peak MiB / step s" for f in families) + " |")
    lines.append("|---|" + "---:|" * len(families))
    ran = {key for f in families for key in results["families"][f]["configs"]}
    for key, label, _ in CONFIGS:
        if key not in ran and (results.get("loss_in_torch") or key == "wrapper_split"):
            continue  # the loss-in-torch record has its rows alone; older records lack wrapper_split
        cells = [_cell(results["families"][f]["configs"].get(key)) for f in families]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    for family in families:
        entry = results["families"][family]
        if results.get("timing_rounds", 1) > 1:
            lines.append(f"{family} step seconds by round: {rm.rounds_text(entry['configs'])}.")
        lines += _goal(family, entry["configs"])
        lines += _losses(family, entry, stock=not results["versions"].get("onnxruntime-training"))
        lines += _notes(family, entry["configs"])
        lines.append("")
    lines.append(LIGER_NOTE)
    return "\n".join(lines)


def _goal(family: str, configs: dict) -> list[str]:
    """Issue #35's goal for the wrapper rows: step peak at most 0.6x torch + checkpointing's,
    step time no worse than it."""
    ckpt = configs.get("torch_ckpt")
    lines = []
    for key in ("wrapper", "wrapper_logits_last", "wrapper_loss_only"):
        ours = configs.get(key)
        if not ours or not ckpt or "error" in ours or "error" in ckpt:
            continue
        peak = ours["step_peak_mib"] / ckpt["step_peak_mib"] if ckpt["step_peak_mib"] else float("inf")
        time_ratio = ours["step_seconds"] / ckpt["step_seconds"]
        verdict = "met" if peak <= 0.6 and time_ratio <= 1.0 else "not met"
        lines.append(
            f"{family}, {key}: goal {verdict} (step peak at most 0.6x torch with checkpointing's, step time no worse "
            f"than it): peak {ours['step_peak_mib']:.0f} MiB = {peak:.2f}x torch+checkpointing's "
            f"{ckpt['step_peak_mib']:.0f}; step time {time_ratio:.2f}x its."
        )
    split = configs.get("wrapper_split")
    if split and ckpt and "error" not in split and "error" not in ckpt:
        # Issue #60's goal: the loss computed in torch at or below torch with checkpointing.
        peak, time_ratio = split["step_peak_mib"], split["step_seconds"] / ckpt["step_seconds"]
        verdict = "met" if peak <= ckpt["step_peak_mib"] and time_ratio <= 1.1 else "not met"
        lines.append(
            f"{family}, wrapper_split: goal {verdict} (step peak at most torch with checkpointing's, step time at "
            f"most 1.1x its): peak {peak:.0f} MiB against {ckpt['step_peak_mib']:.0f}; step time {time_ratio:.2f}x its."
        )
    return lines or [f"{family}: goal not evaluated (needs a wrapper row and the torch_ckpt row)."]


def _losses(family: str, entry: dict, stock: bool = False) -> list[str]:
    """The first step's loss of every row, and whether they agree.  With dropout (GPT-2),
    ORT and torch draw different masks: rows are compared within each runtime.  On stock
    onnxruntime a Dropout's seed does not fix its mask from one graph to another
    (docs/design/torch-builder.md), so there only torch's rows compare."""
    configs = {k: c for k, c in entry["configs"].items() if "loss" in c}
    if not configs:
        return []
    text = ", ".join(f"{k} {c['loss']:.6f}" for k, c in configs.items())
    if "hf_loss" in configs.get("torch_ckpt_cce", {}):
        text += f" (CCE row's HF loss on the same draws: {configs['torch_ckpt_cce']['hf_loss']:.6f})"
    dropout = entry["prepare"]["dropout"] > 0
    # With dropout, only rows that draw the same masks compare: torch's rows (one RNG), and
    # the wrapper's two graphs of one export (fix-dropout-seed gives both the same seeds);
    # the loss-only module is another export, with seeds of its own.
    groups = [["wrapper", "wrapper_unchunked", "wrapper_logits_last"], ["torch_ckpt", "torch_ckpt_cce"]] if dropout else [list(configs)]
    if dropout and stock:
        groups = groups[1:]
    groups = [[k for k in group if k in configs] for group in groups]
    spread = max((_spread([configs[k]["loss"] for k in group]) for group in groups if group), default=0.0)
    verdict = "agree" if spread <= LOSS_RTOL else "DISAGREE"
    within = (" where they draw the same dropout masks (the wrapper's two graphs of one export; torch's rows)"
              if dropout else "")
    if dropout and stock:
        within = (" where they draw the same dropout masks (torch's rows; on stock onnxruntime each of the "
                  "wrapper's graphs draws its own)")
    return [f"{family} first-step losses: {text}; {verdict}{within}, largest relative difference {spread:.1e}."]


def _spread(losses: list[float]) -> float:
    return (max(losses) - min(losses)) / abs(min(losses)) if losses else 0.0


def _notes(family: str, configs: dict) -> list[str]:
    lines = []
    unchunked = configs.get("wrapper_unchunked")
    if unchunked and "error" not in unchunked:
        missing = [p for p in VOCAB_PASSES if p not in unchunked["removed_passes"]]
        if missing:
            lines.append(f"{family}: the default pipeline does not run {', '.join(missing)}; "
                         "the unchunked row leaves out only " + (", ".join(unchunked["removed_passes"]) or "nothing") + ".")
    cce = configs.get("torch_ckpt_cce")
    if cce and "error" not in cce:
        lines.append(f"{family}: CCE's compile (first step, cold Inductor cache): {cce['timing_run_compile_seconds']:.1f} s "
                     f"in the timing run, {cce['compile_seconds']:.1f} s in the memory run.")
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        kind, work, family, seq, *rest = argv[1:]
        path = Path(work)
        if kind == "prepare":
            out = child_prepare(path, family, int(seq), int(rest[0]) if rest else 0)
        elif kind == "wrapper":
            out = child_wrapper(path, family, int(seq), rest[0], int(rest[1]), rest[2:] == ["keep"])
        else:
            out = child_torch(path, family, int(seq), rest[0], int(rest[1]), rest[2:] == ["keep"])
        print(json.dumps(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--seq", type=int, default=512, choices=SEQS)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timing runs a configuration, in rounds over every configuration (default 3)")
    parser.add_argument("--masked-prompt", type=float, default=0.0, metavar="FRACTION",
                        help="labels -100 over this first fraction of each row (an instruction-tuning prompt)")
    parser.add_argument("--keep-output", action="store_true",
                        help="the loop holds the model's output (the logits) through backward, not the loss alone")
    rows = parser.add_mutually_exclusive_group()
    rows.add_argument("--only", nargs="+", choices=[key for key, _, _ in CONFIGS],
                      help="run these configurations only; prints them and records nothing")
    rows.add_argument("--loss-in-torch", action="store_true",
                      help=f"run {' and '.join(LOSS_IN_TORCH)} alone, recorded apart (issue #60)")
    args = parser.parse_args(argv)
    seq = TINY_SEQ if TINY else args.seq
    prompt = int(round(args.masked_prompt * seq))
    only = list(LOSS_IN_TORCH) if args.loss_in_torch else args.only
    results = run(args.models, seq, args.steps, only, prompt, args.rounds, args.keep_output)
    results["loss_in_torch"] = args.loss_in_torch
    if args.only or TINY:  # a partial or smoke run keeps the full run's record
        print(markdown(results))
        return
    stem = "hf_memory_real_width" if seq == 512 else f"hf_memory_real_width_seq{seq}"
    if args.loss_in_torch:
        stem += "_loss_in_torch"
    if prompt:
        stem += f"_masked{round(100 * args.masked_prompt)}"
    if args.keep_output:
        stem += "_kept"
    if results["versions"]["onnxruntime-training"] is None:  # stock onnxruntime: the torch builder
        stem += "_stock"
    if args.models != ["gpt2", "llama"]:
        stem += "_" + "_".join(args.models)
    rm.record(RESULTS / stem, results, markdown(results))


if __name__ == "__main__":
    main()
