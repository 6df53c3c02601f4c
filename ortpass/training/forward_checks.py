"""Checks of the forward model before the gradient build: a scalar loss, integer labels, parameters
that exist, and a graph ORT can order; each refusal names the value or node at fault."""

from __future__ import annotations

import ast
import re
from typing import Iterable

import onnx
import onnx.numpy_helper
import onnx_ir as ir

from ortpass.conventions import (
    MS_DOMAIN,
)
from ortpass.errors import StaticDimsRequired, TrainingGraphError, elide
from ortpass.infra.metadata import get_export_info

__all__ = ["check_forward_model", "check_recorded_params", "check_static_dims"]

#: Where onnxscript's constant folder records what a new constant was folded from
#: (``onnxscript.optimizer.FOLDED_FROM_KEY``; on the value, in memory only).
ONNXSCRIPT_FOLDED_FROM_KEY = "pkg.onnxscript.optimizer.folded_from"
#: How many names an error lists before it counts the rest.
_NAMES_SHOWN = 5


def check_forward_model(proto: onnx.ModelProto, loss: str | None) -> None:
    """Refuse, naming the node and value, a forward model ORT's gradient builder would
    reject with a message about its own C++ internals (or a crash).

    Checked in one walk over the graph: every value is produced once; every node input is
    a graph input, an initializer or a node output; the graph is acyclic; every graph
    output is produced; the loss is a scalar (when its shape is declared); the labels of a
    softmax cross-entropy loss are integer class indices (when their type is known).
    """
    graph = proto.graph
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    producer = _producers(graph, defined)
    for index, node in enumerate(graph.node):
        for name in node.input:
            if name and name not in defined and name not in producer:
                raise TrainingGraphError(
                    f"node {_node_label(node, index)} reads {name!r}, which no node, graph input or initializer defines"
                )
    for output in graph.output:
        if output.name not in defined and output.name not in producer:
            raise TrainingGraphError(f"graph output {output.name!r} is produced by no node")
    _check_acyclic(graph, producer)
    if loss is not None:
        _check_loss_is_scalar(graph, loss)
    _check_label_types(graph)


def _node_label(node: onnx.NodeProto, index: int) -> str:
    return f"{node.name!r} ({node.op_type})" if node.name else f"#{index} ({node.op_type}, unnamed)"


def _producers(graph: onnx.GraphProto, defined: set[str]) -> dict[str, int]:
    producer: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for name in node.output:
            if not name:
                continue
            if name in producer or name in defined:
                first = (
                    f"node {_node_label(graph.node[producer[name]], producer[name])}"
                    if name in producer
                    else "a graph input or initializer"
                )
                raise TrainingGraphError(
                    f"value {name!r} is defined twice: by {first} and by node {_node_label(node, index)}; "
                    "ONNX values have one producer"
                )
            producer[name] = index
    return producer


def _check_acyclic(graph: onnx.GraphProto, producer: dict[str, int]) -> None:
    """Kahn's algorithm over node indices; what it cannot order lies on or after a cycle."""
    nodes = graph.node
    consumers: dict[int, list[int]] = {}
    pending = [0] * len(nodes)
    for index, node in enumerate(nodes):
        sources = {producer[name] for name in node.input if name in producer}
        pending[index] = len(sources)
        for source in sources:
            consumers.setdefault(source, []).append(index)
    ready = [i for i, n in enumerate(pending) if n == 0]
    done = 0
    while ready:
        index = ready.pop()
        done += 1
        for consumer in consumers.get(index, ()):
            pending[consumer] -= 1
            if pending[consumer] == 0:
                ready.append(consumer)
    if done < len(nodes):
        stuck = [_node_label(nodes[i], i) for i, n in enumerate(pending) if n > 0]
        shown = ", ".join(stuck[:5]) + (f" and {len(stuck) - 5} more" if len(stuck) > 5 else "")
        raise TrainingGraphError(f"the graph has a cycle: nodes {shown} are on it or read from it")


def _check_loss_is_scalar(graph: onnx.GraphProto, loss: str) -> None:
    output = next(o for o in graph.output if o.name == loss)
    if not output.type.tensor_type.HasField("shape"):
        return  # undeclared: the gradient builder will tell
    dims = output.type.tensor_type.shape.dim
    if any(not (d.HasField("dim_value") and d.dim_value == 1) for d in dims):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
        raise TrainingGraphError(
            f"loss {loss!r} is not a scalar (declared shape {shape}); reduce it (e.g. ReduceMean) before "
            "building the gradient"
        )


_LOSS_OPS = {("", "SoftmaxCrossEntropyLoss"), (MS_DOMAIN, "SoftmaxCrossEntropyLossInternal")}


_LABEL_TYPES = {onnx.TensorProto.INT32, onnx.TensorProto.INT64}


