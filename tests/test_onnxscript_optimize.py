"""onnxscript's optimizer composes with the training path: as the ``onnxscript-optimize``
pass it keeps every parameter and Dropout and trains as torch does; run on the exported
model by hand it takes parameters, and the gradient build then refuses by name."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxscript.optimizer
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ortpass
from ortpass.errors import PipelineSpecError, TrainingGraphError
from ortpass.export import export
from ortpass.passes import DEFAULT_PIPELINE, OnnxscriptOptimizePass
from ortpass.runtime.parity import check_parity
from ortpass.testing.models import GPTDecoder
from ortpass.training import build_training_graph
from ortpass.training.forward_checks import ONNXSCRIPT_FOLDED_FROM_KEY

NAMES = ["input_ids", "labels"]
DYNAMIC = {"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}}


def _decoder():
    torch.manual_seed(0)
    module = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, dropout=0.1)
    ids = torch.randint(0, 64, (2, 16))
    args = (ids, ids.roll(-1, 1))
    return module, args, export(module, args, input_names=NAMES, dynamic_axes=DYNAMIC)


class _TwoDropoutsZeroBias(nn.Module):
    """Two dropouts of one tensor (independent masks in torch) and a bias that starts at zero."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        nn.init.zeros_(self.out.bias)

    def forward(self, x):
        h = self.lin(x)
        return self.out(F.dropout(h, 0.5, True) * F.dropout(h, 0.5, True)).mean()


def _small():
    torch.manual_seed(0)
    module, x = _TwoDropoutsZeroBias(), torch.randn(4, 8)
    return module, (x,), export(module, (x,), input_names=["x"])


class _TiedLookup(nn.Module):
    """An embedding with a padding row whose weight is the output head's too."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(16, 8, padding_idx=0)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.embedding(input_ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _tied():
    torch.manual_seed(0)
    module = _TiedLookup()
    ids = torch.randint(0, 16, (3, 6))
    ids[:, -2:] = 0  # padding
    args = (ids, ids.roll(-1, 1))
    return module, args, export(module, args, input_names=NAMES, dynamic_axes=DYNAMIC)


def _dropouts(model: ir.Model) -> list[ir.Node]:
    return [node for node in model.graph if node.op_type == "Dropout"]


def test_the_pass_optimizes_the_decoder_and_it_trains_as_torch():
    module, args, forward = _decoder()
    params = [name for name, _ in module.named_parameters()]
    before = len(forward.graph)
    # Named last, it runs first: before every other pre-grad pass, by its declarations.
    result = ortpass.pipeline(f"{DEFAULT_PIPELINE},onnxscript-optimize")(forward)
    optimize = result.report.records[0]
    assert optimize.name == "onnxscript-optimize" and optimize.modified
    assert optimize.nodes_after < before
    assert optimize.stats["counts"]["parameters kept"] == len(params)
    check_parity(module, args, result.model, input_names=NAMES).assert_ok()


def test_the_pass_leaves_the_parameters_initializers_in_their_order():
    module, _, forward = _decoder()
    params = [name for name, _ in module.named_parameters()]
    inputs = [value.name for value in forward.graph.inputs]
    before = list(forward.graph.initializers)
    OnnxscriptOptimizePass()(forward)
    after = list(forward.graph.initializers)
    assert [value.name for value in forward.graph.inputs] == inputs
    assert [name for name in after if name in before] == [name for name in before if name in after]
    assert after[: len(params)] == params == before[: len(params)]
    assert all(forward.graph.initializers[name].const_value is not None for name in params)
    # The optimizer did run: torch's Transposes of the weights stay, its Constants are initializers.
    assert not any(node.op_type == "Constant" for node in forward.graph)


def test_the_optimizer_alone_takes_parameters_and_the_build_names_them_and_the_way_out():
    _, _, forward = _decoder()
    onnxscript.optimizer.optimize(forward)
    assert "head.weight" not in forward.graph.initializers  # folded with its Transpose
    message = r"parameter 'blocks\.0\.attn\.qkv\.weight', recorded as trainable at export, was folded into the constant '/blocks\.0/attn/qkv/Transpose_output_0'"
    with pytest.raises(TrainingGraphError, match=message) as caught:
        build_training_graph(forward)
    text = str(caught.value)
    assert "16 more" in text and "'onnxscript-optimize," in text
    with pytest.raises(TrainingGraphError, match="'onnxscript-optimize,build-training-graph"):
        ortpass.pipeline(DEFAULT_PIPELINE)(forward)


def test_a_lost_parameter_is_named_without_a_fold_record_too():
    _, _, forward = _small()
    onnxscript.optimizer.optimize(forward)
    assert "out.bias" not in forward.graph.initializers  # the zero bias a rewrite rule dropped
    with pytest.raises(TrainingGraphError, match=r"parameter .out\.bias., recorded .* is gone from the model:"):
        build_training_graph(forward)


def test_a_tied_weight_folded_for_one_use_is_refused_though_still_there():
    """The head's Transpose of the shared weight became a constant, the lookup still reads
    the weight: built as it is, the weight would lose the head's share of its gradient."""
    _, _, forward = _tied()
    onnxscript.optimizer.optimize(forward)
    assert "embedding.weight" in forward.graph.initializers
    with pytest.raises(TrainingGraphError, match=r"'embedding\.weight', recorded .* was folded into the constant '/head/"):
        build_training_graph(forward)


