"""Run the opaque Function calls of a torch-built graph (:mod:`ortpass.training.python_ops`)
inside stock onnxruntime, as ``onnxruntime-extensions`` Python ops.

The rule: ``OrtpassForward_<n>`` applies the Function in eager torch on the node's inputs
(``torch.from_numpy``: no copy beyond the one onnxruntime-extensions makes), under grad,
and keeps the autograd graph it made (its ctx) under a fresh handle, the node's first
output; ``OrtpassBackward_<n>`` takes that entry out of the registry, releases it, and
differentiates it (``torch.autograd.grad``), which calls the Function's own ``backward``
with its ctx as eager torch would.  Two forwards before one backward keep two entries; a
forward-only graph (evaluation, ``no_grad``) keeps none.

What onnxruntime-extensions 0.15.2 imposes (measured with onnxruntime 1.32.0), and what
is done about it:

- an exception raised by a Python op aborts the process (``terminate called after
  throwing pybind11::error_already_set``), so a kernel never raises: it keeps the error,
  returns empty outputs, and the session raises it once the run returns
  (:func:`take_failure`, read by ``ortpass.runtime``);
- each op type has fixed input and output element types and counts (no variadic
  inputs): each call gets its own op type, registered before its session opens;
- the ops of one domain live in a ``std::vector`` that moves when an op is added, and a
  session opened before then crashed when it was released (a segfault in ORT's session
  destructor, after 8 ops were added): every op here has a domain of its own, a vector
  of one that never grows;
- inputs arrive as numpy copies (``torch.from_numpy`` then shares them);
- outputs go back through the package's Python hook, which turns each into a Python list
  (``ndarray.tolist()``, 130 ms for 1M floats); the library itself accepts a flat numpy
  array of the declared type and copies it with ``memcpy``, so ortpass installs a hook
  that answers its own ops with arrays (1.2 ms for 1M floats) and passes every other
  Python op to the package's hook unchanged (benchmarks/pythonop_call.py);
- the Python ops are global to the process, so registering is idempotent and locked; the
  kernels run on the thread calling ``session.run``, which takes the GIL for them.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ortpass.errors import OrtpassError
from ortpass.training.python_ops import DOMAIN_PREFIX, FORWARD_PREFIX, op_domain, OpaqueCall, is_python_op, is_python_op_type, opaque_call

__all__ = ["live_contexts", "prepare", "release", "take_failure", "uses_python_ops"]

logger = logging.getLogger(__name__)

_contexts: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # handle -> (inputs, outputs)
_handles = itertools.count(1)
_lock = threading.Lock()
_registered: set[str] = set()
_failure = threading.local()


def uses_python_ops(proto: Any) -> bool:
    """Whether an ``onnx.ModelProto`` holds opaque Function calls."""
    return any(is_python_op(n) for n in proto.graph.node)


def prepare(proto: Any, options: Any) -> None:
    """Register the Python ops ``proto`` runs and load onnxruntime-extensions' library into
    ``options``.  Raises naming the node whose Function this process never traced."""
    try:
        import onnxruntime_extensions
    except ImportError as exc:
        raise OrtpassError(
            "this graph runs torch.autograd.Functions as Python ops, which stock onnxruntime runs only through "
            "onnxruntime-extensions: pip install onnxruntime-extensions"
        ) from exc
    for node in proto.graph.node:
        if not node.domain.startswith(DOMAIN_PREFIX):
            continue
        kernel = _kernel_of(node.op_type) if node.domain.startswith(op_domain("")) else None
        if kernel is None:
            raise OrtpassError(
                f"node {node.name!r} runs {node.op_type}, a Python op that ortpass did not trace in this process; a graph "
                "with Python ops runs only where ortpass built it (nothing a model names is imported)"
            )
        _register(onnxruntime_extensions, node.domain, node.op_type, *kernel)
    options.register_custom_ops_library(onnxruntime_extensions.get_library_path())


#: Kernels of other Python op kinds (``ortpass.training.stock_attention``): op type -> the
#: op's (input dtypes, output dtypes, body), or None when it is not theirs.
kernel_sources: list[Callable[[str], tuple[list[torch.dtype], list[torch.dtype], Callable] | None]] = []


def _kernel_of(op_type: str) -> tuple[list[torch.dtype], list[torch.dtype], Callable] | None:
    for source in kernel_sources:
        kernel = source(op_type)
        if kernel is not None:
            return kernel
    call = opaque_call(int(op_type.rpartition("_")[2])) if is_python_op_type(op_type) else None
    if call is None:
        return None
    if op_type.startswith(FORWARD_PREFIX):
        return call.input_dtypes, [torch.int64, *call.output_dtypes], _forward_kernel(call)
    return [torch.int64, *call.output_dtypes], [call.input_dtypes[k] for k in call.differentiable], _backward_kernel(call)


def take_failure() -> BaseException | None:
    """The error a Python op's torch code raised in this thread's last run (then forgotten)."""
    error = getattr(_failure, "error", None)
    _failure.error = None
    return error


def live_contexts() -> int:
    """How many forward contexts wait for their backward."""
    return len(_contexts)


def release(handles) -> int:
    """Drop the forward contexts under ``handles`` that no backward took (a step dropped
    before its backward ran); returns how many there were.  Handles are never reused, so
    one whose backward ran is simply gone."""
    with _lock:
        return sum(_contexts.pop(int(handle), None) is not None for handle in handles)


_PYOP_TYPES = {
    torch.float32: "dt_float", torch.float64: "dt_double", torch.float16: "dt_float16", torch.int64: "dt_int64",
    torch.int32: "dt_int32", torch.int8: "dt_int8", torch.uint8: "dt_uint8", torch.bool: "dt_bool",
}  # fmt: skip


def register_failure(error: BaseException) -> None:
    """Keep ``error`` for the session to raise after the run (the first one of a run wins)."""
    if getattr(_failure, "error", None) is None:
        _failure.error = error


def _register(extensions: Any, domain: str, op_type: str, inputs: list, outputs: list, body: Callable) -> None:
    with _lock:
        if op_type in _registered:
            return
        _install_hook(extensions)
        types = extensions.PyOp
        inputs = [getattr(types, _PYOP_TYPES[d]) for d in inputs]
        outputs = [getattr(types, _PYOP_TYPES[d]) for d in outputs]
        definition = extensions.onnx_op(op_type=f"{domain}::{op_type}", inputs=inputs, outputs=outputs, attrs={"func_name": types.dt_string})(body)
        _ours.add(definition._id)
        _registered.add(op_type)


_ours: set[int] = set()  # onnxruntime-extensions' ids of the ops registered here
_hooked = False


def _install_hook(extensions: Any) -> None:
    """Answer ortpass's ops with flat numpy arrays, which the library copies with memcpy,
    instead of the lists the package's own hook makes; any other Python op goes to it."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    try:
        from onnxruntime_extensions import _ocos

        theirs, definitions = _ocos._on_pyop_invocation, _ocos.Opdef._odlist
    except (ImportError, AttributeError):  # another version's internals: its own hook (lists) runs
        logger.warning("onnxruntime-extensions %s: Python op outputs go back as lists (slow)", extensions.__version__)
        return

    def invoke(op_id: int, feed: Any, attributes: Any) -> tuple:
        if op_id not in _ours:
            return theirs(op_id, feed, attributes)
        result = definitions[op_id].body(*feed)
        arrays = result if isinstance(result, tuple) else (result,)
        flat: list[Any] = [op_id]
        for array in arrays:
            flat += [array.shape, np.ascontiguousarray(array).reshape(-1)]
        return tuple(flat)

    extensions.PyOp.install_hooker(invoke)


