"""The module as the exporter sees it: flat tensors in, flat tensors out, and
``torch.utils.checkpoint`` as a plain call."""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ortpass.errors import OrtpassError
from ortpass.runtime.module.transitions import describe_tensor, path_name

logger = logging.getLogger(__name__)

INNER = "module"  # attribute holding the user's module inside the export wrapper


class FlatCall(torch.nn.Module):
    """Runs the user's module from flat tensors (what the exporter feeds) and returns flat
    tensors: the loss first in training, then the output's other tensors."""

    def __init__(self, module: torch.nn.Module, leaves: list[tuple[str, Any]], spec: Any, bound: inspect.BoundArguments):
        super().__init__()
        setattr(self, INNER, module)
        # The exporter restores the wrapper's mode after exporting, recursively: it must be
        # the module's (set without recursing, so the submodules keep theirs).
        self.training = module.training
        self._leaves, self._spec, self._signature = leaves, spec, bound.signature
        self.output_spec: str | None = None  # serialized, for the cache
        self.output_tree: Any = None
        self.output_leaves: list[tuple[str, str]] = []  # (output path, "loss"/"tensor"/"none")

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        module = getattr(self, INNER)
        feed = iter(tensors)
        values = [next(feed) if isinstance(leaf, torch.Tensor) else leaf for _, leaf in self._leaves]
        arguments = pytree.tree_unflatten(values, self._spec)
        bound = inspect.BoundArguments(self._signature, arguments)
        return self._flat_outputs(module, module(*bound.args, **bound.kwargs))

    def _flat_outputs(self, module: torch.nn.Module, output: Any) -> tuple[torch.Tensor, ...]:
        with_paths, self.output_tree = pytree.tree_flatten_with_path(output)
        try:
            self.output_spec = pytree.treespec_dumps(self.output_tree)
        except Exception as exc:  # a structure pytree cannot serialize: runnable, not cacheable
            logger.debug("output structure of %s cannot be serialized: %s", type(module).__name__, exc)
        kinds, tensors, loss = [], [], None
        for path, leaf in with_paths:
            name = path_name(path) or "output"
            if leaf is None:
                kinds.append((name, "none"))
            elif not isinstance(leaf, torch.Tensor):
                raise OrtpassError(
                    f"{type(module).__name__}.forward returned {name} = {type(leaf).__name__}: ORTModule returns "
                    "tensors only (pass use_cache=False to transformers models in training)"
                )
            elif self.training and loss is None and _is_loss_path(path):
                loss = leaf
                kinds.append((name, "loss"))
            else:  # in eval the loss, if any, is one output among others
                tensors.append(leaf)
                kinds.append((name, "tensor"))
        if self.training and loss is None:
            raise OrtpassError(
                f"{type(module).__name__}.forward returned no loss ({type(output).__name__}): ORTModule trains "
                "modules whose forward returns a scalar loss tensor or a structure with a `loss` field"
            )
        if loss is not None and (loss.dim() != 0 or not loss.is_floating_point()):
            raise OrtpassError(
                f"the loss of {type(module).__name__} must be a floating-point scalar, got "
                f"{describe_tensor(loss)} of shape {tuple(loss.shape)}"
            )
        self.output_leaves = kinds
        return (loss, *tensors) if loss is not None else tuple(tensors)


def _is_loss_path(path: tuple) -> bool:
    if not path:  # the output is the tensor itself
        return True
    return len(path) == 1 and getattr(path[0], "key", getattr(path[0], "name", None)) == "loss"


@contextlib.contextmanager
def checkpointing_disabled(module: torch.nn.Module, notice: Callable[[str], None]):
    """``torch.utils.checkpoint`` becomes a plain call while exporting (the exporter would
    otherwise trace its reentrant autograd Function as a PythonOp), and transformers'
    ``gradient_checkpointing`` flags are off."""
    import torch.utils.checkpoint as checkpoint_module

    original = checkpoint_module.checkpoint
    flagged = [m for m in module.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if flagged:
        notice(f"gradient checkpointing of {type(module).__name__} ({len(flagged)} modules)")

    def plain_call(function, *args, use_reentrant=None, context_fn=None, determinism_check=None, debug=None, **kwargs):
        notice("torch.utils.checkpoint")
        return function(*args, **kwargs)

    checkpoint_module.checkpoint = plain_call
    for m in flagged:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        checkpoint_module.checkpoint = original
        for m in flagged:
            m.gradient_checkpointing = True
