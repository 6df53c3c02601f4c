"""PassManager: ordering from declarations, checks and rollback, node tagging, report,
dumps and instruments.  The passes are defined here, small and hand-written."""

from __future__ import annotations

import gc
import itertools
import json
import logging
import subprocess
import sys
import time
import weakref

import onnx
import onnx_ir as ir
import pytest
from onnx_ir.passes.common import IdentityEliminationPass

from ortpass import PassManager, PassReport
from ortpass.conventions import CREATED_BY_KEY
from ortpass.errors import ModelLoadError, PassFailedError, PassOrderingError
from ortpass.infra import checks
from ortpass.infra import manager as manager_module
from ortpass.infra.base import OrtFunctionalPass, OrtPass
from ortpass.infra.checks import CheckedState
from ortpass.infra.instruments import ProgressInstrument
from ortpass.infra.ordering import order_passes
from ortpass.infra.report import ManagerResult

# -- passes used by these tests -------------------------------------------------------------


class InsertIdentityPass(OrtPass):
    """Puts an Identity between the first node and its first input."""

    name = "insert-identity"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        first = model.graph.node(0)
        identity = ir.node("Identity", [first.inputs[0]])
        model.graph.insert_before(first, identity)
        first.replace_input_with(0, identity.outputs[0])
        self.count("identities inserted")
        return ir.passes.PassResult(model, True)


class ReluToMsGeluPass(OrtPass):
    """Replaces every Relu by com.microsoft::Gelu (a contrib op the onnx checker has no schema for)."""

    name = "relu-to-ms-gelu"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        relus = [n for n in model.graph if n.op_type == "Relu"]
        for relu in relus:
            gelu = ir.node("Gelu", list(relu.inputs), domain="com.microsoft")
            model.graph.insert_before(relu, gelu)
            name = relu.outputs[0].name
            ir.convenience.replace_all_uses_with(relu.outputs[0], gelu.outputs[0], replace_graph_outputs=True)
            relu.outputs[0].name = None  # hand the (graph output) name over to the new value
            gelu.outputs[0].name = name
            gelu.outputs[0].type, gelu.outputs[0].shape = relu.outputs[0].type, relu.outputs[0].shape
            model.graph.remove(relu, safe=True)
            self.count("relus replaced")
        if relus:
            model.opset_imports["com.microsoft"] = 1
        return ir.passes.PassResult(model, bool(relus))


class NoOpPass(OrtPass):
    """Changes nothing."""

    name = "no-op"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, False)


class RaisesHalfwayPass(OrtPass):
    """Adds a node, then raises: the manager must not keep the added node."""

    name = "raises-halfway"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        model.graph.append(ir.node("Neg", [model.graph.inputs[0]]))
        raise RuntimeError("boom in the middle of a rewrite")


class ReadsUndefinedValuePass(OrtPass):
    """Adds a node that reads a value nothing defines: the onnx checker must refuse it."""

    name = "reads-undefined"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        model.graph.append(ir.node("Relu", [ir.Value(name="never_defined")]))
        return ir.passes.PassResult(model, True)


class BrokenPostconditionPass(InsertIdentityPass):
    """Inserts an Identity but its own postcondition says the graph must have none."""

    name = "broken-postcondition"

    def ensures(self, model: ir.Model) -> None:
        if any(n.op_type == "Identity" for n in model.graph):
            raise ValueError("an Identity is left in the graph")


class SelfTaggingPass(InsertIdentityPass):
    name = "self-tagging"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = super().call(model)
        model.graph.node(0).metadata_props[CREATED_BY_KEY] = "rule:my-rule"
        return result


class CloneAndAppendPass(OrtFunctionalPass):
    """A functional pass: returns a clone with one Neg added on the input."""

    name = "clone-and-append"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        new = model.clone()
        new.graph.append(ir.node("Neg", [new.graph.inputs[0]]))
        new.graph.outputs.append(new.graph.node(len(new.graph) - 1).outputs[0])
        new.graph.outputs[-1].name = "neg_out"
        new.graph.outputs[-1].type = ir.TensorType(ir.DataType.FLOAT)
        new.graph.outputs[-1].shape = ir.Shape([2, 3])
        return ir.passes.PassResult(new, True)


def declared(name: str, phase: str = "any", *, requires=(), provides=(), before=(), after=()) -> OrtPass:
    """A no-op pass instance with the given declarations."""
    cls = type(
        name.title().replace("-", ""),
        (NoOpPass,),
        {
            "name": name,
            "phase": phase,
            "requires_properties": frozenset(requires),
            "provides_properties": frozenset(provides),
            "runs_before": frozenset(before),
            "runs_after": frozenset(after),
        },
    )
    return cls()


def names(passes) -> list[str]:
    return [getattr(p, "name", type(p).__name__) for p in passes]


