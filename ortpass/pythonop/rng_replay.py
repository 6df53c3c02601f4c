"""The PythonOp part of the recompute rewrite: replay the forward's randomness in the clone.

A ``com.microsoft::PythonOp`` runs a ``torch.autograd.Function`` through the torch bridge
(:mod:`ortpass.pythonop.bridge`).  A FlashAttention-like Function draws its dropout mask from
torch's global generator and keeps its inputs in its ``ctx`` for backward.  Recomputing it
(ORT PR #20603, ``docs/design/ort-facts.md``) means:

- the forward node runs in inference mode (``training_mode`` 0): torch keeps no graph and
  no saved tensors for it; it gains two uint8 outputs, the CPU and the device generator
  state taken right before the Function ran (the device state is empty without CUDA);
- the clone reads the same inputs plus those two states, runs in training mode with the
  generators set to the saved states (and restored afterwards, so the rest of the step
  sees the generator stream it would have seen without recompute), and its ``ctx`` is the
  one ``PythonOpGrad`` reads (an inner Function with a ``recompute_forward`` runs that
  there: the clone's autograd graph then serves backward directly);
- ``PythonOpGrad`` checks that backward returns one value per argument of the forward
  call, and the clone's call has two more (the states): it is replaced by one whose
  ``output_convention`` and outputs also cover them (their gradients are None, on two
  unused outputs).

The bridge dispatches on ``func_name`` only, so the two behaviours are two derived
Functions registered with it: ``SAVE_PREFIX[<func_name>]`` and ``REPLAY_PREFIX[<func_name>]``.  The rewrite registers them; a process that
loads such a model from a file calls :func:`register_rng_replay_functions` first.

Only Functions registered with
:func:`ortpass.analysis.recomputable_ops.register_recomputable_function` reach this module
(the analysis grows subgraphs through no other PythonOp).  Torch is imported only when a
PythonOp is actually rewritten.
"""

from __future__ import annotations

import logging
import re
from typing import Iterable, Protocol, Sequence

import onnx_ir as ir

from ortpass.conventions import MS_DOMAIN
from ortpass.errors import UnregisteredFunctionError
from ortpass.pythonop.registry import registered_functions

__all__ = [
    "RNG_STATE_SUFFIXES",
    "SAVE_PREFIX",
    "REPLAY_PREFIX",
    "check_pythonops",
    "clone_with_rng_replay",
    "is_pythonop",
    "register_rng_replay_functions",
    "rng_replay_functions",
]

logger = logging.getLogger(__name__)

#: Names of the two state outputs, appended to the PythonOp's first tensor output name.
RNG_STATE_SUFFIXES = ("_rng_state_cpu", "_rng_state_device")
# The derived Functions' func_names are written into models: they keep the name of the
# module that first defined them, so models saved before it moved still load.
_FUNC_NAME_MODULE = "ortpass.passes.recompute_pythonop"
SAVE_PREFIX = f"{_FUNC_NAME_MODULE}.SaveRngState"
REPLAY_PREFIX = f"{_FUNC_NAME_MODULE}.ReplayRngState"


class Cloner(Protocol):
    """What the recompute rewrite lends this module to make clones (the recompute pass's
    cloner): fresh names, and a backward-tagged copy of a node."""

    def unique(self, name: str) -> str: ...

    def new_clone(
        self, node: ir.Node, inputs: Sequence[ir.Value | None], *, num_outputs: int | None = None,
        attributes: Iterable[ir.Attr] | None = None,
    ) -> ir.Node: ...
_DERIVED = re.compile(rf"^(?:{re.escape(SAVE_PREFIX)}|{re.escape(REPLAY_PREFIX)})\[(?P<inner>.+)\]$")

_UINT8 = ir.DataType.UINT8.value
_STATE_COUNT = len(RNG_STATE_SUFFIXES)


def is_pythonop(node: ir.Node) -> bool:
    return node.domain == MS_DOMAIN and node.op_type == "PythonOp"



def check_pythonops(nodes: Iterable[ir.Node]) -> None:
    """Refuse (before any change) PythonOps whose Function the bridge cannot run."""
    pythonops = [n for n in nodes if is_pythonop(n)]
    for node in pythonops:
        func_name = node.attributes.get_string("func_name", "")
        if _DERIVED.match(func_name):
            raise ir.passes.PreconditionError(f"PythonOp {node.name!r} is already recomputed ({func_name})")
        if node.attributes.get("training_mode") is None or node.attributes["training_mode"].as_int() != 1:
            raise ir.passes.PreconditionError(f"PythonOp {node.name!r} is not in training mode; nothing to recompute")
    known = registered_functions() if pythonops else {}
    for node in pythonops:
        func_name = node.attributes.get_string("func_name", "")
        if func_name not in known:
            raise UnregisteredFunctionError(
                f"PythonOp {node.name!r} calls {func_name!r}, which is not registered with the torch "
                "bridge; register it (ortpass.pythonop.bridge.register_function) before recomputing it"
            )


