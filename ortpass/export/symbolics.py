"""Symbolics for the aten ops real models call that torch's TorchScript exporter lacks.

``ortpass.export.export`` uses torch.onnx's TorchScript exporter (``dynamo=False``), the
one that keeps training-mode Dropout and exports ``torch.autograd.Function`` as PythonOp.
It stopped growing: ops newer code calls have no symbolic there.  The first one users hit
is ``aten::diff``: transformers' masking code (``find_packed_sequence_indices``) calls
``torch.diff`` whenever a decoder runs without ``attention_mask`` and without a cache,
which is how a training step calls it.  The next line of that code,
``(diff != 1).cumsum(-1)``, meets a bug: torch's ``aten::cumsum`` symbolic ignores the
result dtype and writes ``CumSum`` over a bool tensor, which ONNX refuses.

:func:`register_symbolic` adds a symbolic for an aten op (``fn(g, *inputs)`` in
torch.onnx's convention) to ortpass's registry; :func:`symbolics_context`, entered by
``export``, hands every registered one to torch.onnx for the duration of the export and
restores torch's registry after.  Like registered exporters, a registered symbolic takes
priority over torch's own.  Built in:

- ``aten::diff``, missing in torch;
- ``aten::cumsum``: torch's drops the dtype;
- ``aten::batch_norm`` without running statistics (``track_running_stats=False``):
  torch's computes placeholder statistics with a Reshape to the sample's batch size, so
  it refuses a dynamic batch (and would bake the sample's in).  In training mode
  BatchNormalization normalizes with the batch's own statistics and its running inputs
  feed only running outputs nobody reads: ortpass passes constants (zeros, ones) there;
- ``aten::scaled_dot_product_attention``: torch's writes the attention dropout as a
  ``Dropout`` without its ``training_mode`` input, which ONNX reads as inference: the
  dropout silently never happens, and ORT's ``DropoutGrad``, which ignores
  ``training_mode``, still scales the gradient by ``1 / (1 - p)``.  Torch's also refuses ``enable_gqa``,
  which transformers passes for grouped-query attention without a mask (LLaMA,
  Mistral, Qwen2);
- ``aten::embedding``: torch's writes ``Gather(weight, indices)`` and drops
  ``padding_idx``, so ORT's ``GatherGrad`` gives the padding row the gradient torch
  withholds.  Ours writes the same Gather, marks it with its padding row, and
  :func:`record_padding_indices` (called by ``export``) moves the mark into model metadata
  for the gradient build (``ortpass.training.padding_rows``).  It refuses, in a training
  export, ``scale_grad_by_freq`` and ``sparse``, whose gradients ``GatherGrad`` does not
  compute either (torch's refuses only the first).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import json

import onnx_ir as ir
import torch

from ortpass.conventions import PADDING_IDX_KEY
from ortpass.errors import ExportError
from ortpass.infra.named_registry import NamedRegistry

__all__ = [
    "record_padding_indices",
    "register_symbolic",
    "registered_symbolics",
    "symbolics_context",
    "unregister_symbolic",
]

logger = logging.getLogger(__name__)

#: ``symbolic(g, *inputs, **attributes)`` as torch.onnx calls it; returns graph value(s).
Symbolic = Callable[..., Any]

_symbolics: NamedRegistry[Symbolic] = NamedRegistry("a symbolic")


def register_symbolic(op_name: str, *, replace: bool = False) -> Callable[[Symbolic], Symbolic]:
    """Decorator registering an ONNX symbolic for the aten op ``op_name`` (``"aten::diff"``).

    ``ortpass.export.export`` uses it instead of torch.onnx's symbolic for that op, if any.
    ``symbolic(g, *inputs)`` gets torch.onnx's graph context and the node's inputs (graph
    values; ``symbolic_helper._get_const`` reads constants) and returns the output value(s).
    """
    if "::" not in op_name:
        raise ValueError(f"op_name must be namespace::name (e.g. 'aten::diff'), got {op_name!r}")

    def decorator(symbolic: Symbolic) -> Symbolic:
        return _symbolics.add(op_name, symbolic, replace=replace)

    return decorator


def unregister_symbolic(op_name: str) -> None:
    """Forget the symbolic registered for ``op_name`` (no error if there is none)."""
    _symbolics.remove(op_name)


def registered_symbolics() -> dict[str, Symbolic]:
    """The registered symbolics by op name."""
    return _symbolics.snapshot()


@contextlib.contextmanager
def symbolics_context(opset: int) -> Iterator[None]:
    """While active, torch.onnx exports the registered ops with the registered symbolics.

    They are registered at the export ``opset`` (torch.onnx picks the symbolic of the
    newest opset not above the export's, and a custom one at the same opset overrides
    torch's) and unregistered on exit, which brings torch's own back.
    """
    # torch.onnx has no public getter for a registered symbolic; the registry module is the
    # only way to see (and so restore) one that someone registered before us.
    from torch.onnx._internal.torchscript_exporter import registration

    def current(op_name: str):
        group = registration.registry.get_function_group(op_name)
        return group.get(opset) if group is not None else None

    added = [(op_name, symbolic, current(op_name)) for op_name, symbolic in registered_symbolics().items()]
    for op_name, symbolic, _ in added:
        torch.onnx.register_custom_op_symbolic(op_name, symbolic, opset)
    try:
        yield
    finally:
        for op_name, _, previous in added:
            torch.onnx.unregister_custom_op_symbolic(op_name, opset)
            if previous is not None and current(op_name) is not previous:
                torch.onnx.register_custom_op_symbolic(op_name, previous, opset)


# ONNX data types of the dtypes CumSum takes.
_ONNX_DTYPES = {torch.int32: 6, torch.int64: 7, torch.float32: 1, torch.float64: 11, torch.float16: 10, torch.bfloat16: 16}


def _constant(g, values: list[int]):
    return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))


def _slice(g, x, dim: int, start: int, end: int):
    return g.op("Slice", x, _constant(g, [start]), _constant(g, [end]), _constant(g, [dim]))


def _is_none(value) -> bool:
    return value is None or (hasattr(value, "node") and value.node().mustBeNone())


def _is_bool(value) -> bool:
    value_type = value.type()
    return isinstance(value_type, torch._C.TensorType) and value_type.scalarType() == "Bool"


@register_symbolic("aten::diff")
def diff_symbolic(g, x, n, dim, prepend, append):
    """``torch.diff(x, n, dim, prepend, append)``: ``x[1:] - x[:-1]`` along ``dim``, n times.

    Bool tensors take ``Xor`` (what torch computes for them) instead of ``Sub``.
    """
    from torch.onnx import symbolic_helper

    n = symbolic_helper._get_const(n, "i", "n")
    dim = symbolic_helper._get_const(dim, "i", "dim")
    parts = [part for part in (prepend, x, append) if not _is_none(part)]
    out = g.op("Concat", *parts, axis_i=dim) if len(parts) > 1 else x
    difference = "Xor" if _is_bool(x) else "Sub"
    for _ in range(n):
        # INT64_MAX as the end is ONNX's "to the end"; -1 drops the last element.
        out = g.op(difference, _slice(g, out, dim, 1, 2**63 - 1), _slice(g, out, dim, 0, -1))
    return out


@register_symbolic("aten::cumsum")
def cumsum_symbolic(g, x, dim, dtype):
    """``torch.cumsum(x, dim, dtype)`` in the dtype torch computed it in (bool sums as int64).

    The traced node's output type is the result dtype torch chose (from ``dtype``, or int64
    for bool and integer inputs), so the input is cast to it when it differs.
    """
    from torch.onnx import symbolic_helper

    dim = symbolic_helper._get_const(dim, "i", "dim")
    result = g.original_node.output().type()
    result_dtype = result.dtype() if isinstance(result, torch._C.TensorType) else None
    if result_dtype is not None and x.type().dtype() != result_dtype:
        x = g.op("Cast", x, to_i=_ONNX_DTYPES[result_dtype])
    return g.op("CumSum", x, _constant(g, [dim]))


@register_symbolic("aten::scaled_dot_product_attention")
def scaled_dot_product_attention_symbolic(g, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's own SDPA symbolic, with the key/value heads repeated for ``enable_gqa`` and
    its attention Dropout in training mode (SDPA drops out whenever ``dropout_p > 0``)."""
    from torch.onnx import symbolic_helper
    from torch.onnx._internal.torchscript_exporter import symbolic_opset14

    if symbolic_helper._maybe_get_const(enable_gqa, "b"):
        key, value = _repeat_kv_heads(g, query, key), _repeat_kv_heads(g, query, value)
    output = symbolic_opset14.scaled_dot_product_attention(g, query, key, value, attn_mask, dropout_p, is_causal, scale, False)
    dropout = output.node().inputsAt(0).node()  # MatMul(probabilities, value)
    if dropout.kind() == "onnx::Dropout" and dropout.inputsSize() == 2:
        training = g.op("Constant", value_t=torch.tensor(True))
        training.node().moveBefore(dropout)
        dropout.addInput(training)
    return output