def op_types(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


# -- ordering -----------------------------------------------------------------------------


def test_a_fully_declared_set_runs_in_the_same_order_from_every_shuffle():
    passes = [
        declared("infer-shapes", "pre-grad", provides={"shapes"}),
        declared("gather-before-loss", "pre-grad", requires={"shapes"}),
        declared("build-gradient", provides={"training-graph"}),
        declared("fix-dropout-seeds", "post-grad", before={"recompute"}),
        declared("recompute", "post-grad"),
    ]
    # The rules above fix one order: shapes before its user (requires), pre-grad before the
    # gradient build, post-grad after it, and the explicit runs_before between the two post-grad.
    expected = ["infer-shapes", "gather-before-loss", "build-gradient", "fix-dropout-seeds", "recompute"]
    for shuffled in itertools.permutations(passes):
        assert names(order_passes(list(shuffled))) == expected


def test_undeclared_passes_keep_the_given_order():
    plain = IdentityEliminationPass()
    given = [declared("c"), plain, declared("a"), declared("b")]
    assert order_passes(given) == given


def test_only_the_declared_constraint_moves_a_pass():
    given = [declared("a"), declared("b"), declared("c", after={"a"}, before={"b"})]
    assert names(order_passes(given)) == ["a", "c", "b"]


def test_runs_after_a_pass_not_in_the_set_is_ignored():
    given = [declared("b", after={"not-here"}), declared("a", before={"also-not-here"})]
    assert names(order_passes(given)) == ["b", "a"]


def test_a_cycle_is_refused_naming_the_passes_in_it():
    passes = [
        declared("bystander"),
        declared("a", before={"b"}),
        declared("b", requires={"p"}, provides={"q"}),
        declared("c", requires={"q"}, provides={"p"}),
    ]
    with pytest.raises(PassOrderingError, match="cycle") as info:
        PassManager(passes)
    message = str(info.value)
    assert "'b'" in message and "'c'" in message
    assert "bystander" not in message  # not part of the cycle
    assert "requires 'p'" in message or "requires 'q'" in message


def test_a_two_pass_cycle_from_ordering_declarations():
    with pytest.raises(PassOrderingError, match=r"cycle: '?x'? -> '?y'? -> '?x'?|cycle: '?y'? -> '?x'? -> '?y'?"):
        order_passes([declared("x", before={"y"}), declared("y", before={"x"})])


def test_a_requirement_nobody_provides_is_refused_naming_pass_and_property():
    with pytest.raises(PassOrderingError, match=r"pass 'needs-shapes' requires 'shapes'"):
        PassManager([declared("needs-shapes", requires={"shapes"}), declared("other")])


def test_an_assumed_property_satisfies_a_requirement():
    manager = PassManager([declared("needs-shapes", requires={"shapes"})], assume=["shapes"])
    assert names(manager.passes) == ["needs-shapes"]


def test_post_grad_needs_a_gradient_build_or_a_training_graph_input():
    with pytest.raises(PassOrderingError, match="'recompute' requires 'training-graph'"):
        order_passes([declared("recompute", "post-grad")])
    assert names(order_passes([declared("recompute", "post-grad")], assume=["training-graph"])) == ["recompute"]


def test_pre_grad_on_a_model_assumed_to_be_a_training_graph_is_refused():
    with pytest.raises(PassOrderingError, match="'gather' is a pre-grad pass"):
        order_passes([declared("gather", "pre-grad")], assume=["training-graph"])


def test_a_pass_class_instead_of_an_instance_is_a_type_error():
    with pytest.raises(TypeError, match=r"InsertIdentityPass\(\)"):
        PassManager([InsertIdentityPass])


# -- running, tagging, rollback -------------------------------------------------------------


def test_the_callers_model_is_untouched_and_new_nodes_are_tagged(relu_model):
    result = PassManager([InsertIdentityPass()])(relu_model)
    assert isinstance(result, ManagerResult) and result.modified
    assert op_types(relu_model) == ["Relu"]  # the caller's model
    assert op_types(result.model) == ["Identity", "Relu"]
    identity, relu = result.model.graph
    assert identity.metadata_props[CREATED_BY_KEY] == "insert-identity"
    assert CREATED_BY_KEY not in relu.metadata_props  # it existed before the pass
    onnx.checker.check_model(ir.to_proto(result.model))


def test_a_tag_the_pass_set_itself_is_kept(relu_model):
    result = PassManager([SelfTaggingPass()])(relu_model)
    assert result.model.graph.node(0).metadata_props[CREATED_BY_KEY] == "rule:my-rule"


def test_nodes_of_a_functional_pass_that_rebuilt_the_model_are_matched_by_signature(relu_model):
    result = PassManager([CloneAndAppendPass()])(relu_model)
    relu, neg = result.model.graph
    assert neg.metadata_props[CREATED_BY_KEY] == "clone-and-append"
    assert CREATED_BY_KEY not in relu.metadata_props
    record = result.report["clone-and-append"]
    assert (record.added, record.removed) == ({"Neg": 1}, {})


def test_a_nothing_changed_run_still_returns_a_new_model(relu_model):
    result = PassManager([NoOpPass()])(relu_model)
    assert not result.modified
    assert result.model is not relu_model
    assert op_types(result.model) == ["Relu"]


class ReadsUndefinedButSaysUnchangedPass(ReadsUndefinedValuePass):
    """Breaks the model and reports modified=False: a lie the manager must still catch."""

    name = "lies-about-changes"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        super().call(model)
        return ir.passes.PassResult(model, False)


def test_a_pass_that_changed_nothing_is_not_checked_again(relu_model, monkeypatch):
    checked = []
    real_check = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda proto, *a, **k: (checked.append(len(proto.graph.node)), real_check(proto, *a, **k)))
    report = PassManager([InsertIdentityPass(), NoOpPass()], check="full")(relu_model).report
    assert checked == [1, 2]  # the input, then insert-identity's output; no-op: trusted
    assert report["no-op"].check_seconds == 0


def test_a_pass_that_says_unchanged_but_adds_a_node_is_checked(relu_model):
    with pytest.raises(PassFailedError, match="fails the onnx checker after this pass.*never_defined"):
        PassManager([ReadsUndefinedButSaysUnchangedPass()])(relu_model)


class SnapshotBeforeEachPass:
    """Instrument keeping the serialized model each pass was given."""

    def __init__(self):
        self.before: dict[str, bytes] = {}

    def before_pass(self, pass_, model):
        self.before[pass_.name] = ir.to_proto(model).SerializeToString()


