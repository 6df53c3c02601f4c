"""The forward/backward partition of a training graph, as recorded by the gradient build.

``ortpass.training.build_training_graph`` tags every node with its side in node metadata
(``pkg.ortpass.side`` = ``forward`` | ``backward``) and records the training facts (loss
name, parameters, gradient names) as JSON in model metadata (``pkg.ortpass.training``).
Analyses read that record instead of re-deriving the split.  Passes that add nodes to a
training graph must tag them (:func:`tag`); a training graph with an untagged node is
rejected here with an error that names the node.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterable, Literal

import onnx_ir as ir

from ortpass.conventions import SIDE_KEY, TRAINING_KEY
from ortpass.errors import TrainingGraphError

__all__ = [
    "Partition",
    "TrainingInfo",
    "get_partition",
    "get_training_info",
    "is_backward",
    "is_training_graph",
    "set_training_info",
    "tag",
]


Side = Literal["forward", "backward"]


@dataclasses.dataclass(frozen=True)
class TrainingInfo:
    """What the gradient build recorded about a training graph.

    A graph built from a loss (``loss`` set) starts backward from the loss's gradient, an
    initializer of ones.  A graph built from outputs (``loss`` None) takes the gradient of
    each output in ``seeds`` (output -> graph input) as the caller computed it: the loss
    lives outside the graph, in the caller's code.  ``input_gradients`` maps graph inputs
    that get a gradient (inputs that require grad) to their gradient outputs.
    """

    loss: str | None
    params: tuple[str, ...]
    gradients: dict[str, str]  # parameter name -> gradient output name
    seeds: dict[str, str] = dataclasses.field(default_factory=dict)  # output -> its gradient, a graph input
    input_gradients: dict[str, str] = dataclasses.field(default_factory=dict)  # graph input -> gradient output

    @property
    def loss_gradient(self) -> str:
        """The value backward starts from in a loss graph: ORT 1.19.2's gradient builder
        names the loss's gradient ``<loss>_grad`` (an initializer of ones)."""
        if self.loss is None:
            raise TrainingGraphError("this training graph differentiates outputs, not a loss: it has no loss gradient")
        return f"{self.loss}_grad"

    @property
    def gradient_sources(self) -> frozenset[str]:
        """The values backward starts from: the loss's gradient, or every output's."""
        return frozenset(self.seeds.values()) if self.loss is None else frozenset({self.loss_gradient})

    def to_json(self) -> str:
        record: dict = {"loss": self.loss, "params": list(self.params), "gradients": self.gradients}
        if self.seeds:
            record["seeds"] = self.seeds
        if self.input_gradients:
            record["input_gradients"] = self.input_gradients
        return json.dumps(record)


@dataclasses.dataclass
class Partition:
    """Forward and backward nodes of a training graph, in graph order.

    ``stashed`` holds the forward-produced values that backward reads, in the order their
    producers appear: the activations a training step keeps alive between the passes.
    """

    forward: list[ir.Node]
    backward: list[ir.Node]
    stashed: list[ir.Value]

    def side_of(self, node: ir.Node) -> Side:
        return node.metadata_props[SIDE_KEY]  # type: ignore[return-value]

    def is_backward(self, node: ir.Node) -> bool:
        return is_backward(node)

    def backward_consumers(self, value: ir.Value) -> list[ir.Node]:
        return [n for n in _consumer_nodes(value) if self.is_backward(n)]


def is_backward(node: ir.Node) -> bool:
    """``node`` is tagged backward (an untagged node counts as forward)."""
    return node.metadata_props.get(SIDE_KEY) == "backward"


def tag(node: ir.Node, side: Side) -> ir.Node:
    """Record which side of the training graph ``node`` belongs to."""
    if side not in ("forward", "backward"):
        raise ValueError(f"side must be 'forward' or 'backward', not {side!r}")
    node.metadata_props[SIDE_KEY] = side
    return node


def is_training_graph(model: ir.Model) -> bool:
    return TRAINING_KEY in model.metadata_props


def set_training_info(model: ir.Model, info: TrainingInfo) -> None:
    model.metadata_props[TRAINING_KEY] = info.to_json()


def get_training_info(model: ir.Model) -> TrainingInfo:
    raw = model.metadata_props.get(TRAINING_KEY)
    if raw is None:
        raise TrainingGraphError(
            "the model is not a training graph from ortpass.training.build_training_graph "
            f"(model metadata has no {TRAINING_KEY!r})"
        )
    try:
        data = json.loads(raw)
        info = TrainingInfo(
            data["loss"], tuple(data["params"]), dict(data["gradients"]),
            dict(data.get("seeds", {})), dict(data.get("input_gradients", {})),
        )  # fmt: skip
    except (ValueError, KeyError, TypeError) as exc:
        raise TrainingGraphError(f"model metadata {TRAINING_KEY!r} is malformed: {exc}") from exc
    if (info.loss is None) == (not info.seeds):
        raise TrainingGraphError(
            f"model metadata {TRAINING_KEY!r} is malformed: a training graph has a loss or output seeds, not "
            f"{'both' if info.seeds else 'neither'}"
        )
    return info


def get_partition(model: ir.Model, nodes: Iterable[ir.Node] | None = None) -> Partition:
    """Read the forward/backward partition of a training graph (``nodes``: its graph's
    nodes in order, when the caller has them already; default: walk the graph)."""
    get_training_info(model)  # raises a clear error for a non-training graph
    forward: list[ir.Node] = []
    backward: list[ir.Node] = []
    for node in model.graph if nodes is None else nodes:
        side = node.metadata_props.get(SIDE_KEY)
        if side == "forward":
            forward.append(node)
        elif side == "backward":
            backward.append(node)
        else:
            raise TrainingGraphError(
                f"node {node.name!r} ({node.op_type}) has no {SIDE_KEY!r} tag; passes that add "
                "nodes to a training graph must tag them with ortpass.analysis.partition.tag"
            )
    return Partition(forward, backward, _stashed_values(forward, set(backward)))


def _consumer_nodes(value: ir.Value) -> Iterable[ir.Node]:
    seen: set[int] = set()
    for node, _ in value.uses():
        if id(node) not in seen:
            seen.add(id(node))
            yield node


def _stashed_values(forward: list[ir.Node], backward: set[ir.Node]) -> list[ir.Value]:
    """The outputs of ``forward`` that a backward node reads.  ``backward``: the graph's
    backward nodes; a set lookup instead of a tag read per reader halves the time.  A
    reader outside the graph (a node removed without detaching it) is asked for its tag."""
    forward_set = set(forward)

    def read_by_backward(out: ir.Value) -> bool:
        return any(
            user in backward or (user not in forward_set and is_backward(user)) for user, _ in out.uses()
        )

    return [out for node in forward for out in node.outputs if read_by_backward(out)]
