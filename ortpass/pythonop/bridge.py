"""The torch bridge: run ``com.microsoft::PythonOp`` / ``PythonOpGrad`` on ORT 1.19.2.

ORT's PythonOp kernels call two *runners* through C function pointers; ORT's own live in a
torch C++ extension that no longer builds against current torch, so ortpass's are plain
Python exposed as ``ctypes`` callbacks.  They dispatch on ``func_name`` through ortpass's
registry (:mod:`ortpass.pythonop.registry`): only Functions registered there, exported in
this process, or ortpass's own run.  Forward runs ``Function.apply`` on leaf copies of the
inputs and keeps what backward needs under a handle; backward runs the Function's own
``backward`` through ``torch.autograd.grad`` and frees the handle.  The C signatures, the
ABI and why inputs are copied: ``docs/design/pythonop-bridge.md``.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import itertools
import logging
import threading
from typing import Any

import onnx_ir as ir
import torch

from ortpass.errors import OrtpassError, UnregisteredFunctionError
from ortpass.infra.validate import (
    REQUIRED_PYTHONOP_ATTRIBUTES,
    refuse_pythonop_missing_attributes,
)
from ortpass.pythonop.registry import (
    all_nodes,
    pythonop_func_names,
    register_function,
    registered_functions,
    unregister_function,
)

__all__ = [
    "REQUIRED_PYTHONOP_ATTRIBUTES",
    "clear_contexts",
    "last_runner_error",
    "live_contexts",
    "prepare",
    "pythonop_func_names",
    "register_function",
    "registered_functions",
    "unregister_function",
]

logger = logging.getLogger(__name__)


_lock = threading.RLock()
_given_to_ort: set[str] = set()
_contexts: dict[int, "_CallRecord"] = {}
_handles = itertools.count(1)
_runners_installed = False
_last_error: BaseException | None = None


# -- preparing ORT ----------------------------------------------------------------------------


def prepare(model: ir.Model) -> None:
    """Check every PythonOp's Function is registered, then install the runners with ORT.

    Raises ModelLoadError naming the node and attribute for a PythonOp without one of
    :data:`REQUIRED_PYTHONOP_ATTRIBUTES`, and UnregisteredFunctionError naming the
    func_name and node for a Function nobody registered; nothing the model names is
    imported.  Idempotent.
    """
    _check_required_attributes(model)
    names = pythonop_func_names(model)
    if not names:
        return
    from onnxruntime.capi import _pybind_state as C

    _refuse_runtime_without_pythonop(C, names)
    known = registered_functions()
    for func_name, node_name in names.items():
        if func_name not in known:
            raise UnregisteredFunctionError(
                f"node {node_name!r} calls the autograd Function {func_name!r}, which is not registered "
                "in this process: call ortpass.pythonop.bridge.register_function(<the Function class>) "
                "(or ortpass.export.register_function) before building or running the model"
            )
    with _lock:
        _install_runners(C)
        for func_name in names:
            if func_name not in _given_to_ort:
                C.register_torch_autograd_function(func_name, _ort_pool_entry(known[func_name]))
                _given_to_ort.add(func_name)
    logger.debug("bridge ready for %s", sorted(names))




def _refuse_runtime_without_pythonop(C, names: dict[str, str]) -> None:
    """Stock onnxruntime has no PythonOp kernel and no runner hooks: say so, naming the
    Functions, instead of failing on a missing attribute of ORT's bindings."""
    if hasattr(C, "register_forward_runner"):
        return
    import onnxruntime

    raise OrtpassError(
        f"the graph runs torch.autograd.Function {sorted(names)} as PythonOp nodes, which only ONNX Runtime's "
        f"training build (onnxruntime-training-cpu 1.19.2) runs; this onnxruntime ({onnxruntime.__version__}) "
        "has no PythonOp kernel: build the graph with the torch builder (ORTModule(builder='torch'), "
        "ortpass.training.build_training_graph_from_torch), which takes a Function's forward and backward into "
        "the graph as torch traces them"
    )


def _check_required_attributes(model: ir.Model) -> None:
    """Refuse a PythonOp that lacks an attribute ORT needs, naming the node and attribute
    (otherwise it would surface as a call to an unregistered Function named '')."""
    for node in all_nodes(model):
        refuse_pythonop_missing_attributes(node)


def _ort_pool_entry(function: Any) -> type:
    # ORT's pool accepts only classes whose *direct* base is torch.autograd.Function; our
    # runners ignore the callback it hands back, so a stand-in serves deeper classes and
    # custom ops.
    if isinstance(function, type) and torch.autograd.Function in function.__bases__:
        return function
    name = getattr(function, "__name__", None) or type(function).__name__
    return type(name, (torch.autograd.Function,), {"__module__": __name__})


