"""Export a torch module's forward + loss to an onnx_ir model that ORT 1.19.2 accepts.

Uses torch.onnx's TorchScript exporter (``dynamo=False``) in training mode: it is the
exporter that keeps Dropout with its mask, calls custom symbolics for
``torch.autograd.Function`` (which become ``com.microsoft::PythonOp``) and names parameter
initializers by their ``state_dict`` names.  ortpass's own symbolics fill the exporter's
gaps for the aten ops real models call (``ortpass.export.symbolics``), and an op it still
cannot convert fails naming the module and source line that called it, with the way out.
See the README for the ``dynamo=True`` path that ``torch.library.custom_op`` functions take.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import warnings
from typing import Any, Literal, Mapping, Sequence

import onnx
import onnx_ir as ir
import torch

from ortpass.conventions import EXPORT_KEY, MAX_ORT_OPSET
from ortpass.errors import ExportError
from ortpass.export.error_text import without_tensor_values
from ortpass.export.symbolics import record_padding_indices
from ortpass.pythonop.export import name_context_outputs

__all__ = ["export"]

logger = logging.getLogger(__name__)


def export(
    module: torch.nn.Module,
    args: Sequence[Any] | Any,
    *,
    input_names: Sequence[str] | None = None,
    loss_name: str | None = "loss",
    output_names: Sequence[str] | None = None,
    outputs_with_grad: Sequence[str] | None = None,
    inputs_with_grad: Sequence[str] = (),
    opset: int = 17,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    density_threshold: float | None = 90.0,
    fused_attention: bool | Literal["auto"] = False,
    training: bool | None = True,
    weights: bool = True,
) -> ir.Model:
    """Export ``module(*args)`` (whose first output is the scalar loss) for training.

    Without a loss (``loss_name=None``) the graph is built later from outputs: the caller
    computes the loss from them, and the gradient build takes their gradients as inputs
    (:func:`ortpass.training.build_training_graph`).

    Args:
        module: the model including its loss; ``forward`` returns the loss first.
        args: the sample batch (a tensor or a sequence of positional arguments).
        input_names: graph input names for ``args`` (default ``input_0``, ...).
        loss_name: name of the loss output; None: the module returns no loss.
        output_names: names of the outputs (after the loss, if any); default: torch's.
        outputs_with_grad: without a loss, the outputs to differentiate (default: every
            floating-point output that a trainable parameter or an input in
            ``inputs_with_grad`` reaches).
        inputs_with_grad: input names whose gradient the training graph computes too.
        opset: ai.onnx opset (at most 21, what ORT 1.19.2 loads).
        dynamic_axes: ``{input_name: {axis: dim_name}}``; the export batch's sizes of
            these dims are recorded so analyses can evaluate symbolic sizes.
        density_threshold: label density (percent) under which cross-entropy labels get
            the padding flag for ``InsertGatherBeforeSceLossPass``; ``None`` disables
            the probe.
        fused_attention: export every ``torch.nn.functional.scaled_dot_product_attention``
            call as one recomputable PythonOp running torch's fused kernel
            (:mod:`ortpass.export.fused_attention`) instead of its decomposition;
            ``"auto"``: the calls without attention dropout (where it is faster too) and
            those with dropout whose attention is large (``AUTO_DROPOUT_BYTES`` there).
        training: False exports the module in eval mode (no Dropout, no density probe)
            for a forward-only graph, whose first output need not be a loss.  None
            exports every submodule in the mode it is in (a Dropout set to ``eval()``
            inside a training model stays off), for a graph the module's own
            ``training`` flag decides.  Either way every submodule's flag is as before
            after the export.
        weights: False exports the parameters and buffers as graph inputs without their
            values (torch's ``export_params=False``), named as with them: no copy of any
            weight is made (ORTModule attaches its module's own tensors, and its dims
            proof compares graphs alone).

    Returns:
        An onnx_ir model: parameters are initializers named by ``state_dict`` names, the
        loss is the output ``loss_name``, and model metadata ``pkg.ortpass.export``
        records the loss, the trainable parameters and the export dims
        (``pkg.ortpass.padding_idx``: each embedding's padding row).
    """
    if not isinstance(module, torch.nn.Module):
        raise ExportError(f"export needs a torch.nn.Module, got {type(module).__name__}")
    shown = shown_module(module)
    if not 7 <= opset <= MAX_ORT_OPSET:
        raise ExportError(
            f"opset {opset} is not supported: ORT 1.19.2 loads ai.onnx opsets up to {MAX_ORT_OPSET} "
            "and the training ops need 7 or newer"
        )
    check_fused_attention(fused_attention)
    mode = training
    training = module.training if training is None else training
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    if input_names is None:
        input_names = [f"input_{i}" for i in range(len(args))]
    if len(input_names) != len(args):
        raise ExportError(f"{len(input_names)} input_names for {len(args)} arguments")
    unknown = sorted(set(inputs_with_grad) - set(input_names))
    if unknown:
        raise ExportError(f"inputs_with_grad names {unknown}, which are not input names {list(input_names)}")
    names = [*([loss_name] if loss_name is not None else []), *(output_names or ())]

    proto, density_records = _run_torchscript_export(
        module, args, list(input_names), names, opset, dynamic_axes, density_threshold if training else None,
        mode, fused_attention, weights,
    )
    if training and loss_name is not None:
        _check_loss_output(proto, loss_name)
    model = ir.from_proto(proto)
    # TorchScript names values after the symbolics ran, so ctx outputs are named here.
    name_context_outputs(model)
    record_padding_indices(model)
    _name_unnamed_nodes(model)
    # The state: initializers, or without the weights' values graph inputs beyond the call's.
    state_names = set(model.graph.initializers) if weights else {v.name for v in model.graph.inputs} - set(input_names)
    params = [name for name, p in module.named_parameters() if p.requires_grad and name in state_names]
    info = {
        "loss": loss_name,
        "params": params,
        "dims": _export_dims(args, input_names, dynamic_axes),
        "opset": opset,
        "label_density": [dataclasses.asdict(record) for record in density_records],
    }
    if inputs_with_grad:
        info["inputs_with_grad"] = list(inputs_with_grad)
    if training and loss_name is None:
        info["outputs_with_grad"] = _differentiable_outputs(model, outputs_with_grad, [*params, *inputs_with_grad])
    model.metadata_props[EXPORT_KEY] = json.dumps(info)
    logger.info("exported %s: %d nodes, %d trainable parameters", type(shown).__name__, len(model.graph), len(params))
    return model


def check_fused_attention(value: object) -> None:
    """Refuse a ``fused_attention`` setting other than True, False or ``"auto"``."""
    if not (isinstance(value, bool) or value == "auto"):
        raise ExportError(f"fused_attention must be True, False or 'auto', not {value!r}")


def _run_torchscript_export(
    module, args, input_names, output_names, opset, dynamic_axes, density_threshold, training=True, fused_attention=False,
    weights=True,
):
    """Run torch's exporter with PythonOp export and the density probe hooked in.

    Returns the model proto and the probe's records (what it measured per loss call).
    """
    # Imported here: both hook into torch while the exporter runs and are undone after.
    from ortpass.export.control_flow import refuse_data_dependent, watching_conversions
    from ortpass.export.density import density_probe
    from ortpass.export.symbolics import symbolics_context
    from ortpass.pythonop.export import pythonop_export_context

    modes = [(m, m.training) for m in module.modules()]
    if training is not None:
        module.train(training)
    buffer = io.BytesIO()
    probe = None
    conversions: list = []
    try:
        with contextlib.ExitStack() as hooks, warnings.catch_warnings():
            hooks.enter_context(pythonop_export_context())
            hooks.enter_context(symbolics_context(opset))
            if fused_attention:
                from ortpass.export.fused_attention import fused_attention_export

                hooks.enter_context(fused_attention_export(auto=fused_attention == "auto"))
            if density_threshold is not None:
                probe = hooks.enter_context(density_probe(module, threshold=density_threshold))
            # The TorchScript exporter is deprecated in favour of dynamo; it is the path that
            # supports PythonOp and training-mode Dropout, so silence the notice.
            warnings.simplefilter("ignore", category=DeprecationWarning)
            warnings.simplefilter("ignore", category=FutureWarning)
            # torch's shape inference notes, a dozen times per Hugging Face export, that it does not
            # fold a Slice with steps; ortpass exports without constant folding: not actionable.
            warnings.filterwarnings("ignore", message=r"Constant folding - Only steps=1", category=UserWarning)
            _quiet_batch_norm_counters(module)
            conversions = hooks.enter_context(watching_conversions())
            torch.onnx.export(
                module,
                args,
                buffer,
                dynamo=False,
                training=_TRAINING_MODES[training],
                do_constant_folding=False,
                export_params=weights,
                opset_version=opset,
                input_names=input_names,
                output_names=list(output_names),
                dynamic_axes={k: dict(v) for k, v in (dynamic_axes or {}).items()} or None,
            )
    except ExportError:
        raise
    except Exception as exc:
        # A path read from a tensor is the reason to give, whatever the trace did after it.
        refuse_data_dependent(conversions, type(shown_module(module)).__name__, cause=exc)
        raise ExportError(
            f"torch.onnx.export of {type(shown_module(module)).__name__} failed: {type(exc).__name__}: {without_tensor_values(str(exc))}"
            f"{_where_and_way_out(exc)}"
        ) from exc
    finally:
        for m, was_training in modes:  # torch's exporter sets the mode of every submodule
            m.training = was_training
    refuse_data_dependent(conversions, type(shown_module(module)).__name__)
    return onnx.load_from_string(buffer.getvalue()), (probe.records if probe is not None else [])


def _quiet_batch_norm_counters(module: torch.nn.Module) -> None:
    """torch's exporter warns once per BatchNorm that it drops the ``num_batches_tracked += 1``
    of a training BatchNorm (a hundred lines for a ResNet, every export).  Not actionable:
    ORTModule counts the batches in torch (``BatchNormUpdate``).  Said once, at DEBUG; a
    dropped update of any other buffer still warns."""
    counted = [name for name, _ in module.named_buffers() if name.endswith("num_batches_tracked")]
    if counted:
        warnings.filterwarnings(
            "ignore", message=r"ONNX Preprocess - Removing mutation .*num_batches_tracked", category=UserWarning
        )
        logger.debug("the export leaves out the num_batches_tracked updates of %d BatchNorms", len(counted))


_TRAINING_MODES = {
    True: torch.onnx.TrainingMode.TRAINING,
    False: torch.onnx.TrainingMode.EVAL,
    None: torch.onnx.TrainingMode.PRESERVE,
}


def _where_and_way_out(exc: Exception) -> str:
    """For a torch op the exporter cannot convert: which module called it, and what to do.

    torch's error names only the op; the traced node it was converting, still a local of
    the exporter's ``_run_symbolic_function`` frame in the traceback, knows the module
    (its scope) and the source line.
    """
    node = None
    traceback = exc.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_name == "_run_symbolic_function":
            node = traceback.tb_frame.f_locals.get("node")
        traceback = traceback.tb_next
    if node is None:
        return ""
    kind = node.kind()
    scope = _module_path(node.scopeName())
    source = str(node.sourceRange()).strip().splitlines()
    where = f"\n  in {scope}" + (f", {source[0].strip()}" if source else "")
    if not isinstance(exc, torch.onnx.errors.UnsupportedOperatorError):
        return where
    return (
        f"{where}\n  way out: give {kind} a symbolic with "
        f"@ortpass.export.register_symbolic({kind!r}) (fn(g, *inputs) emitting ONNX ops with g.op), "
        "or rewrite that call with ops the exporter supports"
    )


#: A module class attribute: the name of the child module this module only presents to
#: the exporter (ORTModule's flat-argument view); errors name that child and its paths.
VIEW_OF = "ortpass_view_of"


#: View classes seen by this process, by class name (scope names carry only the name).
_VIEW_ATTRIBUTES: dict[str, str] = {}


def shown_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module errors talk about: ``module``, or the one it is a view of."""
    view = getattr(module, VIEW_OF, None)
    if not view:
        return module
    _VIEW_ATTRIBUTES[type(module).__name__] = view
    return getattr(module, view)


def _module_path(scope_name: str) -> str:
    """``model.layers.0.mlp (MixtralSparseMoeBlock)`` from a TorchScript scope name, which
    reads ``pkg.Top::/pkg.Model::model/pkg.Layer::layers.0/...``: one ``class::attribute``
    per module on the way down."""
    parts = [segment.rpartition("::") for segment in scope_name.split("/") if segment]
    names: list[str] = []
    for _, _, attribute in parts:
        # torch names a module from the last non-numeric atom of its full name, so the
        # child of a container that runs it (nn.Sequential ``inner``) is ``inner.0``.
        if names and attribute.startswith(f"{names[-1]}.") and attribute[len(names[-1]) + 1:].replace(".", "").isdigit():
            names[-1] = attribute
        elif attribute:
            names.append(attribute)
    root = parts[0][0].rpartition(".")[2] if parts else ""
    if names and root and names[0] == _VIEW_ATTRIBUTES.get(root):
        names = names[1:]  # inside a view (ORTModule's), paths start at the module it shows
    path = ".".join(names)
    if not path:
        return "the top-level module"
    return f"{path} ({parts[-1][0].rpartition('.')[2]})"


def _check_loss_output(proto: onnx.ModelProto, loss_name: str) -> None:
    outputs = {o.name: o for o in proto.graph.output}
    if loss_name not in outputs:
        raise ExportError(f"the exported graph has no output {loss_name!r}; outputs: {sorted(outputs)}")
    tensor_type = outputs[loss_name].type.tensor_type
    if tensor_type.elem_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE):
        raise ExportError(f"loss {loss_name!r} is not a floating-point tensor; forward must return the loss first")
    if tensor_type.HasField("shape") and len(tensor_type.shape.dim) != 0:
        raise ExportError(f"loss {loss_name!r} has rank {len(tensor_type.shape.dim)}; it must be a scalar")


def _differentiable_outputs(model: ir.Model, given: Sequence[str] | None, sources: Sequence[str]) -> list[str]:
    """``given``, checked to be outputs; or every floating-point output that a value in
    ``sources`` (trainable parameters, inputs with gradient) reaches."""
    outputs = {v.name: v for v in model.graph.outputs}
    if given is not None:
        unknown = sorted(set(given) - set(outputs))
        if unknown:
            raise ExportError(f"outputs_with_grad names {unknown}, which are not outputs {sorted(outputs)}")
        return list(given)
    values = {v.name: v for v in (*model.graph.inputs, *model.graph.initializers.values())}
    reached: set[ir.Value] = {values[name] for name in sources if name in values}
    for node in model.graph:  # graph order is topological
        if any(v in reached for v in node.inputs if v is not None):
            reached.update(node.outputs)
    floats = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
    chosen = [name for name, v in outputs.items() if v in reached and v.dtype in floats]
    if not chosen:
        raise ExportError(f"no output of the module depends on a trainable parameter; outputs: {sorted(outputs)}")
    return chosen


def _name_unnamed_nodes(model: ir.Model) -> None:
    # The partition into forward/backward is recorded by node name, so names must be unique.
    seen: set[str] = set()
    for index, node in enumerate(model.graph):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_ortpass_{index}"
        seen.add(node.name)


def _export_dims(args, input_names, dynamic_axes) -> dict[str, int]:
    dims: dict[str, int] = {}
    by_name = dict(zip(input_names, args))
    for input_name, axes in (dynamic_axes or {}).items():
        value = by_name.get(input_name)
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"dynamic_axes names {input_name!r}, which is not a tensor input")
        for axis, dim_name in axes.items():
            size = int(value.shape[axis])
            if dims.setdefault(dim_name, size) != size:
                raise ExportError(f"dim {dim_name!r} is {dims[dim_name]} and {size} in the export batch")
    return dims
