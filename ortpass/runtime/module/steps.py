"""How a differentiated call runs on ORT and hands its gradients to torch's autograd.

Two kinds of step, chosen when the graph is built:

- :class:`LossStep`, where the module returns its loss: one forward+backward graph runs
  in forward, so **gradients are computed during forward** and wait in the Function's
  context for ``backward()``, which scales them by the loss's incoming gradient
  (``loss / 4`` for accumulation gives 0.25) and returns them to torch.  Every node runs
  in one ORT run, so ORT frees each activation at its last reader in backward.  The
  other outputs (logits) are returned as torch returns them, differentiable; a gradient
  that reaches one of them raises: this graph differentiates the loss only.
- :class:`SplitStep`, where the loss is computed outside (or ``differentiate="outputs"``):
  the graph's forward half runs in forward and returns the outputs and the stashed
  activations; ``backward()`` feeds the outputs' gradients (zeros for an output that got
  none) and the stash to the backward half (:class:`~ortpass.runtime.SplitTrainingSession`).

Both return gradients for the trainable parameters and for inputs that require grad.
Each checks in backward that no parameter or input it read was changed in place since
forward, as torch's own saved tensors do: backward would read the new values.
"""

from __future__ import annotations

import weakref

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ortpass.errors import OrtpassError
from ortpass.runtime.module.flat import INNER
from ortpass.runtime.ort_values import from_dlpack_takes_is_bool

if TYPE_CHECKING:
    from ortpass.runtime.module.graphs import BuiltGraph

__all__ = ["LossRun", "LossStep", "SplitHead", "SplitRun", "SplitStep", "check_unchanged", "to_ortvalue", "to_torch"]


def check_unchanged(tensors: Sequence[torch.Tensor], versions: Sequence[int], names: Sequence[str]) -> None:
    changed = [name for t, v, name in zip(tensors, versions, names) if t._version != v]
    if changed:
        raise RuntimeError(
            f"ORTModule: {changed} were modified by an inplace operation after forward; backward would read the "
            "new values (torch raises the same for its saved tensors)"
        )


class LossStep(torch.autograd.Function):
    """Forward runs the whole ORT step; backward returns the gradients it kept."""

    @staticmethod
    def forward(ctx, run: Callable[[], tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]], names, *inputs):
        loss, gradients, others = run()
        ctx.gradients, ctx.names, ctx.other_names = gradients, names, run.other_names
        ctx.inputs, ctx.versions = inputs, [t._version for t in inputs]
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(o for o in others if not o.is_floating_point()))
        return (loss, *others)

    @staticmethod
    def backward(ctx, grad_loss, *grad_others):
        reached = [name for name, g in zip(ctx.other_names, grad_others) if g is not None]
        if reached:
            raise OrtpassError(
                f"ORTModule: a gradient reached output {reached[0]}, but this module returns its loss and the step "
                "differentiates the loss only; wrap it as ORTModule(model, differentiate='outputs') to "
                "differentiate every output"
            )
        gradients, ctx.gradients = ctx.gradients, None
        if gradients is None:
            raise RuntimeError("ORTModule: backward through the same step twice; the gradients were handed over")
        check_unchanged(ctx.inputs, ctx.versions, ctx.names)
        if grad_loss is None:
            return (None, None, *(None for _ in gradients))
        if grad_loss.numel() == 1 and float(grad_loss) == 1.0:
            return (None, None, *gradients)  # ORT's tensors become .grad as they are
        return (None, None, *(g * grad_loss.to(g.dtype) for g in gradients))


class SplitStep(torch.autograd.Function):
    """Forward runs the graph's forward half; backward runs the body of its backward half.

    It returns a *carrier* (an empty tensor) that only :class:`SplitHead` reads: the outputs
    come from that second node, so their gradients reach the head of backward, which runs
    first and hands this node the gradients of the hidden values.  torch frees the outputs'
    gradients (a language model's logits gradient) once the head returned, instead of
    holding them while every layer's backward runs (:mod:`ortpass.training.backward_head`)."""

    @staticmethod
    def forward(ctx, run: Any, names, *inputs):
        run.outputs, ctx.stash = run.forward()
        ctx.run, ctx.names = run, names
        ctx.inputs, ctx.versions = inputs, [t._version for t in inputs]
        ctx.set_materialize_grads(False)
        return torch.empty(0)

    @staticmethod
    def backward(ctx, _carrier):
        stash, ctx.stash = ctx.stash, None
        if stash is None:
            raise RuntimeError("ORTModule: backward through the same step twice; its activations were freed")
        head, ctx.run.head = ctx.run.head, None
        if head is None:  # no output got a gradient
            return (None, None, *(None for _ in ctx.inputs))
        check_unchanged(ctx.inputs, ctx.versions, ctx.names)
        return (None, None, *ctx.run.backward_body(stash, head))


class SplitHead(torch.autograd.Function):
    """The outputs of a :class:`SplitStep`; backward runs the head of the backward half."""

    @staticmethod
    def forward(ctx, run: Any, carrier: torch.Tensor):
        outputs, run.head = run.outputs, None
        run.outputs = None
        ctx.run = run
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in outputs]
        ctx.set_materialize_grads(False)
        differentiated = set(run.differentiated)
        ctx.mark_non_differentiable(*(o for i, o in enumerate(outputs) if i not in differentiated))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        run = ctx.run
        grads = [grad_outputs[i] for i in run.differentiated]
        if all(g is None for g in grads):
            return None, None
        if run.stash_freed():
            raise RuntimeError("ORTModule: backward through the same step twice; its activations were freed")
        seeds = [
            g if g is not None else torch.zeros(ctx.shapes[i][0], dtype=ctx.shapes[i][1], device=ctx.shapes[i][2])
            for g, i in zip(grads, run.differentiated)
        ]
        run.head = run.backward_head(seeds)
        return None, torch.empty(0)