def test_the_pass_trains_a_tied_weight_with_a_padding_row_as_torch():
    module, args, forward = _tied()
    result = ortpass.pipeline(f"onnxscript-optimize,{DEFAULT_PIPELINE}")(forward)
    check_parity(module, args, result.model, input_names=NAMES).assert_ok()


def test_given_params_are_not_checked_against_the_record():
    _, _, forward = _small()
    onnxscript.optimizer.optimize(forward)
    training = build_training_graph(forward, params=["lin.weight", "lin.bias", "out.weight"])
    assert {"lin.weight_grad", "out.weight_grad"} <= {value.name for value in training.graph.outputs}


def test_the_pass_keeps_dropouts_apart_and_a_zero_bias_which_the_optimizer_alone_does_not():
    _, _, alone = _small()
    onnxscript.optimizer.optimize(alone)
    assert len(_dropouts(alone)) == 1 and "out.bias" not in alone.graph.initializers

    module, args, forward = _small()
    pass_ = OnnxscriptOptimizePass()
    pass_(forward)
    assert len(_dropouts(forward)) == 2 and "out.bias" in forward.graph.initializers
    assert all("seed" not in node.attributes for node in _dropouts(forward))  # the seeds were temporary
    assert pass_.stats["counts"]["dropouts kept apart"] == 2
    check_parity(module, args, build_training_graph(forward), input_names=["x"]).assert_ok()


def test_a_dropout_seeded_before_keeps_its_seed():
    _, _, forward = _small()
    first, second = _dropouts(forward)
    first.attributes["seed"] = ir.AttrInt64("seed", 0)  # the seed the pass would try first
    OnnxscriptOptimizePass()(forward)
    assert [node.attributes.get_int("seed") for node in _dropouts(forward)] == [0, None]


def test_params_option_keeps_the_names_given():
    _, _, forward = _small()
    OnnxscriptOptimizePass(params=["lin.weight", "lin.bias", "out.weight"])(forward)
    assert "out.bias" not in forward.graph.initializers  # not named, so a constant to the optimizer
    with pytest.raises(TrainingGraphError, match=r"\['nope'\] to keep are neither initializers nor graph inputs"):
        ortpass.pipeline("onnxscript-optimize(params=['nope'])")(_small()[2])


def test_options_are_checked_and_a_training_graph_is_refused():
    with pytest.raises(PipelineSpecError, match="num_iterations"):
        ortpass.pipeline("onnxscript-optimize(num_iterations=0)")
    training = build_training_graph(_small()[2])
    with pytest.raises(ir.passes.PreconditionError, match="already a training graph"):
        OnnxscriptOptimizePass()(training)


