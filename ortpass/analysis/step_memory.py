"""Predicted memory of one training step: the bytes a graph's values hold along execution.

Rule (the allocation ONNX Runtime 1.19.2 and 1.31 make for ortpass's sessions, which turn
memory reuse and memory patterns off -- ``ortpass.runtime.session``): graph order is the
execution order; each node's outputs are allocated when it runs; a value is freed after its
last reader, a view (:data:`~ortpass.analysis.memory.ALIAS_OPS`) holding its buffer alive
as a reader would, except that a view that is a graph output is a copy, allocated when it
runs (docs/design/ort-facts.md); graph outputs, and values nobody reads, are held to the
step's end (ORT never frees a value without a reader).  Graph inputs and initializers (weights, the
batch) are the baseline the step starts from and are not counted: the prediction is the
step's peak *above* them, what the benchmarks measure as step peak.  A registered
recomputable PythonOp's ctx output holds what its Function saved (its tensor inputs that
backward does not read; :class:`~ortpass.analysis.recompute.cost.ValueSizes`) and, run in
training mode, the Function's own outputs, of which ORT got copies.

While a node runs, its kernel's scratch is live too.  Most CPU kernels allocate none; the
ones that do, measured alone on ONNX Runtime 1.19.2's CPU provider at the benchmarks'
shapes (``benchmarks/kernel_scratch.py``), are in :data:`KERNEL_SCRATCH`:

- ``Where`` selects each of X and Y into a temporary shaped like the condition broadcast
  with it, then merges them (both broadcast to the output: twice the output);
- ``SoftmaxCrossEntropyLoss`` computes log-probabilities and a second temporary of the
  logits' size, the first of them in its ``log_prob`` output when that is asked for;
- ``LayerNormalizationGrad`` and ``SimplifiedLayerNormalizationGrad`` hold four
  temporaries of their input's size.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from ortpass.analysis import memory
from ortpass.analysis.ort_order import ort_default_order
from ortpass.analysis.partition import get_partition, is_training_graph
from ortpass.analysis.recompute.cost import ValueSizes
from ortpass.conventions import MS_DOMAIN, is_onnx_domain

__all__ = ["KERNEL_SCRATCH", "StepMemory", "kernel_scratch", "last_reads", "predict_step_memory"]

logger = logging.getLogger(__name__)

#: A value larger than this (4 EiB: data-dependent dims at bounds no step reaches, such as
#: four of them at a vocabulary's size) is counted as of unknown size, not as bytes.
MAX_BYTES = 2**62


@dataclasses.dataclass
class StepMemory:
    """Live bytes at each node of a step (``live[i]``: while the i-th node in execution
    order runs, its outputs and scratch included), above the graph's inputs and
    initializers."""

    live: np.ndarray
    nodes: list[ir.Node]
    unknown: list[str]  # values whose size is unknown at the dims: not counted
    bounded: list[str] = dataclasses.field(default_factory=list)  # data-dependent dims, at their bound
    dims: dict[str, int] = dataclasses.field(default_factory=dict)  # every dim the sizes were taken at

    @property
    def peak_bytes(self) -> int:
        return int(self.live.max(initial=0))

    @property
    def peak_node(self) -> ir.Node | None:
        return self.nodes[int(self.live.argmax())] if len(self.live) else None

    @property
    def exact(self) -> bool:
        """False when some value's size was unknown (the peak is then a lower bound)."""
        return not self.unknown


def predict_step_memory(
    model: ir.Model, dims: Mapping[str, int] | None = None, graph_order: Sequence[ir.Node] | None = None
) -> StepMemory:
    """Simulate the allocations of one run of ``model``'s graph at ``dims`` (dim param ->
    size; a static graph needs none).  ``graph_order``: the graph's nodes in the order a
    pass is about to write (default: as they are).  Graph-internal dims (``unk__3``, named
    by shape inference) get their values at ``dims`` from shape inference.  Read only."""
    nodes = ort_default_order(list(model.graph) if graph_order is None else list(graph_order))
    bounded: dict[str, int] = {}
    if dims is not None:
        internal = memory.graph_dim_params(v for node in nodes for v in node.outputs) - set(dims)
        if internal:
            dims = {**dims, **memory.bind_internal_dims(model, dims, internal)}
            bounded = _bound_data_dependent_dims(model, dims, internal - set(dims))
            dims = {**dims, **bounded}
    buffers = memory.BufferMap(lambda node: _view_ort_keeps(node) or _fused_into_matmul(node))
    sizes = ValueSizes(buffers, _buffers_backward_reads(model, nodes, buffers), min_elements=0)
    position = {node: i for i, node in enumerate(nodes)}
    end = len(nodes) - 1
    last_read = last_reads(nodes, position, buffers, end)
    delta = np.zeros(len(nodes) + 1, dtype=np.int64)
    unknown: list[str] = []
    folded = _folded_by_ort(nodes)
    for i, node in enumerate(nodes):
        if node in folded:
            continue
        scratch = kernel_scratch(node, dims)
        delta[i] += scratch
        delta[i + 1] -= scratch
        for value in node.outputs:
            if not value.name or buffers.root(value) is not value:
                continue  # an omitted optional output, or a view: no allocation of its own
            if _untyped_unread_gradient(value):
                continue
            held = memory.symbolic_nbytes(value) if _inference_mode_ctx(value) else sizes.nbytes(value)
            held = _plus_outputs_the_ctx_keeps(value, held)
            nbytes = memory.evaluate(held, dims)
            if nbytes is None or nbytes > MAX_BYTES:
                unknown.append(value.name)
                continue
            delta[i] += nbytes
            delta[last_read.get(value, end) + 1] -= nbytes
    if unknown:
        logger.info("step memory: %d values of unknown size not counted (e.g. %r)", len(unknown), unknown[0])
    return StepMemory(np.cumsum(delta)[:-1], nodes, unknown, sorted(bounded), dict(dims or {}))


