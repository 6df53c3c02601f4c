"""The first step at depth: ``ORTModule``'s first call against torch.compile's cold first step.

Models: HF LLaMA (hidden 256, 4 heads, 2 kv heads, MLP 1024, vocab 2048) and GPT-2
(hidden 256, 4 heads, vocab 2048), batch 2, seq 128, the loss from ``labels``, at 2 to 80
layers.  Each depth and each side runs in a fresh process started from a parent that
imports only the standard library, with torch's threads and ORT's at ``--threads`` (1).
The first step is ``loss = model(ids, labels); loss.backward()``:

- **ortpass**: ``ORTModule(model, cache_dir=<empty temp dir>)``, its first call split into
  phases by wrapping the functions that run them: the export, the dims proof (the second
  export at other sizes and the comparison), the pass pipeline (``pythonop-shape-inference``,
  ``build-training-graph``, the other passes, the manager's checks, the manager's own
  bookkeeping), the session (serializing the model, ORT's session creation), writing the
  on-disk cache, and the step itself with what is left.  On stock onnxruntime the torch
  builder builds the training graph instead of the export and ``build-training-graph``:
  ``torch.export`` of the forward, AOTAutograd's joint trace, ``torch.onnx``'s export of the
  joint program and onnxscript's optimizer on it;
- **ortpass cache**: a second fresh process with the same ``cache_dir``: the first call
  that loads the graph the first process stored (no export, no pipeline);
- **torch.compile**: ``torch.compile(model)`` (Inductor, defaults) with a fresh Inductor
  cache (``TORCHINDUCTOR_CACHE_DIR`` an empty temp dir, set before torch is imported).

Host memory: a thread samples the process's RSS every 10 ms; "peak" is the highest RSS
during the call above the RSS just before it, per phase and overall (a pass's peak counts
the manager's check after it; the manager's own checks and bookkeeping share the peak
outside the passes), and "workers" the highest summed RSS of the process's children
(torch.compile's compile workers) while it ran.  The growth table fits each phase's
seconds against the training graph's node count over the deeper depths.

Results go to ``first_step.json`` / ``first_step.md`` / ``first_step.png`` next to this
script, with the CPU model and the machine's load.  Run: ``python3 benchmarks/first_step.py``
(about an hour on 2 cores); ``--layers 2 8`` for fewer depths, ``--families llama``,
``--sides ortpass`` to skip torch.compile, ``--limit S`` a per-process time limit,
``--out`` another record, ``--from-json A.json B.json`` one record from several runs,
``--repeat N`` the ortpass and cache processes per depth (2: the fastest is kept, as
timeit keeps its best: on this shared machine a quiet process's time varied 15-20% from
run to run, which alone moved t(64)/t(32) from 2.4 to 2.8).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the recorded results, apart from the scripts
sys.path.insert(0, str(HERE))
import recompute_memory as rm  # noqa: E402  (the sibling benchmark's helpers; standard library only at import)
LAYERS = (2, 8, 16, 32, 40, 64, 80)
FAMILIES = ("llama", "gpt2")
SIDES = ("ortpass", "cache", "compile")
HIDDEN, HEADS, KV_HEADS, MLP, VOCAB, BATCH, SEQ = 256, 4, 2, 1024, 2048, 2, 128
if os.environ.get("ORTPASS_BENCH_TINY") == "1":  # the test suite's smoke run
    HIDDEN, HEADS, KV_HEADS, MLP, VOCAB, BATCH, SEQ = 32, 2, 1, 64, 64, 2, 16
PHASES = (
    "export", "dims proof", "torch.export", "joint trace", "torch.onnx", "onnxscript optimize",
    "pythonop-shape-inference", "build-training-graph", "other passes",
    "manager checks", "manager bookkeeping", "serialize", "ORT session", "cache write", "cache load",
    "step and rest",
)


# -- measuring ---------------------------------------------------------------------------------------


class Sampler:
    """RSS of this process (and of its children) every ``interval`` seconds, the highest per phase."""

    def __init__(self, interval: float = 0.01) -> None:
        import psutil

        self.process = psutil.Process()
        self.interval = interval
        self.phase = "step and rest"
        self.base = self.process.memory_info().rss
        self.peak: dict[str, int] = {}
        self.workers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval)

    def sample(self) -> None:
        rss = self.process.memory_info().rss
        self.peak[self.phase] = max(self.peak.get(self.phase, 0), rss)
        try:
            children = sum(c.memory_info().rss for c in self.process.children(recursive=True))
        except Exception:  # noqa: BLE001 - a worker that exits while read
            children = 0
        self.workers = max(self.workers, children)

    def __enter__(self) -> "Sampler":
        self.base = self.process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def mib_above(self) -> dict[str, float]:
        return {phase: round(max(0, rss - self.base) / 2**20, 1) for phase, rss in self.peak.items()}


class Phases:
    """Seconds per phase: ``wrap(owner, name, phase)`` times every call of ``owner.name``
    as ``phase``, less the phases timed inside it (``unless_inside``: phases inside which
    the call counts for the outer phase)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.seconds: dict[str, float] = {}
        self.stack: list[list] = []

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def wrap(self, owner, name: str, phase: str, unless_inside: tuple[str, ...] = ()) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if self.stack and self.stack[-1][0] in unless_inside:
                return original(*args, **kwargs)
            self.sampler.sample()
            outer = self.sampler.phase
            self.sampler.phase = phase
            self.stack.append([phase, 0.0])
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                _, inner = self.stack.pop()
                self.add(phase, elapsed - inner)
                if self.stack:
                    self.stack[-1][1] += elapsed
                self.sampler.sample()
                self.sampler.phase = outer

        setattr(owner, name, timed)