def rng_replay_functions(func_name: str) -> tuple[type, type]:
    """The (save, replay) Functions derived from the registered Function ``func_name``,
    created and registered with the bridge on first use."""
    from ortpass.pythonop import bridge

    inner = bridge.registered_functions().get(func_name)
    if inner is None:
        raise UnregisteredFunctionError(f"autograd Function {func_name!r} is not registered with the torch bridge")
    derived = bridge.registered_functions()
    save_name, replay_name = f"{SAVE_PREFIX}[{func_name}]", f"{REPLAY_PREFIX}[{func_name}]"
    if derived.get(save_name) is not None and derived[save_name].inner is inner:
        return derived[save_name], derived[replay_name]
    base_save, base_replay = _base_classes()
    save = _derive(base_save, "SaveRngState", func_name, inner)
    replay = _derive(base_replay, "ReplayRngState", func_name, inner)
    bridge.register_function(save)
    bridge.register_function(replay)
    return save, replay


def register_rng_replay_functions(model: ir.Model) -> list[str]:
    """Register the derived Functions a recomputed model names (for a model loaded from a
    file in a new process; the inner Functions must be registered already)."""
    names = []
    for node in model.graph.all_nodes():
        match = _DERIVED.match(node.attributes.get_string("func_name", "")) if is_pythonop(node) else None
        if match:
            rng_replay_functions(match.group("inner"))
            names.append(node.attributes.get_string("func_name", ""))
    return names


def _derive(base: type, kind: str, func_name: str, inner: type) -> type:
    qualname = f"{kind}[{func_name}]"
    return type(qualname, (base,), {"__module__": _FUNC_NAME_MODULE, "__qualname__": qualname, "inner": inner})


_BASES: tuple[type, type] | None = None


def _base_classes() -> tuple[type, type]:
    """The two base Functions (defined on first use: they need torch)."""
    global _BASES
    if _BASES is None:
        _BASES = _define_base_classes()
    return _BASES


def _define_base_classes() -> tuple[type, type]:
    import torch

    def device_states() -> torch.Tensor:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.get_rng_state()
        return torch.empty(0, dtype=torch.uint8)

    class SaveRngState(torch.autograd.Function):
        """Run ``inner`` and also return the generator states it started from."""

        inner: type

        @classmethod
        def apply(cls, *args):  # the bridge calls apply; nothing here needs autograd
            cpu, device = torch.get_rng_state(), device_states()
            outputs = cls.inner.apply(*args)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            return (*outputs, cpu, device)

    class ReplayRngState(torch.autograd.Function):
        """Run ``inner`` (with autograd) from the generator states given as the last two
        arguments, then put the generators back as they were.

        The clone runs right before its backward, so there is nothing to save memory for
        between the two: an inner Function that declares ``recompute_forward`` (the same
        outputs, computed by differentiable torch code that keeps what autograd saves) runs
        that instead of ``apply``, and its backward needs no second forward.
        """

        inner: type

        @classmethod
        def apply(cls, *args):
            *inner_args, cpu, device = args
            devices = [torch.cuda.current_device()] if device.numel() else []
            run = getattr(cls.inner, "recompute_forward", None) or cls.inner.apply
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(cpu.detach().cpu())
                if devices:
                    torch.cuda.set_rng_state(device.detach().cpu())
                return run(*inner_args)

    return SaveRngState, ReplayRngState



def _set(attrs: dict[str, ir.Attr], name: str, value) -> None:
    """Set attribute ``name`` (a str, an int or a list of ints) in ``attrs``."""
    attrs[name] = ir.convenience.convert_attribute(name, value)


