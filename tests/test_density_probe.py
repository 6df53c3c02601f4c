"""The label-density probe and its FlagAndPrintDensity flag, alone and through export ->
InsertGatherBeforeSceLossPass -> training graph -> ORT, with parity against torch."""

from __future__ import annotations

import io
import logging
import warnings

import onnx
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import cross_entropy as imported_cross_entropy

from ortpass.conventions import PRINT_DENSITY_ENV
from ortpass.errors import ExportError
from ortpass.export import export
from ortpass.export.density import (
    FUNCTIONAL_SITE,
    FlagAndPrintDensity,
    density_probe,
    label_density,
)
from ortpass.ops.density_flag import FLAG_FUNC_NAME
from ortpass.passes.insert_gather_before_sce_loss import InsertGatherBeforeSceLossPass
from ortpass.pythonop import bridge
from ortpass.pythonop.export import pythonop_export_context
from ortpass.runtime import TrainingSession
from ortpass.runtime.parity import check_parity
from ortpass.testing.models import MLP, BertMLM
from ortpass.training import build_training_graph

# 2 of 6 labels differ from -1 (33.3%); 5 of 6 differ from -100 (83.3%).
SPARSE = torch.tensor([[1, -1, -1], [2, -1, -1]])
MOSTLY_VALID = torch.tensor([[1, 2, 3], [4, 5, -100]])