def _repeat_kv_heads(g, query, key_or_value):
    """``repeat_interleave`` of dim -3 up to the query's head count (torch's ``enable_gqa``)."""
    from torch.onnx import symbolic_helper

    query_sizes = symbolic_helper._get_tensor_sizes(query)
    sizes = symbolic_helper._get_tensor_sizes(key_or_value)
    if not query_sizes or not sizes or len(sizes) != 4 or None in (query_sizes[-3], sizes[-3]):
        raise torch.onnx.errors.SymbolicValueError(
            "scaled_dot_product_attention(enable_gqa=True) exports only rank-4 inputs with known head counts", query
        )
    heads, kv_heads = query_sizes[-3], sizes[-3]
    # [batch, kv_heads, seq, head] -> [batch, kv_heads, 1, seq, head] -> [batch, kv_heads, r, seq, head]
    expanded = g.op("Expand", g.op("Unsqueeze", key_or_value, _constant(g, [2])), _constant(g, [1, 1, heads // kv_heads, 1, 1]))
    # Reshape's 0 keeps the batch size, -1 takes the sequence length; the head size comes
    # from the tensor's shape when tracing lost it (a key read from a KV cache).
    head_size = _constant(g, [sizes[-1]]) if sizes[-1] is not None else _slice(g, g.op("Shape", key_or_value), 0, 3, 4)
    return g.op("Reshape", expanded, g.op("Concat", _constant(g, [0, heads, -1]), head_size, axis_i=0))


#: What the embedding symbolic marks a Gather with: its padding row.  ONNX's Gather has no
#: such attribute; :func:`record_padding_indices` takes it off right after the export.
PADDING_IDX_ATTRIBUTE = "ortpass_padding_idx"

# Options of aten::embedding that change the weight's gradient, and how.
_GRADIENT_OPTIONS = {
    "scale_grad_by_freq": "torch divides each row's gradient by how often its index occurs in the batch",
    "sparse": "torch gives the weight a sparse gradient",
}


@register_symbolic("aten::embedding")
def embedding_symbolic(g, weight, indices, padding_idx, scale_grad_by_freq, sparse):
    """``Gather(weight, indices)`` as torch writes it, marked with ``padding_idx`` when it
    names a row.

    At the aten level ``padding_idx`` is a row or -1 for none: ``nn.Embedding`` and
    ``F.embedding`` turn a negative one into ``num_embeddings + padding_idx`` before the
    call, and an index is never negative, so no other negative value masks anything.
    """
    from torch.onnx import symbolic_helper
    from torch.onnx._internal.torchscript_exporter._globals import GLOBALS

    if GLOBALS.export_training:
        for option, value in (("scale_grad_by_freq", scale_grad_by_freq), ("sparse", sparse)):
            if symbolic_helper._get_const(value, "b", option):
                raise ExportError(
                    f"embedding in {_caller(g)} has {option}=True: {_GRADIENT_OPTIONS[option]}, ONNX Runtime's "
                    f"GatherGrad a plain dense sum, so the weight would train differently from torch; "
                    f"set {option}=False"
                )
    padding_idx = symbolic_helper._get_const(padding_idx, "i", "padding_idx")
    if padding_idx < 0:
        return g.op("Gather", weight, indices)
    return g.op("Gather", weight, indices, **{f"{PADDING_IDX_ATTRIBUTE}_i": padding_idx})


def _caller(g) -> str:
    """The module that called the op being converted, as export errors name it."""
    from ortpass.export.torchscript import _module_path

    return _module_path(g.original_node.scopeName())


def record_padding_indices(model: ir.Model) -> dict[str, int]:
    """Move the embedding symbolic's marks into model metadata; returns what was recorded.

    ``PADDING_IDX_KEY`` maps each marked Gather's output name to its padding row.  The
    output name, not the node name: ORT's pre-gradient transformers rename nodes they
    touch, but keep the names of the values other nodes read.
    """
    recorded: dict[str, int] = {}
    for node in model.graph.all_nodes():
        mark = node.attributes.pop(PADDING_IDX_ATTRIBUTE, None)
        if mark is not None:
            recorded[node.outputs[0].name] = mark.as_int()
    if recorded:
        model.metadata_props[PADDING_IDX_KEY] = json.dumps(recorded)
        logger.debug("embedding padding rows: %s", recorded)
    return recorded


@register_symbolic("aten::batch_norm")
def batch_norm_symbolic(g, input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    from torch.onnx._internal.torchscript_exporter import symbolic_helper, symbolic_opset9, symbolic_opset14
    from torch.onnx._internal.torchscript_exporter._globals import GLOBALS

    if _is_none(running_mean) or _is_none(running_var):
        channels = symbolic_helper._get_tensor_dim_size(input, 1)
        if channels is None:
            raise ExportError("batch_norm without running statistics needs a static channel dim (dim 1)")
        dtype = input.type().dtype() if input.type().dtype() is not None else torch.float32
        running_mean = g.op("Constant", value_t=torch.zeros(channels, dtype=dtype))
        running_var = g.op("Constant", value_t=torch.ones(channels, dtype=dtype))
    torch_symbolic = symbolic_opset14 if GLOBALS.export_onnx_opset_version >= 14 else symbolic_opset9
    return torch_symbolic.batch_norm(
        g, input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled
    )
