"""Property tests: the checks on the IR give the onnx checker's verdict.

The manager's default mode never serializes a model between its input and its output: it
checks the input with :func:`ortpass.infra.checks.input_check` and each pass's output with
:func:`ortpass.infra.checks.incremental_check`, both written to refuse exactly what
``onnx.checker.check_model`` refuses.  Here random forward graphs (the generator of the
pass property tests) get one random breakage each, or none, and each IR check must agree
with the onnx checker on whether the model is valid:

- ``input_check`` on the broken model, with nothing checked before;
- ``incremental_check`` on the broken model, given the state it accepted for the model
  before the breakage (as after a pass that broke it).
"""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_properties import PROPERTY_SETTINGS, recipes

from ortpass.infra import checks
from ortpass.testing.graphs import build_model

# The checks take milliseconds on these graphs: four times the pass properties' examples.
CHECK_SETTINGS = settings(PROPERTY_SETTINGS, max_examples=200)


def _nth(model: ir.Model, index: int) -> ir.Node:
    nodes = list(model.graph)
    return nodes[index % len(nodes)]


def _move_first(model: ir.Model, index: int) -> None:
    node, first = _nth(model, index), model.graph.node(0)
    if node is not first:  # before the first node: out of order if it reads another node
        model.graph.remove(node)
        model.graph.insert_before(first, node)


def _remove(model: ir.Model, index: int) -> None:
    model.graph.remove(_nth(model, index))  # its readers now read a value nothing makes


def _rename_output(name: str) -> Callable[[ir.Model, int], None]:
    def rename(model: ir.Model, index: int) -> None:
        _nth(model, index).outputs[0].name = name

    return rename


def _set_op_type(model: ir.Model, index: int) -> None:
    _nth(model, index).op_type = "NoSuchOp"


def _add_attribute(attr: ir.Attr) -> Callable[[ir.Model, int], None]:
    def add(model: ir.Model, index: int) -> None:
        _nth(model, index).attributes[attr.name] = attr

    return add


def _retype_an_attribute(model: ir.Model, index: int) -> None:
    node = _nth(model, index)
    for name in list(node.attributes):
        node.attributes[name] = ir.AttrString(name, "not what the schema asks")
        return


def _extra_input(model: ir.Model, index: int) -> None:
    node = _nth(model, index)
    node.resize_inputs(len(node.inputs) + 1)
    node.replace_input_with(len(node.inputs) - 1, model.graph.inputs[0])


def _drop_an_input(model: ir.Model, index: int) -> None:
    node = _nth(model, index)
    node.resize_inputs(max(len(node.inputs) - 1, 0))


def _unimport_its_domain(model: ir.Model, index: int) -> None:
    node = _nth(model, index)
    if node.domain in ("", "ai.onnx"):
        node.domain = "com.nobody"
    else:
        del model.opset_imports[node.domain]


def _set_model(**fields) -> Callable[[ir.Model, int], None]:
    def set_(model: ir.Model, index: int) -> None:
        del index
        for name, value in fields.items():
            setattr(model, name, value)

    return set_


def _set_default_opset(version: int) -> Callable[[ir.Model, int], None]:
    def set_(model: ir.Model, index: int) -> None:
        del index
        model.opset_imports[""] = version

    return set_


def _empty_graph_name(model: ir.Model, index: int) -> None:
    del index
    model.graph.name = ""


def _undefined_graph_output(model: ir.Model, index: int) -> None:
    del index
    model.graph.outputs.append(ir.Value(name="made_by_nobody", type=ir.TensorType(ir.DataType.FLOAT)))


def _graph_output_untyped(model: ir.Model, index: int) -> None:
    del index
    model.graph.outputs[0].type = None


BREAKAGES: dict[str, Callable[[ir.Model, int], None]] = {
    "nothing": lambda model, index: None,
    "node-moved-first": _move_first,
    "node-removed": _remove,
    "output-renamed-to-the-input": _rename_output("x"),
    "output-renamed-empty": _rename_output(""),
    "unknown-op": _set_op_type,
    "bogus-attribute": _add_attribute(ir.AttrInt64("bogus", 1)),
    "attribute-of-another-type": _retype_an_attribute,
    "extra-input": _extra_input,
    "input-dropped": _drop_an_input,
    "domain-not-imported": _unimport_its_domain,
    "default-opset-1": _set_default_opset(1),
    "default-opset-13": _set_default_opset(13),
    "ir-version-too-new": _set_model(ir_version=99),
    "ir-version-3": _set_model(ir_version=3),
    "graph-name-emptied": _empty_graph_name,
    "graph-output-undefined": _undefined_graph_output,
    "graph-output-untyped": _graph_output_untyped,
}


def _refused(check: Callable[[], object]) -> bool:
    try:
        check()
    except Exception:  # noqa: BLE001 - only whether it refused is compared
        return True
    return False


breakages = st.tuples(st.sampled_from(sorted(BREAKAGES)), st.integers(0, 1000))


@CHECK_SETTINGS
@given(recipe=recipes, breakage=breakages)
def test_the_input_check_agrees_with_the_onnx_checker(recipe, breakage) -> None:
    name, index = breakage
    model = build_model(recipe)
    BREAKAGES[name](model, index)
    refused = _refused(lambda: checks.full_check(model))
    event(f"{name}: refused={refused}")
    assert _refused(lambda: checks.input_check(model)) == refused


@CHECK_SETTINGS
@given(recipe=recipes, breakage=breakages)
def test_the_incremental_check_agrees_with_the_onnx_checker(recipe, breakage) -> None:
    name, index = breakage
    model = build_model(recipe)
    accepted = checks.input_check(model)
    BREAKAGES[name](model, index)
    refused = _refused(lambda: checks.full_check(model))
    event(f"{name}: refused={refused}")
    assert _refused(lambda: checks.incremental_check(model, accepted)) == refused


def test_the_breakages_break() -> None:
    """The properties above are vacuous if the checker accepts every broken model: on a
    fixed recipe it refuses all but the breakages that leave this one valid."""
    from test_properties import GraphRecipe, LossRecipe, Step

    recipe = GraphRecipe(
        batch_shape=(4, 6),
        steps=(Step("MatMul", width=8), Step("Gelu"), Step("Dropout"), Step("MatMul", width=8)),
        loss=LossRecipe("sce", classes=5, reduction="mean", ignore_index=True),
    )
    # Node 2 is the Dropout (an ai.onnx op, so the checker has its schema): without its
    # optional training_mode input, or under opset 13, it is still valid.
    stays_valid = {"nothing", "input-dropped", "default-opset-13"}
    for name, breakage in BREAKAGES.items():
        model = build_model(recipe)
        breakage(model, 2)
        assert _refused(lambda: checks.full_check(model)) == (name not in stays_valid), name
