"""Pass options checked against the types their constructors declare (ortpass.infra.options)."""

from __future__ import annotations

import os
from typing import Literal, Sequence

import onnx_ir as ir
import pytest

from ortpass.errors import PipelineSpecError
from ortpass.infra.options import NonNegativeInt, check_options


class Declared(ir.passes.InPlacePass):
    def __init__(
        self,
        flag: bool = False,
        count: NonNegativeInt = 0,
        ratio: float = 0.5,
        mode: Literal[0, 1, 2] = 0,
        names: Sequence[str] | None = None,
        path: str | os.PathLike | None = None,
        anything=None,
    ) -> None:
        super().__init__()

    def call(self, model):
        return ir.passes.PassResult(model, False)


class Unresolvable(ir.passes.InPlacePass):
    def __init__(self, level: "NoSuchType" = 0) -> None:  # noqa: F821 - the point of the test
        super().__init__()

    def call(self, model):
        return ir.passes.PassResult(model, False)


ACCEPTED = [
    {"flag": True}, {"count": 0}, {"count": 7}, {"ratio": 1}, {"ratio": 0.25}, {"mode": 2}, {"names": ["a", "b"]},
    {"names": ("a",)}, {"names": []}, {"names": None}, {"path": "plans.json"}, {"anything": [1, "x"]},
]
REFUSED = [
    ({"flag": "no"}, r"option 'flag' must be bool, not 'no' \(str\)"),
    ({"flag": 1}, r"option 'flag' must be bool, not 1 \(int\)"),
    ({"count": True}, r"option 'count' must be int, not True \(bool\)"),
    ({"count": -1}, r"option 'count' must be at least 0, not -1 \(int\)"),
    ({"count": 1.0}, r"option 'count' must be int, not 1\.0 \(float\)"),
    ({"ratio": False}, r"option 'ratio' must be float, not False \(bool\)"),
    ({"mode": 3}, r"option 'mode' must be one of 0, 1, 2, not 3 \(int\)"),
    ({"mode": True}, r"option 'mode' must be one of 0, 1, 2, not True \(bool\)"),
    ({"names": "ab"}, r"option 'names' must be a list of str or None, not 'ab' \(str\); for one name write names=\['ab'\]"),
    ({"names": ["a", 1]}, r"option 'names' must be a list of str or None, not \['a', 1\] \(list\)"),
    ({"path": 3}, r"option 'path' must be str or PathLike or None, not 3 \(int\)"),
]


@pytest.mark.parametrize("options", ACCEPTED, ids=[next(iter(o)) + "=" + repr(next(iter(o.values()))) for o in ACCEPTED])
def test_values_of_the_declared_type_are_accepted(options):
    check_options(Declared, options, "pass 'declared'")


@pytest.mark.parametrize(("options", "message"), REFUSED, ids=[repr(o) for o, _ in REFUSED])
def test_values_of_another_type_are_refused_naming_the_option(options, message):
    with pytest.raises(PipelineSpecError, match=r"^pass 'declared': " + message):
        check_options(Declared, options, "pass 'declared'")


def test_a_long_value_is_elided_in_the_message():
    with pytest.raises(PipelineSpecError) as info:
        check_options(Declared, {"flag": "x" * 100_000}, "pass 'declared'")
    assert len(str(info.value)) < 400 and "characters]" in str(info.value)


def test_an_annotation_that_cannot_be_read_lets_the_constructor_decide():
    check_options(Unresolvable, {"level": "anything"}, "pass 'unresolvable'")
