"""ORTModule under FSDP: what each way of sharding hands the wrapper's forward.

The rule: a call runs one graph, exported once, whose parameters are fed every step.  So
the parameters the wrapper reads in forward must be the module's own, registered as
parameters and unsharded for this call, and nothing of FSDP may run inside the module
(its hooks would run once, in the export, instead of every step).  Checked at every call
(:func:`check_sharding`):

- ``FSDP(ORTModule(m), use_orig_params=True)``: during forward FSDP registers views of its
  unsharded flat parameter as the module's parameters; the wrapper feeds them and hands
  their gradients to autograd, which carries them into the flat parameter.  Runs, at the
  root or as a unit of its own inside a bigger model (an ``ORTModule`` per layer); a unit
  that frees its parameters after forward gathers them again before backward, where the
  split step feeds them from where they are then (:mod:`ortpass.runtime.module.steps`).
  With ``builder="torch"`` refused: torch.export takes only ``nn.Parameter`` s.
- ``use_orig_params=False``: the views are plain tensor attributes, not parameters (the
  flat parameter sits on the wrapper or on a module around it).  Refused.
- FSDP inside the wrapped module (an ``auto_wrap_policy`` unit, ``fully_shard`` on a
  submodule, ``ORTModule(fully_shard(m))``): refused.  ``ORTModule(FSDP(m))`` and
  ``ORTModule(fully_shard(m))`` are refused when wrapping (``_REFUSED_WRAPPERS``).
- ``fully_shard(ORTModule(m))`` (FSDP2): it re-classes the wrapper (:func:`rebased_class`),
  and before forward swaps in unsharded plain parameters; but the ``state_dict`` pre-hook
  it puts on every module holding parameters reshards them to DTensors, and the exporter
  reads the state dict.  Those hooks move to the wrapper, the root a ``state_dict()`` of
  the sharded model starts at.  Runs.
- Any other DTensor parameter at forward time (tensor parallelism): refused.
"""

from __future__ import annotations

import logging
import sys

import torch

from ortpass.errors import OrtpassError

__all__ = ["check_sharding"]

logger = logging.getLogger(__name__)

_ROOT_ONLY = (
    "Shard at the root only: FSDP(ORTModule(model), use_orig_params=True) without auto_wrap_policy, "
    "or fully_shard(ORTModule(model))."
)


def check_sharding(wrapper: torch.nn.Module) -> None:
    """Refuse, by name, a way of sharding ``wrapper`` (an ORTModule) that its graph cannot
    run; keep FSDP2's parameters unsharded through the export where it shards the wrapper."""
    if "torch.distributed.fsdp" not in sys.modules:  # nothing can be sharded: no cost per call
        return
    from torch.distributed.fsdp import FlatParameter, FSDPModule, FullyShardedDataParallel

    flat_views = any(isinstance(p, FlatParameter) for p in wrapper._parameters.values())
    for path, m in wrapper.module.named_modules():
        if isinstance(m, (FullyShardedDataParallel, FSDPModule)):
            raise OrtpassError(_inside(path, m))
        flat_views = flat_views or _has_flat_views(m, FlatParameter)
    if flat_views:
        raise OrtpassError(
            "ORTModule cannot run under FullyShardedDataParallel with use_orig_params=False: FSDP hands the forward "
            "its parameters as views of one flat parameter, not as the module's parameters, so the graph cannot be "
            "fed them.\nPass use_orig_params=True: FSDP(ORTModule(model), use_orig_params=True)."
        )
    if isinstance(wrapper, FSDPModule):
        _state_dict_hooks_to_root(wrapper)
    _check_parameters(wrapper)


def _has_flat_views(module: torch.nn.Module, flat_parameter: type) -> bool:
    """Whether FSDP1 with ``use_orig_params=False`` (its flat parameter on a module around
    the wrapper) set ``module``'s parameters as plain views: attributes, not parameters."""
    return any(
        isinstance(getattr(value, "_base", None), flat_parameter) and name not in module._parameters
        for name, value in vars(module).items()
    )


