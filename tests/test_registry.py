"""Plugin registration: the register_pass decorator and the ``ortpass.passes`` entry points."""

from __future__ import annotations

import sys
import textwrap

import onnx_ir as ir
import pytest

from ortpass import available_passes, get_pass, pipeline, register_pass
from ortpass.errors import PipelineSpecError
from ortpass.infra.base import OrtPass
from ortpass.infra.registry import ENTRY_POINT_GROUP


class _Unchanged(OrtPass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, False)


def test_the_decorator_makes_a_pass_available_by_name(isolated_registry, relu_model):
    @register_pass("user-pass")
    class UserPass(_Unchanged):
        """Changes nothing."""

    assert get_pass("user-pass") is UserPass
    assert UserPass.name == "user-pass"  # the registered name becomes the pass name
    assert available_passes()["user-pass"].endswith("UserPass")
    result = pipeline("user-pass")(relu_model)
    assert [r.name for r in result.report.records] == ["user-pass"]


def test_a_second_class_under_a_taken_name_is_refused_unless_replacing(isolated_registry):
    register_pass("taken")(type("First", (_Unchanged,), {}))
    second = type("Second", (_Unchanged,), {})
    with pytest.raises(ValueError, match="'taken' is already registered to .*First"):
        register_pass("taken")(second)
    register_pass("taken", replace=True)(second)
    assert get_pass("taken") is second


@pytest.mark.parametrize("bad", ["", "a,b", "a(b)", "with space"])
def test_names_that_pipeline_text_cannot_hold_are_refused(bad):
    with pytest.raises(ValueError, match="invalid pass name"):
        register_pass(bad)


def test_only_onnx_ir_passes_can_be_registered(isolated_registry):
    with pytest.raises(TypeError, match="onnx_ir.passes.PassBase subclass"):
        register_pass("not-a-pass")(object)


@pytest.fixture
def plugin_dist(tmp_path, monkeypatch, isolated_registry):
    """An installed-looking distribution on sys.path declaring two ortpass passes."""
    (tmp_path / "ortpass_test_plugin.py").write_text(
        textwrap.dedent(
            '''
            import onnx_ir as ir
            from ortpass.infra.base import OrtPass

            class PluginPass(OrtPass):
                """Adds an Identity after the first graph input."""

                def call(self, model):
                    x = model.graph.inputs[0]
                    identity = ir.node("Identity", [x])
                    model.graph.insert_before(model.graph.node(0), identity)
                    model.graph.node(1).replace_input_with(0, identity.outputs[0])
                    self.count("plugged in")
                    return ir.passes.PassResult(model, True)
            '''
        )
    )
    dist_info = tmp_path / "ortpass_test_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: ortpass-test-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n"
        "plugin-identity = ortpass_test_plugin:PluginPass\n"
        "plugin-broken = ortpass_test_plugin:NoSuchClass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ortpass_test_plugin", raising=False)
    yield
    sys.modules.pop("ortpass_test_plugin", None)


def test_an_entry_point_pass_is_listed_before_it_is_loaded(plugin_dist):
    assert available_passes()["plugin-identity"] == "ortpass_test_plugin:PluginPass (entry point)"
    assert "ortpass_test_plugin" not in sys.modules


def test_an_entry_point_pass_runs_in_a_pipeline(plugin_dist, relu_model):
    cls = get_pass("plugin-identity")
    assert cls.__name__ == "PluginPass" and cls.name == "plugin-identity"
    result = pipeline("plugin-identity")(relu_model)
    record = result.report["plugin-identity"]
    assert record.added == {"Identity": 1}
    assert record.stats == {"counts": {"plugged in": 1}}


def test_an_entry_point_that_fails_to_load_names_itself(plugin_dist):
    with pytest.raises(PipelineSpecError, match=r"pass 'plugin-broken' from entry point 'ortpass_test_plugin:NoSuchClass'"):
        pipeline("plugin-broken")

