"""``ORTModule``: train a ``torch.nn.Module`` on ONNX Runtime with the optimized training graph.

``model = ORTModule(model)`` keeps the training loop: ``loss = model(...)`` runs the
forward+backward graph that ``ortpass.export`` + the pipeline built, and
``loss.backward()`` hands each trainable parameter its gradient, through torch's own
accumulation and hooks, so optimizers, clipping, schedulers and gradient accumulation work
unchanged.

How a step runs (and what that means):

- The graph is one forward+backward graph, so **gradients are computed during forward**.
  ``forward`` runs the whole ORT step inside a ``torch.autograd.Function`` whose inputs
  are the trainable parameters; the gradients wait in the Function's context (memory held
  from forward to ``backward()``, as torch holds activations) and its ``backward``
  scales them by the incoming gradient of the loss (``loss / 4`` for accumulation gives
  0.25) and returns them to torch, which accumulates them into ``.grad`` and runs the
  parameters' hooks.  At a gradient of exactly 1 the tensor ORT wrote is handed over as
  it is, which ``AccumulateGrad`` then keeps as ``.grad`` without a copy.
- Only the loss carries gradient.  Other tensor outputs (logits, hidden states) come back
  detached, and gradient sent into them is not supported: the graph has no input for it.
  They are graph outputs, so ORT keeps them until the step ends.
- A graph is chosen by :class:`GraphTransitionManager` from the input schema: tensor
  dtypes and ranks, the nesting of the arguments, the values of the non-tensor ones, the
  set of trainable parameters, ``training``.  Every tensor dim is dynamic in the export, so
  a new sequence length or batch size runs the same graph.  ``eval()`` runs a forward-only
  graph exported in eval mode (no Dropout, no gradients).
- Parameters, buffers and batch tensors are fed to ORT as OrtValues over torch's memory
  (DLPack); ORT's outputs come back to torch the same way.  The session holds no copy of
  the weights: parameters and buffers are graph inputs without initializer values.
- ``torch.utils.checkpoint`` (and transformers' gradient checkpointing) is a no-op while
  exporting: graph recompute replaces it (the default pipeline's ``recompute(level=1)``
  recomputes layer by layer, as per-layer checkpointing does).

Not supported: modules that update their own parameters or buffers in forward
(BatchNorm's running statistics), gradient through inputs, non-tensor outputs other than
``None``.  Each is refused with an error naming the argument, output or tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import onnx_ir as ir
import torch
import torch.utils._pytree as pytree

from ortpass.errors import OrtpassError

__all__ = ["GraphTransitionManager", "InputSchema", "ORTModule"]

logger = logging.getLogger(__name__)

#: Python values the exporter bakes into the graph as constants (part of the schema).
_CONSTANT_TYPES = (bool, int, float, str, type(None))
_INNER = "module"  # attribute holding the user's module inside the export wrapper
_CACHE_FORMAT = 1


# -- the input schema -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InputSchema:
    """What decides the graph: two calls with equal schemas run the same graph."""

    structure: str  # the pytree spec of the bound arguments
    leaves: tuple[tuple[str, str, str], ...]  # (argument path, "tensor"/"constant", dtype+rank or repr)
    trainable: tuple[str, ...]
    training: bool

    def difference(self, previous: InputSchema | None) -> str:
        """Why a graph built for ``previous`` does not serve this schema, in words."""
        if previous is None:
            return "first call"
        if self.training != previous.training:
            return f"training changed {previous.training} -> {self.training} ({'train' if self.training else 'eval'} graph)"
        if self.trainable != previous.trainable:
            added = sorted(set(self.trainable) - set(previous.trainable))
            removed = sorted(set(previous.trainable) - set(self.trainable))
            return f"trainable parameters changed: +{added} -{removed}"
        old, new = {p: (k, d) for p, k, d in previous.leaves}, {p: (k, d) for p, k, d in self.leaves}
        if set(new) - set(old) or set(old) - set(new):
            return f"arguments changed: new {sorted(set(new) - set(old))}, gone {sorted(set(old) - set(new))}"
        for path, (kind, detail) in new.items():
            if old[path] != (kind, detail):
                return f"argument {path} changed: {old[path][0]} {old[path][1]} -> {kind} {detail}"
        return "argument structure changed"


def _describe_tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}[rank {t.dim()}]"


def _path_name(path: tuple) -> str:
    """``extra['bias']`` for the arguments' paths (the first key is a parameter name)."""
    if path and isinstance(path[0], pytree.MappingKey):
        return f"{path[0].key}{pytree.keystr(path[1:])}"
    return pytree.keystr(path).lstrip(".")


