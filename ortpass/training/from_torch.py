"""Build the forward+backward graph from torch's own autograd: no training build needed.

The rule: torch differentiates, ONNX carries the result.  ``torch.export`` traces the
module (non-strict, the sizes named in ``dynamic_axes`` symbolic), torch's AOTAutograd
traces the joint forward+backward graph in ATen ops
(``torch.export.experimental._export_forward_backward``), and ``torch.onnx`` writes it
in standard ONNX ops, which stock ``onnxruntime`` runs.  ORT's gradient builder is the
other builder (:mod:`ortpass.training.build`); it needs ``onnxruntime-training``, which
has no wheel for CPython 3.13+.  Writing gradients of our own instead would duplicate
the gradient formulas torch keeps for every op.

Both kinds of graph of the other builder come out, recorded the same way
(:mod:`ortpass.analysis.partition`), so the post-gradient passes cannot tell them apart:

- *From a loss*: torch differentiates ``loss * seed`` where ``seed`` is the value named
  ``<loss>_grad``, made here an initializer of ones, as ORT's builder names it.
- *From outputs*: torch differentiates ``sum_k (output_k * seed_k).sum()``; each seed is a
  graph input ``<output_k>_grad``, the gradient the caller computed for that output.

The product itself is dead once the gradients are out, and is removed.  Nodes that the
forward outputs need and that read no seed are tagged forward; the rest backward.

A ``torch.autograd.Function`` goes into the graph with its own backward
(:mod:`ortpass.training.autograd_functions`: ``torch.export`` alone would inline its
forward and drop its backward); one torch cannot trace is refused by name.  A forward that updates a
buffer (BatchNorm's running statistics in training mode) is functionalized by the trace:
the graph computes each new value, as the forward output ``<buffer>_updated``, and
:func:`buffer_updates` lists them for the caller to copy into the module after a step.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import onnx_ir as ir
import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind

from ortpass.analysis import memory
from ortpass.conventions import BUFFER_UPDATES_KEY
from ortpass.errors import TrainingGraphError
from ortpass.export.control_flow import data_dependent_refusal
from ortpass.infra.metadata import update_export_info
from ortpass.training import stock_attention
from ortpass.training.autograd_functions import FunctionCalls, retrying_untraceable, routing
from ortpass.training.joint_decompositions import joint_decompositions
from ortpass.training.joint_onnx import joint_to_onnx, record_training_graph, without_terminal_codes
from ortpass.training.label_gather import DEFAULT_THRESHOLD, LabelGather

__all__ = ["buffer_updates", "build_training_graph_from_torch"]

logger = logging.getLogger(__name__)

_INNER = "inner"  # the user's module inside the joint wrapper; stripped from state names


def build_training_graph_from_torch(
    module: torch.nn.Module,
    args: Sequence[torch.Tensor],
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_axes: Mapping[str, Mapping[int, str] | Sequence[int]] | None = None,
    loss: int | None | str | Callable[[list[torch.Tensor]], int | None] = "auto",
    outputs_with_grad: Sequence[int] | None = None,
    density_threshold: float | None = DEFAULT_THRESHOLD,
    fused_attention: bool = False,
) -> ir.Model:
    """Trace ``module`` at ``args`` and return its training graph in standard ONNX ops.

    Args:
        module: called as ``module(*args)``; its output is a tensor or any pytree of
            tensors (flattened in pytree order, ``None`` leaves dropped).  Its state is
            not changed.
        args: example tensors.  Those that require grad get a gradient output
            ``<input>_grad``.
        input_names: graph input names (default ``input_<k>``).
        output_names: graph output names of the flat outputs (default: ``loss`` for the
            loss, ``output_<k>`` for the others).
        dynamic_axes: per input name, the axes that may change size (a dict of axis ->
            name, as ``ortpass.export.export`` takes, or a list of axes).  Those torch.export
            finds dynamic are symbolic in the graph's inputs, valid from size 2 on; the
            ones the trace ties to a size (and those of size 0 or 1 in ``args``) are
            static there, and ORT refuses other sizes.
        loss: the flat output to differentiate: its index, ``"auto"`` (output 0 when it
            is a floating-point scalar that requires grad, else ``outputs_with_grad``'s
            way), None to differentiate ``outputs_with_grad``, or a function of the flat
            outputs (of one eager forward) that returns one of those.
        outputs_with_grad: the flat outputs whose gradients the caller feeds (default:
            every output that requires grad); used when there is no loss.
        density_threshold: a cross-entropy whose labels at ``args`` are valid under this
            percent is traced over its valid rows (:mod:`ortpass.training.label_gather`);
            None: never.
        fused_attention: SDPA calls without dropout as one Python op running torch's kernel
            (:mod:`ortpass.training.stock_attention`, needs onnxruntime-extensions to run).

    Raises:
        TrainingGraphError: a torch.autograd.Function torch cannot trace (named), nothing
            to differentiate, or a failed trace (with torch's reason).
    """
    args = tuple(args)
    names = list(input_names) if input_names is not None else [f"input_{k}" for k in range(len(args))]
    if len(names) != len(args):
        raise TrainingGraphError(f"{len(names)} input names for {len(args)} inputs")
    dynamic = _dynamic_shapes(names, args, dynamic_axes or {})
    _refuse_cumulative_batch_norms(module)
    gather = LabelGather(module, density_threshold)  # measures in the probe, gathers in the trace
    probe = gather.measured(_probe_outputs, module, args)
    loss_index, with_grad = _differentiated(probe, loss, outputs_with_grad)
    out_names = _output_names(output_names, len(probe), loss_index)
    seeds = [torch.ones_like(probe[loss_index])] if loss_index is not None else [torch.ones_like(probe[k]) for k in with_grad]
    joint = _Joint(module, len(args), loss_index, with_grad)
    seed_dynamic = tuple({a: torch.export.Dim.AUTO for a in range(s.dim())} or None for s in seeds)
    with stock_attention.fusing(fused_attention):
        program = gather.traced(_joint_program, joint, (*args, *seeds), (*dynamic, *seed_dynamic))
    backward = program.graph_signature.backward_signature  # read before joint_to_onnx changes the kinds
    mutated = dict(program.graph_signature.buffers_to_mutate)  # output arg -> buffer, likewise
    output_args = [spec.arg.name for spec in program.graph_signature.output_specs]
    # The backward signature names an input by AOTAutograd's placeholder, arg<k>_1, k its
    # position among all of the program's inputs.
    input_args = [f"arg{k}_1" for k, spec in enumerate(program.graph_signature.input_specs) if spec.kind == InputKind.USER_INPUT]
    seed_names = [f"{out_names[k]}_grad" for k in ([loss_index] if loss_index is not None else with_grad)]
    model = joint_to_onnx(program, [*names, *seed_names])
    inputs_by_arg = dict(zip(input_args, [*names, *seed_names]))
    info = record_training_graph(
        model, backward, output_args, inputs_by_arg, out_names, seed_names, loss_index, with_grad, _INNER, mutated
    )
    _name_dims(model, names, args, dynamic_axes or {})
    gather.record(model)
    logger.info(
        "built training graph from torch: %d nodes, %d gradients", len(model.graph), len(info.gradients)
    )
    return model


def buffer_updates(model: ir.Model) -> dict[str, str]:
    """The buffers a torch-built training graph's forward updates: graph output -> buffer
    name (empty for a forward that updates none, and for ORT's builder's graphs)."""
    raw = model.metadata_props.get(BUFFER_UPDATES_KEY)
    return json.loads(raw) if raw else {}


def _name_dims(model: ir.Model, names: list[str], args: tuple, dynamic_axes) -> None:
    """Give torch.export's symbols (``s23``) the names ``dynamic_axes`` gives them
    (``batch``), or ``<input>_dim<axis>``, in every shape of the graph, and record each
    name's size at ``args`` as ``ortpass.export`` does (the memory analyses read it)."""
    renames: dict[str, str] = {}
    sizes: dict[str, int] = {}
    inputs = {v.name: v for v in model.graph.inputs}
    for name, arg in zip(names, args):
        axes = dynamic_axes.get(name, ())
        given = axes if isinstance(axes, Mapping) else {}
        for axis, dim in enumerate(inputs[name].shape or ()) if name in inputs else ():
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None and dim.value not in renames and not dim.value.isdigit():
                renames[dim.value] = given.get(axis, f"{name}_dim{axis}")
                sizes[renames[dim.value]] = int(arg.shape[axis])
    symbols = {memory.dim_symbol(old): memory.dim_symbol(new) for old, new in renames.items()}
    values = [*model.graph.inputs, *(v for node in model.graph for v in node.outputs)]
    for value in values:
        if value.shape is not None and any(isinstance(d, ir.SymbolicDim) and d.value is not None for d in value.shape):
            value.shape = ir.Shape([_renamed(d, symbols) for d in value.shape])
    update_export_info(model, dims=sizes)


def _renamed(dim: int | ir.SymbolicDim, symbols: Mapping[Any, Any]) -> int | ir.SymbolicDim:
    """``dim`` with torch's symbols renamed, inside expressions too (``s85*s95`` is
    ``batch*seq``): the memory analyses bind a dim's size by its symbols' names.  A dim
    the trace specialized (a guard in a backward formula, ``Eq(s87, 4)``) is written by
    torch.onnx as the symbolic name ``"4"``, which ONNX Runtime accepts at any size while
    the graph holds 4 inside: it becomes the static dim it is."""
    if not isinstance(dim, ir.SymbolicDim) or dim.value is None:
        return dim
    expr = memory.dim_expr(dim, unknown_name="")
    if expr.is_Integer:
        return int(expr)
    renamed = expr.xreplace(symbols)
    return dim if renamed == expr else ir.SymbolicDim(str(renamed))


class _Joint(torch.nn.Module):
    """``(objective, *detached outputs)``: the objective is what torch differentiates (the
    loss times its seed, or the outputs dotted with theirs); the outputs go out as values."""

    def __init__(self, module: torch.nn.Module, n_inputs: int, loss_index: int | None, with_grad: list[int]):
        super().__init__()
        setattr(self, _INNER, module)
        self.training = module.training
        self._n_inputs, self._loss_index, self._with_grad = n_inputs, loss_index, with_grad

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs, seeds = tensors[: self._n_inputs], tensors[self._n_inputs :]
        flat = _flatten(getattr(self, _INNER)(*inputs))
        if self._loss_index is not None:
            objective = flat[self._loss_index] * seeds[0]
        else:
            objective = sum((flat[k] * seed).sum() for k, seed in zip(self._with_grad, seeds))
        return (objective, *(t.detach() for t in flat))


def _flatten(output: Any) -> list[torch.Tensor]:
    leaves = [leaf for leaf in pytree.tree_leaves(output) if leaf is not None]
    wrong = [type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)]
    if wrong:
        raise TrainingGraphError(f"the module returned {wrong[0]} among its outputs; a training graph returns tensors only")
    return leaves