_ALL_MODES = ("full", "incremental", "none")
_FAILING_PASSES = {  # name: (pass, what the error says, the check modes that catch it)
    "raises": (RaisesHalfwayPass, "RuntimeError: boom in the middle of a rewrite", _ALL_MODES),
    # Without checks nothing refuses a model that reads an undefined value.
    "checker-fails": (ReadsUndefinedValuePass, "fails the onnx checker after this pass.*never_defined", _ALL_MODES[:2]),
    "postcondition-fails": (BrokenPostconditionPass, "PostconditionError.*an Identity is left in the graph", _ALL_MODES),
}


@pytest.mark.parametrize(
    "failing_cls, reason, check",
    [
        pytest.param(cls, reason, check, id=f"{name}-{check}")
        for name, (cls, reason, checks) in _FAILING_PASSES.items()
        for check in checks
    ],
)
def test_a_failing_pass_gives_back_the_model_before_it(relu_model, failing_cls, reason, check):
    failing = failing_cls()
    snapshots = SnapshotBeforeEachPass()
    manager = PassManager([InsertIdentityPass(), failing, NoOpPass()], instruments=[snapshots], check=check)
    with pytest.raises(PassFailedError, match=reason) as info:
        manager(relu_model)
    error = info.value
    assert error.pass_name == failing.name
    assert failing.name in str(error)
    # The model handed back is the one the failing pass was given: the first pass's
    # Identity is there, nothing of the failing pass is.
    assert ir.to_proto(error.model).SerializeToString() == snapshots.before[failing.name]
    assert op_types(error.model) == ["Identity", "Relu"]
    assert op_types(relu_model) == ["Relu"]
    # The report stops at the failure; the pass after it never ran.
    assert [(r.name, r.failed) for r in error.report.records] == [("insert-identity", False), (failing.name, True)]


# -- the rollback point: run the passes again instead of copying before each ---------------


class CountCopies:
    """Counts ``ir.Model.clone`` calls while installed; each takes at least ``seconds``."""

    def __init__(self, monkeypatch, seconds: float = 0.0):
        self.calls = 0
        real_clone = ir.Model.clone

        def counting_clone(model):
            self.calls += 1
            time.sleep(seconds)
            return real_clone(model)

        monkeypatch.setattr(ir.Model, "clone", counting_clone)


@pytest.fixture
def fake_clock(monkeypatch):
    """``time.perf_counter`` that only ``time.sleep`` advances (and sleeps that do not
    wait): the rollback's copy-or-run-again choice compares timings, which on a loaded
    machine the scheduler decides, not the passes."""
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(time, "sleep", sleep)
    return clock


class SlowInsertIdentityPass(InsertIdentityPass):
    """Takes far longer than ten copies of the small test model, so a copy after it pays."""

    name = "slow-insert-identity"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        time.sleep(0.05)
        return super().call(model)


class AddsMoreNodesEachRunPass(OrtPass):
    """Not deterministic: the n-th run adds n Neg nodes."""

    name = "adds-more-each-run"

    def __init__(self):
        self.runs = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.runs += 1
        for _ in range(self.runs):
            model.graph.append(ir.node("Neg", [model.graph.inputs[0]]))
        return ir.passes.PassResult(model, True)


@pytest.mark.parametrize("check", ["incremental", "none"])
def test_fast_passes_are_run_again_on_rollback_instead_of_copied_before(relu_model, check, monkeypatch, fake_clock):
    copies = CountCopies(monkeypatch, seconds=0.05)  # as if the model were large; the passes take no time
    passes = [InsertIdentityPass(), InsertIdentityPass(), ReluToMsGeluPass(), RaisesHalfwayPass()]
    snapshots = SnapshotBeforeEachPass()
    with pytest.raises(PassFailedError, match="boom") as info:
        PassManager(passes, check=check, instruments=[snapshots])(relu_model)
    # One copy of the caller's model for the first pass; the rollback rebuilt the model
    # from another copy of it, with the three passes run again (tags included).
    assert copies.calls == 2
    assert ir.to_proto(info.value.model).SerializeToString() == snapshots.before["raises-halfway"]
    assert op_types(info.value.model) == ["Identity", "Identity", "Gelu"]
    assert "could not rebuild" not in str(info.value)


@pytest.mark.parametrize("check", ["incremental", "none"])
def test_a_pass_much_slower_than_a_copy_is_followed_by_a_copy(relu_model, check, monkeypatch, fake_clock):
    copies = CountCopies(monkeypatch, seconds=0.001)  # 50 copies' time in the slow pass
    with pytest.raises(PassFailedError) as info:
        PassManager([SlowInsertIdentityPass(), InsertIdentityPass(), RaisesHalfwayPass()], check=check)(relu_model)
    # The caller's model, then the model after the slow pass; the rollback copies that
    # copy and runs insert-identity again on it, not the slow pass.
    assert copies.calls == 3
    assert op_types(info.value.model) == ["Identity", "Identity", "Relu"]


def test_a_pass_that_runs_differently_again_gets_the_earlier_model_back_and_says_so(relu_model):
    passes = [InsertIdentityPass(), AddsMoreNodesEachRunPass(), RaisesHalfwayPass()]
    with pytest.raises(PassFailedError, match="boom") as info:
        PassManager(passes, check="none")(relu_model)
    message = str(info.value)
    assert "could not rebuild the model before the failing pass" in message
    assert "running 'adds-more-each-run' again left 4 nodes, not 3" in message
    assert "given back instead: the model given to the manager" in message
    assert op_types(info.value.model) == ["Relu"]


def test_in_the_full_mode_the_serialization_is_the_rollback_point(relu_model, monkeypatch):
    passes = [InsertIdentityPass(), AddsMoreNodesEachRunPass(), RaisesHalfwayPass()]
    copies = CountCopies(monkeypatch)
    with pytest.raises(PassFailedError, match="boom") as info:
        PassManager(passes, check="full")(relu_model)
    # Nothing is run again: the model comes back from what the check serialized.
    assert copies.calls == 1
    assert op_types(info.value.model) == ["Identity", "Relu", "Neg"]
    assert "could not rebuild" not in str(info.value)


