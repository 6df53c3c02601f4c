"""Random small forward+loss graphs for property tests.

A :class:`GraphRecipe` is a list of plain steps (an op name plus the choices it needs), so a
test framework such as hypothesis can draw one and shrink it, and :func:`build_model`
turns it into an ``onnx_ir.Model`` that ORT 1.19.2's gradient builder accepts:

- one float batch input ``x`` of a small static shape, and float parameters (initializers)
  created by the steps that need weights;
- a DAG of MatMul / Add / Mul / Gelu (com.microsoft) / Tanh / Relu / Sigmoid / Reshape /
  Transpose / Dropout / LayerNormalization / Softmax nodes, each step reading
  one of the values made so far (not only the latest one, so branches and joins occur);
- a loss: ``SoftmaxCrossEntropyLoss`` over logits ``[rows, classes]`` against the int64
  input ``labels`` (reduction mean or sum, with or without ``ignore_index``), or
  ``ReduceMean`` of the square of the last value times a scale parameter.

Nodes the loss does not depend on are dropped, and the parameters are exactly the float
initializers the remaining nodes read, so every parameter gets a gradient.  A Dropout
carries a ``seed`` unless its step says otherwise: two sessions over graphs derived from
the same recipe then draw the same masks, whatever a pass did to the graph, so their
losses can be compared.  The Dropout ratios are initializers named ``ratio_<n>``
(:data:`RATIO_PREFIX`), so a test can turn every Dropout into the identity.

:func:`as_training_graph` turns a hand-built forward+backward graph into what the gradient
build would have given (sides tagged, training info recorded), for tests of post-grad passes.

This module has no dependency on hypothesis or torch.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir

from ortpass.analysis.partition import TrainingInfo, set_training_info, tag
from ortpass.conventions import MS_DOMAIN

__all__ = [
    "as_training_graph",
    "IGNORE_INDEX",
    "RATIO_PREFIX",
    "LossRecipe",
    "GraphRecipe",
    "Step",
    "SAME_SHAPE_OPS",
    "STEP_KINDS",
    "build_model",
    "make_batch",
    "params_of",
]

logger = logging.getLogger(__name__)

#: Ops that read one activation (and maybe parameters) and keep its shape.
SAME_SHAPE_OPS = ("Relu", "Tanh", "Sigmoid", "Gelu", "Softmax", "Dropout", "LayerNormalization")
#: Every kind of step a recipe may hold.
STEP_KINDS = SAME_SHAPE_OPS + ("MatMul", "Add", "Mul", "Reshape", "Transpose")

IGNORE_INDEX = -100
RATIO_PREFIX = "ratio_"
OPSET = 17
IR_VERSION = 8  # what ORT 1.19.2 loads


@dataclasses.dataclass(frozen=True)
class Step:
    """One node to add.

    ``source``/``other`` pick input values among those made so far, counted back from
    the newest (0 = the latest value), wrapped around the number of values.  ``width`` is
    MatMul's output width; ``ratio`` Dropout's ratio and ``seeded`` whether it has a seed
    attribute; ``with_param`` makes Add/Mul read a parameter (broadcast over the last
    axis) instead of a second value.
    """

    kind: str
    source: int = 0
    other: int = 1
    width: int = 8
    ratio: float = 0.25
    with_param: bool = True
    seeded: bool = True


@dataclasses.dataclass(frozen=True)
class LossRecipe:
    """``kind`` "sce" (SoftmaxCrossEntropyLoss) or "mean" (ReduceMean of the square)."""

    kind: str = "sce"
    classes: int = 5
    reduction: str = "mean"
    ignore_index: bool = True


@dataclasses.dataclass(frozen=True)
class GraphRecipe:
    batch_shape: tuple[int, ...] = (4, 6)
    steps: tuple[Step, ...] = ()
    loss: LossRecipe = LossRecipe()
    seed: int = 0  # of the initializer values

    @property
    def loss_rows(self) -> int:
        """Rows of the SCE logits: the batch shape without its last axis, flattened."""
        return int(np.prod(self.batch_shape[:-1]))


@dataclasses.dataclass
class _Value:
    name: str
    shape: tuple[int, ...]


class _Builder:
    """Appends onnx.helper nodes and initializers; tracks the shape of every value."""

    def __init__(self, recipe: GraphRecipe) -> None:
        self.recipe = recipe
        self.rng = np.random.default_rng(recipe.seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.values = [_Value("x", tuple(recipe.batch_shape))]
        self.value_infos: list[onnx.ValueInfoProto] = []
        self.count = 0

    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}_{self.count}"

    def pick(self, back: int) -> _Value:
        return self.values[-1 - back % len(self.values)]

    def param(self, stem: str, shape: Sequence[int], *, around: float = 0.0) -> str:
        name = self.fresh(stem)
        data = (around + 0.5 * self.rng.standard_normal(shape)).astype(np.float32)
        self.initializers.append(onnx.numpy_helper.from_array(data, name))
        return name

    def constant(self, stem: str, array: np.ndarray) -> str:
        name = self.fresh(stem)
        self.initializers.append(onnx.numpy_helper.from_array(array, name))
        return name

    def node(self, op: str, inputs: Sequence[str], shape: Sequence[int], *, outputs: int = 1,
             domain: str = "", **attrs) -> _Value:
        names = [self.fresh(op.lower()) for _ in range(outputs)]
        self.nodes.append(oh.make_node(op, list(inputs), names, name=self.fresh(f"n_{op}"), domain=domain, **attrs))
        # Recorded here because onnx's shape inference stops at com.microsoft ops (Gelu).
        self.value_infos.append(oh.make_tensor_value_info(names[0], onnx.TensorProto.FLOAT, list(shape)))
        value = _Value(names[0], tuple(shape))
        self.values.append(value)
        return value

    # -- steps ---------------------------------------------------------------------------

    def add_step(self, step: Step) -> None:
        src = self.pick(step.source)
        kind = step.kind
        if kind in ("Relu", "Tanh", "Sigmoid"):
            self.node(kind, [src.name], src.shape)
        elif kind == "Gelu":
            self.node("Gelu", [src.name], src.shape, domain=MS_DOMAIN)
        elif kind == "Softmax":
            self.node("Softmax", [src.name], src.shape, axis=-1)
        elif kind == "Dropout":
            ratio = self.constant(RATIO_PREFIX.rstrip("_"), np.array(step.ratio, np.float32))
            training = self.constant("training", np.array(True))
            # A seed per node: sessions over graphs built from one recipe draw alike.
            seed = {"seed": self.count} if step.seeded else {}
            self.node("Dropout", [src.name, ratio, training], src.shape, outputs=2, **seed)
        elif kind == "LayerNormalization" and src.shape[-1] == 1:
            # ORT 1.19.2's LayerNormalizationGrad refuses to normalize one element ("M != 1
            # was false", at run time): a graph no pass could make trainable.
            self.node("Tanh", [src.name], src.shape)
        elif kind == "LayerNormalization":
            width = src.shape[-1]
            scale = self.param("ln_scale", [width], around=1.0)
            bias = self.param("ln_bias", [width])
            self.node("LayerNormalization", [src.name, scale, bias], src.shape, axis=-1, epsilon=1e-5)
        elif kind == "MatMul":
            weight = self.param("w", [src.shape[-1], step.width])
            self.node("MatMul", [src.name, weight], (*src.shape[:-1], step.width))
        elif kind in ("Add", "Mul"):
            self.binary(kind, src, step)
        elif kind == "Reshape":
            self.reshape(src)
        elif kind == "Transpose":
            self.transpose(src)
        else:
            raise ValueError(f"unknown step kind {kind!r}; known: {STEP_KINDS}")

    def binary(self, op: str, src: _Value, step: Step) -> None:
        other = self.pick(step.other)
        if step.with_param or other.shape != src.shape:
            operand = self.param(f"{op.lower()}_p", [src.shape[-1]], around=1.0 if op == "Mul" else 0.0)
        else:
            operand = other.name
        self.node(op, [src.name, operand], src.shape)

    def reshape(self, src: _Value) -> None:
        """Split the last axis in two when it is even, else merge the last two axes."""
        shape = src.shape
        if shape[-1] % 2 == 0 and len(shape) < 4:
            target = (*shape[:-1], 2, shape[-1] // 2)
        elif len(shape) >= 2:
            target = (*shape[:-2], shape[-2] * shape[-1])
        else:
            return
        spec = self.constant("shape", np.array(target, np.int64))
        self.node("Reshape", [src.name, spec], target)

    def transpose(self, src: _Value) -> None:
        """Swap the last two axes."""
        if len(src.shape) < 2:
            return
        perm = list(range(len(src.shape)))
        perm[-1], perm[-2] = perm[-2], perm[-1]
        self.node("Transpose", [src.name], [src.shape[p] for p in perm], perm=perm)

    # -- loss ----------------------------------------------------------------------------

    def add_loss(self) -> tuple[list[onnx.ValueInfoProto], dict[str, tuple[int, ...]]]:
        """Append the loss on the latest value; returns extra graph inputs and their shapes."""
        last = self.values[-1]
        loss = self.recipe.loss
        if loss.kind == "mean":
            # A scale parameter, so that even a recipe without weights has one to train.
            scale = self.param("out_scale", [last.shape[-1]], around=1.0)
            scaled = self.node("Mul", [last.name, scale], last.shape)
            square = self.node("Mul", [scaled.name, scaled.name], last.shape)
            self.nodes.append(oh.make_node("ReduceMean", [square.name], ["loss"], name="loss_node", keepdims=0))
            return [], {}
        rows = self.recipe.loss_rows
        # Flatten to [rows, features], then project to the classes: logits [rows, classes].
        numel = int(np.prod(last.shape))
        if numel % rows:  # a Transpose or a MatMul left a size rows does not divide: project first
            spec = self.constant("shape", np.array([1, numel], np.int64))
            line = self.node("Reshape", [last.name, spec], (1, numel))
            spread = self.node("MatMul", [line.name, self.param("spread", [numel, rows * last.shape[-1]])], (1, rows * last.shape[-1]))
            last, numel = spread, rows * last.shape[-1]
        features = numel // rows
        spec = self.constant("shape", np.array([rows, features], np.int64))
        flat = self.node("Reshape", [last.name, spec], (rows, features))
        weight = self.param("head", [features, loss.classes])
        logits = self.node("MatMul", [flat.name, weight], (rows, loss.classes))
        attrs = {"reduction": loss.reduction}
        if loss.ignore_index:
            attrs["ignore_index"] = IGNORE_INDEX
        self.nodes.append(
            oh.make_node("SoftmaxCrossEntropyLoss", [logits.name, "labels"], ["loss"], name="loss_node", **attrs)
        )
        labels = oh.make_tensor_value_info("labels", onnx.TensorProto.INT64, [rows])
        return [labels], {"labels": (rows,)}


def _prune(nodes: list[onnx.NodeProto], initializers: list[onnx.TensorProto]):
    """Keep the nodes the loss depends on and the initializers they read."""
    needed = {"loss"}
    kept: list[onnx.NodeProto] = []
    for node in reversed(nodes):
        if needed.intersection(node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
    kept.reverse()
    return kept, [t for t in initializers if t.name in needed]


def build_model(recipe: GraphRecipe) -> ir.Model:
    """The forward+loss model a recipe describes (see the module docstring)."""
    builder = _Builder(recipe)
    for step in recipe.steps:
        builder.add_step(step)
    extra_inputs, _ = builder.add_loss()
    nodes, initializers = _prune(builder.nodes, builder.initializers)
    graph = oh.make_graph(
        nodes,
        "random_training_graph",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(recipe.batch_shape)), *extra_inputs],
        [oh.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])],
        initializers,
        value_info=[vi for vi in builder.value_infos if vi.name in {o for n in nodes for o in n.output}],
    )
    opsets = [oh.make_opsetid("", OPSET), oh.make_opsetid(MS_DOMAIN, 1)]
    proto = oh.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)
    proto = onnx.shape_inference.infer_shapes(proto)
    return ir.from_proto(proto)


def as_training_graph(proto: onnx.ModelProto, sides: Sequence[str], info: TrainingInfo) -> ir.Model:
    """``proto`` as a training graph: node ``i`` tagged ``sides[i]`` (``"forward"`` or
    ``"backward"``) and ``info`` (loss, parameters, gradient outputs) recorded."""
    model = ir.from_proto(proto)
    nodes = list(model.graph)
    if len(nodes) != len(sides):
        raise ValueError(f"{len(sides)} sides for {len(nodes)} nodes")
    for node, side in zip(nodes, sides):
        tag(node, side)
    set_training_info(model, info)
    return model


def params_of(model: ir.Model) -> list[str]:
    """The parameters of a model from :func:`build_model`: its float initializers that are
    not scalars (the Dropout ratios are scalars)."""
    return [
        name
        for name, value in model.graph.initializers.items()
        if value.dtype == ir.DataType.FLOAT and value.shape is not None and len(value.shape) > 0
    ]



def make_batch(recipe: GraphRecipe, *, density: float = 1.0, seed: int = 0) -> dict[str, np.ndarray]:
    """A batch for the model of ``recipe``: ``x``, and ``labels`` for an SCE loss with about
    ``density`` of the labels valid (the rest ``ignore_index``; at least one stays valid,
    so a mean over valid rows is defined)."""
    rng = np.random.default_rng(seed)
    batch = {"x": rng.standard_normal(recipe.batch_shape).astype(np.float32)}
    if recipe.loss.kind == "sce":
        rows = recipe.loss_rows
        labels = rng.integers(0, recipe.loss.classes, size=rows).astype(np.int64)
        if recipe.loss.ignore_index:
            ignored = rng.random(rows) >= density
            ignored[rng.integers(rows)] = False
            labels[ignored] = IGNORE_INDEX
        batch["labels"] = labels
    return batch
