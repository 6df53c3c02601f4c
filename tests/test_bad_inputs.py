"""The bad-input corpus: every public entry point refuses malformed input with an error that
names the problem, and leaves its input alone.

Each row of ``CASES`` is one bad input: how to make it (a model in memory, a file, or both),
the entry point it is given to, the error type expected and a regex the message must match
(the file, node, value, option or plan string at fault).  For every row the test also
checks that the in-memory model serializes to the same bytes after the failed call and
that every input file has the same bytes and modification time.

``SKIPS`` are inputs a pass must not rewrite but also must not refuse (ORT's conditions for
the rewrite do not hold): the pass reports ``modified=False``, leaves the bytes as they
were, and says why in its statistics or log.

The inputs are generated here, from the table, rather than stored: each case reads as
what is wrong with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io as _io
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest

import ortpass
from ortpass import io
from ortpass.conventions import EXPORT_KEY
from ortpass.errors import (
    ModelLoadError,
    OrtpassError,
    PassOrderingError,
    PipelineSpecError,
    PlanError,
    TrainingGraphError,
    UnregisteredFunctionError,
)
from ortpass.testing.graphs import (
    GraphRecipe,
    LossRecipe,
    Step,
    build_model,
    make_batch,
    params_of,
)

FLOAT, INT64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
#: The longest error message any entry point may give (long values are elided).
MAX_MESSAGE = 2000
MS = "com.microsoft"


# -- inputs ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Input:
    """What a case hands to its entry point: a model, the file it was written to, and any
    other files the call reads (plan files)."""

    model: ir.Model | None = None
    path: Path | None = None
    files: list[Path] = dataclasses.field(default_factory=list)

    def all_files(self) -> list[Path]:
        return [p for p in [self.path, *self.files] if p is not None]


def _snapshot(inp: Input) -> tuple:
    model = ir.to_proto(inp.model).SerializeToString() if inp.model is not None else None
    files = []
    for path in inp.all_files():
        if path.exists() and not path.is_dir() and not path.is_file():  # a FIFO, a device: never read
            files.append((str(path), "special", path.stat().st_mtime_ns))
        elif path.is_dir():
            files.append((str(path), sorted(os.listdir(path)), path.stat().st_mtime_ns))
        elif path.exists():
            files.append((str(path), path.read_bytes(), path.stat().st_mtime_ns))
        else:
            files.append((str(path), None, None))
    return model, files


RECIPE = GraphRecipe(
    batch_shape=(4, 6),
    steps=(Step("MatMul", width=8), Step("Gelu"), Step("Dropout"), Step("MatMul", width=8)),
    loss=LossRecipe("sce", classes=5, reduction="mean", ignore_index=True),
)


def _forward() -> ir.Model:
    return build_model(RECIPE)


_TRAINING_CACHE: list[bytes] = []


def _training() -> ir.Model:
    """The training graph of RECIPE (built once; every case gets its own copy)."""
    if not _TRAINING_CACHE:
        from ortpass.training import build_training_graph

        forward = _forward()
        _TRAINING_CACHE.append(ir.to_proto(build_training_graph(forward, params=params_of(forward))).SerializeToString())
    return ir.from_proto(onnx.load_from_string(_TRAINING_CACHE[0]))


def _without_training_record(model: ir.Model) -> ir.Model:
    """A training graph whose training-graph record was removed (its nodes keep their tags)."""
    from ortpass.conventions import TRAINING_KEY

    del model.metadata_props[TRAINING_KEY]
    return model


def _graph(nodes, inputs=None, outputs=None, inits=(), *, opsets=(("", 17),), ir_version=8, value_info=()):
    """A small forward model from onnx.helper pieces: x[2,3] @ w[3,3] ... -> loss."""
    inputs = inputs if inputs is not None else [oh.make_tensor_value_info("x", FLOAT, [2, 3])]
    outputs = outputs if outputs is not None else [oh.make_tensor_value_info("loss", FLOAT, [])]
    inits = list(inits) or [onnx.numpy_helper.from_array(np.ones((3, 3), np.float32), "w")]
    graph = oh.make_graph(nodes, "bad", inputs, outputs, inits, value_info=list(value_info))
    return oh.make_model(graph, opset_imports=[oh.make_opsetid(d, v) for d, v in opsets], ir_version=ir_version)


def _mm(out="h"):
    return oh.make_node("MatMul", ["x", "w"], [out], name="mm")


def _sum(src, axes=None):
    if axes is None:
        return oh.make_node("ReduceSum", [src], ["loss"], name="L", keepdims=0)
    return oh.make_node("ReduceSum", [src], ["loss"], name="L", keepdims=0, axes=axes)


def model_input(proto_or_model) -> Callable[[Path], Input]:
    """A case input: the model in memory and saved to ``model.onnx``."""

    def make(tmp: Path) -> Input:
        proto = proto_or_model() if callable(proto_or_model) else proto_or_model
        if isinstance(proto, ir.Model):
            proto = ir.to_proto(proto)
        path = tmp / "model.onnx"
        onnx.save(proto, str(path))
        return Input(model=ir.from_proto(proto), path=path)

    return make


def memory_input(make_model: Callable[[], ir.Model]) -> Callable[[Path], Input]:
    """A case input built in memory that onnx_ir could not read back from its file (the
    file is written for the record and must stay untouched too)."""

    def make(tmp: Path) -> Input:
        model = make_model()
        path = tmp / "model.onnx"
        onnx.save(ir.to_proto(model), str(path))
        return Input(model=model, path=path)

    return make


def file_input(name: str, content: bytes | None = None, *, directory: bool = False) -> Callable[[Path], Input]:
    """A case input that is only a file (or a directory, or nothing) at ``tmp/name``."""

    def make(tmp: Path) -> Input:
        path = tmp / name
        if directory:
            path.mkdir()
        elif content is not None:
            path.write_bytes(content)
        return Input(path=path)

    return make


def _good_bytes() -> bytes:
    return ir.to_proto(_forward()).SerializeToString()


def with_plan_file(content: str | None, name="plans.json", *, directory=False) -> Callable[[Path], Input]:
    def make(tmp: Path) -> Input:
        inp = model_input(_training)(tmp)
        plan = tmp / name
        if directory:
            plan.mkdir()
        elif content is not None:
            plan.write_text(content)
        inp.files.append(plan)
        return inp

    return make


# -- bad models -----------------------------------------------------------------------------


def ir_too_new() -> onnx.ModelProto:
    proto = ir.to_proto(_forward())
    proto.ir_version = 99
    return proto


def opset_too_new(model: Callable[[], ir.Model]) -> Callable[[], onnx.ModelProto]:
    def make() -> onnx.ModelProto:
        proto = ir.to_proto(model())
        for opset in proto.opset_import:
            if opset.domain in ("", "ai.onnx"):
                opset.version = 22
        return proto

    return make


def cycle() -> onnx.ModelProto:
    # a = x + b; b = Relu(a): each node reads the other's output.
    nodes = [
        oh.make_node("Add", ["x", "b"], ["a"], name="A"),
        oh.make_node("Relu", ["a"], ["b"], name="B"),
        _sum("b"),
    ]
    return _graph(nodes, inits=[onnx.numpy_helper.from_array(np.ones((1,), np.float32), "unused")])


def dangling() -> onnx.ModelProto:
    return _graph([_mm(), oh.make_node("Add", ["h", "ghost"], ["a"], name="add"), _sum("a")])


def unknown_domain(import_it: bool) -> Callable[[], onnx.ModelProto]:
    def make() -> onnx.ModelProto:
        nodes = [_mm(), oh.make_node("Baz", ["h"], ["a"], name="baz", domain="foo.bar"), _sum("a")]
        opsets = (("", 17), ("foo.bar", 1)) if import_it else (("", 17),)
        return _graph(nodes, opsets=opsets)

    return make


def unknown_op() -> onnx.ModelProto:
    return _graph([_mm(), oh.make_node("NotAnOp", ["h"], ["a"], name="nop"), _sum("a")])


PYTHONOP_ATTRS = dict(
    func_name="nowhere.NotRegistered",
    input_convention="d",
    input_tensor_types=[FLOAT],
    input_tensor_ranks=[2],
    input_requires_grads=[1],
    output_tensor_types=[FLOAT],
    output_tensor_ranks=[2],
    training_mode=1,
)


def pythonop(**attrs) -> Callable[[], onnx.ModelProto]:
    def make() -> onnx.ModelProto:
        node = oh.make_node("PythonOp", ["h"], ["ctx", "a"], name="py", domain=MS, **attrs)
        return _graph([_mm(), node, _sum("a")], opsets=(("", 17), (MS, 1)))

    return make


def float_labels() -> onnx.ModelProto:
    sce = oh.make_node("SoftmaxCrossEntropyLoss", ["h", "labels"], ["loss"], name="L", reduction="mean",
                       ignore_index=-100)
    inputs = [oh.make_tensor_value_info("x", FLOAT, [2, 3]), oh.make_tensor_value_info("labels", FLOAT, [2])]
    return _graph([_mm(), sce], inputs=inputs, value_info=[oh.make_tensor_value_info("h", FLOAT, [2, 3])])


def duplicate_value_proto() -> onnx.ModelProto:
    # Both MatMul and Relu write 'h'.
    return _graph([_mm(), oh.make_node("Relu", ["x"], ["h"], name="r"), _sum("h")])


def duplicate_value_model() -> ir.Model:
    """The same mistake in memory (onnx_ir does not forbid two values sharing a name)."""
    model = ir.from_proto(_graph([_mm(), oh.make_node("Relu", ["x"], ["r_out"], name="r"),
                                  oh.make_node("Add", ["h", "r_out"], ["a"], name="add"), _sum("a")]))
    relu = next(n for n in model.graph if n.name == "r")
    relu.outputs[0].name = "h"
    return model


def unproduced_output() -> onnx.ModelProto:
    outputs = [oh.make_tensor_value_info("loss", FLOAT, []), oh.make_tensor_value_info("z", FLOAT, [2])]
    return _graph([_mm(), _sum("h")], outputs=outputs)


def vector_loss() -> onnx.ModelProto:
    # ReduceSum over axis 1 only: the "loss" is a [2] vector (opset 12: axes attribute).
    return _graph([_mm(), _sum("h", axes=[1])], outputs=[oh.make_tensor_value_info("loss", FLOAT, [2])],
                  opsets=(("", 12),))


def without_shapes() -> ir.Model:
    """RECIPE's training graph with every intermediate shape forgotten."""
    model = _training()
    for node in model.graph:
        for value in node.outputs:
            value.shape = None
    return model