@pytest.mark.parametrize("check", ["full", "incremental"])
def test_an_invalid_input_is_refused_before_blaming_a_pass(relu_model, check):
    relu_model.graph.append(ir.node("Relu", [ir.Value(name="dangling")]))
    with pytest.raises(ModelLoadError, match="before any pass ran"):
        PassManager([NoOpPass()], check=check)(relu_model)


@pytest.mark.parametrize("check", ["full", "incremental"])
def test_an_input_newer_than_the_checker_is_refused_before_any_pass(relu_model, check):
    relu_model.ir_version = 99  # read outside the graph: the incremental mode checks the header
    with pytest.raises(ModelLoadError, match="before any pass ran.*ir_version 99 is higher"):
        PassManager([InsertIdentityPass()], check=check)(relu_model)


@pytest.fixture
def blind_input_check(monkeypatch):
    """An input check that sees nothing, standing for a flaw of the input that only the
    onnx checker itself finds (the incremental mode checks the input on the IR)."""
    monkeypatch.setattr("ortpass.infra.checkers.input_check", CheckedState.of)


def test_a_pass_failing_on_an_input_only_the_checker_refuses_blames_the_input(relu_model, blind_input_check):
    relu_model.graph.node(0).attributes["bogus"] = ir.AttrInt64("bogus", 1)
    with pytest.raises(ModelLoadError, match="(?s)input model fails the onnx checker.*bogus.*when pass 'raises-halfway' failed"):
        PassManager([RaisesHalfwayPass()], check="incremental")(relu_model)
    assert op_types(relu_model) == ["Relu"]


def test_a_final_check_refusing_what_the_input_brought_blames_the_input(
    relu_model, blind_input_check, blind_incremental_check
):
    relu_model.graph.node(0).attributes["bogus"] = ir.AttrInt64("bogus", 1)
    insert = InsertIdentityPass()
    runs = []
    insert.call = lambda model: (runs.append(model), InsertIdentityPass.call(insert, model))[1]
    with pytest.raises(ModelLoadError, match="(?s)input model fails the onnx checker.*bogus.*final check refused"):
        PassManager([insert], check="incremental")(relu_model)
    assert len(runs) == 1  # the input was looked at before running the passes again


@pytest.mark.parametrize("check", ["full", "incremental"])
def test_the_result_carries_the_serialization_the_last_check_accepted(relu_model, check):
    result = PassManager([InsertIdentityPass(), NoOpPass()], check=check)(relu_model)
    assert result.proto.SerializeToString() == ir.to_proto(result.model).SerializeToString()


def test_the_final_check_takes_the_weights_one_at_a_time_and_holds_no_serialization(monkeypatch):
    """Where the weights are graph inputs (ORTModule's graphs), the incremental mode's final
    onnx check sees each weight (a floating-point initializer that is a graph input) alone
    and the graph without them: no copy of the whole model's bytes is made or kept (a deep
    model's first call peaked there)."""
    import onnx

    weight = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]),
                      const_value=ir.tensor([1.0, 2.0], dtype=ir.DataType.FLOAT, name="w"))
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    node = ir.node("Add", [x, weight], num_outputs=1)
    node.outputs[0].name, node.outputs[0].type, node.outputs[0].shape = "y", ir.TensorType(ir.DataType.FLOAT), ir.Shape([2])
    graph = ir.Graph([x, weight], [node.outputs[0]], nodes=[node], initializers=[weight], opset_imports={"": 17},
                     name="g")
    model = ir.Model(graph, ir_version=8)
    tensors, models = [], []
    real_tensor, real_model = onnx.checker.check_tensor, onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_tensor", lambda t, *a: (tensors.append(t.name), real_tensor(t, *a))[1])
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, *a, **k: (models.append(m), real_model(m, *a, **k))[1])
    result = PassManager([InsertIdentityPass()], check="incremental")(model)
    assert result.proto is None
    assert tensors == ["w", "w"]  # the input check's, then the final check's
    final = models[-1]
    assert [i.name for i in final.graph.input] == ["x", "w"] and not final.graph.initializer


@pytest.mark.parametrize("check, passes", [("none", [InsertIdentityPass()]), ("incremental", [NoOpPass()])])
def test_no_serialization_is_carried_where_no_check_made_one(relu_model, check, passes):
    assert PassManager(passes, check=check)(relu_model).proto is None


def test_a_pass_reuses_the_node_listing_the_pass_before_left(relu_model, monkeypatch):
    listings = []
    real = manager_module.all_nodes
    monkeypatch.setattr(manager_module, "all_nodes", lambda model: (listings.append(model), real(model))[1])
    report = PassManager([InsertIdentityPass(), InsertIdentityPass(), NoOpPass()], check="none")(relu_model).report
    # The first pass's input (a copy of the caller's model), then each pass's output.
    assert len(listings) == 4
    assert [(r.nodes_before, r.nodes_after) for r in report.records] == [(1, 2), (2, 3), (3, 3)]


# -- the incremental check ------------------------------------------------------------------


