"""Recompute plan strings: ``<cluster>:<type>:<count>``, comma-joined lists, JSON files."""

import json

import pytest

from ortpass.analysis.plans import (
    PlanSpec,
    PlanType,
    cluster_id,
    format_plans,
    load_plan_file,
    parse_plan,
    parse_plans,
    save_plan_file,
)
from ortpass.errors import PlanError


def test_parse_one_plan():
    spec = parse_plan("Reshape+Where+BiasSoftmax+:1:-1")
    assert spec == PlanSpec("Reshape+Where+BiasSoftmax+", PlanType.RECOMPUTE, -1)
    assert spec.op_types == ("Reshape", "Where", "BiasSoftmax")
    assert parse_plan(" Cast+:2:3 ") == PlanSpec("Cast+", PlanType.RECOMPUTE_WITH_COMPROMISE, 3)


def test_format_round_trips():
    text = "Gelu+:1:-1,Expand+Tile+:1:2,Cast+:2:-1"
    assert format_plans(parse_plans(text)) == text
    assert str(parse_plan("Gelu+:1:-1")) == "Gelu+:1:-1"


def test_lists_and_specs_are_accepted():
    spec = PlanSpec("Gelu+", PlanType.RECOMPUTE)
    assert parse_plans(["Gelu+:1:-1", spec]) == [spec, spec]
    assert parse_plans(None) == [] and parse_plans("") == []
    assert parse_plans(spec) == [spec]


def test_cluster_id_from_op_types():
    assert cluster_id(["MatMul", "Transpose", "Reshape"]) == "MatMul+Transpose+Reshape+"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("Gelu+:1", "expected '<cluster>:<type>:<count>'"),
        ("Gelu+:3:-1", "type must be 0, 1 or 2"),
        ("Gelu+:x:-1", "type must be 0, 1 or 2"),
        ("Gelu+:1:all", "count must be an integer"),
        ("Gelu+:1:0", "bad count 0"),
        ("Gelu+:1:-2", "bad count -2"),
        ("Gelu:1:-1", "bad cluster id 'Gelu'"),
        ("+Gelu+:1:-1", "bad cluster id"),
    ],
)
def test_bad_plan_strings_name_the_string(text, fragment):
    with pytest.raises(PlanError) as info:
        parse_plan(text)
    assert fragment in str(info.value)
    assert repr(text) in str(info.value)


def test_empty_entry_in_a_list_is_an_error():
    with pytest.raises(PlanError, match="empty plan"):
        parse_plans("Gelu+:1:-1,,Cast+:2:-1")
    with pytest.raises(PlanError, match="must be a string"):
        parse_plans([3])


def test_json_file_round_trip(tmp_path):
    path = tmp_path / "plans.json"
    save_plan_file(path, ["Gelu+:1:-1", PlanSpec("Cast+", PlanType.RECOMPUTE_WITH_COMPROMISE, 2)])
    assert json.loads(path.read_text()) == ["Gelu+:1:-1", "Cast+:2:2"]
    assert [str(s) for s in load_plan_file(path)] == ["Gelu+:1:-1", "Cast+:2:2"]


def test_bad_files_name_the_file(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(PlanError, match="missing.json.*does not exist"):
        load_plan_file(missing)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("[\"Gelu+:1:-1\",")
    with pytest.raises(PlanError, match="bad.json.*not valid JSON"):
        load_plan_file(bad_json)
    not_list = tmp_path / "dict.json"
    not_list.write_text('{"plans": []}')
    with pytest.raises(PlanError, match="dict.json.*JSON list"):
        load_plan_file(not_list)
    bad_plan = tmp_path / "plan.json"
    bad_plan.write_text('["Gelu+:1:-1", "Gelu+:9:-1"]')
    with pytest.raises(PlanError, match="plan.json.*'Gelu\\+:9:-1'"):
        load_plan_file(bad_plan)
