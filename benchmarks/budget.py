"""A memory budget instead of a level (issue #34): step peak memory against warm step time
on Hugging Face GPT-2 and LLaMA, for ortpass's recompute planner at five budgets, against
torch.compile at five ``activation_memory_budget`` values, torch eager with
``torch.utils.checkpoint`` on every k-th decoder layer, torch eager, ORT without recompute
and ortpass's default pipeline (recompute level 1).

Models: ``hf_memory.py``'s, built by its code (4 layers, hidden 256, 4 heads, vocab 2048,
batch 8, seq 512, ``--seq 2048`` for the long sequence; LLaMA's MLP 1024 wide; GPT-2's
dropout 0.1, LLaMA none).  Configurations (``CONFIGS``):

- ``ort``: the default pipeline without ``fix-dropout-seed`` and ``recompute`` (its other
  passes, replay-dropout-mask and recompute-gate-activation included, kept: the graph
  the budget points are planned from, less the planner); ``ort_plain``: hf_memory's ``ort``
  row, the training graph as ``build_training_graph`` builds it, no ortpass pass at all;
- ``ort_l1``: the default pipeline (recompute level 1), hf_memory's ``ortpass`` row;
- ``torch``: torch eager (SDPA); ``torch_ckpt_k1``/``k2``/``k4``: transformers'
  ``activation_checkpointing_enable(every_n_layers=k)`` (``torch.utils.checkpoint``,
  ``use_reentrant=False``, on decoder layers 0, k, 2k, ...; k=1 is every layer, as
  ``gradient_checkpointing_enable()``); ``torch_ckpt_sac``: torch's selective activation
  checkpointing on every layer (``benchmarks/selective_checkpointing.py``: matmuls and
  attention kept, the rest recomputed); their first-step loss and gradient norm are
  checked against ``torch``'s;
- ``ortpass_budget_i``, i = 0..4: the default pipeline with ``fix-dropout-seed(level=1),
  recompute(level=1)`` replaced by ``fix-dropout-seed(budget=B),recompute(budget=B)``
  (:func:`budget_pipeline`), B = peak(torch_ckpt_k1) + i/4 (peak(ort) - peak(torch_ckpt_k1)),
  the step peaks this run measured, in bytes.  The graphs are built once those two rows
  are measured (one export, the pipeline once per budget).  A budget the planner refuses
  (an ``OrtpassError``: unreachable, or an option this ortpass does not know) is recorded
  with its error.  The recompute pass's ``predicted peak bytes`` counter, where it has one,
  is kept next to the measured peak;
- ``torch_compile_budget_i``: ``torch.compile(model)`` (Inductor, CPU) with
  ``torch._functorch.config.activation_memory_budget = i/4`` (0: recompute all it can, 1:
  torch's default).  Each run compiles from a fresh Inductor cache; the first step (the
  compile) is timed apart as ``compile_seconds``, then ``recompute_memory._measure`` runs
  its own warm-up step and the measured steps.  A compile or run that fails is recorded
  with its error.  The model's ``loss_type`` is set to its default, ``"ForCausalLM"``
  (unset, transformers logs a warning Dynamo cannot trace: a graph break before the loss);
  ``dynamo_graphs`` and ``graph_breaks`` are recorded.  Inductor draws its own dropout
  masks: GPT-2's loss is not compared.

Memory and time are measured as ``recompute_memory.py`` measures them (its helpers are
used here): each configuration in a fresh process for its step peak (glibc
``MALLOC_MMAP_THRESHOLD_=65536``, ORT's arena off, step peak = highest RSS during a step
above the RSS after setup and a warm-up step; the ORT children import no torch) and in a
second fresh process, with the settings a user runs, for its warm step time (fastest of
``--steps``; the load average before each configuration is kept with it).

Goal (issue #34): at every budget, ortpass's step time is at or below that of every other
configuration (the other ortpass budget points aside) whose step peak is at or below
ortpass's there; and at the largest budget, within 5% of ``ort``'s step time.

Usage: ``python benchmarks/budget.py [--models gpt2 llama] [--seq 512|2048] [--steps 6]
[--only KEY ...] [--out DIR]``.  Writes ``budget[_seq<N>].json``, ``.md`` and ``.png``
(step peak against step time, one plot per model) next to this script (``_<model>``
added for one model alone) or in ``--out``.  ``--only`` runs those configurations (and
what they need: ``ort`` and ``torch_ckpt_k1`` for the ortpass budgets, ``torch`` for the
loss checks) and records nothing.  ``ORTPASS_BENCH_TINY=1`` (hf_memory's tiny models, for
a smoke run) records nothing either unless ``--out`` is given.
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
import hf_memory as hm  # the models, as hf_memory builds and exports them
import recompute_memory as rm  # the measuring helpers

TINY = os.environ.get("ORTPASS_BENCH_TINY") == "1"
POINTS = 5  # budget points i = 0..4
RECOMPUTE_SPEC = "fix-dropout-seed(level=1),recompute(level=1)"
CKPT_EVERY = (1, 2, 4)
_NTH = {1: "", 2: "2nd ", 4: "4th "}
# Checkpointing leaves the forward as it is: the first step's loss and gradients agree
# with torch eager's up to this, relatively.
LOSS_RTOL = 1e-5
# torch.compile's kernels round differently; compared only where no dropout draws differ.
COMPILE_LOSS_RTOL = 1e-3
TIME_TOLERANCE_AT_LARGEST = 0.05  # the goal: within 5% of ort's step time at i = 4
PREDICTED_COUNTER = "predicted peak bytes"

CONFIGS = [
    # (key, label, kind)
    ("ort", "ORT, no recompute (default pipeline without fix-dropout-seed, recompute)", "ort"),
    ("ort_plain", "ORT, no recompute, no ortpass pass (hf_memory's ort row)", "ort"),
    ("ort_l1", "ortpass default pipeline, recompute(level=1)", "ort"),
    ("torch", "torch eager (SDPA)", "torch"),
    *[(f"torch_ckpt_k{k}", f"torch eager + checkpoint every {_NTH[k]}layer", "torch") for k in CKPT_EVERY],
    ("torch_ckpt_sac", "torch eager + selective activation checkpointing (matmuls and attention kept)", "torch"),
    *[(f"ortpass_budget_{i}", f"ortpass, budget {i}/4", "ort-budget") for i in range(POINTS)],
    *[(f"torch_compile_budget_{i}", f"torch.compile, activation_memory_budget={i / 4:g}", "torch-compile")
      for i in range(POINTS)],
]
KEYS = [key for key, _, _ in CONFIGS]
LABELS = {key: label for key, label, _ in CONFIGS}
KINDS = {key: kind for key, _, kind in CONFIGS}


# -- pipelines ---------------------------------------------------------------------------------


def budget_pipeline(budget_bytes: int) -> str:
    """The default pipeline with its recompute at level 1 replaced by the planner at
    ``budget_bytes`` (the step's peak above the graph's inputs).  Raises ValueError where
    the default pipeline does not hold ``RECOMPUTE_SPEC`` once."""
    from ortpass.passes import DEFAULT_PIPELINE

    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"a budget is a non-negative int of bytes, got {budget_bytes!r}")
    if DEFAULT_PIPELINE.count(RECOMPUTE_SPEC) != 1:
        raise ValueError(f"the default pipeline does not hold {RECOMPUTE_SPEC!r} once: {DEFAULT_PIPELINE}")
    budget = f"fix-dropout-seed(budget={budget_bytes}),recompute(budget={budget_bytes})"
    return DEFAULT_PIPELINE.replace(RECOMPUTE_SPEC, budget)


def no_recompute_pipeline() -> str:
    """The default pipeline without ``RECOMPUTE_SPEC`` (the ``ort`` row)."""
    from ortpass.passes import DEFAULT_PIPELINE

    if DEFAULT_PIPELINE.count(RECOMPUTE_SPEC) != 1:
        raise ValueError(f"the default pipeline does not hold {RECOMPUTE_SPEC!r} once: {DEFAULT_PIPELINE}")
    return DEFAULT_PIPELINE.replace(RECOMPUTE_SPEC + ",", "").replace("," + RECOMPUTE_SPEC, "")


def budgets_mib(low_mib: float, high_mib: float) -> list[float]:
    """Budget i = low + i/4 (high - low), i = 0..4."""
    return [low_mib + i / (POINTS - 1) * (high_mib - low_mib) for i in range(POINTS)]


# -- children ----------------------------------------------------------------------------------


def _recompute_stats(report) -> dict:
    """The recompute pass's counters (and its notes where they are short) from a report."""
    try:
        stats = report["recompute"].stats
    except KeyError:
        return {}
    out = {"counts": dict(stats.get("counts", {}))}
    notes = stats.get("notes", {})
    if notes:
        text = json.dumps(notes, default=str)
        out["notes"] = notes if len(text) <= 20000 else {k: f"{len(v)} noted" for k, v in notes.items()}
    return out


