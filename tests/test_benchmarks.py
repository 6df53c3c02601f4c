"""The benchmark scripts keep running against the current code (their numbers are
recorded by running them by hand; here only the smallest configuration, for breakage)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))  # the scripts import their sibling modules
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


@pytest.mark.slow
def test_scaling_times_ortpass_and_ort_on_the_smallest_decoder():
    scaling = _load("scaling")
    result = scaling.run_one(2, dynamic=False)
    passes = {p["pass"]: p for p in result["pipeline"]["passes"]}
    assert list(passes) == [
        "pythonop-shape-inference", "insert-gather-before-sce-loss", "build-training-graph",
        "fix-dropout-seed", "recompute", "replay-dropout-mask", "order-backward-joins",
    ]
    table = scaling.to_markdown([result], scaling.summarize([result])).splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("| mode |"))
    assert "| fix-dropout-seed | recompute | replay-dropout-mask | order-backward-joins |" in table[header]
    assert table[header + 2].count("|") == table[header].count("|")  # a cell per column
    assert passes["recompute"]["modified"] and passes["recompute"]["nodes_after"] > passes["recompute"]["nodes_before"]
    by_mode = result["post_grad_by_check_mode"]
    assert list(by_mode) == ["full", "incremental", "none"]
    assert all(t["wall_seconds"] >= t["pass_seconds"] > 0 for t in by_mode.values())
    assert by_mode["none"]["check_seconds"] == 0 < by_mode["incremental"]["check_seconds"]
    ort = result["ort"]
    # ORT's analysis finds plans on the same training graph (the one before recompute).
    assert ort["plans"] and ort["analysis_seconds"] > 0
    assert ort["ort_graph_nodes"] >= result["training_nodes"]
    assert 0 < ort["transformer_seconds"] < ort["session_seconds_with"]


def _transformer_line(stamp: str, name: str, modified: int) -> str:
    return (
        f"2026-11-22 {stamp} [I:onnxruntime:, graph_transformer.cc:15 Apply] "
        f"GraphTransformer {name} modified: {modified} with status: OK"
    )


def test_the_memory_optimizer_time_is_read_from_the_transformer_log_lines():
    scaling = _load("scaling")
    log = "\n".join([
        _transformer_line("18:25:26.900000000", "ConstantFolding", 1),
        _transformer_line("18:25:26.925111935", "MemcpyTransformer", 0),
        "2026-11-22 18:25:26.930000000 [I:onnxruntime:, memory_optimizer.cc:105 ModifyGraph] Node x is applying",
        _transformer_line("18:25:26.932314508", "MemoryOptimizer", 1),
        _transformer_line("18:25:26.990000000", "ConstantFolding", 0),
    ])
    assert scaling.memory_optimizer_seconds(log) == pytest.approx(0.007202573, abs=1e-7)
    # After a transformer that changed the graph, ORT resolves it again before the next
    # one starts: that time is not the memory optimizer's, so nothing is counted.
    after_a_change = log.replace("MemcpyTransformer modified: 0", "MemcpyTransformer modified: 1")
    assert scaling.memory_optimizer_seconds(after_a_change) is None
    assert scaling.memory_optimizer_seconds("no transformer ran") is None


def test_memory_runs_turn_the_arena_off_and_timing_runs_use_training_session_options(monkeypatch):
    import onnxruntime as ort

    recompute_memory = _load("recompute_memory")
    memory = recompute_memory._ort_training_options(ort)
    assert memory.enable_cpu_mem_arena is False and not memory.enable_mem_reuse
    assert memory.get_session_config_entry("session.disable_prepacking") == "1"
    monkeypatch.setattr(recompute_memory, "TIMING_RUN", True)
    timing = recompute_memory._ort_training_options(ort, runs_torch=True)
    assert timing.enable_cpu_mem_arena is True and not timing.enable_mem_reuse
    with pytest.raises(RuntimeError, match="does not have configuration"):
        timing.get_session_config_entry("session.disable_prepacking")
    assert timing.get_session_config_entry("session.intra_op.allow_spinning") == "0"


@pytest.mark.slow
def test_recompute_memory_measures_every_configuration_on_a_tiny_decoder(monkeypatch):
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")  # read by the script and by its children
    recompute_memory = _load("recompute_memory")
    results = recompute_memory.run([2], steps=1)
    configs = results["layers"]["2"]["configs"]
    assert list(configs) == [key for key, _, _ in recompute_memory.CONFIGS]
    assert all(c["step_seconds"] > 0 and c["step_peak_mib"] >= 0 for c in configs.values())
    assert configs["ort_l1"]["ort_recompute_nodes"] > 0 and configs["ort"]["ort_recompute_nodes"] == 0
    assert configs["ort_l1_full"]["ort_recompute_nodes"] > 0
    assert recompute_memory.markdown(results).count("| ortpass recompute level 1 |") == 1


@pytest.mark.slow
def test_family_memory_measures_both_pipelines_on_two_tiny_families(monkeypatch):
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")  # read by the script and by its children
    family_memory = _load("family_memory")
    from test_real_models import FAMILIES  # the conformance suite's families

    assert set(family_memory.FAMILIES) == set(FAMILIES)
    results = family_memory.run(["gpt2", "bert"], steps=1)
    rows = family_memory.rows(results)
    assert [row["family"] for row in rows] == ["gpt2", "bert"]
    for row in rows:
        assert row["peak_without_mib"] >= 0 and row["peak_with_mib"] >= 0
        assert row["clones"] > 0 and row["ort_recompute_nodes"] > 0  # the tiny run lowers the size floor to 0
    for entry in results["families"].values():
        assert entry["prepare"]["recompute"]["no_recompute"] == {}
        assert entry["configs"]["no_recompute"]["ort_recompute_nodes"] == 0
    table = family_memory.markdown(results).splitlines()
    assert "| family | peak without recompute MiB | peak with MiB | reduction % | clones |" in table
    assert sum(line.startswith(("| gpt2 |", "| bert |")) for line in table) == 2


@pytest.mark.slow
def test_family_memory_with_a_budget_adds_the_budget_row_and_its_predicted_peak(monkeypatch):
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")
    monkeypatch.setenv("ORTPASS_BENCH_BUDGET", "0.0")  # what --budget 0.0 sets for the children
    family_memory = _load("family_memory")
    results = family_memory.run(["gpt2"], steps=1)
    (row,) = family_memory.rows(results)
    assert row["budget_clones"] > 0 and row["predicted_budget_mib"] > 0
    assert row["peak_budget_mib"] >= 0 and row["step_seconds_budget"] > 0
    assert "| family | without recompute | level 1 | budget | budget's clones |" in family_memory.markdown(results)


@pytest.mark.slow
def test_hf_memory_measures_every_configuration_on_a_tiny_gpt2(monkeypatch):
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")  # read by the script and by its children
    hf_memory = _load("hf_memory")
    results = hf_memory.run(["gpt2"], seq=16, steps=1)
    configs = results["families"]["gpt2"]["configs"]
    assert list(configs) == [key for key, _, kind in hf_memory.CONFIGS if not kind.endswith("-stock")]  # no stock Python
    assert all(c["step_seconds"] > 0 and c["step_peak_mib"] >= 0 for c in configs.values())
    assert all(c["memory_run_step_seconds"] > 0 for c in configs.values())  # times from a second run
    # The fused-attention graph runs its attention as PythonOps through the bridge.
    assert configs["ortpass_fused"]["ort_nodes"] > 0
    table = hf_memory.markdown(results)
    assert table.count("| ortpass default pipeline, fused attention |") == 1
    assert "gpt2, ortpass default pipeline: goal" in table
    # GPT-2's attention dropout (0.1) keeps ORTModule's "auto" default on the plain row.
    assert results["families"]["gpt2"]["prepare"]["auto_fuses"] is False
    assert "gpt2: ORTModule's default (fused_attention='auto') is the row \"ortpass default pipeline\"." in table
    # The loop that computes the loss in torch runs ORTModule's split step, built once.
    assert configs["wrapper_split"]["graph_builds"] == 1 and configs["wrapper_split"]["loss"] > 0
    assert "gpt2, ortpass.ORTModule, loss computed in torch from the logits: goal" in table


@pytest.mark.slow
def test_hf_memory_runs_the_wrapper_row_in_the_python_it_is_given(monkeypatch):
    """The stock rows run in ``--stock-python``'s environment; given this one (the training
    build here), the ORTModule row builds its graph at the first step and trains."""
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")
    hf_memory = _load("hf_memory")
    results = hf_memory.run(["gpt2"], seq=16, steps=2, only=["wrapper_stock"], stock_python=sys.executable)
    row = results["families"]["gpt2"]["configs"]["wrapper_stock"]
    assert row["graph_builds"] == 1  # built at the first step, reused by the steps after
    assert row["sessions_without_arena"] > 0 and row["step_seconds"] > 0 and row["loss"] > 0


@pytest.mark.slow
def test_hf_memory_budget_row_runs_llama_under_its_budget_and_skips_gpt2(monkeypatch):
    """``wrapper_stock_budget`` gives ORTModule the family's ``memory_budget``; a family
    without one (GPT-2) has no such row."""
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")
    hf_memory = _load("hf_memory")
    results = hf_memory.run(["gpt2", "llama"], seq=16, steps=2, only=["wrapper_stock_budget"], stock_python=sys.executable)
    assert results["families"]["gpt2"]["configs"] == {}
    row = results["families"]["llama"]["configs"]["wrapper_stock_budget"]
    assert row["memory_budget"] == hf_memory.WRAPPER_BUDGET["llama"] and row["graph_builds"] == 1
    assert f"memory_budget='{row['memory_budget']}'" in row["label"]
    assert row["step_seconds"] > 0 and row["loss"] > 0


@pytest.mark.slow
def test_onnxscript_optimize_times_both_graphs_of_the_small_decoder():
    bench = _load("onnxscript_optimize")
    result = bench.run_one("small", steps=1)
    without, with_ = result["without"], result["with"]
    assert with_["optimized_nodes"] < without["export_nodes"] == with_["export_nodes"]
    assert 0 < with_["constants_lifted"] <= without["export_nodes"] - with_["optimized_nodes"]
    assert with_["training_nodes_without_ort_fusions"] < without["training_nodes_without_ort_fusions"]
    assert without["step_ms_median"] > 0 and with_["step_ms_median"] > 0
    table = bench.to_markdown([result], steps=1).splitlines()
    assert sum(line.startswith("| small (32 hidden, 2 layers) |") for line in table) == 1


def test_remove_pass_drops_a_named_pass_with_or_without_options():
    real_width = _load("hf_memory_real_width")
    spec = "a,recompute(level=1, plans=['x', 'y']),b"
    assert real_width.remove_pass(spec, "recompute") == "a,b"
    assert real_width.remove_pass(spec, "a") == "recompute(level=1, plans=['x', 'y']),b"
    assert real_width.remove_pass(spec, "b") == "a,recompute(level=1, plans=['x', 'y'])"
    with pytest.raises(ValueError, match="no pass 'c'"):
        real_width.remove_pass(spec, "c")


@pytest.mark.parametrize("keep_output", [False, True])
def test_the_real_width_loop_holds_the_output_through_backward_only_when_asked(keep_output):
    """torch frees the logits before backward when the loop keeps the loss alone (measured on
    GPT-2 at real width: 294 MiB against 491 with the output held); the benchmark's two loops
    must differ in exactly that."""
    import weakref

    import torch

    real_width = _load("hf_memory_real_width")
    model = torch.nn.Linear(4, 3)
    logits_alive_in_backward = []

    class Output:  # what a Hugging Face model returns: the loss beside the logits
        def __init__(self, loss, logits):
            self.loss, self.logits = loss, logits

    def forward():
        logits = model(torch.ones(2, 4))
        logits_ref = weakref.ref(logits)  # autograd keeps the Linear's input, not its output
        loss = logits.sum()
        loss.register_hook(lambda grad: logits_alive_in_backward.append(logits_ref() is not None))
        return Output(loss, logits)

    losses = []
    real_width._training_step(model, forward, losses, keep_output=keep_output)()
    assert logits_alive_in_backward == [keep_output]
    assert losses == [pytest.approx(float(model(torch.ones(2, 4)).sum()))]
    assert model.weight.grad is not None


def test_hf_memory_dispatches_real_width_to_its_own_script(monkeypatch):
    hf_memory = _load("hf_memory")
    calls = []
    stub = type(sys)("hf_memory_real_width")
    stub.main = calls.append
    monkeypatch.setitem(sys.modules, "hf_memory_real_width", stub)
    hf_memory.main(["--real-width", "--seq", "2048", "--only", "wrapper"])
    assert calls == [["--seq", "2048", "--only", "wrapper"]]


@pytest.mark.slow
def test_hf_memory_real_width_measures_the_wrapper_and_checkpointing_on_tiny_models(monkeypatch):
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")  # read by the script and by its children
    real_width = _load("hf_memory_real_width")
    # The CCE row is left out: its torch.compile takes ~15 s even on the tiny model.
    # LLaMA's attention is fused and recomputed: its timing run loads PythonOps from the cache.
    results = real_width.run(["gpt2", "llama"], seq=real_width.TINY_SEQ, steps=1,
                             only=["wrapper", "wrapper_split", "torch_ckpt"], rounds=2)
    table = real_width.markdown(results)
    assert "| ortpass.ORTModule, default pipeline | " in table
    assert "| ortpass.ORTModule, loss computed in torch from the logits | " in table
    assert "| torch + checkpointing + Cut Cross-Entropy (torch_compile impl) | not run | not run |" in table
    for family in ("gpt2", "llama"):
        configs = results["families"][family]["configs"]
        assert list(configs) == ["wrapper", "wrapper_split", "torch_ckpt"]
        assert f"{family}, wrapper_split: goal " in table
        assert all(c["step_seconds"] > 0 and c["step_peak_mib"] >= 0 for c in configs.values())
        # The memory run built the graph; the timing run loaded it from ORTModule's cache.
        assert configs["wrapper"]["graph_builds"] == 1 and configs["wrapper"]["timing_run_graph_builds"] == 0
        assert configs["wrapper"]["sessions_without_arena"] > 0  # the memory run's sessions: ORT's arena off
        for cfg in configs.values():  # two timing runs, the row's time the faster
            assert len(cfg["step_seconds_rounds"]) == 2 and cfg["step_seconds"] == min(cfg["step_seconds_rounds"])
        assert f"{family} step seconds by round: wrapper " in table
        assert f"{family}, wrapper: goal " in table and f"{family} first-step losses: wrapper " in table
    # Without dropout the loop's own loss is the model's: transformers' shift, the same mean.
    llama = results["families"]["llama"]["configs"]
    assert llama["wrapper_split"]["loss"] == pytest.approx(llama["torch_ckpt"]["loss"], rel=1e-5)


def test_timing_rounds_alternate_their_order_and_keep_each_rows_fastest():
    rm = _load("recompute_memory")
    calls = []
    scripted = {"a": iter([3.0, 1.5]), "b": iter([0.9, 1.2]), "c": iter([2.0, 2.5])}

    def timer(key):
        def time_once():
            calls.append(key)
            return {"step_seconds": next(scripted[key])}
        return time_once

    configs = {"a": {"step_seconds": 2.0}, "b": {"step_seconds": 1.0}, "c": {"step_seconds": 2.2},
               "failed": {"error": "no such package"}}
    rm.more_timing_rounds(configs, {key: timer(key) for key in ("a", "b", "c", "failed")}, rounds=3)
    assert calls == ["c", "b", "a", "a", "b", "c"]  # round 1 was the config's own run, in order a b c
    assert configs["a"]["step_seconds_rounds"] == [2.0, 3.0, 1.5] and configs["a"]["step_seconds"] == 1.5
    assert configs["b"]["step_seconds"] == 0.9 and configs["c"]["step_seconds"] == 2.0
    assert "step_seconds_rounds" not in configs["failed"]
    assert rm.rounds_text(configs) == "a 2.00 / 3.00 / 1.50; b 1.00 / 0.90 / 1.20; c 2.20 / 2.00 / 2.50"
    configs = {"a": {"step_seconds": 2.0}}
    rm.more_timing_rounds(configs, {"a": timer("a")}, rounds=1)  # one round: nothing more runs
    assert configs == {"a": {"step_seconds": 2.0, "step_seconds_rounds": [2.0]}}


def test_budget_plans_and_measures_budget_points_on_a_tiny_gpt2(monkeypatch):
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")  # read by the script and by its children
    budget = _load("budget")
    # seq 512: at the tiny model's seq 16 every step peak reads 0 MiB and no budget is reachable.
    results = budget.run(["gpt2"], seq=512, steps=1, only=["ortpass_budget_4"])
    entry = results["families"]["gpt2"]
    configs = entry["configs"]
    assert list(configs) == ["ort", "torch", "torch_ckpt_k1", "ortpass_budget_4"]  # and what the budgets need
    point = configs["ortpass_budget_4"]
    assert point["budget_mib"] == pytest.approx(configs["ort"]["step_peak_mib"])  # the largest budget: ORT's peak
    assert "error" not in point and point["step_seconds"] > 0 and point["predicted_peak_bytes"] > 0
    assert entry["loss_checks"]["torch_ckpt_k1"] is True  # checkpointing changes no number
    assert "ortpass_budget_4" in entry["goal"]["points"]
    assert "ortpass, budget 4/4" in budget.markdown(results)


def test_attention_time_measures_every_kernel_and_both_checkpointed_steps_on_tiny_shapes(monkeypatch):
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")
    attention_time = _load("attention_time")
    kernels = attention_time.kernels()
    assert len(kernels) == 4
    for name, row in kernels.items():
        if "not_run" in row:  # ONNX's Attention on an onnxruntime older than opset 23
            assert "Attention" in name
            continue
        assert row["seconds"] > 0
        assert row["max_abs_diff"] < 1e-5, name  # every kernel computes the same attention
    steps = attention_time.checkpointed_steps(rounds=1)
    assert len(steps["flash"]) == len(steps["math"]) == 1 and min(steps["flash"] + steps["math"]) > 0
    python_ops = attention_time.python_op_kernels()
    assert python_ops.pop("max_abs_diff_of_the_backwards") < 1e-5  # both backwards give the same gradients
    assert len(python_ops) == 3 and min(python_ops.values()) > 0
    table = attention_time.markdown(
        {"kernels": kernels, "checkpointed_steps": steps, "load": [0.0, 0.0], "python_op_kernels": attention_time.python_op_kernels()}
    )
    assert "| torch SDPA, flash kernel |" in table and "| math |" in table
    assert "| backward from the forward's logsumexp |" in table


def test_matmul_kernels_times_every_product_of_the_step_alone_and_in_torch_on_tiny_shapes(monkeypatch):
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")
    matmul_kernels = _load("matmul_kernels")
    results = matmul_kernels.run(runs=1)
    products = results["products"].values()
    assert sum(p["per_step"] for p in products) == results["nodes"]  # each product node once a step
    assert "Gemm" in {p["op"] for p in products} <= set(matmul_kernels.PRODUCTS)
    for product in products:
        assert product["ort_ms"] > 0 and product["torch_ms"] > 0 and product["step_ms"] > 0
        assert product["max_abs_diff"] <= 1e-5 * product["scale"]  # ORT's and torch's product agree
    # A weight gradient: x (tokens x in) transposed times dY (tokens x out) is in x out x tokens MACs.
    assert matmul_kernels._flop("Gemm", {"transA": 1}, [[4096, 256], [4096, 1024]]) == 2 * 256 * 1024 * 4096
    assert matmul_kernels._flop("MatMul", {}, [[32, 512, 64], [32, 64, 512]]) == 2 * 32 * 512 * 64 * 512
    assert "| **all** |" in matmul_kernels.markdown(results)


@pytest.mark.slow
def test_first_step_times_every_phase_and_torch_compile_on_a_tiny_llama(monkeypatch, tmp_path):
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")  # read by the script and by its children
    first_step = _load("first_step")
    results = first_step.run(["llama"], [1, 2], ["ortpass", "cache", "compile"], threads=1, limit=900, repeat=2)
    rows = {(r["side"], r["layers"]): r for r in results["rows"]}
    assert set(rows) == {(side, layers) for side in first_step.SIDES for layers in (1, 2)}
    ort = rows["ortpass", 2]
    assert {"export", "dims proof", "pythonop-shape-inference", "build-training-graph", "ORT session",
            "cache write"} <= set(ort["phase_seconds"])  # fmt: skip
    assert all(seconds >= 0 for seconds in ort["phase_seconds"].values())
    assert ort["training_nodes"] > rows["ortpass", 1]["training_nodes"] and ort["peak_mib"] >= 0
    assert len(ort["seconds_runs"]) == 2 and round(ort["seconds"], 2) == min(ort["seconds_runs"])  # the fastest kept
    assert len(rows["compile", 2]["seconds_runs"]) == 1  # torch.compile's cold step runs once
    cache = rows["cache", 2]
    assert cache["graph_builds"] == 0 and "cache load" in cache["phase_seconds"]  # loaded, not exported
    assert rows["compile", 2]["seconds"] > 0 and rows["compile", 2]["workers_mib"] >= 0
    assert first_step.ratios(results, "llama") == {"t(2)/t(1)": round(ort["seconds"] / rows["ortpass", 1]["seconds"], 2)}
    table = first_step.markdown(results)
    assert "| layers | nodes (training) | ortpass first call s |" in table and "Growth against the node count" in table
    first_step.plot(results, tmp_path / "first_step.png")
    assert (tmp_path / "first_step.png").stat().st_size > 0


def test_ort_session_scaling_times_both_graphs_at_each_size(tmp_path):
    scaling = _load("ort_session_scaling")
    results = scaling.run(sizes=[20, 40], repeat=1)
    rows = {(r["shape"], r["nodes"]): r for r in results["rows"]}
    assert set(rows) == {("chain", 20), ("chain", 40), ("forward-backward", 40), ("forward-backward", 80)}
    assert all(r["optimizers off"] > 0 and r["default"] > 0 for r in rows.values())
    table = scaling.markdown(results)
    assert "| forward-backward | 80 |" in table and f"ORT {results['onnxruntime']}" in table


def test_session_transformers_opens_each_graph_three_ways_and_compares_what_ort_runs():
    bench = _load("session_transformers")
    results = bench.run(layer_counts=[1], repeat=1)
    (row,) = results["rows"]
    assert row["layers"] == 1 and row["ortpass"] > 0 and row["not numbered"] > 0 and row["all run"] > 0
    assert row["same_optimized_graph"] is True
    assert "QDQPropagationTransformer" in row["idle"] and "NchwcTransformer" in row["idle"]
    assert "| 1 | " in bench.markdown(results)


@pytest.mark.stock
def test_pythonop_call_times_the_function_pair_on_the_installed_runtime(monkeypatch):
    """The side this environment holds: the training build's PythonOp through ortpass's
    bridge, or stock's Python op through onnxruntime-extensions (with its own list hook)."""
    import importlib.util

    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")  # read at import: two sizes, three steps
    pythonop_call = _load("pythonop_call")
    side = "training" if importlib.util.find_spec("onnxruntime.training") is not None else "stock"
    result = pythonop_call._measure_side(side)
    assert result["side"] == side and [row["elements"] for row in result["rows"]] == [2, 2000]
    for row in result["rows"]:
        assert row["step_without_s"] > 0 and row["step_with_s"] > 0
        assert row["call_pair_us"] == pytest.approx((row["step_with_s"] - row["step_without_s"]) * 1e6)
        assert ("call_pair_lists_us" in row) == (side == "stock")
    assert "| 2,000 |" in pythonop_call._markdown([result])