def build_model(family: str, layers: int):
    import transformers

    if family == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
            intermediate_size=MLP, vocab_size=VOCAB, max_position_embeddings=SEQ,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        inner = transformers.LlamaForCausalLM(config)
    elif family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
        )
        inner = transformers.GPT2LMHeadModel(config)
    else:
        raise ValueError(f"unknown model family {family!r}: llama or gpt2")
    import torch

    class CausalLMLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = inner

        def forward(self, input_ids, labels):
            return self.model(input_ids=input_ids, labels=labels).loss

    return CausalLMLoss()


def _batch():
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids, ids.clone()


def child(side: str, family: str, layers: int, threads: int, cache_dir: str) -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model(family, layers)
    ids, labels = _batch()
    out: dict = {"side": side, "family": family, "layers": layers}
    if side == "compile":
        step_model = torch.compile(model)
        with Sampler() as sampler:
            start = time.perf_counter()
            step_model(ids, labels).backward()
            out["seconds"] = time.perf_counter() - start
        out["peak_mib"] = round(max(0, max(sampler.peak.values()) - sampler.base) / 2**20, 1)
        out["workers_mib"] = round(sampler.workers / 2**20, 1)
        return out
    import ortpass
    from ortpass.infra.base import pass_name_of
    from ortpass.infra.manager import PassManager
    from ortpass.runtime import session as session_module
    from ortpass.runtime.module import graphs

    sampler = Sampler()
    phases = Phases(sampler)
    reports = []
    phases.wrap(graphs.GraphBuilding, "_export", "export", unless_inside=("dims proof",))
    phases.wrap(graphs.GraphBuilding, "_pins", "dims proof")
    phases.wrap(graphs, "store_cached", "cache write")
    phases.wrap(graphs, "load_cached", "cache load")
    phases.wrap(session_module, "open_session", "ORT session")
    phases.wrap(session_module.TrainingSession, "__init__", "serialize")
    # The torch builder's build (stock onnxruntime): torch.export of the forward, AOTAutograd's
    # joint trace, torch.onnx's export of the joint program, onnxscript's optimizer on it.
    import torch.export.experimental as export_experimental

    from ortpass.training import from_torch, joint_onnx

    phases.wrap(from_torch, "_export", "torch.export")
    phases.wrap(export_experimental, "_export_forward_backward", "joint trace")
    phases.wrap(torch.onnx, "export", "torch.onnx", unless_inside=("export", "dims proof"))
    phases.wrap(joint_onnx, "optimize_keeping_training_values", "onnxscript optimize")
    manager_call = PassManager.call

    def call(self, model):
        start = time.perf_counter()
        result = manager_call(self, model)
        reports.append((time.perf_counter() - start, result.report))
        return result

    PassManager.call = call
    phases.wrap(PassManager, "call", "pipeline")
    run_pass = PassManager._run_pass

    def sampled_pass(self, run, position, pass_, *args):
        name = pass_name_of(pass_)
        sampler.sample()
        outer, sampler.phase = sampler.phase, name if name in PHASES else "other passes"
        try:
            return run_pass(self, run, position, pass_, *args)
        finally:
            sampler.sample()
            sampler.phase = outer

    PassManager._run_pass = sampled_pass
    wrapped = ortpass.ORTModule(model, cache_dir=cache_dir, threads=threads)
    with sampler:
        start = time.perf_counter()
        wrapped(ids, labels).backward()
        total = time.perf_counter() - start
    out["seconds"] = total
    if side == "ortpass":
        phases.seconds.pop("pipeline", None)
        for wall, report in reports:
            _pipeline_phases(phases, wall, report)
            out["pass_seconds"] = {r.name: round(r.seconds, 3) for r in report.records}
            out["forward_nodes"] = report.records[0].nodes_before
            out["training_nodes"] = report.records[-1].nodes_after
    phases.add("step and rest", total - sum(phases.seconds.values()))
    out["phase_seconds"] = {p: round(phases.seconds.get(p, 0.0), 3) for p in PHASES if p in phases.seconds}
    memory = sampler.mib_above()
    outside_passes = memory.pop("pipeline", 0.0)  # the manager's input and final checks, its bookkeeping
    for phase in ("manager checks", "manager bookkeeping"):
        if phase in out["phase_seconds"]:
            memory[phase] = outside_passes
    out["phase_peak_mib"] = memory
    out["peak_mib"] = max(memory.values(), default=0.0)
    out["workers_mib"] = round(sampler.workers / 2**20, 1)
    out["graph_builds"] = wrapped.graph_builds
    return out