def child_prepare(work: Path, family: str, seq: int) -> dict:
    """Export once; save the batch, the weights, the exported forward (for the budget
    graphs, built later) and the ``ort``, ``ort_plain`` and ``ort_l1`` graphs."""
    import numpy as np
    import onnx_ir as ir
    import torch

    import ortpass
    from ortpass.analysis.step_memory import predict_step_memory
    from ortpass.export import export
    from ortpass.passes import DEFAULT_PIPELINE
    from ortpass.training import build_training_graph

    torch.manual_seed(0)
    model = hm.build_model(family, seq)
    ids = np.random.default_rng(0).integers(0, hm.VOCAB, (hm.BATCH, seq))
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids}
    np.savez(work / "batch.npz", **batch)
    torch.save(model.state_dict(), work / "weights.pt")
    args = tuple(torch.from_numpy(batch[k]) for k in batch)
    # ORTModule's default export: attention fused where it has no dropout (LLaMA), or where
    # it is large; its PythonOps then run torch's kernel through ortpass's bridge.
    forward = export(hm._loss_module(model), args, input_names=list(batch), fused_attention="auto")
    ir.save(forward, work / "forward.onnx")
    info: dict = {"nodes": {}, "recompute": {}, "pipeline_seconds": {}, "pipelines": {},
                  "fused_attention": any(node.op_type == "PythonOp" for node in forward.graph)}
    training = build_training_graph(forward)
    ir.save(training, work / "ort_plain.onnx")
    info["nodes"]["ort_plain"] = len(training.graph)
    info["predicted_peak_bytes"] = {"ort_plain": predict_step_memory(training).peak_bytes}
    for key, spec in (("ort", no_recompute_pipeline()), ("ort_l1", DEFAULT_PIPELINE)):
        start = time.perf_counter()
        result = ortpass.pipeline(spec)(forward)
        info["pipeline_seconds"][key] = time.perf_counter() - start
        ir.save(result.model, work / f"{key}.onnx")
        info["nodes"][key] = len(result.model.graph)
        info["recompute"][key] = _recompute_stats(result.report)
        info["pipelines"][key] = spec
        info["predicted_peak_bytes"][key] = predict_step_memory(result.model).peak_bytes
    return info


