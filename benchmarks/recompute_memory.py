"""Peak memory and step time of one training step: ortpass recompute vs ORT's C++ memory
optimizer vs torch eager, with and without torch.utils.checkpoint per block.

Model: ``ortpass.testing.models.GPTDecoder`` (vocab 2048, hidden 256, 4 heads, seq 512,
batch 8, dropout 0.1), 4 layers and, with ``--layers 4 8``, 8 layers.

How memory is measured (docs/design/ort-facts.md):

- every configuration runs in a fresh process started by this script, which imports only
  the standard library (a child inherits its parent's high-water mark, and torch alone
  adds ~550 MiB);
- glibc ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the RSS;
- step peak = the highest RSS during one training step (``VmHWM`` after resetting it
  through ``/proc/self/clear_refs``) minus the RSS after setup and a warm-up step;
- ORT configurations never import torch: the graphs are exported, built and rewritten in a
  separate child first and saved to files; the ORT children load only
  ``onnxruntime.capi`` (the ``onnxruntime`` package's ``__init__`` would import torch
  through ``onnxruntime.training``) and record ``"torch" in sys.modules``;
- ORT's CPU memory arena is off (freed tensors would stay in the arena, and the RSS after
  the warm-up step would already hold the step's peak);
- the step of every configuration allocates its gradients (ORT returns them as outputs;
  torch's ``.grad`` are set to None before each step).

Step time is measured in a second fresh process per configuration, with the settings a
user runs: glibc's defaults, and ``TrainingSession``'s session options (arena and
prepacking on, ORT's threads not spinning where PythonOps run torch); the memory run's
settings slow ORT far more than torch (docs/design/ort-facts.md).

ORT configurations share ORTModule's session options for training: no memory pattern,
no memory reuse (reuse keeps a freed buffer held until the next value of its size takes
it; measured +100 MiB of step peak at level 1); in the memory run also no CPU arena and no
weight prepacking.  The ortpass graphs run in a plain session with ORT's default execution order and
:data:`ortpass.runtime.session.DISABLED_ORT_OPTIMIZERS` (CSE, SkipLayerNormFusion,
GeluFusion, GemmTransposeFusion: they undo recompute, drop outputs backward reads, change
the forward's rounding, or break the execution order RecomputePass writes).

ORT's C++ optimizer runs as ORTModule drives it: the forward part of the same training
graph goes through ORT's own gradient builder (``OrtModuleGraphBuilder``: ORT's
pre-training fusions, then a YieldOp between forward and backward); ORT's analysis of that
graph (``TrainingAgent.get_serialized_ortmodule_memory_stat``, probe ``1:1``) gives the
level-1 plans (every type-1 plan), written to a JSON plan file named in the session config;
the session uses ``ExecutionOrder.MEMORY_EFFICIENT`` and all of ORT's optimizers; a step is
``TrainingAgent.run_forward`` then ``run_backward`` with a loss gradient of 1.

Usage: ``python benchmarks/recompute_memory.py [--layers 4 8] [--steps 7]``.  Writes
``recompute_memory.json`` and ``recompute_memory.md`` next to this script.  The ortpass
graphs are built as ``build_training_graph`` does by default, with ORT's pre-gradient
fusions; ``ORTPASS_BENCH_ORT_FUSIONS=0`` builds them without (measured at 4 layers: no
recompute 784 MiB, level 1 269 MiB, against 656 and 237 with them, before the recompute
pass dropped the outputs nobody reads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the recorded results, apart from the scripts
VOCAB, HIDDEN, HEADS, SEQ, BATCH, DROPOUT = 2048, 256, 4, 512, 8, 0.1
MIN_ELEMENTS = None  # the recompute passes' default floor (ORT's 1Mi elements)
if os.environ.get("ORTPASS_BENCH_TINY") == "1":  # the test suite's smoke run: seconds, not minutes
    VOCAB, HIDDEN, SEQ, BATCH, MIN_ELEMENTS = 64, 32, 16, 2, 0
ORT_DISABLED_OPTIMIZERS = ["CommonSubexpressionElimination", "SkipLayerNormFusion", "GeluFusion", "GemmTransposeFusion"]
MIB = 1024 * 1024
TIMING_RUN = os.environ.get("ORTPASS_BENCH_TIMING") == "1"  # set by _run_child(timing=True)
# ortpass configurations: key -> (recompute level, 0 = none; whether replay-dropout-mask and
# order-backward-joins run)
ORTPASS_PIPELINES = {"ort_replay": (0, True), "ort_l1": (1, False), "ort_l1_full": (1, True), "ort_l2": (2, False)}

CONFIGS = [
    # (key, label, kind)
    ("ort", "ORT, no recompute", "ort"),
    ("ort_replay", "ortpass replay-dropout-mask + order-backward-joins, no recompute", "ort"),
    ("ort_l1", "ortpass recompute level 1", "ort"),
    ("ort_l1_full", "ortpass recompute level 1 + replay-dropout-mask + order-backward-joins", "ort"),
    ("ort_l2", "ortpass recompute level 2", "ort"),
    ("ort_cpp", "ORT C++ path (ORTModule's graph and session), no recompute", "ort"),
    ("ort_cpp_l1", "ORT C++ memory optimizer level 1", "ort"),
    ("torch", "torch eager", "torch"),
    ("torch_ckpt", "torch eager + checkpoint per block", "torch"),
]


# -- measuring (used by every child) ------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _measure(step, steps: int) -> dict:
    """Warm up, then measure the step peak of one step and the time of ``steps`` steps."""
    step()  # warm-up: allocator pools, kernel caches, lazily created state
    # The baseline is read after the reset: the other way round, memory freed in between
    # (by a background thread) leaves the peak below the baseline.  Linux 6.x keeps RSS as
    # per-CPU counters whose reads are approximate, so on a step that allocates almost
    # nothing (the test suite's tiny decoder) the later VmHWM can still read a few pages
    # below the baseline: a step's peak is never below its start, so that reads as 0.
    _reset_peak()
    rss_after_setup = _rss_bytes()
    times = []
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
    peak = _peak_bytes()
    for _ in range(steps - 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "rss_after_setup_mib": rss_after_setup / MIB,
        "step_peak_mib": max(0, peak - rss_after_setup) / MIB,
        # The fastest step: on a shared machine other work only ever adds time, and the
        # median of 3 moved by 20 points between runs of the same graph.
        "step_seconds": min(times),
        "step_seconds_median": statistics.median(times),
        "step_seconds_all": times,
    }


def measure_loss_steps(model, batch: dict, steps: int) -> dict:
    """:func:`_measure` of torch steps that set the gradients to None (the step allocates
    them, as ORT's does), compute ``model(**batch).loss`` and its backward; the first
    step's loss recorded as ``loss``."""
    losses: list[float] = []

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        losses.append(float(loss))

    result = _measure(step, steps)
    result["loss"] = losses[0]
    return result


# -- children -------------------------------------------------------------------------------------


def child_prepare(work: Path, layers: int) -> dict:
    """Export, build and rewrite the graphs (imports torch); save them and the batch."""
    import numpy as np
    import onnx_ir as ir
    import torch

    import ortpass
    from ortpass.export import export
    from ortpass.passes import FixDropoutSeedPass, OrderBackwardJoinsPass, RecomputePass, ReplayDropoutMaskPass
    from ortpass.testing.models import GPTDecoder
    from ortpass.training import build_training_graph

    torch.manual_seed(0)
    model = GPTDecoder(VOCAB, HIDDEN, HEADS, layers, SEQ, DROPOUT)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ))
    labels = rng.integers(0, VOCAB, (BATCH, SEQ))
    np.savez(work / "batch.npz", input_ids=ids, labels=labels)
    torch.save(model.state_dict(), work / "weights.pt")

    from ortpass.runtime.session import DISABLED_ORT_OPTIMIZERS

    if list(DISABLED_ORT_OPTIMIZERS) != ORT_DISABLED_OPTIMIZERS:
        raise RuntimeError(f"ORT_DISABLED_OPTIMIZERS is stale: TrainingSession disables {DISABLED_ORT_OPTIMIZERS}")
    forward = export(model, (torch.from_numpy(ids), torch.from_numpy(labels)), input_names=["input_ids", "labels"])
    training = build_training_graph(forward, ort_fusions=os.environ.get("ORTPASS_BENCH_ORT_FUSIONS", "1") == "1")
    ir.save(training, work / "ort.onnx")
    _save_ort_module_graph(training, work)
    info = {"nodes": {"ort": len(training.graph)}, "applied": {}}
    for key, (level, replay) in ORTPASS_PIPELINES.items():
        options = {"level": level, "min_elements": MIN_ELEMENTS}
        passes = [ReplayDropoutMaskPass(), OrderBackwardJoinsPass()] if replay else []
        if level:
            passes += [RecomputePass(**options), FixDropoutSeedPass(**options)]
        manager = ortpass.PassManager(passes, assume=["training-graph"])
        result = manager(training)
        ir.save(result.model, work / f"{key}.onnx")
        info["nodes"][key] = len(result.model.graph)
        recompute = next((p for p in manager.passes if isinstance(p, RecomputePass)), None)
        info["applied"][key] = [a.to_dict() for a in recompute.applied] if recompute else []
    return info


