"""Fused attention on stock onnxruntime: ``scaled_dot_product_attention`` as one Python op
whose kernel is torch's, forward and backward (the torch builder, through
onnxruntime-extensions: :mod:`ortpass.training.python_op_kernels`).

The rule: while the builder traces (``fused_attention=True``), an SDPA call becomes
``ortpass_attention::forward_<n>`` and its gradient ``ortpass_attention::backward_<n>``;
``<n>`` numbers the call's constants (causal, scale, grouped heads, the mask's kind,
dropout, the kernel).  Both are functions of their inputs, so no batch x heads x seq x seq
tensor lives between forward and backward, and the forward node is registered recomputable
and as attention for layer detection: a clone computes what the forward computed.

- A call torch's CPU flash kernel takes as it is (no dropout, 4-d inputs with equal heads
  and head sizes, a mask of 2 or 4 dims): ``forward_<n>(q, k, v[, mask]) -> (out, lse)``
  runs that kernel and keeps its logsumexp per row (batch x heads x seq, 1/head_dim of the
  output); ``backward_<n>(dout, q, k, v, out, lse[, mask]) -> (dq, dk, dv)`` runs its
  backward, which computes the probabilities again block by block from the logsumexp, as
  FlashAttention's does.  These are the kernels torch's own SDPA and its autograd run for
  such a call: the same bits.
- Any other call: ``forward_<n>(q, k, v[, mask][, seed]) -> out`` runs torch's SDPA keeping
  nothing, and ``backward_<n>(dout, q, k, v[, mask][, seed])`` runs it again under autograd
  and differentiates it.

Dropout: a call with ``dropout_p > 0`` gets ``seed_<n>(q) -> seed``, an int64 drawn from
torch's generator once per call and step (not recomputable: the value is stashed, 8
bytes); the forward, any recompute clone and the backward run SDPA under a generator
seeded by it, so they draw the same mask.  The masks are torch's SDPA's own from that seed.

Not fused, left to the math attention (``ortpass.training.from_torch._math_attention``),
which is exact: a float mask that requires grad (T5's position bias: its gradient is not
computed here), and dtypes other than float32 and float64.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ortpass.training.python_ops import register_ort_only_pair

__all__ = ["BACKWARD_PREFIX", "FORWARD_PREFIX", "fused_calls", "fusing", "replacement"]

logger = logging.getLogger(__name__)

FORWARD_PREFIX, BACKWARD_PREFIX, SEED_PREFIX = "OrtpassAttention_", "OrtpassAttentionGrad_", "OrtpassAttentionSeed_"
_NAMESPACE = "ortpass_attention"
_torch_sdpa = F.scaled_dot_product_attention  # torch's own, taken before the builder patches the name


@dataclasses.dataclass(frozen=True)
class _Attention:
    number: int
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    dtype: torch.dtype
    mask_dtype: torch.dtype | None  # None: no mask
    dropout_p: float = 0.0  # > 0: the ops take a seed (int64 scalar) last
    flash: bool = False  # the forward also outputs torch's flash kernel's logsumexp, which its backward reads

    @property
    def input_dtypes(self) -> list[torch.dtype]:
        seed = [torch.int64] if self.dropout_p > 0 else []
        return [self.dtype] * 3 + ([self.mask_dtype] if self.mask_dtype is not None else []) + seed

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rest: list[torch.Tensor]) -> torch.Tensor:
        """torch's SDPA; with dropout, its mask drawn from a generator seeded by ``rest[-1]``, so
        the forward, a recompute clone and the backward draw the same one."""
        mask = rest[0] if self.mask_dtype is not None else None
        options = dict(attn_mask=mask, is_causal=self.is_causal, scale=self.scale, enable_gqa=self.enable_gqa)
        if self.dropout_p == 0:
            return _torch_sdpa(q, k, v, **options)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(rest[-1]))
            return _torch_sdpa(q, k, v, dropout_p=self.dropout_p, **options)

    def flash_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rest: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The output and the logsumexp per row: the CPU flash kernel torch's SDPA runs for
        these inputs (tests compare the two bit for bit)."""
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, self.is_causal, attn_mask=self._additive_mask(rest, q.dtype), scale=self.scale
        )

    def flash_backward(self, dout, q, k, v, out, lse, rest: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The flash kernel's backward from the forward's output and logsumexp: the
        probabilities are computed again block by block, the forward is not run again."""
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, self.is_causal, attn_mask=self._additive_mask(rest, q.dtype), scale=self.scale
        )

    def _additive_mask(self, rest: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as the flash kernel takes it: a boolean mask becomes 0 where kept and
        -inf where masked, as SDPA converts it before calling the kernel."""
        mask = rest[0] if self.mask_dtype is not None else None
        if mask is None or mask.dtype != torch.bool:
            return mask
        return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))