def _check_label_types(graph: onnx.GraphProto) -> None:
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info)}
    types.update({t.name: t.data_type for t in graph.initializer})
    for index, node in enumerate(graph.node):
        domain = "" if node.domain == "ai.onnx" else node.domain
        if (domain, node.op_type) not in _LOSS_OPS or len(node.input) < 2:
            continue
        label_type = types.get(node.input[1], onnx.TensorProto.UNDEFINED)
        if label_type not in (onnx.TensorProto.UNDEFINED, *_LABEL_TYPES):
            raise TrainingGraphError(
                f"loss node {_node_label(node, index)} reads labels {node.input[1]!r} of type "
                f"{onnx.TensorProto.DataType.Name(label_type)}; labels must be int32 or int64 class indices"
            )


def resolve_loss(proto: onnx.ModelProto, loss: str | None) -> str:
    outputs = [o.name for o in proto.graph.output]
    if loss is None:
        loss = "loss" if "loss" in outputs else (outputs[0] if len(outputs) == 1 else None)
        if loss is None:
            raise TrainingGraphError(f"cannot tell which output is the loss; pass loss=... (outputs: {outputs})")
    if loss not in outputs:
        raise TrainingGraphError(f"loss {loss!r} is not a graph output; outputs are {outputs}")
    return loss


def resolve_loss_or_outputs(
    proto: onnx.ModelProto, export_info: dict, loss: str | None = None, outputs_with_grad: Iterable[str] | None = None
) -> tuple[str | None, list[str]]:
    """What backward starts from: ``(loss, [])`` or ``(None, outputs)``, from the arguments
    or else from the export's record (``loss``, or ``outputs_with_grad`` without one)."""
    if outputs_with_grad is None and loss is None:
        outputs_with_grad = export_info.get("outputs_with_grad")
    if outputs_with_grad:
        return None, resolve_differentiated_outputs(proto, outputs_with_grad)
    return resolve_loss(proto, loss or export_info.get("loss")), []


def resolve_differentiated_outputs(proto: onnx.ModelProto, outputs: Iterable[str]) -> list[str]:
    """The outputs a graph built without a loss differentiates: floating-point graph outputs."""
    declared = {o.name: o.type.tensor_type.elem_type for o in proto.graph.output}
    outputs = list(outputs)
    for name in outputs:
        if name not in declared:
            raise TrainingGraphError(f"output {name!r} to differentiate is not a graph output; outputs are {sorted(declared)}")
        if declared[name] not in (*float_proto_types(), onnx.TensorProto.UNDEFINED):
            raise TrainingGraphError(
                f"output {name!r} is not floating point ({onnx.TensorProto.DataType.Name(declared[name])}): "
                "it has no gradient"
            )
    if len(set(outputs)) != len(outputs):
        raise TrainingGraphError(f"duplicate output names in {outputs}")
    return outputs


def resolve_differentiated_inputs(proto: onnx.ModelProto, inputs: Iterable[str], params: Iterable[str]) -> list[str]:
    """Graph inputs (not parameters) that get a gradient: floating-point inputs."""
    declared = {i.name: i.type.tensor_type.elem_type for i in proto.graph.input}
    inputs, params = list(inputs), set(params)
    for name in inputs:
        if name not in declared or name in params:
            raise TrainingGraphError(f"input {name!r} to differentiate is not a graph input other than a parameter")
        if declared[name] not in float_proto_types():
            raise TrainingGraphError(f"input {name!r} is not floating point: it has no gradient")
    return inputs


def check_recorded_params(model: ir.Model) -> None:
    """Refuse a model that lost parameters recorded at export, or in which onnxscript's
    constant folder made a constant of one (a weight tied to another use trains through
    that use no more), naming them, where they went when the folder says, and the way out.

    ``onnxscript.optimizer.optimize`` run on the exported model does both (see
    :mod:`ortpass.passes.onnxscript_optimize`, which runs it with the parameters kept).
    The folder's record lives on the values in memory: a model saved and loaded again
    shows only the parameters that are gone.
    """
    recorded = get_export_info(model).get("params") or []
    present = {*model.graph.initializers, *(value.name for value in model.graph.inputs)}
    folded = _folded_into(model, recorded)
    lost = [name for name in recorded if name not in present or name in folded]
    if not lost:
        return
    first = lost[0]
    fate = f"was folded into the constant {folded[first]!r}" if first in folded else "is gone from the model"
    shown = ", ".join(repr(name) for name in lost[1 : 1 + _NAMES_SHOWN])
    more = f"{shown} and {len(lost) - 1 - _NAMES_SHOWN} more" if len(lost) > 1 + _NAMES_SHOWN else shown
    others = f"; so were {len(lost) - 1} more ({more})" if len(lost) > 1 else ""
    raise TrainingGraphError(
        f"parameter {first!r}, recorded as trainable at export, {fate}{others}: something between export and "
        "the gradient build folded, merged or removed it, as onnxscript.optimizer.optimize does with weights. "
        "Run onnxscript's optimizer as ortpass's pre-grad pass instead, which keeps the parameters "
        "(ortpass.pipeline('onnxscript-optimize,build-training-graph,...') on the exported model), or pass "
        "params=[...] naming the parameters to train"
    )