class _BreaksModel(OrtPass):
    """Breaks the model in one way; ``how`` names it."""

    name = "breaks-model"

    def __init__(self, how: str):
        self.how = how

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        relu = graph.node(0)
        if self.how == "duplicate-output-name":
            graph.append(ir.node("Neg", [graph.inputs[0]], outputs=[ir.Value(name=relu.outputs[0].name)]))
        elif self.how == "unknown-attribute-on-an-old-node":
            relu.attributes["bogus"] = ir.AttrInt64("bogus", 1)
        elif self.how == "unknown-op":
            graph.append(ir.node("NoSuchOp", [graph.inputs[0]]))
        elif self.how == "wrong-input-count":
            graph.append(ir.node("Add", [graph.inputs[0]]))
        elif self.how == "out-of-order":
            neg = ir.node("Neg", [relu.outputs[0]])
            graph.insert_before(relu, neg)
        elif self.how == "undefined-graph-output":
            graph.outputs.append(ir.Value(name="nobody_makes_me", type=ir.TensorType(ir.DataType.FLOAT)))
        elif self.how == "unimported-domain":
            graph.append(ir.node("Gelu", [graph.inputs[0]], domain="com.microsoft"))
        elif self.how == "opset-too-old":  # changes the opset imports: a full check
            model.opset_imports[""] = 1
            graph.append(ir.node("Gelu", [graph.inputs[0]]))
        elif self.how == "unnamed-value":
            graph.append(ir.node("Neg", [graph.inputs[0]]))
            graph.node(1).outputs[0].name = None
        elif self.how == "required-input-named-empty":  # no node changes, only a name
            graph.node(0).outputs[0].name = ""
        elif self.how == "graph-name-emptied":
            graph.name = ""
        return ir.passes.PassResult(model, True)


BREAKAGES = [
    "duplicate-output-name", "unknown-attribute-on-an-old-node", "unknown-op", "wrong-input-count", "out-of-order",
    "undefined-graph-output", "unimported-domain", "opset-too-old", "unnamed-value", "required-input-named-empty",
    "graph-name-emptied",
]


@pytest.mark.parametrize("how", BREAKAGES)
@pytest.mark.parametrize("check", ["full", "incremental"])
def test_both_check_modes_refuse_what_the_onnx_checker_refuses(relu_model, how, check):
    before = ir.to_proto(relu_model).SerializeToString()
    with pytest.raises(PassFailedError, match="fails the onnx checker after this pass") as info:
        PassManager([InsertIdentityPass(), _BreaksModel(how)], check=check)(relu_model)
    assert op_types(info.value.model) == ["Identity", "Relu"]
    assert ir.to_proto(relu_model).SerializeToString() == before


def test_the_incremental_check_gives_the_same_model_as_the_full_one(relu_model):
    full = run_three(relu_model, check="full")
    incremental = run_three(relu_model, check="incremental")
    assert ir.to_proto(incremental.model).SerializeToString() == ir.to_proto(full.model).SerializeToString()
    assert [r.name for r in incremental.report.records] == [r.name for r in full.report.records]


@pytest.fixture
def spy_incremental_check(monkeypatch):
    """The op types of the nodes the incremental checks looked at, and of those they
    asked onnx's ``check_node`` about."""
    looked_at, asked = [], []
    real_signature, real_check_node = checks._signature, onnx.checker.C.check_node

    def signature(node, *rest):
        looked_at.append(node.op_type)
        return real_signature(node, *rest)

    def check_node(data, *args):
        asked.append(onnx.NodeProto.FromString(data).op_type)
        return real_check_node(data, *args)

    monkeypatch.setattr(checks, "_signature", signature)
    monkeypatch.setattr(onnx.checker.C, "check_node", check_node)
    return looked_at, asked


def test_the_incremental_check_looks_again_only_at_new_and_changed_nodes(relu_model, spy_incremental_check):
    looked_at, asked = spy_incremental_check
    PassManager([InsertIdentityPass(), InsertIdentityPass()], check="incremental")(relu_model)
    # The input's Relu (the output goes through the onnx checker itself); the first
    # Identity and the Relu now reading it; the second Identity and the first one, now
    # reading it.  The Relu, which the second pass left alone, is not looked at again.
    assert looked_at == ["Relu", "Identity", "Relu", "Identity", "Identity"]
    # check_node decides on a node's op, attributes and which inputs are present: the
    # rewired Relu and the second pass's nodes are like ones it accepted already.
    assert asked == ["Relu", "Identity"]


class InsertLeakyReluPass(OrtPass):
    """Puts a LeakyRelu with the given alpha in front of the first node."""

    name = "insert-leaky-relu"

    def __init__(self, alpha: float):
        self.alpha = alpha

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        first = model.graph.node(0)
        leaky = ir.node("LeakyRelu", [first.inputs[0]], attributes={"alpha": self.alpha})
        model.graph.insert_before(first, leaky)
        first.replace_input_with(0, leaky.outputs[0])
        return ir.passes.PassResult(model, True)


def test_a_node_with_other_attribute_values_is_checked_again(relu_model, spy_incremental_check):
    _, asked = spy_incremental_check
    PassManager([InsertLeakyReluPass(0.1), InsertLeakyReluPass(0.1), InsertLeakyReluPass(0.2)], check="incremental")(
        relu_model
    )
    assert asked == ["Relu", "LeakyRelu", "LeakyRelu"]


class ImportsDomainPass(InsertIdentityPass):
    """Inserts an Identity, and imports ``domain`` at ``version``."""

    name = "imports-domain"

    def __init__(self, domain: str, version: int):
        self.domain, self.version = domain, version

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        model.opset_imports[self.domain] = self.version
        return super().call(model)


@pytest.mark.parametrize(
    "domain, version, full",
    [("com.microsoft", 1, False), ("", 14, True)],
    ids=["a-domain-added", "a-domain-at-another-version"],
)
def test_only_a_changed_opset_import_makes_the_incremental_check_a_full_one(relu_model, monkeypatch, domain, version, full):
    fallbacks = []
    real = checks.full_check
    monkeypatch.setattr(checks, "full_check", lambda model: (fallbacks.append(model), real(model))[1])
    PassManager([InsertIdentityPass(), ImportsDomainPass(domain, version)], check="incremental")(relu_model)
    assert len(fallbacks) == int(full)


