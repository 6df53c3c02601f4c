"""Training with ``ortpass.ORTModule`` against a bare ``TrainingSession`` loop and torch eager.

Model: Hugging Face GPT-2 (``GPT2LMHeadModel``), 4 layers, hidden 256, 4 heads, vocab 2048,
GPT-2's dropout 0.1; batch 8, seq 512; every configuration's forward returns the loss
only (``CausalLMLoss``), so no configuration returns logits.

Configurations, each in a fresh process:

- ``wrapper``: ``ORTModule(model)`` with the default pipeline (recompute level 1 ...);
  a step is ``model(ids, labels).backward()``, gradients into ``.grad``: one graph
  computes forward and backward in forward (the loss step);
- ``wrapper_split``: the same with ``differentiate="outputs"``: forward and backward
  run apart, the loss's gradient fed to backward (the split step), as a loop that
  computes its loss outside the module runs;
- ``wrapper_logits``: that loop: ``ORTModule(GPT2LMHeadModel)`` returns the logits and
  the loss is ``F.cross_entropy`` in torch;
- ``session``: the same export and pipeline run by hand: ``TrainingSession.run`` on the
  batch, numpy gradients (what ortpass offered before the wrapper); ``session_dynamic``
  the same with every input dim dynamic, as the wrapper exports;
- ``torch`` and ``torch_ckpt``: torch eager, without and with transformers' gradient
  checkpointing (``gradient_checkpointing_enable()``);
- ``lora_frozen`` and ``lora_full``: the wrapper on GPT-2 with rank-8 adapters on every
  projection, its base frozen, and the same model with everything trainable.

Memory is measured as ``benchmarks/recompute_memory.py`` does, with its helpers: a fresh
process per configuration started by a parent that imports only the standard library,
``MALLOC_MMAP_THRESHOLD_=65536``, step peak = the peak RSS during one step above the RSS
after setup and a warm-up step; ``.grad`` is set to None before every step so each step
allocates its gradients.  ORT's CPU arena is off in the ORT configurations (as there: else
the RSS after the warm-up step already holds the step's peak); the ORT sessions are
ortpass's own, so the benchmark turns the arena off through ``onnxruntime.SessionOptions``.
Step time: the fastest of ``--steps`` warm steps (the machine is shared; other work only
adds time).

Usage: ``python benchmarks/train_wrapper.py [--steps 5]``; writes ``train_wrapper.json``
and ``train_wrapper.md`` next to this script.  ``ORTPASS_BENCH_TINY=1`` runs a tiny model
(the test suite's smoke run); ``ORTPASS_BENCH_PIPELINE=SPEC`` runs the wrapper
configurations with another pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the recorded results, apart from the scripts
sys.path.insert(0, str(HERE))
from recompute_memory import _measure  # noqa: E402  (the standard library only at import)

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH, LORA_RANK = 4, 256, 4, 2048, 512, 8, 8
if os.environ.get("ORTPASS_BENCH_TINY") == "1":
    LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH, LORA_RANK = 2, 32, 4, 64, 16, 2, 2

CONFIGS = [
    ("wrapper", "ORTModule, default pipeline"),
    ("wrapper_split", "ORTModule, forward and backward apart (differentiate='outputs')"),
    ("wrapper_logits", "ORTModule returning logits, loss in torch"),
    ("session", "bare TrainingSession loop, default pipeline"),
    ("session_dynamic", "bare TrainingSession loop, every input dim dynamic (as the wrapper exports)"),
    ("torch", "torch eager"),
    ("torch_ckpt", "torch eager + gradient checkpointing"),
    ("lora_frozen", "ORTModule, LoRA adapters, base frozen"),
    ("lora_full", "ORTModule, LoRA adapters, everything trainable"),
]


# -- children ---------------------------------------------------------------------------------


def _model(lora: bool):
    import torch
    import transformers

    from ortpass.testing.models import CausalLMLoss, add_low_rank_adapters

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    if lora:
        add_low_rank_adapters(model, LORA_RANK)
    return CausalLMLoss(model).train()


def _logits_loss(model):
    """``F.cross_entropy`` in torch over the logits ``model(input_ids=ids)`` returns."""
    import torch
    import torch.nn.functional as F

    class LogitsLoss(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids, labels):
            logits = self.model(input_ids=ids, use_cache=False).logits
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return LogitsLoss(model)


def _batch():
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids, ids.roll(-1, 1)


def _arena_off() -> None:
    import onnxruntime

    class Options(onnxruntime.SessionOptions):
        def __init__(self):
            super().__init__()
            self.enable_cpu_mem_arena = False

    onnxruntime.SessionOptions = Options


def child(key: str, steps: int) -> dict:
    import torch

    from ortpass.passes import DEFAULT_PIPELINE

    model = _model(lora=key.startswith("lora"))
    ids, labels = _batch()
    if key == "lora_frozen":
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith((".a", ".b")))
    losses: list[float] = []
    setup_start = time.perf_counter()
    if key.startswith("session"):
        import ortpass
        from ortpass.export import export
        from ortpass.runtime import TrainingSession

        _arena_off()
        names = ["input_ids", "labels"]
        dynamic = {name: {0: f"{name}_dim0", 1: f"{name}_dim1"} for name in names} if key == "session_dynamic" else None
        forward = export(model, (ids, labels), input_names=names, dynamic_axes=dynamic)
        session = TrainingSession(ortpass.pipeline(DEFAULT_PIPELINE)(forward).model)
        feeds = {"input_ids": ids.numpy(), "labels": labels.numpy()}

        def step():
            result = session.run(feeds)
            losses.append(result.loss)

    else:
        if key == "torch_ckpt":
            model.model.gradient_checkpointing_enable()
        if key == "wrapper_logits":
            model = _logits_loss(model.model)
        if key.startswith("wrapper") or key.startswith("lora"):
            from ortpass import ORTModule

            _arena_off()
            pipeline = os.environ.get("ORTPASS_BENCH_PIPELINE") or None
            differentiate = "outputs" if key == "wrapper_split" else "auto"
            if key == "wrapper_logits":
                model.model = ORTModule(model.model, pipeline=pipeline)
            else:
                model = ORTModule(model, pipeline=pipeline, differentiate=differentiate)
            model(ids, labels)  # export, pipeline, session: setup, not a step

        def step():
            model.zero_grad(set_to_none=True)
            loss = model(ids, labels)
            loss.backward()
            losses.append(float(loss))

    setup_seconds = time.perf_counter() - setup_start
    result = _measure(step, steps)
    result.update(
        loss=losses[0],
        setup_seconds=setup_seconds,
        trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        threads=torch.get_num_threads(),
    )
    return result


# -- the parent (standard library only) ---------------------------------------------------------


def _run_child(key: str, steps: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", key, str(steps)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"child {key} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(steps: int, keys: list[str] | None = None) -> dict:
    load_before = os.getloadavg()[0]
    configs = {key: _run_child(key, steps) for key, _ in CONFIGS if keys is None or key in keys}
    return {
        "model": {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "vocab": VOCAB, "seq": SEQ, "batch": BATCH,
                  "lora_rank": LORA_RANK, "dropout": 0.1},
        "cpus": os.cpu_count(),
        "steps": steps,
        "load_average": [load_before, os.getloadavg()[0]],
        "configs": configs,
    }  # fmt: skip


def markdown(results: dict) -> str:
    m, configs = results["model"], results["configs"]
    lines = [
        "# ORTModule: training steps against a bare TrainingSession and torch eager",
        "",
        f"Hugging Face GPT-2, {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, vocab {m['vocab']}, "
        f"dropout {m['dropout']}; batch {m['batch']}, seq {m['seq']}; forward + backward on CPU "
        f"({results['cpus']} cores, shared). Step peak = peak RSS during a step above the RSS after setup and a "
        f"warm-up step, each configuration in a fresh process. Step time: fastest of {results['steps']} warm steps. "
        f"Load average before/after: {results['load_average'][0]:.1f} / {results['load_average'][1]:.1f}.",
        "",
        "| configuration | steps/s | warm step s | step peak MiB | trainable parameters | setup s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, label in CONFIGS:
        if key in configs:
            c = configs[key]
            lines.append(
                f"| {label} | {1 / c['step_seconds']:.3f} | {c['step_seconds']:.2f} | {c['step_peak_mib']:.0f} | "
                f"{c['trainable_parameters']:,} | {c['setup_seconds']:.1f} |"
            )
    lines.append("")
    if "wrapper" in configs and "session" in configs:
        overhead = configs["wrapper"]["step_seconds"] / configs["session"]["step_seconds"] - 1
        verdict = "met" if overhead <= 0.05 else "not met"
        lines.append(f"Wrapper step time over the bare session: {overhead:+.1%} (goal: at most +5%: {verdict}).")
    if "wrapper" in configs and "wrapper_split" in configs:
        one, split = configs["wrapper"], configs["wrapper_split"]
        lines.append(
            f"One graph (loss step) against forward and backward apart (split step): {one['step_seconds']:.2f} vs "
            f"{split['step_seconds']:.2f} s a step, {one['step_peak_mib']:.0f} vs {split['step_peak_mib']:.0f} MiB."
        )
    if "lora_frozen" in configs and "lora_full" in configs:
        frozen, full = configs["lora_frozen"]["step_peak_mib"], configs["lora_full"]["step_peak_mib"]
        lines.append(f"LoRA step peak, base frozen vs everything trainable: {frozen:.0f} vs {full:.0f} MiB.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        print(json.dumps(child(argv[1], int(argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="configuration keys to run (default: all)")
    args = parser.parse_args(argv)
    results = run(args.steps, args.only)
    (RESULTS / "train_wrapper.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "train_wrapper.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