def bind_arguments(module: torch.nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """The call's arguments by parameter name of ``module.forward``."""
    try:
        return inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise OrtpassError(f"{type(module).__name__}.forward does not take these arguments: {exc}") from exc


def flatten_arguments(module: torch.nn.Module, bound: inspect.BoundArguments) -> tuple[list[tuple[str, Any]], Any]:
    """(argument path, leaf) pairs and the pytree spec; refuses leaves the exporter cannot see."""
    with_paths, spec = pytree.tree_flatten_with_path(dict(bound.arguments))
    leaves = []
    for path, leaf in with_paths:
        name = _path_name(path)
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                raise OrtpassError(
                    f"argument {name} of {type(module).__name__} requires grad: ORTModule computes gradients "
                    "for the module's parameters only; pass it detached"
                )
        elif not isinstance(leaf, _CONSTANT_TYPES):
            raise OrtpassError(
                f"argument {name} of {type(module).__name__} is a {type(leaf).__name__}, which the ONNX exporter "
                "cannot see: pass tensors, Python scalars, strings or None, nested in tuples, lists and dicts"
            )
        leaves.append((name, leaf))
    return leaves, spec


def input_schema(module: torch.nn.Module, leaves: list[tuple[str, Any]], spec: Any) -> InputSchema:
    described = tuple(
        (name, "tensor", _describe_tensor(leaf)) if isinstance(leaf, torch.Tensor) else (name, "constant", repr(leaf))
        for name, leaf in leaves
    )
    trainable = tuple(name for name, p in module.named_parameters() if p.requires_grad)
    return InputSchema(str(spec), described, trainable, module.training)


# -- transitions ------------------------------------------------------------------------------


class GraphTransitionManager:
    """Decides, in one place, whether a call runs the current graph, one built before, or
    a new export; logs every transition with its reason."""

    def __init__(self) -> None:
        self._graphs: dict[InputSchema, Any] = {}
        self.current: InputSchema | None = None
        self.transitions: list[tuple[str, str]] = []  # (action, reason): "export"/"load"/"switch"

    def graph_for(self, schema: InputSchema, build: Callable[[InputSchema], tuple[Any, str]]) -> Any:
        if schema == self.current:
            return self._graphs[schema]
        reason = schema.difference(self.current)
        if schema in self._graphs:
            self._record("switch", f"back to a graph built before: {reason}")
        else:
            graph, action = build(schema)
            self._graphs[schema] = graph
            self._record(action, reason)
        self.current = schema
        return self._graphs[schema]

    def _record(self, action: str, reason: str) -> None:
        self.transitions.append((action, reason))
        logger.info("ORTModule graph %s: %s", action, reason)


# -- the export wrapper -----------------------------------------------------------------------


class _FlatCall(torch.nn.Module):
    """Runs the user's module from flat tensors (what the exporter feeds) and returns flat
    tensors: the loss first in training, then the output's other tensors."""

    def __init__(self, module: torch.nn.Module, leaves: list[tuple[str, Any]], spec: Any, bound: inspect.BoundArguments):
        super().__init__()
        setattr(self, _INNER, module)
        # The exporter restores the wrapper's mode after exporting, recursively: it must be
        # the module's (set without recursing, so the submodules keep theirs).
        self.training = module.training
        self._leaves, self._spec, self._signature = leaves, spec, bound.signature
        self.output_spec: str | None = None  # serialized, for the cache
        self.output_tree: Any = None
        self.output_leaves: list[tuple[str, str]] = []  # (output path, "loss"/"tensor"/"none")

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        module = getattr(self, _INNER)
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
            name = _path_name(path) or "output"
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
                f"{_describe_tensor(loss)} of shape {tuple(loss.shape)}"
            )
        self.output_leaves = kinds
        return (loss, *tensors) if loss is not None else tuple(tensors)


