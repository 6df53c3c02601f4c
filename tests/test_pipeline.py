"""Pipeline text: names and options parsed, looked up and checked against constructors."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from ortpass import pipeline
from ortpass.errors import PassOrderingError, PipelineSpecError
from ortpass.infra.base import OrtPass
from ortpass.infra.pipeline_text import PassSpec, parse_pipeline, without_passes


class ScalePass(OrtPass):
    """A pass with options of every kind; it changes nothing."""

    name = "scale"

    def __init__(self, factor: float = 1.0, *, label: str = "s", axes: list[int] | None = None, enabled: bool = True):
        super().__init__()
        if factor <= 0:
            raise ValueError(f"factor must be positive, got {factor}")
        self.factor, self.label, self.axes, self.enabled = factor, label, axes, enabled

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, False)


class AnyOptionsPass(OrtPass):
    name = "any-options"

    def __init__(self, **options):
        super().__init__()
        self.options = options

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, False)


class FirstPass(OrtPass):
    name = "first"
    runs_after = {"last"}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, False)


class LastPass(FirstPass):
    name = "last"
    runs_after = {"first"}


@pytest.fixture(autouse=True)
def registered(isolated_registry):
    for cls in (ScalePass, AnyOptionsPass, FirstPass, LastPass):
        isolated_registry[cls.name] = cls


def test_names_and_options_of_every_kind():
    manager = pipeline("any-options, scale(factor=2.5, label='x, y)', axes=[0, -1], enabled=False) ,scale()")
    first, configured, default = manager.passes
    assert isinstance(first, AnyOptionsPass) and first.options == {}
    assert (configured.factor, configured.label, configured.axes, configured.enabled) == (2.5, "x, y)", [0, -1], False)
    assert (default.factor, default.label, default.axes, default.enabled) == (1.0, "s", None, True)


def test_int_none_and_double_quotes():
    (configured,) = pipeline('scale(factor=3, label="q", axes=None)').passes
    assert (configured.factor, configured.label, configured.axes) == (3, "q", None)


def test_a_constructor_taking_any_keyword_gets_every_option():
    (configured,) = pipeline("any-options(a=1, b=[True, None, 'z'])").passes
    assert configured.options == {"a": 1, "b": [True, None, "z"]}


def test_parse_keeps_positions():
    assert parse_pipeline("a, b(x=1)") == [PassSpec("a", {}, 0), PassSpec("b", {"x": 1}, 3)]


def test_manager_options_pass_through():
    manager = pipeline("scale", check=False, assume=["shapes"])
    assert manager.check == "none" and manager.assume == {"shapes"}


def test_unknown_pass_names_the_pass_its_position_and_the_known_ones():
    with pytest.raises(PipelineSpecError, match=r"position 6: unknown pass 'scael'; known passes: .*scale"):
        pipeline("scale,scael")


def test_unknown_option_names_the_option_and_lists_the_real_ones():
    with pytest.raises(PipelineSpecError, match=r"pass 'scale' .* has no option 'factr'; its options: factor, label, axes, enabled"):
        pipeline("scale(factr=2)")


def test_a_value_the_constructor_rejects_names_the_pass():
    with pytest.raises(PipelineSpecError, match=r"pass 'scale' .*rejected its options.*factor must be positive"):
        pipeline("scale(factor=-1)")


@pytest.mark.parametrize(
    "text, message",
    [
        ("", r"position 0: the pipeline is empty"),
        ("   ", r"the pipeline is empty"),
        ("scale,", r"position 6: expected a pass name, found the end"),
        (",scale", r"position 0: expected a pass name, found ','"),
        ("scale scale", r"position 6: expected ',' between passes"),
        ("scale(factor)", r"expected '=' after option 'factor' of pass 'scale'"),
        ("scale(factor=)", r"position 13: option 'factor' of pass 'scale' has no value"),
        ("scale(factor=2", r"options are not closed"),
        ("scale(factor=2 3)", r"'2 3' is not a literal"),
        ("scale(label=x)", r"option 'label' of pass 'scale': 'x' is not a literal.*quote strings"),
        ("scale(label='x)", r"position 12: unterminated string"),
        ("scale(axes=[0, 1)", r"unbalanced brackets"),
        ("scale(factor={1: 2})", r"is a dict; options take"),
        ("scale(axes=[[1]])", r"is a list; options take"),
        ("scale(factor=1, factor=2)", r"position 16: option 'factor' of pass 'scale' is given twice"),
        ("scale(1)", r"expected an option name in pass 'scale'"),
        ("scale)", r"expected ',' between passes, found '\)'"),
    ],
)
def test_malformed_text_is_refused_with_its_position(text, message):
    with pytest.raises(PipelineSpecError, match=message):
        pipeline(text)


def test_the_manager_built_from_text_orders_passes_too():
    with pytest.raises(PassOrderingError, match="cycle"):
        pipeline("first,last")


def test_a_pass_refusing_its_options_with_an_ortpass_error_is_named():
    # RecomputePass raises PlanError for a bad plan string; from a pipeline the error
    # must also say which pass, at which position, got it.
    with pytest.raises(PipelineSpecError, match=r"pass 'recompute' \(position \d+\) rejected its options .*PlanError"):
        pipeline("fix-dropout-seed,recompute(plans='Gelu+:9:-1')")


def test_without_passes_drops_the_named_passes_and_keeps_the_others_as_written():
    spec = "a(x=1, y='b,c'), b ,c(z=[1, 2])"
    assert without_passes(spec, {"b"}) == "a(x=1, y='b,c'),c(z=[1, 2])"
    assert without_passes(spec, {"d"}) == "a(x=1, y='b,c'),b,c(z=[1, 2])"
    assert without_passes(spec, {"a", "b", "c"}) == ""
