"""Export ``torch.autograd.Function`` calls as ``com.microsoft::PythonOp`` nodes.

Inside :func:`pythonop_export_context`, torch.onnx's TorchScript exporter
(``dynamo=False``) hands every traced Function call (``prim::PythonOp``) to
:func:`_symbolic`, which either calls the exporter registered for that Function
(:func:`register_exporter`, which wins) or emits one PythonOp node in ORT's schema:

- inputs: the tensor arguments only; output 0 is the context handle (int64 scalar),
  outputs 1.. the Function's tensor outputs;
- attributes: ``func_name`` (``module.QualName``), ``input_convention`` (``d`` tensor,
  ``c`` constant per argument), tensor types/ranks of inputs and outputs,
  ``input_requires_grads`` (one per argument), ``training_mode``, ``safe_run_mode``, and
  the non-tensor arguments as typed attributes (``input_{bool,int,float}_scalars`` +
  ``..._scalar_positions``; homogeneous tuples in ``input_{bool,int,float}_tuples`` +
  ``..._tuple_positions`` + ``..._tuple_begins``).

Any other non-tensor argument (None, a string, a list, a module, a mixed tuple...) makes
the export fail with :class:`~ortpass.errors.ExportError` naming the Function and the
argument position.  ORT's own exporter wrote such objects' addresses into the model
(``input_pointer_scalars``); an address is meaningless in a saved model and unsafe to
load, so ortpass never writes one.

Floats travel as ONNX float attributes (32-bit), so the runtime sees
``float(numpy.float32(value))``: 0.25 stays 0.25, 0.1 becomes 0.10000000149.

The TorchScript exporter renames every value after the symbolics ran, so the ctx output
gets its ``<first output>_ctx`` name afterwards, from :func:`name_context_outputs`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterator, Sequence

import onnx
import onnx_ir as ir
import torch

from ortpass.conventions import MS_DOMAIN
from ortpass.errors import ExportError
from ortpass.infra.named_registry import NamedRegistry

__all__ = [
    "CONTEXT_SUFFIX",
    "FunctionCall",
    "constant_attributes",
    "record_exported",
    "exported_functions",
    "name_context_outputs",
    "pythonop_attributes",
    "pythonop_export_context",
    "qualified_name",
    "register_exporter",
    "registered_exporter",
    "unregister_exporter",
]

logger = logging.getLogger(__name__)

CONTEXT_SUFFIX = "_ctx"

# torch.onnx calls custom symbolics registered at opset 1 for every later opset too.
_SYMBOLIC_NAME = "prim::PythonOp"
_SYMBOLIC_OPSET = 1

_TORCH_TO_ONNX_DTYPE: dict[torch.dtype, int] = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.float64: onnx.TensorProto.DOUBLE,
    torch.int64: onnx.TensorProto.INT64,
    torch.int32: onnx.TensorProto.INT32,
    torch.int16: onnx.TensorProto.INT16,
    torch.int8: onnx.TensorProto.INT8,
    torch.uint8: onnx.TensorProto.UINT8,
    torch.bool: onnx.TensorProto.BOOL,
}


@dataclasses.dataclass(frozen=True)
class FunctionCall:
    """One traced ``Function.apply`` call, as a registered exporter receives it.

    ``args`` holds the call's arguments in order: ``torch._C.Value`` for tensors, the
    Python values for everything else.  ``outputs`` are the traced tensor outputs (their
    ``type()`` carries dtype and shape); an exporter returns one graph value per output.
    """

    function: type
    func_name: str
    args: tuple[Any, ...]
    input_convention: str
    outputs: tuple[torch._C.Value, ...]


#: ``exporter(g, call) -> Value | tuple[Value, ...]`` replacing the Function's outputs.
Exporter = Callable[[Any, FunctionCall], Any]

_exporters: NamedRegistry[Exporter] = NamedRegistry("an exporter")
_exported: NamedRegistry[Any] = NamedRegistry("an exported Function")


def qualified_name(function: type | str) -> str:
    """``module.QualName`` of a Function class (the PythonOp ``func_name``); strings pass."""
    if isinstance(function, str):
        return function
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        raise TypeError(f"expected a torch.autograd.Function subclass or its qualified name, got {function!r}")
    return f"{function.__module__}.{function.__qualname__}"


def register_exporter(function: type | str, *, replace: bool = False) -> Callable[[Exporter], Exporter]:
    """Decorator registering ``exporter(g, call: FunctionCall)`` for one Function.

    ``function`` is the Function class or its qualified name (``module.QualName``).  The
    exporter emits nodes with ``g.op(...)`` and returns the values that replace the
    Function's tensor outputs.  A registered exporter takes priority over the default
    PythonOp, and may handle arguments the default refuses.
    """
    name = qualified_name(function)

    def decorator(exporter: Exporter) -> Exporter:
        return _exporters.add(name, exporter, replace=replace)

    return decorator


def unregister_exporter(function: type | str) -> None:
    """Remove the exporter registered for ``function`` (no error if there is none)."""
    _exporters.remove(qualified_name(function))


def registered_exporter(function: type | str) -> Exporter | None:
    """The exporter registered for ``function``, or None."""
    return _exporters.get(qualified_name(function))


def record_exported(func_name: str, function: Any) -> None:
    """Note that ``function`` was exported as PythonOps named ``func_name`` in this process."""
    _exported.add(func_name, function, replace=True)


def exported_functions() -> dict[str, Any]:
    """Every Function (or custom op) exported as a PythonOp in this process, by func_name."""
    return _exported.snapshot()


@contextlib.contextmanager
def pythonop_export_context(*, training: bool = True) -> Iterator[None]:
    """While active, torch.onnx (``dynamo=False``) exports Function calls as PythonOps.

    ``training`` sets the nodes' ``training_mode`` (1: ORT keeps a ctx for PythonOpGrad).
    On exit, torch's symbolic registry is restored to what it was, so nothing leaks
    between exports.
    """
    # torch.onnx has no public getter for a registered symbolic; the registry module is the
    # only way to see (and so restore) one that someone registered before us.
    from torch.onnx._internal.torchscript_exporter import registration

    group = registration.registry.get_function_group(_SYMBOLIC_NAME)
    previous = group.get(_SYMBOLIC_OPSET) if group is not None else None

    def symbolic(g, *args, **kwargs):
        return _symbolic(g, args, training=training)

    torch.onnx.register_custom_op_symbolic(_SYMBOLIC_NAME, symbolic, _SYMBOLIC_OPSET)
    try:
        yield
    finally:
        torch.onnx.unregister_custom_op_symbolic(_SYMBOLIC_NAME, _SYMBOLIC_OPSET)
        group = registration.registry.get_function_group(_SYMBOLIC_NAME)
        if previous is not None and (group is None or group.get(_SYMBOLIC_OPSET) is not previous):
            torch.onnx.register_custom_op_symbolic(_SYMBOLIC_NAME, previous, _SYMBOLIC_OPSET)


def _symbolic(g, args: Sequence[Any], *, training: bool):
    node = g.original_node
    function = node.pyobj().__self__
    call = FunctionCall(
        function=function,
        func_name=qualified_name(function),
        args=tuple(args),
        input_convention=node.cconv(),
        outputs=tuple(node.outputs()),
    )
    exporter = _exporters.get(call.func_name)
    if exporter is not None:
        logger.debug("exporting %s with its registered exporter", call.func_name)
        return exporter(g, call)
    return _emit_pythonop(g, call, training)


def _emit_pythonop(g, call: FunctionCall, training: bool):
    attributes = pythonop_attributes(call, training=training)
    tensor_inputs = [a for a in call.args if isinstance(a, torch._C.Value)]
    kwargs = {_torch_attribute_key(name, value): value for name, value in attributes.items()}
    values = g.op(f"{MS_DOMAIN}::PythonOp", *tensor_inputs, outputs=1 + len(call.outputs), **kwargs)
    ctx, *outputs = values
    ctx.setType(torch._C.TensorType.create_from_tensor(torch.zeros((), dtype=torch.int64)))
    for value, traced in zip(outputs, call.outputs):
        value.setType(_with_unknown_sizes(traced.type()))
    record_exported(call.func_name, call.function)
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _with_unknown_sizes(traced: Any) -> Any:
    """The traced type of a Function's output with its dtype and rank but no sizes.

    The tracer types an output with the sizes of the sample batch, and torch.onnx's shape
    inference then folds ``out.shape[0]`` into a constant: transformers' SDPA path reshapes
    the attention output with it, so a graph exported at batch 2 mixed rows across samples
    at batch 3 (the fused attention PythonOp).  Unknown sizes keep that shape computed
    at run time; ``pythonop-shape-inference`` gives the ONNX graph its shapes afterwards.
    """
    if not isinstance(traced, torch._C.TensorType) or traced.dim() is None:
        return traced
    return traced.with_sizes([None] * traced.dim())


def pythonop_attributes(call: FunctionCall, *, training: bool = True) -> dict[str, Any]:
    """ORT's PythonOp attributes for ``call``: name -> int, float, str or list of them."""
    if len(call.input_convention) != len(call.args):
        raise ExportError(
            f"{call.func_name}: {len(call.args)} arguments but input convention {call.input_convention!r}"
        )
    tensors = [a for a in call.args if isinstance(a, torch._C.Value)]
    requires_grads = [int(isinstance(a, torch._C.Value) and a.requires_grad()) for a in call.args]
    attributes: dict[str, Any] = {
        "func_name": call.func_name,
        "input_convention": call.input_convention,
        "input_requires_grads": requires_grads,
        "input_tensor_types": [_onnx_dtype(call, v, f"input {i}") for i, v in enumerate(tensors)],
        "input_tensor_ranks": [_rank(call, v, f"input {i}") for i, v in enumerate(tensors)],
        "output_tensor_types": [_onnx_dtype(call, v, f"output {i}") for i, v in enumerate(call.outputs)],
        "output_tensor_ranks": [_rank(call, v, f"output {i}") for i, v in enumerate(call.outputs)],
        # No input needs a gradient: ORT's gradient builder makes no PythonOpGrad, so nothing
        # would ever release a context kept in training mode (one leaked per step).
        "training_mode": int(training and any(requires_grads)),
        "safe_run_mode": 1,
    }
    attributes.update(constant_attributes(call.func_name, call.input_convention, call.args))
    return attributes


