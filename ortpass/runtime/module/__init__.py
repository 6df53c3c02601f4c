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

import dataclasses
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import onnx_ir as ir
import torch
import torch.utils._pytree as pytree

from ortpass.errors import OrtpassError
from ortpass.runtime.module.cache import cache_key_material, load_cached, store_cached
from ortpass.runtime.module.flat import INNER, FlatCall, checkpointing_disabled
from ortpass.runtime.module.transitions import (
    GraphTransitionManager,
    InputSchema,
    bind_arguments,
    flatten_arguments,
    input_schema,
)

__all__ = ["GraphTransitionManager", "InputSchema", "ORTModule"]

logger = logging.getLogger(__name__)


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

    def __init__(self, model: ir.Model, providers: Any, threads: int | None) -> None:
        import onnxruntime as ort

        from ortpass.runtime.session import _resolve_providers
        from ortpass.training.build import clamp_for_ort

        proto = ir.to_proto(model)
        clamp_for_ort(proto)
        if any(n.op_type == "PythonOp" for n in proto.graph.node):
            from ortpass.pythonop import bridge

            bridge.prepare(model)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if threads is not None:
            options.intra_op_num_threads = threads
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
        threads: ORT's intra-op threads (default: ORT's); 1 makes steps bitwise
            reproducible (CPU ``GatherGrad`` sums in thread order otherwise).
        opset: the ai.onnx opset of the export.
        fused_attention: export ``scaled_dot_product_attention`` as one recomputable PythonOp
            running torch's kernel (``ortpass.export.export(fused_attention=True)``): no
            seq x seq tensor is kept between forward and backward.  Default ``"auto"``: the
            calls without attention dropout (LLaMA-like models), where it is faster as well
            as smaller, and calls with dropout whose attention at the first batch is large
            (``AUTO_DROPOUT_BYTES``); the others export decomposed (README, "Fused attention").

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
        threads: int | None = None,
        opset: int = 17,
        fused_attention: bool | Literal["auto"] = "auto",
    ) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise OrtpassError(f"ORTModule wraps a torch.nn.Module, got {type(module).__name__}")
        from ortpass.export.torchscript import check_fused_attention

        check_fused_attention(fused_attention)  # refused when wrapping, not at the first step
        if pipeline is None:
            from ortpass.passes import DEFAULT_PIPELINE

            pipeline = DEFAULT_PIPELINE
        self.module = module
        self.pipeline = pipeline
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.providers = providers
        self.threads = threads
        self.opset = opset
        self.fused_attention = fused_attention
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
        key_material = cache_key_material(
            self.module, schema, self.pipeline if schema.training else "eval", self.opset, self.fused_attention
        )
        cached = load_cached(self.cache_dir, key_material) if self.cache_dir is not None else None
        if cached is not None:
            model, meta = cached
            return self._graph_from(model, meta), "load"
        model, meta, output_tree = self._export_and_optimize(schema, leaves, spec, bound)
        if self.cache_dir is not None:
            store_cached(self.cache_dir, key_material, model, meta)
        return self._graph_from(model, meta, output_tree), "export"

    def _export_and_optimize(self, schema: InputSchema, leaves, spec, bound) -> tuple[ir.Model, dict, Any]:
        from ortpass.export import export

        flat = FlatCall(self.module, leaves, spec, bound)
        taken: set[str] = set()
        names = [_graph_input_name(name, taken) for name, leaf in leaves if isinstance(leaf, torch.Tensor)]
        tensors = [leaf for _, leaf in leaves if isinstance(leaf, torch.Tensor)]
        dynamic = {name: {axis: f"{name}_dim{axis}" for axis in range(t.dim())} for name, t in zip(names, tensors)}
        named = [*self.module.named_parameters(remove_duplicate=False), *self.module.named_buffers(remove_duplicate=False)]
        state = {f"{INNER}.{n}": t for n, t in named}
        versions = {name: t._version for name, t in state.items()}
        with checkpointing_disabled(self.module, self._notice_checkpointing):
            model = export(
                flat, tuple(tensors), input_names=names, loss_name="loss" if schema.training else "output_0",
                opset=self.opset, dynamic_axes=dynamic, training=schema.training,
                fused_attention=self.fused_attention,
            )  # fmt: skip
        changed = [name.removeprefix(f"{INNER}.") for name, t in state.items() if t._version != versions[name]]
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
            "state_inputs": [[n, n.removeprefix(f"{INNER}.")] for n in stripped if n in graph_inputs],
            "outputs": outputs,
            "output_spec": flat.output_spec,
            "output_leaves": flat.output_leaves,
        }
        return model, meta, flat.output_tree

    def _graph_from(self, model: ir.Model, meta: dict, output_tree: Any = None) -> _Graph:
        from ortpass.runtime.session import TrainingSession

        output_spec = output_tree if output_tree is not None else pytree.treespec_loads(meta["output_spec"])
        if meta["training"]:
            session = TrainingSession(model, self.providers, threads=self.threads)
            prefix = f"{INNER}."
            params = [p.removeprefix(prefix) for p in session.info.params]
            gradient_outputs = list(session.info.gradients.values())
        else:
            session, params, gradient_outputs = _ForwardSession(model, self.providers, self.threads), [], []
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