def test_a_changed_graph_input_shape_is_checked_again(relu_model, spy_incremental_check, monkeypatch):
    seen = []
    real = onnx.checker.check_value_info
    monkeypatch.setattr(onnx.checker, "check_value_info", lambda proto, ctx: (seen.append(proto.name), real(proto, ctx)))

    class ChangesInputShape(InsertIdentityPass):
        def call(self, model):
            model.graph.inputs[0].shape = ir.Shape([7])
            return super().call(model)

    PassManager([InsertIdentityPass(), ChangesInputShape()], check="incremental")(relu_model)
    # The input check saw the graph's input and output; after the first pass nothing of
    # them changed, after the second the input's shape did.
    graph = relu_model.graph
    assert seen == [graph.inputs[0].name, graph.outputs[0].name, graph.inputs[0].name]


def test_an_unknown_check_mode_is_refused():
    with pytest.raises(ValueError, match="check must be"):
        PassManager([NoOpPass()], check="quick")


def test_check_modes_by_name_and_by_bool():
    assert PassManager([]).check == "incremental"
    assert PassManager([], check=True).check == "full"
    assert PassManager([], check=False).check == "none"


def test_the_manager_nests_inside_an_onnx_ir_pass_manager(relu_model):
    outer = ir.passes.PassManager([PassManager([InsertIdentityPass()]), IdentityEliminationPass()])
    result = outer(relu_model)
    assert op_types(result.model) == ["Relu"]
    assert op_types(relu_model) == ["Relu"]


# -- report -------------------------------------------------------------------------------


def run_three(model: ir.Model, **kwargs) -> ManagerResult:
    passes = [InsertIdentityPass(), NoOpPass(), ReluToMsGeluPass(), IdentityEliminationPass()]
    return PassManager(passes, **kwargs)(model)


def test_report_counts_nodes_added_and_removed_by_op_type_and_pass_statistics(relu_model):
    report = run_three(relu_model).report
    assert [r.name for r in report.records] == [
        "insert-identity", "no-op", "relu-to-ms-gelu", "IdentityEliminationPass",
    ]
    ins, noop, gelu, elim = report.records
    assert (ins.added, ins.removed, ins.nodes_before, ins.nodes_after) == ({"Identity": 1}, {}, 1, 2)
    assert ins.stats == {"counts": {"identities inserted": 1}}
    assert ins.modified and not noop.modified
    assert (noop.added, noop.removed, noop.stats) == ({}, {}, {})
    # A contrib op passes the onnx checker (it has no schema for com.microsoft).
    assert (gelu.added, gelu.removed) == ({"com.microsoft::Gelu": 1}, {"Relu": 1})
    assert gelu.stats == {"counts": {"relus replaced": 1}}
    # A plain onnx_ir pass: no statistics of its own, but the diff is still measured.
    assert (elim.added, elim.removed, elim.stats) == ({}, {"Identity": 1}, {})
    assert (elim.nodes_before, elim.nodes_after) == (2, 1)
    assert all(r.seconds >= 0 and r.check_seconds >= 0 for r in report.records)
    assert report.modified


def test_report_json_round_trip_and_save(relu_model, tmp_path):
    report = run_three(relu_model).report
    assert PassReport.from_json(report.to_json()) == report
    path = tmp_path / "sub" / "report.json"
    report.save(path)
    data = json.loads(path.read_text())
    assert data == report.to_dict()
    assert data["passes"][0]["added"] == {"Identity": 1}


def test_report_table_has_a_row_per_pass_with_its_changes(relu_model):
    table = run_three(relu_model).report.to_table()
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["#", "pass", "ms"]
    rows = {line.split()[1]: line for line in lines[2:-1]}
    assert list(rows) == ["insert-identity", "no-op", "relu-to-ms-gelu", "IdentityEliminationPass"]
    assert "Identity+1" in rows["insert-identity"] and "identities inserted=1" in rows["insert-identity"]
    assert "com.microsoft::Gelu+1" in rows["relu-to-ms-gelu"] and "Relu-1" in rows["relu-to-ms-gelu"]
    assert " no " in rows["no-op"]
    assert lines[-1].startswith("total: 4 passes") and lines[-1].endswith("nodes 1 -> 1")
    # fixed width: every row's "changed" column starts at the same offset
    column = lines[0].index("changed")
    assert {line[column:].split()[0] for line in lines[2:-1]} == {"yes", "no"}


def test_a_failed_pass_shows_in_the_table(relu_model):
    with pytest.raises(PassFailedError) as info:
        PassManager([RaisesHalfwayPass()])(relu_model)
    assert "FAILED" in info.value.report.to_table() and "boom" in info.value.report.to_table()


# -- dump_dir and instruments -----------------------------------------------------------------


def test_dump_dir_holds_one_file_per_changing_pass(relu_model, tmp_path):
    result = run_three(relu_model, dump_dir=tmp_path / "dumps")
    files = sorted(p.name for p in (tmp_path / "dumps").iterdir())
    assert files == ["01_insert-identity.onnx", "03_relu-to-ms-gelu.onnx", "04_IdentityEliminationPass.onnx"]
    third = onnx.load(str(tmp_path / "dumps" / "03_relu-to-ms-gelu.onnx"))
    assert [n.op_type for n in third.graph.node] == ["Identity", "Gelu"]
    assert result.report["no-op"].dump_path is None


def test_dump_dir_keeps_the_input_of_a_failing_pass(relu_model, tmp_path):
    with pytest.raises(PassFailedError):
        PassManager([InsertIdentityPass(), RaisesHalfwayPass()], dump_dir=tmp_path)(relu_model)
    kept = onnx.load(str(tmp_path / "02_raises-halfway.failed-input.onnx"))
    assert [n.op_type for n in kept.graph.node] == ["Identity", "Relu"]


