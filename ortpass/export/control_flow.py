"""Refuse a trace whose Python code read a tensor's value: that trace froze one path.

TorchScript's tracer records tensor ops only.  Where the module's Python turns a tensor
into a Python value (``if x.mean() > 0:``, ``x[:, :int(lengths.max())]``,
``for _ in range(int(n))``), the trace keeps the path that value chose for the export
batch and replays it for every later batch: wrong for another batch, silently.

The rule: while the exporter traces, every conversion of a tensor to a Python value
(``bool()``, ``int()``, ``float()``, ``operator.index``, ``.item()``, ``.tolist()``,
``torch.equal`` ...) is looked up in the trace: the graph value being converted is
followed back through the ops that made it.  It is refused when it reaches

- a graph input's or a parameter's *data* (``prim::Param`` read by an op other than a
  size query): the path depends on the batch or on the weights;
- a random op (``aten::rand``, ``bernoulli`` ...): the path depends on the draw.

It is allowed when everything it comes from is a size (``aten::size``, ``numel``,
``dim``) or a constant: the value then changes only with the batch's shape, and
ORTModule's second export at other sizes (:mod:`ortpass.runtime.module.dims`) pins every
dim whose size the graph baked in (a constant that differs between the two exports).
This is what the Hugging Face families do while tracing (``docs/design/control-flow.md``
lists them): comparisons of sizes (query and key lengths, the mask's length).
transformers skips its value-reading shortcuts (``padding_mask.all()``)
while ``torch.jit.is_tracing()``.

A conversion inside a ``torch.autograd.Function``'s forward is allowed: the exporter writes
the call as one PythonOp, whose forward torch runs at every step, or with the Function's
registered exporter; the trace keeps none of its Python.

Known safe call sites that read data, each with its reason (:data:`SAFE_CALL_SITES`):
BatchNorm's cumulative average (``momentum=None``) reads ``num_batches_tracked``, but
ORTModule computes the running statistics itself (:mod:`ortpass.runtime.module.state`),
so the factor the trace bakes in is never used.

Not detected: a branch on sizes that both export sizes take the same way
(``if x.shape[1] > 1000``), Python state outside tensors (a counter in ``self``), and
conversions done in C++ without a Python call.  torch.export (the torch builder) needs no
watch: it refuses a data-dependent branch itself, which :func:`data_dependent_refusal`
words as this module's refusal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import logging
import os
import sys
import warnings
from typing import Iterator

import torch

from ortpass.errors import ExportError

__all__ = [
    "Conversion", "DataDependentControlFlow", "data_dependent_refusal", "refuse_data_dependent", "watching_conversions",
]

logger = logging.getLogger(__name__)

#: Tensor methods that hand Python a value read from a tensor: what they give.
_METHODS = {
    "__bool__": "a Python bool",
    "__int__": "a Python int",
    "__index__": "a Python index",
    "__float__": "a Python float",
    "__complex__": "a Python complex",
    "item": "a Python number (.item())",
    "tolist": "a Python list (.tolist())",
    "numpy": "a NumPy array",
    "equal": "a Python bool (Tensor.equal)",
    "allclose": "a Python bool (Tensor.allclose)",
}
#: torch functions that do the same.
_FUNCTIONS = {
    "equal": "a Python bool (torch.equal)",
    "allclose": "a Python bool (torch.allclose)",
    "is_nonzero": "a Python bool (torch.is_nonzero)",
}

#: Graph nodes whose output depends on their inputs' shapes only.
_SHAPE_OPS = {"aten::size", "aten::numel", "aten::dim", "aten::sym_size", "prim::shape", "onnx::Shape"}

#: Graph nodes whose output is a random draw.
_RANDOM_OPS = {
    "aten::rand", "aten::randn", "aten::randint", "aten::randperm", "aten::rand_like", "aten::randn_like",
    "aten::randint_like", "aten::bernoulli", "aten::bernoulli_", "aten::normal", "aten::normal_",
    "aten::uniform_", "aten::multinomial", "aten::dropout", "aten::feature_dropout", "aten::exponential_",
}  # fmt: skip

#: Call sites that read data yet trace right, as (path ending, function): the reason.
SAFE_CALL_SITES = {
    ("torch/nn/modules/batchnorm.py", "forward"): (
        "momentum=None reads num_batches_tracked for the cumulative average; ORTModule computes the running "
        "statistics in torch from the batch statistics, so the baked factor is never used"
    ),
}

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_ORTPASS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: ortpass's code that runs inside the trace on purpose (probes, symbolics, PythonOp export).
_ORTPASS_HOOKS = tuple(os.path.join(_ORTPASS_DIR, p) for p in ("export" + os.sep, "pythonop" + os.sep))
#: ortpass's code that only calls the module being traced.
_ORTPASS_CALLERS = (os.path.join(_ORTPASS_DIR, "export", "torchscript.py"),)


@dataclasses.dataclass(frozen=True)
class Conversion:
    """One tensor-to-Python conversion during a trace: where, into what, and from what."""

    what: str
    file: str
    line: int
    code: str
    source: str  # what it reads: "sizes", "the data of x", "a random op (...)"
    data_dependent: bool  # False for sizes, and where the value cannot freeze the graph

    def where(self) -> str:
        return f"{self.file}:{self.line}" + (f": {self.code}" if self.code else "")


class DataDependentControlFlow(ExportError):
    """The module's Python read a tensor's value while being traced (see the module doc)."""


class _Watch:
    """Wraps the conversions (on ``torch.Tensor`` and in ``torch``) while it is on, and
    records those made while the TorchScript tracer is on.  Wrapping the conversions
    alone (not a TorchFunctionMode over every op) leaves every other warning's source line
    the user's."""

    def __init__(self) -> None:
        self.conversions: list[Conversion] = []
        self.in_function = 0  # depth of autograd.Function calls the trace is inside

    def wrap_apply(self, original):
        """``Function.apply`` that counts the calls the trace is inside: a Function's
        forward is exported as one PythonOp (run by torch at every step) or by its own
        symbolic, so a value it reads freezes nothing."""
        watch = self

        def apply(cls, *args, **kwargs):
            watch.in_function += 1
            try:
                return original.__get__(None, cls)(*args, **kwargs)
            finally:
                watch.in_function -= 1

        return classmethod(apply)

    def wrap(self, original, what: str):
        def converted(*args, **kwargs):
            if torch._C._get_tracing_state() is None:
                return original(*args, **kwargs)
            self._record(what, args, sys._getframe(1))
            with warnings.catch_warnings():  # recorded here: refused, or logged as sizes-only
                warnings.filterwarnings("ignore", message="Converting a tensor to a", category=torch.jit.TracerWarning)
                return original(*args, **kwargs)

        return converted

    def _record(self, what: str, args: tuple, caller) -> None:
        where = _user_frame(caller)
        if where is None:
            return
        file, line = where
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        source = _first_data_source(tensors)
        frozen = source != "sizes"
        if frozen and _is_safe_call_site(caller.f_code.co_filename, caller.f_code.co_name):
            source, frozen = f"{source}, at a known safe call site", False
        elif frozen and self.in_function:
            source, frozen = f"{source}, inside an autograd.Function's forward", False
        code = linecache.getline(file, line).strip()
        self.conversions.append(Conversion(what, file, line, code, source, frozen))