def test_the_fold_record_key_and_the_size_limits_are_onnxscripts():
    from onnxscript.optimizer import _constant_folding

    assert ONNXSCRIPT_FOLDED_FROM_KEY == onnxscript.optimizer.FOLDED_FROM_KEY
    pass_ = OnnxscriptOptimizePass()
    assert pass_.input_size_limit == _constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT
    assert pass_.output_size_limit == _constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT


def test_a_model_optimized_with_the_pass_is_what_the_gradients_of_the_original_are():
    """Same weights, same batch, Dropouts off: the optimized graph's step is the original's."""
    torch.manual_seed(0)
    module = GPTDecoder(vocab=64, hidden=32, heads=4, layers=2, dropout=0.0)
    ids = torch.randint(0, 64, (2, 16))
    batch = {"input_ids": ids.numpy(), "labels": ids.roll(-1, 1).numpy()}
    plain = export(module, (ids, ids.roll(-1, 1)), input_names=NAMES, dynamic_axes=DYNAMIC)
    optimized = plain.clone()
    OnnxscriptOptimizePass()(optimized)
    from ortpass.runtime import TrainingSession

    expected = TrainingSession(build_training_graph(plain), threads=1).run(batch)
    got = TrainingSession(build_training_graph(optimized), threads=1).run(batch)
    assert got.loss == pytest.approx(expected.loss, rel=1e-6)
    assert got.gradients.keys() == expected.gradients.keys()
    for name, gradient in expected.gradients.items():
        np.testing.assert_allclose(got.gradients[name], gradient, rtol=1e-4, atol=1e-6)


def _decoder_and_a_transpose_pair() -> ir.Model:
    """``GPTDecoder``'s export and a second output, ``Transpose(Transpose(x))``, which
    onnxscript's rule ``TransposeTranspose`` rewrites into ``Identity(x)``."""
    model = _decoder()[2]
    x = ir.val("pair_x", ir.DataType.FLOAT, ir.Shape([2, 8]))
    model.graph.inputs.append(x)
    first = ir.node("Transpose", [x], attributes={"perm": [1, 0]})
    second = ir.node("Transpose", [first.outputs[0]], attributes={"perm": [1, 0]})
    model.graph.extend([first, second])
    second.outputs[0].name = "pair_y"
    model.graph.outputs.append(second.outputs[0])
    return model


def test_a_skipped_rule_is_all_that_changes_from_onnxscripts_optimize_ir():
    """``optimize_keeping_training_values(skipped_rules=...)`` writes out ``optimize_ir``'s
    sequence of passes with rules left out (the torch builder skips the slow SlicesSplit,
    which rewrote nothing on the suite's joint graphs): without a rule that rewrites nothing,
    the graph is ``optimize_ir``'s to the byte; without one that rewrites, its nodes stay."""
    from ortpass.ops.optimizer import optimize_keeping_training_values

    def optimized(model, **options):
        optimize_keeping_training_values(model, list(model.graph.initializers), **options)
        return ir.to_proto(model).SerializeToString(), model

    plain, _ = optimized(_decoder()[2])
    assert optimized(_decoder()[2], skipped_rules=["SlicesSplit"])[0] == plain
    _, rewritten = optimized(_decoder_and_a_transpose_pair())
    _, kept = optimized(_decoder_and_a_transpose_pair(), skipped_rules=["TransposeTranspose"])
    transposes = lambda model: sum(node.op_type == "Transpose" for node in model.graph)  # noqa: E731
    assert transposes(kept) == transposes(rewritten) + 2
    with pytest.raises(ValueError, match="no default rewrite rule of onnxscript is named \\['SliceSplit'\\]"):
        optimize_keeping_training_values(_decoder()[2], [], skipped_rules=["SliceSplit"])