def child_prepare_budgets(work: Path, budgets: list[int]) -> dict:
    """The budget graphs from the saved forward: the pipeline once per budget; a budget the
    pipeline refuses gets its error instead of a graph."""
    import onnx_ir as ir

    import ortpass
    from ortpass.analysis.step_memory import predict_step_memory
    from ortpass.errors import OrtpassError

    forward = ir.load(work / "forward.onnx")
    points = []
    for i, budget in enumerate(budgets):
        point: dict = {"budget_bytes": budget}
        start = time.perf_counter()
        try:
            spec = budget_pipeline(budget)
            point["pipeline"] = spec
            result = ortpass.pipeline(spec)(forward)
        except OrtpassError as exc:  # unreachable, or no planner here: recorded, the others still run
            point["error"] = f"{type(exc).__name__}: {exc}"[:4000]
            report = getattr(exc, "report", None)
            if report is not None:
                point["recompute"] = _recompute_stats(report)
        else:
            ir.save(result.model, work / f"ortpass_budget_{i}.onnx")
            point["nodes"] = len(result.model.graph)
            point["recompute"] = _recompute_stats(result.report)
            point["predicted_peak_bytes"] = point["recompute"].get("counts", {}).get(PREDICTED_COUNTER)
            # The passes after recompute (replay-dropout-mask, ...) change the graph again.
            point["final_graph_predicted_peak_bytes"] = predict_step_memory(result.model).peak_bytes
        point["pipeline_seconds"] = time.perf_counter() - start
        points.append(point)
    return {"points": points}