def _install_runners(C) -> None:
    global _runners_installed
    if _runners_installed:
        return
    C.register_forward_runner(ctypes.cast(_FORWARD_CALLBACK, ctypes.c_void_p).value)
    C.register_backward_runner(ctypes.cast(_BACKWARD_CALLBACK, ctypes.c_void_p).value)
    # ORT's pool holds Python objects in C++ statics; release them before the interpreter
    # goes away (ORT's own bridge does the same), or the process may crash at exit.
    atexit.register(C.unregister_python_functions)
    _runners_installed = True


# -- the context table ------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _CallRecord:
    """What a forward call keeps for its backward; the object ORT holds as ``ctx``."""

    handle: int
    func_name: str
    argument_count: int
    outputs: tuple[Any, ...]
    leaves: dict[int, torch.Tensor]  # argument position -> leaf tensor that needs a gradient


def live_contexts() -> int:
    """How many forward calls are waiting for their backward."""
    with _lock:
        return len(_contexts)


def clear_contexts() -> int:
    """Drop every pending forward context (e.g. after forward-only runs of a training graph)."""
    with _lock:
        count = len(_contexts)
        _contexts.clear()
    return count


def last_runner_error(*, clear: bool = False) -> BaseException | None:
    """The exception the latest failing runner raised (ORT reports only a generic error).

    ``clear=True`` also forgets it, so a later failure is not blamed on an old one.
    """
    global _last_error
    error = _last_error
    if clear:
        _last_error = None
    return error


# -- the runners (Python side) ----------------------------------------------------------------


def _lookup(func_name: str) -> Any:
    """The callable that runs ``func_name``: ``Function.apply`` or the custom op itself."""
    function = registered_functions().get(func_name)
    if function is None:
        raise UnregisteredFunctionError(f"autograd Function {func_name!r} is not registered with the bridge")
    if isinstance(function, type) and issubclass(function, torch.autograd.Function):
        return function.apply
    return function


