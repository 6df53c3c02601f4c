"""``ORTModule``: train a ``torch.nn.Module`` on ONNX Runtime with the optimized training graph.

``model = ORTModule(model)`` keeps the training loop: the module's own loss
(``loss = model(ids, labels)``) or one computed in torch from its outputs
(``loss = F.cross_entropy(model(x), y)``), then ``loss.backward()``, which hands each
trainable parameter (and each input that requires grad) its gradient through torch's own
accumulation and hooks, so optimizers, clipping, schedulers and gradient accumulation work
unchanged.  The contract: a call gives what torch eager gives, or it is refused with the
reason (or, with ``fallback="torch"``, run by torch with one warning naming the reason).

How a call runs (and what that means):

- **The graph a call runs** is chosen by :class:`GraphTransitionManager` from the input
  schema (tensor dtypes, ranks and which require grad; the values of non-tensor
  arguments; their nesting; the trainable parameters; every submodule's ``training``
  flag; whether the call is differentiated) and from the dims a graph is pinned in
  (:mod:`ortpass.runtime.module.dims`): a graph runs at other batch sizes and sequence
  lengths only where a second export proved those dims dynamic.
- **Differentiated calls** (grad enabled and something requires grad, whatever the
  mode) run a training graph exported with every submodule in the mode it is in.  Where
  the module returns its loss the graph is one forward+backward step computed in forward;
  otherwise forward and backward run apart, torch's autograd in between
  (:mod:`ortpass.runtime.module.steps`).  Other calls run a forward-only graph.
- **BatchNorm** in training mode updates ``running_mean``, ``running_var`` and
  ``num_batches_tracked`` as torch does (:mod:`ortpass.runtime.module.state`); an export
  changes no buffer, no mode and no random generator.
- Parameters, buffers and batch tensors reach ORT as OrtValues over torch's memory
  (DLPack); ORT's outputs come back to torch the same way.  The session holds no copy of
  the weights: parameters and buffers are graph inputs without initializer values.
- ``torch.utils.checkpoint`` (and transformers' gradient checkpointing) is a plain call
  while exporting: graph recompute replaces it.

Refused, each with an error naming what is at fault: a module wrapped in
``DistributedDataParallel`` (wrap the other way round), autocast, arguments the exporter
cannot see, forwards that update parameters or buffers in place other than BatchNorm's
statistics, and outputs that are not tensors.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
import torch.utils._pytree as pytree

from ortpass.errors import OrtpassError
from ortpass.runtime.module.budget import BudgetFit
from ortpass.runtime.module.distributed import check_sharding
from ortpass.runtime.module.facade import ModelFacade, model_signature
from ortpass.runtime.module.graphs import BuiltGraph, GraphBuilding
from ortpass.runtime.module.steps import LossRun, LossStep, SplitHead, SplitRun, SplitStep, to_ortvalue, to_torch
from ortpass.runtime.module.transitions import (
    GraphTransitionManager,
    InputSchema,
    bind_arguments,
    flatten_arguments,
    input_schema,
)

__all__ = ["GraphTransitionManager", "InputSchema", "LossStep", "ORTModule", "SplitStep", "to_ortvalue"]

logger = logging.getLogger(__name__)

#: Wrappers that run their own logic around every forward: exported once, it would run once.
_REFUSED_WRAPPERS = {
    "DistributedDataParallel": "DDP(ORTModule(model)): DDP then all-reduces the gradients ORTModule hands torch",
    "DataParallel": "ORTModule(model) on one device, with DistributedDataParallel around it for several",
    "FullyShardedDataParallel": "FSDP(ORTModule(model), use_orig_params=True)",
    "FSDPModule": "fully_shard(ORTModule(model)) (FSDP2)",
}


# -- the wrapper ------------------------------------------------------------------------------


class ORTModule(ModelFacade, GraphBuilding, torch.nn.Module):
    """Drop-in wrapper: ``model = ORTModule(model)``; then train as in torch.

    Args:
        module: the module to run on ORT.  Its forward may return its loss (a scalar, or
            a structure with a ``loss`` field: a transformers ``ModelOutput``), or outputs
            from which the loop computes the loss in torch.
        pipeline: the ortpass pipeline spec for training graphs (default: the one
            ``ortpass optimize`` runs, recompute level 1 included, without
            ``expand-fast-gelu-grad`` and ``transposed-gemm-as-matmul`` where ``providers``
            name CUDA: they replace a slow CPU kernel and a slow CPU product); it must build the training graph (``build-training-graph``).
        cache_dir: where built graphs are kept, keyed on the module's structure and
            parameter names/shapes, the input schema, the pipeline and the versions of
            torch, onnx, onnxruntime and ortpass, and a digest of ortpass's own source;
            another process loads instead of exporting.
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
            On the torch builder (stock), ``True`` makes the calls without dropout one Python
            op running torch's kernels (``ortpass.training.stock_attention``); ``"auto"``
            keeps them decomposed there.
        differentiate: ``"auto"``: where the module returns a loss, the step
            differentiates that loss only, in one graph (a gradient reaching another output
            raises); otherwise every output that requires grad.  ``"outputs"``: every
            output that requires grad, always (a loss and its logits both in the loop's
            loss, as in distillation).
        builder: who builds the training graph.  ``"ort"``: ONNX Runtime's gradient
            builder, on the TorchScript export (needs ``onnxruntime-training``; every
            pass of the pipeline runs, PythonOps and fused attention included).
            ``"torch"``: torch's autograd on a ``torch.export`` trace
            (:func:`ortpass.training.build_training_graph_from_torch`), in standard ONNX
            ops that stock ``onnxruntime`` runs; the pipeline's post-grad passes run on it,
            its pre-grad passes do not.  Default ``"auto"``: ``"ort"`` where the installed
            onnxruntime is the training build, else ``"torch"``.
        fallback: ``"raise"`` (default): a module ORTModule cannot export or differentiate
            raises, naming why.  ``"torch"``: such a call runs the module in torch instead,
            with one warning per input schema naming the cause.
        memory_budget: recompute what brings the step's peak under this budget at the
            least added time, instead of the pipeline's recompute level: bytes (an int,
            or a string such as ``"6GiB"``; the peak above the weights and the batch) or
            a fraction between recomputing every candidate (0.0) and nothing (1.0).
            Planned at the dims of the batch a graph is built for
            (:func:`ortpass.analysis.recompute.budget.plan_for_budget`); with bytes, a
            batch at which that graph would go over the budget gets a graph planned at its
            sizes (:mod:`ortpass.runtime.module.budget`).  A budget no recompute reaches
            raises, naming the lowest peak it can reach.

    The wrapper presents itself as the module it wraps (:mod:`ortpass.runtime.module.facade`):
    its attributes (``config``, ``save_pretrained``, ``generate``...), its class to
    ``isinstance``, its ``forward`` signature, and ``state_dict()`` keys as the module's own
    (``load_state_dict`` also takes ``module.``-prefixed ones); the wrapped module is
    ``.module``.  ``graph_builds`` counts the graphs built (exported and optimized) in this
    process.  Copies
    (``copy.deepcopy``, pickling, ``torch.save``) carry the module, not the sessions: a
    copy builds its own graphs on its first call.
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
        differentiate: Literal["auto", "outputs"] = "auto",
        builder: Literal["auto", "ort", "torch"] = "auto",
        fallback: Literal["raise", "torch"] = "raise",
        memory_budget: int | float | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise OrtpassError(f"ORTModule wraps a torch.nn.Module, got {type(module).__name__}")
        _refuse_wrappers(module)
        from ortpass.export.torchscript import check_fused_attention

        check_fused_attention(fused_attention)  # refused when wrapping, not at the first step
        if differentiate not in ("auto", "outputs"):
            raise OrtpassError(f"differentiate must be 'auto' or 'outputs', not {differentiate!r}")
        if fallback not in ("raise", "torch"):
            raise OrtpassError(f"fallback must be 'raise' or 'torch', not {fallback!r}")
        if builder not in ("auto", "ort", "torch"):
            raise OrtpassError(f"builder must be 'auto', 'ort' or 'torch', not {builder!r}")
        if builder == "auto":
            from ortpass.training.backend import has_training_ops

            builder = "ort" if has_training_ops() else "torch"
        if builder == "torch" and fused_attention is True and not _extensions_available():
            raise OrtpassError(
                "fused_attention=True on the torch builder runs attention as a Python op, which stock onnxruntime runs "
                "only through onnxruntime-extensions: pip install onnxruntime-extensions (or use ORT's builder)"
            )
        # A pipeline the user did not write: its recompute level was not their choice either,
        # so a graph without transformer layers says "recomputes nothing" at INFO only.
        self.pipeline_is_default = pipeline is None
        if pipeline is None:
            from ortpass.passes import DEFAULT_PIPELINE

            pipeline = DEFAULT_PIPELINE
            if _names_cuda(providers):
                from ortpass.infra.pipeline_text import without_passes

                # ORT's CUDA kernel is one fused kernel; cuBLAS reads a transposed operand as it is
                pipeline = without_passes(pipeline, {"expand-fast-gelu-grad", "transposed-gemm-as-matmul"})
        self.budget_fit: BudgetFit | None = None
        if memory_budget is not None:
            from ortpass.analysis.recompute.budget import parse_budget
            from ortpass.infra.pipeline_text import with_memory_budget

            kind, amount = parse_budget(memory_budget)  # refused when wrapping, not at the first step
            pipeline = with_memory_budget(pipeline, memory_budget)
            self.budget_fit = BudgetFit(int(amount)) if kind == "bytes" else None
        self.module = module
        self._register_state_hooks()
        self.pipeline = pipeline
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.providers = providers
        self.threads = threads
        self.opset = opset
        self.fused_attention = fused_attention
        self.differentiate = differentiate
        self.fallback = fallback
        self.builder_in_use = builder
        self.graph_builds = 0
        self.transitions = GraphTransitionManager()
        self._noticed_checkpointing = False
        self._in_torch: dict[InputSchema, str] = {}  # schemas that fell back, and why
        self._said: set[str] = set()  # fallback causes already warned about
        self._static: dict[InputSchema, set[tuple[int, int]]] = {}  # dims ORT needs static, learned

    # -- copies: the module travels, the sessions do not ---------------------------------------

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["transitions"] = GraphTransitionManager()
        state["_in_torch"], state["_static"], state["_said"] = {}, {}, set()
        return state

    # -- calls --------------------------------------------------------------------------------

    @model_signature  # inspect.signature(model.forward) is the wrapped module's
    @torch.compiler.disable(recursive=True)  # ORT runs outside any compiled graph: a graph break
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = bind_arguments(self.module, args, kwargs)
        schema = None
        try:
            check_sharding(self)  # FSDP around the wrapper adapted, inside it refused (distributed.py)
            leaves, spec = flatten_arguments(self.module, bound)
            tensors = [leaf for _, leaf in leaves if isinstance(leaf, torch.Tensor)]
            names = [name for name, leaf in leaves if isinstance(leaf, torch.Tensor)]
            # Autocast is this call's context, not its schema's: refused before the schema is
            # known, so a fallback for it does not send later calls of the schema to torch.
            _refuse_autocast(self.module, tensors)
            schema = input_schema(self.module, leaves, spec)
            if schema in self._in_torch:
                return self.module(*args, **kwargs)
            graph = self.transitions.graph_for(
                schema, tensors, names, lambda s: self._build(s, leaves, spec, bound, tensors), self.budget_fit
            )
        except OrtpassError as exc:
            if self.fallback != "torch":
                raise
            self._fall_back(schema, exc)
            return self.module(*args, **kwargs)
        return self._run(graph, tensors)

    def _run(self, graph: BuiltGraph, tensors: list[torch.Tensor]) -> Any:
        feeds = {name: to_ortvalue(t) for name, t in zip(graph.tensor_inputs, tensors) if name is not None}
        state = dict(self.module.named_parameters(remove_duplicate=False))  # a tied weight by either name
        state.update(self.module.named_buffers(remove_duplicate=False))
        written = graph.written_by_ort
        for graph_name, state_name in graph.state_inputs:
            tensor = state[state_name]
            # ORT's BatchNormInternal writes its running-statistics outputs over those
            # inputs (an alias); torch's buffers are updated by BatchNormUpdate instead.
            feeds[graph_name] = to_ortvalue(tensor.clone() if state_name in written else tensor)
        if graph.kind == "forward":
            with torch.no_grad():
                outputs = [to_torch(v) for v in graph.session.run_with_ort_values(feeds, graph.outputs)]
            return self._unflatten(graph, outputs)
        differentiable = [state[name] for name in graph.params] + [tensors[i] for i in graph.inputs_with_grad]
        names = list(graph.params) + [f"input {graph.tensor_inputs[i]}" for i in graph.inputs_with_grad]
        if graph.kind == "loss":
            outputs = LossStep.apply(LossRun(self, graph, feeds), names, *differentiable)
        else:
            run = SplitRun(self, graph, feeds)
            outputs = SplitHead.apply(run, SplitStep.apply(run, names, *differentiable))
        return self._unflatten(graph, outputs)

    def _update_batch_norms(self, graph: BuiltGraph, statistics: list[torch.Tensor]) -> None:
        start = 0
        for bn in graph.batch_norms:
            count = len(bn.outputs())
            bn.apply(self.module, *statistics[start : start + count])
            start += count

    @staticmethod
    def _unflatten(graph: BuiltGraph, outputs: Sequence[torch.Tensor]) -> Any:
        """The module's output structure from the flat outputs (the loss first, if any)."""
        has_loss = graph.kind == "loss"
        rest = iter(outputs[1:] if has_loss else outputs)
        values = [
            outputs[0] if kind == "loss" else None if kind == "none" else next(rest) for _, kind in graph.output_leaves
        ]
        return pytree.tree_unflatten(values, graph.output_spec)

    def _fall_back(self, schema: InputSchema | None, exc: OrtpassError) -> None:
        """Warn once per cause; a schema that could not be built (``schema`` given) runs in
        torch from now on, a call refused for its own context (``None``) only this once."""
        cause = f"{type(exc).__name__}: {exc}"
        if schema is not None:
            self._in_torch[schema] = cause  # later calls of this schema go to torch directly
        if cause in self._said:
            return
        self._said.add(cause)
        self.transitions.record("fallback", cause)
        message = f"ORTModule runs {type(self.module).__name__} in torch for these inputs (fallback='torch'): {cause}"
        logger.warning(message)
        warnings.warn(message, stacklevel=_user_stack_level())

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