def _pipeline_phases(phases: Phases, wall: float, report) -> None:
    named = ("pythonop-shape-inference", "build-training-graph")
    checks = sum(r.check_seconds or 0.0 for r in report.records) + (report.final_check_seconds or 0.0)
    passes = 0.0
    for record in report.records:
        phases.add(record.name if record.name in named else "other passes", record.seconds)
        passes += record.seconds
    phases.add("manager checks", checks)
    phases.add("manager bookkeeping", max(0.0, wall - passes - checks))


# -- the parent --------------------------------------------------------------------------------------


def run_child(side: str, family: str, layers: int, threads: int, cache_dir: str, limit: float, env: dict) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", side, family, str(layers), str(threads), cache_dir]
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"side": side, "family": family, "layers": layers, "timed_out": limit}
    if proc.returncode != 0:
        raise RuntimeError(f"child {side} {family} {layers} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(families, layer_counts, sides, threads: int = 1, limit: float = 1800, repeat: int = 2) -> dict:
    rows = []
    base_env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(threads))
    for family in families:
        for layers in layer_counts:
            with tempfile.TemporaryDirectory(prefix="first_step_") as tmp:
                for side in sides:
                    env = dict(base_env)
                    if side == "compile":
                        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
                    runs = []
                    for attempt in range(1 if side == "compile" else repeat):
                        # Each ortpass run exports into an empty cache; the cache side loads the first's.
                        cache_dir = os.path.join(tmp, f"ortpass_cache_{attempt if side == 'ortpass' else 0}")
                        load = os.getloadavg()[0]
                        row = run_child(side, family, layers, threads, cache_dir, limit, env)
                        row["load_before"] = round(load, 2)
                        runs.append(row)
                    row = _fastest(runs)
                    rows.append(row)
                    print(_row_line(row), flush=True)
    return {
        "model": {"hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS, "mlp": MLP, "vocab": VOCAB,
                  "batch": BATCH, "seq": SEQ},
        "threads": threads,
        "repeat": repeat,
        "cpus": os.cpu_count(),
        "cpu_model": rm.cpu_model(),
        "load_at_end": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": rows,
    }  # fmt: skip