def _save_ort_module_graph(training, work: Path) -> None:
    """ORT's own gradient graph of ``training``'s forward part, as ORTModule builds it
    (YieldOp between forward and backward), with the parameter values and the feed names."""
    import numpy as np
    import onnx.numpy_helper

    from ortpass.analysis import get_training_info

    sys.path.insert(0, str(HERE))
    from recompute_vs_ort_analysis import forward_model_for_ort, ort_module_gradient_graph

    forward = forward_model_for_ort(training)
    gradient_model, info = ort_module_gradient_graph(forward, list(get_training_info(training).params))
    (work / "ort_cpp.onnx").write_bytes(gradient_model)
    trained = set(info.initializer_names_to_train)
    np.savez(
        work / "ort_cpp_params.npz",
        **{i.name: onnx.numpy_helper.to_array(i) for i in forward.graph.initializer if i.name in trained},
    )
    feeds = {"user_inputs": list(info.user_input_names), "params": list(info.initializer_names_to_train)}
    (work / "ort_cpp_feeds.json").write_text(json.dumps(feeds))


def _load_ort():
    """onnxruntime's C API and InferenceSession without running ``onnxruntime/__init__``
    (which imports torch through onnxruntime.training)."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("onnxruntime")
    package = types.ModuleType("onnxruntime")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["onnxruntime"] = package
    from onnxruntime.capi import _pybind_state as C
    from onnxruntime.capi.onnxruntime_inference_collection import InferenceSession

    return C, InferenceSession


def _ort_training_options(C, runs_torch: bool = False):
    """TrainingSession's session options (``ortpass.runtime.session.training_options``); in a
    memory run also no arena and no prepacking (see the module docstring)."""
    from ortpass.runtime.session import training_options

    options = training_options(C, runs_torch=runs_torch)
    if not TIMING_RUN:
        # Without this, freed tensors go back to ORT's arena, not to the OS, and the RSS
        # after the warm-up step already holds the step's peak.
        options.enable_cpu_mem_arena = False
        options.add_session_config_entry("session.disable_prepacking", "1")
    return options


def _ort_module_agent(C, InferenceSession, work: Path, options):
    """A session over ORT's YieldOp graph and the TrainingAgent that runs it."""
    feeds = json.loads((work / "ort_cpp_feeds.json").read_text())
    device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    names = feeds["user_inputs"] + feeds["params"]
    fetches = [f"{p}_grad" for p in feeds["params"]]
    session = InferenceSession(str(work / "ort_cpp.onnx"), options, providers=["CPUExecutionProvider"])
    agent = C.TrainingAgent(session._sess, names, [device] * len(names), fetches, [device] * len(fetches), 0)
    return session, agent, feeds, device


