"""Parity between a training step on ONNX Runtime and the same step in torch eager.

Dropout draws different random numbers in ORT and torch, so the ORT step fetches every
Dropout mask (graph order is the order torch called dropout while tracing) and the torch
step replays them: ``torch.nn.functional.dropout`` is replaced, for the duration of the
reference step only, by ``x * mask / (1 - p)``, which is what both frameworks compute.

The error measure per tensor is ``max|ort - torch| / max|torch|``: relative to the
tensor's scale, so near-zero entries of a gradient do not dominate.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import onnx_ir as ir
import torch

from ortpass.runtime.session import StepResult, TrainingSession, with_dropout_masks

__all__ = ["ParityResult", "check_parity", "relative_error", "replay_dropout_masks", "torch_step"]


@dataclasses.dataclass
class ParityResult:
    ort: StepResult
    torch_loss: float
    torch_gradients: dict[str, np.ndarray]
    errors: dict[str, float]  # "loss" and each parameter -> relative error
    rtol: float

    @property
    def ok(self) -> bool:
        return all(err <= self.rtol for err in self.errors.values())

    def worst(self) -> tuple[str, float]:
        return max(self.errors.items(), key=lambda item: item[1])

    def assert_ok(self) -> None:
        if not self.ok:
            bad = {k: f"{v:.2e}" for k, v in self.errors.items() if v > self.rtol}
            raise AssertionError(f"ORT and torch differ beyond rtol={self.rtol:g}: {bad}")


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return float("inf")
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    diff = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
    return diff / scale if scale > 0 else diff


@contextlib.contextmanager
def replay_dropout_masks(masks: Sequence[np.ndarray]) -> Iterator[None]:
    """Make ``F.dropout`` apply the given masks, in call order, instead of drawing new ones."""
    pending = list(masks)
    original = torch.nn.functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training:
            return input
        if not pending:
            raise AssertionError("torch called dropout more often than the ORT graph has Dropout nodes")
        mask = torch.from_numpy(np.asarray(pending.pop(0))).to(input.device)
        if mask.shape != input.shape:
            raise AssertionError(f"dropout mask shape {tuple(mask.shape)} != input shape {tuple(input.shape)}")
        return input * mask.to(input.dtype) / (1.0 - p)

    torch.nn.functional.dropout = dropout
    try:
        yield
        if pending:
            raise AssertionError(f"{len(pending)} ORT Dropout masks were not used by the torch step")
    finally:
        torch.nn.functional.dropout = original


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
    providers: Any = None,
    batch: Mapping[str, Any] | None = None,
) -> ParityResult:
    """Run one step on ORT and in torch with the same weights and batch; compare.

    The ORT graph's parameters take the module's current weights, so the two agree even
    if the model was exported before the module changed.  ``batch`` overrides the feeds
    built from ``input_names``/``args`` (for graphs whose inputs were renamed).
    """
    with_masks, masks = with_dropout_masks(training_model)
    session = TrainingSession(with_masks, providers, extra_outputs=masks)
    state = {name: p.detach() for name, p in module.named_parameters()}
    params = {name: state[name] for name in session.info.params}
    feeds = dict(batch) if batch is not None else dict(zip(input_names, args))
    result = session.run(feeds, params)

    torch_loss, torch_grads = torch_step(module, args, dropout_masks=[result.extras[m] for m in masks])
    errors = {"loss": relative_error(np.float64(result.loss), np.float64(torch_loss))}
    for name, grad_name in session.info.gradients.items():
        reference = torch_grads.get(name)
        if reference is None:
            reference = np.zeros_like(result.gradients[name])
        errors[name] = relative_error(result.gradients[name], reference)
    return ParityResult(result, torch_loss, torch_grads, errors, rtol)