_calls: dict[int, _Attention] = {}
_by_options: dict[tuple, _Attention] = {}
_numbers = itertools.count()
_lock = threading.Lock()
fused_calls: list[int] = []  # every call fused so far in this process (numbers), for tests and logs


@functools.cache
def _library() -> torch.library.Library:
    return torch.library.Library(_NAMESPACE, "FRAGMENT")


_local = threading.local()


@contextlib.contextmanager
def fusing(enabled: bool) -> Iterator[None]:
    """While open, the builder's traces in this thread fuse SDPA calls (:func:`replacement`)."""
    previous = getattr(_local, "enabled", False)
    _local.enabled = enabled
    try:
        yield
    finally:
        _local.enabled = previous


def replacement(math_attention: Any) -> Any:
    """What SDPA becomes while the builder traces: the fused op where :func:`fusing` is on."""
    return _sdpa_as_python_op(math_attention) if getattr(_local, "enabled", False) else math_attention


def _sdpa_as_python_op(math_attention: Any) -> Any:
    """An SDPA replacement for the builder's trace: fused where this module can, else
    ``math_attention`` (same arguments)."""

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        mask_requires_grad = attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad
        if mask_requires_grad or query.dtype not in (torch.float32, torch.float64):
            return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        mask_dtype = attn_mask.dtype if attn_mask is not None else None
        if mask_dtype is not None and mask_dtype not in (torch.bool, query.dtype):
            return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        flash = _flash_kernel_takes(query, key, value, attn_mask, dropout_p, enable_gqa)
        call = _call_for(bool(is_causal), scale, bool(enable_gqa), query.dtype, mask_dtype, float(dropout_p), flash)
        tensors = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
        if call.dropout_p > 0:  # a seed drawn once per call and step, read by every op of the call
            tensors.append(getattr(torch.ops.ortpass_attention, f"seed_{call.number}")(query.detach()))
        fused_calls.append(call.number)
        output = getattr(torch.ops.ortpass_attention, f"forward_{call.number}")(*tensors)
        return output[0] if call.flash else output

    return attention


def _flash_kernel_takes(query, key, value, attn_mask, dropout_p: float, enable_gqa: bool) -> bool:
    """Whether torch's CPU flash kernel takes this call as it is: no dropout (the kernel has
    none), 4-d inputs with the same heads and head size (no grouped heads), and a mask of
    2 or 4 dims.  Other calls keep a backward that runs SDPA again under autograd."""
    if dropout_p != 0 or enable_gqa or not query.dim() == key.dim() == value.dim() == 4:
        return False
    if attn_mask is not None and attn_mask.dim() not in (2, 4):
        return False
    heads = (query.shape[1], key.shape[1], value.shape[1], query.shape[3], key.shape[3], value.shape[3])
    return all(isinstance(d, int) for d in heads) and heads[0] == heads[1] == heads[2] and heads[3] == heads[4] == heads[5]


def _call_for(
    is_causal: bool, scale: float | None, enable_gqa: bool, dtype: torch.dtype, mask_dtype, dropout_p: float, flash: bool
) -> _Attention:
    options = (is_causal, scale, enable_gqa, dtype, mask_dtype, dropout_p, flash)
    with _lock:
        call = _by_options.get(options)
        if call is None:
            call = _Attention(next(_numbers), *options)
            _define(call)
            _calls[call.number] = _by_options[options] = call
    return call