def child_ort_plans(work: Path) -> dict:
    """ORT's own level-1 plans for its YieldOp graph: every type-1 plan of its analysis at
    probe ``1:1``, as ORTModule collects them, written to the plan file the session reads."""
    C, InferenceSession = _load_ort()
    session, agent, _, _ = _ort_module_agent(C, InferenceSession, work, _ort_training_options(C))
    _, stats = agent.get_serialized_ortmodule_memory_stat("", "1:1", False)
    plans = []
    for cluster in stats:  # a cluster may list several plans, comma-joined
        type_1 = [plan for plan in cluster.split(",") if plan.split(":")[1] == "1"]
        if type_1:
            plans.append(",".join(type_1))
    plans.sort()
    (work / "ort_cpp_plans.json").write_text(json.dumps(plans))
    del agent, session
    return {"plans": plans, "torch_imported": "torch" in sys.modules}


def _disabled(path: Path) -> list[str]:
    """What TrainingSession disables for this graph (``ortpass.runtime.session.disabled_optimizers``:
    ORT_DISABLED_OPTIMIZERS, and more on some graphs)."""
    import onnx_ir as ir

    from ortpass.runtime.session import disabled_optimizers

    return disabled_optimizers(ir.load(path))


def child_ort(work: Path, key: str, steps: int, bridge: bool = False) -> dict:
    """One step of ``<key>.onnx`` in a plain session; ``bridge``: the graph holds PythonOps,
    so ortpass's torch bridge (and torch) are loaded before the session is made."""
    import numpy as np

    C, InferenceSession = _load_ort()
    if bridge:
        import onnx_ir as ir

        from ortpass.pythonop.rng_replay import register_rng_replay_functions
        from ortpass.pythonop import bridge as torch_bridge

        model = ir.load(work / f"{key}.onnx")
        register_rng_replay_functions(model)  # the recompute clones' RNG-replaying Functions
        torch_bridge.prepare(model)
    options = _ort_training_options(C, runs_torch=bridge)
    optimized = work / f"{key}.optimized.onnx"
    options.optimized_model_filepath = str(optimized)
    session = InferenceSession(
        str(work / f"{key}.onnx"), options, providers=["CPUExecutionProvider"], disabled_optimizers=_disabled(work / f"{key}.onnx")
    )
    feeds = dict(np.load(work / "batch.npz"))
    fetch = [o.name for o in session.get_outputs()]
    losses = []

    def step():
        losses.append(float(session.run(fetch, feeds)[0]))  # gradients die right here

    result = _measure(step, steps)
    del session
    return _finish_ort(result, losses, optimized)


