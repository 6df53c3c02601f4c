"""Property tests: every built-in pass, on random small training graphs.

For each pass named by ``ortpass.available_passes()`` (new passes are covered without
editing this file), configured so that it fires where it can (``FIRING_OPTIONS``):

1. either the pass reports ``modified=False`` and the serialized model is byte-for-byte
   what it was, or ONNX Runtime computes the same loss and gradients from the rewritten
   model as from the model before the pass (fp32, relative error 1e-5 in the sense of
   ``ortpass.runtime.parity.relative_error``);
2. running the pass again on its own output changes nothing (``modified=False`` and equal
   bytes);
3. the onnx checker accepts the output.

Pre-grad passes run on the forward+loss model and are compared through the training
graphs built from the model before and after them; post-grad passes run on the training
graph.  A pass that requires a property another pass provides (recompute requires
"dropout-seeds-fixed") is compared against the model after those providers, run with the
same options.  Dropout nodes carry seeds (see ``ortpass.testing.graphs``), so both sides
draw the same masks.

The graphs come from ``ortpass.testing.graphs``: chains and DAGs of MatMul, Add, Mul, Gelu,
Tanh, Relu, Sigmoid, Reshape, Transpose, Dropout, LayerNormalization and Softmax ending in
SoftmaxCrossEntropyLoss (labels at a random density of valid rows) or ReduceMean.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ortpass
from ortpass.testing.graphs import (
    RATIO_PREFIX,
    STEP_KINDS,
    GraphRecipe,
    LossRecipe,
    Step,
    build_model,
    make_batch,
    params_of,
)

# Fixed for CI: the same examples on every run (derandomize), no example database, no
# per-example deadline (the first example pays for importing ONNX Runtime).
PROPERTY_SETTINGS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

RTOL = 1e-5
RUN_SEED = 1234  # ORT's global generator, for any Dropout without its own seed

#: Options that make a pass fire on graphs where it can.  "ALL_DETECTED" stands for the
#: plan strings the recompute analysis finds in the graph at hand (layer boundaries are
#: rare in random graphs, so levels 1 and 2 alone would mostly select nothing).
ALL_DETECTED = object()
FIRING_OPTIONS: dict[str, list[dict[str, Any]]] = {
    "insert-gather-before-sce-loss": [{"force": True}, {"force": True, "move_above_projection": True}],
    "recompute": [
        {"level": 1, "min_elements": 0},
        {"level": 2, "min_elements": 0},
        {"plans": ALL_DETECTED, "min_elements": 0},
    ],
    "fix-dropout-seed": [{"level": 1, "min_elements": 0}, {"plans": ALL_DETECTED, "min_elements": 0}],
}
#: Passes whose purpose is to change where Dropout draws its random numbers (a seed of its
#: own instead of ORT's global generator): their output draws other masks by design, so
#: they are compared with every Dropout ratio set to 0 on both sides.
CHANGES_RANDOM_STREAM = {"fix-dropout-seed"}


def _seeded_as_replay_seeds(model: ir.Model) -> ir.Model:
    """``model`` with each unseeded Dropout given the seed replay-dropout-mask gives it."""
    from ortpass.ops.dropout import dropout_seed

    copy = model.clone()
    for node in copy.graph:
        if node.op_type == "Dropout" and "seed" not in node.attributes:
            node.attributes["seed"] = ir.AttrInt64("seed", dropout_seed(node))
    return copy


#: Passes that seed Dropouts as part of a rewrite that must keep the numbers of the seeded
#: graph: compared, with dropout on, against their input seeded the same way.
SEEDED_REFERENCE = {"replay-dropout-mask": _seeded_as_replay_seeds}
#: Passes that are not rewrites of a given model and so have no property to check here.
NOT_A_REWRITE = {"build-training-graph"}  # it is the gradient build every case starts with


# -- strategies -------------------------------------------------------------------------


# Dropout, MatMul and Gelu twice as likely: they make the stashed activations that
# recompute and fix-dropout-seed act on.
steps = st.builds(
    Step,
    kind=st.sampled_from(STEP_KINDS + ("Dropout", "MatMul", "Gelu")),
    source=st.sampled_from([0, 0, 0, 1, 2]),  # mostly the latest value: fewer dead branches
    other=st.integers(0, 3),
    width=st.sampled_from([4, 6, 8]),
    ratio=st.sampled_from([0.1, 0.5]),
    with_param=st.booleans(),
    seeded=st.sampled_from([False, True]),
)
losses = st.one_of(
    st.builds(
        LossRecipe,
        kind=st.just("sce"),
        classes=st.integers(2, 7),
        reduction=st.sampled_from(["mean", "sum"]),
        ignore_index=st.booleans(),
    ),
    st.just(LossRecipe(kind="mean")),
    st.just(LossRecipe(kind="sce", classes=5, reduction="mean", ignore_index=True)),
)


def _with_unseeded_dropout(drawn: tuple[bool, list[Step]]) -> tuple[Step, ...]:
    """Half the recipes start with MatMul -> unseeded Dropout, which fix-dropout-seed seeds
    and recompute clones: drawn freely, a Dropout often ends up seeded or in a dead branch."""
    prefix, rest = drawn
    start = (Step("MatMul", width=8), Step("Dropout", seeded=False)) if prefix else ()
    return start + tuple(rest)


recipes = st.builds(
    GraphRecipe,
    batch_shape=st.sampled_from([(4, 6), (3, 8), (2, 3, 4)]),
    steps=st.tuples(st.booleans(), st.lists(steps, min_size=2, max_size=8)).map(_with_unseeded_dropout),
    loss=losses,
    seed=st.integers(0, 1000),
)
densities = st.sampled_from([0.1, 0.5, 1.0])


# -- helpers ----------------------------------------------------------------------------


def _bytes(model: ir.Model) -> bytes:
    return ir.to_proto(model).SerializeToString()


def _training_graph(forward: ir.Model) -> ir.Model:
    from ortpass.training import build_training_graph

    return build_training_graph(forward, params=params_of(forward))


def _step(training: ir.Model, batch: dict[str, np.ndarray]):
    from ortpass.runtime import TrainingSession

    return TrainingSession(training).run(batch, seed=RUN_SEED)


def _without_dropout(model: ir.Model) -> ir.Model:
    """A copy whose Dropout ratios (the generator's ``ratio_<n>`` initializers) are 0."""
    model = model.clone()
    for name, value in model.graph.initializers.items():
        if name.startswith(RATIO_PREFIX):
            value.const_value = ir.tensor(np.array(0.0, np.float32), name=name)
    return model


def _assert_same_step(before: ir.Model, after: ir.Model, batch: dict[str, np.ndarray], what: str, *,
                      dropout: bool = True) -> None:
    from ortpass.runtime.parity import relative_error

    if not dropout:
        before, after = _without_dropout(before), _without_dropout(after)
    expected, actual = _step(before, batch), _step(after, batch)
    errors = {"loss": relative_error(np.float64(actual.loss), np.float64(expected.loss))}
    assert set(actual.gradients) == set(expected.gradients), what
    for name, grad in expected.gradients.items():
        errors[name] = relative_error(actual.gradients[name], grad)
    bad = {k: f"{v:.2e}" for k, v in errors.items() if not v <= RTOL}
    assert not bad, f"{what}: loss/gradients differ beyond {RTOL:g}: {bad}"


def _accepts(cls: type, key: str) -> bool:
    params = inspect.signature(cls).parameters
    return key in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _resolve(options: dict[str, Any], training: ir.Model) -> dict[str, Any] | None:
    """Options with ALL_DETECTED replaced by the detected plan strings (None: no plan)."""
    if options.get("plans") is not ALL_DETECTED:
        return dict(options)
    from ortpass.analysis import find_recompute_candidates

    report = find_recompute_candidates(training, min_elements=options.get("min_elements", 0))
    plans = [record.plan_string for record in report.plans]
    return {**options, "plans": plans} if plans else None


def _providers_of(cls: type, options: dict[str, Any]) -> list[ir.passes.PassBase]:
    """Instances of the registered passes that provide what ``cls`` requires, with the
    options of ``options`` they accept."""
    wanted = set(getattr(cls, "requires_properties", ()))
    found = []
    for name in ortpass.available_passes():
        other = ortpass.get_pass(name)
        if other is cls or not wanted & set(getattr(other, "provides_properties", ())):
            continue
        found.append(other(**{k: v for k, v in options.items() if _accepts(other, k)}))
    return found


def _check_pass(cls: type, options: dict[str, Any], model: ir.Model, batch, *, training: bool) -> bool:
    """Run the three properties for one pass instance on ``model``; True if it fired."""
    for provider in _providers_of(cls, options):
        model = provider(model.clone()).model
    what = f"{cls.__name__}({options})"
    before = _bytes(model)
    result = cls(**options)(model.clone())
    after = _bytes(result.model)
    onnx.checker.check_model(ir.to_proto(result.model))
    if not result.modified:
        assert after == before, f"{what} reported modified=False but changed the model"
    else:
        name = getattr(cls, "name", "")
        dropout = name not in CHANGES_RANDOM_STREAM
        if training:
            reference = SEEDED_REFERENCE[name](model) if name in SEEDED_REFERENCE else model
            _assert_same_step(reference, result.model, batch, what, dropout=dropout)
        else:
            _assert_same_step(_training_graph(model), _training_graph(result.model), batch, what, dropout=dropout)
    again = cls(**options)(result.model.clone())
    assert not again.modified, f"{what} modified its own output again: {getattr(again, 'stats', None)}"
    assert _bytes(again.model) == after, f"{what} run twice changed the bytes"
    return bool(result.modified)


def _pass_names() -> list[str]:
    return sorted(name for name in ortpass.available_passes() if name not in NOT_A_REWRITE)


# -- the property -----------------------------------------------------------------------


@pytest.mark.parametrize("pass_name", _pass_names())
@PROPERTY_SETTINGS
@given(recipe=recipes, density=densities)
def test_pass_keeps_loss_and_gradients(pass_name: str, recipe: GraphRecipe, density: float) -> None:
    cls = ortpass.get_pass(pass_name)
    phase = getattr(cls, "phase", "any")
    forward = build_model(recipe)
    training = _training_graph(forward)
    batch = make_batch(recipe, density=density, seed=recipe.seed)
    for options in FIRING_OPTIONS.get(pass_name, [{}]):
        resolved = _resolve(options, training)
        if resolved is None:
            continue
        fired = False
        if phase in ("pre-grad", "any"):
            fired |= _check_pass(cls, resolved, forward, batch, training=False)
        if phase in ("post-grad", "any"):
            fired |= _check_pass(cls, resolved, training, batch, training=True)
        # Shown by --hypothesis-show-statistics: how often each configuration rewrote.
        shown = ", ".join(f"{k}={'<detected>' if v is ALL_DETECTED else v}" for k, v in options.items())
        event(f"{pass_name}({shown}) fired={fired}")


def test_the_generator_makes_graphs_the_passes_rewrite() -> None:
    """The property above is vacuous if no pass ever fires: check a fixed recipe where
    recompute and the gather both apply (a Gelu stashed for backward, an SCE loss)."""
    recipe = GraphRecipe(
        batch_shape=(4, 6),
        steps=(Step("MatMul", width=8), Step("Gelu"), Step("Dropout"), Step("MatMul", width=8)),
        loss=LossRecipe("sce", classes=5, reduction="mean", ignore_index=True),
    )
    forward = build_model(recipe)
    training = _training_graph(forward)
    batch = make_batch(recipe, density=0.5)
    gather = ortpass.get_pass("insert-gather-before-sce-loss")
    assert _check_pass(gather, {"force": True}, forward, batch, training=False)
    recompute = ortpass.get_pass("recompute")
    assert _check_pass(recompute, _resolve({"plans": ALL_DETECTED, "min_elements": 0}, training), training, batch, training=True)