def _user_frame(frame) -> tuple[str, int] | None:
    """(file, line) of the code that converted: the innermost frame outside torch (the
    line in the user's code, or in transformers', that called into torch).  Where that
    frame is ortpass's hook into the trace (the density probe reads the labels on
    purpose): None.  Where it is ortpass's call of the module (the export, ORTModule's
    flat view), the module is torch's own (an ``nn.Sequential`` of torch layers): the
    line in torch that converted."""
    innermost = frame
    while frame is not None:
        file = frame.f_code.co_filename
        if not file.startswith(_TORCH_DIR):
            if not file.startswith(_ORTPASS_DIR):
                return file, frame.f_lineno
            if file.startswith(_ORTPASS_HOOKS) and not file.startswith(_ORTPASS_CALLERS):
                return None
            return innermost.f_code.co_filename, innermost.f_lineno
        frame = frame.f_back
    return None


def _is_safe_call_site(file: str, function: str) -> bool:
    path = file.replace(os.sep, "/")
    return any(path.endswith(end) and function == name for end, name in SAFE_CALL_SITES)


def _first_data_source(tensors: list[torch.Tensor]) -> str:
    """``"sizes"`` when every traced value the tensors come from is a size or a constant;
    else what they read (an input's or a parameter's data, a random op)."""
    for tensor in tensors:
        try:
            value = torch._C._get_value_trace(tensor)
        except RuntimeError:  # not in the trace: a constant to it
            continue
        found = _data_source(value)
        if found is not None:
            return found
    return "sizes"