def child_ort_cpp(work: Path, steps: int, recompute: bool = True) -> dict:
    """ORT's C++ memory optimizer at level 1, run as ORTModule runs it; without
    ``recompute``, the same graph and session without the optimizer (its own baseline:
    ORT's path runs optimizers the ortpass sessions must disable)."""
    import numpy as np

    C, InferenceSession = _load_ort()
    options = _ort_training_options(C)
    options.execution_order = C.ExecutionOrder.MEMORY_EFFICIENT
    if recompute:
        options.add_session_config_entry("optimization.memory_optimizer_config", str(work / "ort_cpp_plans.json"))
        options.add_session_config_entry("optimization.enable_memory_probe_recompute_config", "1:1")
    optimized = work / ("ort_cpp_l1.optimized.onnx" if recompute else "ort_cpp.optimized.onnx")
    options.optimized_model_filepath = str(optimized)
    session, agent, feeds, device = _ort_module_agent(C, InferenceSession, work, options)
    params = np.load(work / "ort_cpp_params.npz")
    batch = dict(np.load(work / "batch.npz"))
    # ortvalue_from_numpy does not copy: these arrays must outlive the steps.
    arrays = [batch[n] for n in feeds["user_inputs"]] + [params[n] for n in feeds["params"]]
    loss_grad = np.ones((), np.float32)
    losses = []

    def step():
        inputs = C.OrtValueVector()
        for array in arrays:
            inputs.push_back(C.OrtValue.ortvalue_from_numpy(array, device))
        outputs, state = C.OrtValueVector(), C.PartialGraphExecutionState()
        agent.run_forward(inputs, outputs, state, None)
        losses.append(float(outputs[0].numpy()))
        grad_inputs, gradients = C.OrtValueVector(), C.OrtValueVector()
        grad_inputs.push_back(C.OrtValue.ortvalue_from_numpy(loss_grad, device))
        agent.run_backward(grad_inputs, gradients, state)  # gradients die right here

    result = _measure(step, steps)
    del agent, session
    return _finish_ort(result, losses, optimized)


