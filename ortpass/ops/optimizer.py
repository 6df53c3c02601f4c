"""onnxscript's optimizer on a graph that will be (or is being) differentiated.

Rule: while ``onnxscript.optimizer.optimize_ir`` runs, every parameter is a graph input
without a value (the constant folder leaves a node that reads a graph input alone, and
initializer deduplication skips graph inputs) and every Dropout without a seed carries a
distinct temporary one (common-subexpression elimination would otherwise merge two
Dropouts of one input into one mask); afterwards the parameters are initializers again,
in their old order, and the temporary seeds are gone.  Why each matters is measured in
:mod:`ortpass.passes.onnxscript_optimize`, the pass that runs this on an export; the torch
builder runs it on the graph torch.onnx writes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Sequence
from typing import Any

import onnx_ir as ir

from ortpass.errors import TrainingGraphError
from ortpass.ops.dropout import is_dropout

__all__ = ["Kept", "optimize_keeping_training_values"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Kept:
    """How many parameters were kept out of the optimizer's reach, and Dropouts kept apart."""

    parameters: int
    dropouts: int


def optimize_keeping_training_values(
    model: ir.Model, params: Sequence[str], *, skipped_rules: Collection[str] = (), **options: Any
) -> Kept:
    """Run onnxscript's optimizer on ``model`` in place (``options`` go to ``optimize_ir``),
    ``params`` and the Dropouts kept; the model keeps its parameters if it raises.  The
    default rewrite rules named in ``skipped_rules`` are left out (:func:`_optimize_without`)."""
    import onnxscript.optimizer  # the optimizer and its rewriter load only when asked for

    graph = model.graph
    order = list(graph.initializers)
    hidden = _hide(graph, params)
    seeded = _seed_dropouts(graph)
    try:
        if skipped_rules:
            _optimize_without(model, skipped_rules, **options)
        else:
            onnxscript.optimizer.optimize_ir(model, **options)
    finally:
        _unseed(seeded)
        _restore(graph, hidden, order)
    return Kept(len(hidden), len(seeded))


def _optimize_without(
    model: ir.Model,
    skipped_rules: Collection[str],
    *,
    num_iterations: int = 2,
    onnx_shape_inference: bool = True,
    input_size_limit: int | None = None,
    output_size_limit: int | None = None,
) -> None:
    """``onnxscript.optimizer.optimize_ir``'s sequence of passes (onnxscript 0.7), its default
    rewrite rules less ``skipped_rules`` (by name).  ``optimize_ir`` takes no rules, hence
    the sequence written out here; ``tests/test_onnxscript_optimize.py`` checks it still
    writes what ``optimize_ir`` does where the skipped rules rewrite nothing."""
    from onnx_ir.passes import common
    from onnxscript import rewriter
    from onnxscript.optimizer import _constant_folding

    unknown = set(skipped_rules) - {rule.name for rule in rewriter._DEFAULT_REWRITE_RULES}
    if unknown:
        raise ValueError(f"no default rewrite rule of onnxscript is named {sorted(unknown)}")
    rules = [rule for rule in rewriter._DEFAULT_REWRITE_RULES if rule.name not in skipped_rules]
    fold = _constant_folding.FoldConstantsPass(
        shape_inference=onnx_shape_inference,
        input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT if input_size_limit is None else input_size_limit,
        output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT if output_size_limit is None else output_size_limit,
    )  # fmt: skip
    cleanup = [common.RemoveUnusedNodesPass(), common.RemoveUnusedFunctionsPass(), common.RemoveUnusedOpsetsPass()]
    ir.passes.Sequential(
        common.InlinePass(),
        ir.passes.PassManager([fold, rewriter.RewritePass(rules), *cleanup], steps=num_iterations, early_stop=True),
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )(model)


@dataclasses.dataclass
class _Hidden:
    """A parameter made a graph input without a value for the optimizer's run."""

    value: ir.Value
    tensor: ir.TensorProtocol
    was_input: bool


def _hide(graph: ir.Graph, names: Sequence[str]) -> list[_Hidden]:
    """Make each parameter a graph input without a value; a parameter without one (a graph
    input already) needs nothing."""
    inputs = set(graph.inputs)
    hidden = []
    for name in names:
        value = graph.initializers.get(name)
        if value is None or value.const_value is None:
            continue
        hidden.append(_Hidden(value, value.const_value, value in inputs))
        graph.initializers.pop(name)
        value.const_value = None
        if value not in inputs:
            graph.inputs.append(value)
    return hidden


def _restore(graph: ir.Graph, hidden: Sequence[_Hidden], order: Sequence[str]) -> None:
    """Give the parameters their values back as initializers, in the order of before
    (the gradient build's default parameters and their gradients follow it)."""
    for item in hidden:
        if not item.was_input:
            if item.value not in graph.inputs:
                raise TrainingGraphError(f"onnxscript's optimizer removed the graph input {item.value.name!r}")
            graph.inputs.remove(item.value)
        item.value.const_value = item.tensor
        graph.register_initializer(item.value)
    rank = {name: index for index, name in enumerate(order)}
    values = sorted(graph.initializers.values(), key=lambda value: rank.get(value.name, len(rank)))
    for value in values:
        graph.initializers.pop(value.name)
    for value in values:
        graph.register_initializer(value)


def _seed_dropouts(graph: ir.Graph) -> list[ir.Node]:
    """Give every Dropout without a seed a distinct one; returns those nodes."""
    dropouts = [node for node in graph if is_dropout(node)]
    taken = {node.attributes.get_int("seed") for node in dropouts} - {None}
    seeded, seed = [], 0
    for node in dropouts:
        if "seed" in node.attributes:
            continue
        while seed in taken:
            seed += 1
        node.attributes["seed"] = ir.AttrInt64("seed", seed)
        taken.add(seed)
        seeded.append(node)
    return seeded


def _unseed(nodes: Sequence[ir.Node]) -> None:
    # Nodes the optimizer replaced (an inference-mode Dropout became an Identity) are out
    # of the graph; dropping their seed too is harmless.
    for node in nodes:
        node.attributes.pop("seed", None)
