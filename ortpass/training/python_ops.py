"""A ``torch.autograd.Function`` torch cannot trace, run from the torch builder's graph as
two Python ops (stock onnxruntime, through ``onnxruntime-extensions``).

The rule: a Function whose forward or backward torch cannot trace (a custom kernel, numpy,
a branch on a tensor's value) is kept opaque.  While the builder traces, its call becomes
one op ``ortpass_opaque::forward_<n>(tensors) -> (handle, *outputs)``, whose fake kernel
takes the output shapes from the PythonOp shape-inference registry
(:mod:`ortpass.pythonop.shape_inference`, the one place that knows a Function's shapes,
whichever builder runs), and whose autograd formula calls
``ortpass_opaque::backward_<n>(handle, *output grads) -> input grads``.  torch.onnx writes
both as nodes ``OrtpassForward_<n>`` / ``OrtpassBackward_<n>``, each in a domain of its own
(``ortpass.python_op.<process token>.forward<n>``: onnxruntime-extensions keeps the Python ops of one
domain in a vector that moves when it grows, which crashed sessions opened before), and :mod:`ortpass.training.python_op_kernels` runs them: the
Function's own forward and backward in eager torch, the ctx between them kept under the
handle.  The handle is an int64 scalar the forward node outputs and the backward node
reads, so the graph's split stashes it like any activation.

Only Functions a model applied while ortpass traced it are registered here (``_opaque``,
for the process's life); nothing a saved graph names is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import logging
import threading
import uuid
from typing import Any

import onnx_ir as ir
import torch
import torch.utils._pytree as pytree

from ortpass.conventions import MS_DOMAIN
from ortpass.errors import TrainingGraphError

__all__ = ["DOMAIN_PREFIX", "OpaqueCall", "is_python_op", "op_domain", "runs_here", "extensions_available", "opaque_apply", "ops_in", "register_ort_only_pair", "translation_table", "type_outputs"]

logger = logging.getLogger(__name__)

DOMAIN_PREFIX = "ortpass.python_op."  # + <process token>.forward<n> / ...: one op per domain
# The numbers <n> are this process's: a graph saved by another process (ORTModule's cache)
# names other calls under the same numbers, and must not run them.
PROCESS_TOKEN = uuid.uuid4().hex[:12]


def op_domain(kind: str) -> str:
    """The domain of one Python op of this process (``kind``: ``forward3``, ``attention0``...)."""
    return f"{DOMAIN_PREFIX}{PROCESS_TOKEN}.{kind}"


def runs_here(model: ir.Model) -> bool:
    """Whether every Python op of ``model`` was traced in this process (a graph loaded from
    another one's cache is built again instead)."""
    return all(not n.domain.startswith(DOMAIN_PREFIX) or n.domain.startswith(op_domain("")) for n in model.graph)
FORWARD_PREFIX, BACKWARD_PREFIX = "OrtpassForward_", "OrtpassBackward_"
_NAMESPACE = "ortpass_opaque"
_TENSOR = object()  # a template's placeholder for a tensor the op carries
# What onnxruntime-extensions' Python ops take and return (numpy has no bfloat16).
_RUNTIME_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)