def logits_of_unknown_shape() -> ir.Model:
    """SCE whose logits come from an op ONNX has no schema for, with no shape recorded:
    nothing can tell their rank."""
    sce = oh.make_node("SoftmaxCrossEntropyLoss", ["h", "labels"], ["loss"], name="L", reduction="mean",
                       ignore_index=-100)
    inputs = [oh.make_tensor_value_info("x", FLOAT, [2, 3]), oh.make_tensor_value_info("labels", INT64, [2])]
    mystery = oh.make_node("Mystery", ["x"], ["h"], name="mystery", domain="custom.ops")
    return ir.from_proto(_graph([mystery, sce], inputs=inputs, opsets=(("", 17), ("custom.ops", 1))))


# -- entry points ---------------------------------------------------------------------------


def load(inp: Input):
    return io.load(inp.path)


def build(**kwargs) -> Callable[[Input], Any]:
    def call(inp: Input):
        from ortpass.training import build_training_graph

        return build_training_graph(inp.model, **kwargs)

    return call


def run_pipeline(spec: str, **kwargs) -> Callable[[Input], Any]:
    def call(inp: Input):
        return ortpass.pipeline(spec, **kwargs)(inp.model)

    return call


def make_pipeline(spec: str) -> Callable[[Input], Any]:
    return lambda inp: ortpass.pipeline(spec)


def session(inp: Input):
    from ortpass.runtime import TrainingSession

    return TrainingSession(inp.model)


def session_run(batch: Callable[[], dict], params: dict | None = None) -> Callable[[Input], Any]:
    def call(inp: Input):
        from ortpass.runtime import TrainingSession

        return TrainingSession(inp.model).run(batch(), params)

    return call


def prepare(inp: Input):
    from ortpass.pythonop import bridge

    return bridge.prepare(inp.model)


def recompute(*args, **kwargs) -> Callable[[Input], Any]:
    """Construct RecomputePass(*args, **kwargs) and run it on the input model."""

    def call(inp: Input):
        from ortpass.passes import RecomputePass

        return RecomputePass(*args, **kwargs)(inp.model)

    return call


def recompute_with_plan_file(inp: Input):
    from ortpass.passes import RecomputePass

    return RecomputePass(config_file=inp.files[0])(inp.model)


def find_candidates(inp: Input):
    from ortpass.analysis import find_recompute_candidates

    return find_recompute_candidates(inp.model)


class CliFailed(Exception):
    """The ortpass command exited non-zero; the message is its exit code and stderr."""