def _inside(path: str, unit: torch.nn.Module) -> str:
    from torch.distributed.fsdp import FSDPModule

    fsdp2 = isinstance(unit, FSDPModule)
    what = "fully_shard (FSDP2)" if fsdp2 else "FullyShardedDataParallel"
    how = "fully_shard on a submodule" if fsdp2 else "a per-layer auto_wrap_policy"
    return (
        f"ORTModule cannot run {what} inside the module it wraps (at {path or 'its top'}, from {how}): "
        f"the export would run FSDP's all-gather and reduce-scatter hooks once, not every step.\n{_ROOT_ONLY}"
    )


def _state_dict_hooks_to_root(wrapper: torch.nn.Module) -> None:
    """Move FSDP2's ``state_dict`` pre-hooks (reshard to DTensors) from the modules inside
    ``wrapper`` to ``wrapper``: the exporter reads the inner module's state dict mid-forward,
    a user's ``state_dict()`` starts at the root and still gets DTensors."""
    moved: dict[int, object] = {}
    for m in wrapper.module.modules():
        for key, hook in list(m._state_dict_pre_hooks.items()):
            if getattr(hook, "__module__", "").startswith("torch.distributed.fsdp"):
                del m._state_dict_pre_hooks[key]
                moved.setdefault(id(hook), hook)
    for hook in moved.values():
        wrapper.register_state_dict_pre_hook(hook)
    if moved:
        logger.info("ORTModule: FSDP2's %d state_dict pre-hook(s) now run at the wrapper, not inside it", len(moved))


def _check_parameters(wrapper: torch.nn.Module) -> None:
    """Refuse DTensor parameters, and FSDP1's flat-parameter views where torch.export
    builds the graph (it takes only ``nn.Parameter`` s as parameters)."""
    from torch.distributed.fsdp import FlatParameter

    dtensor = sys.modules.get("torch.distributed.tensor")
    sharded, views = [], []
    for name, p in wrapper.module.named_parameters():
        if dtensor is not None and isinstance(p, dtensor.DTensor):
            sharded.append(name)
        elif isinstance(p._base, FlatParameter):
            views.append(name)
    if sharded:
        more = f" and {len(sharded) - 1} more" if len(sharded) > 1 else ""
        raise OrtpassError(
            f"ORTModule cannot run DTensor parameters ({sharded[0]}{more}): the graph is fed whole local tensors.\n"
            f"{_ROOT_ONLY}"
        )
    if views and getattr(wrapper, "builder_in_use", None) == "torch":
        raise OrtpassError(
            "ORTModule(builder='torch') cannot run under FullyShardedDataParallel: FSDP hands the forward its "
            "parameters as views of a flat parameter, and torch.export takes only nn.Parameters as parameters.\n"
            "Shard with fully_shard(ORTModule(model)) (FSDP2) instead, or use onnxruntime-training (builder='ort')."
        )


_REBASED: dict[tuple[type, type], type] = {}


def rebased_class(cls: type, reported: type, real: type) -> type:
    """The class to give the wrapper when something assigns it ``cls``.

    ``fully_shard`` (FSDP2) re-classes the module it shards as ``FSDP<its class>``, a subclass
    of FSDPModule and of ``module.__class__``, which the wrapper reports as the wrapped
    model's class (``reported``).  That class, derived from the wrapper's own (``real``)
    instead, keeps ORTModule's forward: ``FSDPORTModule(FSDPModule, ORTModule)``.
    """
    if issubclass(cls, real) or not issubclass(cls, reported):
        return cls
    if reported not in cls.__bases__:
        raise OrtpassError(
            f"ORTModule cannot become a {cls.__name__}: it derives from {reported.__name__}, the class the wrapper "
            f"reports, only through {[b.__name__ for b in cls.__bases__]}"
        )
    if (cls, real) not in _REBASED:
        bases = tuple(real if base is reported else base for base in cls.__bases__)
        namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        name = cls.__name__.replace(reported.__name__, real.__name__)
        _REBASED[cls, real] = type(name, bases, namespace)
        logger.info("ORTModule re-classed as %s (from %s)", name, cls.__name__)
    return _REBASED[cls, real]