def last_reads(nodes: Sequence[ir.Node], position: Mapping[ir.Node, int], buffers: memory.BufferMap, end: int) -> dict[ir.Value, int]:
    """The position after which each buffer is freed: the last read of it or of any view
    of it; ``end`` where it or a view is a graph output or is read by nobody."""
    last: dict[ir.Value, int] = {}
    for node in nodes:
        for value in node.outputs:
            if not value.name:
                continue
            readers = [position[user] for user, _ in value.uses() if user in position]
            release = end if value.is_graph_output() or not readers else max(readers)
            root = buffers.root(value)
            last[root] = max(last.get(root, release), release)
    return last


def _buffers_backward_reads(model: ir.Model, nodes: list[ir.Node], buffers: memory.BufferMap) -> set[ir.Value]:
    """Buffers of the stashed activations (backward keeps them anyway): a PythonOp's ctx
    does not hold them a second time.  Empty for a graph that is not a training graph."""
    if not is_training_graph(model):
        return set()
    return {buffers.root(v) for v in get_partition(model, nodes).stashed}


#: Ops ORT's constant folding leaves alone even when every input is a constant.
_NOT_FOLDED = frozenset({"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"})


def _folded_by_ort(nodes: Sequence[ir.Node]) -> set[ir.Node]:
    """Nodes ORT's constant folding computes when the session is made (every input an
    initializer with a value, or computed by such a node: a weight's Transpose where the
    weights are initializers); their outputs become initializers, the step's baseline.
    Measured: HF LLaMA's 28 weight transposes, 16 MiB, held by no step on ORT 1.19.2."""
    folded: set[ir.Node] = set()
    for node in nodes:  # in execution order: producers first
        if node.op_type in _NOT_FOLDED or not is_onnx_domain(node.domain) or _has_subgraph(node):
            continue
        if all(_constant(v, folded) for v in node.inputs):
            folded.add(node)
    return folded


def _constant(value: ir.Value | None, folded: set[ir.Node]) -> bool:
    if value is None:
        return True
    producer = value.producer()
    if producer is None:
        # An initializer with its value; one that is also a graph input can be fed anew.
        return value.const_value is not None and not value.is_graph_input()
    return producer in folded


def _has_subgraph(node: ir.Node) -> bool:
    return any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values())


def _view_ort_keeps(node: ir.Node) -> bool:
    """A view op whose output shares its input's buffer in ORT: not a graph output, which
    ORT gives a buffer of its own (measured with ``Reshape`` on ORT 1.19.2 and 1.32.0:
    196 MiB of logits returned through a Reshape peaked at 391-392 MiB)."""
    return memory.is_alias_node(node) and not node.outputs[0].is_graph_output()


def _fused_into_matmul(node: ir.Node) -> bool:
    """A Transpose of the last two axes that only MatMuls read: ORT's MatmulTransposeFusion
    makes each a FusedMatMul reading the Transpose's input, and the Transpose is gone; its
    output counts as a view of its input.  Measured: HF LLaMA's 28 weight transposes
    (16 MiB) held by no step on ORT 1.19.2."""
    if node.op_type != "Transpose" or not is_onnx_domain(node.domain) or not node.inputs or node.inputs[0] is None:
        return False
    out = node.outputs[0]
    perm = node.attributes.get_ints("perm")
    rank = len(perm) if perm is not None else (len(out.shape) if out.shape is not None else 0)
    if rank < 2 or (perm is not None and list(perm) != [*range(rank - 2), rank - 1, rank - 2]):
        return False
    readers = [user for user, _ in out.uses()]
    return bool(readers) and not out.is_graph_output() and all(
        (user.op_type == "MatMul" and is_onnx_domain(user.domain)) or (user.op_type == "FusedMatMul" and user.domain == MS_DOMAIN)
        for user in readers
    )


def _inference_mode_ctx(value: ir.Value) -> bool:
    """The ctx output of a PythonOp run in inference mode (``training_mode`` 0: recompute
    made it so, and its clone keeps the ctx backward reads): torch saves nothing in it."""
    producer = value.producer()
    if producer is None or producer.op_type != "PythonOp" or value.index() != 0:
        return False
    mode = producer.attributes.get("training_mode")
    return mode is not None and mode.as_int() == 0