def _refuse_wrappers(module: torch.nn.Module) -> None:
    for cls in type(module).__mro__:
        way = _REFUSED_WRAPPERS.get(cls.__name__)
        if way is not None and cls.__module__.startswith("torch."):
            raise OrtpassError(
                f"ORTModule cannot wrap {cls.__name__}: the export would run its forward once, so what it does "
                f"around every call (its communication every step) would happen once; wrap the other way round: {way}"
            )


def _refuse_autocast(module: torch.nn.Module, tensors: list[torch.Tensor]) -> None:
    """Refuse a call under autocast, naming only ways out that run on ORT's CPU kernels:
    a bfloat16 model has no CPU ``Gemm``, and ORT's builder binds the fused loss gradient to
    float32, so a float16 model trains there with its loss computed in torch."""
    devices = {t.device.type for t in tensors} | {p.device.type for p in module.parameters()}
    enabled = sorted(d for d in devices if d in ("cpu", "cuda") and torch.is_autocast_enabled(d))
    if enabled:
        raise OrtpassError(
            f"ORTModule does not run under torch.autocast (enabled for {enabled}): the graph would run in the "
            "parameters' dtype and ignore it; call the module outside autocast, or, to train in float16, convert "
            "the model (model.half()) before wrapping it and compute the loss in torch from its outputs"
        )


def _user_stack_level() -> int:
    """The ``stacklevel`` that makes a warning of :meth:`ORTModule._fall_back` point at the
    user's call (the first frame outside ortpass and torch: ``forward`` is wrapped by
    torch's compiler-disable and called through ``nn.Module.__call__``)."""
    import sys

    inside = (str(Path(torch.__file__).parent), str(Path(__file__).parents[2]))
    level, frame = 1, sys._getframe(1)  # 1: the frame that calls warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        level, frame = level + 1, frame.f_back
    return level


def _names_cuda(providers: Any) -> bool:
    """Whether ``providers`` (as :class:`~ortpass.runtime.TrainingSession` takes them) run on CUDA."""
    if providers is None or isinstance(providers, str):
        return providers == "cuda"
    return "CUDAExecutionProvider" in list(providers)


def _extensions_available() -> bool:
    from ortpass.training.python_ops import extensions_available

    return extensions_available()
