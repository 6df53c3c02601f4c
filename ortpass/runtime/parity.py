"""Parity between a training step on ONNX Runtime and the same step in torch eager.

Dropout draws different random numbers in ORT and torch, so the ORT step fetches every
Dropout mask (graph order is the order torch called dropout while tracing) and the torch
step replays them, for the duration of the reference step only:

- ``torch.nn.functional.dropout`` becomes ``x * mask / (1 - p)``, which is what both
  frameworks compute.  A call with ``p=0`` is the identity and takes no mask: ORT's
  fusions remove Dropout nodes of ratio 0, so their masks are not replayed either.
- ``torch.nn.functional.scaled_dot_product_attention`` with ``dropout_p > 0`` draws its
  attention dropout inside the kernel, without calling ``F.dropout``; it becomes torch's
  math attention (``aten::_scaled_dot_product_attention_math``) given the next mask,
  which the exporter wrote as a Dropout on the attention probabilities.

Tolerance, per tensor (the loss and each gradient)::

    error = max|ort - torch| / max(max|torch|, scale_floor * G)  <=  rtol

with ``G`` the largest ``|torch|`` entry of any gradient of the step, ``rtol=1e-5`` and
``scale_floor=1e-2`` by default.  Relative to the tensor's own scale, so near-zero entries
of a gradient do not dominate; but never to less than 1% of the step's largest gradient,
so a gradient that is zero in exact arithmetic (an attention key bias: softmax ignores a
shift along the keys) and comes out as float32 rounding noise on both sides (1e-12 next
to gradients of 1e-1) is not reported as a 100% error.  In absolute terms a tensor passes
when ``max|ort - torch| <= max(rtol * max|torch|, rtol * scale_floor * G)``: float32
rounding in a sum is relative to the size of its terms, which the largest gradient bounds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import onnx_ir as ir
import torch

from ortpass.runtime.dropout_masks import forward_dropouts, with_dropout_masks
from ortpass.runtime.session import StepResult, TrainingSession

__all__ = ["DEFAULT_SCALE_FLOOR", "ParityResult", "check_parity", "dropout_ratios", "relative_error", "replay_dropout_masks", "torch_step"]

#: Least scale of a tensor, as a fraction of the step's largest gradient entry (module docstring).
DEFAULT_SCALE_FLOOR = 1e-2


@dataclasses.dataclass
class ParityResult:
    ort: StepResult
    torch_loss: float
    torch_gradients: dict[str, np.ndarray]
    errors: dict[str, float]  # "loss" and each parameter -> relative error (module docstring)
    rtol: float
    scale_floor: float = DEFAULT_SCALE_FLOOR

    @property
    def ok(self) -> bool:
        return all(err <= self.rtol for err in self.errors.values())

    def worst(self) -> tuple[str, float]:
        return max(self.errors.items(), key=lambda item: item[1])

    def assert_ok(self) -> None:
        if not self.ok:
            bad = {k: f"{v:.2e}" for k, v in self.errors.items() if v > self.rtol}
            raise AssertionError(f"ORT and torch differ beyond rtol={self.rtol:g} (scale floor {self.scale_floor:g} of the largest gradient): {bad}")


def relative_error(actual: np.ndarray, expected: np.ndarray, *, floor: float = 0.0) -> float:
    """``max|actual - expected| / max(max|expected|, floor)``; inf if the shapes differ."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return float("inf")
    scale = max(float(np.max(np.abs(expected))) if expected.size else 0.0, floor)
    diff = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
    return diff / scale if scale > 0 else diff