def _plus_outputs_the_ctx_keeps(value: ir.Value, held):
    """``held``, plus, for the ctx output of a PythonOp run in training mode, the bytes of
    its other outputs: the bridge hands ORT a copy of each and keeps the Function's own in
    the ctx for backward (``ortpass.pythonop.bridge``).  Measured on HF LLaMA with fused
    attention (benchmarks/budget.py): without them the step was predicted one attention
    output per layer low (16 MiB at seq 512, 64 at 2048)."""
    producer = value.producer()
    if producer is None or producer.op_type != "PythonOp" or value.index() != 0 or _inference_mode_ctx(value):
        return held
    outputs = [memory.symbolic_nbytes(v) for v in producer.outputs[1:] if v.name]
    return None if held is None or None in outputs else held + sum(outputs)


def _bound_data_dependent_dims(model: ir.Model, dims: Mapping[str, int], unbound: set[str]) -> dict[str, int]:
    """A value for each internal dim shape inference cannot give at ``dims``: one that
    depends on the data (the rows the gather before the loss keeps, those with a label).
    Such a dim counts rows selected from the batch's tokens, so it is bounded by the
    element count of the largest input with symbolic dims (``batch x seq``: the batch, not
    a weight); the prediction is then an upper bound, which keeps a budget met.  A static
    graph has no such input, and its data-dependent dims stay unknown."""
    if not unbound:
        return {}
    batch = [v for v in model.graph.inputs if v.shape is not None and any(isinstance(d, ir.SymbolicDim) for d in v.shape)]
    counts = [memory.evaluate(memory.symbolic_numel(v), dims) for v in batch]
    bound = max((c for c in counts if c is not None), default=None)
    if bound is None:
        return {}
    logger.info("step memory: data-dependent dims %s counted at their bound, %d", sorted(unbound), bound)
    return {name: bound for name in unbound}


def _untyped_unread_gradient(value: ir.Value) -> bool:
    """A PythonOpGrad output the gradient builder left untyped and nobody reads: the
    gradient of an input that takes none (an attention mask), which ortpass's bridge
    returns as None, so ORT allocates nothing for it."""
    producer = value.producer()
    return (
        value.dtype is None
        and producer is not None
        and producer.op_type == "PythonOpGrad"
        and not value.uses()
        and not value.is_graph_output()
    )


def _where_scratch(node: ir.Node, dims: Mapping[str, int] | None) -> int:
    """X and Y each selected into a temporary shaped like the condition broadcast with it."""
    condition, out = node.inputs[0], node.outputs[0]
    if condition is None or out.dtype is None:
        return 0
    total = 0
    for value in node.inputs[1:3]:
        count = _broadcast_numel(condition, value, dims) if value is not None else None
        if count is None:
            return 0
        total += count * out.dtype.itemsize
    return total


def _broadcast_numel(a: ir.Value, b: ir.Value, dims: Mapping[str, int] | None) -> int | None:
    if a.shape is None or b.shape is None:
        return None
    rank = max(len(a.shape), len(b.shape))
    sizes = []
    for shape in (a.shape, b.shape):
        padded = [1] * (rank - len(shape)) + list(shape)
        sizes.append([d if isinstance(d, int) else (dims or {}).get(str(d.value)) for d in padded])
    count = 1
    for x, y in zip(*sizes):
        if x is None or y is None:
            return None
        count *= max(x, y)
    return count


def _times_input(index: int, factor: float):
    def scratch(node: ir.Node, dims: Mapping[str, int] | None) -> int:
        value = node.inputs[index] if index < len(node.inputs) else None
        return int(factor * (memory.nbytes_at(value, dims) or 0)) if value is not None else 0

    return scratch


def _cross_entropy_scratch(node: ir.Node, dims: Mapping[str, int] | None) -> int:
    """Two temporaries of the logits' size, one of them the ``log_prob`` output if asked for."""
    logits = memory.nbytes_at(node.inputs[0], dims) or 0 if node.inputs and node.inputs[0] is not None else 0
    has_log_prob = len(node.outputs) > 1 and bool(node.outputs[1].name)
    return logits if has_log_prob else 2 * logits


#: (domain, op type) -> the scratch its CPU kernel allocates while it runs, in bytes
#: (``benchmarks/kernel_scratch.py``: ONNX Runtime 1.19.2, batch 8 x 512, hidden 256).
KERNEL_SCRATCH = {
    ("", "Where"): _where_scratch,
    ("", "SoftmaxCrossEntropyLoss"): _cross_entropy_scratch,
    (MS_DOMAIN, "LayerNormalizationGrad"): _times_input(1, 4.0),
    (MS_DOMAIN, "SimplifiedLayerNormalizationGrad"): _times_input(1, 4.0),
}


def kernel_scratch(node: ir.Node, dims: Mapping[str, int] | None) -> int:
    """Bytes ``node``'s kernel allocates beyond its outputs while it runs (0 for most ops,
    and where a size is unknown)."""
    rule = KERNEL_SCRATCH.get(("" if is_onnx_domain(node.domain) else node.domain, node.op_type))
    return rule(node, dims) if rule is not None else 0
