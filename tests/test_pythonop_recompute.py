"""Recompute through a FlashAttention-like PythonOp: the clone replays forward's RNG state.

Expected values come from the no-recompute graph run on ORT with torch's generator seeded
alike: attention dropout inside the Function draws from torch's generator, so without the
replay the clone (run later, in backward) would draw a different mask and every gradient
upstream of attention would change.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch
from torch import nn

import ortpass
from ortpass.analysis import find_recompute_candidates
from ortpass.export import export
from ortpass.passes import FixDropoutSeedPass, RecomputePass
from ortpass.pythonop import bridge, rng_replay
from ortpass.pythonop.export import qualified_name
from ortpass.runtime import TrainingSession
from ortpass.testing.flash_attention import FlashAttentionFunction
from ortpass.training import build_training_graph

BATCH, SEQ, HEADS, HEAD_DIM = 2, 16, 2, 8
HIDDEN = HEADS * HEAD_DIM
FLASH = qualified_name(FlashAttentionFunction)


class FlashAttentionRegression(nn.Module):
    """x -> q, k, v projections -> FlashAttentionFunction (dropout 0.3) -> projection -> MSE.

    Shapes are Python ints, so the exported Reshapes take constant shapes and the recompute
    subgraph can grow from the PythonOp up to the projections.
    """

    def __init__(self, dropout: float = 0.3):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.dropout = dropout

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(BATCH, SEQ, HEADS, HEAD_DIM).transpose(1, 2)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        attended = FlashAttentionFunction.apply(q, k, v, self.dropout, True, 0.5)
        y = self.out(attended.transpose(1, 2).reshape(BATCH, SEQ, HIDDEN))
        return nn.functional.mse_loss(y, target)


@pytest.fixture(scope="module")
def training_graph() -> ir.Model:
    torch.manual_seed(0)
    model = FlashAttentionRegression()
    x, target = torch.randn(BATCH, SEQ, HIDDEN), torch.randn(BATCH, SEQ, HIDDEN)
    return build_training_graph(export(model, (x, target), input_names=["x", "target"]))


@pytest.fixture(scope="module")
def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "x": rng.standard_normal((BATCH, SEQ, HIDDEN), dtype=np.float32),
        "target": rng.standard_normal((BATCH, SEQ, HIDDEN), dtype=np.float32),
    }


def _pythonop_plan(model: ir.Model) -> str:
    """Every type-1 plan through the PythonOp (the PythonOp entry itself, and the
    projection's input that ends in it); their subgraphs share the PythonOp's clone."""
    report = find_recompute_candidates(model, min_elements=0)
    plans = [p.plan_string for p in report.plans if "PythonOp+" in p.cluster and p.type == 1]
    assert plans, report.to_table()
    return ",".join(plans)


def _recompute(model: ir.Model, plan: str) -> ir.Model:
    passes = [RecomputePass(plan, min_elements=0), FixDropoutSeedPass(plan, min_elements=0)]
    return ortpass.PassManager(passes, assume=["training-graph"])(model).model


def _pythonops(model: ir.Model, op_type: str = "PythonOp") -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == op_type and n.domain == "com.microsoft"]


def test_flash_attention_function_matches_autograd_of_the_same_math():
    # The hand-written backward against torch autograd of the same forward, mask included.
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    torch.manual_seed(7)
    out = FlashAttentionFunction.apply(q, k, v, 0.4, True, 0.5)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    torch.manual_seed(7)
    scores = (q @ k.transpose(-2, -1)) * 0.5
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    keep = (torch.rand(scores.shape) >= 0.4).to(torch.float64) / 0.6
    expected = (scores.softmax(-1) * keep) @ v
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))):
        torch.testing.assert_close(got, want)


def test_the_function_is_registered_as_recomputable_and_runnable():
    from ortpass.analysis.recomputable_ops import recomputable_functions

    assert FLASH in recomputable_functions()
    assert bridge.registered_functions()[FLASH] is FlashAttentionFunction


def test_pythonop_clone_replays_rng_and_feeds_pythonop_grad(training_graph):
    plan = _pythonop_plan(training_graph)
    model = _recompute(training_graph, plan)

    forward, clone = sorted(_pythonops(model), key=lambda n: n.name.endswith("_recompute"))
    assert clone.name == forward.name + "_recompute"
    # Forward: inference mode, two extra uint8 state outputs; clone: training mode, reads them.
    assert forward.attributes["training_mode"].as_int() == 0
    assert forward.attributes["func_name"].as_string() == f"{rng_replay.SAVE_PREFIX}[{FLASH}]"
    assert len(forward.outputs) == 4
    states = forward.outputs[2:]
    assert [s.dtype for s in states] == [ir.DataType.UINT8] * 2
    assert clone.attributes["training_mode"].as_int() == 1
    assert clone.attributes["func_name"].as_string() == f"{rng_replay.REPLAY_PREFIX}[{FLASH}]"
    assert list(clone.inputs[-2:]) == list(states)
    assert clone.attributes["input_convention"].as_string().endswith("dd")
    # The gradient reads the clone's ctx, not forward's (which holds nothing).
    (grad,) = _pythonops(model, "PythonOpGrad")
    assert grad.inputs[0] is clone.outputs[0]
    assert not forward.outputs[0].uses()


def test_recompute_through_pythonop_gives_identical_loss_and_gradients(training_graph, batch):
    plan = _pythonop_plan(training_graph)
    baseline = TrainingSession(training_graph)
    recomputed = TrainingSession(_recompute(training_graph, plan))
    for step in range(2):  # the second step checks the generators stayed in step
        torch.manual_seed(100 + step)
        expected = baseline.run(batch)
        torch.manual_seed(100 + step)
        got = recomputed.run(batch)
        assert got.loss == expected.loss
        for name, grad in expected.gradients.items():
            np.testing.assert_array_equal(got.gradients[name], grad, err_msg=name)
    assert bridge.live_contexts() == 0


def test_without_the_replay_the_clone_would_draw_another_mask(training_graph, batch, monkeypatch):
    # The replay is what makes the test above pass: a clone that runs from the current
    # generator state (the states ignored) changes the gradients.
    plan = _pythonop_plan(training_graph)
    model = _recompute(training_graph, plan)
    _, replay = rng_replay.rng_replay_functions(FLASH)

    def apply_ignoring_states(cls, *args):
        return cls.inner.apply(*args[:-2])

    monkeypatch.setattr(replay, "apply", classmethod(apply_ignoring_states))
    torch.manual_seed(5)
    expected = TrainingSession(training_graph).run(batch)
    torch.manual_seed(5)
    got = TrainingSession(model).run(batch)
    assert got.loss == expected.loss  # forward is untouched
    assert any(not np.array_equal(got.gradients[k], v) for k, v in expected.gradients.items())


def test_register_rng_replay_functions_finds_the_derived_names(training_graph):
    model = _recompute(training_graph, _pythonop_plan(training_graph))
    names = rng_replay.register_rng_replay_functions(model)
    assert sorted(names) == sorted(
        [f"{rng_replay.SAVE_PREFIX}[{FLASH}]", f"{rng_replay.REPLAY_PREFIX}[{FLASH}]"]
    )
    assert all(name in bridge.registered_functions() for name in names)


def test_an_unregistered_function_is_refused_and_the_model_is_unchanged(training_graph, monkeypatch):
    plan = _pythonop_plan(training_graph)
    monkeypatch.setattr(bridge, "registered_functions", lambda: {})
    model = ir.from_proto(ir.to_proto(training_graph))
    before = [n.name for n in model.graph]
    with pytest.raises(ortpass.errors.UnregisteredFunctionError, match="FlashAttentionFunction"):
        RecomputePass(plan, min_elements=0)(model)
    assert [n.name for n in model.graph] == before


# -- the ctx's size, and layers found through a registered attention Function ----------------

QKV_BYTES = 3 * BATCH * HEADS * SEQ * HEAD_DIM * 4  # q, k, v in float32: what the ctx holds


def test_the_ctx_counts_the_inputs_it_holds(training_graph):
    # Backward reads none of q, k, v (PythonOpGrad reads the ctx and the output gradient),
    # so the ctx is what keeps them: 3 x 512 float32, not the 8 bytes of its int64 handle.
    report = find_recompute_candidates(training_graph, min_elements=0)
    (ctx,) = [s for s in report.stashed if s.producer.op_type == "PythonOp"]
    assert ctx.value.dtype == ir.DataType.INT64 and ctx.bytes == QKV_BYTES
    (occurrence,) = [o for p in report.plans for o in p.occurrences if o.entry.op_type == "PythonOp"]
    assert occurrence.saving_bytes == QKV_BYTES


def test_the_size_floor_applies_to_what_the_ctx_holds(training_graph):
    elements = QKV_BYTES // 4

    def floor_rejects(min_elements: int) -> bool:
        report = find_recompute_candidates(training_graph, min_elements=min_elements)
        return any(s.entry.op_type == "PythonOp" and "smaller than" in s.reason for s in report.skipped)

    assert not floor_rejects(elements)
    assert floor_rejects(elements + 1)


def _flash_decoder_graph(layers: int) -> ir.Model:
    from ortpass.testing.flash_attention import use_flash_attention
    from ortpass.testing.models import GPTDecoder

    torch.manual_seed(0)
    model = use_flash_attention(GPTDecoder(vocab=32, hidden=HIDDEN, heads=HEADS, layers=layers, max_seq=SEQ, dropout=0.2))
    ids = torch.randint(0, 32, (BATCH, SEQ))
    return build_training_graph(export(model, (ids, ids), input_names=["input_ids", "labels"]))


@pytest.fixture(scope="module")
def flash_decoder() -> ir.Model:
    return _flash_decoder_graph(2)


def test_layers_are_found_through_a_registered_attention_function(flash_decoder, monkeypatch):
    from ortpass.analysis import find_layer_boundaries, get_partition, recomputable_ops

    forward = get_partition(flash_decoder).forward
    assert not any(n.op_type == "Softmax" for n in forward)  # attention is only in the PythonOps
    assert len(find_layer_boundaries(forward)) == 2
    # Registered as recomputable but not as attention: no layer is found.
    monkeypatch.setattr(recomputable_ops, "_ATTENTION_FUNCTIONS", set())
    assert len(find_layer_boundaries(forward)) == 0


def test_level_1_recomputes_the_attention_function_with_identical_gradients(flash_decoder):
    passes = [RecomputePass(level=1, min_elements=0), FixDropoutSeedPass(level=1, min_elements=0)]
    model = ortpass.PassManager(passes, assume=["training-graph"])(flash_decoder).model
    clones = [n for n in _pythonops(model) if n.name.endswith("_recompute")]
    assert len(clones) == 2
    rng = np.random.default_rng(3)
    batch = {"input_ids": rng.integers(0, 32, (BATCH, SEQ)), "labels": rng.integers(0, 32, (BATCH, SEQ))}
    # The baseline's Dropouts are seeded like the recomputed graph's (FixDropoutSeedPass
    # alone); the attention dropout inside the Function draws from torch's generator.
    seeded = ortpass.PassManager([FixDropoutSeedPass(level=1, min_elements=0)], assume=["training-graph"])
    baseline = TrainingSession(seeded(flash_decoder).model)
    recomputed = TrainingSession(model)
    torch.manual_seed(7)
    expected = baseline.run(batch)
    torch.manual_seed(7)
    got = recomputed.run(batch)
    assert got.loss == expected.loss
    for name, grad in expected.gradients.items():
        np.testing.assert_array_equal(got.gradients[name], grad, err_msg=name)


def test_ortmodule_cache_registers_the_derived_functions_of_a_loaded_graph(training_graph):
    """ORTModule's cache loads a recomputed fused-attention graph in a fresh process, where
    nothing registered the RNG-replaying Functions; the cache registers them itself."""
    from ortpass.pythonop.registry import unregister_function
    from ortpass.runtime.module import cache

    model = _recompute(training_graph, _pythonop_plan(training_graph))
    names = rng_replay.register_rng_replay_functions(model)
    for name in names:
        unregister_function(bridge.registered_functions()[name])
    assert not any(name in bridge.registered_functions() for name in names)  # as in a fresh process
    cache._register_own_functions(model)
    assert all(name in bridge.registered_functions() for name in names)
