"""Side by side: ortpass's recompute analysis and ORT 1.19.2's own (C++ memory optimizer).

ORT's analysis (``TrainingAgent.get_serialized_ortmodule_memory_stat``) runs on the graph
ORTModule would run: ORT's gradient graph with a YieldOp between forward and backward,
after the session's optimizations.  We give ORT the forward part of our training graph
(with the outputs its gradient builder needs already added) and ortpass the training
graph itself, so both start from the same forward nodes.

Cases:
- ``gpt<N>``: the GPT-like decoder of ``ortpass.testing.models`` (hidden 64, 4 heads),
  symbolic batch and seq, probe level 1 (advanced), no layer boundary;
- ``dropout``: x -> Dropout -> MatMul -> loss, where both Dropout outputs are stashed: ORT
  counts only one of them.

For every plan ORT reports: does ortpass have a plan with the same cluster and frequency,
and if not, why.  Results go to ``recompute_vs_ort_analysis.json`` and ``.md`` next to this
script.  Run: ``python3 benchmarks/recompute_vs_ort_analysis.py``.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import tempfile

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import torch

from ortpass.analysis import find_recompute_candidates, get_partition, get_training_info
from ortpass.analysis.partition import TrainingInfo, set_training_info, tag
from ortpass.export import export
from ortpass.testing.models import GPTDecoder
from ortpass.training import build_training_graph

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the recorded results, apart from the scripts


def forward_model_for_ort(training: ir.Model) -> onnx.ModelProto:
    """The forward part of ``training`` as a forward+loss model with parameters as initializers."""
    proto = ir.to_proto(training)
    info = get_training_info(training)
    partition = get_partition(training)
    forward_names = {n.name for n in partition.forward}
    params = set(info.params)
    graph = proto.graph
    nodes = [n for n in graph.node if n.name in forward_names]
    for n in nodes:
        del n.metadata_props[:]
    inputs = [i for i in graph.input if i.name not in params]
    outputs = [oh.make_tensor_value_info(info.loss, onnx.TensorProto.FLOAT, [])]
    fwd = oh.make_graph(nodes, "forward", inputs, outputs, list(graph.initializer), value_info=list(graph.value_info))
    return oh.make_model(fwd, opset_imports=list(proto.opset_import), ir_version=min(proto.ir_version, 8))


def ort_module_gradient_graph(forward: onnx.ModelProto, params: list[str]):
    """ORTModule's gradient graph of ``forward`` (forward, YieldOp, backward), as ORT's
    memory optimizer expects it, and ORT's graph info (input and trained names)."""
    import onnxruntime.capi._pybind_state as C

    config = C.OrtModuleGraphBuilderConfiguration()
    config.initializer_names = list(params)
    config.initializer_names_to_train = list(params)
    config.input_names_require_grad = []
    config.build_gradient_graph = True
    builder = C.OrtModuleGraphBuilder()
    builder.initialize(forward.SerializeToString(), config)
    builder.build(C.TrainingGraphTransformerConfiguration())
    return builder.get_gradient_model(), builder.get_graph_info()


def ort_training_agent(session, graph_info):
    """ORT's TrainingAgent over a session of ORTModule's gradient graph (CPU feeds/fetches)."""
    import onnxruntime.capi._pybind_state as C

    device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    feeds = list(graph_info.user_input_names) + list(graph_info.initializer_names_to_train)
    fetches = [f"{p}_grad" for p in graph_info.initializer_names_to_train]
    return C.TrainingAgent(session._sess, feeds, [device] * len(feeds), fetches, [device] * len(fetches), 0)


def ort_memory_stat(
    forward: onnx.ModelProto, params: list[str], probe: str = "1:0", optimized_path: str | None = None
) -> dict[str, tuple[str, int]]:
    """ORT's recompute plans: {plan string: (symbolic saving, frequency)}; the graph ORT
    analysed (its YieldOp gradient graph after session optimizations) goes to
    ``optimized_path`` when given."""
    import onnxruntime as ort

    gradient_model, graph_info = ort_module_gradient_graph(forward, params)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if optimized_path:
        options.optimized_model_filepath = optimized_path
    session = ort.InferenceSession(gradient_model, options, providers=["CPUExecutionProvider"])
    agent = ort_training_agent(session, graph_info)
    with tempfile.TemporaryDirectory() as tmp:
        config_file = os.path.join(tmp, "plans.json")
        with open(config_file, "w") as f:
            json.dump([], f)
        table, stats = agent.get_serialized_ortmodule_memory_stat(config_file, probe, True)
    ort_memory_stat.last_table = table  # ORT's own printout, kept for the record
    return {plan: (str(symbolic), int(freq)) for plan, (symbolic, freq) in stats.items()}


_ROW = re.compile(r"^\|(\d+)\s*\|")
_OPTION = re.compile(r">>Option \d+\s*: (Recompute|RecomputeWithCompromise) subgraph (\S+)")


