"""ortpass numbers a graph's nodes for ONNX Runtime so that ORT's priority sort keeps few
nodes waiting, and ORT still runs the nodes in the same order, to the same results."""

from __future__ import annotations

import bisect
import glob
import json
import random

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ortpass.runtime.idle_transformers import idle_transformers
from ortpass.runtime.node_numbering import number_for_ort
import ortpass.runtime.node_numbering as node_numbering
from ortpass.io import load
from ortpass.runtime.session import DISABLED_ORT_OPTIMIZERS, disabled_optimizers

pytestmark = pytest.mark.stock

ort = pytest.importorskip("onnxruntime")

CHAIN, EARLY = 40, 10


def _model(nodes, inputs, outputs) -> onnx.ModelProto:
    proto = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs), opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8  # readable by ORT 1.19.2
    return proto


def _vector(name: str):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [4])


def _chain_and_early_leaves() -> onnx.ModelProto:
    """A chain of CHAIN Sin nodes, then EARLY ``Neg(x)``s, listed last but ready from the
    start: ORT's priority sort keeps them waiting while the whole chain passes."""
    nodes = [helper.make_node("Sin", [f"a{i}" if i else "x"], [f"a{i + 1}"], name=f"sin{i}") for i in range(CHAIN)]
    nodes += [helper.make_node("Neg", ["x"], [f"b{i}"], name=f"neg{i}") for i in range(EARLY)]
    return _model(nodes, [_vector("x")], [_vector(f"a{CHAIN}"), *(_vector(f"b{i}") for i in range(EARLY))])


def _priority_sort_waiting(proto: onnx.ModelProto) -> float:
    """ORT's priority sort (``Graph::KahnsTopologicalSort`` with ``PriorityNodeCompare``)
    replayed: ready nodes wait in a sorted list, ``Shape`` and ``Size`` first and then the
    lowest number; returns the list's mean length when a node is inserted (what each
    insertion walks).  Numbers: graph order, ``Constant`` nodes left out as ORT does."""
    nodes = [node for node in proto.graph.node if node.op_type != "Constant"]
    made_by = {name: i for i, node in enumerate(nodes) for name in node.output}
    edges = [[made_by[name] for name in node.input if name in made_by] for node in nodes]
    readers: list[list[int]] = [[] for _ in nodes]
    for node, producers in enumerate(edges):
        for producer in producers:
            readers[producer].append(node)
    missing = [len(producers) for producers in edges]
    key = [(node.op_type not in ("Shape", "Size"), i) for i, node in enumerate(nodes)]
    waiting, lengths = [], []
    for node in (i for i, count in enumerate(missing) if count == 0):
        lengths.append(len(waiting))
        bisect.insort(waiting, key[node])
    while waiting:
        _, node = waiting.pop(0)
        for reader in readers[node]:
            missing[reader] -= 1
            if missing[reader] == 0:
                lengths.append(len(waiting))
                bisect.insort(waiting, key[reader])
    return sum(lengths) / len(lengths)