def clone_with_rng_replay(
    graph: ir.Graph, node: ir.Node, inputs: Sequence[ir.Value | None], cloner: Cloner
) -> tuple[ir.Node, ir.Node]:
    """Rewrite the forward PythonOp ``node`` to save the generator states, and create its
    clone replaying them.  Returns (the forward node now in the graph, the clone)."""
    func_name = node.attributes.get_string("func_name", "")
    save, replay = rng_replay_functions(func_name)
    from ortpass.pythonop.export import qualified_name

    forward = _saving_forward(node, qualified_name(save), cloner)
    old_outputs = list(node.outputs)
    _take_place(graph, node, forward)

    attrs = {a.name: a for a in node.attributes.values()}
    _set(attrs, "func_name", qualified_name(replay))
    _set(attrs, "input_convention", node.attributes.get_string("input_convention", "") + "d" * _STATE_COUNT)
    _set(attrs, "input_tensor_types", list(node.attributes.get_ints("input_tensor_types", ())) + [_UINT8] * _STATE_COUNT)
    _set(attrs, "input_tensor_ranks", list(node.attributes.get_ints("input_tensor_ranks", ())) + [1] * _STATE_COUNT)
    _set(attrs, "input_requires_grads", list(node.attributes.get_ints("input_requires_grads", ())) + [0] * _STATE_COUNT)
    states = list(forward.outputs[len(old_outputs) :])
    clone = cloner.new_clone(forward, [*inputs, *states], num_outputs=len(old_outputs), attributes=attrs.values())
    for user, _ in list(forward.outputs[0].uses()):
        if user.domain == MS_DOMAIN and user.op_type == "PythonOpGrad":
            _widen_gradient(graph, user, states)
    logger.debug("PythonOp %s recomputed as %s with replayed RNG state", node.name, clone.name)
    return forward, clone


def _widen_gradient(graph: ir.Graph, grad: ir.Node, states: Sequence[ir.Value]) -> None:
    """Replace ``grad`` (a PythonOpGrad) by one that also accounts for the state arguments.

    PythonOpGrad checks that backward returns one value per argument of the forward call
    (its ``output_convention``), and the clone's call has the two states as extra tensor
    arguments; their gradients come back as None and land on two unused outputs.
    """
    attrs = {a.name: a for a in grad.attributes.values()}
    _set(attrs, "output_convention", grad.attributes.get_string("output_convention", "") + "d" * _STATE_COUNT)
    _set(attrs, "output_tensor_types", list(grad.attributes.get_ints("output_tensor_types", ())) + [_UINT8] * _STATE_COUNT)
    _set(attrs, "output_tensor_ranks", list(grad.attributes.get_ints("output_tensor_ranks", ())) + [1] * _STATE_COUNT)
    _set(attrs, "output_tensor_requires_grads", list(grad.attributes.get_ints("output_tensor_requires_grads", ())) + [0] * _STATE_COUNT)
    widened = _with_state_outputs(grad, attrs)
    _take_place(graph, grad, widened)
    for state, output in zip(states, widened.outputs[len(grad.outputs) :]):
        output.name = f"{state.name}_grad"


def _with_state_outputs(node: ir.Node, attrs: dict[str, ir.Attr]) -> ir.Node:
    """A copy of ``node`` (same inputs, name, metadata) with ``attrs`` and two more outputs."""
    return ir.Node(
        node.domain,
        node.op_type,
        list(node.inputs),
        attributes=list(attrs.values()),
        num_outputs=len(node.outputs) + _STATE_COUNT,
        version=node.version,
        name=node.name,
        metadata_props=dict(node.metadata_props),
    )


def _take_place(graph: ir.Graph, old: ir.Node, new: ir.Node) -> None:
    """Put ``new`` where ``old`` is: same position, its outputs (names, types, shapes, uses)."""
    graph.insert_before(old, new)
    old_outputs = list(old.outputs)
    for before, after in zip(old_outputs, new.outputs):
        after.type, after.shape = before.type, before.shape
        before.replace_all_uses_with(after, replace_graph_outputs=True)
    graph.remove(old, safe=True)
    for before, after in zip(old_outputs, new.outputs):
        name = before.name
        before.name = None
        after.name = name



def _saving_forward(node: ir.Node, save_name: str, cloner: Cloner) -> ir.Node:
    attrs = {a.name: a for a in node.attributes.values()}
    _set(attrs, "func_name", save_name)
    _set(attrs, "training_mode", 0)
    _set(attrs, "output_tensor_types", list(node.attributes.get_ints("output_tensor_types", ())) + [_UINT8] * _STATE_COUNT)
    _set(attrs, "output_tensor_ranks", list(node.attributes.get_ints("output_tensor_ranks", ())) + [1] * _STATE_COUNT)
    requires = node.attributes.get_ints("output_tensor_requires_grads")
    if requires is not None:
        _set(attrs, "output_tensor_requires_grads", [*requires, *[0] * _STATE_COUNT])
    forward = _with_state_outputs(node, attrs)
    first = node.outputs[1].name if len(node.outputs) > 1 and node.outputs[1].name else node.name
    for suffix, state in zip(RNG_STATE_SUFFIXES, forward.outputs[len(node.outputs) :]):
        state.name = cloner.unique(f"{first}{suffix}")
        state.type = ir.TensorType(ir.DataType.UINT8)
        state.shape = ir.Shape([None])
    return forward
