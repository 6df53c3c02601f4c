"""Run a training graph's forward and backward apart, as two ORT sessions.

:func:`ortpass.training.split.split_training_graph` cuts the graph; this runs the halves.
Forward takes the batch and the parameters and returns the graph's outputs and the stashed
values; backward takes those stashed values back, the outputs' gradients (for a graph
built from outputs) and the inputs it reads, and returns the gradients.  Between the two
the caller does what it wants with the outputs, as a torch training loop computes its
loss from the logits.  Sessions use :class:`~ortpass.runtime.TrainingSession`'s options.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from ortpass.analysis.partition import get_training_info
from ortpass.errors import OrtpassError
from ortpass.runtime.row_adds import ortvalue_tensor, rows_added_after_proto
from ortpass.runtime.session import open_session, run_with_ort_values as _run, training_model
from ortpass.training.backward_head import cut_backward_head
from ortpass.training.split import declare_types, split_training_graph

__all__ = ["SplitTrainingSession"]

logger = logging.getLogger(__name__)


class SplitTrainingSession:
    """Forward and backward of ``model`` (a training graph) in two ORT sessions.

    Args:
        model: a training graph (after any post-grad passes), built from a loss or from
            outputs (``build_training_graph(outputs_with_grad=...)``), or the path of one
            saved to a file.
        providers, threads, session_options: as for :class:`~ortpass.runtime.TrainingSession`.

    Attributes:
        outputs: what :meth:`run_forward` returns first (the graph's forward outputs).
        context_positions: where the stash :meth:`run_forward` returns holds a Python op's
            forward context handle (graphs of the torch builder), which its backward releases.
        gradients: what :meth:`run_backward` returns (gradient output names, in order).
        seeds: output -> the graph input its gradient is fed to (graphs built from outputs).
    """

    def __init__(
        self, model: ir.Model | str | os.PathLike, providers: Any = None, *, threads: int | None = None,
        session_options: Any = None,
    ) -> None:
        model = training_model(model)
        self.info = get_training_info(model)
        graphs = split_training_graph(model)
        self.outputs, self.stashed, self.gradients = graphs.outputs, graphs.stashed, graphs.gradients
        self.context_positions = _context_positions(graphs.forward, self.stashed)
        self.seeds = dict(self.info.seeds)
        self._output_set = set(self.outputs)
        initializers = model.graph.initializers
        self._default_params = {
            name: initializers[name].const_value.numpy()
            for name in self.info.params
            if name in initializers and initializers[name].const_value is not None
        }
        self.forward_inputs = [i.name for i in graphs.forward.graph.input]
        options = dict(threads=threads, session_options=session_options)
        self._forward, self.providers = open_session(graphs.forward, model, providers, **options)
        declare_types(graphs.backward.graph, {o.name: _elem_type(o.type) for o in self._forward.get_outputs()})
        backward, self._rows = rows_added_after_proto(graphs.backward)
        halves = cut_backward_head(backward, self.seeds.values())
        self._head, self._head_inputs, self._head_fetch = None, [], []
        if halves is not None:
            self._head, _ = open_session(halves.head, model, providers, **options)
            self._head_inputs = [i.name for i in halves.head.graph.input]
            self._head_fetch = [o.name for o in halves.head.graph.output]
            backward = halves.body
        self._backward, _ = open_session(backward, model, providers, **options)
        self._body_inputs = [i.name for i in backward.graph.input]
        self._body_fetch = {o.name for o in backward.graph.output}

    def run_forward(self, feeds: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
        """Run forward on C-level OrtValues (``feeds`` holds at least every input forward
        reads); returns (outputs, stashed values), OrtValues owned by ORT."""
        fetch = [*self.outputs, *(name for name in self.stashed if name not in self._output_set)]
        values = dict(zip(fetch, _run(self._forward, {name: feeds[name] for name in self.forward_inputs}, fetch)))
        return [values[name] for name in self.outputs], [values[name] for name in self.stashed]

    def run_backward(self, feeds: Mapping[str, Any], stash: Sequence[Any], seeds: Mapping[str, Any]) -> list[Any]:
        """Run backward: ``feeds`` as given to forward, ``stash`` as forward returned them,
        ``seeds`` the gradient of each output in :attr:`seeds`; returns the gradients."""
        return self.run_backward_body(feeds, stash, self.run_backward_head(feeds, stash, seeds))

    def run_backward_head(self, feeds: Mapping[str, Any], stash: Sequence[Any], seeds: Mapping[str, Any]) -> dict:
        """The first part of backward, the nodes that read the outputs' gradients
        (:mod:`ortpass.training.backward_head`); returns what :meth:`run_backward_body`
        takes.  Once it returned, the caller may drop ``seeds``: the body does not read them."""
        missing = sorted(set(self.seeds) - set(seeds))
        if missing:
            raise OrtpassError(f"backward needs the gradient of outputs {missing}")
        fed = {self.seeds[output]: value for output, value in seeds.items()}
        if self._head is None:
            return fed
        available = {**feeds, **dict(zip(self.stashed, stash)), **fed}
        values = _run(self._head, {name: available[name] for name in self._head_inputs}, self._head_fetch)
        return dict(zip(self._head_fetch, values))

    def run_backward_body(self, feeds: Mapping[str, Any], stash: Sequence[Any], head: Mapping[str, Any]) -> list[Any]:
        """The rest of backward, from :meth:`run_backward_head`'s values; returns the gradients."""
        available = {**feeds, **dict(zip(self.stashed, stash)), **head}
        run_feeds = {name: available[name] for name in self._body_inputs}
        fetch = self._rows.fetch(self.gradients)
        body_fetch = [name for name in fetch if name in self._body_fetch]
        by_name = {**head, **dict(zip(body_fetch, _run(self._backward, run_feeds, body_fetch)))}
        return self._rows.finish(self.gradients, [by_name[name] for name in fetch], ortvalue_tensor)

    def run(self, batch: Mapping[str, Any], seeds: Mapping[str, Any] = {}) -> tuple[dict, dict]:
        """Forward then backward on numpy values (for tests and parity checks): the outputs
        and the gradients by name.  Parameters missing from ``batch`` take the model's values."""
        from onnxruntime.capi import _pybind_state as C

        def ort_value(value):
            return C.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(np.asarray(value)), C.OrtDevice(0, 0, 0))

        feeds = {name: ort_value(value) for name, value in {**self._default_params, **batch}.items()}
        missing = sorted(set(self.forward_inputs) - set(feeds))
        if missing:
            raise OrtpassError(f"batch is missing graph inputs {missing}")
        outputs, stashed = self.run_forward(feeds)
        gradients = self.run_backward(feeds, stashed, {k: ort_value(v) for k, v in seeds.items()})
        return (
            {name: v.numpy() for name, v in zip(self.outputs, outputs)},
            {name: v.numpy() for name, v in zip(self.gradients, gradients)},
        )


def _context_positions(forward: Any, stashed: Sequence[str]) -> list[int]:
    """Where in the stash the torch builder's Python ops keep their forward context handles
    (:mod:`ortpass.training.python_op_kernels`): the first output of each forward op."""
    if not any(n.domain.startswith("ortpass.python_op.") for n in forward.graph.node):
        return []  # no Python op: torch need not be imported
    from ortpass.training.python_ops import FORWARD_PREFIX, is_python_op

    handles = {n.output[0] for n in forward.graph.node if is_python_op(n) and n.op_type.startswith(FORWARD_PREFIX)}
    return [position for position, name in enumerate(stashed) if name in handles]


def _elem_type(ort_type: str) -> int:
    """ONNX element type from ORT's type string (``tensor(float)``)."""
    import onnx

    name = ort_type.removeprefix("tensor(").removesuffix(")")
    names = {"float": "FLOAT", "double": "DOUBLE", "float16": "FLOAT16", "bfloat16": "BFLOAT16", "bool": "BOOL"}
    return getattr(onnx.TensorProto, names.get(name, name.upper()), onnx.TensorProto.UNDEFINED)