def constant_attributes(func_name: str, input_convention: str, args: Sequence[Any]) -> dict[str, list]:
    """The typed attributes of the non-tensor (``c``) arguments; only non-empty ones appear.

    Raises ExportError naming ``func_name`` and the argument position for an argument that
    is not a bool/int/float scalar or a homogeneous tuple of them.
    """
    scalars: dict[str, tuple[list, list]] = {kind: ([], []) for kind in ("bool", "int", "float")}
    tuples: dict[str, tuple[list, list, list]] = {kind: ([], [], []) for kind in ("bool", "int", "float")}
    for position, (kind_char, arg) in enumerate(zip(input_convention, args)):
        if kind_char == "d":
            continue
        scalar_kind = _scalar_kind(arg)
        if scalar_kind is not None:
            values, positions = scalars[scalar_kind]
            values.append(_attribute_value(scalar_kind, arg))
            positions.append(position)
            continue
        tuple_kind = _tuple_kind(arg)
        if tuple_kind is None:
            raise ExportError(
                f"{func_name}: argument {position} ({type(arg).__name__} {arg!r:.60}) cannot be a "
                "PythonOp attribute; only tensors, bool/int/float scalars and homogeneous tuples of "
                "them are exported (register an exporter for this Function to handle it)"
            )
        values, positions, begins = tuples[tuple_kind]
        begins.append(len(values))
        values.extend(_attribute_value(tuple_kind, item) for item in arg)
        positions.append(position)

    attributes: dict[str, list] = {}
    for kind, (values, positions) in scalars.items():
        if positions:
            attributes[f"input_{kind}_scalars"] = values
            attributes[f"input_{kind}_scalar_positions"] = positions
    for kind, (values, positions, begins) in tuples.items():
        if positions:
            attributes[f"input_{kind}_tuples"] = values
            attributes[f"input_{kind}_tuple_positions"] = positions
            attributes[f"input_{kind}_tuple_begins"] = begins
    return attributes