def _execution_order(proto: onnx.ModelProto, feeds: dict, tmp_path, name: str, disabled=None) -> tuple[list[str], list[np.ndarray]]:
    """The order ORT ran the nodes in (its profiler) and the outputs, one thread, in a
    session given ``proto`` as it is: optimized as ortpass's sessions are when ``disabled``
    (the transformers left out) is given, not optimized otherwise."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / name)
    if disabled is None:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the nodes as given
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"],
                                   disabled_optimizers=disabled or [])  # fmt: skip
    outputs = session.run(None, feeds)
    with open(session.end_profiling(), encoding="utf-8") as f:
        events = json.load(f)
    ran = [e["name"][: -len("_kernel_time")] for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    return ran, outputs


def _renumbered(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    return copy, number_for_ort(copy.graph)


def test_a_node_ready_early_is_numbered_so_it_does_not_wait_and_ort_runs_the_same_order(tmp_path):
    proto = _chain_and_early_leaves()
    numbered, changed = _renumbered(proto)
    assert changed
    before, after = _priority_sort_waiting(proto), _priority_sort_waiting(numbered)
    assert before > EARLY * 0.75 and after < before / 4, (before, after)
    feeds = {"x": np.linspace(-1, 1, 4, dtype=np.float32)}
    order, outputs = _execution_order(proto, feeds, tmp_path, "given")
    numbered_order, numbered_outputs = _execution_order(numbered, feeds, tmp_path, "numbered")
    assert numbered_order == order and len(order) == CHAIN + EARLY
    for got, want in zip(numbered_outputs, outputs):
        np.testing.assert_array_equal(got, want)


def test_a_graph_whose_nodes_wait_for_nothing_keeps_its_numbers():
    chain = _model(
        [helper.make_node("Sin", [f"a{i}" if i else "x"], [f"a{i + 1}"]) for i in range(5)], [_vector("x")], [_vector("a5")]
    )
    before = chain.SerializeToString()
    assert not number_for_ort(chain.graph)
    assert chain.SerializeToString() == before


def test_the_walk_order_ort_takes_between_inputs_is_kept():
    """At ``Add(a, b)`` ORT walks the producer with the higher number first, so swapping
    two independent producers would swap when they run: the numbering keeps their order."""
    proto = _model(
        [
            helper.make_node("Sin", ["x"], ["s"], name="sin"),
            helper.make_node("Cos", ["x"], ["c"], name="cos"),
            helper.make_node("Add", ["c", "s"], ["y"], name="add"),
            helper.make_node("Neg", ["x"], ["n"], name="neg"),  # ready early, numbered last
        ],
        [_vector("x")],
        [_vector("y"), _vector("n")],
    )
    numbered, _ = _renumbered(proto)
    names = [node.name for node in numbered.graph.node]
    assert names.index("sin") < names.index("cos")


def test_a_numbering_that_would_change_ort_s_order_is_not_applied(monkeypatch, caplog):
    """The check before the graph changes: a numbering whose default order differs (here,
    the chain's leaves swapped) leaves the graph as it was, with a warning."""
    proto = _chain_and_early_leaves()
    before = proto.SerializeToString()
    monkeypatch.setattr(node_numbering, "_numbering", lambda producers: list(reversed(range(len(producers)))))
    with caplog.at_level("WARNING", logger="ortpass.runtime.node_numbering"):
        assert not number_for_ort(proto.graph)
    assert proto.SerializeToString() == before
    assert "would change ORT's execution order" in caplog.text


def test_constant_nodes_go_first_in_their_order():
    nodes = [
        helper.make_node("Sin", ["x"], ["s"]),
        helper.make_node("Constant", [], ["k1"], value=helper.make_tensor("k1v", TensorProto.FLOAT, [4], [1, 2, 3, 4])),
        helper.make_node("Mul", ["s", "k1"], ["m"]),
        helper.make_node("Constant", [], ["k2"], value=helper.make_tensor("k2v", TensorProto.FLOAT, [4], [4, 3, 2, 1])),
        helper.make_node("Add", ["m", "k2"], ["y"]),
    ]
    proto = _model(nodes, [_vector("x")], [_vector("y")])
    assert number_for_ort(proto.graph)
    assert [node.output[0] for node in proto.graph.node[:2]] == ["k1", "k2"]
    assert [node.output[0] for node in proto.graph.node[2:]] == ["s", "m", "y"]


def test_a_value_a_subgraph_reads_counts_as_an_edge(tmp_path):
    """An ``If`` branch reading an outer value makes ORT give the If an edge from its
    producer: the numbering keeps it, and ORT runs the same order to the same results."""
    branch = helper.make_graph([helper.make_node("Neg", ["s"], ["out"])], "branch", [], [_vector("out")])
    nodes = [
        helper.make_node("Sin", ["x"], ["s"], name="sin"),
        helper.make_node("Cos", ["x"], ["c"], name="cos"),
        helper.make_node("If", ["cond"], ["y"], name="if", then_branch=branch, else_branch=branch),
        helper.make_node("Add", ["y", "c"], ["z"], name="add"),
        helper.make_node("Neg", ["x"], ["n"], name="neg"),
    ]
    proto = _model(nodes, [_vector("x"), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])], [_vector("z"), _vector("n")])
    numbered, changed = _renumbered(proto)
    assert changed
    names = [node.name for node in numbered.graph.node]
    assert names.index("sin") < names.index("if")  # the If reads the Sin's output inside its branch
    feeds = {"x": np.linspace(-1, 1, 4, dtype=np.float32), "cond": np.array(True)}
    order, outputs = _execution_order(proto, feeds, tmp_path, "given")
    numbered_order, numbered_outputs = _execution_order(numbered, feeds, tmp_path, "numbered")
    assert numbered_order == order
    for got, want in zip(numbered_outputs, outputs):
        np.testing.assert_array_equal(got, want)


def _feeds(proto: onnx.ModelProto, batch: tuple[int, int], vocab: int) -> dict:
    """Every graph input: weights at random, ids and labels below ``vocab``; a dim without a
    size is the batch's on its axis."""
    rng = np.random.default_rng(0)
    feeds = {}
    for value in proto.graph.input:
        tensor = value.type.tensor_type
        shape = [d.dim_value or batch[axis] for axis, d in enumerate(tensor.shape.dim)]
        if tensor.elem_type == TensorProto.INT64:
            feeds[value.name] = rng.integers(0, vocab, shape, dtype=np.int64)
        else:
            feeds[value.name] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    return feeds