def _load_torch(work: Path, family: str, seq: int):
    import numpy as np
    import torch

    model = hm.build_model(family, seq)
    model.load_state_dict(torch.load(work / "weights.pt"))
    model.train()
    batch = {k: torch.from_numpy(v) for k, v in np.load(work / "batch.npz").items()}
    return model, batch


def _grad_norm(model) -> float:
    import torch

    grads = [p.grad.detach().double().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm())


def child_torch(work: Path, family: str, seq: int, key: str, steps: int) -> dict:
    """torch eager, with checkpointing on every k-th layer for ``torch_ckpt_k<k>``, and with
    torch's selective activation checkpointing on every layer for ``torch_ckpt_sac``."""
    import torch

    model, batch = _load_torch(work, family, seq)
    info: dict = {}
    if key.startswith("torch_ckpt_k"):
        model.activation_checkpointing_enable(every_n_layers=int(key.removeprefix("torch_ckpt_k")))
        layers = model.transformer.h if family == "gpt2" else model.model.layers
        info["checkpointed_layers"] = [i for i, layer in enumerate(layers) if layer.gradient_checkpointing]
    elif key == "torch_ckpt_sac":
        from selective_checkpointing import enable_selective_checkpointing

        enable_selective_checkpointing(model)
    elif key != "torch":
        raise ValueError(f"not a torch eager configuration: {key}")
    losses: list[float] = []
    norms: list[float] = []

    def step():
        model.zero_grad(set_to_none=True)  # the step allocates its gradients, as ORT's does
        loss = model(**batch).loss
        loss.backward()
        losses.append(float(loss))
        if not norms:
            norms.append(_grad_norm(model))

    torch.manual_seed(0)  # the same dropout draws in every torch row's first step
    result = rm._measure(step, steps)
    return {**result, **info, "loss": losses[0], "grad_norm": norms[0], "torch_threads": torch.get_num_threads()}


def child_torch_compile(work: Path, family: str, seq: int, key: str, steps: int) -> dict:
    """torch.compile at ``activation_memory_budget = i/4``; an error is returned, not raised."""
    # A fresh Inductor cache per run, so that the first step's time is a cold compile
    # (the memory run's compile would otherwise warm the timing run's).
    run = "timing" if rm.TIMING_RUN else "memory"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor_{key}_{run}")
    i = int(key.removeprefix("torch_compile_budget_"))
    try:
        return _torch_compile(work, family, seq, i / (POINTS - 1), steps)
    except Exception as exc:  # noqa: BLE001  recorded; the other rows still run
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def _torch_compile(work: Path, family: str, seq: int, fraction: float, steps: int) -> dict:
    import torch
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = fraction
    model, batch = _load_torch(work, family, seq)
    # The default loss, named: without a loss_type, transformers' loss_function property
    # logs a warning_once, which Dynamo cannot trace (a graph break before the loss).
    model.loss_type = "ForCausalLM"
    compiled = torch.compile(model)
    losses: list[float] = []
    norms: list[float] = []

    def step():
        model.zero_grad(set_to_none=True)
        loss = compiled(**batch).loss
        loss.backward()
        losses.append(float(loss.detach()))
        if not norms:
            norms.append(_grad_norm(model))

    torch.manual_seed(0)
    start = time.perf_counter()
    step()  # compiles forward and backward
    compile_seconds = time.perf_counter() - start
    result = rm._measure(step, steps)  # its own warm-up step first
    from torch._dynamo.utils import counters

    return {
        **result,
        "dynamo_graphs": counters["stats"]["unique_graphs"],  # more than 1 or 2: graph breaks or recompiles
        "graph_breaks": sum(counters["graph_break"].values()),
        "compile_seconds": compile_seconds,
        "activation_memory_budget": functorch_config.activation_memory_budget,
        "loss": losses[0],
        "grad_norm": norms[0],
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }


# -- the parent (standard library only, matplotlib for the plot at the end) --------------------


def _child(*args: str) -> dict:
    return rm._run_child(*args, script=__file__)