def _scalar_kind(value: Any) -> str | None:
    # bool before int: bool is a subclass of int, and ORT rebuilds each kind as its own type.
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return None


def _tuple_kind(value: Any) -> str | None:
    if not isinstance(value, tuple):
        return None
    if not value:
        # An empty tuple rebuilds as () whatever its kind; int is the usual one (sizes, dims).
        return "int"
    kinds = {_scalar_kind(item) for item in value}
    if len(kinds) == 1 and None not in kinds:
        return kinds.pop()
    return None


def _attribute_value(kind: str, value: Any) -> int | float:
    return float(value) if kind == "float" else int(value)


def _onnx_dtype(call: FunctionCall, value: torch._C.Value, what: str) -> int:
    dtype = value.type().dtype() if isinstance(value.type(), torch._C.TensorType) else None
    if dtype not in _TORCH_TO_ONNX_DTYPE:
        raise ExportError(f"{call.func_name}: {what} has no exportable tensor dtype ({dtype})")
    return _TORCH_TO_ONNX_DTYPE[dtype]


def _rank(call: FunctionCall, value: torch._C.Value, what: str) -> int:
    rank = value.type().dim() if isinstance(value.type(), torch._C.TensorType) else None
    if rank is None:
        raise ExportError(f"{call.func_name}: the rank of {what} is unknown after tracing")
    return rank


def _torch_attribute_key(name: str, value: Any) -> str:
    # g.op reads the attribute type from a one-letter suffix (s string, i int, f float) and
    # makes it a list attribute when the value is a list.
    if isinstance(value, str):
        return f"{name}_s"
    items = value if isinstance(value, list) else [value]
    if items and all(isinstance(v, float) for v in items):
        return f"{name}_f"
    return f"{name}_i"


def name_context_outputs(model: ir.Model) -> int:
    """Name every PythonOp's ctx output ``<first tensor output>_ctx``; returns how many changed.

    The TorchScript exporter assigns value names after the symbolics ran, so this runs on
    the exported model.  A name already taken in the graph is left alone.
    """
    taken = {v.name for node in model.graph.all_nodes() for v in node.outputs if v.name}
    taken.update(v.name for v in model.graph.inputs if v.name)
    taken.update(model.graph.initializers)
    renamed = 0
    for node in model.graph.all_nodes():
        if node.op_type != "PythonOp" or node.domain != MS_DOMAIN or len(node.outputs) < 2:
            continue
        ctx, first = node.outputs[0], node.outputs[1]
        wanted = f"{first.name}{CONTEXT_SUFFIX}"
        if ctx.name == wanted or wanted in taken:
            continue
        taken.discard(ctx.name)
        ctx.name = wanted
        taken.add(wanted)
        renamed += 1
    return renamed