@pytest.mark.stock
@pytest.mark.slow
def test_label_gather_torch_builder_measures_every_row_with_the_same_loss(monkeypatch):
    """The smallest GPT-2 with padded labels: the gathered rows name the loss they gathered,
    the others none, and every row computes torch eager's loss (the gather drops only
    ignored rows)."""
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")  # read by the script and by its children
    label_gather = _load("label_gather_torch_builder")
    results = label_gather.run(["gpt2"], steps=1, layers=1, vocab=64)
    rows = results["models"]["gpt2"]["rows"]
    assert list(rows) == [key for key, _, _, _ in label_gather.CONFIGS]
    for key, _, gather, _ in label_gather.CONFIGS:
        assert rows[key]["loss"] == pytest.approx(rows["torch"]["loss"], rel=1e-5), key
        if gather is not None:
            assert bool(rows[key]["gathered"]) == gather, key
    assert set(results["models"]["gpt2"]["alternating"]) == {"pipeline", "alone"}
    assert "| torch builder, no passes, label gather |" in label_gather.markdown(results)


def test_weight_gradient_gemm_times_both_forms_of_every_product_and_they_agree(monkeypatch):
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")  # read at import: 64 rows
    bench = _load("weight_gradient_gemm")
    products = bench.products(rounds=1)
    assert len(products) == len(bench.PRODUCTS)
    for row in products.values():
        assert list(row) == ["ORT Gemm(transA=1)", "ORT Transpose + MatMul", "torch mm(dY.t(), x)"]
        for form in row.values():
            assert form["fastest_ms"] > 0 and form["max_rel_err"] < 1e-5  # each form computes dY^T x


@pytest.mark.stock
@pytest.mark.slow
def test_weight_gradient_gemm_rewrites_every_weight_gradient_of_the_stock_llama_step(monkeypatch):
    from ortpass.training.backend import has_training_ops

    if has_training_ops():
        pytest.skip("the step's graph is the torch builder's, which ORTModule builds on stock onnxruntime")
    monkeypatch.setenv("ORTPASS_BENCH_TINY", "1")
    bench = _load("weight_gradient_gemm")
    step = bench.step(rounds=1)
    layers = sys.modules["hf_memory"].LAYERS
    assert step["gemms_rewritten"] == 7 * layers + 1  # q, k, v, o, gate, up, down a layer, and the vocabulary head
    assert step["max_rel_diff_of_outputs"] < 1e-5  # the same loss and gradients
    assert "| transposed-gemm-as-matmul |" in bench.markdown(
        {"cpus": 2, "cpu_model": "x", "onnxruntime": "y", "rounds": 1, "load": [0.0, 0.0], "products": bench.products(1), "step": step}
    )