def _config(key: str, work: Path, family: str, seq: int, steps: int, bridge: bool = False) -> dict:
    """A memory run, then a timing run (``recompute_memory._run_config``); for the budget
    points and torch.compile, an error (a child that reports one, or dies) is recorded.
    ``bridge``: the ORT graphs hold fused-attention PythonOps (torch is loaded for them)."""
    kind = KINDS[key]
    if kind in ("ort", "ort-budget"):
        args = ("ort", str(work), key, str(steps), "1" if bridge else "0")
    elif kind == "torch":
        args = ("torch", str(work), family, str(seq), key, str(steps))
    else:
        args = ("torch-compile", str(work), family, str(seq), key, str(steps))
    load = {"load_average_before": os.getloadavg()[0]}  # times are noisy where the machine is shared
    if kind not in ("ort-budget", "torch-compile"):
        return {**rm._run_config(*args, script=__file__), **load}
    try:
        memory = _child(*args)
        if "error" in memory:
            return {**memory, **load}
        timing = rm._run_child(*args, script=__file__, timing=True)
        if "error" in timing:
            return {"error": f"timing run: {timing['error']}", "memory_run": memory}
    except RuntimeError as exc:
        return {"error": str(exc).strip()[-2000:], **load}
    times = {k: timing[k] for k in ("step_seconds", "step_seconds_median", "step_seconds_all")}
    out = {**memory, **times, "memory_run_step_seconds": memory["step_seconds"], **load}
    if "compile_seconds" in memory:
        out.update(compile_seconds=timing["compile_seconds"], memory_run_compile_seconds=memory["compile_seconds"])
    return out


def _wanted(only: list[str] | None) -> list[str]:
    """The configurations to run, in CONFIGS order: ``only`` and what it needs."""
    if not only:
        return list(KEYS)
    wanted = set(only)
    if any(k.startswith("ortpass_budget_") for k in wanted):
        wanted |= {"ort", "torch_ckpt_k1"}  # the budgets come from their peaks
    if any(k.startswith(("torch_ckpt", "torch_compile")) for k in wanted):
        wanted.add("torch")  # the loss checks
    return [k for k in KEYS if k in wanted]


def run(families: list[str], seq: int, steps: int, only: list[str] | None = None) -> dict:
    results: dict = {
        "model": {"layers": hm.LAYERS, "hidden": hm.HIDDEN, "heads": hm.HEADS, "vocab": hm.VOCAB, "batch": hm.BATCH,
                  "seq": seq, "llama_mlp": hm.LLAMA_MLP},
        "tiny": TINY,
        "cpus": os.cpu_count(),
        "steps_timed": steps,
        "load_average_before": os.getloadavg(),
        "families": {},
    }
    wanted = _wanted(only)
    for family in families:
        with tempfile.TemporaryDirectory(prefix=f"budget_{family}_") as tmp:
            work = Path(tmp)
            print(f"[{family}] preparing graphs", flush=True)
            entry: dict = {"prepare": _child("prepare", str(work), family, str(seq)), "configs": {}}
            configs = entry["configs"]
            for key in wanted:
                if key.startswith("ortpass_budget_") and "budgets" not in entry:
                    entry.update(_prepare_budgets(work, family, configs))
                print(f"[{family}] {LABELS[key]}", flush=True)
                if key.startswith("ortpass_budget_") and "error" in entry["budgets"]["points"][int(key[-1])]:
                    point = entry["budgets"]["points"][int(key[-1])]
                    measured = {"error": point["error"]}
                else:
                    measured = _config(key, work, family, seq, steps, bridge=entry["prepare"]["fused_attention"])
                bridged = entry["prepare"]["fused_attention"]
                if KINDS[key] in ("ort", "ort-budget") and measured.get("torch_imported") and not bridged:
                    raise RuntimeError(f"{key}: torch was imported in the ORT child; the memory would be wrong")
                configs[key] = {"label": LABELS[key], **measured}
                if key in entry["prepare"]["predicted_peak_bytes"]:
                    configs[key]["predicted_peak_bytes"] = entry["prepare"]["predicted_peak_bytes"][key]
                if key.startswith("ortpass_budget_"):
                    point = entry["budgets"]["points"][int(key[-1])]
                    configs[key].update(budget_mib=point["budget_bytes"] / rm.MIB,
                                        predicted_peak_bytes=point.get("predicted_peak_bytes"))
                print("    " + _summary(configs[key]), flush=True)
            entry["loss_checks"] = _loss_checks(family, configs)
            entry["goal"] = goal(configs)
            results["families"][family] = entry
    results["load_average_after"] = os.getloadavg()
    return results