def _dynamic_shapes(names, args, dynamic_axes) -> tuple:
    unknown = sorted(set(dynamic_axes) - set(names))
    if unknown:
        raise TrainingGraphError(f"dynamic_axes names inputs {unknown}, which are not among {names}")
    shapes = []
    for name, arg in zip(names, args):
        axes = dynamic_axes.get(name, ())
        # torch.export specializes sizes 0 and 1 (it assumes a dynamic dim is >= 2, where
        # broadcasting cannot differ): such a dim stays static here.
        shapes.append({int(a): torch.export.Dim.AUTO for a in axes if arg.shape[int(a)] > 1} or None)
    return tuple(shapes)


def _math_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` as matmul, softmax and dropout: what the joint trace
    sees instead of the fused kernel, whose decomposition gives an output strided in a way
    its meta kernel does not, and a later ``.view`` then fails (torch 2.14, GPT-2).

    The mask is added to the scores as a bias at the mask's own size (0 / -inf for a
    boolean or causal one), not filled into them: the same scores, and the backward needs
    nothing for it (softmax's gradient is already 0 where its output is), where
    ``masked_fill`` costs a ``Where`` over batch x heads x seq x seq in the backward too.
    A query that may attend to no key gets 0 and no gradient, as from torch's SDPA (its
    safe softmax), not the NaN of a softmax over -inf only.

    The scale multiplies the query, not the scores: batch x heads x seq x head-dim values
    instead of seq x seq, in the forward, every recompute clone and the backward (HF LLaMA,
    batch 8 x 512, head dim 64: 30 ms of a 1.45 s stock step).  Exact where the scale is a
    power of two (head dims 4, 16, 64, 256); otherwise it rounds once at another place, as
    torch's own math attention does (it scales query and key by the scale's square root)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    scores = torch.matmul(query * scale, key.transpose(-2, -1))
    if is_causal:  # every query sees at least the first key
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        scores = scores + _bias(causal, scores.dtype)
    attends = None
    if attn_mask is not None:
        # Few nodes on purpose: recompute rebuilds this bias for each layer's probabilities.
        keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf")
        attends = keep.any(dim=-1, keepdim=True)
        if attn_mask.dtype == torch.bool:
            scores = scores + _bias(keep | ~attends, scores.dtype)
        else:
            scores = scores + attn_mask.masked_fill(~attends, 0.0)
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = torch.nn.functional.dropout(weights, p=dropout_p)
    output = torch.matmul(weights, value)
    return output if attends is None else output * attends


def _bias(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``keep`` holds, -inf elsewhere: a boolean attention mask as one to add."""
    return torch.zeros((), dtype=dtype, device=keep.device).where(keep, float("-inf"))


@contextlib.contextmanager
def _attention_as_math() -> Iterator[None]:
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = stock_attention.replacement(_math_attention)  # fused where asked
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


def _export(module: torch.nn.Module, args: tuple, dynamic: tuple, functions: FunctionCalls | None = None) -> torch.export.ExportedProgram:
    """``module`` traced by torch.export; with ``functions``, each autograd Function call
    kept whole for the joint trace, else inlined (its forward: a graph without backward),
    but for those torch cannot trace, which run as Python ops either way."""
    if functions is None:
        return retrying_untraceable(lambda calls: _export(module, args, dynamic, calls), forward_only=True)
    # Grad on: a call under no_grad that updates BatchNorm statistics is traced as a step.
    with routing(), torch.random.fork_rng(devices=[]), _attention_as_math(), torch.enable_grad():
        try:
            return torch.export.export(module, args, dynamic_shapes=(dynamic,), strict=False)
        except Exception as exc:
            functions.refuse_untraceable(_shown(module))
            refusal = data_dependent_refusal(exc, _shown(module))  # a path read from a tensor: named by file:line
            if refusal is not None:
                raise refusal from exc
            raise TrainingGraphError(f"torch.export could not trace {_shown(module)}: {without_terminal_codes(str(exc))}") from exc


def _refuse_cumulative_batch_norms(module: torch.nn.Module) -> None:
    """A training BatchNorm with ``momentum=None`` averages over every batch so far: its
    forward reads ``1 / num_batches_tracked`` as a Python float, data torch.export cannot
    trace ("Could not extract specialized integer from data-dependent expression")."""
    cumulative = [
        name for name, m in module.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats and m.momentum is None
    ]  # fmt: skip
    if cumulative:
        raise TrainingGraphError(
            f"{_shown(module)}: BatchNorm {cumulative} in training mode with momentum=None (a cumulative average, "
            "1/num_batches_tracked read as a Python number) cannot be traced by torch.export; give it a momentum, "
            "or use ORT's builder (onnxruntime-training)"
        )


def _shown(module: torch.nn.Module) -> str:
    inner = getattr(module, _INNER, module)
    inner = getattr(inner, "ortpass_view_of", None) and getattr(inner, inner.ortpass_view_of) or inner
    return type(inner).__name__


def _probe_outputs(module: torch.nn.Module, args: tuple) -> list[torch.Tensor]:
    """The flat outputs of one eager forward, and whether each requires grad (torch.export's
    fake outputs do not say).  Nothing is kept for backward (the saved-tensor hook drops
    every activation), torch's generators and the module's buffers are left as they were."""
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    with (
        torch.random.fork_rng(devices=[]),
        torch.autograd.graph.saved_tensors_hooks(lambda _: None, lambda _: None),
        torch.enable_grad(),
    ):
        flat = _flatten(module(*args))
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(buffers[name])
    return [t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() else t.detach() for t in flat]


def _differentiated(probe: list[torch.Tensor], loss, outputs_with_grad) -> tuple[int | None, list[int]]:
    if callable(loss):
        loss = loss(probe)
    elif loss == "auto":
        loss = 0 if probe and probe[0].dim() == 0 and probe[0].requires_grad and outputs_with_grad is None else None
    if loss is not None:
        if not 0 <= loss < len(probe) or probe[loss].dim() != 0 or not probe[loss].requires_grad:
            raise TrainingGraphError(f"output {loss} is not a floating-point scalar loss that requires grad")
        return loss, []
    with_grad = list(outputs_with_grad) if outputs_with_grad is not None else [k for k, t in enumerate(probe) if t.requires_grad]
    if not with_grad:
        raise TrainingGraphError("no output requires grad: nothing for backward to differentiate")
    bad = [k for k in with_grad if not 0 <= k < len(probe) or not probe[k].is_floating_point()]
    if bad:
        raise TrainingGraphError(f"outputs_with_grad {bad} are not floating-point outputs of the module")
    return None, with_grad


def _output_names(given, count: int, loss_index: int | None) -> list[str]:
    if given is not None:
        if len(given) != count:
            raise TrainingGraphError(f"{len(given)} output names for {count} outputs")
        return list(given)
    return ["loss" if k == loss_index else f"output_{k}" for k in range(count)]


def _joint_program(joint: _Joint, args: tuple, dynamic: tuple) -> torch.export.ExportedProgram:
    # The Functions' calls live until the joint trace ran; one torch cannot trace, again as a Python op.
    return retrying_untraceable(lambda functions: _joint_program_once(joint, args, dynamic, functions))


def _joint_program_once(joint: _Joint, args: tuple, dynamic: tuple, functions: FunctionCalls) -> torch.export.ExportedProgram:
    from torch.export.experimental import _export_forward_backward

    program = _export(joint, args, dynamic, functions)
    _drop_unread_parameters(program)
    try:
        with joint_decompositions(), torch.enable_grad():  # ATen ops torch.onnx cannot write (right)
            joint_program = _export_forward_backward(program, joint_loss_index=0)
    except Exception as exc:
        functions.refuse_untraceable(_shown(joint))
        raise TrainingGraphError(f"torch could not trace the backward of {_shown(joint)}: {without_terminal_codes(str(exc))}") from exc
    if functions.applied:
        logger.info("autograd Functions traced into the joint graph: %s", sorted(set(functions.applied)))
    return joint_program


def _drop_unread_parameters(program: torch.export.ExportedProgram) -> None:
    """A parameter no node reads (the second name of a tied weight: torch.export lifts
    every name, and the graph reads one) would stop AOTAutograd ("a parameter that did not
    receive a gradient"); it gets none, as in eager."""
    specs = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    for node in list(program.graph.nodes):
        spec = specs.get(node.name)
        if node.op == "placeholder" and not node.users and spec is not None and spec.kind == InputKind.PARAMETER:
            program.graph_signature.input_specs.remove(spec)
            program.graph.erase_node(node)
            program.state_dict.pop(spec.target, None)
    program.graph_module.recompile()
