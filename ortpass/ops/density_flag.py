"""The label-density flag: a ``com.microsoft::PythonOp`` that ``ortpass.export`` (or
ORTModule) places on a loss's labels, recording the share of labels that count.  How to
recognize it, find it behind a label, and read its density; its shape inferer is registered
here so that a process that only loads a saved model (no torch) still infers its shape."""

from __future__ import annotations

import onnx_ir as ir

from ortpass.conventions import DENSITY_FLAG, MS_DOMAIN, is_onnx_domain
from ortpass.pythonop.shape_inference import register_shape_inferer

__all__ = ["FLAG_FUNC_NAME", "FLAG_FUNC_NAMES", "flag_before", "flag_density", "is_flag"]


#: func_name of the flag ``ortpass.export.density`` exports (module.QualName of the class).
#: Spelled out here so that passes do not import torch.
FLAG_FUNC_NAME = DENSITY_FLAG
#: Flags this pass recognizes: ours, and the one ORTModule exported.
FLAG_FUNC_NAMES = frozenset({FLAG_FUNC_NAME, "onnxruntime.training.ortmodule._runtime_inspector.FlagAndPrintDensity"})



def _flag_shape(node: ir.Node, input_shapes, input_dtypes):
    """The flag is an identity: its output keeps the label's dims (``batch``, ``seq``...)."""
    return [input_shapes[0]], [input_dtypes[0]]


# Registered here, not beside the torch Function, so that a process that only loads a
# saved model (and never imports torch) still infers the flag's shape.
for _name in sorted(FLAG_FUNC_NAMES):
    register_shape_inferer(_name)(_flag_shape)



def is_flag(node: ir.Node) -> bool:
    if node.op_type != "PythonOp" or node.domain != MS_DOMAIN:
        return False
    func_name = node.attributes.get("func_name")
    return func_name is not None and func_name.value in FLAG_FUNC_NAMES and len(node.outputs) >= 2


def flag_before(label: ir.Value | None) -> ir.Node | None:
    """The density flag producing ``label``, directly or through one Reshape."""
    producer = label.producer() if label is not None else None
    if producer is not None and producer.op_type == "Reshape" and is_onnx_domain(producer.domain):
        data = producer.inputs[0]
        producer = data.producer() if data is not None else None
    if producer is not None and is_flag(producer):
        return producer
    return None


def flag_density(flag: ir.Node) -> float | None:
    """The density the flag recorded at export (its first float argument), if any."""
    floats = flag.attributes.get("input_float_scalars")
    if floats is None or not floats.value:
        return None
    return float(floats.value[0])