@contextlib.contextmanager
def replay_dropout_masks(masks: Sequence[np.ndarray]) -> Iterator[None]:
    """Make ``F.dropout`` and SDPA's attention dropout apply the given masks, in call
    order, instead of drawing new ones (``p=0`` calls are the identity and take none)."""
    functional = torch.nn.functional
    pending = list(masks)
    original_dropout, original_sdpa = functional.dropout, functional.scaled_dot_product_attention

    def next_mask(like_shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if not pending:
            raise AssertionError("torch called dropout more often than the ORT graph has Dropout nodes of ratio > 0")
        mask = torch.from_numpy(np.asarray(pending.pop(0))).to(device)
        if tuple(mask.shape) != tuple(like_shape):
            raise AssertionError(f"dropout mask shape {tuple(mask.shape)} != input shape {tuple(like_shape)}")
        return mask

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        return input * next_mask(input.shape, input.device).to(input.dtype) / (1.0 - p)

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p == 0:
            return original_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa:  # the math kernel's own GQA mishandles a dropout mask (torch 2.15)
            repeats = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
        probabilities_shape = (*torch.broadcast_shapes(query.shape[:-2], key.shape[:-2]), query.shape[-2], key.shape[-2])
        mask = next_mask(probabilities_shape, query.device)
        with warnings.catch_warnings():
            # "Dropout mask should only be used for testing purposes": this is the test.
            warnings.simplefilter("ignore", UserWarning)
            output, _ = torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, mask, scale=scale
            )
        return output

    functional.dropout, functional.scaled_dot_product_attention = dropout, scaled_dot_product_attention
    try:
        yield
        if pending:
            raise AssertionError(f"{len(pending)} ORT Dropout masks were not used by the torch step")
    finally:
        functional.dropout, functional.scaled_dot_product_attention = original_dropout, original_sdpa


def torch_step(
    module: torch.nn.Module, args: Sequence[Any], *, dropout_masks: Sequence[np.ndarray] | None = None
) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients by parameter name of one eager step (gradients are reset first)."""
    module.train()
    module.zero_grad(set_to_none=True)
    context = replay_dropout_masks(dropout_masks) if dropout_masks is not None else contextlib.nullcontext()
    with context:
        out = module(*args)
    loss = out[0] if isinstance(out, (tuple, list)) else out
    loss.backward()
    grads = {
        name: p.grad.detach().cpu().numpy().copy()
        for name, p in module.named_parameters()
        if p.grad is not None
    }
    return float(loss.detach()), grads


def check_parity(
    module: torch.nn.Module,
    args: Sequence[Any],
    training_model: ir.Model,
    *,
    input_names: Sequence[str],
    rtol: float = 1e-5,
    scale_floor: float = DEFAULT_SCALE_FLOOR,
    providers: Any = None,
    batch: Mapping[str, Any] | None = None,
) -> ParityResult:
    """Run one step on ORT and in torch with the same weights and batch; compare.

    The ORT graph's parameters take the module's current weights, so the two agree even
    if the model was exported before the module changed.  ``batch`` overrides the feeds
    built from ``input_names``/``args`` (for graphs whose inputs were renamed).  The
    tolerance is the module docstring's.
    """
    with_masks, masks = with_dropout_masks(training_model)
    session = TrainingSession(with_masks, providers, extra_outputs=masks)
    state = {name: p.detach() for name, p in module.named_parameters()}
    params = {name: state[name] for name in session.info.params}
    feeds = dict(batch) if batch is not None else dict(zip(input_names, args))
    result = session.run(feeds, params)

    replayed = [result.extras[m] for m, ratio in zip(masks, dropout_ratios(with_masks)) if ratio != 0]
    torch_loss, torch_grads = torch_step(module, args, dropout_masks=replayed)
    largest = max((float(np.max(np.abs(g))) for g in torch_grads.values() if g.size), default=0.0)
    floor = scale_floor * largest
    errors = {"loss": relative_error(np.float64(result.loss), np.float64(torch_loss))}
    for name, grad_name in session.info.gradients.items():
        reference = torch_grads.get(name)
        if reference is None:
            reference = np.zeros_like(result.gradients[name])
        errors[name] = relative_error(result.gradients[name], reference, floor=floor)
    return ParityResult(result, torch_loss, torch_grads, errors, rtol, scale_floor)


def dropout_ratios(model: ir.Model) -> list[float | None]:
    """The ratio of each forward Dropout, in the order of ``dropout_mask_names`` (None: not
    a constant; opset-12 Dropout's default ratio is 0.5)."""
    ratios: list[float | None] = []
    for node in forward_dropouts(model):
        ratio = node.inputs[1] if len(node.inputs) > 1 else None
        if ratio is None:
            ratios.append(0.5)
            continue
        tensor = ir.convenience.get_const_tensor(ratio)
        ratios.append(float(tensor.numpy()) if tensor is not None else None)
    return ratios
