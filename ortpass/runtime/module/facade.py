"""The wrapper seen from outside: ``ORTModule(model)`` presents itself as ``model``.

Training libraries look a model over before they run it.  Hugging Face's Trainer reads
``forward``'s signature to keep the batch's columns, the model's class to find its label
names and whether it returns a loss, ``config`` and ``loss_type`` to count the tokens a loss
is normalized by, and saves with ``save_pretrained`` when the model is a ``PreTrainedModel``;
accelerate unwraps the containers it knows (DDP, FSDP, a compiled module) and saves their
``state_dict``; PEFT and user code call ``get_input_embeddings``, ``generate``,
``resize_token_embeddings``.  None of them knows ORTModule, and a wrapper that answers as
a container (its own class, ``module.``-prefixed keys, no ``config``) sends them down the
path for an unknown ``nn.Module``: Trainer dropped every column, counted the wrong tokens,
and saved prefixed weights without a config.  So the wrapper answers as the model would:

- **Attributes** the wrapper does not have itself are the wrapped module's, bound to it:
  ``config``, ``save_pretrained`` (which saves the module, config and tied weights
  included), ``generate`` (runs in torch), ``resize_token_embeddings`` (the next call builds
  a graph for the new shapes).  Dunder names are not forwarded: copy and pickle probe them.
- **Class**: ``isinstance(wrapper, type(model))`` holds, because ``__class__`` answers the
  model's class (as ``unittest.mock`` does); ``type(wrapper)`` is still ``ORTModule``, and
  ``isinstance(wrapper, ORTModule)`` holds.
- **Signature**: ``inspect.signature(wrapper.forward)`` is the model's forward's.
- **State**: ``state_dict()`` keys are the model's own, also where the wrapper sits inside
  a bigger module; ``load_state_dict`` takes them, and the ``module.``-prefixed keys of
  checkpoints saved by earlier ortpass.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
from typing import Any, Callable

import torch

__all__ = ["ModelFacade", "model_signature", "without_wrapper_prefix"]

logger = logging.getLogger(__name__)

WRAPPED = "module"  # the wrapper's attribute that holds the wrapped module (DDP's name for it)
_PREFIX = f"{WRAPPED}."


class model_signature:  # noqa: N801 - used as a decorator, like functools' lower-case classes
    """Decorates the wrapper's ``forward``: bound, it reports the wrapped module's
    ``forward`` signature to ``inspect.signature`` (Trainer keeps the batch's columns by it)."""

    def __init__(self, function: Callable) -> None:
        self.function = function
        functools.update_wrapper(self, function)

    def __get__(self, instance: Any, owner: type | None = None) -> Callable:
        return self.function if instance is None else _BoundForward(self.function, instance)


class _BoundForward(functools.partial):
    """``forward`` bound to a wrapper; its signature, read only when asked, is the module's."""

    @property
    def __signature__(self) -> inspect.Signature:
        wrapper = self.args[0]
        module = wrapper.__dict__.get("_modules", {}).get(WRAPPED)
        return inspect.signature(self.func if module is None else module.forward)


class ModelFacade(torch.nn.Module):
    """The part of :class:`~ortpass.runtime.module.ORTModule` that answers as the wrapped
    module (``self.module``) would; see the module docstring for the rules."""

    def _wrapped(self) -> torch.nn.Module | None:
        # Read from __dict__: during unpickling the attributes are not there yet, and
        # self._modules would recurse into __getattr__.
        return self.__dict__.get("_modules", {}).get(WRAPPED)

    def _register_state_hooks(self) -> None:
        self.register_state_dict_post_hook(_drop_wrapper_prefix)
        self.register_load_state_dict_pre_hook(_add_wrapper_prefix)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # the wrapper's own parameters, buffers, submodules
        except AttributeError:
            module = self._wrapped()
            if module is None or (name.startswith("__") and name.endswith("__")):
                raise
            return getattr(module, name)

    def _reported_class(self) -> type:  # isinstance() reads __class__ after type()
        module = self._wrapped()
        return type(self) if module is None else module.__class__

    def _set_class(self, cls: type) -> None:
        # fully_shard (FSDP2) re-classes the module it shards from the class it reports:
        # derive that class from the wrapper's own instead (distributed.rebased_class).
        from ortpass.runtime.module.distributed import rebased_class

        object.__dict__["__class__"].__set__(self, rebased_class(cls, self._reported_class(), type(self)))

    __class__ = property(_reported_class, _set_class)  # type: ignore[assignment]

    def __dir__(self) -> list[str]:
        module = self._wrapped()
        return sorted(set(super().__dir__()) | (set(dir(module)) if module is not None else set()))

    def __reduce_ex__(self, protocol: int) -> tuple:
        # pickle refuses an object whose __class__ is not the class it rebuilds it from.
        return (_new_instance, (type(self),), self.__getstate__())

    def _get_name(self) -> str:  # repr(wrapper): ORTModule(  (module): LlamaForCausalLM(...) )
        return type(self).__name__

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load the wrapped module's state, under its own keys or ``module.``-prefixed ones;
        missing and unexpected keys are reported as the module names them."""
        module = self._modules[WRAPPED]
        if _has_own_inner(module):  # its keys are the wrapper's, "module." and all
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        return module.load_state_dict(without_wrapper_prefix(state_dict, module), strict=strict, assign=assign)


def _new_instance(cls: type) -> Any:
    return cls.__new__(cls)


def without_wrapper_prefix(state_dict: Any, module: torch.nn.Module, prefix: str = "") -> Any:
    """``state_dict`` with its ``prefix + "module."`` keys (and ``_metadata`` entries) renamed
    ``prefix + ...``; other keys as they are.  Where the wrapped module has an entry of its
    own named ``module``, its keys would be ambiguous: the wrapper keeps the prefix then,
    as a container does."""
    if _has_own_inner(module):
        return state_dict
    renamed = collections.OrderedDict((_strip(key, prefix), value) for key, value in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        # The module's entry comes after the wrapper's and replaces it.
        renamed._metadata = collections.OrderedDict(  # type: ignore[attr-defined]
            (_strip(key + ".", prefix)[:-1], value) for key, value in metadata.items()
        )
    return renamed


def _has_own_inner(module: torch.nn.Module) -> bool:
    return any(WRAPPED in getattr(module, table) for table in ("_modules", "_parameters", "_buffers"))


def _strip(key: str, prefix: str) -> str:
    return prefix + key[len(prefix) + len(_PREFIX) :] if key.startswith(prefix + _PREFIX) else key


def _drop_wrapper_prefix(wrapper: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook: the wrapper's entries under the module's own keys, in place
    (the dict is shared with the modules around the wrapper, and keeps its order)."""
    if prefix.endswith("_fsdp_wrapped_module."):  # FSDP1's own hooks then look for the keys it recorded
        return
    module = wrapper._modules[WRAPPED]
    renamed = without_wrapper_prefix(state_dict, module, prefix)
    if renamed is state_dict:
        return
    state_dict.clear()
    state_dict.update(renamed)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        metadata.clear()
        metadata.update(renamed._metadata)


def _add_wrapper_prefix(wrapper, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    """Load pre-hook, where the wrapper sits inside a bigger module: its entries, saved
    under the module's own keys, go to ``prefix + "module."`` before the children load
    (keys that already carry it stay)."""
    if _has_own_inner(wrapper._modules[WRAPPED]):
        return
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + _PREFIX)]:
        state_dict[prefix + _PREFIX + key[len(prefix) :]] = state_dict.pop(key)