def _fastest(runs: list[dict]) -> dict:
    """The fastest of one depth and side's runs (the others' times vary with what else the
    machine does, not with the code), with every run's seconds and the highest peak."""
    done = [r for r in runs if "seconds" in r]
    if not done:
        return runs[0]
    row = dict(min(done, key=lambda r: r["seconds"]))
    row["seconds_runs"] = [round(r["seconds"], 2) for r in done]
    row["peak_mib"] = max(r["peak_mib"] for r in done)
    return row


def _row_line(row: dict) -> str:
    if "timed_out" in row:
        return f"{row['family']} {row['layers']:>3} {row['side']:<8} timed out after {row['timed_out']} s"
    return (f"{row['family']} {row['layers']:>3} {row['side']:<8} {row['seconds']:8.2f} s  peak {row['peak_mib']:8.1f} MiB"
            f"  workers {row['workers_mib']:7.1f} MiB  (load {row['load_before']})")  # fmt: skip


# -- the record --------------------------------------------------------------------------------------


def _rows(results: dict, family: str, side: str) -> dict[int, dict]:
    return {r["layers"]: r for r in results["rows"] if r["family"] == family and r["side"] == side and "seconds" in r}


def ratios(results: dict, family: str) -> dict[str, float]:
    """t(2L)/t(L) of ortpass's first call for each depth whose double was run."""
    rows = _rows(results, family, "ortpass")
    return {f"t({2 * n})/t({n})": round(rows[2 * n]["seconds"] / rows[n]["seconds"], 2) for n in sorted(rows) if 2 * n in rows}