def _finish_ort(result: dict, losses: list[float], optimized: Path) -> dict:
    result["torch_imported"] = "torch" in sys.modules
    result["loss"] = losses[0]
    import onnx  # only now: the measurement is done

    graph = onnx.load(str(optimized), load_external_data=False).graph
    result["ort_nodes"] = len(graph.node)
    result["ort_recompute_nodes"] = sum("_recompute" in n.name for n in graph.node)
    optimized.unlink()
    return result


def child_torch(work: Path, key: str, layers: int, steps: int) -> dict:
    import numpy as np
    import torch

    from ortpass.testing.models import GPTDecoder

    model = GPTDecoder(VOCAB, HIDDEN, HEADS, layers, SEQ, DROPOUT, checkpoint=key == "torch_ckpt")
    model.load_state_dict(torch.load(work / "weights.pt"))
    model.train()
    batch = np.load(work / "batch.npz")
    ids, labels = torch.from_numpy(batch["input_ids"]), torch.from_numpy(batch["labels"])
    losses = []

    def step():
        model.zero_grad(set_to_none=True)  # the step allocates its gradients, as ORT's does
        loss = model(ids, labels)
        loss.backward()
        losses.append(float(loss))

    result = _measure(step, steps)
    result["loss"] = losses[0]
    result["torch_threads"] = torch.get_num_threads()
    return result


# -- the parent (standard library only) -----------------------------------------------------------


