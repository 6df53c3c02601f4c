"""The ``dynamo=True`` path: ``torch.library.custom_op`` functions as ``com.microsoft::PythonOp``.

torch.export inlines a plain ``torch.autograd.Function`` (its custom backward is lost), so
on this path only a ``torch.library.custom_op`` with ``register_fake`` and
``register_autograd`` stays one node.  :func:`export_with_custom_ops` runs
``torch.onnx.export(..., dynamo=True)`` with a ``custom_translation_table`` that turns each
listed op into one PythonOp whose ``func_name`` is the op's name (``namespace::name``),
with the same attributes the TorchScript path writes (``ortpass.pythonop.export``).

onnxscript builds a node only from a known schema and keeps only declared attributes,
so :func:`ensure_pythonop_schema` registers ORT's PythonOp attribute set as an
``onnx.defs.OpSchema`` (com.microsoft, version 1) once per process; the ONNX checker then
also validates PythonOp attributes by type.

The output dtypes and ranks are known only after the exporter has typed the node's outputs
from torch.export's metadata, so they are filled in after the export.  Exported ops are
recorded so the torch bridge may run them (through the op itself, whose registered
autograd gives the backward).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Iterable, Sequence

import onnx
import onnx_ir as ir
import torch

from ortpass.errors import ExportError
from ortpass.pythonop.export import (
    MS_DOMAIN,
    constant_attributes,
    name_context_outputs,
    record_exported,
)

__all__ = [
    "PYTHONOP_ATTRIBUTES",
    "complete_output_attributes",
    "custom_op_name",
    "custom_op_translation_table",
    "ensure_pythonop_schema",
    "export_with_custom_ops",
    "pythonop_translation",
]

logger = logging.getLogger(__name__)

_INTS = onnx.defs.OpSchema.AttrType.INTS
_FLOATS = onnx.defs.OpSchema.AttrType.FLOATS
_INT = onnx.defs.OpSchema.AttrType.INT
_STRING = onnx.defs.OpSchema.AttrType.STRING

#: ORT 1.19.2's PythonOp attributes and their types (training_op_defs.cc).
PYTHONOP_ATTRIBUTES: dict[str, Any] = {
    "func_name": _STRING,
    "input_convention": _STRING,
    "input_requires_grads": _INTS,
    "input_tensor_types": _INTS,
    "input_tensor_ranks": _INTS,
    "output_tensor_types": _INTS,
    "output_tensor_ranks": _INTS,
    "training_mode": _INT,
    "safe_run_mode": _INT,
    "comment": _STRING,
    "tensor_reuse_map": _INTS,
    **{f"input_{kind}_scalars": (_FLOATS if kind == "float" else _INTS) for kind in ("bool", "int", "float")},
    **{f"input_{kind}_scalar_positions": _INTS for kind in ("bool", "int", "float")},
    **{f"input_{kind}_tuples": (_FLOATS if kind == "float" else _INTS) for kind in ("bool", "int", "float")},
    **{f"input_{kind}_tuple_positions": _INTS for kind in ("bool", "int", "float")},
    **{f"input_{kind}_tuple_begins": _INTS for kind in ("bool", "int", "float")},
    # Declared so the checker accepts models from ORT's own exporter; ortpass never writes them.
    "input_pointer_scalars": _INTS,
    "input_pointer_scalar_positions": _INTS,
}

_REQUIRED = {"func_name", "input_convention"}

_TENSOR_TYPES = [
    f"tensor({t})"
    for t in ("float", "float16", "bfloat16", "double", "int64", "int32", "int16", "int8", "uint8", "bool")
]


def ensure_pythonop_schema() -> None:
    """Register com.microsoft::PythonOp (version 1) with onnx, unless a schema exists."""
    if onnx.defs.has("PythonOp", MS_DOMAIN):
        return
    parameter = onnx.defs.OpSchema.FormalParameter
    variadic = onnx.defs.OpSchema.FormalParameterOption.Variadic
    schema = onnx.defs.OpSchema(
        "PythonOp",
        MS_DOMAIN,
        1,
        doc="A torch.autograd.Function or torch custom op run by ONNX Runtime's torch bridge.",
        inputs=[parameter("inputs", "T", param_option=variadic, is_homogeneous=False, min_arity=0)],
        outputs=[
            parameter("context", "TInt64"),
            parameter("outputs", "T", param_option=variadic, is_homogeneous=False, min_arity=1),
        ],
        type_constraints=[("T", _TENSOR_TYPES, "tensor arguments and results"), ("TInt64", ["tensor(int64)"], "ctx")],
        attributes=[
            onnx.defs.OpSchema.Attribute(name, kind, "", required=name in _REQUIRED)
            for name, kind in PYTHONOP_ATTRIBUTES.items()
        ],
    )
    onnx.defs.register_schema(schema)
    logger.debug("registered the com.microsoft::PythonOp schema with onnx")


def custom_op_name(op: Any) -> str:
    """``namespace::name`` of a custom op (CustomOpDef, OpOverloadPacket or OpOverload)."""
    name = getattr(op, "_qualname", None) or getattr(getattr(op, "_schema", None), "name", None)
    if name is None:
        raise TypeError(f"{op!r} is not a torch.library custom op")
    return name


def _overload(op: Any) -> torch._ops.OpOverload:
    if isinstance(op, torch._ops.OpOverload):
        return op
    namespace, name = custom_op_name(op).split("::", 1)
    return getattr(getattr(torch.ops, namespace), name).default


def pythonop_translation(op: Any) -> Callable[..., Any]:
    """A dynamo translation function emitting ``op`` as one PythonOp."""
    import onnxscript

    ensure_pythonop_schema()
    overload = _overload(op)
    func_name = custom_op_name(op)
    schema = overload._schema
    arguments = list(schema.arguments)
    convention = "".join("d" if isinstance(a.type, torch.TensorType) else "c" for a in arguments)
    if any(not isinstance(r.type, torch.TensorType) for r in schema.returns) or not schema.returns:
        raise ExportError(f"{func_name}: only custom ops returning one or more Tensors can be PythonOps ({schema})")
    output_count = len(schema.returns)
    microsoft = onnxscript.values.Opset(MS_DOMAIN, 1)

    def translate(*args: Any) -> Any:
        # torch.export drops trailing arguments left at their default; put them back.
        values = list(args) + [a.default_value for a in arguments[len(args) :]]
        tensors = [v for v, c in zip(values, convention) if c == "d"]
        constants = [tuple(v) if isinstance(v, list) else v for v in values]
        attributes = {
            "func_name": func_name,
            "input_convention": convention,
            "input_requires_grads": [int(c == "d" and v.dtype.is_floating_point()) for v, c in zip(values, convention)],
            "input_tensor_types": [int(t.dtype) for t in tensors],
            "input_tensor_ranks": [len(t.shape) for t in tensors],
            "training_mode": 1,
            "safe_run_mode": 1,
            **constant_attributes(func_name, convention, constants),
        }
        results = microsoft.PythonOp(*tensors, **attributes, _outputs=1 + output_count)
        outputs = results[1:]
        return outputs[0] if output_count == 1 else tuple(outputs)

    translate.__name__ = f"pythonop_{func_name.replace('::', '_')}"
    return translate


def custom_op_translation_table(ops: Iterable[Any]) -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    """``custom_translation_table`` entries for ``torch.onnx.export(..., dynamo=True)``."""
    return {_overload(op): pythonop_translation(op) for op in ops}


def export_with_custom_ops(
    module: torch.nn.Module,
    args: Sequence[Any],
    *,
    custom_ops: Iterable[Any],
    opset: int = 18,
    **export_kwargs: Any,
) -> ir.Model:
    """``torch.onnx.export(module, args, dynamo=True)`` with ``custom_ops`` as PythonOps.

    Returns the onnx_ir model with every PythonOp's output types and ranks filled in and
    its ctx output named ``<first output>_ctx``; the ops are recorded for the bridge.
    """
    custom_ops = list(custom_ops)
    table = custom_op_translation_table(custom_ops)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=FutureWarning)
            # Exporting in training mode is the point: the graph is for training.
            warnings.filterwarnings("ignore", message="Exporting a model while it is in training mode")
            program = torch.onnx.export(
                module,
                tuple(args),
                dynamo=True,
                opset_version=opset,
                custom_translation_table=table,
                optimize=False,
                verbose=False,
                **export_kwargs,
            )
    except ExportError:
        raise
    except Exception as exc:
        raise ExportError(f"dynamo export of {type(module).__name__} failed: {type(exc).__name__}: {exc}") from exc
    model = program.model
    complete_output_attributes(model)
    name_context_outputs(model)
    for op in custom_ops:
        record_exported(custom_op_name(op), op)
    return model


def complete_output_attributes(model: ir.Model) -> int:
    """Fill ``output_tensor_types``/``ranks`` of PythonOps from their typed outputs."""
    completed = 0
    for node in model.graph.all_nodes():
        if node.op_type != "PythonOp" or node.domain != MS_DOMAIN or "output_tensor_types" in node.attributes:
            continue
        outputs = node.outputs[1:]
        if any(v.dtype is None or v.shape is None for v in outputs):
            raise ExportError(f"PythonOp {node.name!r}: the exporter left an output untyped; cannot record its type and rank")
        node.attributes["output_tensor_types"] = ir.AttrInt64s("output_tensor_types", [int(v.dtype) for v in outputs])
        node.attributes["output_tensor_ranks"] = ir.AttrInt64s("output_tensor_ranks", [v.shape.rank() for v in outputs])
        node.outputs[0].dtype = ir.DataType.INT64
        node.outputs[0].shape = ir.Shape([])
        completed += 1
    return completed
