"""Building ORTModule's graphs: export, the dims proof, the pipeline, the sessions.

:class:`GraphBuilding` is the half of :class:`~ortpass.runtime.module.ORTModule` that turns
a call's input schema into a :class:`BuiltGraph`: export the module as it is (every
submodule in its mode, side effects undone), prove which dims may change
(:mod:`ortpass.runtime.module.dims`), build the training graph with the pipeline where
the call is differentiated, expose BatchNorm statistics, drop the weights' values (they
are fed every step) and open the session the step kind needs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from typing import Any, Literal

import onnx_ir as ir
import torch
import torch.utils._pytree as pytree

from ortpass.errors import OrtpassError, StaticDimsRequired
from ortpass.runtime.module.cache import cache_key_material, load_cached, store_cached
from ortpass.training.python_ops import runs_here
from ortpass.runtime.module.dims import PinnedDims, graph_signature, prove_dynamic_dims
from ortpass.runtime.module.flat import INNER, FlatCall, checkpointing_disabled
from ortpass.runtime.module.graph_state import attach_state, state_to_inputs, strip_state_values
from ortpass.runtime.module.state import (
    BatchNormUpdate,
    BufferCopy,
    export_side_effects_undone,
    expose_batch_norm_statistics,
    running_stat_buffers,
    state_update_from,
)
from ortpass.runtime.module.transitions import InputSchema

__all__ = ["BuiltGraph", "GraphBuilding", "input_names"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class BuiltGraph:
    """One built graph and what running it needs."""

    kind: Literal["loss", "split", "forward"]
    session: Any
    tensor_inputs: list[str | None]  # graph input name per tensor leaf (None: the graph does not read it)
    state_inputs: list[tuple[str, str]]  # (graph input name, parameter or buffer name)
    params: list[str]  # trainable parameter names, in gradient order
    inputs_with_grad: list[int]  # positions of the tensor leaves that get a gradient, in gradient order
    outputs: list[str]  # one graph output per flat output (loss first in a loss step)
    gradient_outputs: list[str]  # loss step: parameters' then inputs' gradients
    differentiated: list[int]  # split step: the flat outputs whose gradients backward takes
    batch_norms: list[BatchNormUpdate | BufferCopy]  # the module state a step updates, from graph outputs
    output_spec: Any  # a TreeSpec
    output_leaves: list[tuple[str, str]]
    report: Any = None  # the pipeline's PassReport (None for a graph loaded from the cache)
    training_model: Any = None  # the training graph, kept where a memory budget is checked at new sizes
    fits_budget: dict = dataclasses.field(default_factory=dict)  # sizes -> within the budget there

    @functools.cached_property
    def written_by_ort(self) -> set[str]:
        """The buffers ORT writes over while it runs (BatchNorm's running statistics, which
        ``BatchNormInternal`` outputs in place of its inputs): fed as copies."""
        return {
            f"{bn.module}.{stat}".lstrip(".")
            for bn in self.batch_norms
            if isinstance(bn, BatchNormUpdate)
            for stat in ("running_mean", "running_var")
        }


class _ForwardSession:
    """A session over a forward-only graph, run on OrtValues like TrainingSession."""

    def __init__(self, model: ir.Model, providers: Any, threads: int | None) -> None:
        from ortpass.runtime.session import open_session

        self._session, _ = open_session(ir.to_proto(model), model, providers, threads=threads)

    def run_with_ort_values(self, feeds, fetch):
        from ortpass.runtime.session import run_with_ort_values

        return run_with_ort_values(self._session, feeds, fetch)


def _graph_input_name(path: str, taken: set[str]) -> str:
    name = re.sub(r"[^0-9A-Za-z_]+", "_", path).strip("_") or "input"
    candidate, n = name, 0
    while candidate in taken:
        n += 1
        candidate = f"{name}_{n}"
    taken.add(candidate)
    return candidate


def _name_outputs(model: ir.Model, has_loss: bool) -> list[str]:
    """Name the graph's outputs ``loss`` (when the first is the loss) and ``output_<k>``."""
    taken = {v.name for n in model.graph for v in n.outputs} | {v.name for v in model.graph.inputs}
    names = []
    for k, value in enumerate(model.graph.outputs):
        wanted = "loss" if has_loss and k == 0 else f"output_{k}"
        if value.name != wanted and wanted not in taken and not value.is_graph_input():
            taken.discard(value.name)
            value.name = wanted
            taken.add(wanted)
        names.append(value.name)
    return names


def input_names(leaves) -> list[str]:
    taken: set[str] = set()
    return [_graph_input_name(name, taken) for name, leaf in leaves if isinstance(leaf, torch.Tensor)]