def _run_child(*args: str, script: str = __file__, timing: bool = False, python: str | None = None) -> dict:
    """Run ``script --child ARGS`` in a fresh process (of ``python``, default this one); its
    last stdout line is JSON.  A ``timing`` run uses the settings a user runs, not the
    memory run's (module docstring)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env.pop("ORTPASS_BENCH_TIMING", None)
    env.update({"ORTPASS_BENCH_TIMING": "1"} if timing else {"MALLOC_MMAP_THRESHOLD_": "65536"})
    proc = subprocess.run(
        [python or sys.executable, str(Path(script).resolve()), "--child", *args],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_config(*args: str, script: str = __file__, python: str | None = None) -> dict:
    """One configuration in two fresh processes: its step peak from a memory run, its step
    times from a timing run (the memory run's fastest step is kept as
    ``memory_run_step_seconds``)."""
    memory = _run_child(*args, script=script, python=python)
    timing = _run_child(*args, script=script, timing=True, python=python)
    times = {key: timing[key] for key in ("step_seconds", "step_seconds_median", "step_seconds_all")}
    return {**memory, **times, "memory_run_step_seconds": memory["step_seconds"]}


def cpu_model() -> str:
    """The CPU's model name as ``/proc/cpuinfo`` gives it.  Recorded because the shared
    machine is not always the same CPU: on 2026-11-28 it was an "Intel(R) Xeon(R)
    Processor" (AVX-512) where the docs had an AMD EPYC, and step-time ratios between ORT
    and torch differed from an earlier record's by more than the drift between runs
    (docs/performance.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def more_timing_rounds(configs: dict[str, dict], timers: dict[str, Callable[[], dict]], rounds: int) -> None:
    """Time each configuration in ``timers`` ``rounds - 1`` more times, each round in the
    order reversed from the round before (A B C, C B A, A B C), each time in a fresh
    process; ``configs[key]["step_seconds"]`` becomes its fastest over every round, the first
    being the timing run it already had, and ``step_seconds_rounds`` keeps each round's.

    Why: this machine's step times drift by 10-30% over tens of minutes, in both
    directions, on the same graph (docs/performance.md).  Timed once, one row after another,
    a ratio between two rows measured minutes apart carries that drift; alternating rounds
    give every row a turn early and late."""
    keys = [key for key in configs if key in timers and "error" not in configs[key]]
    for key in keys:
        configs[key]["step_seconds_rounds"] = [configs[key]["step_seconds"]]
    for round_index in range(1, rounds):
        for key in reversed(keys) if round_index % 2 else keys:
            timing = timers[key]()
            if "error" in timing:
                raise RuntimeError(f"{key}: timing round {round_index + 1} failed: {timing['error']}")
            configs[key]["step_seconds_rounds"].append(timing["step_seconds"])
            print(f"    round {round_index + 1}, {key}: step {timing['step_seconds']:.2f} s", flush=True)
    for key in keys:
        configs[key]["step_seconds"] = min(configs[key]["step_seconds_rounds"])


def rounds_text(configs: dict[str, dict]) -> str:
    """Each configuration's fastest step in each timing round, as the record prints them."""
    timed = {key: cfg["step_seconds_rounds"] for key, cfg in configs.items() if "step_seconds_rounds" in cfg}
    return "; ".join(f"{key} " + " / ".join(f"{t:.2f}" for t in times) for key, times in timed.items())


def run(layers_list: list[int], steps: int, only: list[str] | None = None) -> dict:
    results: dict = {
        "model": {"vocab": VOCAB, "hidden": HIDDEN, "heads": HEADS, "seq": SEQ, "batch": BATCH, "dropout": DROPOUT},
        "cpus": os.cpu_count(),
        "ort_disabled_optimizers": ORT_DISABLED_OPTIMIZERS,
        "steps_timed": steps,
        "layers": {},
    }
    results["load_average_before"] = os.getloadavg()
    for layers in layers_list:
        with tempfile.TemporaryDirectory(prefix=f"recompute_bench_{layers}_") as tmp:
            work = Path(tmp)
            print(f"[{layers} layers] preparing graphs", flush=True)
            entry = {"prepare": _run_child("prepare", str(work), str(layers))}
            if not only or "ort_cpp_l1" in only:
                entry["ort_cpp_plans"] = _run_child("ort-plans", str(work))
            entry["configs"] = {}
            for key, label, kind in CONFIGS:
                if only and key not in only:
                    continue
                print(f"[{layers} layers] {label}", flush=True)
                if key.startswith("ort_cpp"):
                    measured = _run_config("ort-cpp", str(work), str(steps), str(int(key == "ort_cpp_l1")))
                elif kind == "ort":
                    measured = _run_config("ort", str(work), key, str(steps))
                else:
                    measured = _run_config("torch", str(work), key, str(layers), str(steps))
                if kind == "ort" and measured["torch_imported"]:
                    raise RuntimeError(f"{key}: torch was imported in the ORT child; the memory would be wrong")
                entry["configs"][key] = {"label": label, **measured}
                print(f"    step peak {measured['step_peak_mib']:.0f} MiB, step {measured['step_seconds']:.2f} s", flush=True)
            results["layers"][str(layers)] = entry
    results["load_average_after"] = os.getloadavg()
    return results


def markdown(results: dict) -> str:
    lines = [
        "# Recompute: step peak memory and warm step time",
        "",
        "GPT-like decoder, hidden {hidden}, {heads} heads, seq {seq}, batch {batch}, vocab {vocab}, dropout "
        "{dropout}; one training step on CPU ({cpus} cores).".format(cpus=results["cpus"], **results["model"]),
        "Step peak = peak RSS during a step minus RSS after setup and a warm-up step; each configuration in "
        "a fresh process, ORT ones without torch imported. Step time: fastest of "
        f"{results['steps_timed']} warm steps in a second fresh process with the settings a user runs (no mmap "
        "threshold; ORT with TrainingSession's options). Extra time: vs the same runtime and graph without recompute (ORT C++: its own graph and session). "
        "Load average before/after: {:.1f} / {:.1f} (the machine is shared; times are noisy).".format(
            results["load_average_before"][0], results["load_average_after"][0]
        ),
        "",
    ]
    for layers, entry in results["layers"].items():
        configs = entry["configs"]
        lines += [
            f"## {layers} layers",
            "",
            "| configuration | step peak MiB | warm step s | extra time | RSS after setup MiB | recompute nodes in ORT's graph |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for key, cfg in configs.items():
            base = configs[_baseline(key)]["step_seconds"]
            extra = cfg["step_seconds"] / base - 1
            clones = cfg.get("ort_recompute_nodes", "")
            lines.append(
                f"| {cfg['label']} | {cfg['step_peak_mib']:.0f} | {cfg['step_seconds']:.2f} | {extra:+.0%} | "
                f"{cfg['rss_after_setup_mib']:.0f} | {clones} |"
            )
        plans = entry["ort_cpp_plans"]["plans"]
        lines += ["", f"ORT C++ level-1 plans ({len(plans)}): `{','.join(plans)}`", ""]
        lines += _goal(configs)
        for key, applied in entry["prepare"]["applied"].items():
            text = ", ".join(f"{a['plan']} x{a['applied']}" for a in applied if a["applied"])
            if text:
                lines.append(f"{configs[key]['label']} plans: {text}")
        lines.append("")
    return "\n".join(lines)


def _baseline(key: str) -> str:
    """The configuration without recompute that ``key``'s extra step time is measured against."""
    if key.startswith("torch"):
        return "torch"
    return "ort_cpp" if key.startswith("ort_cpp") else "ort"


def _goal(configs: dict) -> list[str]:
    """Issue 7's goal: level 1's peak no higher than ORT C++'s and torch checkpoint's, at
    less extra step time than either; for level 1 alone and with replay-dropout-mask and
    order-backward-joins."""
    cpp, ckpt = configs["ort_cpp_l1"], configs["torch_ckpt"]
    theirs = {
        "ORT C++ L1": (cpp, cpp["step_seconds"] / configs["ort_cpp"]["step_seconds"] - 1),
        "torch checkpoint": (ckpt, ckpt["step_seconds"] / configs["torch"]["step_seconds"] - 1),
    }
    lines = []
    for name, key in (("ortpass L1", "ort_l1"), ("ortpass L1 + replay + order", "ort_l1_full")):
        ours = configs[key]
        extra = ours["step_seconds"] / configs["ort"]["step_seconds"] - 1
        rows = {name: (ours, extra), **theirs}
        peaks = ", ".join(f"{n} {cfg['step_peak_mib']:.0f} MiB" for n, (cfg, _) in rows.items())
        lower = ours["step_peak_mib"] <= min(cpp["step_peak_mib"], ckpt["step_peak_mib"])
        faster = extra < min(e for _, e in theirs.values())
        verdict = "met" if lower and faster else "not met"
        lines.append(
            f"Goal for {name}: {verdict}. Peaks: {peaks}. Extra step time: "
            + ", ".join(f"{n} {e:+.0%}" for n, (_, e) in rows.items()) + "."
        )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        kind, work, *rest = argv[1:]
        work_path = Path(work)
        if kind == "prepare":
            out = child_prepare(work_path, int(rest[0]))
        elif kind == "ort-plans":
            out = child_ort_plans(work_path)
        elif kind == "ort":
            out = child_ort(work_path, rest[0], int(rest[1]))
        elif kind == "ort-cpp":
            out = child_ort_cpp(work_path, int(rest[0]), recompute=rest[1] == "1")
        else:
            out = child_torch(work_path, rest[0], int(rest[1]), int(rest[2]))
        print(json.dumps(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--only", nargs="+", choices=[key for key, _, _ in CONFIGS],
                        help="run these configurations only; prints them and records nothing")
    args = parser.parse_args(argv)
    results = run(args.layers, args.steps, args.only)
    if args.only:
        return
    record(RESULTS / "recompute_memory", results, markdown(results))


def record(stem: Path, results: dict, text: str) -> None:
    """Write ``<stem>.json`` and ``<stem>.md`` (the benchmarks' recorded results); print the table.
    A dot in the stem's name (an ORT version) stays part of it."""
    Path(f"{stem}.json").write_text(json.dumps(results, indent=1))
    Path(f"{stem}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
