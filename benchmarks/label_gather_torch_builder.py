"""Benchmark: the torch builder's label gather (``ortpass.training.label_gather``) on stock
onnxruntime: step peak memory and step time of Hugging Face models whose labels are mostly
ignored, with and without the gather.

Models (configs in code, no hub; dropout 0): ``BertForMaskedLM`` with 15% of the labels
kept (the rest -100, as masked-LM collators give), and ``GPT2LMHeadModel`` with labels
padded (-100) after each row's length, drawn between an eighth and half of the sequence
(about 30% valid after the model's shift).  ``--layers`` layers (default 2), hidden 256, 4
heads, vocabulary ``--vocab`` (default 8192), batch 8, seq 512.

Each model's training graph is built by ``build_training_graph_from_torch`` with
``density_threshold`` 90 (ORTModule's: the loss is gathered) or None (not), then either
the default pipeline's post-grad passes (what ``ORTModule`` runs on stock; among them
``chunk-lm-head-loss``, which reads the gathered rows' hidden states) or none (the gather
alone), and run by a plain session.  torch eager is the reference row.

Memory and time are measured as ``recompute_memory.py`` measures them (its helpers): a
fresh process per configuration for the step peak (highest RSS during a step above the RSS
after setup and a warm-up step, ORT's arena off), another for the step time (the user's
settings; the fastest of ``--steps``).  Step times on this shared machine drift 10-30%;
memory does not.

Run with the stock venv: ``.venv-stock/bin/python benchmarks/label_gather_torch_builder.py
[--models bert gpt2] [--steps 3] [--layers 2] [--vocab 8192]``.  Writes
``results/label_gather_torch_builder.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
import recompute_memory as rm  # noqa: E402  (the sibling benchmark's measuring helpers)

HIDDEN, HEADS, BATCH, SEQ = 256, 4, 8, 512
if os.environ.get("ORTPASS_BENCH_TINY") == "1":  # a smoke run
    HIDDEN, HEADS, BATCH, SEQ = 32, 2, 2, 32

#: (key, label, gather, post-grad passes)
CONFIGS = [
    ("gather_pipeline", "torch builder + default post-grad passes, label gather", True, True),
    ("plain_pipeline", "torch builder + default post-grad passes, no gather", False, True),
    ("gather_alone", "torch builder, no passes, label gather", True, False),
    ("plain_alone", "torch builder, no passes, no gather", False, False),
    ("torch", "torch eager", None, None),
]


def build_model(family: str, layers: int, vocab: int):
    import transformers

    if family == "bert":
        config = transformers.BertConfig(
            vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
            intermediate_size=4 * HIDDEN, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        return transformers.BertForMaskedLM(config)
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_embd=HIDDEN, n_layer=layers, n_head=HEADS, n_positions=SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    raise ValueError(f"unknown model {family!r}: bert or gpt2")


def make_batch(family: str, vocab: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(4, vocab, (BATCH, SEQ))
    if family == "bert":
        keep = rng.random((BATCH, SEQ)) < 0.15
    else:
        lengths = rng.integers(SEQ // 8, SEQ // 2, (BATCH, 1))
        keep = np.arange(SEQ) < lengths
    return {"input_ids": ids, "labels": np.where(keep, ids, -100)}


def _loss_module(model):
    import torch

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, labels):
            return self.model(input_ids=input_ids, labels=labels).loss

    return Loss()


def child_prepare(work: Path, family: str, layers: int, vocab: int) -> dict:
    """Build and save every configuration's graph, the weights and the batch."""
    import numpy as np
    import onnx_ir as ir
    import torch

    import ortpass
    from ortpass.infra.pipeline_text import passes_of_phase
    from ortpass.passes import DEFAULT_PIPELINE
    from ortpass.training.from_torch import build_training_graph_from_torch
    from ortpass.training.label_gather import gathered_losses
    from ortpass.training.split import read_forward_masks

    torch.manual_seed(0)
    model = build_model(family, layers, vocab)
    batch = make_batch(family, vocab)
    np.savez(work / "batch.npz", **batch)
    torch.save(model.state_dict(), work / "weights.pt")
    args = tuple(torch.from_numpy(batch[k]) for k in batch)
    labels = batch["labels"][:, 1:] if family == "gpt2" else batch["labels"]  # GPT-2 shifts them
    info: dict = {"density": float((labels != -100).mean() * 100), "configs": {}}
    for key, _, gather, passes in CONFIGS:
        if gather is None:
            continue
        built = build_training_graph_from_torch(
            _loss_module(model), args, input_names=list(batch), density_threshold=90.0 if gather else None
        )
        record = {"gathered": [g.site for g in gathered_losses(built)], "nodes_built": len(built.graph)}
        if passes:
            result = ortpass.pipeline(passes_of_phase(DEFAULT_PIPELINE, "post-grad"), assume=["training-graph"])(built)
            built = result.model
            chunk = result.report["chunk-lm-head-loss"].stats
            record["chunk-lm-head-loss"] = chunk.get("counts", {})
        read_forward_masks(built, standard_ops=True)
        ir.save(built, work / f"{key}.onnx")
        record["nodes"] = len(built.graph)
        info["configs"][key] = record
    return info


def child_torch(work: Path, family: str, layers: int, vocab: int, steps: int) -> dict:
    import numpy as np
    import torch

    model = build_model(family, layers, vocab)
    model.load_state_dict(torch.load(work / "weights.pt"))
    model.train()
    batch = {k: torch.from_numpy(v) for k, v in np.load(work / "batch.npz").items()}
    return rm.measure_loss_steps(model, batch, steps)