def _folded_into(model: ir.Model, lost: list[str]) -> dict[str, str]:
    """Lost parameter -> the constant onnxscript's constant folder made of it."""
    found: dict[str, str] = {}
    for value in model.graph.initializers.values():
        for source in _names_in(value.metadata_props.get(ONNXSCRIPT_FOLDED_FROM_KEY, "")):
            found.setdefault(source, elide(value.name or "", 80))
    return {name: found[name] for name in lost if name in found}


def _names_in(record: str) -> list[str]:
    # The folder writes repr(sorted(names)), a Python list of str; anything else says nothing.
    try:
        names = ast.literal_eval(record) if record else []
    except (ValueError, SyntaxError):
        return []
    return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []


def resolve_params(proto: onnx.ModelProto, params: Iterable[str] | None) -> list[str]:
    initializers = {init.name: init for init in proto.graph.initializer}
    inputs = {i.name: i for i in proto.graph.input}
    if params is None:
        params = [
            name
            for name, init in initializers.items()
            if len(init.dims) > 0 and init.data_type in float_proto_types()
        ]
    params = list(params)
    if not params:
        raise TrainingGraphError("no parameters to differentiate")
    for name in params:
        if name in initializers:
            data_type = initializers[name].data_type
        elif name in inputs:
            data_type = inputs[name].type.tensor_type.elem_type
        else:
            raise TrainingGraphError(f"parameter {name!r} is neither an initializer nor a graph input of the model")
        if data_type not in float_proto_types():
            raise TrainingGraphError(f"parameter {name!r} is not floating point (type {onnx.TensorProto.DataType.Name(data_type)})")
    if len(set(params)) != len(params):
        raise TrainingGraphError(f"duplicate parameter names in {params}")
    return params


#: The float types whose initializers are trainable parameters.
_FLOAT_TYPES = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}


def float_proto_types() -> set[int]:
    return {int(t) for t in _FLOAT_TYPES}


#: Ops whose ORT 1.19.2 CPU gradient kernel reads its input's shape from the graph and
#: crashes the process when those dims are dynamic, and the input dims it needs static
#: (None: all).  Measured: a Conv -> MaxPool(2) -> Linear model with dynamic height and
#: width died with SIGSEGV in MaxPoolGrad (dynamic batch alone ran right at three batch
#: sizes); with AveragePool(2), a dynamic batch alone died with SIGFPE in
#: AveragePoolGrad (docs/design/ort-facts.md).
_NEEDS_STATIC_INPUT_DIMS: dict[str, slice] = {"MaxPool": slice(2, None), "AveragePool": slice(0, None)}

_DIM_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NOT_DIM_SYMBOLS = frozenset({"floor", "ceil", "max", "min", "Max", "Min", "Mod"})


def check_static_dims(proto: onnx.ModelProto) -> None:
    """Refuse, naming the node and the dynamic dims, an op whose ORT gradient kernel needs
    static input dims it does not have (:data:`_NEEDS_STATIC_INPUT_DIMS`); run on a model
    whose value infos carry the shapes (after shape inference).  Raises
    :class:`StaticDimsRequired`, which names the graph's dims to make static."""
    shapes = {v.name: v.type.tensor_type.shape for v in (*proto.graph.input, *proto.graph.value_info)}
    for index, node in enumerate(proto.graph.node):
        needed = _NEEDS_STATIC_INPUT_DIMS.get(node.op_type)
        if needed is None or node.domain not in ("", "ai.onnx") or not node.input:
            continue
        shape = shapes.get(node.input[0])
        dims = list(shape.dim)[needed] if shape is not None else None
        if dims is not None and all(d.HasField("dim_value") for d in dims):
            continue
        symbols = frozenset(
            name for d in (dims or ()) if not d.HasField("dim_value") for name in _DIM_SYMBOL.findall(d.dim_param)
        ) - _NOT_DIM_SYMBOLS
        which = "spatial" if needed.start else "input"
        raise StaticDimsRequired(
            f"node {_node_label(node, index)}: ORT's {node.op_type}Grad needs static {which} dims and crashes "
            f"the process otherwise; its input {node.input[0]!r} has dynamic dims "
            f"{sorted(symbols) if symbols else '(unknown)'}: export with them static",
            symbols,
        )