def _prepare_budgets(work: Path, family: str, configs: dict) -> dict:
    low, high = configs["torch_ckpt_k1"]["step_peak_mib"], configs["ort"]["step_peak_mib"]
    mib = budgets_mib(low, high)
    print(f"[{family}] budget graphs: {', '.join(f'{b:.0f}' for b in mib)} MiB", flush=True)
    prepared = _child("prepare-budgets", str(work), ",".join(str(round(b * rm.MIB)) for b in mib))
    for point in prepared["points"]:
        if "error" in point:
            print(f"    budget {point['budget_bytes'] / rm.MIB:.1f} MiB refused: {point['error'][:300]}", flush=True)
    return {"budgets": {"low_mib": low, "high_mib": high, "mib": mib, **prepared}}


def _summary(cfg: dict) -> str:
    if "error" in cfg:
        return "not run: " + cfg["error"].strip().splitlines()[-1][:300]
    text = f"step peak {cfg['step_peak_mib']:.0f} MiB, step {cfg['step_seconds']:.3f} s"
    if cfg.get("predicted_peak_bytes") is not None:
        text += f", predicted peak {cfg['predicted_peak_bytes'] / rm.MIB:.0f} MiB"
    if "compile_seconds" in cfg:
        text += f", compile {cfg['compile_seconds']:.1f} s"
    return text


def _ok(cfg: dict | None) -> bool:
    return cfg is not None and "error" not in cfg


def _loss_checks(family: str, configs: dict) -> dict:
    """First-step loss and gradient norm of the checkpointed and compiled rows against
    torch eager's: True, False, or a sentence saying why it was not compared."""
    ref = configs.get("torch")
    checks: dict = {}
    for key, cfg in configs.items():
        if not key.startswith(("torch_ckpt", "torch_compile")) or not _ok(cfg):
            continue
        if not _ok(ref):
            checks[key] = "not compared: torch eager not run"
            continue
        if key.startswith("torch_compile") and family == "gpt2":
            checks[key] = "not compared: Inductor draws its own dropout masks (GPT-2's dropout 0.1)"
            continue
        rtol = LOSS_RTOL if key.startswith("torch_ckpt") else COMPILE_LOSS_RTOL
        checks[key] = all(abs(cfg[k] - ref[k]) <= rtol * abs(ref[k]) for k in ("loss", "grad_norm"))
    return checks


def goal(configs: dict) -> dict:
    """Issue #34's goal for each budget point: its step time at or below that of every
    other configuration (other budget points aside) whose step peak is at or below its
    own; at the largest budget also within 5% of ``ort``'s step time."""
    others = {k: c for k, c in configs.items() if not k.startswith("ortpass_budget_") and _ok(c)}
    points: dict = {}
    for i in range(POINTS):
        key = f"ortpass_budget_{i}"
        ours = configs.get(key)
        if ours is None:
            continue
        if not _ok(ours):
            points[key] = {"met": False, "why": "no graph: " + ours["error"].strip().splitlines()[-1][:300]}
            continue
        smaller = {k: c for k, c in others.items() if c["step_peak_mib"] <= ours["step_peak_mib"]}
        faster = sorted(k for k, c in smaller.items() if c["step_seconds"] < ours["step_seconds"])
        point = {"met": not faster, "compared_with": sorted(smaller), "faster_at_no_more_memory": faster}
        if i == POINTS - 1:
            if _ok(configs.get("ort")):
                ratio = ours["step_seconds"] / configs["ort"]["step_seconds"]
                point["time_vs_ort"] = ratio
                point["met"] = point["met"] and ratio <= 1 + TIME_TOLERANCE_AT_LARGEST
            else:
                point["met"] = False
                point["why"] = "ort not run"
        # Informational: another budget point as small and faster (the planner did worse here).
        point["dominated_by_budget_points"] = sorted(
            k for k, c in configs.items()
            if k.startswith("ortpass_budget_") and k != key and _ok(c)
            and c["step_peak_mib"] <= ours["step_peak_mib"] and c["step_seconds"] < ours["step_seconds"]
        )
        points[key] = point
    return {"met": bool(points) and all(p["met"] for p in points.values()), "points": points}