def cli(*argv: str) -> Callable[[Input], Any]:
    """Run ``ortpass <argv>`` with {in}/{dir} replaced; raise CliFailed on a non-zero exit."""

    def call(inp: Input):
        from ortpass.cli import main

        args = [a.format(**{"in": inp.path, "dir": inp.path.parent}) for a in argv]
        stderr = _io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(_io.StringIO()):
            code = main(args)
        if code != 0:
            raise CliFailed(f"exit {code}: {stderr.getvalue()}")
        return code

    return call


def linked_model_input(link_name: str, *, hard: bool = False) -> Callable[[Path], Input]:
    """model_input, and a symbolic (or hard) link to it named ``link_name``."""

    def make(tmp: Path) -> Input:
        inp = model_input(_forward)(tmp)
        link = tmp / link_name
        os.link(inp.path, link) if hard else link.symlink_to(inp.path)
        return inp

    return make



# -- inputs of the file-safety and validation cases ------------------------------------------


def named_model_input(name: str, proto_or_model) -> Callable[[Path], Input]:
    """model_input, saved under ``name`` (a name a dump file would have)."""

    def make(tmp: Path) -> Input:
        inp = model_input(proto_or_model)(tmp)
        path = inp.path.rename(tmp / name)
        return Input(model=inp.model, path=path)

    return make


def special_input(kind: str) -> Callable[[Path], Input]:
    """A FIFO in the case's directory, or a device outside it."""

    def make(tmp: Path) -> Input:
        if kind == "fifo":
            path = tmp / "pipe.onnx"
            os.mkfifo(path)
            return Input(path=path)
        return Input(path=Path("/dev/zero"))

    return make


def with_export_metadata(text: str, model: Callable[[], ir.Model]) -> Callable[[], ir.Model]:
    def make() -> ir.Model:
        m = model()
        m.metadata_props[EXPORT_KEY] = text
        return m

    return make


def _train_with_export_metadata(text: str) -> Callable[[], ir.Model]:
    return with_export_metadata(text, _training)


def pythonop_func_name(attr: onnx.AttributeProto) -> Callable[[], onnx.ModelProto]:
    def make() -> onnx.ModelProto:
        proto = pythonop(**{k: v for k, v in PYTHONOP_ATTRS.items() if k != "func_name"})()
        node = next(n for n in proto.graph.node if n.op_type == "PythonOp")
        node.attribute.append(attr)
        return proto

    return make


def local_function() -> onnx.ModelProto:
    double = oh.make_function("local", "Double", ["a"], ["b"], [oh.make_node("Add", ["a", "a"], ["b"])],
                              [oh.make_opsetid("", 17)])
    proto = _graph([_mm(), oh.make_node("Double", ["h"], ["d"], name="dbl", domain="local"), _sum("d")],
                   opsets=(("", 17), ("local", 1)))
    proto.functions.append(double)
    return proto


def loop_reading_param() -> onnx.ModelProto:
    """A Loop whose body multiplies by the parameter 'w' from the outer scope."""
    body = oh.make_graph(
        [oh.make_node("MatMul", ["h_in", "w"], ["h_out"], name="body_mm"),
         oh.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "body",
        [oh.make_tensor_value_info("i", INT64, []), oh.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
         oh.make_tensor_value_info("h_in", FLOAT, [2, 3])],
        [oh.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []), oh.make_tensor_value_info("h_out", FLOAT, [2, 3])],
    )
    nodes = [
        oh.make_node("Constant", [], ["n"], name="trips", value=onnx.numpy_helper.from_array(np.array(2, np.int64))),
        oh.make_node("Constant", [], ["c"], name="go", value=onnx.numpy_helper.from_array(np.array(True))),
        oh.make_node("Loop", ["n", "c", "x"], ["y"], name="loop", body=body),
        _sum("y"),
    ]
    return _graph(nodes)


def no_nodes() -> onnx.ModelProto:
    """The loss is the graph's input: a valid ONNX model with nothing to differentiate."""
    value = oh.make_tensor_value_info("loss", FLOAT, [])
    return oh.make_model(oh.make_graph([], "empty", [value], [value]), opset_imports=[oh.make_opsetid("", 17)],
                         ir_version=8)


def input_dim_huge() -> onnx.ModelProto:
    """x declared [2, 2**62] while w is [3, 3]."""
    proto = _graph([_mm(), _sum("h")])
    proto.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 2**62
    return proto


def weight_transposed() -> onnx.ModelProto:
    """h declared [2, 3] (value_info), but w is [3, 4]: x @ w is [2, 4]."""
    return _graph([_mm(), _sum("h")], inits=[onnx.numpy_helper.from_array(np.ones((3, 4), np.float32), "w")],
                  value_info=[oh.make_tensor_value_info("h", FLOAT, [2, 3])])


def weight_declared_transposed() -> onnx.ModelProto:
    """w holds a [3, 4] tensor, but its value_info declares [4, 3] (an exporter's record of
    the weight before it was transposed)."""
    return _graph([_mm(), _sum("h")], inits=[onnx.numpy_helper.from_array(np.ones((3, 4), np.float32), "w")],
                  value_info=[oh.make_tensor_value_info("w", FLOAT, [4, 3])])


def cli_golden_in(directory_name: str) -> Callable[[Input], Any]:
    return lambda inp: cli("golden", "check", "--dir", str(inp.path.parent))(inp)


# -- the table ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[Path], Input]
    entry: str  # for the reader: which public entry point
    call: Callable[[Input], Any]
    error: type[BaseException]
    match: str