def test_a_training_graph_runs_the_same_order_to_the_same_step_with_few_nodes_waiting(tmp_path):
    """ORTModule's training graph of a 4-layer decoder (the training build's gradient
    builder, or the torch builder on stock), run as ortpass's sessions optimize it: ORT runs
    the numbered graph's nodes in the order it runs the graph as built, to bitwise the same
    loss and gradients, and its priority sort keeps a few nodes waiting, not dozens."""
    from ortpass.runtime.module import ORTModule
    from ortpass.testing.models import GPTDecoder

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    cache = tmp_path / "cache"
    ORTModule(GPTDecoder(vocab=64, hidden=32, heads=4, layers=4, dropout=0.0), cache_dir=cache, threads=1)(ids, ids).backward()
    (path,) = glob.glob(str(cache / "*.onnx"))
    proto = onnx.load(path)
    numbered, changed = _renumbered(proto)
    assert changed
    before, after = _priority_sort_waiting(proto), _priority_sort_waiting(numbered)
    assert after < before / 3, (before, after)
    disabled = disabled_optimizers(load(path)) + idle_transformers(proto)
    feeds = _feeds(proto, tuple(ids.shape), 64)
    order, outputs = _execution_order(proto, feeds, tmp_path, "given", disabled)
    numbered_order, numbered_outputs = _execution_order(numbered, feeds, tmp_path, "numbered", disabled)
    assert numbered_order == order and len(order) > 300
    for got, want in zip(numbered_outputs, outputs):
        np.testing.assert_array_equal(got, want)


def _random_graph(seed: int, steps: int = 16) -> onnx.ModelProto:
    """Random 4x4 float graphs of ops ORT rewrites on its own: eliminated (Identity, no-op
    Cast, inference Dropout, Not before Where) and fused (MatMul then Add into Gemm,
    Transpose into MatMul), among plain unary and binary ops."""
    rng = random.Random(seed)
    values, nodes = ["x"], []
    for i in range(steps):
        kind, out = rng.choice(["unary", "unary", "binary", "binary", "Identity", "Cast", "Dropout", "Transpose",
                                "MatMul", "MatMul+Add", "Not+Where"]), f"v{i}"  # fmt: skip
        pick = lambda: rng.choice(values)  # noqa: E731
        if kind == "unary":
            nodes.append(helper.make_node(rng.choice(["Sin", "Cos", "Neg", "Sigmoid", "Relu"]), [pick()], [out], name=f"n{i}"))
        elif kind == "binary":
            nodes.append(helper.make_node(rng.choice(["Add", "Mul", "Sub", "Div"]), [pick(), pick()], [out], name=f"n{i}"))
        elif kind == "Cast":
            nodes.append(helper.make_node("Cast", [pick()], [out], name=f"n{i}", to=TensorProto.FLOAT))
        elif kind == "Transpose":
            nodes.append(helper.make_node("Transpose", [pick()], [out], name=f"n{i}", perm=[1, 0]))
        elif kind == "MatMul":
            nodes.append(helper.make_node("MatMul", [pick(), pick()], [out], name=f"n{i}"))
        elif kind == "MatMul+Add":
            nodes.append(helper.make_node("MatMul", [pick(), pick()], [f"{out}m"], name=f"n{i}m"))
            nodes.append(helper.make_node("Add", [f"{out}m", pick()], [out], name=f"n{i}"))
        elif kind == "Not+Where":
            nodes.append(helper.make_node("Less", [pick(), pick()], [f"{out}l"], name=f"n{i}l"))
            nodes.append(helper.make_node("Not", [f"{out}l"], [f"{out}n"], name=f"n{i}n"))
            nodes.append(helper.make_node("Where", [f"{out}n", pick(), pick()], [out], name=f"n{i}"))
        else:
            nodes.append(helper.make_node(kind, [pick()], [out], name=f"n{i}"))
        values.append(out)
    read = {name for node in nodes for name in node.input}
    square = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [4, 4])  # noqa: E731
    return _model(nodes, [square("x")], [square(v) for v in values[1:] if v not in read])


def _orders_that_change(tmp_path, seeds) -> int:
    """How many of the random graphs ORT, optimizing as ortpass's sessions do, runs in
    another order once numbered; each runs to bitwise the same outputs either way."""
    feeds = {"x": np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)}
    changed = 0
    for seed in seeds:
        proto = _random_graph(seed)
        numbered, renumbered = _renumbered(proto)
        if not renumbered:
            continue
        try:
            order, outputs = _execution_order(proto, feeds, tmp_path, "given", list(DISABLED_ORT_OPTIMIZERS))
        except Exception:  # noqa: BLE001  1.19.2's MatMulAddFusion can drop a Gemm input ORT then misses
            continue
        numbered_order, numbered_outputs = _execution_order(numbered, feeds, tmp_path, "numbered", list(DISABLED_ORT_OPTIMIZERS))
        changed += numbered_order != order
        for got, want in zip(numbered_outputs, outputs):
            np.testing.assert_array_equal(got, want)
    return changed


def test_through_ort_s_own_eliminations_and_fusions_the_order_holds(tmp_path):
    assert _orders_that_change(tmp_path, range(60)) == 0


def test_without_the_stand_ins_ort_s_rewrites_change_the_order(tmp_path, monkeypatch):
    """The stand-ins are what keeps the order through ORT's rewrites: without them some of
    the same random graphs run in another order."""
    monkeypatch.setattr(node_numbering, "STAND_INS", 0)
    assert _orders_that_change(tmp_path, range(60)) > 0