def _data_source(value) -> str | None:
    stack, seen = [value], set()
    while stack:
        value = stack.pop()
        if value.unique() in seen:
            continue
        seen.add(value.unique())
        node = value.node()
        kind = node.kind()
        if kind in _SHAPE_OPS or kind == "prim::Constant":
            continue
        if kind == "prim::Param":
            name = value.debugName()
            return f"the data of {name}" if name and not name.isdigit() else "the data of an input or a parameter"
        if kind in _RANDOM_OPS:
            return f"a random op ({kind})"
        stack.extend(node.inputs())
    return None


@contextlib.contextmanager
def watching_conversions() -> Iterator[list[Conversion]]:
    """Record, while the body traces, each conversion of a tensor to a Python value; the
    list yielded fills as the trace runs."""
    watch = _Watch()
    # torch.Tensor inherits these from TensorBase: what its own dict held is put back (an
    # outer watch's wrapper, where exports nest), or the name deleted.
    own = {name: torch.Tensor.__dict__.get(name, _INHERITED) for name in _METHODS}
    for name, what in _METHODS.items():
        setattr(torch.Tensor, name, watch.wrap(getattr(torch.Tensor, name), what))
    originals = {name: getattr(torch, name) for name in _FUNCTIONS}
    for name, what in _FUNCTIONS.items():
        setattr(torch, name, watch.wrap(originals[name], what))
    apply = torch.autograd.Function.__dict__["apply"]
    torch.autograd.Function.apply = watch.wrap_apply(apply)
    try:
        yield watch.conversions
    finally:
        for name, value in own.items():
            if value is _INHERITED:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)
        for name, original in originals.items():
            setattr(torch, name, original)
        torch.autograd.Function.apply = apply


_INHERITED = object()


def refuse_data_dependent(conversions: list[Conversion], module_name: str, cause: BaseException | None = None) -> None:
    """Raise :class:`DataDependentControlFlow` naming the data-dependent conversions (from
    ``cause``, the trace's own failure, if any)."""
    found = list(dict.fromkeys(c for c in conversions if c.data_dependent))
    for conversion in conversions:
        if not conversion.data_dependent:
            logger.debug("trace of %s: %s converted to %s from %s", module_name, conversion.where(), conversion.what, conversion.source)
    if not found:
        return
    lines = "\n".join(f"  {c.where()} ({c.what} from {c.source})" for c in found[:5])
    more = f"\n  and {len(found) - 5} more" if len(found) > 5 else ""
    raise DataDependentControlFlow(
        f"{module_name}.forward reads a tensor's value in Python while it is traced, so the graph would keep "
        f"the path of the export batch for every batch:\n{lines}{more}\n"
        "  way out: compute it with tensor ops (torch.where, masks instead of slicing to a length read from a "
        "tensor), or pass the value as a Python number argument (each value builds its own graph), or "
        "ORTModule(model, fallback='torch') to run this model in torch"
    ) from cause


def data_dependent_refusal(exc: BaseException, module_name: str) -> DataDependentControlFlow | None:
    """The refusal for torch.export's own data-dependent error (a guard or a specialization
    on a value read from a tensor), naming the user's file and line; None for other errors."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, GuardOnDataDependentSymNode):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    where = _traceback_user_frame(cause)
    place = f"\n  {where}" if where else ""
    return DataDependentControlFlow(
        f"{module_name}.forward reads a tensor's value in Python (torch.export cannot trace a branch, a loop "
        f"count or a size taken from a tensor's data):{place}\n"
        "  way out: compute it with tensor ops (torch.where, masks), or pass the value as a Python number "
        "argument, or ORTModule(model, fallback='torch') to run this model in torch"
    )


def _traceback_user_frame(exc: BaseException) -> str | None:
    """``file:line: code`` of the innermost frame of ``exc``'s traceback outside torch and ortpass."""
    found = None
    traceback = exc.__traceback__
    while traceback is not None:
        file = traceback.tb_frame.f_code.co_filename
        if not file.startswith(_TORCH_DIR) and not file.startswith(_ORTPASS_DIR):
            code = linecache.getline(file, traceback.tb_lineno).strip()
            found = f"{file}:{traceback.tb_lineno}" + (f": {code}" if code else "")
        traceback = traceback.tb_next
    return found