def _run_forward(func_name: str, requires_grads, tensor_flags, training: bool, args: list) -> list:
    run = _lookup(func_name)
    call_args: list[Any] = []
    leaves: dict[int, torch.Tensor] = {}
    for position, (is_tensor, arg) in enumerate(zip(tensor_flags, args)):
        if not is_tensor or arg is None:
            call_args.append(arg)
            continue
        tensor = torch.from_dlpack(arg)
        if training:
            tensor = tensor.detach().clone().requires_grad_(bool(requires_grads[position]))
            if tensor.requires_grad:
                leaves[position] = tensor
        call_args.append(tensor)
    with torch.set_grad_enabled(training):
        outputs = run(*call_args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    inputs = [a for a in call_args if isinstance(a, torch.Tensor)]
    returned = [_to_ort(o, copy=training, inputs=inputs) for o in outputs]
    if not training:
        return [None, *returned]
    record = _CallRecord(next(_handles), func_name, len(args), outputs, leaves)
    with _lock:
        _contexts[record.handle] = record
    return [record, *returned]


def _run_backward(args: list) -> list:
    record, *grads = args
    if not isinstance(record, _CallRecord):
        raise TypeError(f"PythonOpGrad got a context of type {type(record).__name__}, not a bridge context")
    with _lock:
        _contexts.pop(record.handle, None)
    differentiable = [(o, g) for o, g in zip(record.outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
    positions = list(record.leaves)
    results: list[Any] = [None] * record.argument_count
    if differentiable and positions:
        outputs = [o for o, _ in differentiable]
        # torch materializes a missing output gradient as zeros before calling backward.
        grad_outputs = [torch.zeros_like(o) if g is None else torch.from_dlpack(g) for o, g in differentiable]
        input_grads = torch.autograd.grad(
            outputs, [record.leaves[p] for p in positions], grad_outputs, allow_unused=True
        )
        for position, grad in zip(positions, input_grads):
            grad = torch.zeros_like(record.leaves[position]) if grad is None else grad
            results[position] = _to_ort(grad, copy=False, inputs=grad_outputs)
    return results


def _to_ort(tensor: Any, *, copy: bool, inputs: list[torch.Tensor]) -> Any:
    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"a PythonOp output must be a tensor, got {type(tensor).__name__}")
    tensor = tensor.detach()
    # ORT may reuse an input's buffer after this node; never hand it one of its own buffers
    # back under a new name, and never one torch still holds for backward (copy=True).
    if copy or not tensor.is_contiguous() or any(_same_storage(tensor, t) for t in inputs):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return torch.utils.dlpack.to_dlpack(tensor)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# -- the C side: callbacks ORT calls through a function pointer ----------------------------------


class _StdVector(ctypes.Structure):
    # libstdc++'s std::vector<T>: pointers to the first element, one past the last element,
    # and one past the end of the storage.
    _fields_ = [("begin", ctypes.c_void_p), ("end", ctypes.c_void_p), ("end_of_storage", ctypes.c_void_p)]


def _read_int64s(address: int) -> list[int]:
    vector = _StdVector.from_address(address)
    if not vector.begin:
        return []
    count = (vector.end - vector.begin) // ctypes.sizeof(ctypes.c_int64)
    return list((ctypes.c_int64 * count).from_address(vector.begin))


def _read_objects(address: int) -> list[Any]:
    vector = _StdVector.from_address(address)
    if not vector.begin:
        return []
    count = (vector.end - vector.begin) // ctypes.sizeof(ctypes.c_void_p)
    pointers = (ctypes.c_void_p * count).from_address(vector.begin)
    # cast to py_object gives a new reference; ORT keeps its own.
    return [ctypes.cast(p, ctypes.py_object).value if p else None for p in pointers]


def _find_operator_new() -> Any:
    """``operator new(std::size_t)``, which ORT's ``std::allocator`` frees with ``delete``.

    The process's global scope first: an allocator preloaded there (jemalloc, tcmalloc)
    interposes ORT's ``delete`` too.  Its C++ runtime is not always there: torch 2.14's
    CUDA wheel loads libstdc++ with local binding only, so then the library ORT's own
    module names (``libstdc++.so.6``, already loaded; dlopen returns the same handle).
    """
    for name in (None, "libstdc++.so.6"):
        try:
            return ctypes.CDLL(name)._Znwm
        except (OSError, AttributeError):
            continue
    raise RuntimeError(
        "the PythonOp bridge found no C++ operator new (_Znwm) in this process or in libstdc++.so.6; "
        "it needs the GNU C++ runtime ONNX Runtime is built against"
    )


_operator_new = _find_operator_new()
_operator_new.restype = ctypes.c_void_p
_operator_new.argtypes = [ctypes.c_size_t]
_incref = ctypes.pythonapi.Py_IncRef
_incref.argtypes = [ctypes.py_object]
_incref.restype = None


def _write_objects(result_address: int, objects: list[Any]) -> None:
    """Construct the returned std::vector<PyObject*> in place, one new reference per item."""
    size = len(objects) * ctypes.sizeof(ctypes.c_void_p)
    storage = _operator_new(size) if objects else None
    if objects:
        slots = (ctypes.c_void_p * len(objects)).from_address(storage)
        for index, obj in enumerate(objects):
            _incref(obj)
            slots[index] = id(obj)
    vector = _StdVector.from_address(result_address)
    vector.begin = storage
    vector.end = storage + size if storage else None
    vector.end_of_storage = vector.end


_RUNNER = ctypes.CFUNCTYPE(
    ctypes.c_void_p,  # the hidden result pointer, returned as the ABI requires
    ctypes.c_void_p,  # hidden: where to construct the returned std::vector<PyObject*>
    ctypes.c_char_p,  # func_name
    ctypes.c_void_p,  # callback (Function.apply / backward from ORT's pool; unused)
    ctypes.c_void_p,  # const std::vector<int64_t>& requires_grads
    ctypes.c_void_p,  # const std::vector<int64_t>& tensor_flags
    ctypes.c_bool,  # is_training_mode
    ctypes.c_void_p,  # const std::vector<int64_t>& inplace_map
    ctypes.c_char_p,  # invoke_id
    ctypes.c_bool,  # safe_run_mode
    ctypes.c_void_p,  # const std::vector<PyObject*>& args
)


def _runner(kind: str):
    def callback(result, func_name, _callback, requires_grads, tensor_flags, training, _inplace, _invoke_id, _safe, args):
        global _last_error
        name = func_name.decode()
        try:
            arguments = _read_objects(args)
            if kind == "forward":
                objects = _run_forward(name, _read_int64s(requires_grads), _read_int64s(tensor_flags), training, arguments)
            else:
                objects = _run_backward(arguments)
            del arguments
        except BaseException as exc:  # noqa: BLE001 - an exception must not cross into C++
            _last_error = exc
            logger.error("PythonOp %s runner failed for %s: %s: %s", kind, name, type(exc).__name__, exc, exc_info=True)
            # An empty result makes ORT fail the run with an output-count error.
            objects = []
        _write_objects(result, objects)
        return result

    return _RUNNER(callback)


# Module-level: the callbacks must live as long as ORT may call them.
_FORWARD_CALLBACK = _runner("forward")
_BACKWARD_CALLBACK = _runner("backward")