def _is_loss_path(path: tuple) -> bool:
    if not path:  # the output is the tensor itself
        return True
    return len(path) == 1 and getattr(path[0], "key", getattr(path[0], "name", None)) == "loss"


@contextlib.contextmanager
def _checkpointing_disabled(module: torch.nn.Module, notice: Callable[[str], None]):
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


# -- graphs and sessions ----------------------------------------------------------------------


@dataclasses.dataclass
class _Graph:
    """One built graph and what running it needs."""

    session: Any
    training: bool
    tensor_inputs: list[str | None]  # graph input name per tensor leaf (None: the graph does not read it)
    state_inputs: list[tuple[str, str]]  # (graph input name, parameter or buffer name)
    params: list[str]  # trainable parameter names, in gradient order
    gradient_outputs: list[str]
    outputs: list[str]  # loss (training) then the other tensor outputs
    output_spec: Any  # a TreeSpec
    output_leaves: list[tuple[str, str]]


class _ForwardSession:
    """A session over a forward-only (eval) graph, run on OrtValues like TrainingSession."""

    def __init__(self, model: ir.Model, providers: Any) -> None:
        import onnxruntime as ort

        from ortpass.runtime.session import _resolve_providers
        from ortpass.training.build import clamp_for_ort

        proto = ir.to_proto(model)
        clamp_for_ort(proto)
        if any(n.op_type == "PythonOp" for n in proto.graph.node):
            from ortpass.runtime import bridge

            bridge.prepare(model)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self._session = ort.InferenceSession(
            proto.SerializeToString(), options, providers=_resolve_providers(providers, ort.get_available_providers())
        )

    def run_with_ort_values(self, feeds, fetch):
        try:
            return list(self._session._sess.run_with_ort_values(dict(feeds), list(fetch), None))
        except Exception as exc:
            raise OrtpassError(f"the forward step failed on ONNX Runtime: {type(exc).__name__}: {exc}") from exc


def _graph_input_name(path: str, taken: set[str]) -> str:
    name = re.sub(r"[^0-9A-Za-z_]+", "_", path).strip("_") or "input"
    candidate, n = name, 0
    while candidate in taken:
        n += 1
        candidate = f"{name}_{n}"
    taken.add(candidate)
    return candidate


def _state_to_inputs(model: ir.Model, state_names: set[str]) -> None:
    """Make every parameter and buffer a graph input (ORT's fusions then cannot fold a
    frozen weight into a constant); ``strip`` below drops their values afterwards."""
    inputs = {v.name for v in model.graph.inputs}
    for name, value in model.graph.initializers.items():
        if name in state_names and name not in inputs:
            model.graph.inputs.append(value)


def _strip_state_values(model: ir.Model, state_names: set[str]) -> list[str]:
    """Drop the values of parameters and buffers: the session gets them fed every step."""
    stripped = []
    for name in list(model.graph.initializers):
        if name in state_names:
            value = model.graph.initializers.pop(name)
            value.const_value = None
            stripped.append(name)
    return stripped


def _to_ortvalue(t: torch.Tensor):
    """A C-level OrtValue over ``t``'s memory (DLPack; ORT reads bools as bytes)."""
    from onnxruntime.capi import _pybind_state as C

    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    is_bool = t.dtype == torch.bool
    return C.OrtValue.from_dlpack(torch.utils.dlpack.to_dlpack(t.view(torch.uint8) if is_bool else t), is_bool)