class CallLog:
    def __init__(self):
        self.calls = []

    def run_begin(self, passes, model):
        self.calls.append(("run_begin", len(passes)))

    def before_pass(self, pass_, model):
        self.calls.append(("before", pass_.name, len(model.graph)))

    def after_pass(self, pass_, model, record):
        self.calls.append(("after", record.name, len(model.graph), record.failed))

    def run_end(self, model, report):
        self.calls.append(("run_end", len(report.records)))


def test_instruments_see_every_pass_and_the_rolled_back_model(relu_model):
    log = CallLog()
    with pytest.raises(PassFailedError):
        PassManager([InsertIdentityPass(), RaisesHalfwayPass()], instruments=[log, object()])(relu_model)
    assert log.calls == [
        ("run_begin", 2),
        ("before", "insert-identity", 1),
        ("after", "insert-identity", 2, False),
        ("before", "raises-halfway", 2),
        ("after", "raises-halfway", 2, True),  # the model before the failing pass
        ("run_end", 1 + 1),
    ]


def test_progress_instrument_logs_position_and_outcome(relu_model, caplog):
    caplog.set_level(logging.INFO, logger="ortpass.infra.instruments")
    PassManager([InsertIdentityPass(), NoOpPass()], instruments=[ProgressInstrument()])(relu_model)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(messages) == 2
    assert messages[0].startswith("[1/2] insert-identity: changed, 1 -> 2 nodes (")
    assert messages[1].startswith("[2/2] no-op: unchanged (")


# -- import cost ----------------------------------------------------------------------------


def _modules_after_import(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(done.stdout.split())


def test_importing_the_manager_and_the_command_does_not_start_onnxruntime():
    assert "onnxruntime" not in _modules_after_import("import ortpass, ortpass.infra.manager, ortpass.cli")


def test_importing_ortpass_does_not_import_torch():
    assert "torch" not in _modules_after_import("import ortpass")


def test_table_cells_list_the_commonest_op_types_and_count_the_rest():
    from ortpass.infra.report import _format_counts

    counts = {f"Op{i}": i for i in range(1, 10)}  # 9 types, 45 nodes
    assert _format_counts(counts, "+") == "Op9+9 Op8+8 Op7+7 Op6+6 Op5+5 Op4+4 (+3 types, +6)"
    assert _format_counts({}, "-") == "-"


# -- the analysis cache ---------------------------------------------------------------------


class CountsRelus(OrtPass):
    """Reads an 'relu-count' analysis through the run's cache; changes nothing."""

    name = "counts-relus"
    computed = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        def compute():
            type(self).computed += 1
            return sum(n.op_type == "Relu" for n in model.graph)

        cache = self.analysis_cache
        count = compute() if cache is None else cache.get(("relu-count",), model, compute)
        self.count("relus", count)
        return ir.passes.PassResult(model, False)


class PreservingIdentityPass(InsertIdentityPass):
    name = "insert-identity-preserving"
    preserves_analyses = frozenset({"relu-count"})  # an Identity is not a Relu


@pytest.mark.parametrize(
    "between, computed",
    [
        (NoOpPass(), 1),  # changes nothing: the analysis stays valid
        (PreservingIdentityPass(), 1),  # changes the model but declares the analysis valid
        (InsertIdentityPass(), 2),  # changes the model: the analysis is computed again
    ],
    ids=["unchanged", "preserved", "invalidated"],
)
def test_a_cached_analysis_lives_until_a_pass_changes_the_model(relu_model, between, computed):
    CountsRelus.computed = 0
    first, second = CountsRelus(), CountsRelus()
    second.name = "counts-relus-again"
    PassManager([first, between, second])(relu_model)
    assert CountsRelus.computed == computed
    assert first.analysis_cache is None  # lent for the call only
    CountsRelus()(relu_model)  # alone: no cache, computed
    assert CountsRelus.computed == computed + 1


class RecordsGcState(NoOpPass):
    name = "records-gc-state"
    seen: list[bool] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        type(self).seen.append(gc.isenabled())
        return super().call(model)


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_cyclic_gc_is_paused_during_a_run_and_restored(relu_model, enabled_before):
    RecordsGcState.seen = []
    (gc.enable if enabled_before else gc.disable)()
    try:
        PassManager([RecordsGcState()])(relu_model)
        assert RecordsGcState.seen == [False]
        assert gc.isenabled() == enabled_before
        with pytest.raises(PassFailedError):
            PassManager([RaisesHalfwayPass()])(relu_model)
        assert gc.isenabled() == enabled_before
    finally:
        gc.enable()


class DropsACopy(NoOpPass):
    """Makes a copy of the model and drops it: cyclic garbage, which a paused collector keeps."""

    name = "drops-a-copy"
    dropped: list = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        copy = model.clone()
        type(self).dropped.append(weakref.ref(copy.graph))
        del copy
        return super().call(model)


class SeesTheCopyFreed(NoOpPass):
    name = "sees-the-copy-freed"
    seen: list = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        type(self).seen.append((gc.isenabled(), [ref() is None for ref in DropsACopy.dropped]))
        return super().call(model)


def test_garbage_a_pass_leaves_is_collected_before_the_next_once_it_outgrows_the_live_objects(relu_model, monkeypatch):
    """Issue 59: paused for the whole run, the collector kept every dropped model copy until
    the run ended (+5.8 GiB on an 80-layer LLaMA).  Between passes it now collects once the
    objects made since its last collection outnumber those alive after it (here: always)."""
    from ortpass.infra import gc_pause

    monkeypatch.setattr(gc_pause.CyclicGcPaused, "MIN_PENDING", 0)
    monkeypatch.setattr(gc_pause.CyclicGcPaused, "GROWTH", 0.0)
    DropsACopy.dropped, SeesTheCopyFreed.seen = [], []
    gc.collect()
    PassManager([DropsACopy(), SeesTheCopyFreed()])(relu_model)
    assert SeesTheCopyFreed.seen == [(False, [True])]  # freed between the passes, the collector paused in both


def test_a_small_run_is_not_collected_between_passes(relu_model):
    DropsACopy.dropped, SeesTheCopyFreed.seen = [], []
    gc.collect()
    PassManager([DropsACopy(), SeesTheCopyFreed()])(relu_model)
    assert SeesTheCopyFreed.seen == [(False, [False])]  # far fewer new objects than alive ones: no collection
    gc.collect()
    assert DropsACopy.dropped[0]() is None


class NegInThenBranchPass(OrtPass):
    """Puts a Neg after the output of the first node's then_branch (a node in a subgraph)."""

    name = "neg-in-then-branch"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        branch = model.graph.node(0).attributes["then_branch"].value
        typed = {"type": ir.TensorType(ir.DataType.FLOAT), "shape": ir.Shape([2])}
        neg = ir.node("Neg", [branch.outputs[0]], outputs=[ir.Value(name="then_negated", **typed)])
        branch.append(neg)
        branch.outputs[0] = neg.outputs[0]
        return ir.passes.PassResult(model, True)


def test_nodes_created_in_a_subgraph_are_counted_and_tagged():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    cond = ir.Value(name="cond", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))

    def branch(op: str) -> ir.Graph:
        node = ir.node(op, [x], outputs=[ir.Value(name=f"{op.lower()}_out", type=x.type, shape=x.shape)])
        return ir.Graph([], [node.outputs[0]], nodes=[node], name=f"{op.lower()}_branch")

    if_node = ir.node("If", [cond], attributes={"then_branch": branch("Relu"), "else_branch": branch("Abs")})
    if_node.outputs[0].name, if_node.outputs[0].type, if_node.outputs[0].shape = "y", x.type, x.shape
    graph = ir.Graph([cond, x], [if_node.outputs[0]], nodes=[if_node], opset_imports={"": 18}, name="main")
    model = ir.Model(graph, ir_version=10)
    result = PassManager([NegInThenBranchPass()])(model)
    assert result.report["neg-in-then-branch"].added == {"Neg": 1}
    then_branch = result.model.graph.node(0).attributes["then_branch"].value
    assert [n.op_type for n in then_branch] == ["Relu", "Neg"]
    assert then_branch.node(1).metadata_props[CREATED_BY_KEY] == "neg-in-then-branch"