CASES = [
    # Files that are not models.
    Case("truncated-protobuf", file_input("cut.onnx", None), "ortpass.io.load", load, ModelLoadError,
         r"cut\.onnx: not a readable ONNX protobuf"),
    Case("random-bytes", file_input("noise.onnx", np.random.default_rng(0).bytes(512)), "ortpass.io.load", load,
         ModelLoadError, r"noise\.onnx: not a readable ONNX protobuf"),
    Case("empty-file", file_input("empty.onnx", b""), "ortpass.io.load", load, ModelLoadError,
         r"empty\.onnx: the file parses but holds no graph"),
    Case("text-file", file_input("notes.onnx", b"hello, this is not a model\n"), "ortpass.io.load", load,
         ModelLoadError, r"notes\.onnx: not a readable ONNX protobuf"),
    Case("directory", file_input("models", directory=True), "ortpass.io.load", load, ModelLoadError,
         r"models: is a directory"),
    Case("missing-file", file_input("absent.onnx"), "ortpass.io.load", load, ModelLoadError,
         r"absent\.onnx: no such file"),
    Case("duplicate-value-file", file_input("dup.onnx", None), "ortpass.io.load", load, ModelLoadError,
         r"dup\.onnx: malformed ONNX model .*Output 'h' is redeclared.*node 'r'"),
    # Versions ORT 1.19.2 cannot load.
    Case("ir-version-too-new", model_input(ir_too_new), "pipeline(...)", run_pipeline("insert-gather-before-sce-loss"),
         ModelLoadError, r"ir_version 99 is higher"),
    Case("opset-too-new-build", model_input(opset_too_new(_forward)), "build_training_graph", build(),
         TrainingGraphError, r"ai\.onnx opset 22 is newer than ONNX Runtime 1\.19\.2 loads"),
    Case("opset-too-new-session", model_input(opset_too_new(_training)), "TrainingSession", session,
         TrainingGraphError, r"ai\.onnx opset 22 is newer"),
    # Broken graph structure.
    Case("cycle-build", model_input(cycle), "build_training_graph", build(params=["x"]), TrainingGraphError,
         r"cycle: nodes 'A' \(Add\), 'B' \(Relu\)"),
    Case("cycle-pipeline", model_input(cycle), "pipeline(...)", run_pipeline("insert-gather-before-sce-loss"),
         ModelLoadError, r"topologically sorted.*input 'b' of node.*name: A"),
    Case("dangling-input-build", model_input(dangling), "build_training_graph", build(params=["w"]),
         TrainingGraphError, r"node 'add' \(Add\) reads 'ghost', which no node"),
    Case("dangling-input-pipeline", model_input(dangling), "pipeline(...)",
         run_pipeline("insert-gather-before-sce-loss"), ModelLoadError, r"input 'ghost' of node"),
    Case("duplicate-value-build", memory_input(duplicate_value_model), "build_training_graph", build(params=["w"]),
         TrainingGraphError, r"value 'h' is defined twice: by node 'mm' \(MatMul\) and by node 'r' \(Relu\)"),
    Case("duplicate-value-pipeline", memory_input(duplicate_value_model), "pipeline(...)",
         run_pipeline("insert-gather-before-sce-loss"), ModelLoadError, r"static single assignment|SSA.*'h'|'h'.*multiple"),
    Case("output-never-produced", model_input(unproduced_output), "build_training_graph",
         build(params=["w"], loss="loss"), TrainingGraphError, r"graph output 'z' is produced by no node"),
    Case("output-never-produced-pipeline", model_input(unproduced_output), "pipeline(...)",
         run_pipeline("insert-gather-before-sce-loss"), ModelLoadError, r"Graph output 'z' is not an output of any node"),
    Case("non-scalar-loss", model_input(vector_loss), "build_training_graph", build(params=["w"]),
         TrainingGraphError, r"loss 'loss' is not a scalar \(declared shape \[2\]\)"),
    # Ops nobody knows.
    Case("unknown-domain", model_input(unknown_domain(True)), "build_training_graph", build(params=["w"]),
         TrainingGraphError, r"foo\.bar:Baz.* is not a registered function/op"),
    Case("unknown-domain-not-imported", model_input(unknown_domain(False)), "pipeline(...)",
         run_pipeline("build-training-graph(params=['w'])"), ModelLoadError, r"No opset import for domain 'foo\.bar'.*baz"),
    Case("unknown-op", model_input(unknown_op), "pipeline(...)", run_pipeline("build-training-graph(params=['w'])"),
         ModelLoadError, r"No Op registered for NotAnOp.*Name: nop"),
    # PythonOps.
    Case("pythonop-missing-attributes", model_input(pythonop()), "bridge.prepare", prepare, ModelLoadError,
         r"PythonOp node 'py' lacks the required attribute\(s\) \['func_name', 'input_convention', "
         r"'output_tensor_types', 'output_tensor_ranks'\]"),
    Case("pythonop-missing-func-name-build", model_input(pythonop(**{k: v for k, v in PYTHONOP_ATTRS.items() if k != "func_name"})),
         "build_training_graph", build(params=["w"]), ModelLoadError, r"'py' lacks the required attribute\(s\) \['func_name'\]"),
    Case("pythonop-unregistered", model_input(pythonop(**PYTHONOP_ATTRS)), "bridge.prepare", prepare,
         UnregisteredFunctionError, r"node 'py' calls the autograd Function 'nowhere\.NotRegistered', which is not registered"),
    Case("pythonop-unregistered-build", model_input(pythonop(**PYTHONOP_ATTRS)), "build_training_graph",
         build(params=["w"]), UnregisteredFunctionError, r"'nowhere\.NotRegistered'"),
    # Losses.
    Case("float-labels", model_input(float_labels), "build_training_graph", build(params=["w"]), TrainingGraphError,
         r"loss node 'L' \(SoftmaxCrossEntropyLoss\) reads labels 'labels' of type FLOAT"),
    Case("unknown-loss-name", model_input(_forward), "build_training_graph", build(loss="nope"), TrainingGraphError,
         r"loss 'nope' is not a graph output; outputs are \['loss'\]"),
    Case("unknown-param", model_input(_forward), "build_training_graph", build(params=["nope"]), TrainingGraphError,
         r"parameter 'nope' is neither an initializer nor a graph input"),
    # Recompute plans.
    Case("plan-without-fields", model_input(_training), "RecomputePass(...)", recompute("Gelu"), PlanError,
         r"bad plan string 'Gelu': expected '<cluster>:<type>:<count>'"),
    Case("plan-bad-type", model_input(_training), "RecomputePass(...)", recompute("Gelu+:3:-1"), PlanError,
         r"'Gelu\+:3:-1': type must be 0, 1 or 2, not '3'"),
    Case("plan-zero-count", model_input(_training), "RecomputePass(...)", recompute("Gelu+:1:0"), PlanError,
         r"bad count 0"),
    Case("plan-count-not-int", model_input(_training), "RecomputePass(...)", recompute("Gelu+:1:x"), PlanError,
         r"count must be an integer, not 'x'"),
    Case("plan-bad-cluster", model_input(_training), "RecomputePass(...)", recompute("gelu:1:-1"), PlanError,
         r"bad cluster id 'gelu'"),
    Case("plan-empty-entry", model_input(_training), "RecomputePass(...)", recompute("Gelu+:1:-1,,Tanh+:1:-1"),
         PlanError, r"empty plan in 'Gelu\+:1:-1,,Tanh\+:1:-1'"),
    Case("plan-list-with-int", model_input(_training), "RecomputePass(...)", recompute(["Gelu+:1:-1", 3]), PlanError,
         r"a plan must be a string .* not int 3"),
    Case("plans-not-strings", model_input(_training), "RecomputePass(...)", recompute(5), PlanError,
         r"plans must be a comma-joined string or a list of plan strings, not int 5"),
    Case("plans-with-level", model_input(_training), "RecomputePass(...)", recompute("Gelu+:1:-1", level=1), PlanError,
         r"level 1 selects every detected plan itself"),
    Case("bad-level", model_input(_training), "RecomputePass(...)", recompute(level=7), ValueError,
         r"recompute level must be one of \(0, 1, 2\), not 7"),
    Case("plan-in-pipeline", model_input(_training), "pipeline(...)", make_pipeline("recompute(plans='Gelu')"),
         PipelineSpecError, r"pass 'recompute' .*PlanError: bad plan string 'Gelu'"),
    Case("plan-file-missing", with_plan_file(None, "absent.json"), "RecomputePass(config_file=...)",
         recompute_with_plan_file, PlanError, r"plan file '.*absent\.json' does not exist"),
    Case("plan-file-not-json", with_plan_file("{not json"), "RecomputePass(config_file=...)",
         recompute_with_plan_file, PlanError, r"plan file '.*plans\.json' is not valid JSON"),
    Case("plan-file-not-a-list", with_plan_file(json.dumps({"plans": ["Gelu+:1:-1"]})), "RecomputePass(config_file=...)",
         recompute_with_plan_file, PlanError, r"plans\.json' must hold a JSON list of plan strings, not dict"),
    Case("plan-file-non-strings", with_plan_file("[1, 2]"), "RecomputePass(config_file=...)",
         recompute_with_plan_file, PlanError, r"plans\.json': a plan must be a string .* not int 1"),
    Case("plan-file-bad-plan", with_plan_file('["Gelu+:1:-1", "Tanh"]'), "RecomputePass(config_file=...)",
         recompute_with_plan_file, PlanError, r"plans\.json': bad plan string 'Tanh'"),
    Case("plan-file-is-directory", with_plan_file(None, "plandir", directory=True), "RecomputePass(config_file=...)",
         recompute_with_plan_file, PlanError, r"plan file '.*plandir' cannot be read"),
    # Post-grad work on a model that is not a training graph.
    Case("recompute-on-forward", model_input(_forward), "RecomputePass(...)", recompute(level=1), TrainingGraphError,
         r"not a training graph"),
    Case("analysis-on-forward", model_input(_forward), "find_recompute_candidates", find_candidates,
         TrainingGraphError, r"not a training graph"),
    Case("session-on-forward", model_input(_forward), "TrainingSession", session, TrainingGraphError,
         r"not a training graph"),
    Case("run-missing-input", model_input(_training), "TrainingSession.run",
         session_run(lambda: {"x": make_batch(RECIPE)["x"]}), OrtpassError, r"batch is missing graph inputs \['labels'\]"),
    Case("run-unknown-param", model_input(_training), "TrainingSession.run",
         session_run(lambda: make_batch(RECIPE), {"nope": np.zeros(1, np.float32)}), OrtpassError,
         r"'nope' is not a parameter of this training graph"),
    Case("run-wrong-dtype", model_input(_training), "TrainingSession.run",
         session_run(lambda: {**make_batch(RECIPE), "x": make_batch(RECIPE)["x"].astype(np.float64)}), OrtpassError,
         r"Unexpected input data type\. Actual: \(tensor\(double\)\) , expected: \(tensor\(float\)\)"),
    # Pipelines.
    Case("pipeline-empty", model_input(_forward), "pipeline(...)", make_pipeline(""), PipelineSpecError,
         r"the pipeline is empty"),
    Case("pipeline-double-comma", model_input(_forward), "pipeline(...)", make_pipeline("recompute,,fix-dropout-seed"),
         PipelineSpecError, r"position 10: expected a pass name, found ','"),
    Case("pipeline-unclosed", model_input(_forward), "pipeline(...)", make_pipeline("recompute(level=1"),
         PipelineSpecError, r"the options are not closed"),
    Case("pipeline-not-a-literal", model_input(_forward), "pipeline(...)", make_pipeline("recompute(level=x)"),
         PipelineSpecError, r"option 'level' of pass 'recompute': 'x' is not a literal"),
    Case("pipeline-unknown-pass", model_input(_forward), "pipeline(...)", make_pipeline("no-such-pass"),
         PipelineSpecError, r"unknown pass 'no-such-pass'; known passes: .*recompute"),
    Case("pipeline-unknown-option", model_input(_forward), "pipeline(...)", make_pipeline("recompute(bogus=1)"),
         PipelineSpecError, r"pass 'recompute' \(position 0\) has no option 'bogus'; its options: plans, level"),
    Case("pipeline-option-twice", model_input(_forward), "pipeline(...)", make_pipeline("recompute(level=1,level=2)"),
         PipelineSpecError, r"option 'level' of pass 'recompute' is given twice"),
    Case("pipeline-post-grad-without-build", model_input(_forward), "pipeline(...)",
         make_pipeline("fix-dropout-seed(level=1),recompute(level=1)"), PassOrderingError,
         r"pass 'fix-dropout-seed' requires 'training-graph'"),
    # The command line.
    Case("cli-output-is-input", model_input(_forward), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{in}", "--pipeline", "insert-gather-before-sce-loss"), CliFailed,
         r"exit 2: .*model\.onnx is the input model; refusing to overwrite it without --in-place"),
    Case("cli-output-links-to-input", linked_model_input("link.onnx"), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/link.onnx", "--pipeline", "insert-gather-before-sce-loss"), CliFailed,
         r"exit 2: .*link\.onnx is the input model; refusing to overwrite it"),
    Case("cli-report-over-input", model_input(_forward), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx", "--report", "{in}"), CliFailed,
         r"exit 2: .*--report .*model\.onnx is the input model; refusing to overwrite it"),
    Case("cli-no-output", model_input(_forward), "ortpass optimize", cli("optimize", "{in}"), CliFailed,
         r"exit 2: .*no output: give -o OUT\.onnx, or --in-place"),
    Case("cli-not-a-model", file_input("noise.onnx", b"\x00\xff" * 64), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx"), CliFailed, r"exit 2: .*noise\.onnx: not a readable ONNX protobuf"),
    Case("cli-bad-pipeline", model_input(_forward), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx", "--pipeline", "recompute(bogus=1)"), CliFailed,
         r"exit 2: .*has no option 'bogus'"),
    Case("cli-report-on-forward-with-no-build", model_input(_forward), "ortpass report",
         cli("report", "{in}", "--no-build"), CliFailed, r"exit 2: .*model\.onnx is not a training graph"),
    Case("cli-report-on-untagged-training-graph", model_input(lambda: _without_training_record(_training())),
         "ortpass report", cli("report", "{in}"), CliFailed,
         r"exit 2: .*has nodes the gradient build tagged .* but no training-graph record"),
    Case("cli-post-grad-passes-on-forward", model_input(_forward), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx", "--pipeline", "fix-dropout-seed(level=1),recompute(level=1)"),
         CliFailed, r"exit 2: .*is a forward model, not a training graph.*add build-training-graph"),
    Case("cli-pre-grad-pass-on-training-graph", model_input(_training), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx", "--pipeline", "insert-gather-before-sce-loss"),
         CliFailed, r"exit 2: .*is a training graph already.*'insert-gather-before-sce-loss' runs on the forward model"),
    Case("cli-default-pipeline-on-training-graph", model_input(_training), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx"),
         CliFailed, r"exit 2: .*is a training graph already.*the pipeline builds one \('build-training-graph'\)"),
    Case("cli-recompute-without-seeds-on-training-graph", model_input(_training), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx", "--pipeline", "recompute(level=1)"),
         CliFailed, r"exit 2: .*requires 'dropout-seeds-fixed'.*add 'fix-dropout-seed' to the pipeline"),
    # Files the command must not write over (issue: data loss).
    Case("cli-dump-dir-over-input", named_model_input("01_build-training-graph.onnx", _forward), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx", "--dump-dir", "{dir}", "--pipeline", "build-training-graph"),
         CliFailed, r"exit 2: .*--dump-dir .*01_build-training-graph\.onnx is the input model; refusing to overwrite it"),
    Case("cli-dump-dir-over-input-by-dotdot", named_model_input("01_build-training-graph.onnx", _forward),
         "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx", "--dump-dir", "{dir}/../" + "{dir.name}", "--pipeline",
             "build-training-graph"),
         CliFailed, r"exit 2: .*--dump-dir .* is the input model"),
    Case("cli-output-hard-link-to-input", linked_model_input("hard.onnx", hard=True), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/hard.onnx", "--pipeline", "insert-gather-before-sce-loss"), CliFailed, r"exit 2: .*-o .*hard\.onnx is the input model; refusing to overwrite it without --in-place"),
    Case("cli-report-is-output", model_input(_forward), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx", "--report", "{dir}/./out.onnx"), CliFailed,
         r"exit 2: .*--report .*out\.onnx and -o .*out\.onnx are the same file"),
    Case("cli-json-is-plot", model_input(_training), "ortpass report",
         cli("report", "{in}", "--json", "{dir}/x", "--plot", "{dir}/x"), CliFailed,
         r"exit 2: .*--plot .*x and --json .*x are the same file"),
    Case("cli-report-over-plan-file", with_plan_file('["Gelu+:1:-1"]'), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx", "--report", "{dir}/plans.json", "--pipeline",
             "build-training-graph,fix-dropout-seed,recompute(config_file='{dir}/plans.json')"), CliFailed,
         r"exit 2: .*--report .*plans\.json is the config_file file .*plans\.json; refusing to overwrite it"),
    Case("cli-output-is-directory", model_input(_forward), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}", "--pipeline", "insert-gather-before-sce-loss"), CliFailed,
         r"exit 2: .*-o .* is a directory; give a file name"),
    Case("cli-report-is-directory", model_input(_forward), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx", "--report", "{dir}", "--pipeline",
             "insert-gather-before-sce-loss"), CliFailed, r"exit 2: .*--report .* is a directory"),
    Case("cli-output-under-a-file", model_input(_forward), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{in}/out.onnx", "--pipeline", "insert-gather-before-sce-loss"), CliFailed,
         r"exit 2: .*-o .*model\.onnx/out\.onnx: .*model\.onnx is a file, not a directory"),
    Case("cli-plot-is-directory", model_input(_training), "ortpass report",
         cli("report", "{in}", "--plot", "{dir}"), CliFailed, r"exit 2: .*--plot .* is a directory; give a file name"),
    # Inputs that are not files.
    Case("fifo-input", special_input("fifo"), "ortpass optimize", cli("optimize", "{in}", "-o", "{dir}/out.onnx"),
         CliFailed, r"exit 2: .*pipe\.onnx: is a FIFO \(named pipe\), not a regular file"),
    Case("device-input", special_input("zero"), "ortpass.io.load", load, ModelLoadError,
         r"/dev/zero: is a character device, not a regular file"),
    # Report options and metadata (issue: raw tracebacks).
    Case("cli-probe-level-99", model_input(_training), "ortpass report", cli("report", "{in}", "--probe-level", "99"),
         CliFailed, r"exit 2: .*argument --probe-level: invalid choice: 99"),
    Case("cli-probe-level-negative", model_input(_training), "ortpass report",
         cli("report", "{in}", "--probe-level", "-1"), CliFailed, r"exit 2: .*argument --probe-level: invalid choice: -1"),
    Case("cli-min-elements-negative", model_input(_training), "ortpass report",
         cli("report", "{in}", "--min-elements", "-5"), CliFailed, r"exit 2: .*--min-elements: must be >= 0, not -5"),
    Case("cli-dim-not-a-number", model_input(_training), "ortpass report",
         cli("report", "{in}", "--dim", "batch=abc"), CliFailed,
         r"exit 2: .*--dim: the size of dim 'batch' is not an integer: 'abc'"),
    Case("cli-plot-unknown-format", model_input(_training), "ortpass report",
         cli("report", "{in}", "--plot", "{dir}/p.xyz"), CliFailed, r"exit 2: .*unknown image format '\.xyz'; use one of .*png"),
    Case("cli-report-metadata-not-json", model_input(_train_with_export_metadata("{not json")), "ortpass report",
         cli("report", "{in}"), CliFailed, r"exit 2: .*metadata 'pkg\.ortpass\.export' is not valid JSON"),
    Case("cli-report-dims-a-list", model_input(_train_with_export_metadata('{"dims": [4, 6]}')), "ortpass report",
         cli("report", "{in}"), CliFailed, r"exit 2: .*'dims' must map dim names to sizes, not list \[4, 6\]"),
    Case("cli-report-dims-not-numbers", model_input(_train_with_export_metadata('{"dims": {"batch": "abc"}}')),
         "ortpass report", cli("report", "{in}"), CliFailed,
         r"exit 2: .*'dims' sizes must be positive integers; bad: \{'batch': 'abc'\}"),
    Case("cli-golden-file-without-case", file_input("nocase.py", b"x = 1\n"), "ortpass golden check",
         cli_golden_in("."), CliFailed, r"exit 2: .*nocase\.py defines no case\(\) function"),
    Case("cli-golden-file-that-raises", file_input("boom.py", b"raise RuntimeError('boom')\n"), "ortpass golden check",
         cli_golden_in("."), CliFailed, r"exit 2: .*boom\.py failed to import: RuntimeError: boom"),
    # Pass options checked against their declared types when the pipeline is built.
    Case("option-bool-given-a-str", model_input(_forward), "pipeline(...)",
         make_pipeline("insert-gather-before-sce-loss(force='no')"), PipelineSpecError,
         r"pass 'insert-gather-before-sce-loss' \(position 0\): option 'force' must be bool, not 'no' \(str\)"),
    Case("option-fusions-given-a-str", model_input(_forward), "pipeline(...)",
         make_pipeline("build-training-graph(ort_fusions='no')"), PipelineSpecError,
         r"option 'ort_fusions' must be bool, not 'no' \(str\)"),
    Case("option-level-given-a-bool", model_input(_forward), "pipeline(...)",
         make_pipeline("build-training-graph,fix-dropout-seed(level=1),recompute(level=True)"), PipelineSpecError,
         r"pass 'recompute' \(position \d+\): option 'level' must be one of 0, 1, 2, not True \(bool\)"),
    Case("option-params-given-a-str", model_input(_forward), "pipeline(...)",
         make_pipeline("build-training-graph(params='fc1.weight')"), PipelineSpecError,
         r"option 'params' must be a list of str or None, not 'fc1\.weight' \(str\); for one name write params=\['fc1\.weight'\]"),
    Case("option-probe-level-out-of-range", model_input(_forward), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx", "--pipeline",
             "build-training-graph,fix-dropout-seed(level=1),recompute(level=1,probe_level=99)"), CliFailed,
         r"exit 2: .*option 'probe_level' must be one of 0, 1, not 99 \(int\)"),
    Case("option-min-elements-given-a-str", model_input(_forward), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx", "--pipeline",
             "build-training-graph,fix-dropout-seed(level=1),recompute(level=1,min_elements='x')"), CliFailed,
         r"exit 2: .*option 'min_elements' must be int or None, not 'x' \(str\)"),
    Case("option-min-elements-negative", model_input(_forward), "pipeline(...)",
         make_pipeline("build-training-graph,fix-dropout-seed(level=1,min_elements=-1),recompute(level=1)"),
         PipelineSpecError, r"pass 'fix-dropout-seed' \(position \d+\): option 'min_elements' must be at least 0, not -1"),
    Case("option-seed-given-a-float", model_input(_forward), "pipeline(...)", make_pipeline("replay-dropout-mask(base_seed=1.5)"),
         PipelineSpecError, r"option 'base_seed' must be int, not 1\.5 \(float\)"),
    Case("option-recompute-probe-level-in-python", model_input(_training), "RecomputePass(...)",
         recompute(level=1, probe_level=99), ValueError, r"probe_level must be 0 \(basic\) or 1 \(advanced\), not 99"),
    # Bad models refused before any pass runs, naming the node, value or key.
    Case("metadata-a-list", model_input(with_export_metadata("[1, 2]", _forward)), "pipeline(...)",
         run_pipeline("build-training-graph"), ModelLoadError, r"metadata 'pkg\.ortpass\.export' must be a JSON object, not list"),
    Case("metadata-params-a-str", model_input(with_export_metadata('{"params": "w"}', _forward)), "pipeline(...)",
         run_pipeline("insert-gather-before-sce-loss"), ModelLoadError, r"'params' must be a list of names, not 'w'"),
    Case("pythonop-func-name-int", model_input(pythonop_func_name(oh.make_attribute("func_name", 5))),
         "pipeline(...)", run_pipeline("pythonop-shape-inference"), ModelLoadError,
         r"PythonOp node 'py' \(PythonOp\): attribute 'func_name' must be STRING, not INT"),
    Case("pythonop-func-name-not-utf8",
         model_input(pythonop_func_name(onnx.AttributeProto(name="func_name", type=onnx.AttributeProto.STRING, s=b"\xff\xfe"))),
         "ortpass optimize", cli("optimize", "{in}", "-o", "{dir}/out.onnx"), CliFailed,
         r"exit 2: .*model\.onnx: malformed ONNX model \(attribute 'func_name' of node 'py' is not UTF-8 text"),
    Case("pythonop-func-name-not-utf8-in-memory",
         model_input(pythonop_func_name(onnx.AttributeProto(name="func_name", type=onnx.AttributeProto.STRING, s=b"\xff\xfe"))),
         "pipeline(...)", run_pipeline("pythonop-shape-inference"), ModelLoadError,
         r"node 'py' \(PythonOp\): attribute 'func_name' is not UTF-8 text"),
    Case("node-name-not-utf8", file_input("latin1.onnx", _good_bytes().replace(b"Gelu", b"G\xe9lu", 1)),
         "ortpass.io.load", load, ModelLoadError, r"latin1\.onnx: malformed ONNX model \(.* is not UTF-8 text"),
    Case("loss-recorded-at-export-missing", model_input(with_export_metadata('{"loss": "nope"}', _forward)),
         "ortpass optimize", cli("optimize", "{in}", "-o", "{dir}/out.onnx"), CliFailed,
         r"exit 2: .*TrainingGraphError: loss 'nope' is not a graph output"),
    Case("param-recorded-at-export-missing", model_input(with_export_metadata('{"params": ["w9"]}', _forward)),
         "ortpass optimize", cli("optimize", "{in}", "-o", "{dir}/out.onnx"), CliFailed,
         r"exit 2: .*parameter 'w9', recorded as trainable at export, is gone from the model"),
    Case("local-function", model_input(local_function), "ortpass optimize", cli("optimize", "{in}", "-o", "{dir}/out.onnx"),
         CliFailed, r"exit 2: .*defines 1 local function\(s\) \(local::Double\), which ORT's gradient builder cannot"),
    Case("local-function-build", model_input(local_function), "build_training_graph", build(params=["w"]),
         ModelLoadError, r"local function\(s\) \(local::Double\)"),
    Case("loop-reads-param", model_input(loop_reading_param), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx", "--pipeline", "build-training-graph(params=['w'])"), CliFailed,
         r"exit 2: .*node 'loop' \(Loop\): its subgraph 'body' reads the parameter\(s\) \['w'\] from the outer scope"),
    Case("no-nodes", model_input(no_nodes), "pipeline(...)", run_pipeline("build-training-graph"), ModelLoadError,
         r"the graph has no nodes"),
    Case("input-dim-huge", model_input(input_dim_huge), "ortpass optimize", cli("optimize", "{in}", "-o", "{dir}/out.onnx"),
         CliFailed, r"exit 2: .*declared shapes are inconsistent: node 'mm' \(MatMul\): Incompatible dimensions"),
    Case("weight-transposed", model_input(weight_transposed), "pipeline(...)", run_pipeline("build-training-graph"),
         ModelLoadError, r"declared shapes are inconsistent: node 'mm' \(MatMul\): Inferred shape and existing shape differ in dimension 1: \(4\) vs \(3\)"),
    Case("weight-declared-transposed", model_input(weight_declared_transposed), "ortpass optimize",
         cli("optimize", "{in}", "-o", "{dir}/out.onnx"), CliFailed,
         r"exit 2: .*initializer 'w' holds a tensor of shape \[3, 4\], but its shape is declared \[4, 3\]"),
    # Messages stay bounded.
    Case("plan-a-megabyte-long", model_input(_forward), "pipeline(...)",
         make_pipeline("recompute(plans='" + "G" * 1_000_000 + "')"), PipelineSpecError,
         r"pass 'recompute' .*PlanError: .*characters\]"),
    Case("pipeline-a-megabyte-long", model_input(_forward), "pipeline(...)",
         make_pipeline("recompute(level=1)" + "x" * 1_000_000), PipelineSpecError,
         r"pipeline of 1000018 characters, near .*position 18: expected ',' between passes"),
]