class TwoLosses(nn.Module):
    """A CrossEntropyLoss module (ignore_index -1) plus a functional cross_entropy (-100)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 10)
        self.ce = nn.CrossEntropyLoss(ignore_index=-1)

    def forward(self, x, y, z):
        logits = self.lin(x).view(-1, 10)
        return self.ce(logits, y.view(-1)) + F.cross_entropy(logits, z.view(-1), reduction="sum")


def batch():
    torch.manual_seed(1)
    return torch.randn(2, 3, 8), SPARSE, MOSTLY_VALID


def export_with_probe(module, args, threshold=90.0, opset=17) -> tuple[onnx.ModelProto, object]:
    buffer = io.BytesIO()
    with pythonop_export_context(), density_probe(module, threshold=threshold) as probe, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, args, buffer, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
            opset_version=opset, do_constant_folding=False, output_names=["loss"],
        )  # fmt: skip
    return onnx.load_from_string(buffer.getvalue()), probe


def flags(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in proto.graph.node if n.op_type == "PythonOp"]


def attribute(node: onnx.NodeProto, name: str):
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)


# -- the flag ------------------------------------------------------------------------------------
def test_func_name_is_the_one_the_pass_looks_for():
    assert f"{FlagAndPrintDensity.__module__}.{FlagAndPrintDensity.__qualname__}" == FLAG_FUNC_NAME


def test_label_density_counts_labels_other_than_ignore_index():
    assert label_density(SPARSE, -1) == (2, 6, pytest.approx(100 / 3))
    assert label_density(MOSTLY_VALID, -100) == (5, 6, pytest.approx(500 / 6))


def test_flag_is_an_identity_forward_and_backward():
    labels = torch.tensor([3, -100, 1])
    assert torch.equal(FlagAndPrintDensity.apply(labels, -100, 50.0), labels)
    x = torch.randn(4, requires_grad=True)
    FlagAndPrintDensity.apply(x, 0, 50.0).mul(3.0).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 3.0))


def test_flag_prints_density_when_asked(monkeypatch, capsys, caplog):
    labels = torch.tensor([3, -100, 1, -100])
    monkeypatch.setenv(PRINT_DENSITY_ENV, "1")
    FlagAndPrintDensity.apply(labels, -100, 12.5)
    assert "label density 50.00% (2/4" in capsys.readouterr().out
    monkeypatch.delenv(PRINT_DENSITY_ENV)
    with caplog.at_level(logging.INFO, logger="ortpass.export.density"):
        FlagAndPrintDensity.apply(labels, -100, 12.5)
    assert capsys.readouterr().out == ""
    assert "label density 50.00% (2/4" in caplog.text


# -- the probe in eager mode ----------------------------------------------------------------------
def test_probe_measures_module_and_functional_losses_with_their_ignore_index():
    model = TwoLosses()
    expected = model(*batch())
    with density_probe(model) as probe:
        loss = model(*batch())
    torch.testing.assert_close(loss, expected)  # the flag changes no value
    module_record, functional_record = probe.records
    assert (module_record.site, module_record.ignore_index) == ("ce", -1)
    assert (module_record.valid, module_record.total) == (2, 6)
    assert module_record.density == pytest.approx(100 / 3) and module_record.flagged
    assert (functional_record.site, functional_record.ignore_index) == (FUNCTIONAL_SITE, -100)
    assert functional_record.density == pytest.approx(500 / 6) and functional_record.flagged


def test_threshold_decides_which_labels_are_flagged():
    model = TwoLosses()
    with density_probe(model, threshold=80.0) as probe:
        model(*batch())
    assert [r.flagged for r in probe.records] == [True, False]  # 33.3% < 80% <= 83.3%
    assert "not flagged (density >= threshold 80%)" in probe.summary()


def test_cross_entropy_imported_by_name_is_probed_too():
    logits = torch.randn(6, 10)
    with density_probe(nn.Module()) as probe:
        imported_cross_entropy(logits, SPARSE.view(-1), ignore_index=-1)
    (record,) = probe.records
    assert record.site == FUNCTIONAL_SITE and record.flagged


def test_probability_targets_are_not_measured():
    with density_probe(nn.Module()) as probe:
        F.cross_entropy(torch.randn(4, 10), torch.softmax(torch.randn(4, 10), dim=1))
    (record,) = probe.records
    assert record.density is None and not record.flagged
    assert "class-probability" in record.reason


def test_everything_is_restored_on_exit_even_after_an_error():
    model = TwoLosses()
    original = torch._C._nn.cross_entropy_loss
    with pytest.raises(ValueError, match="boom"), density_probe(model):
        assert torch._C._nn.cross_entropy_loss is not original
        raise ValueError("boom")
    assert torch._C._nn.cross_entropy_loss is original
    assert not model.ce._forward_pre_hooks and not model.ce._forward_hooks
    with density_probe(model):  # usable again
        pass


def test_probes_do_not_nest():
    with density_probe(nn.Module()), pytest.raises(ExportError, match="do not nest"), density_probe(nn.Module()):
        pass


def test_threshold_must_be_a_percentage():
    with pytest.raises(ValueError, match="percentage"), density_probe(nn.Module(), threshold=150):
        pass


# -- the probe during export --------------------------------------------------------------------------
def test_export_puts_a_flag_between_each_sparse_label_and_its_loss():
    proto, probe = export_with_probe(TwoLosses(), batch())
    assert len(probe.flagged) == 2
    flag_by_ignore_index = {attribute(f, "input_int_scalars")[0]: f for f in flags(proto)}
    assert sorted(flag_by_ignore_index) == [-100, -1]
    for ignore_index, density in ((-1, 100 / 3), (-100, 500 / 6)):
        flag = flag_by_ignore_index[ignore_index]
        assert attribute(flag, "func_name").decode() == FLAG_FUNC_NAME
        assert attribute(flag, "input_float_scalars")[0] == pytest.approx(density, rel=1e-6)
        (consumer,) = [n for n in proto.graph.node if flag.output[1] in n.input]
        assert consumer.op_type == "SoftmaxCrossEntropyLoss"
        assert attribute(consumer, "ignore_index") == ignore_index
    # Measuring left nothing in the trace.
    assert not {"NonZero", "Equal", "Not", "ReduceSum"} & {n.op_type for n in proto.graph.node}


def test_dense_labels_get_no_flag():
    proto, probe = export_with_probe(TwoLosses(), batch(), threshold=10.0)
    assert not flags(proto) and not probe.flagged and len(probe.records) == 2


# -- end to end -----------------------------------------------------------------------------------
def padded_labels(shape, classes, density, seed=0):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, shape, generator=generator)
    labels[torch.rand(shape, generator=generator) >= density] = -100
    return labels


@pytest.mark.parametrize(
    "make_model, make_args",
    [
        (lambda: MLP(), lambda: (torch.randn(32, 16), padded_labels((32,), 10, 0.25))),
        (lambda: BertMLM(), lambda: (torch.randint(0, 128, (2, 16)), padded_labels((2, 16), 128, 0.15))),
    ],
    ids=["module-loss", "functional-loss"],
)
def test_export_pass_and_training_parity_with_torch(make_model, make_args):
    torch.manual_seed(0)
    module, args = make_model(), make_args()
    model = export(module, args, input_names=["x", "labels"])
    assert [n.op_type for n in model.graph].count("PythonOp") == 1

    pass_ = InsertGatherBeforeSceLossPass(keep_flag_for_printing=False)
    assert pass_(model).modified
    op_types = [n.op_type for n in model.graph]
    assert "PythonOp" not in op_types and op_types.count("ShrunkenGather") == 2

    training = build_training_graph(model)
    check_parity(module, args, training, input_names=["x", "labels"]).assert_ok()


def test_printing_flag_reports_each_step_through_the_torch_bridge(monkeypatch, capsys):
    torch.manual_seed(0)
    module, args = MLP(), (torch.randn(32, 16), padded_labels((32,), 10, 0.25))
    model = export(module, args, input_names=["x", "labels"])
    monkeypatch.setenv(PRINT_DENSITY_ENV, "1")
    assert InsertGatherBeforeSceLossPass()(model).modified
    assert [n.op_type for n in model.graph].count("PythonOp") == 1
    session = TrainingSession(build_training_graph(model))
    capsys.readouterr()

    valid = int((args[1] != -100).sum())
    for step in range(2):
        session.run({"x": args[0].numpy(), "labels": args[1].numpy()})
        assert f"label density {valid / 32 * 100:.2f}% ({valid}/32" in capsys.readouterr().out
    # Integer labels need no backward: the flag runs without a context, so none is left behind.
    assert bridge.live_contexts() == 0


def test_shape_inference_keeps_the_label_dims_across_the_flag():
    from ortpass.passes.pythonop_shape_inference import PythonOpShapeInferencePass

    module, args = MLP(), (torch.randn(32, 16), padded_labels((32,), 10, 0.25))
    model = export(module, args, input_names=["x", "labels"], dynamic_axes={"labels": {0: "batch"}, "x": {0: "batch"}})
    PythonOpShapeInferencePass()(model)
    (flag,) = [n for n in model.graph if n.op_type == "PythonOp"]
    assert str(flag.outputs[1].shape) == "[batch]"
    assert flag.outputs[1].dtype == ir.DataType.INT64