class GraphBuilding:
    """Graph building for :class:`~ortpass.runtime.module.ORTModule` (a mixin: it reads the
    wrapper's options, ``module``, ``pipeline``, ``opset``... and counts ``graph_builds``)."""

    def _pipeline_notices(self):
        """Where ORTModule chose the pipeline, "recompute(level=1) recomputes nothing" (a
        graph without transformer layers: a CNN, an MLP) is INFO, not a warning the user
        cannot act on; a pipeline the user wrote still warns."""
        from ortpass.passes.recompute import layerwise_notices_at

        return layerwise_notices_at(logging.INFO if getattr(self, "pipeline_is_default", False) else logging.WARNING)

    def _kind(self, schema: InputSchema) -> Literal["train", "forward"]:
        """Training graph for differentiated calls, and for calls whose forward updates
        BatchNorm statistics (the training graph keeps them); a forward graph otherwise."""
        return "train" if schema.differentiable or running_stat_buffers(self.module) else "forward"

    def _build(self, schema: InputSchema, leaves, spec, bound, tensors) -> tuple[BuiltGraph, str, PinnedDims]:
        kind = self._kind(schema)
        key_material = cache_key_material(
            self.module, schema, self.pipeline if kind == "train" else "forward", self.opset, self.fused_attention
        )
        key_material["differentiate"] = self.differentiate
        key_material["builder"] = self.builder_in_use
        if self.cache_dir is not None:
            cached = load_cached(self.cache_dir, key_material)
            if cached is not None:
                model, meta = cached
                pinned = PinnedDims(
                    tuple((tuple(dim), size) for dim, size in meta["pinned"]),
                    tuple(tuple(dim) for dim in meta.get("at_least_two", ())),
                )
                if pinned.accepts(tensors) and runs_here(model):  # Python ops traced by another process: build again
                    return self._graph_from(model, meta), "load", pinned
        static = self._static.setdefault(schema, set())
        while True:
            try:
                model, meta, output_tree = self._export_and_optimize(kind, leaves, spec, bound, tensors, static)
                break
            except OrtpassError as exc:
                needed = self._dims_needed_static(exc, leaves, tensors)
                if not needed or needed <= static:
                    raise
                static |= needed
                logger.info("ORTModule exports again with dims %s static: %s", sorted(needed), exc)
        self.graph_builds += 1
        report = meta.pop("report")
        pinned = PinnedDims.of(meta.pop("pin"), tensors, meta.get("at_least_two", ()))
        meta["pinned"] = [[list(dim), size] for dim, size in pinned.sizes]
        meta["at_least_two"] = [list(dim) for dim in pinned.at_least_two]
        if self.cache_dir is not None:
            store_cached(self.cache_dir, key_material, model, meta)
        return self._graph_from(model, meta, output_tree, report), "export", pinned

    @staticmethod
    def _dims_needed_static(exc: BaseException, leaves, tensors) -> set[tuple[int, int]]:
        """The tensor dims a :class:`StaticDimsRequired` (raised, or the cause of a failed
        pass) names, as (tensor position, axis)."""
        while exc is not None and not isinstance(exc, StaticDimsRequired):
            exc = exc.__cause__
        if exc is None:
            return set()
        names = input_names(leaves)
        by_dim = {f"{name}_dim{axis}": (i, axis) for i, (name, t) in enumerate(zip(names, tensors)) for axis in range(t.dim())}
        return {by_dim[d] for d in exc.dims if d in by_dim}

    def _export(self, flat: FlatCall, names: list[str], tensors: list[torch.Tensor], static: set, kind: str) -> ir.Model:
        """Export ``flat`` at ``tensors`` with the ``static`` dims static and the others
        dynamic, its parameters and buffers graph inputs without values (torch's copy of
        every weight would only be dropped: :func:`attach_state` gives the graph torch's
        own tensors, and the dims proof compares graphs alone); the module's buffers,
        modes and torch's generators are left as they were, and a forward that writes to a
        parameter or buffer (BatchNorm's statistics excepted) is refused."""
        with export_side_effects_undone(self.module) as effects:
            model = self._traced(flat, names, tensors, static, kind)
        allowed = running_stat_buffers(self.module)
        changed = [name for name in effects.changed if name not in allowed]
        if changed:
            raise OrtpassError(
                f"{type(self.module).__name__}.forward updates {changed} in place; ORTModule cannot run a graph "
                "that changes the module's own parameters or buffers (BatchNorm's running statistics excepted)"
            )
        return model

    def _traced(self, flat: FlatCall, names: list[str], tensors: list[torch.Tensor], static: set, kind: str) -> ir.Model:
        from ortpass.export import export

        dynamic = {
            name: {axis: f"{name}_dim{axis}" for axis in range(t.dim()) if (i, axis) not in static}
            for i, (name, t) in enumerate(zip(names, tensors))
        }
        # A leaf requiring grad makes the outputs it reaches require grad in the trace.
        traced = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        train = kind == "train"
        # Grad enabled for a training graph even under the caller's no_grad (a call that only
        # updates BatchNorm statistics): the trace tells which outputs require grad.
        with checkpointing_disabled(self.module, self._notice_checkpointing), torch.set_grad_enabled(train):
            return export(
                flat, tuple(traced), input_names=names, loss_name=None, opset=self.opset, dynamic_axes=dynamic,
                training=None, fused_attention=self.fused_attention, density_threshold=90.0 if train else None,
                inputs_with_grad=[n for n, t in zip(names, tensors) if t.requires_grad and train],
                outputs_with_grad=[],  # decided below from what the trace says requires grad
                weights=False,
            )  # fmt: skip

    def _export_and_optimize(self, kind, leaves, spec, bound, tensors, static) -> tuple[ir.Model, dict, Any]:
        from ortpass.infra.metadata import update_export_info

        names = input_names(leaves)
        flat = FlatCall(self.module, leaves, spec, bound, find_loss=kind == "train" and self.differentiate == "auto")
        named = [*self.module.named_parameters(remove_duplicate=False), *self.module.named_buffers(remove_duplicate=False)]
        state = {f"{INNER}.{n}" for n, _ in named}
        if self.builder_in_use == "torch":  # forward graphs too: no PythonOp, which stock ORT lacks
            return self._built_by_torch(flat, names, tensors, static, state, kind)
        model = self._export(flat, names, tensors, static, kind)
        attach_state(model, {f"{INNER}.{n}": t for n, t in named})
        # Read now: the export at other sizes below traces ``flat`` again.
        output_leaves, output_spec, output_tree = flat.output_leaves, flat.output_spec, flat.output_tree
        has_loss = any(k == "loss" for _, k in output_leaves)
        outputs = _name_outputs(model, has_loss)
        if kind == "train":
            differentiated = [o for o, needs in zip(outputs, flat.requires_grad) if needs]
            if not has_loss and not differentiated:
                raise OrtpassError(
                    f"no output of {type(self.module).__name__} requires grad: nothing for backward to differentiate"
                )
            update_export_info(
                model, loss=outputs[0] if has_loss else None, outputs_with_grad=None if has_loss else differentiated
            )
        pin = self._pins(flat, names, tensors, static, kind, model, state)  # attach_state made the state inputs
        batch_norms: list[BatchNormUpdate] = []
        report = None
        if kind == "train":
            import ortpass

            with self._pipeline_notices():
                result = ortpass.pipeline(self.pipeline)(model)
            model, report = result.model, result.report
            batch_norms = expose_batch_norm_statistics(model, self.module, f"{INNER}.")
        stripped = strip_state_values(model, state)
        graph_inputs = {v.name for v in model.graph.inputs}
        meta = {
            "kind": "forward" if kind != "train" else ("loss" if has_loss else "split"),
            "tensor_inputs": [n if n in graph_inputs else None for n in names],
            "inputs_with_grad": [i for i, t in enumerate(tensors) if t.requires_grad and kind == "train"],
            "state_inputs": [[n, n.removeprefix(f"{INNER}.")] for n in stripped if n in graph_inputs],
            "outputs": outputs,
            "batch_norms": [bn.to_list() for bn in batch_norms],
            "output_spec": output_spec,
            "output_leaves": output_leaves,
            "pin": pin,
            "report": report,
        }
        return model, meta, output_tree

    def _built_by_torch(
        self, flat: FlatCall, names, tensors, static, state: set[str], kind: str = "train"
    ) -> tuple[ir.Model, dict, Any]:
        """The training graph from torch's autograd (:mod:`ortpass.training.from_torch`), then
        the pipeline's post-grad passes; or, for a call without gradient, the forward graph
        (:mod:`ortpass.training.forward_from_torch`).  torch.export proves the dims it leaves
        symbolic dynamic, from size 2 on; the others are pinned."""
        import ortpass
        from ortpass.infra.pipeline_text import passes_of_phase
        from ortpass.training.forward_from_torch import build_forward_graph_from_torch
        from ortpass.training.from_torch import buffer_updates, build_training_graph_from_torch

        dynamic = {n: [a for a in range(t.dim()) if (i, a) not in static] for i, (n, t) in enumerate(zip(names, tensors))}
        traced = [t.detach().requires_grad_(t.requires_grad) for t in tensors]

        def found_loss() -> bool:  # FlatCall puts a loss it finds first (known once it ran)
            return any(kind == "loss" for _, kind in flat.output_leaves)

        with export_side_effects_undone(self.module), checkpointing_disabled(self.module, self._notice_checkpointing):
            if kind == "train":
                model = build_training_graph_from_torch(
                    flat, traced, input_names=names, dynamic_axes=dynamic, loss=lambda _: 0 if found_loss() else None,
                    fused_attention=self.fused_attention is True,  # a Python op on stock (ortpass.training.stock_attention)
                )
            else:
                model = build_forward_graph_from_torch(flat, traced, input_names=names, dynamic_axes=dynamic)
        updates = [BufferCopy(buffer.removeprefix(f"{INNER}."), output) for output, buffer in buffer_updates(model).items()]
        has_loss = found_loss()
        outputs = [v.name for v in model.graph.outputs[: len(flat.requires_grad)]]
        post_grad = passes_of_phase(self.pipeline, "post-grad") if kind == "train" else None
        report = None
        if post_grad:
            with self._pipeline_notices():
                result = ortpass.pipeline(post_grad, assume=["training-graph"])(model)
            model, report = result.model, result.report
        state_to_inputs(model, state)
        stripped = strip_state_values(model, state)
        graph_inputs = {v.name: v for v in model.graph.inputs}
        symbolic = {(i, a) for i, n in enumerate(names) if n in graph_inputs
                    for a, d in enumerate(graph_inputs[n].shape or ()) if not isinstance(d, int)}  # fmt: skip
        all_dims = {(i, a) for i, t in enumerate(tensors) for a in range(t.dim())}
        meta = {
            "kind": "forward" if kind != "train" else "loss" if has_loss else "split",
            "tensor_inputs": [n if n in graph_inputs else None for n in names],
            "inputs_with_grad": [i for i, t in enumerate(tensors) if t.requires_grad and kind == "train"],
            "state_inputs": [[n, n.removeprefix(f"{INNER}.")] for n in stripped if n in graph_inputs],
            "outputs": outputs,
            "batch_norms": [update.to_list() for update in updates],
            "output_spec": flat.output_spec,
            "output_leaves": flat.output_leaves,
            "pin": sorted(all_dims - symbolic),
            "at_least_two": sorted(symbolic),
            "report": report,
        }
        return model, meta, flat.output_tree

    def _pins(self, flat, names, tensors, static, kind, model: ir.Model, state: set[str]) -> set[tuple[int, int]]:
        """The dims this graph is pinned in: those exported static, and those a second
        export at other sizes does not prove dynamic (:mod:`ortpass.runtime.module.dims`)."""
        reference = graph_signature(model, state)

        def signature_at(changed: list[torch.Tensor]) -> list | None:
            try:
                return graph_signature(self._export(flat, names, changed, static, kind), state)
            except Exception as exc:  # any failure of that export leaves the dims unproven
                logger.debug("ORTModule: the export at other sizes failed: %s", exc)
                return None

        pins = prove_dynamic_dims(tensors, static, signature_at, reference)
        return sorted(pins)

    def _graph_from(self, model: ir.Model, meta: dict, output_tree: Any = None, report: Any = None) -> BuiltGraph:
        from ortpass.runtime.session import TrainingSession
        from ortpass.runtime.split_session import SplitTrainingSession

        output_spec = output_tree if output_tree is not None else pytree.treespec_loads(meta["output_spec"])
        kind = meta["kind"]
        params, gradient_outputs, differentiated = [], [], []
        if kind == "loss":
            session = TrainingSession(model, self.providers, threads=self.threads)
            params = [p.removeprefix(f"{INNER}.") for p in session.info.params]
            inputs = [meta["tensor_inputs"][i] for i in meta["inputs_with_grad"]]
            gradient_outputs = [*session.info.gradients.values(), *(session.info.input_gradients[n] for n in inputs)]
        elif kind == "split":
            session = SplitTrainingSession(model, self.providers, threads=self.threads)
            params = [p.removeprefix(f"{INNER}.") for p in session.info.params]
            differentiated = [k for k, name in enumerate(meta["outputs"]) if name in session.seeds]
        else:
            session = _ForwardSession(model, self.providers, self.threads)
        return BuiltGraph(
            kind=kind,
            session=session,
            tensor_inputs=meta["tensor_inputs"],
            state_inputs=[tuple(pair) for pair in meta["state_inputs"]],
            params=params,
            inputs_with_grad=list(meta["inputs_with_grad"]),
            outputs=meta["outputs"],
            gradient_outputs=gradient_outputs,
            differentiated=differentiated,
            batch_norms=[state_update_from(entry) for entry in meta["batch_norms"]],
            output_spec=output_spec,
            output_leaves=[tuple(pair) for pair in meta["output_leaves"]],
            report=report,
            training_model=model if kind != "forward" and self.budget_fit is not None else None,
        )


