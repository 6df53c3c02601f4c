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
from ortpass.runtime.module.transitions import path_name

logger = logging.getLogger(__name__)

INNER = "module"  # attribute holding the user's module inside the export wrapper


class FlatCall(torch.nn.Module):
    """Runs the user's module from flat tensors (what the exporter feeds) and returns flat
    tensors: the loss first when ``find_loss`` and the module returns one (a floating-point
    scalar as its output or its ``loss`` field), then the output's other tensors.  Export
    errors name the user's module and paths inside it (``VIEW_OF``)."""

    ortpass_view_of = INNER

    def __init__(
        self,
        module: torch.nn.Module,
        leaves: list[tuple[str, Any]],
        spec: Any,
        bound: inspect.BoundArguments,
        find_loss: bool,
    ):
        super().__init__()
        setattr(self, INNER, module)
        # The exporter preserves modes (TrainingMode.PRESERVE); the wrapper's is the module's.
        self.training = module.training
        self._leaves, self._spec, self._signature = leaves, spec, bound.signature
        self._find_loss = find_loss
        self.output_spec: str | None = None  # serialized, for the cache
        self.output_tree: Any = None
        self.output_leaves: list[tuple[str, str]] = []  # (output path, "loss"/"tensor"/"none")
        self.requires_grad: list[bool] = []  # per flat output: whether torch would differentiate it

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
                    "tensors only" + (_CACHE_WAY_OUT if "Cache" in type(leaf).__name__ else "")
                )
            elif self._find_loss and loss is None and _is_loss(path, leaf):
                loss = leaf
                kinds.append((name, "loss"))
            else:  # without a loss to differentiate, a loss is one output among others
                tensors.append(leaf)
                kinds.append((name, "tensor"))
        self.output_leaves = kinds
        flat = (loss, *tensors) if loss is not None else tuple(tensors)
        self.requires_grad = [t.requires_grad for t in flat]
        return flat


#: A transformers model whose config has use_cache=True (the default of most decoders)
#: returns its key/value cache in training and in evaluation alike.
_CACHE_WAY_OUT = (
    "; this is transformers' key/value cache (the config's use_cache=True): set model.config.use_cache = False "
    "before training or evaluating with ORTModule (generate() runs the model in torch and keeps its cache)"
)


def _is_loss(path: tuple, leaf: torch.Tensor) -> bool:
    """The output itself or its ``loss`` field, a floating-point scalar that requires grad."""
    if leaf.dim() != 0 or not leaf.is_floating_point() or not leaf.requires_grad:
        return False
    return not path or (len(path) == 1 and getattr(path[0], "key", getattr(path[0], "name", None)) == "loss")


@contextlib.contextmanager
def checkpointing_disabled(module: torch.nn.Module, notice: Callable[[str], None]):
    """``torch.utils.checkpoint`` becomes a plain call while exporting (the exporter would
    otherwise trace its reentrant autograd Function as a PythonOp, and crash), and
    transformers' ``gradient_checkpointing`` flags are off.

    A reference bound before the export (``from torch.utils.checkpoint import checkpoint``
    at import, a ``functools.partial`` of it, the decorator form) never reads the module
    attribute again, so the calls are caught where each of them goes through: torch's
    ``_checkpoint_impl`` (every form, torch 2.14 on) and, for older torch, the reentrant
    ``CheckpointFunction.apply``; the module attribute too, for ``checkpoint_sequential``."""
    import torch.utils.checkpoint as checkpoint_module

    flagged = [m for m in module.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if flagged:
        notice(f"gradient checkpointing of {type(module).__name__} ({len(flagged)} modules)")

    def plain_call(function=None, *args, **options):
        if function is None:  # the decorator form: checkpoint(use_reentrant=False)(fn)
            return lambda fn: _plain(fn)
        notice("torch.utils.checkpoint")
        return function(*args, **{k: v for k, v in options.items() if k not in _CHECKPOINT_OPTIONS})

    def _plain(fn):
        return lambda *args, **kwargs: plain_call(fn, *args, **kwargs)

    def plain_impl(function, args, kwargs, **options):
        notice("torch.utils.checkpoint")
        return function(*args, **kwargs)

    def plain_apply(function, preserve_rng_state, *args):
        notice("torch.utils.checkpoint")
        return function(*args)

    patched = [(checkpoint_module, "checkpoint", plain_call)]
    if hasattr(checkpoint_module, "_checkpoint_impl"):
        patched.append((checkpoint_module, "_checkpoint_impl", plain_impl))
    patched.append((checkpoint_module.CheckpointFunction, "apply", staticmethod(plain_apply)))
    originals = [(owner, name, owner.__dict__.get(name, _INHERITED)) for owner, name, _ in patched]
    for owner, name, value in patched:
        setattr(owner, name, value)
    for m in flagged:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for owner, name, value in originals:
            if value is _INHERITED:  # CheckpointFunction.apply is autograd.Function's
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        for m in flagged:
            m.gradient_checkpointing = True


_INHERITED = object()

#: ``torch.utils.checkpoint.checkpoint``'s own keyword arguments (not the function's).
_CHECKPOINT_OPTIONS = {
    "use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop",
    "respect_saved_tensors_hooks",
}  # fmt: skip