def growth(results: dict, family: str) -> dict[str, float | None]:
    """Each phase's log-log slope against the training graph's node count, fitted from the
    deepest half of the depths run (1 = linear in nodes)."""
    rows = [r for _, r in sorted(_rows(results, family, "ortpass").items()) if r.get("training_nodes")]
    rows = rows[len(rows) // 2 - (len(rows) % 2 == 0) :] if len(rows) > 2 else rows
    slopes: dict[str, float | None] = {}
    for phase in PHASES:
        points = [(math.log(r["training_nodes"]), math.log(r["phase_seconds"][phase]))
                  for r in rows if r["phase_seconds"].get(phase, 0) > 0]  # fmt: skip
        if len(points) < 2:
            slopes[phase] = None
            continue
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        var = sum((x - mx) ** 2 for x, _ in points)
        slopes[phase] = round(sum((x - mx) * (y - my) for x, y in points) / var, 2) if var else None
    return slopes


def markdown(results: dict) -> str:
    m = results["model"]
    lines = [
        "# The first step at depth: ORTModule's first call against torch.compile's cold first step",
        "",
        f"HF models, hidden {m['hidden']}, {m['heads']} heads (LLaMA: {m['kv_heads']} kv heads, MLP {m['mlp']}), "
        f"vocab {m['vocab']}, batch {m['batch']}, seq {m['seq']}, the loss from `labels`; {results['threads']} thread(s) "
        f"for torch and ORT; each depth and side in a fresh process, the fastest of {results.get('repeat', 1)} for ortpass "
        f"and cache (every run's seconds in the json); {results['cpus']} cores of {results['cpu_model']}, "
        f"{results['date']}, load average before each process in the rows (`load`), {results['load_at_end']} at the end. "
        "Peak: host RSS above the RSS before the call; workers: torch.compile's compile workers' RSS. "
        "`cache`: a second process loading the graph the first stored in `cache_dir`.",
        "",
    ]
    lines += [f"- {note}" for note in results.get("notes", ())]
    for family in sorted({r["family"] for r in results["rows"]}):
        ort, cache, comp = (_rows(results, family, s) for s in SIDES)
        lines += ["", f"## {family}", "",
                  "| layers | nodes (training) | ortpass first call s | peak MiB | cache start s | torch.compile s | "
                  "its peak + workers MiB | load |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for layers in sorted(set(ort) | set(comp) | set(cache)):
            o, c, k = ort.get(layers, {}), comp.get(layers, {}), cache.get(layers, {})
            lines.append(
                f"| {layers} | {o.get('training_nodes', '')} | {_f(o.get('seconds'))} | {_f(o.get('peak_mib'), 0)} | "
                f"{_f(k.get('seconds'))} | {_f(c.get('seconds'))} | "
                f"{_f(c.get('peak_mib'), 0)} + {_f(c.get('workers_mib'), 0)} | {o.get('load_before', '')} |"
            )
        if ort:
            lines += ["", f"Ratios: {ratios(results, family)}.", "", "Seconds per phase (peak MiB above the start in brackets):", ""]
            present = [p for p in PHASES if any(p in r["phase_seconds"] for r in ort.values())]
            lines += ["| layers | " + " | ".join(present) + " |", "|---:|" + "---:|" * len(present)]
            for layers, r in sorted(ort.items()):
                cells = [f"{r['phase_seconds'][p]:.2f} ({r['phase_peak_mib'].get(p, 0):.0f})" if p in r["phase_seconds"] else ""
                         for p in present]  # fmt: skip
                lines.append(f"| {layers} | " + " | ".join(cells) + " |")
            slopes = growth(results, family)
            lines += ["", "Growth against the node count (log-log slope over the deeper depths; 1 = linear): "
                      + ", ".join(f"{p} {s}" for p, s in slopes.items() if s is not None) + "."]  # fmt: skip
    return "\n".join(lines)


def _f(value, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({r["family"] for r in results["rows"]})
    fig, axes = plt.subplots(2, len(families), figsize=(6 * len(families), 8), squeeze=False)
    for column, family in enumerate(families):
        for side, label in (("ortpass", "ORTModule first call"), ("cache", "ORTModule, cache_dir, second process"),
                            ("compile", "torch.compile cold")):  # fmt: skip
            rows = _rows(results, family, side)
            if not rows:
                continue
            xs = sorted(rows)
            axes[0][column].plot(xs, [rows[x]["seconds"] for x in xs], marker="o", label=label)
            axes[1][column].plot(xs, [rows[x]["peak_mib"] + rows[x]["workers_mib"] for x in xs], marker="o", label=label)
        axes[0][column].set_title(f"{family}: first step (s)")
        axes[1][column].set_title(f"{family}: host peak + workers (MiB)")
        for ax in axes[:, column]:
            ax.set_xlabel("layers")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        side, family, layers, threads, cache_dir = argv[1:6]
        print(json.dumps(child(side, family, int(layers), int(threads), cache_dir)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--layers", nargs="+", type=int, default=list(LAYERS))
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--limit", type=float, default=1800, help="seconds a process may run (default 1800)")
    parser.add_argument("--repeat", type=int, default=2, help="ortpass and cache processes per depth, the fastest kept (default 2)")
    parser.add_argument("--out", default=str(RESULTS / "first_step"), help="the record's path without suffix")
    parser.add_argument("--from-json", nargs="+", metavar="JSON",
                        help="run nothing: write the record from these results (their rows together, the first's conditions)")
    args = parser.parse_args(argv)
    if args.from_json:
        loaded = [json.loads(Path(path).read_text()) for path in args.from_json]
        results = {**loaded[0], "rows": [row for part in loaded for row in part["rows"]],
                   "runs": [{k: v for k, v in part.items() if k != "rows"} for part in loaded]}  # fmt: skip
    else:
        results = run(args.families, args.layers, args.sides, args.threads, args.limit, args.repeat)
    stem = Path(args.out)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    stem.with_suffix(".md").write_text(text + "\n")
    plot(results, stem.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