def _failed(exc: BaseException, call: OpaqueCall, side: str, dtypes: list[torch.dtype]) -> tuple[np.ndarray, ...]:
    """Keep the error for the session to raise; empty outputs of the declared types."""
    logger.debug("%s of %s failed", side, call.func_name, exc_info=exc)
    error = OrtpassError(f"the {side} of torch.autograd.Function {call.func_name} raised {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    register_failure(error)
    return tuple(np.zeros((0,), dtype=torch.empty((), dtype=d).numpy().dtype) for d in dtypes)


def _forward_kernel(call: OpaqueCall) -> Any:
    def forward(*arrays: np.ndarray, **_: Any) -> tuple[np.ndarray, ...]:
        try:
            inputs = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
            for k in call.differentiable if call.keep_context else ():
                inputs[k].requires_grad_(True)
            args, kwargs = call.arguments(inputs)
            with torch.set_grad_enabled(call.keep_context):
                output = call.function.apply(*args, **kwargs)
            outputs = list(output) if isinstance(output, tuple) else [output]
            if len(outputs) != len(call.output_dtypes) or any(o.dtype != d for o, d in zip(outputs, call.output_dtypes)):
                raise TypeError(
                    f"it returned {[str(o.dtype) for o in outputs]}, and its shape inferer said {[str(d) for d in call.output_dtypes]}"
                )
            handle = 0
            if call.keep_context:
                handle = next(_handles)
                with _lock:
                    _contexts[handle] = ([inputs[k] for k in call.differentiable], outputs)
            return (np.array(handle, dtype=np.int64), *(o.detach().numpy() for o in outputs))
        except BaseException as exc:  # raising here would abort the process
            return _failed(exc, call, "forward", [torch.int64, *call.output_dtypes])

    return forward


def _backward_kernel(call: OpaqueCall) -> Any:
    def backward(handle: np.ndarray, *grads: np.ndarray, **_: Any) -> Any:
        try:
            with _lock:
                entry = _contexts.pop(int(handle), None)
            if entry is None:
                raise RuntimeError(f"no forward context under handle {int(handle)} (its forward failed, or its backward already ran)")
            inputs, outputs = entry
            pairs = [(o, torch.from_numpy(np.ascontiguousarray(g))) for o, g in zip(outputs, grads) if o.requires_grad]
            computed = torch.autograd.grad(
                [o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True
            ) if pairs else [None] * len(inputs)  # fmt: skip
            result = tuple(
                (g if g is not None else torch.zeros_like(x)).detach().numpy() for g, x in zip(computed, inputs)
            )
            return result if len(result) != 1 else result[0]
        except BaseException as exc:
            failed = _failed(exc, call, "backward", [call.input_dtypes[k] for k in call.differentiable])
            return failed if len(failed) != 1 else failed[0]

    return backward