def ort_table_frequencies(table: str) -> dict[str, int]:
    """Total frequency per plan string, read from ORT's printed table.

    ORT's returned dict is keyed by plan string, but ORT clusters by plan string *and*
    the order of the stashed outputs (which follows a per-process hash order), so clusters
    with equal plan strings overwrite each other there; its table lists every cluster.
    """
    totals: dict[str, int] = collections.Counter()
    frequency = 0
    for line in table.splitlines():
        row = _ROW.match(line)
        if row:
            frequency = int(row.group(1))
        option = _OPTION.search(line)
        if option:
            plan_type = 1 if option.group(1) == "Recompute" else 2
            totals[f"{option.group(2)}:{plan_type}:-1"] += frequency
    return dict(totals)


def gpt_case(layers: int) -> ir.Model:
    torch.manual_seed(0)
    module = GPTDecoder(vocab=128, hidden=64, heads=4, layers=layers, max_seq=64, dropout=0.1)
    ids = torch.randint(0, 128, (4, 32))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}}
    return build_training_graph(export(module, (ids, ids), input_names=["input_ids", "labels"], dynamic_axes=axes))


def dropout_case() -> tuple[ir.Model, onnx.ModelProto]:
    """x[batch,1024] -> Dropout -> y -> MatMul W -> ReduceSum: backward reads y and the mask."""
    w = oh.make_tensor("W", onnx.TensorProto.FLOAT, [1024, 16], np.ones(1024 * 16, np.float32))
    ratio = oh.make_tensor("ratio", onnx.TensorProto.FLOAT, [], [0.1])
    training = oh.make_tensor("training", onnx.TensorProto.BOOL, [], [True])
    nodes = [
        oh.make_node("Dropout", ["x", "ratio", "training"], ["y", "mask"], name="dropout"),
        oh.make_node("MatMul", ["y", "W"], ["o"], name="matmul"),
        oh.make_node("ReduceSum", ["o"], ["loss"], name="sum", keepdims=0),
    ]
    graph = oh.make_graph(
        nodes, "dropout", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 1024])],
        [oh.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])], [w, ratio, training],
    )
    forward = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    # Our side: the same forward nodes and backward nodes reading what ORT's gradient reads
    # (DropoutGrad reads the mask; MatMul's weight gradient reads y).
    backward = [
        oh.make_node("Identity", ["mask"], ["mask_read"], name="dropout_grad"),
        oh.make_node("Identity", ["y"], ["y_read"], name="matmul_grad"),
    ]
    train_graph = oh.make_graph(
        nodes + backward, "train", list(graph.input),
        [oh.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in ("loss", "mask_read", "y_read")],
        [w, ratio, training],
        value_info=[oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 1024]),
                    oh.make_tensor_value_info("mask", onnx.TensorProto.BOOL, ["batch", 1024])],
    )
    model = ir.from_proto(oh.make_model(train_graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8))
    for node in model.graph:
        tag(node, "backward" if node.name.endswith("_grad") else "forward")
    set_training_info(model, TrainingInfo("loss", ("W",), {"W": "W_grad"}))
    return model, forward


def ort_session_graph(path: str, params: list[str], loss: str) -> ir.Model:
    """The graph ORT analysed, as an ortpass training graph: nodes before the YieldOp are
    forward (the YieldOp too), nodes after it backward."""
    # ORT leaves out the types of some values; onnx shape inference puts them back.
    model = ir.from_proto(onnx.shape_inference.infer_shapes(onnx.load(path)))
    side = "forward"
    for node in model.graph:
        tag(node, side)
        if node.op_type == "YieldOp":
            side = "backward"
    set_training_info(model, TrainingInfo(loss, tuple(params), {p: f"{p}_grad" for p in params}))
    return model