# -- the incremental mode's final check -----------------------------------------------------


@pytest.fixture
def blind_incremental_check(monkeypatch):
    """An incremental check that sees nothing, standing for what it cannot see (say, a
    tensor changed in place): only the final check can catch a broken model then."""
    monkeypatch.setattr("ortpass.infra.checkers.incremental_check", lambda model, previous: CheckedState.of(model))


class BreaksTheModelOnlyTheFirstTimePass(ReadsUndefinedValuePass):
    name = "breaks-only-once"

    def __init__(self):
        self.runs = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.runs += 1
        if self.runs == 1:
            return super().call(model)
        model.graph.append(ir.node("Neg", [model.graph.inputs[0]]))
        return ir.passes.PassResult(model, True)


def test_the_incremental_mode_ends_with_the_onnx_checker_once(relu_model, monkeypatch):
    checked = []
    real_check = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda proto, *a, **k: (checked.append(len(proto.graph.node)), real_check(proto, *a, **k)))
    report = PassManager([InsertIdentityPass(), InsertIdentityPass(), NoOpPass()], check="incremental")(relu_model).report
    # The input's header (its graph's rules were checked on the IR) and the whole output,
    # not what the passes gave each other.
    assert checked == [0, 3]
    assert report.final_check_seconds > 0
    assert report.total_seconds >= report.final_check_seconds
    assert PassReport.from_json(report.to_json()).final_check_seconds == report.final_check_seconds
    assert f"(final check {report.final_check_seconds * 1000:.1f})" in report.to_table().splitlines()[-1]
    checked.clear()
    assert PassManager([NoOpPass()], check="incremental")(relu_model).report.final_check_seconds == 0
    assert checked == [0]  # the input's header; nothing changed, so nothing more to check


def test_the_final_check_names_the_pass_the_incremental_checks_let_through(relu_model, blind_incremental_check):
    snapshots = SnapshotBeforeEachPass()
    passes = [InsertIdentityPass(), ReadsUndefinedValuePass(), NoOpPass(), ReluToMsGeluPass()]
    with pytest.raises(PassFailedError, match="after this pass \\(the final check found it\\).*never_defined") as info:
        PassManager(passes, check="incremental", instruments=[snapshots])(relu_model)
    error = info.value
    assert error.pass_name == "reads-undefined"
    assert ir.to_proto(error.model).SerializeToString() == snapshots.before["reads-undefined"]
    assert [(r.name, r.failed) for r in error.report.records] == [("insert-identity", False), ("reads-undefined", True)]
    assert op_types(relu_model) == ["Relu"]


def test_the_final_check_also_looks_after_a_pass_that_says_unchanged_but_added_nodes(relu_model, blind_incremental_check):
    with pytest.raises(PassFailedError, match="the final check found it.*never_defined") as info:
        PassManager([ReadsUndefinedButSaysUnchangedPass()], check="incremental")(relu_model)
    assert info.value.pass_name == "lies-about-changes"
    assert op_types(info.value.model) == ["Relu"]


def test_the_final_check_says_so_when_no_pass_can_be_blamed(relu_model, blind_incremental_check):
    with pytest.raises(PassFailedError, match="yet no pass's output did when the passes ran again") as info:
        PassManager([InsertIdentityPass(), BreaksTheModelOnlyTheFirstTimePass()], check="incremental")(relu_model)
    assert op_types(info.value.model) == ["Relu"]  # nothing applied