# Inputs generated from bytes that only exist at test time.
_LATE_CONTENT = {
    "truncated-protobuf": lambda: _good_bytes()[: len(_good_bytes()) // 2],
    "duplicate-value-file": lambda: duplicate_value_proto().SerializeToString(),
}


def _listing(directory: Path) -> set[str]:
    """Every file under ``directory``, hidden ones included: a failed call leaves no stray file."""
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


def _make(case: Case, tmp: Path) -> Input:
    inp = case.make(tmp)
    if case.id in _LATE_CONTENT:
        inp.path.write_bytes(_LATE_CONTENT[case.id]())
        os.utime(inp.path, ns=(1_000_000_000, 1_000_000_000))  # a known mtime to compare
    return inp


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 110
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


def _params(rows):
    return [pytest.param(row, id=row.id) for row in rows]


@pytest.mark.parametrize("case", _params(CASES))
def test_bad_input_is_refused_by_name_and_left_alone(case: Case, tmp_path: Path):
    inp = _make(case, tmp_path)
    before, listed = _snapshot(inp), _listing(tmp_path)
    with pytest.raises(case.error) as info:
        case.call(inp)
    assert re.search(case.match, str(info.value), re.DOTALL), (
        f"{case.entry} raised {type(info.value).__name__} whose message does not match {case.match!r}:\n{info.value}"
    )
    assert _snapshot(inp) == before, f"{case.entry} changed its input model or file"
    assert _listing(tmp_path) == listed, f"{case.entry} left files behind: {_listing(tmp_path) ^ listed}"
    message = str(info.value)
    assert len(message) <= MAX_MESSAGE, f"{case.entry}: a {len(message)}-character message"
    if isinstance(info.value, CliFailed):  # one line says what is wrong (golden also names the folder it runs)
        lines = [line for line in message.split(": ", 1)[1].splitlines() if line.strip()]
        verdicts = [line for line in lines if re.match(r"ortpass( \w+)?: (\w+Error: |error: )", line)]
        assert len(verdicts) == 1 and len(lines) <= 2 and "Traceback" not in message, f"{case.entry} printed:\n{message}"


# -- inputs a pass must leave alone, saying why ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Skip:
    id: str
    model: Callable[[], ir.Model]
    make_pass: Callable[[], ir.passes.PassBase]
    why: str  # regex over the pass's statistics and its log records


SKIPS = [
    Skip("gather-logits-rank-unknown", logits_of_unknown_shape,
         lambda: ortpass.get_pass("insert-gather-before-sce-loss")(force=True), r"rank unknown"),
    Skip("gather-float-labels", lambda: ir.from_proto(float_labels()),
         lambda: ortpass.get_pass("insert-gather-before-sce-loss")(force=True), r"labels are FLOAT, not INT32/INT64"),
    Skip("gather-without-flag", _forward, lambda: ortpass.get_pass("insert-gather-before-sce-loss")(), r"flag"),
    Skip("recompute-shapes-missing", without_shapes,
         lambda: ortpass.get_pass("recompute")("Gelu+:1:-1", min_elements=0), r"Gelu\+:1:-1 matches no candidate"),
    Skip("recompute-plan-absent-from-graph", _training,
         lambda: ortpass.get_pass("recompute")("Tile+:1:-1", min_elements=0), r"Tile\+:1:-1 matches no candidate"),
]


@pytest.mark.parametrize("skip", _params(SKIPS))
def test_pass_leaves_unsuitable_input_unchanged_and_says_why(skip: Skip, caplog):
    model = skip.model()
    before = ir.to_proto(model).SerializeToString()
    pass_ = skip.make_pass()
    with caplog.at_level(logging.INFO, logger="ortpass"):
        result = pass_(model)
    assert not result.modified
    assert ir.to_proto(result.model).SerializeToString() == before
    said = json.dumps(getattr(pass_, "stats", {}), default=str) + "\n" + caplog.text
    assert re.search(skip.why, said), f"no reason matching {skip.why!r} in:\n{said}"


def test_shapes_missing_are_named_by_the_analysis():
    """Without shapes, the recompute analysis cannot size a stashed value: it skips the
    candidate and names the value (rather than guessing a saving or crashing)."""
    from ortpass.analysis import find_recompute_candidates

    model = without_shapes()
    before = ir.to_proto(model).SerializeToString()
    report = find_recompute_candidates(model, min_elements=0)
    assert not report.plans
    assert any(re.search(r"the size of '.+' is unknown", s.reason) for s in report.skipped)
    assert ir.to_proto(model).SerializeToString() == before


# -- the incremental mode's input check against the onnx checker ----------------------------


def _refused(check: Callable[[ir.Model], Any], model: ir.Model) -> bool:
    try:
        check(model)
    except Exception:  # noqa: BLE001 - only whether it refused is compared
        return True
    return False


def test_the_input_check_on_the_ir_refuses_what_the_onnx_checker_refuses(tmp_path: Path):
    """The default check mode checks its input on the IR (``checks.input_check``) instead of
    serializing it for the onnx checker; on every model of the corpus both give one verdict."""
    from ortpass.infra import checks

    verdicts = {}
    for i, case in enumerate(CASES):
        directory = tmp_path / str(i)
        directory.mkdir()
        model = _make(case, directory).model
        if model is not None:
            verdicts[case.id] = (_refused(checks.full_check, model), _refused(checks.input_check, model))
    assert len(verdicts) >= 20
    assert sum(full for full, _ in verdicts.values()) >= 5  # the corpus has models both refuse
    disagree = {case: v for case, v in verdicts.items() if v[0] != v[1]}
    assert not disagree, f"(onnx checker refused, input check refused) differ: {disagree}"