def _to_torch(value) -> torch.Tensor:
    tensor = torch.utils.dlpack.from_dlpack(value.to_dlpack())
    if value.data_type() == "tensor(bool)" and tensor.dtype != torch.bool:
        tensor = tensor.view(torch.bool)
    return tensor


# -- the autograd bridge ----------------------------------------------------------------------


class _OrtStep(torch.autograd.Function):
    """Forward runs the whole ORT step; backward returns the gradients it stashed."""

    @staticmethod
    def forward(ctx, run: Callable[[], tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]], *params):
        loss, gradients, others = run()
        ctx.gradients = gradients
        ctx.mark_non_differentiable(*others)
        return (loss, *others)

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        gradients, ctx.gradients = ctx.gradients, None
        if gradients is None:
            raise RuntimeError("ORTModule: backward through the same step twice; the gradients were handed over")
        if grad_loss.numel() == 1 and float(grad_loss) == 1.0:
            return (None, *gradients)  # ORT's tensors become .grad as they are
        return (None, *(g * grad_loss.to(g.dtype) for g in gradients))


# -- the wrapper ------------------------------------------------------------------------------


class ORTModule(torch.nn.Module):
    """Drop-in wrapper: ``model = ORTModule(model)``; then train as in torch.

    Args:
        module: a module whose forward returns the loss in training: a scalar tensor, or a
            structure with a ``loss`` field (a transformers ``ModelOutput``, a dict).
        pipeline: the ortpass pipeline spec for training graphs (default: the one
            ``ortpass optimize`` runs, recompute level 1 included); it must build the
            training graph (``build-training-graph``).
        cache_dir: where built graphs are kept, keyed on the module's structure and
            parameter names/shapes, the input schema, the pipeline and the versions of
            torch, onnx, onnxruntime and ortpass; another process loads instead of exporting.
        providers: as for :class:`~ortpass.runtime.TrainingSession`.
        opset: the ai.onnx opset of the export.

    ``state_dict()`` keys carry the ``module.`` prefix (as with DDP); the wrapped module is
    ``.module``.  ``graph_builds`` counts exports in this process.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        pipeline: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        providers: Any = None,
        opset: int = 17,
    ) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise OrtpassError(f"ORTModule wraps a torch.nn.Module, got {type(module).__name__}")
        if pipeline is None:
            from ortpass.cli import DEFAULT_PIPELINE

            pipeline = DEFAULT_PIPELINE
        self.module = module
        self.pipeline = pipeline
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.providers = providers
        self.opset = opset
        self.graph_builds = 0
        self.transitions = GraphTransitionManager()
        self._noticed_checkpointing = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = bind_arguments(self.module, args, kwargs)
        leaves, spec = flatten_arguments(self.module, bound)
        schema = input_schema(self.module, leaves, spec)
        graph = self.transitions.graph_for(schema, lambda s: self._build(s, leaves, spec, bound))
        tensors = [leaf for _, leaf in leaves if isinstance(leaf, torch.Tensor)]
        feeds = {name: _to_ortvalue(t) for name, t in zip(graph.tensor_inputs, tensors) if name is not None}
        state = dict(self.module.named_parameters(remove_duplicate=False))  # a tied weight by either name
        state.update(self.module.named_buffers(remove_duplicate=False))
        for graph_name, state_name in graph.state_inputs:
            feeds[graph_name] = _to_ortvalue(state[state_name])
        if not graph.training:
            with torch.no_grad():
                outputs = [_to_torch(v) for v in graph.session.run_with_ort_values(feeds, graph.outputs)]
            return self._unflatten(graph, None, outputs)

        def run():
            values = graph.session.run_with_ort_values(feeds, graph.outputs + graph.gradient_outputs)
            n = len(graph.outputs)
            return _to_torch(values[0]), [_to_torch(v) for v in values[n:]], [_to_torch(v) for v in values[1:n]]

        loss, *others = _OrtStep.apply(run, *(state[name] for name in graph.params))
        return self._unflatten(graph, loss, others)

    @staticmethod
    def _unflatten(graph: _Graph, loss: torch.Tensor | None, others: Sequence[torch.Tensor]) -> Any:
        rest = iter(others)
        values = [loss if kind == "loss" else None if kind == "none" else next(rest) for _, kind in graph.output_leaves]
        return pytree.tree_unflatten(values, graph.output_spec)

    # -- building ---------------------------------------------------------------------------

    def _notice_checkpointing(self, what: str) -> None:
        if self._noticed_checkpointing:
            return
        self._noticed_checkpointing = True
        message = (
            f"ORTModule: {what} is not run in the ORT graph; graph recompute replaces it: "
            "recompute(level=1) in the pipeline recomputes layer by layer as per-layer checkpointing does"
            + ("" if "recompute(" in self.pipeline or "recompute," in self.pipeline else " (this pipeline has no recompute)")
        )
        logger.warning(message)
        warnings.warn(message, stacklevel=4)

    def _build(self, schema: InputSchema, leaves, spec, bound) -> tuple[_Graph, str]:
        key_material = _cache_key_material(self.module, schema, self.pipeline if schema.training else "eval", self.opset)
        cached = _load_cached(self.cache_dir, key_material) if self.cache_dir is not None else None
        if cached is not None:
            model, meta = cached
            return self._graph_from(model, meta), "load"
        model, meta, output_tree = self._export_and_optimize(schema, leaves, spec, bound)
        if self.cache_dir is not None:
            _store_cached(self.cache_dir, key_material, model, meta)
        return self._graph_from(model, meta, output_tree), "export"

    def _export_and_optimize(self, schema: InputSchema, leaves, spec, bound) -> tuple[ir.Model, dict, Any]:
        from ortpass.export import export

        flat = _FlatCall(self.module, leaves, spec, bound)
        taken: set[str] = set()
        names = [_graph_input_name(name, taken) for name, leaf in leaves if isinstance(leaf, torch.Tensor)]
        tensors = [leaf for _, leaf in leaves if isinstance(leaf, torch.Tensor)]
        dynamic = {name: {axis: f"{name}_dim{axis}" for axis in range(t.dim())} for name, t in zip(names, tensors)}
        named = [*self.module.named_parameters(remove_duplicate=False), *self.module.named_buffers(remove_duplicate=False)]
        state = {f"{_INNER}.{n}": t for n, t in named}
        versions = {name: t._version for name, t in state.items()}
        with _checkpointing_disabled(self.module, self._notice_checkpointing):
            model = export(
                flat, tuple(tensors), input_names=names, loss_name="loss" if schema.training else "output_0",
                opset=self.opset, dynamic_axes=dynamic, training=schema.training,
            )  # fmt: skip
        changed = [name.removeprefix(f"{_INNER}.") for name, t in state.items() if t._version != versions[name]]
        if changed:
            raise OrtpassError(
                f"{type(self.module).__name__}.forward updates {changed} in place; ORTModule cannot run a graph "
                "that changes the module's own parameters or buffers"
            )
        self.graph_builds += 1
        outputs = [v.name for v in model.graph.outputs]
        _state_to_inputs(model, set(state))
        if schema.training:
            import ortpass

            model = ortpass.pipeline(self.pipeline)(model).model
        stripped = _strip_state_values(model, set(state))
        graph_inputs = {v.name for v in model.graph.inputs}
        meta = {
            "training": schema.training,
            "tensor_inputs": [n if n in graph_inputs else None for n in names],
            "state_inputs": [[n, n.removeprefix(f"{_INNER}.")] for n in stripped if n in graph_inputs],
            "outputs": outputs,
            "output_spec": flat.output_spec,
            "output_leaves": flat.output_leaves,
        }
        return model, meta, flat.output_tree

    def _graph_from(self, model: ir.Model, meta: dict, output_tree: Any = None) -> _Graph:
        from ortpass.runtime.session import TrainingSession

        output_spec = output_tree if output_tree is not None else pytree.treespec_loads(meta["output_spec"])
        if meta["training"]:
            session = TrainingSession(model, self.providers)
            prefix = f"{_INNER}."
            params = [p.removeprefix(prefix) for p in session.info.params]
            gradient_outputs = list(session.info.gradients.values())
        else:
            session, params, gradient_outputs = _ForwardSession(model, self.providers), [], []
        return _Graph(
            session=session,
            training=meta["training"],
            tensor_inputs=meta["tensor_inputs"],
            state_inputs=[tuple(pair) for pair in meta["state_inputs"]],
            params=params,
            gradient_outputs=gradient_outputs,
            outputs=meta["outputs"],
            output_spec=output_spec,
            output_leaves=[tuple(pair) for pair in meta["output_leaves"]],
        )


# -- the on-disk cache ------------------------------------------------------------------------


def _cache_key_material(module: torch.nn.Module, schema: InputSchema, pipeline: str, opset: int) -> dict:
    """Everything that changes the graph; its hash names the cache entry, and the entry
    keeps it whole to compare on load."""
    import onnx
    import onnxruntime

    import ortpass

    classes = {type(m) for m in module.modules()}
    sources = {}
    for cls in sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        try:  # the forward code decides the graph as much as the structure does
            text = inspect.getsource(cls)
        except (OSError, TypeError):
            text = ""
        sources[f"{cls.__module__}.{cls.__qualname__}"] = hashlib.sha256(text.encode()).hexdigest()
    config = getattr(module, "config", None)
    return {
        "format": _CACHE_FORMAT,
        "structure": repr(module),
        "classes": sources,
        "config": config.to_json_string() if hasattr(config, "to_json_string") else None,
        "parameters": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in module.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in module.named_buffers()],
        "schema": dataclasses.asdict(schema),
        "pipeline": pipeline,
        "opset": opset,
        "versions": {
            "torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "onnx_ir": ir.__version__, "ortpass": ortpass.__version__,
        },
    }  # fmt: skip


def _entry_paths(cache_dir: Path, material: dict) -> tuple[Path, Path]:
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir / f"{digest}.onnx", cache_dir / f"{digest}.json"


def _load_cached(cache_dir: Path, material: dict) -> tuple[ir.Model, dict] | None:
    model_path, meta_path = _entry_paths(cache_dir, material)
    if not (model_path.is_file() and meta_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("key") != json.loads(json.dumps(material)):
            logger.info("ORTModule cache entry %s is for another key; not used", meta_path.name)
            return None
        model = ir.load(model_path)
    except Exception as exc:  # a damaged entry is rebuilt, never trusted
        logger.warning("ORTModule cache entry %s cannot be read (%s); exporting again", model_path, exc)
        return None
    _register_own_functions(model)
    return model, meta["graph"]


def _register_own_functions(model: ir.Model) -> None:
    """A loaded graph may call ortpass's own density Function; nothing else is registered."""
    from ortpass.runtime import bridge

    if any("FlagAndPrintDensity" in name for name in bridge.pythonop_func_names(model)):
        from ortpass.export.density import FlagAndPrintDensity

        bridge.register_function(FlagAndPrintDensity)


def _store_cached(cache_dir: Path, material: dict, model: ir.Model, meta: dict) -> None:
    if meta["output_spec"] is None:
        logger.warning("ORTModule: the output structure cannot be serialized; the graph is not cached")
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    model_path, meta_path = _entry_paths(cache_dir, material)
    # Write to temporary files and rename: another process never reads half an entry.
    for path, write in ((model_path, lambda p: ir.save(model, p)),
                        (meta_path, lambda p: Path(p).write_text(json.dumps({"key": material, "graph": meta})))):  # fmt: skip
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=path.suffix)
        os.close(fd)
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    logger.info("ORTModule cached the graph as %s", model_path.name)