def _runs_only_in_ort(*_: Any) -> Any:
    raise RuntimeError(f"{_NAMESPACE}::seed_* runs only inside ONNX Runtime")


def _define(call: _Attention) -> None:
    from ortpass.analysis.recomputable_ops import register_recomputable_op
    from ortpass.training.python_ops import op_domain

    library, n = _library(), call.number
    rest = (", Tensor mask" if call.mask_dtype is not None else "") + (", Tensor seed" if call.dropout_p > 0 else "")
    if call.flash:  # the logsumexp goes from the forward to the backward
        library.define(f"forward_{n}(Tensor q, Tensor k, Tensor v{rest}) -> (Tensor, Tensor)")
        library.define(f"backward_{n}(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse{rest}) -> (Tensor, Tensor, Tensor)")
    else:
        library.define(f"forward_{n}(Tensor q, Tensor k, Tensor v{rest}) -> Tensor")
        library.define(f"backward_{n}(Tensor dout, Tensor q, Tensor k, Tensor v{rest}) -> (Tensor, Tensor, Tensor)")

    def fake_forward(q, k, v, *mask):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        return (out, q.new_empty(q.shape[:-1])) if call.flash else out

    def fake_backward(dout, q, k, v, *mask):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    register_ort_only_pair(library, n, fake_forward, fake_backward, "attention")
    if call.dropout_p > 0:
        library.define(f"seed_{n}(Tensor anchor) -> Tensor")
        torch.library.register_fake(f"{_NAMESPACE}::seed_{n}", lambda anchor: anchor.new_empty((), dtype=torch.int64), lib=library)
        library.impl(f"seed_{n}", _runs_only_in_ort, "CompositeExplicitAutograd")

    def setup_context(ctx, inputs, output):
        if call.flash:
            ctx.mark_non_differentiable(output[1])
            ctx.save_for_backward(*inputs[:3], *output, *inputs[3:])  # the backward op's order
        else:
            ctx.save_for_backward(*inputs)

    def backward(ctx, dout, *_):  # no gradient flows into the logsumexp
        grads = getattr(torch.ops.ortpass_attention, f"backward_{n}")(dout, *ctx.saved_tensors)
        return (*grads, *[None] * (len(call.input_dtypes) - 3))  # none for the mask and the seed

    torch.library.register_autograd(f"{_NAMESPACE}::forward_{n}", backward, setup_context=setup_context, lib=library)
    # A function of its inputs alone: a clone in backward computes the forward's output.
    register_recomputable_op(f"{FORWARD_PREFIX}{n}", (1,), domain=op_domain(f"attention{n}"))


def translation_table(program: torch.export.ExportedProgram) -> dict[Any, Any]:
    """torch.onnx translations of the attention ops ``program`` holds: one node each."""
    import onnxscript

    from ortpass.training.python_ops import _ensure_schema, op_domain, ops_in

    table: dict[Any, Any] = {}
    for target, side, number in ops_in(program, _NAMESPACE):
        call = _calls[number]
        if side == "seed":
            domain = op_domain(f"attentionseed{number}")
            _ensure_schema(domain, f"{SEED_PREFIX}{number}", 1, 1)
            table[target] = _translation(onnxscript.values.Opset(domain, 1), f"{SEED_PREFIX}{number}", 1, True)
            continue
        forward = side == "forward"
        domain = op_domain(f"attention{'' if forward else 'grad'}{number}")
        op_type = f"{FORWARD_PREFIX if forward else BACKWARD_PREFIX}{number}"
        inputs, outputs = kernel_of(op_type)[:2]
        _ensure_schema(domain, op_type, len(inputs), len(outputs))
        table[target] = _translation(onnxscript.values.Opset(domain, 1), op_type, len(inputs), len(outputs))
    return table


