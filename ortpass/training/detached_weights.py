"""The parameters' values kept out of the protos the gradient build hands around.

The gradient build works on protos: its own copy of the forward model, ORT's symbolic
shape inference, ORT's pre-gradient transformers and gradient builder (each given the
model serialized and handing back another serialization), onnx's shape inference on the
training graph.  Each holds the weights' bytes once more, some two or three times at
once: on an 80-layer LLaMA (300 MiB of weights) the build's host peak was made of such
copies (issue 59).  None of them reads a parameter's value when the parameter is also a
graph input: ORT treats such an initializer as an overridable default, never a constant
(no folding, no fusion reads it), and shape inference takes its type and shape from the
input's declaration.

So the build serializes those initializers where they are, with their type and dims, but
their data a reference to external data that does not exist (``location``
:data:`PLACEHOLDER`; :func:`ortpass.graph.weightless.proto_with_placeholders`), never
copying their bytes: ORT's tools keep them as initializers, in the same place, and one
that did try to read one would fail on the missing file rather than compute with wrong
values.  The Python shape inferences (ORT's symbolic one, onnx's) check every
initializer's external file, so they run without the detached ones
(:func:`without_detached`; the graph inputs declare their types and shapes).
:func:`reattach` gives the training graph the forward model's own tensors back (shared,
not copied).  The training graph then comes out byte for byte as without detaching.
"""

from __future__ import annotations

from typing import Callable

import onnx
import onnx_ir as ir

from ortpass.errors import TrainingGraphError
from ortpass.graph.weightless import PLACEHOLDER

__all__ = ["PLACEHOLDER", "reattach", "without_detached"]


def without_detached(infer: Callable[[onnx.ModelProto], onnx.ModelProto], proto: onnx.ModelProto,
                     detached: set[str]) -> onnx.ModelProto:
    """``infer(proto)`` (a shape inference returning a model) run with the detached
    initializers out of ``proto``'s graph; they are put back in their places in what it
    returns (and in ``proto``)."""
    if not detached:
        return infer(proto)
    order = [init.name for init in proto.graph.initializer]
    held = {}
    for init in proto.graph.initializer:
        if init.name in detached:
            held[init.name] = onnx.TensorProto()
            held[init.name].CopyFrom(init)  # a placeholder: no data to copy
    _keep_initializers(proto, lambda init: init.name not in detached)
    try:
        out = infer(proto)
    finally:
        _put_back(proto, order, held)
    if out is not proto:
        _put_back(out, order, held)
    return out


def _keep_initializers(proto: onnx.ModelProto, keep: Callable[[onnx.TensorProto], bool]) -> None:
    for index in reversed(range(len(proto.graph.initializer))):
        if not keep(proto.graph.initializer[index]):
            del proto.graph.initializer[index]


def _put_back(proto: onnx.ModelProto, order: list[str], held: dict[str, onnx.TensorProto]) -> None:
    present = {init.name: index for index, init in enumerate(proto.graph.initializer)}
    if all(name in present for name in held):
        return
    kept = list(proto.graph.initializer)
    rest = {init.name: init for init in kept}
    merged = [held[name] if name in held else rest.pop(name) for name in order if name in held or name in rest]
    merged += list(rest.values())  # any the inference added, after
    copies = [onnx.TensorProto() for _ in merged]
    for copy, init in zip(copies, merged):
        copy.CopyFrom(init)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(copies)


def reattach(training: ir.Model, model: ir.Model, detached: set[str]) -> None:
    """Give each detached initializer of ``training`` the forward ``model``'s tensor."""
    for name in detached:
        value = training.graph.initializers.get(name)
        if value is None:
            continue  # the build dropped it (nothing reads it any more)
        source = model.graph.initializers[name].const_value
        placeholder = value.const_value
        if placeholder is None or tuple(placeholder.shape) != tuple(source.shape) or placeholder.dtype != source.dtype:
            raise TrainingGraphError(
                f"parameter {name!r} came out of ONNX Runtime's gradient builder with another type or shape "
                f"({placeholder.dtype if placeholder is not None else None} "
                f"{tuple(placeholder.shape) if placeholder is not None else None}, not {source.dtype} {tuple(source.shape)})"
            )
        value.const_value = source
    leftover = [v.name for v in training.graph.initializers.values()
                if isinstance(v.const_value, ir.ExternalTensor) and v.const_value.location == PLACEHOLDER]  # fmt: skip
    if leftover:
        raise TrainingGraphError(f"initializers {leftover[:3]} lost their values in the gradient build")