def compare(name: str, training: ir.Model, forward: onnx.ModelProto, params: list[str], dims: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        optimized = os.path.join(tmp, "ort_session_graph.onnx")
        ort_plans = ort_memory_stat(forward, params, optimized_path=optimized)
        ort_table_freq = ort_table_frequencies(ort_memory_stat.last_table)
        ort_graph = ort_session_graph(optimized, params, get_training_info(training).loss)
    # Same graph as ORT: every stashed activation ORT sees, ortpass sees.
    report = find_recompute_candidates(ort_graph, dims=dims)
    own = find_recompute_candidates(training, dims=dims)
    ours = {p.plan_string: p for p in report.plans}
    rows = []
    for plan in sorted(set(ort_plans) | set(ort_table_freq)):
        symbolic, freq = ort_plans.get(plan, (None, 0))
        mine = ours.get(plan)
        rows.append({
            "plan": plan,
            "ort_frequency": freq,
            "ort_table_frequency": ort_table_freq.get(plan, 0),
            "ort_symbolic": symbolic,
            "ortpass_frequency": mine.frequency if mine else 0,
            "ortpass_symbolic": str(mine.symbolic_saving) if mine else None,
            "ortpass_saving_bytes": mine.saving_bytes if mine else None,
        })
    only_ours = [
        {"plan": p.plan_string, "frequency": p.frequency, "symbolic": str(p.symbolic_saving)}
        for p in report.plans if p.plan_string not in ort_plans and p.plan_string not in ort_table_freq
    ]
    skipped = [s.to_dict() for s in report.skipped]
    return {"case": name, "ort_table": ort_memory_stat.last_table, "dims": report.dims, "ort_plans": rows, "only_ortpass": only_ours, "ortpass_skipped": skipped,
            "ortpass_table_on_ort_graph": report.to_table(), "ortpass_table_on_own_training_graph": own.to_table()}


FINDINGS = """\
Both analyses run on the same graph: the one ORT's analysis sees (its YieldOp gradient graph
after session optimizations, so FusedMatMul, Gelu fusion etc. are there).  ORT's returned
dict is keyed by plan string and loses clusters whose plan strings collide (LayerNorm x1 in
the dict, x5/x9 in its table; Dropout+ and Gelu+ missing from the dict): frequencies are
compared with ORT's printed table.

- Same plans, same frequencies: ConstantOfShape+Trilu+, FusedMatMul+Add+,
  FusedMatMul+Add+Dropout+, FusedMatMul+Add+Split+Reshape+Transpose+,
  FusedMatMul+Where+Softmax+, LayerNormalization+, MatMul+Transpose+Reshape+,
  Slice+Gather+Add+, Dropout+.
- Undercount: ORT's symbolic saving counts one stashed output per node.  LayerNorm: ORT's
  table lists 3 stashed outputs (Y, mean, inv-std-dev) but its saving is `batch*seq*1*4`
  (one of them); ortpass counts all three: 264*batch*seq bytes per LayerNorm at hidden 64
  (64*4 + 4 + 4).  Attention Dropout: ORT's table lists y and the mask; ortpass counts
  both (4 + 1 bytes per element, `40*batch*seq**2` for 2 nodes of 4 heads).  In the
  `dropout` case ORT's session graph stashes only y, and both report `4096*batch`; on
  ortpass's own training graph (y and mask stashed) ortpass reports `5120*batch`
  (see `ortpass_table_on_own_training_graph` in the JSON).
- Reshape+ (ORT x1, ortpass none): the labels Reshape is a view of the graph input
  `labels`; recomputing it frees nothing.  ORT counts `batch*seq*8` bytes that are not saved.
- Unsqueeze+ (ORT x1, ortpass none): a 1-element int64 tensor; ortpass applies the size
  floor to stashed buffers too (ORT applies it only to inputs it follows).
- Gelu+ (ORT x2) vs ortpass Gelu+ x1 + Gelu+Reshape+ x1: for one Gelu, backward reads only a
  Reshape view of its output.  ORT attributes the stash to the Gelu (ReuseFreq); ortpass
  recomputes the Gelu and the view together.  Same buffer, same saving.
- Add+ (ORT table x4/x8, no saving in its dict) vs ortpass FusedMatMul+Add+Dropout+Add+:
  the residual Add.  ORT stops at the Dropout output and lists the Add's output as reusing
  a buffer (its analysis consults ORT's allocation plan; ortpass models views only).
  ortpass grows through the Dropout, whose output backward does not read.
"""


def to_markdown(results: list[dict]) -> str:
    lines = ["# Recompute analysis: ortpass vs ORT 1.19.2 (probe level 1)", "", FINDINGS]
    for result in results:
        lines += [f"## {result['case']}", "",
                  "| ORT plan | ORT freq (dict / table) | ORT symbolic (dict) | ortpass freq | ortpass symbolic |",
                  "|---|---|---|---|---|"]
        for row in result["ort_plans"]:
            lines.append(f"| `{row['plan']}` | {row['ort_frequency']} / {row['ort_table_frequency']} | "
                         f"`{row['ort_symbolic']}` | {row['ortpass_frequency']} | `{row['ortpass_symbolic']}` |")
        lines += ["", "Plans only ortpass reports:", ""]
        lines += [f"- `{p['plan']}` x{p['frequency']}: `{p['symbolic']}`" for p in result["only_ortpass"]] or ["- none"]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    results = []
    model, forward = dropout_case()
    results.append(compare("dropout", model, forward, ["W"], {"batch": 8}))
    for layers in (2, 4):
        training = gpt_case(layers)
        params = list(get_training_info(training).params)
        results.append(compare(f"gpt{layers}", training, forward_model_for_ort(training), params, None))
    for result in results:
        print(f"== {result['case']}")
        for row in result["ort_plans"]:
            print(f"  {row['plan']:<45} ORT dict x{row['ort_frequency']:<3} table x{row['ort_table_frequency']:<3} "
                  f"ortpass x{row['ortpass_frequency']:<3} "
                  f"ORT {row['ort_symbolic']}  |  ortpass {row['ortpass_symbolic']}")
        for p in result["only_ortpass"]:
            print(f"  only ortpass: {p['plan']:<35} x{p['frequency']}  {p['symbolic']}")
    (RESULTS / "recompute_vs_ort_analysis.json").write_text(json.dumps(results, indent=1))
    (RESULTS / "recompute_vs_ort_analysis.md").write_text(to_markdown(results))


if __name__ == "__main__":
    main()