def _translation(opset: Any, op_type: str, n_inputs: int, n_outputs: int) -> Any:
    def translate(*args: Any) -> Any:
        outputs = getattr(opset, op_type)(*args[:n_inputs], func_name="torch.nn.functional.scaled_dot_product_attention")
        return outputs if n_outputs == 1 else tuple(outputs)

    translate.__name__ = op_type
    return translate


def type_outputs(model: Any) -> None:
    """The element types torch.onnx leaves unset on a custom op's tuple outputs."""
    import onnx_ir as ir

    from ortpass.training.python_ops import _onnx_type

    for node in model.graph:
        if node.op_type.startswith((FORWARD_PREFIX, BACKWARD_PREFIX, SEED_PREFIX)) and node.op_type.rpartition("_")[2].isdigit():
            call = _calls.get(int(node.op_type.rpartition("_")[2]))
            dtype = torch.int64 if node.op_type.startswith(SEED_PREFIX) else call.dtype if call is not None else None
            for value in node.outputs if dtype is not None else ():
                value.dtype = ir.DataType(_onnx_type(dtype))


def kernel_of(op_type: str) -> tuple[list[torch.dtype], list[torch.dtype], Any] | None:
    """The Python op kernel of an attention op type (for python_op_kernels), or None."""
    if not op_type.startswith((FORWARD_PREFIX, BACKWARD_PREFIX, SEED_PREFIX)):
        return None
    call = _calls.get(int(op_type.rpartition("_")[2]))
    if call is None:
        return None
    if op_type.startswith(SEED_PREFIX):
        return [call.dtype], [torch.int64], _seed_kernel
    if op_type.startswith(FORWARD_PREFIX):
        return call.input_dtypes, [call.dtype] * (2 if call.flash else 1), _forward_kernel(call)
    saved = [call.dtype] * 2 if call.flash else []  # the forward's output and logsumexp
    return [call.dtype, *call.input_dtypes[:3], *saved, *call.input_dtypes[3:]], [call.dtype] * 3, _backward_kernel(call)


def _tensors(arrays) -> list[torch.Tensor]:
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def _seed_kernel(anchor: np.ndarray, **_: Any) -> np.ndarray:
    """A seed from torch's generator: one draw per call and step (not recomputable)."""
    return np.array(int(torch.randint(0, 2**62, ())), dtype=np.int64)


def _forward_kernel(call: _Attention) -> Any:
    def forward(q, k, v, *rest, **_: Any) -> np.ndarray:
        try:
            with torch.no_grad():
                q, k, v, *rest = _tensors((q, k, v, *rest))
                if call.flash:
                    return tuple(t.numpy() for t in call.flash_forward(q, k, v, rest))
                return call.attend(q, k, v, rest).numpy()
        except BaseException as exc:  # raising here would abort the process
            return _failed(exc, "forward", 2 if call.flash else 1)

    return forward


def _backward_kernel(call: _Attention) -> Any:
    def backward(dout, q, k, v, *rest, **_: Any) -> tuple[np.ndarray, ...]:
        try:
            dout, q, k, v, *rest = _tensors((dout, q, k, v, *rest))
            if call.flash:
                with torch.no_grad():
                    return tuple(g.numpy() for g in call.flash_backward(dout, q, k, v, *rest[:2], rest[2:]))
            leaves = [t.requires_grad_(True) for t in (q, k, v)]
            with torch.enable_grad():
                out = call.attend(*leaves, rest)
                grads = torch.autograd.grad(out, leaves, dout)
            return tuple(g.numpy() for g in grads)
        except BaseException as exc:
            return _failed(exc, "backward", 3)

    return backward


def _failed(exc: BaseException, side: str, count: int) -> Any:
    from ortpass.errors import OrtpassError
    from ortpass.training.python_op_kernels import register_failure

    error = OrtpassError(f"the fused attention's {side} raised {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    register_failure(error)
    empty = tuple(np.zeros((0,), np.float32) for _ in range(count))
    return empty if count > 1 else empty[0]


def _register_kernels() -> None:
    from ortpass.training import python_op_kernels

    if kernel_of not in python_op_kernels.kernel_sources:
        python_op_kernels.kernel_sources.append(kernel_of)


_register_kernels()