def _goal_lines(family: str, entry: dict) -> list[str]:
    configs, result = entry["configs"], entry["goal"]
    if not result["points"]:
        return [f"{family}: goal not evaluated (no ortpass budget point run)."]
    lines = [f"{family}: goal {'met' if result['met'] else 'not met'}."]
    for key, point in result["points"].items():
        if "why" in point and not _ok(configs[key]):
            lines.append(f"{family}, {configs[key]['label']}: not met ({point['why']}).")
            continue
        ours = configs[key]
        text = (f"{family}, {ours['label']}: {'met' if point['met'] else 'not met'} "
                f"(peak {ours['step_peak_mib']:.0f} MiB, step {ours['step_seconds']:.3f} s")
        if point["faster_at_no_more_memory"]:
            text += "; faster at no more memory: " + ", ".join(
                f"{k} {configs[k]['step_peak_mib']:.0f} MiB / {configs[k]['step_seconds']:.3f} s"
                for k in point["faster_at_no_more_memory"])
        else:
            text += f"; no faster configuration among the {len(point['compared_with'])} at no more memory"
        if "time_vs_ort" in point:
            text += f"; {point['time_vs_ort']:.3f}x ort's step time"
        if point["dominated_by_budget_points"]:
            text += "; also dominated by " + ", ".join(point["dominated_by_budget_points"])
        lines.append(text + ").")
    return lines


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(results: dict) -> str:
    m = results["model"]
    lines = [
        f"# A memory budget instead of a level: step peak memory and warm step time (seq {m['seq']})",
        "",
        (f"Hugging Face GPT-2 and LLaMA ({m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, vocab "
        f"{m['vocab']}, batch {m['batch']}, seq {m['seq']}, LLaMA MLP {m['llama_mlp']}"
        f"{', the tiny smoke-run models' if results.get('tiny') else ''}); one training step on CPU "
        f"({results['cpus']} cores). Step peak above the RSS after setup and a warm-up step, each configuration "
        f"in a fresh process; step time: fastest of {results['steps_timed']} warm steps in another fresh process "
        "with the settings a user runs (no mmap threshold; ORT with TrainingSession's options). Budget i = "
        "peak(torch + checkpoint every layer) + i/4 (peak(ORT, no recompute) - that), from this run's peaks; "
        "torch.compile's budget is its activation_memory_budget = i/4. Compile s: the first step of the timing "
        "run, cold Inductor cache. Load average before/after: "
        f"{results['load_average_before'][0]:.1f} / {results['load_average_after'][0]:.1f}."),
        "",
    ]
    for family, entry in results["families"].items():
        configs = entry["configs"]
        lines += [
            f"## {family}",
            "",
            "| configuration | budget MiB | predicted peak MiB | step peak MiB | warm step s | compile s | first-step loss |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for key, cfg in configs.items():
            budget = _fmt(cfg.get("budget_mib"), ".0f")
            predicted = cfg.get("predicted_peak_bytes")
            predicted = "" if predicted is None else f"{predicted / rm.MIB:.0f}"
            if not _ok(cfg):
                error = " ".join(cfg["error"].split())[:300].replace("|", "\\|")
                lines.append(f"| {cfg['label']} | {budget} | {predicted} | not run: {error} | | | |")
                continue
            lines.append(
                f"| {cfg['label']} | {budget} | {predicted} | {cfg['step_peak_mib']:.0f} | {cfg['step_seconds']:.3f} | "
                f"{_fmt(cfg.get('compile_seconds'), '.1f')} | {cfg['loss']:.5f} |"
            )
        lines.append("")
        lines += _goal_lines(family, entry)
        checks = entry["loss_checks"]
        if checks:
            lines.append(f"{family} loss and gradient norm vs torch eager: " + ", ".join(
                f"{k} {'agree' if v is True else 'DIFFER' if v is False else v}" for k, v in checks.items()) + ".")
        ckpt = [f"{k} layers {c['checkpointed_layers']}" for k, c in configs.items() if "checkpointed_layers" in c]
        if ckpt:
            lines.append(f"{family} checkpointed decoder layers: " + ", ".join(ckpt) + ".")
        for key, stats in entry["prepare"]["recompute"].items():
            lines.append(f"{family} {key}: recompute {stats.get('counts', {})}")
        for i, point in enumerate(entry.get("budgets", {}).get("points", [])):
            state = f"refused ({' '.join(point['error'].split())[:200]})" if "error" in point else \
                f"recompute {point.get('recompute', {}).get('counts', {})}"
            lines.append(f"{family} ortpass_budget_{i} ({point['budget_bytes']} bytes, pipeline "
                         f"{point['pipeline_seconds']:.1f} s): {state}")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """One plot per model: step peak MiB against warm step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(results["families"])
    fig, axes = plt.subplots(1, len(families), figsize=(7 * len(families), 5.5), squeeze=False)
    for ax, family in zip(axes[0], families):
        entry = results["families"][family]
        configs = entry["configs"]
        for prefix, label, style in (("ortpass_budget_", "ortpass, budget i/4", "o-"),
                                     ("torch_compile_budget_", "torch.compile, activation_memory_budget i/4", "s--")):
            points = [(int(k[-1]), c) for k, c in configs.items() if k.startswith(prefix) and _ok(c)]
            if not points:
                continue
            xs, ys = [c["step_peak_mib"] for _, c in points], [c["step_seconds"] for _, c in points]
            line, = ax.plot(xs, ys, style, label=label)
            for (i, _), x, y in zip(points, xs, ys):
                ax.annotate(str(i), (x, y), textcoords="offset points", xytext=(4, 4), color=line.get_color(), fontsize=8)
        for key, cfg in configs.items():
            if key.startswith(("ortpass_budget_", "torch_compile_budget_")) or not _ok(cfg):
                continue
            ax.plot(cfg["step_peak_mib"], cfg["step_seconds"], "^" if key.startswith("ort") else "D", label=key)
            ax.annotate(key, (cfg["step_peak_mib"], cfg["step_seconds"]), textcoords="offset points", xytext=(4, -10),
                        fontsize=8)
        budgets = entry.get("budgets", {})
        for i, mib in enumerate(budgets.get("mib", [])):
            ax.axvline(mib, color="0.85", linestyle=":", zorder=0)
            if "error" in budgets["points"][i]:  # the planner refused it: no point to draw
                ax.annotate(f"budget {i} refused", (mib, 0.02), xycoords=ax.get_xaxis_transform(), rotation=90,
                            fontsize=7, color="0.4", va="bottom", ha="right")
        ax.set_title(f"{family}, seq {results['model']['seq']}: goal {'met' if entry['goal']['met'] else 'not met'}")
        ax.set_xlabel("step peak MiB")
        ax.set_ylabel("warm step s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        kind, work, *rest = argv[1:]
        path = Path(work)
        if kind == "prepare":
            out = child_prepare(path, rest[0], int(rest[1]))
        elif kind == "prepare-budgets":
            out = child_prepare_budgets(path, [int(b) for b in rest[0].split(",")])
        elif kind == "ort":
            out = rm.child_ort(path, rest[0], int(rest[1]), bridge=rest[2] == "1")
        elif kind == "torch":
            out = child_torch(path, rest[0], int(rest[1]), rest[2], int(rest[3]))
        elif kind == "torch-compile":
            out = child_torch_compile(path, rest[0], int(rest[1]), rest[2], int(rest[3]))
        else:
            raise ValueError(f"unknown child {kind!r}")
        print(json.dumps(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", nargs="+", choices=KEYS,
                        help="run these configurations (and what they need) only; prints them, and records them only with --out")
    parser.add_argument("--out", type=Path, help="write the records here (default: next to this script; "
                        "with ORTPASS_BENCH_TINY=1, nowhere unless given)")
    args = parser.parse_args(argv)
    results = run(args.models, args.seq, args.steps, args.only)
    text = markdown(results)
    if (args.only or TINY) and args.out is None:  # a subset is recorded only where asked
        print(text)
        return
    stem = "budget" if args.seq == 512 else f"budget_seq{args.seq}"
    if args.models != ["gpt2", "llama"]:  # a subset keeps the full run's record
        stem += "_" + "_".join(args.models)
    out = args.out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    rm.record(out / stem, results, text)
    plot(results, (out / stem).with_suffix(".png"))


if __name__ == "__main__":
    main()
