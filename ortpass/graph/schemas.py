"""ONNX Runtime's own ops in the ONNX domain (""), made known to onnx.

ORT registers a few ops of its own in the ONNX domain rather than ``com.microsoft``
(measured on ORT 1.19.2, docs/design/ort-facts.md): ``SimplifiedLayerNormalization``
(which its pre-gradient fusions make of every RMSNorm chain), the gradient ops its
builder emits there (``MaxPoolGrad``, ``AveragePoolGrad``, ``SparseSoftmaxCrossEntropyGrad``)
and ``SparseSoftmaxCrossEntropy``.  onnx knows none of them, so ``onnx.checker`` refused
every graph holding one ("No Op registered for SimplifiedLayerNormalization"), and onnx's
shape inference left their outputs without shapes.

:func:`register_ort_schemas` registers an ``onnx.defs.OpSchema`` for each in onnx's
process-wide registry, once: the checker then checks them (input and output counts,
types, attribute names and types) as ORT's schemas would, and an op neither knows is still
refused.  The training build of ORT 1.19.2 exposes no schema registry to Python
(``get_all_operator_schema`` is missing from its pybind module), so the signatures are
written out here from ORT's schemas; ORT accepts unlisted attributes on these ops
(``AllowUncheckedAttributes``), which onnx's Python schemas cannot express, so the
attributes listed are every one ORT's fusions and gradient builder write (the gradient
ops copy their forward op's attributes).  Where onnx later defines an op of the same name,
onnx's schema is kept.
"""

from __future__ import annotations

import logging
import threading

import onnx
import onnx.defs

__all__ = ["ORT_ONNX_DOMAIN_OPS", "register_ort_schemas"]

logger = logging.getLogger(__name__)

_Param = onnx.defs.OpSchema.FormalParameter
_OPTIONAL = onnx.defs.OpSchema.FormalParameterOption.Optional
_FLOATS = ["tensor(float16)", "tensor(float)", "tensor(double)", "tensor(bfloat16)"]
_LOCK = threading.Lock()
_registered = False


def _attr(name: str, default: object) -> onnx.defs.OpSchema.Attribute:
    return onnx.defs.OpSchema.Attribute(name, onnx.helper.make_attribute(name, default), "")


def _optional_attr(name: str, kind: onnx.defs.OpSchema.AttrType) -> onnx.defs.OpSchema.Attribute:
    return onnx.defs.OpSchema.Attribute(name, kind, "", required=False)


_INTS = onnx.defs.OpSchema.AttrType.INTS
_INT = onnx.defs.OpSchema.AttrType.INT
_STRING = onnx.defs.OpSchema.AttrType.STRING


def _normalized_shape(input_type: onnx.TypeProto, axis: int) -> onnx.TypeProto | None:
    """``input_type``'s shape with the normalized dims (``axis`` to the last) set to 1:
    the shape ORT's kernel gives InvStdDev.  (ORT's own schema inference sets only
    ``axis`` to 1, which its kernel contradicts when ``axis`` is not the last dim.)"""
    if not input_type.tensor_type.HasField("shape"):
        return None
    out = onnx.TypeProto()
    out.tensor_type.elem_type = onnx.TensorProto.FLOAT
    out.tensor_type.shape.CopyFrom(input_type.tensor_type.shape)
    dims = out.tensor_type.shape.dim
    rank = len(dims)
    axis = axis + rank if axis < 0 else axis
    for dim in dims[axis:]:
        dim.Clear()
        dim.dim_value = 1
    return out


def _infer_simplified_layer_norm(ctx: onnx.shape_inference.InferenceContext) -> None:
    x_type = ctx.get_input_type(0)
    scale_type = ctx.get_input_type(1)
    if x_type is None or not x_type.HasField("tensor_type"):
        return
    y = onnx.TypeProto()
    y.CopyFrom(x_type)
    if scale_type is not None and scale_type.tensor_type.elem_type:
        y.tensor_type.elem_type = scale_type.tensor_type.elem_type
    ctx.set_output_type(0, y)
    if ctx.get_num_outputs() > 1 and ctx.has_output(1):
        axis_attr = ctx.get_attribute("axis")
        inv_std = _normalized_shape(x_type, axis_attr.i if axis_attr is not None else -1)
        if inv_std is not None:
            stash = ctx.get_attribute("stash_type")
            if stash is not None and stash.i == onnx.TensorProto.DOUBLE:
                inv_std.tensor_type.elem_type = onnx.TensorProto.DOUBLE
            ctx.set_output_type(1, inv_std)