@dataclasses.dataclass
class OpaqueCall:
    """One opaque ``Function.apply`` call: what its ops' tensors go back into at run time."""

    number: int
    function: type
    template: list[Any]  # the flat arguments, _TENSOR where the op carries a tensor
    spec: Any  # pytree spec of (args, kwargs)
    input_dtypes: list[torch.dtype]
    output_dtypes: list[torch.dtype]
    differentiable: list[int]  # positions (among the tensors) of the inputs that get a gradient
    keep_context: bool  # a training graph's forward keeps ctx for backward; a forward-only one not

    @property
    def func_name(self) -> str:
        return f"{self.function.__module__}.{self.function.__qualname__}"

    def arguments(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
        feed = iter(tensors)
        leaves = [next(feed) if leaf is _TENSOR else leaf for leaf in self.template]
        return pytree.tree_unflatten(leaves, self.spec)


_opaque: dict[int, OpaqueCall] = {}
_numbers = itertools.count()
_lock = threading.Lock()


def extensions_available() -> bool:
    """Whether ``onnxruntime-extensions`` (the only way stock onnxruntime runs Python code
    as an op) is installed."""
    return importlib.util.find_spec("onnxruntime_extensions") is not None


def opaque_call(number: int) -> OpaqueCall | None:
    return _opaque.get(number)


def is_python_op(node: Any) -> bool:
    """Whether an ONNX node (onnx_ir or proto) is an opaque Function's forward or backward."""
    return node.domain.startswith(DOMAIN_PREFIX) and is_python_op_type(node.op_type)


def is_python_op_type(op_type: str) -> bool:
    return op_type.startswith((FORWARD_PREFIX, BACKWARD_PREFIX)) and op_type.rpartition("_")[2].isdigit()


@functools.cache
def _library() -> torch.library.Library:
    return torch.library.Library(_NAMESPACE, "FRAGMENT")


def opaque_apply(cls: type, args: tuple, kwargs: dict, *, keep_context: bool) -> Any:
    """``cls.apply(*args, **kwargs)`` as the opaque op (called while torch.export traces)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not tensors:
        raise OpaqueFunctionError(f"torch.autograd.Function {name} takes no tensor: nothing for a Python op to carry")
    bad = [str(t.dtype) for t in tensors if t.dtype not in _RUNTIME_DTYPES]
    if bad:
        raise OpaqueFunctionError(f"torch.autograd.Function {name} takes a {bad[0]} tensor, which onnxruntime-extensions' Python ops cannot carry")
    number = next(_numbers)
    call = OpaqueCall(
        number, cls, [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec,
        [t.dtype for t in tensors], [], [k for k, t in enumerate(tensors) if t.is_floating_point()], keep_context,
    )  # fmt: skip
    shapes, dtypes = _inferred(call, tensors)
    call.output_dtypes = dtypes
    with _lock:
        _opaque[number] = call
    _define(call, len(shapes))
    outputs = getattr(torch.ops.ortpass_opaque, f"forward_{number}")(*tensors)[1:]
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


class OpaqueFunctionError(TrainingGraphError):
    """A Function that cannot run as a Python op either (no shape inferer, a dtype...)."""


def _inferred(call: OpaqueCall, tensors: list[torch.Tensor]) -> tuple[list[list[Any]], list[torch.dtype]]:
    """Output shapes (torch sizes, symbolic where the inputs' are) and dtypes from the
    registered shape inferer, called as for a PythonOp node."""
    from ortpass.pythonop.shape_inference import get_shape_inferer

    inferer = get_shape_inferer(call.function)
    if inferer is None:
        raise OpaqueFunctionError(
            f"torch.autograd.Function {call.func_name} runs outside torch's ops, so the torch builder runs it as a Python "
            "op, and needs its output shapes: register them with "
            f"@ortpass.pythonop.shape_inference.register_shape_inferer({call.function.__qualname__})"
        )
    symbols: dict[str, Any] = {}
    shapes = []
    for tensor in tensors:
        dims: list[int | str] = []
        for size in tensor.shape:
            if isinstance(size, torch.SymInt) and not size.node.is_nested_int() and not _static(size):
                symbols[str(size)] = size
                dims.append(str(size))
            else:
                dims.append(int(size))
        shapes.append(ir.Shape(dims))
    node = ir.Node(MS_DOMAIN, "PythonOp", inputs=[], attributes=[ir.AttrString("func_name", call.func_name)])
    types = [ir.DataType(_onnx_type(t.dtype)) for t in tensors]
    out_shapes, out_types = inferer(node, shapes, types)
    result = []
    for k, shape in enumerate(out_shapes):
        dims = list(shape.dims) if isinstance(shape, ir.Shape) else list(shape) if shape is not None else None
        if dims is None or any(d is None for d in dims):
            raise OpaqueFunctionError(f"the shape inferer of {call.func_name} leaves output {k}'s shape unknown; a Python op needs it")
        try:
            result.append([symbols[str(d.value if isinstance(d, ir.SymbolicDim) else d)] if not isinstance(d, int) else d for d in dims])
        except KeyError as exc:
            raise OpaqueFunctionError(f"the shape inferer of {call.func_name} names dim {exc} for output {k}, which no input has") from None
    dtypes = [_torch_type(t) if t is not None else tensors[0].dtype for t in out_types]
    return result, dtypes


def _static(size: torch.SymInt) -> bool:
    try:
        return size.node.expr.is_Integer
    except AttributeError:
        return False


def _onnx_type(dtype: torch.dtype) -> int:
    from ortpass.pythonop.export import _TORCH_TO_ONNX_DTYPE

    return _TORCH_TO_ONNX_DTYPE[dtype]


def _torch_type(onnx_type: Any) -> torch.dtype:
    from ortpass.pythonop.export import _TORCH_TO_ONNX_DTYPE

    wanted = int(onnx_type)
    return next(d for d, t in _TORCH_TO_ONNX_DTYPE.items() if t == wanted)


def register_ort_only_pair(library: torch.library.Library, n: int, fake_forward: Any, fake_backward: Any, what: str) -> None:
    """Register ``forward_<n>`` and ``backward_<n>`` of ``library``: the fake kernels torch
    traces with, and a real kernel that refuses (these ops run only inside ONNX Runtime, as
    Python ops; torch only traces them)."""
    namespace = library.ns

    def kernel_outside_the_graph(*_: Any) -> Any:
        raise TrainingGraphError(f"{namespace}::forward_{n} ({what}) runs only inside ONNX Runtime")

    torch.library.register_fake(f"{namespace}::forward_{n}", fake_forward, lib=library)
    torch.library.register_fake(f"{namespace}::backward_{n}", fake_backward, lib=library)
    library.impl(f"forward_{n}", kernel_outside_the_graph, "CompositeExplicitAutograd")
    library.impl(f"backward_{n}", kernel_outside_the_graph, "CompositeExplicitAutograd")


def _define(call: OpaqueCall, n_outputs: int) -> None:
    """The forward and backward ops of one call, their fake kernels and autograd."""
    library, n = _library(), call.number
    n_inputs, n_grads = len(call.input_dtypes), len(call.differentiable)
    inputs = ", ".join(f"Tensor t{k}" for k in range(n_inputs))
    library.define(f"forward_{n}({inputs}) -> ({', '.join(['Tensor'] * (1 + n_outputs))})")
    grads = "".join(f", Tensor g{k}" for k in range(n_outputs))
    sizes = "".join(f", SymInt[] s{k}" for k in range(n_grads))
    library.define(f"backward_{n}(Tensor handle{grads}{sizes}) -> ({', '.join(['Tensor'] * max(n_grads, 1))})")

    def fake_forward(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shapes, dtypes = _inferred(call, list(tensors))
        handle = tensors[0].new_empty((), dtype=torch.int64)
        return (handle, *(tensors[0].new_empty(s, dtype=d) for s, d in zip(shapes, dtypes)))

    def fake_backward(handle: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, ...]:
        sizes = rest[n_outputs:]
        grads = tuple(handle.new_empty(s, dtype=call.input_dtypes[k]) for s, k in zip(sizes, call.differentiable))
        return grads if len(grads) != 1 else grads[0]

    register_ort_only_pair(library, n, fake_forward, fake_backward, call.func_name)

    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.save_for_backward(output[0])
        ctx.input_sizes = [list(inputs[k].shape) for k in call.differentiable]
        ctx.outputs = [(list(o.shape), o.dtype) for o in output[1:]]

    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        (handle,) = ctx.saved_tensors
        filled = [g if g is not None else handle.new_zeros(s, dtype=d) for g, (s, d) in zip(grads[1:], ctx.outputs)]
        computed = getattr(torch.ops.ortpass_opaque, f"backward_{n}")(handle, *filled, *ctx.input_sizes)
        computed = computed if n_grads != 1 else (computed,)
        result: list[torch.Tensor | None] = [None] * n_inputs
        for k, grad in zip(call.differentiable, computed):
            result[k] = grad
        return tuple(result)

    if n_grads:  # else no output can require grad: nothing to differentiate
        torch.library.register_autograd(f"{_NAMESPACE}::forward_{n}", backward, setup_context=setup_context, lib=library)


def translation_table(program: torch.export.ExportedProgram) -> dict[Any, Any]:
    """torch.onnx translations of the opaque ops ``program`` holds: one custom-domain node
    each, the backward's sizes dropped (its kernel knows them from ctx)."""
    import onnxscript

    table: dict[Any, Any] = {}
    for target, side, number in ops_in(program, _NAMESPACE):
        call = _opaque[number]
        table[target] = _translation(onnxscript.values.Opset(op_domain(f"{side}{number}"), 1), side, call)
    return table


def ops_in(program: torch.export.ExportedProgram, namespace: str) -> list[tuple[Any, str, int]]:
    """(op, side, number) of each call in ``program`` to an op ``<side>_<number>`` of
    ``namespace`` (the ops :func:`register_ort_only_pair` registers)."""
    found = []
    for node in program.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == namespace:
            side, _, number = target._opname.partition("_")
            found.append((target, side, int(number)))
    return found


def _translation(contrib: Any, side: str, call: OpaqueCall) -> Any:
    op_type = f"{FORWARD_PREFIX if side == 'forward' else BACKWARD_PREFIX}{call.number}"
    n_outputs = 1 + len(call.output_dtypes) if side == "forward" else len(call.differentiable)
    n_tensors = len(call.input_dtypes) if side == "forward" else 1 + len(call.output_dtypes)

    _ensure_schema(contrib.domain, op_type, n_tensors, n_outputs)

    def translate(*args: Any) -> Any:
        outputs = getattr(contrib, op_type)(*args[:n_tensors], func_name=call.func_name)
        return tuple(outputs) if n_outputs > 1 else outputs

    translate.__name__ = op_type
    return translate


def _ensure_schema(domain: str, op_type: str, n_inputs: int, n_outputs: int) -> None:
    """onnx's schema of one op type: onnxscript writes a node only for an op it knows, with
    as many outputs as the schema has formal outputs (so no variadic ones)."""
    import onnx

    if onnx.defs.has(op_type, domain):
        return
    parameter = onnx.defs.OpSchema.FormalParameter
    types = [f"tensor({t})" for t in ("float", "double", "float16", "int64", "int32", "int8", "uint8", "bool")]
    schema = onnx.defs.OpSchema(
        op_type, domain, 1,
        doc="A torch.autograd.Function call run in eager torch (ortpass.training.python_op_kernels).",
        inputs=[parameter(f"input_{k}", f"I{k}") for k in range(n_inputs)],
        outputs=[parameter(f"output_{k}", f"O{k}") for k in range(n_outputs)],
        type_constraints=[(f"{t}{k}", types, "") for t, n in (("I", n_inputs), ("O", n_outputs)) for k in range(n)],
        attributes=[onnx.defs.OpSchema.Attribute("func_name", onnx.defs.OpSchema.AttrType.STRING, "", required=False)],
    )  # fmt: skip
    onnx.defs.register_schema(schema)


def type_outputs(model: ir.Model) -> None:
    """Give the Python op nodes' outputs their element types (torch.onnx leaves those of a
    custom op's tuple unset): the handle int64, the rest as the Function returns them."""
    for node in model.graph:
        if not is_python_op(node):
            continue
        call = _opaque[int(node.op_type.rpartition("_")[2])]
        if node.op_type.startswith(FORWARD_PREFIX):
            dtypes = [torch.int64, *call.output_dtypes]
        else:
            dtypes = [call.input_dtypes[k] for k in call.differentiable]
        for value, dtype in zip(node.outputs, dtypes):
            value.dtype = ir.DataType(_onnx_type(dtype))