# -- the ORT work each step does ----------------------------------------------------------------


def to_ortvalue(t: torch.Tensor):
    """A C-level OrtValue over ``t``'s memory (DLPack; bools as
    :func:`~ortpass.runtime.ort_values.from_dlpack_takes_is_bool` says)."""
    from onnxruntime.capi import _pybind_state as C

    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if from_dlpack_takes_is_bool():
        is_bool = t.dtype == torch.bool
        return C.OrtValue.from_dlpack(torch.utils.dlpack.to_dlpack(t.view(torch.uint8) if is_bool else t), is_bool)
    return C.OrtValue.from_dlpack(torch.utils.dlpack.to_dlpack(t))


def to_torch(value) -> torch.Tensor:
    tensor = torch.utils.dlpack.from_dlpack(value.to_dlpack())
    if value.data_type() == "tensor(bool)" and tensor.dtype != torch.bool:
        tensor = tensor.view(torch.bool)
    return tensor


class LossRun:
    """The ORT work of one loss step, called by :class:`LossStep` in forward."""

    def __init__(self, module: Any, graph: BuiltGraph, feeds: dict) -> None:
        self.module, self.graph, self.feeds = module, graph, feeds
        self.other_names = [name for name, kind in graph.output_leaves if kind == "tensor"]

    def __call__(self):
        graph = self.graph
        statistics = [name for bn in graph.batch_norms for name in bn.outputs()]
        values = graph.session.run_with_ort_values(self.feeds, graph.outputs + graph.gradient_outputs + statistics)
        values = [to_torch(v) for v in values]
        n, g = len(graph.outputs), len(graph.gradient_outputs)
        self.module._update_batch_norms(graph, values[n + g :])
        return values[0], values[n : n + g], values[1:n]


class SplitRun:
    """The ORT work of one split step: forward half now, backward half in ``backward()``."""

    def __init__(self, module: Any, graph: BuiltGraph, feeds: dict) -> None:
        self.module, self.graph, self.feeds = module, graph, feeds
        self.differentiated = graph.differentiated
        self.outputs = None  # forward's outputs, from SplitStep to SplitHead
        self.head = None  # the head of backward's values, from SplitHead to SplitStep
        self._stash: list | None = None

    def forward(self):
        session = self.graph.session
        outputs, self._stash = session.run_forward(self.feeds)
        if session.context_positions:
            self._release_contexts_if_dropped([self._stash[i] for i in session.context_positions])
        by_name = dict(zip(session.outputs, (to_torch(v) for v in outputs)))
        self.module._update_batch_norms(
            self.graph, [by_name[n] for bn in self.graph.batch_norms for n in bn.outputs()]
        )
        return [by_name[name] for name in self.graph.outputs], self._stash

    def stash_freed(self) -> bool:
        return self._stash is None

    def _release_contexts_if_dropped(self, handles: list) -> None:
        """The Python ops' forward contexts (the torch builder's) are released by their
        backward; a step dropped before backward (its outputs discarded: a skipped step, a
        forward with grad whose loss is never used) would keep them, and every tensor
        their Functions saved, for good.  They go when this run does: torch frees the
        step's autograd nodes, which hold it, once its outputs are gone."""
        from ortpass.training import python_op_kernels

        weakref.finalize(self, python_op_kernels.release, [int(h.numpy()) for h in handles])

    def backward_head(self, seeds: list[torch.Tensor]) -> dict:
        names = [self.graph.outputs[i] for i in self.differentiated]
        feeds = self._feeds_now()
        return self.graph.session.run_backward_head(feeds, self._stash, dict(zip(names, map(to_ortvalue, seeds))))

    def backward_body(self, stash, head: dict) -> list[torch.Tensor]:
        session = self.graph.session
        self._stash = None
        gradients = session.run_backward_body(self._feeds_now(), stash, head)
        by_name = dict(zip(session.gradients, (to_torch(g) for g in gradients)))
        return [by_name[name] for name in self._gradient_names()]

    def _feeds_now(self) -> dict:
        """The feeds, each parameter or buffer whose memory moved since forward fed again from
        where it is now.  FSDP frees a unit's gathered parameters after its forward and gathers
        them again, elsewhere, before its backward: torch's saved tensors follow the storage,
        a pointer fed at forward would read freed memory."""
        feeds, root = self.feeds, self.module.module
        for graph_name, state_name in self.graph.state_inputs:
            if state_name in self.graph.written_by_ort:  # fed as a copy at forward
                continue
            path, _, attribute = state_name.rpartition(".")
            tensor = getattr(root.get_submodule(path), attribute)
            if tensor.data_ptr() != feeds[graph_name].data_ptr():
                feeds = dict(feeds) if feeds is self.feeds else feeds
                feeds[graph_name] = to_ortvalue(tensor)
        return feeds

    def _gradient_names(self) -> list[str]:
        info = self.graph.session.info
        inputs = [self.graph.tensor_inputs[i] for i in self.graph.inputs_with_grad]
        return [info.gradients[f"{INNER}.{p}"] for p in self.graph.params] + [info.input_gradients[n] for n in inputs]