def child_pair(work: Path, keys: list[str], steps: int) -> dict:
    """The step times of two graphs run alternately in one process (the user's settings):
    their ratio drifts less with the machine's load than two processes' times do."""
    import time

    import numpy as np

    C, InferenceSession = rm._load_ort()
    feeds = dict(np.load(work / "batch.npz"))
    sessions = {}
    for key in keys:
        path = work / f"{key}.onnx"
        sessions[key] = InferenceSession(str(path), rm._ort_training_options(C), providers=["CPUExecutionProvider"],
                                         disabled_optimizers=rm._disabled(path))  # fmt: skip
    times: dict[str, list[float]] = {key: [] for key in keys}
    for step in range(steps + 1):  # the first round warms up
        for key, session in sessions.items():
            fetch = [o.name for o in session.get_outputs()]
            start = time.perf_counter()
            session.run(fetch, feeds)
            if step:
                times[key].append(time.perf_counter() - start)
    return {key: min(t) for key, t in times.items()}


def run(families: list[str], steps: int, layers: int, vocab: int) -> dict:
    import onnxruntime

    results: dict = {
        "machine": {"cpu": rm.cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "onnxruntime": onnxruntime.__version__,
        "sizes": {"layers": layers, "hidden": HIDDEN, "heads": HEADS, "vocab": vocab, "batch": BATCH, "seq": SEQ},
        "steps": steps,
        "models": {},
    }
    for family in families:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            print(f"{family}: building the graphs", flush=True)
            info = rm._run_child("prepare", str(work), family, str(layers), str(vocab), script=__file__)
            rows = {}
            for key, label, gather, _ in CONFIGS:
                print(f"  {label}", flush=True)
                if gather is None:
                    measured = rm._run_config("torch", str(work), family, str(layers), str(vocab), str(steps), script=__file__)
                else:
                    measured = rm._run_config("ort", str(work), key, str(steps), script=__file__)
                measured.update(label=label, **info["configs"].get(key, {}))
                rows[key] = measured
                print(f"    step peak {measured['step_peak_mib']:.0f} MiB, step {measured['step_seconds']:.2f} s, "
                      f"loss {measured['loss']:.4f}", flush=True)  # fmt: skip
            pairs = {}
            for passes in ("pipeline", "alone"):
                keys = [f"gather_{passes}", f"plain_{passes}"]
                pairs[passes] = rm._run_child("pair", str(work), *keys, str(steps), script=__file__, timing=True)
                print(f"  {passes}, alternating: " + ", ".join(f"{k} {t:.2f} s" for k, t in pairs[passes].items()), flush=True)
            results["models"][family] = {"label_density": info["density"], "rows": rows, "alternating": pairs}
    return results


def markdown(results: dict) -> str:
    s = results["sizes"]
    lines = [
        "# The torch builder's label gather on stock onnxruntime",
        "",
        f"One training step, onnxruntime {results['onnxruntime']}, {results['machine']['cpus']} cores of "
        f"{results['machine']['cpu']}: {s['layers']} layers, hidden {s['hidden']}, vocabulary {s['vocab']}, "
        f"batch {s['batch']} x seq {s['seq']}.  Step peak: highest RSS during a step above the RSS after "
        f"setup and a warm-up step (ORT's arena off); step time: fastest of {results['steps']} in a second "
        "process with the user's settings (noisy on this shared machine, 10-30%; memory is stable).  "
        "Written by `benchmarks/label_gather_torch_builder.py`.",
        "",
    ]
    for family, model in results["models"].items():
        rows = model["rows"]
        lines += [f"## {family} (label density {model['label_density']:.1f}%)", "",
                  "| configuration | step peak MiB | step s | loss | gathered | chunk-lm-head-loss |",
                  "|---|---:|---:|---:|---|---|"]  # fmt: skip
        for key, row in rows.items():
            lines.append(
                f"| {row['label']} | {row['step_peak_mib']:.0f} | {row['step_seconds']:.2f} | {row['loss']:.4f} | "
                f"{', '.join(row.get('gathered', [])) or '-'} | {row.get('chunk-lm-head-loss', '-') or '-'} |"
            )
        for with_passes in ("pipeline", "alone"):
            gathered, plain = rows.get(f"gather_{with_passes}"), rows.get(f"plain_{with_passes}")
            pair = model.get("alternating", {}).get(with_passes)
            if gathered and plain:
                text = (
                    f"\n{with_passes}: the gather's peak {gathered['step_peak_mib']:.0f} against "
                    f"{plain['step_peak_mib']:.0f} MiB ({gathered['step_peak_mib'] / max(plain['step_peak_mib'], 1e-9):.2f}x), "
                    f"step {gathered['step_seconds'] / plain['step_seconds']:.2f}x the time"
                )
                if pair:
                    g, p = pair[f"gather_{with_passes}"], pair[f"plain_{with_passes}"]
                    text += f"; run alternately in one process {g:.2f} against {p:.2f} s ({g / p:.2f}x)"
                lines.append(text + ".")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        kind, rest = argv[1], argv[2:]
        if kind == "prepare":
            out = child_prepare(Path(rest[0]), rest[1], int(rest[2]), int(rest[3]))
        elif kind == "pair":
            out = child_pair(Path(rest[0]), rest[1:3], int(rest[3]))
        elif kind == "torch":
            out = child_torch(Path(rest[0]), rest[1], int(rest[2]), int(rest[3]), int(rest[4]))
        else:
            out = rm.child_ort(Path(rest[0]), rest[1], int(rest[2]))
        print(json.dumps(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["bert", "gpt2"], choices=["bert", "gpt2"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=RESULTS / "label_gather_torch_builder")
    args = parser.parse_args(argv)
    results = run(args.models, args.steps, args.layers, args.vocab)
    rm.record(args.out, results, markdown(results))


if __name__ == "__main__":
    main()
