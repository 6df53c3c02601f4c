"""Step peak memory and step time on Hugging Face GPT-2 and LLaMA: ortpass's default
pipeline, with and without fused attention, against ORT without recompute, ORT 1.19.2's
C++ memory optimizer at level 1, torch eager, and torch eager with transformers'
``gradient_checkpointing_enable()``.

Models: ``GPT2LMHeadModel`` and ``LlamaForCausalLM`` from configs in code (no hub): 4
layers, hidden 256, 4 heads, vocab 2048, batch 8, seq 512 (``--seq 2048`` for the long
sequence, where attention dominates), ``attention_mask`` of ones, the configs' own dropout
(GPT-2: 0.1 on embeddings, residuals and attention; LLaMA: none); LLaMA's MLP is 1024 wide.
Exported with static shapes.

Memory is measured as ``recompute_memory.py`` measures it (its helpers are used here): a
fresh process per configuration started from a parent that imports only the standard
library, glibc ``MALLOC_MMAP_THRESHOLD_=65536``, ORT's CPU arena off, step peak = highest
RSS during a step above the RSS after setup and a warm-up step.  The ORT children import no
torch, except the fused-attention one, whose PythonOps run torch's kernel through ortpass's
bridge (its RSS after setup includes torch; the step peak does not).

Step time comes from a second fresh process per configuration, with the settings a user
runs: glibc's defaults, and for ORT ``TrainingSession``'s session options (arena and
prepacking on; ORT's threads do not spin where PythonOps run torch).  The memory run's
settings make every tensor an ``mmap``, which slows ORT far more than torch (LLaMA without
recompute: 2.48 s against 1.14 s; docs/design/ort-facts.md); its time is kept in the JSON
as ``memory_run_step_seconds``.

The torch-builder rows (issue #33) build the training graph from torch's autograd
(``build_training_graph_from_torch``) and run the default pipeline's post-grad passes;
the stock row runs that graph in a child of ``--stock-python``, an environment holding
stock ``onnxruntime`` (the README's ``.venv-stock``), with its recomputed Dropouts reading
the forward masks as sessions do there.  The last ortpass row is ``ortpass.ORTModule`` in that
environment, as a user runs it: the graph built at the first step with every input dim
dynamic (the static rows' graphs have the benchmark's sizes fixed).

Every row is timed ``--rounds`` times (default 3), in rounds over all rows whose order
alternates, and keeps its fastest (``recompute_memory.more_timing_rounds``: this machine's
step times drift by 10-30% over tens of minutes).

Usage: ``python benchmarks/hf_memory.py [--models gpt2 llama] [--seq 512] [--steps 6]
[--rounds 3] [--stock-python .venv-stock/bin/python]``.
Writes ``hf_memory[_seq<N>].json`` and ``.md`` next to this script (``_<model>`` added for
one model alone).

``--real-width [--seq 512|2048] [--models gpt2 llama] [--steps N] [--keep-output] [--only KEY ...]`` runs
``hf_memory_real_width.py`` instead: GPT-2 small and a LLaMA with LLaMA-3's vocabulary at
real width, ORTModule against torch + checkpointing and Cut Cross-Entropy (issue #35).
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
import recompute_memory as rm  # noqa: E402  (the sibling benchmark's measuring helpers)

LAYERS, HIDDEN, HEADS, VOCAB, BATCH, LLAMA_MLP = 4, 256, 4, 2048, 8, 1024
if os.environ.get("ORTPASS_BENCH_TINY") == "1":  # the test suite's smoke run
    LAYERS, HIDDEN, HEADS, VOCAB, BATCH, LLAMA_MLP = 2, 32, 2, 64, 2, 64

CONFIGS = [
    # (key, label, kind)
    ("ort", "ORT, no recompute", "ort"),
    ("ortpass", "ortpass default pipeline", "ort"),
    ("ortpass_fused", "ortpass default pipeline, fused attention", "ort-bridge"),
    ("ort_cpp", "ORT C++ path, no recompute", "ort-cpp"),
    ("ort_cpp_l1", "ORT 1.19.2 C++ memory optimizer, level 1", "ort-cpp"),
    ("torch_builder", "ortpass, torch builder (training build)", "ort"),
    ("torch_builder_stock", "ortpass, torch builder, stock onnxruntime", "ort-stock"),
    ("wrapper_stock", "ortpass.ORTModule (dynamic dims), stock onnxruntime", "wrapper-stock"),
    ("wrapper_stock_fused", "ortpass.ORTModule (dynamic dims), fused_attention=True, stock onnxruntime",
     "wrapper-stock"),
    ("wrapper_stock_budget", "ortpass.ORTModule (dynamic dims), memory_budget='{budget}', stock onnxruntime",
     "wrapper-stock"),
    ("wrapper_split", "ortpass.ORTModule, loss computed in torch from the logits", "wrapper"),
    ("wrapper_split_stock", "ortpass.ORTModule, loss computed in torch from the logits, stock onnxruntime",
     "wrapper-stock"),
    ("torch", "torch eager (SDPA)", "torch"),
    ("torch_ckpt", "torch eager + gradient_checkpointing_enable()", "torch"),
    ("torch_sac", "torch eager + selective activation checkpointing (matmuls and attention kept)", "torch"),
]


#: ``wrapper_stock_budget``'s memory budget: the step peak ORTModule's planner aims at (in its
#: prediction's terms, which count more than the measured peak above the RSS after setup:
#: 142.5 MiB predicted where 123 were measured, LLaMA's default row on 2026-11-30).  150 MiB:
#: in one process beside torch with checkpointing, budgets of 150-180 MiB ran LLaMA's step
#: 2-4% faster than it and 7-9% faster than the default (fastest of seven rounds; 140 MiB:
#: 105 MiB measured, the default's time; ``docs/performance.md``).
#: GPT-2's default row is already faster than torch with checkpointing: no budget row.
WRAPPER_BUDGET = {"llama": "150MiB"}


def build_model(family: str, seq: int):
    import transformers

    if family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=seq,
            bos_token_id=0, eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(config)
    if family == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
            intermediate_size=LLAMA_MLP, vocab_size=VOCAB, max_position_embeddings=seq,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )
        return transformers.LlamaForCausalLM(config)
    raise ValueError(f"unknown model family {family!r}: gpt2 or llama")


def _loss_module(model):
    import torch

    class CausalLMLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, labels):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    return CausalLMLoss()


def child_prepare(work: Path, family: str, seq: int) -> dict:
    """Export (plain and fused attention), run the default pipeline, save every graph."""
    import numpy as np
    import onnx_ir as ir
    import torch

    import ortpass
    from ortpass.passes import DEFAULT_PIPELINE
    from ortpass.export import export
    from ortpass.training import build_training_graph

    torch.manual_seed(0)
    model = build_model(family, seq)
    ids = np.random.default_rng(0).integers(0, VOCAB, (BATCH, seq))
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids}
    np.savez(work / "batch.npz", **batch)
    torch.save(model.state_dict(), work / "weights.pt")
    args = tuple(torch.from_numpy(batch[k]) for k in batch)
    info: dict = {"nodes": {}, "recompute": {}}
    forward = export(_loss_module(model), args, input_names=list(batch))
    training = build_training_graph(forward)
    ir.save(training, work / "ort.onnx")
    info["nodes"]["ort"] = len(training.graph)
    rm._save_ort_module_graph(training, work)
    # ORTModule's default, fused_attention="auto", fuses the attention calls without dropout
    # and the large ones with it: the run records which of the two rows below that default is.
    auto = export(_loss_module(model), args, input_names=list(batch), fused_attention="auto")
    info["auto_fuses"] = any(node.op_type == "PythonOp" for node in auto.graph)
    _prepare_torch_builder(work, model, args, list(batch), info)
    for key, fused in (("ortpass", False), ("ortpass_fused", True)):
        source = forward if not fused else export(_loss_module(model), args, input_names=list(batch), fused_attention=True)
        result = ortpass.pipeline(DEFAULT_PIPELINE)(source)
        ir.save(result.model, work / f"{key}.onnx")
        info["nodes"][key] = len(result.model.graph)
        info["recompute"][key] = result.report["recompute"].stats.get("counts", {})
    return info


def _prepare_torch_builder(work: Path, model, args: tuple, names: list[str], info: dict) -> None:
    """The graph stock onnxruntime runs: built from torch's autograd, then the default
    pipeline's post-grad passes; saved as run on the training build and as on stock (where
    recomputed Dropouts read the forward masks, ``masks_read_where_redraws_differ``)."""
    import onnx_ir as ir

    import ortpass
    from ortpass.infra.pipeline_text import passes_of_phase
    from ortpass.passes import DEFAULT_PIPELINE
    from ortpass.training.from_torch import build_training_graph_from_torch
    from ortpass.training.split import read_forward_masks

    built = build_training_graph_from_torch(_loss_module(model), args, input_names=names)
    result = ortpass.pipeline(passes_of_phase(DEFAULT_PIPELINE, "post-grad"), assume=["training-graph"])(built)
    ir.save(result.model, work / "torch_builder.onnx")
    info["nodes"]["torch_builder"] = len(result.model.graph)
    info["recompute"]["torch_builder"] = result.report["recompute"].stats.get("counts", {})
    read_forward_masks(result.model, standard_ops=True)
    ir.save(result.model, work / "torch_builder_stock.onnx")


def child_torch(work: Path, family: str, seq: int, key: str, steps: int) -> dict:
    import numpy as np
    import torch

    model = build_model(family, seq)
    model.load_state_dict(torch.load(work / "weights.pt"))
    if key == "torch_ckpt":
        model.gradient_checkpointing_enable()
    elif key == "torch_sac":
        from selective_checkpointing import enable_selective_checkpointing

        enable_selective_checkpointing(model)
    model.train()
    batch = {k: torch.from_numpy(v) for k, v in np.load(work / "batch.npz").items()}
    return rm.measure_loss_steps(model, batch, steps)


def child_wrapper(work: Path, family: str, seq: int, steps: int, loss: str = "module", fused: bool = False,
                  budget: str | None = None) -> dict:
    """``ortpass.ORTModule`` as a user runs it: the graph built at the first step with every
    input dim dynamic, its default pipeline (on stock onnxruntime: the torch builder); over
    the loss module (``loss="module"``), or over the model with the loss computed in torch
    from its logits (``loss="torch"``: forward and backward run apart).  The memory run's sessions get the arena off, as the
    other rows' (``hf_memory_real_width._sessions_without_arena``); the timing run loads the
    graph the memory run built from the shared ``cache_dir``.  ``fused``: ``fused_attention=True``
    (on stock, attention as one Python op running torch's kernel).  ``budget``: ``memory_budget``
    (recompute planned for that step peak at the least added time, instead of every layer)."""
    import numpy as np
    import torch

    import ortpass
    from hf_memory_real_width import _sessions_without_arena, _training_step

    without_arena = _sessions_without_arena()
    model = build_model(family, seq)
    model.load_state_dict(torch.load(work / "weights.pt"))
    model.config.use_cache = False  # ORTModule returns tensors only
    model.train()
    batch = {k: torch.from_numpy(v) for k, v in np.load(work / "batch.npz").items()}
    if loss == "torch":
        wrapped = ortpass.ORTModule(model, cache_dir=work / f"cache_{family}_split")

        def forward():
            logits = wrapped(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            # The logits shifted, as transformers' loss did before it shifted the labels: a copy
            # of the logits that torch_ckpt's in-model loss does not make (the rows were recorded
            # with it; hf_memory_real_width.causal_lm_loss shifts the labels instead).
            shifted = logits[:, :-1].flatten(0, 1).float()
            return torch.nn.functional.cross_entropy(shifted, batch["labels"][:, 1:].flatten())
    else:
        variant = "_fused" if fused else ("_budget" if budget else "")
        wrapped = ortpass.ORTModule(_loss_module(model), cache_dir=work / f"cache_{family}{variant}",
                                    fused_attention=True if fused else "auto", memory_budget=budget)

        def forward():
            return wrapped(**batch)

    losses: list[float] = []
    torch.manual_seed(0)
    result = rm._measure(_training_step(wrapped, forward, losses), steps)
    result.update(loss=losses[0], graph_builds=wrapped.graph_builds, sessions_without_arena=len(without_arena),
                  torch_imported=True, memory_budget=budget)
    return result


def run(families: list[str], seq: int, steps: int, only: list[str] | None = None, stock_python: str | None = None,
        rounds: int = 1) -> dict:
    """Measure every configuration; the stock rows only with ``stock_python`` (a Python whose
    environment holds stock onnxruntime and ortpass).  Each row's step time is its fastest
    of ``rounds`` timing runs, in rounds of alternating order (``recompute_memory.more_timing_rounds``)."""
    results: dict = {
        "model": {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "vocab": VOCAB, "batch": BATCH, "seq": seq,
                  "llama_mlp": LLAMA_MLP},
        "cpus": os.cpu_count(),
        "cpu_model": rm.cpu_model(),
        "steps_timed": steps,
        "timing_rounds": rounds,
        "load_average_before": os.getloadavg(),
        "families": {},
        "stock_onnxruntime": _child_version(stock_python) if stock_python else None,
    }
    for family in families:
        with tempfile.TemporaryDirectory(prefix=f"hf_memory_{family}_") as tmp:
            work = Path(tmp)
            print(f"[{family}] preparing graphs", flush=True)
            entry = {"prepare": _child("prepare", str(work), family, str(seq))}
            if not only or "ort_cpp_l1" in only:
                entry["ort_cpp_plans"] = _child("ort-plans", str(work))
            entry["configs"] = {}
            timers = {}
            for key, label, kind in CONFIGS:
                if (only and key not in only) or (kind.endswith("-stock") and not stock_python):
                    continue
                budget = WRAPPER_BUDGET.get(family, "") if key.endswith("_budget") else ""
                if key.endswith("_budget") and not budget:
                    continue
                label = label.format(budget=budget)  # the budget row's label names its budget
                print(f"[{family}] {label}", flush=True)
                python = stock_python if kind.endswith("-stock") else None
                if kind == "ort-cpp":
                    args = ("ort-cpp", str(work), str(steps), str(int(key == "ort_cpp_l1")))
                elif kind == "ort-stock":
                    args = ("ort", str(work), key, str(steps), "0")
                elif kind.startswith("wrapper"):
                    loss = "torch" if key.startswith("wrapper_split") else "module"
                    args = ("wrapper", str(work), family, str(seq), str(steps), loss, str(int(key.endswith("_fused"))), budget)
                elif kind.startswith("ort"):
                    args = ("ort", str(work), key, str(steps), str(int(kind == "ort-bridge")))
                else:
                    args = ("torch", str(work), family, str(seq), key, str(steps))
                measured = _config(*args, python=python)
                timers[key] = functools.partial(rm._run_child, *args, script=__file__, timing=True, python=python)
                if kind in ("ort", "ort-cpp", "ort-stock") and measured["torch_imported"]:
                    raise RuntimeError(f"{key}: torch was imported in the ORT child; the memory would be wrong")
                entry["configs"][key] = {"label": label, **measured}
                print(f"    step peak {measured['step_peak_mib']:.0f} MiB, step {measured['step_seconds']:.2f} s", flush=True)
            rm.more_timing_rounds(entry["configs"], timers, rounds)
            results["families"][family] = entry
    results["load_average_after"] = os.getloadavg()
    return results


def _child(*args: str) -> dict:
    return rm._run_child(*args, script=__file__)


def _config(*args: str, python: str | None = None) -> dict:
    return rm._run_config(*args, script=__file__, python=python)


def _child_version(python: str) -> str:
    """The onnxruntime version ``python`` imports (the stock rows' runtime)."""
    import subprocess

    code = "import onnxruntime; print(onnxruntime.__version__)"  # either package's distribution name
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def markdown(results: dict) -> str:
    m = results["model"]
    lines = [
        f"# Hugging Face models: step peak memory and warm step time (seq {m['seq']})",
        "",
        f"{m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, vocab {m['vocab']}, batch {m['batch']}, "
        f"seq {m['seq']} (LLaMA MLP {m['llama_mlp']}); attention_mask of ones; one training step on CPU "
        f"({results['cpus']} cores of {results.get('cpu_model', 'an unrecorded CPU')}). Step peak above the RSS after setup and a warm-up step, each configuration "
        f"in a fresh process; step time: fastest of {results['steps_timed']} warm steps in another fresh process "
        "with the settings a user runs (no mmap threshold; ORT with TrainingSession's options), the fastest of "
        f"{results.get('timing_rounds', 1)} such processes a row, timed in rounds over every row in alternating order. "
        "Load average before/after: "
        f"{results['load_average_before'][0]:.1f} / {results['load_average_after'][0]:.1f}.",
        "",
    ]
    for run, update in enumerate(results.get("updates", []), start=1):
        lines += [f"Run {run}, on {update['date']}: rows {', '.join(update['rows'])} alone "
                  f"({update['timing_rounds']} timing rounds; load average before/after "
                  f"{update['load_average_before'][0]:.1f} / {update['load_average_after'][0]:.1f}); their rows say "
                  f"\"(run {run})\", and their times compare only with each other.", ""]
    families = list(results["families"])
    lines.append("| configuration | " + " | ".join(f"{f}: peak MiB / step s" for f in families) + " |")
    lines.append("|---|" + "---:|" * len(families))
    for key, label in _rows(results):
        cells = []
        for family in families:
            cfg = results["families"][family]["configs"].get(key)
            cells.append(f"{cfg['step_peak_mib']:.0f} / {cfg['step_seconds']:.2f}" if cfg else "not run")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    for family in families:
        entry = results["families"][family]
        default = "ortpass_fused" if entry["prepare"].get("auto_fuses") else "ortpass"
        lines.append(f"{family}: ORTModule's default (fused_attention='auto') is the row "
                     f"\"{entry['configs'][default]['label']}\".")
        if results.get("timing_rounds", 1) > 1:
            lines.append(f"{family} step seconds by round: {rm.rounds_text(entry['configs'])}.")
        lines += _goal(family, entry["configs"])
        for key, counts in entry["prepare"]["recompute"].items():
            lines.append(f"{family} {key}: recompute {dict(counts)}")
        lines.append(f"{family} ORT C++ level-1 plans: {len(entry['ort_cpp_plans']['plans'])}")
        lines.append("")
    return "\n".join(lines)


def _rows(results: dict) -> list[tuple[str, str]]:
    """(key, label) of every row, in CONFIGS' order, each row of a later run after its key's."""
    configs = [entry["configs"] for entry in results["families"].values()]
    keys = {k for c in configs for k in c}
    rows = []
    for key, label, _ in CONFIGS:
        run = next((c[key]["run"] for c in configs if key in c and c[key].get("run")), None)
        # As measured (a budget row's label names its budget); a row not run, the budgets in use.
        label = next((c[key]["label"] for c in configs if key in c), label.format(budget=", ".join(WRAPPER_BUDGET.values())))
        rows.append((key, f"{label} (run {run})" if run else label))
        rows += [(k, f"{next(c[k]['label'] for c in configs if k in c)} (run {k.split('@')[1]})")
                 for k in sorted(keys) if k.startswith(f"{key}@")]
    return rows


def _goal(family: str, configs: dict) -> list[str]:
    """The real-model memory goal: peak at or below torch + checkpointing and below ORT C++
    level 1, step time at most 1.2x torch + checkpointing's."""
    cpp = configs["ort_cpp_l1"]
    lines = []
    ours_keys = ("ortpass", "ortpass_fused", "torch_builder", "torch_builder_stock", "wrapper_stock",
                 "wrapper_stock_fused", "wrapper_stock_budget", "wrapper_split", "wrapper_split_stock")
    for key in [k for base in ours_keys for k in configs if k.split("@")[0] == base]:
        ours = configs[key]
        run = ours.get("run", 0)  # torch + checkpointing measured in the same run
        ckpt = next(c for k, c in configs.items() if k.split("@")[0] == "torch_ckpt" and c.get("run", 0) == run)
        peak_ok = ours["step_peak_mib"] <= ckpt["step_peak_mib"] and ours["step_peak_mib"] < cpp["step_peak_mib"]
        ratio = ours["step_seconds"] / ckpt["step_seconds"]
        verdict = "met" if peak_ok and ratio <= 1.2 else "not met"
        run_text = f" (run {ours['run']})" if ours.get("run") else ""
        lines.append(
            f"{family}, {ours['label']}{run_text}: goal {verdict} (peak {ours['step_peak_mib']:.0f} MiB vs torch+checkpointing "
            f"{ckpt['step_peak_mib']:.0f} and ORT C++ L1 {cpp['step_peak_mib']:.0f}; step time {ratio:.2f}x "
            "torch+checkpointing's)."
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        kind, work, *rest = argv[1:]
        path = Path(work)
        if kind == "prepare":
            out = child_prepare(path, rest[0], int(rest[1]))
        elif kind == "ort-plans":
            out = rm.child_ort_plans(path)
        elif kind == "ort":
            out = rm.child_ort(path, rest[0], int(rest[1]), bridge=rest[2] == "1")
        elif kind == "ort-cpp":
            out = rm.child_ort_cpp(path, int(rest[0]), recompute=rest[1] == "1")
        elif kind == "wrapper":
            out = child_wrapper(path, rest[0], int(rest[1]), int(rest[2]), rest[3], rest[4] == "1", rest[5] or None)
        else:
            out = child_torch(path, rest[0], int(rest[1]), rest[2], int(rest[3]))
        print(json.dumps(out))
        return
    if "--real-width" in argv:  # its own script, arguments and record (module docstring)
        import hf_memory_real_width

        hf_memory_real_width.main([a for a in argv if a != "--real-width"])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timing runs a configuration, in rounds over every configuration (default 3)")
    parser.add_argument("--stock-python", default=str(HERE.parent / ".venv-stock" / "bin" / "python"),
                        help="a Python whose environment holds stock onnxruntime and ortpass, for the stock rows "
                        "(default: the README's .venv-stock; rows skipped when it does not exist)")
    parser.add_argument("--only", nargs="+", choices=[key for key, _, _ in CONFIGS],
                        help="run these configurations only; prints them and records nothing")
    parser.add_argument("--update-record", action="store_true",
                        help="with --only: put these rows into the existing record, each marked with its run")
    args = parser.parse_args(argv)
    stock_python = args.stock_python if Path(args.stock_python).exists() else None
    results = run(args.models, args.seq, args.steps, args.only, stock_python, args.rounds)
    stem = "hf_memory" if args.seq == 512 else f"hf_memory_seq{args.seq}"
    if args.models != ["gpt2", "llama"]:  # a subset keeps the full run's record
        stem += "_" + "_".join(args.models)
    if args.only and args.update_record:
        results = _merged_into_record(RESULTS / f"{stem}.json", results, args.only)
    elif args.only:
        return
    rm.record(RESULTS / stem, results, markdown(results))


def _merged_into_record(path: Path, update: dict, keys: list[str]) -> dict:
    """The record at ``path`` with ``keys``' rows of ``update`` added, each marked with its
    run (``run``: 1 for the first update); a row the record has already is kept, and the new
    one added beside it as ``<key>@<run>``, so that a row's time is compared only with rows
    of its own run.  The update's date and load are kept in ``updates``."""
    record = json.loads(path.read_text())
    if record["model"] != update["model"]:
        raise SystemExit(f"{path} was measured on another model ({record['model']}); run every row instead")
    run = len(record.get("updates", [])) + 1
    for family, entry in update["families"].items():
        configs = record["families"][family]["configs"]
        for key, measured in entry["configs"].items():
            if key in keys:
                configs[key if key not in configs else f"{key}@{run}"] = {**measured, "run": run}
    record.setdefault("updates", []).append({
        "rows": keys, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "timing_rounds": update["timing_rounds"],
        "load_average_before": update["load_average_before"], "load_average_after": update["load_average_after"],
    })  # fmt: skip
    return record


if __name__ == "__main__":
    main()