def _simplified_layer_norm() -> onnx.defs.OpSchema:
    schema = onnx.defs.OpSchema(
        "SimplifiedLayerNormalization",
        "",
        1,
        "RMSNorm (ONNX Runtime contrib op): Y = X / sqrt(mean(X^2 over axis..) + epsilon) * scale.",
        inputs=[_Param("X", "T", ""), _Param("scale", "V", "")],
        outputs=[_Param("Y", "V", ""), _Param("inv_std_var", "U", "", param_option=_OPTIONAL)],
        type_constraints=[("T", _FLOATS, ""), ("V", _FLOATS, ""), ("U", ["tensor(float)", "tensor(double)"], "")],
        attributes=[_attr("axis", -1), _attr("epsilon", 1e-5), _attr("stash_type", 1)],
    )
    schema.set_type_and_shape_inference_function(_infer_simplified_layer_norm)
    return schema


# The attributes of MaxPool / AveragePool (any opset), which ORT's gradient builder copies
# onto their gradient ops.
_POOL_ATTRS = [
    _optional_attr("kernel_shape", _INTS),
    _optional_attr("strides", _INTS),
    _optional_attr("pads", _INTS),
    _optional_attr("dilations", _INTS),
    _optional_attr("auto_pad", _STRING),
    _optional_attr("ceil_mode", _INT),
]


def _max_pool_grad() -> onnx.defs.OpSchema:
    return onnx.defs.OpSchema(
        "MaxPoolGrad",
        "",
        9,
        "Gradient of MaxPool (ONNX Runtime training op).",
        inputs=[_Param("dY", "T", ""), _Param("Indices", "I", "")],
        outputs=[_Param("dX", "T", "")],
        type_constraints=[("T", _FLOATS[:3], ""), ("I", ["tensor(int64)"], "")],
        attributes=[*_POOL_ATTRS, _optional_attr("storage_order", _INT)],
    )


def _average_pool_grad() -> onnx.defs.OpSchema:
    kernel_shape = onnx.defs.OpSchema.Attribute("kernel_shape", _INTS, "", required=True)
    return onnx.defs.OpSchema(
        "AveragePoolGrad",
        "",
        9,
        "Gradient of AveragePool (ONNX Runtime training op).",
        inputs=[_Param("dY", "T", "")],
        outputs=[_Param("dX", "T", "")],
        type_constraints=[("T", _FLOATS[:3], "")],
        attributes=[kernel_shape, *_POOL_ATTRS[1:], _optional_attr("count_include_pad", _INT)],
    )


def _sparse_softmax_cross_entropy() -> onnx.defs.OpSchema:
    return onnx.defs.OpSchema(
        "SparseSoftmaxCrossEntropy",
        "",
        9,
        "Softmax cross-entropy with class-index labels (ONNX Runtime training op).",
        inputs=[_Param("logits", "T", ""), _Param("label", "Tind", ""), _Param("weight", "T", "", param_option=_OPTIONAL)],
        outputs=[_Param("Y", "T", ""), _Param("log_prob", "T", "", param_option=_OPTIONAL)],
        type_constraints=[("T", _FLOATS, ""), ("Tind", ["tensor(int32)", "tensor(int64)"], "")],
        attributes=[_attr("reduction", "mean")],
    )


def _sparse_softmax_cross_entropy_grad() -> onnx.defs.OpSchema:
    return onnx.defs.OpSchema(
        "SparseSoftmaxCrossEntropyGrad",
        "",
        9,
        "Gradient of SparseSoftmaxCrossEntropy (ONNX Runtime training op).",
        inputs=[
            _Param("dY", "T", ""),
            _Param("log_prob", "T", ""),
            _Param("label", "Tind", ""),
            _Param("weight", "T", "", param_option=_OPTIONAL),
        ],
        outputs=[_Param("d_logits", "T", "")],
        type_constraints=[("T", _FLOATS, ""), ("Tind", ["tensor(int32)", "tensor(int64)"], "")],
        attributes=[_attr("reduction", "mean")],
    )


_SCHEMAS = (
    _simplified_layer_norm,
    _max_pool_grad,
    _average_pool_grad,
    _sparse_softmax_cross_entropy,
    _sparse_softmax_cross_entropy_grad,
)

#: The ops ORT 1.19.2 registers in the ONNX domain that onnx does not define.
ORT_ONNX_DOMAIN_OPS = frozenset(
    {"SimplifiedLayerNormalization", "MaxPoolGrad", "AveragePoolGrad", "SparseSoftmaxCrossEntropy", "SparseSoftmaxCrossEntropyGrad"}
)


def register_ort_schemas() -> None:
    """Register ORT's ONNX-domain ops with onnx (once per process; idempotent)."""
    global _registered
    with _LOCK:
        if _registered:
            return
        for make in _SCHEMAS:
            schema = make()
            if onnx.defs.has(schema.name, schema.domain):
                logger.debug("onnx defines %s itself; keeping onnx's schema", schema.name)
                continue
            onnx.defs.register_schema(schema)
        _registered = True
