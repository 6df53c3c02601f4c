"""The joint forward+backward program torch traced, written as an ortpass training graph.

:func:`joint_to_onnx` writes the program in ONNX (torch.onnx, then onnxscript's optimizer
with the parameters kept); :func:`record_training_graph` gives it what every training
graph of ortpass has: outputs named as ORT's builder names them (``<param>_grad``), the
parameters as graph inputs with their values, the loss's seed ``<loss>_grad`` an
initializer of ones, each node tagged forward or backward, and the training record
(:mod:`ortpass.analysis.partition`).  Used by :mod:`ortpass.training.from_torch`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import torch
import torch.utils._pytree as pytree

from ortpass.analysis.partition import TrainingInfo, set_training_info, tag
from ortpass.conventions import BUFFER_UPDATES_KEY, BUILDER_KEY, MAX_ORT_IR_VERSION, MS_DOMAIN, SIDE_KEY
from ortpass.errors import TrainingGraphError
from ortpass.ops.optimizer import optimize_keeping_training_values
from ortpass.training import onnx_decomposition, python_ops, stock_attention

__all__ = ["joint_to_onnx", "name_outputs", "record_training_graph", "without_terminal_codes"]

# onnxscript's SlicesSplit (two Slices of a last dim's halves -> one Split) is a two-root
# pattern, slow to match: without it the optimizer takes 2.4 s instead of 8.3 on BART's
# joint graph of the real-models suite (3269 nodes), 1.4 instead of 4.4 on LLaMA's, and
# writes the same graph to the byte on GPT-2, LLaMA, T5 and BART (onnxscript 0.7.2).
_SLOW_RULES_THAT_NEVER_FIRE = ("SlicesSplit",)


def joint_to_onnx(program: torch.export.ExportedProgram, input_names: list[str]) -> ir.Model:
    """The joint program in ONNX, every output (the gradients included) a graph output, in
    the program's output order; the user inputs and seeds named."""
    from torch.export.graph_signature import OutputKind

    _ops_torch_onnx_writes_right(program)
    signature = program.graph_signature
    for spec in signature.output_specs:
        spec.kind = OutputKind.USER_OUTPUT
    _, flat_spec = pytree.tree_flatten(tuple(range(len(signature.output_specs))))
    program._module_call_graph[0].signature.out_spec = flat_spec
    try:
        # Not torch.onnx's optimize=True: its optimizer folds Transpose(weight) into a
        # constant and merges equal weights.  onnxscript-optimize keeps the parameters.
        # An opaque Function call (ortpass.training.python_ops) is one custom-domain node.
        table = {**python_ops.translation_table(program), **stock_attention.translation_table(program),
                 **onnx_decomposition.translations()}
        with onnx_decomposition.decomposing_only_what_needs_it():  # the joint program is decomposed already
            onnx_program = torch.onnx.export(program, dynamo=True, optimize=False, verbose=False, custom_translation_table=table)
    except Exception as exc:
        raise TrainingGraphError(f"torch.onnx could not write the joint graph: {without_terminal_codes(str(exc))}") from exc
    model = onnx_program.model
    # Parameters and buffers (their FQNs, the initializers' names) are kept apart: equal
    # values would be merged (two BatchNorms' fresh running means, both zeros), and the
    # module feeds each by its name at every step.
    state = [*program.graph_signature.parameters, *program.graph_signature.buffers]
    optimize_keeping_training_values(model, state, skipped_rules=_SLOW_RULES_THAT_NEVER_FIRE)
    _broadcast_expanded_scalars(model.graph)
    _transposes_read_by_gemm(model)
    python_ops.type_outputs(model)
    stock_attention.type_outputs(model)
    model.ir_version = min(model.ir_version, MAX_ORT_IR_VERSION)
    user_inputs = [v for v in model.graph.inputs if v.name not in model.graph.initializers]
    for value, name in zip(user_inputs, input_names):
        value.name = name
    return model


# Elementwise ops that broadcast their inputs numpy-style: a scalar read in place of a
# tensor of the output's shape filled with it gives the same values.
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Equal", "Less", "Greater"})


def _broadcast_expanded_scalars(graph: ir.Graph) -> None:
    """Let broadcasting read a constant scalar that torch wrote as a full tensor.

    torch's backward formulas fill tensors with a constant (``full_like(x, 1) - sigmoid``
    in SiLU's gradient), which torch.onnx writes ``Expand(c, shape)``, and the trace shares
    one such tensor among every layer of the same shape: on HF LLaMA (batch 8 x 512, MLP
    1024) a 16 MiB tensor of ones alive through the whole backward.  Rule: where an
    ``Expand`` of a one-element constant feeds a broadcasting elementwise op whose other
    inputs already have the Expand's output shape, the op reads the constant itself; the
    Expand goes once nothing reads it.  Same values: each element is the constant either way.
    """
    for expand in [n for n in graph if n.op_type == "Expand" and n.domain in ("", "ai.onnx")]:
        fill, expanded = expand.inputs[0], expand.outputs[0]
        constant = ir.convenience.get_const_tensor(fill) if fill is not None else None
        if constant is None or constant.size != 1 or not _fully_named(expanded.shape) or expanded.is_graph_output():
            continue
        for reader, index in list(expanded.uses()):
            others = [v for i, v in enumerate(reader.inputs) if i != index]
            if reader.op_type in _BROADCASTING and reader.domain in ("", "ai.onnx") and others and all(
                v is not None and v is not expanded and v.shape == expanded.shape for v in others
            ):
                reader.replace_input_with(index, fill)
        if not expanded.uses():
            graph.remove(expand, safe=True)


def _transposes_read_by_gemm(model: ir.Model) -> None:
    """Let a matrix product read a transposed operand in place, as ORT's builder writes it.

    A weight's gradient in torch's backward is ``mm(permute(x), dY)``, which torch.onnx
    writes ``MatMul(Transpose(x), dY)``: the Transpose copies the whole activation gradient
    (batch x seq x ffn, 16 MiB a layer on HF LLaMA at batch 8 x 512) before the product
    reads it.  ORT's own builder writes ``Gemm(x, dY, transA=1)``, which reads ``x`` as it
    is.  ORT would fuse the pair into a ``FusedMatMul``, but that node gets a new, higher
    index, and ORT's default order then runs every weight gradient at the end of the step
    (``docs/design/torch-builder.md``, so the builder's sessions disable that fusion).
    Attention's backward ``P^T dO`` transposes the batched seq x seq probabilities alike.
    Rule: a ``MatMul`` one or both of whose operands are ``Transpose(a)`` swapping the last
    two axes alone, read by ``MatMul`` nodes only, becomes ``Gemm`` with
    ``transA``/``transB`` where both operands are matrices, else (operands of one rank
    above 2, each transposed matrix square) ``com.microsoft::FusedMatMul`` with the same
    flags, in the MatMul's place; the Transpose goes once nothing reads it.  The same
    product: the flags transpose each matrix of the batch, alpha 1 and no C add nothing.
    Square only, as measured on HF LLaMA: ``P^T dO`` fused took 7.8 ms a layer against 9.9,
    and a seq x head-dim operand's cheap Transpose fused was no faster (the design doc).
    """
    graph = model.graph
    for matmul in [n for n in graph if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")]:
        operands, flags = [], {}
        for value, flag in zip(matmul.inputs, ("transA", "transB")):
            source = _transposed_matrices(value)
            operands.append(value if source is None else source)
            if source is not None:
                flags[flag] = 1
        ranks = {_rank(v) for v in operands}
        transposed = [v for v, source in zip(matmul.inputs, operands) if v is not source]
        if not flags or len(ranks) != 1 or None in ranks or (ranks != {2} and not all(map(_square, transposed))):
            continue
        if ranks == {2}:
            product = ir.node("Gemm", operands, flags, name=matmul.name)
        else:
            product = ir.node("FusedMatMul", operands, {**flags, "alpha": 1.0}, domain=MS_DOMAIN, name=matmul.name)
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        ir.convenience.replace_nodes_and_values(graph, matmul, [matmul], [product], matmul.outputs, product.outputs)
        for value in dict.fromkeys(transposed):  # one Transpose may be both operands
            if not value.uses():
                graph.remove(value.producer(), safe=True)


def _transposed_matrices(value: ir.Value | None) -> ir.Value | None:
    """``a`` where ``value`` is ``Transpose(a)`` swapping its last two axes alone (a
    matrix, or each matrix of a batch), read by MatMul nodes only."""
    transpose = value.producer() if value is not None else None
    if transpose is None or transpose.op_type != "Transpose" or transpose.domain not in ("", "ai.onnx"):
        return None
    rank = _rank(transpose.inputs[0])
    if rank is None or rank < 2 or value.is_graph_output():
        return None
    perm = transpose.attributes.get("perm")
    swapped = [*range(rank - 2), rank - 1, rank - 2]
    # No perm reverses the axes: the swap for a matrix only.
    if list(perm.as_ints()) != swapped if perm is not None else rank != 2:
        return None
    if any(reader.op_type != "MatMul" for reader, _ in value.uses()):
        return None
    return transpose.inputs[0]


def _square(value: ir.Value) -> bool:
    """Whether the last two dims of ``value`` are known to be equal (a number or a symbol)."""
    rows, columns = value.shape[-2], value.shape[-1]
    return rows == columns and (isinstance(rows, int) or rows.value is not None)


def _rank(value: ir.Value | None) -> int | None:
    return len(value.shape) if value is not None and value.shape is not None else None


def _fully_named(shape: ir.Shape | None) -> bool:
    """Every dim a number or a named symbol: two such shapes that compare equal are equal."""
    return shape is not None and all(isinstance(d, int) or d.value is not None for d in shape)


# An ANSI escape sequence (ECMA-48 CSI: ESC [ parameters intermediates final byte).
_TERMINAL_CODE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


def without_terminal_codes(text: str) -> str:
    """``text`` without terminal escape codes: torch.onnx colours its error text for a
    terminal (``\\x1b[96m...\\x1b[0m``), which a log file or an exception shows as is."""
    return _TERMINAL_CODE.sub("", text)


def _ops_torch_onnx_writes_right(program: torch.export.ExportedProgram) -> None:
    """ATen ops of the joint graph rewritten into ops torch.onnx (torch 2.14) translates:

    - ``aten.empty_permuted`` (a backward formula's buffer) -> ``aten.empty``: torch.onnx has
      no translation, and an ONNX tensor has no memory layout to permute;
    - ``aten.copy(dst, src)`` with ``src`` broadcast to ``dst``'s shape (``ids[:, 0] = 0``,
      as transformers shifts labels right for BART and T5) -> ``zeros_like(dst) + src``:
      torch.onnx writes ``src`` unbroadcast, and ORT then refuses the graph;
    - ``aten.squeeze`` that squeezes nothing (``labels.squeeze()`` of a regression head's
      batch of labels, whose dim is symbolic and so not 1) and ``prims.view_of`` ->
      ``aten.alias``: torch.onnx decomposes such a squeeze again into ``prims.view_of``
      (torch's reference returns the input unchanged as a view), which it cannot translate
      ("No ONNX function found for prims.view_of", BERT with ``num_labels=1``).
    """
    aten = torch.ops.aten
    graph = program.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.prims.view_of.default or (node.target in _SQUEEZES and _shape(node) == _shape(node.args[0])):
            node.target, node.args, node.kwargs = aten.alias.default, node.args[:1], {}
        elif node.target is aten.empty_permuted.default:
            node.target = aten.empty.memory_format
            node.args = node.args[:1]
        elif node.target is aten.copy.default and _shape(node.args[0]) != _shape(node.args[1]):
            dst, src = node.args[:2]
            with graph.inserting_before(node):
                zeros = graph.call_function(aten.zeros_like.default, (dst,))
                zeros.meta["val"] = dst.meta["val"]  # torch.onnx reads each node's value (shape, dtype)
                if src.meta["val"].dtype != dst.meta["val"].dtype:
                    cast = graph.call_function(aten._to_copy.default, (src,), {"dtype": dst.meta["val"].dtype})
                    cast.meta["val"], src = src.meta["val"].to(dst.meta["val"].dtype), cast
                summed = graph.call_function(aten.add.Tensor, (zeros, src))
            summed.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(summed)
            graph.erase_node(node)
    program.graph_module.recompile()


_SQUEEZES = (torch.ops.aten.squeeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims)


def _shape(node: Any) -> tuple | None:
    value = getattr(node, "meta", {}).get("val")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def record_training_graph(
    model: ir.Model, backward, output_args: list[str], inputs_by_arg: dict[str, str], out_names, seed_names, loss_index, with_grad,
    prefix: str, buffers_to_mutate: dict[str, str],
) -> TrainingInfo:
    """Name the outputs and the parameters, make the loss's seed ones, drop the objective,
    tag the sides and record the training info.  ``output_args``: the joint program's
    output names, in the order of the ONNX graph's outputs; ``inputs_by_arg``: its user
    inputs' names -> the graph's input names; ``buffers_to_mutate``: output arg -> the
    buffer whose new value it is (those outputs come first in the program)."""
    graph = model.graph
    by_arg = dict(zip(output_args, graph.outputs))
    objective_and_outputs = [value for arg, value in by_arg.items() if arg not in buffers_to_mutate]
    flat = objective_and_outputs[1 : 1 + len(out_names)]
    graph.outputs.clear()
    for value, name in zip(flat, out_names):
        graph.outputs.append(_as_output(graph, value, name))
    updated = {buffer.removeprefix(f"{prefix}."): by_arg[arg] for arg, buffer in buffers_to_mutate.items()}
    state = _rename_state(graph, prefix)
    gradients, input_gradients = {}, {}
    for arg, param in backward.gradients_to_parameters.items():
        param = state.get(param, param.removeprefix(f"{prefix}."))
        gradients[param] = _append_output(graph, by_arg[arg], f"{param}_grad")
    for arg, input_arg in backward.gradients_to_user_inputs.items():
        user_input = inputs_by_arg[input_arg]
        if user_input not in seed_names:  # not a seed's own gradient
            input_gradients[user_input] = _append_output(graph, by_arg[arg], f"{user_input}_grad")
    _make_inputs(graph, list(gradients))
    updates = {_append_output(graph, value, f"{buffer}_updated"): buffer for buffer, value in updated.items()}
    if updates:
        model.metadata_props[BUFFER_UPDATES_KEY] = json.dumps(updates)
    loss_name = out_names[loss_index] if loss_index is not None else None
    if loss_name is not None:
        _seed_of_ones(graph, seed_names[0], graph.outputs[loss_index])
    common_passes.RemoveUnusedNodesPass()(model)
    _dims_from_inputs(graph, [v for v in graph.inputs if v.name in seed_names])
    _name_nodes(graph)
    _tag_sides(graph, [*flat, *(v for v in graph.outputs if v.name in updates)])
    early = sorted({n.name for v in graph.inputs if v.name in seed_names for n, _ in v.uses() if n.metadata_props[SIDE_KEY] == "forward"})
    if early:
        raise TrainingGraphError(f"forward nodes {early} read an output's gradient (a size torch.onnx took from it)")
    seeds = {} if loss_name else {out_names[k]: s for k, s in zip(with_grad, seed_names)}
    info = TrainingInfo(loss_name, tuple(gradients), gradients, seeds, input_gradients)
    set_training_info(model, info)
    model.metadata_props[BUILDER_KEY] = "torch"
    return info


def _as_output(graph: ir.Graph, value: ir.Value, name: str) -> ir.Value:
    """``value`` renamed ``name``, or an Identity of it named so where it cannot be renamed
    (a graph input, an initializer, already an output, or the name taken)."""
    taken = any(v.name == name for v in graph.outputs) or name in graph.initializers
    if value.is_graph_input() or value.is_initializer() or value.is_graph_output() or taken:
        node = ir.node("Identity", [value], name=f"{name}_identity")
        graph.append(node)
        node.outputs[0].name = name
        node.outputs[0].shape, node.outputs[0].type = value.shape, value.type
        return node.outputs[0]
    value.name = name
    return value


def name_outputs(graph: ir.Graph, names: list[str]) -> None:
    """The graph's outputs named ``names``, in order (an Identity where a value cannot be
    renamed: a graph input, an initializer, or one value returned twice)."""
    values = list(graph.outputs)
    graph.outputs.clear()
    for value, name in zip(values, names):
        graph.outputs.append(_as_output(graph, value, name))


def _append_output(graph: ir.Graph, value: ir.Value, name: str) -> str:
    output = _as_output(graph, value, name)
    graph.outputs.append(output)
    return output.name


def _rename_state(graph: ir.Graph, prefix: str) -> dict[str, str]:
    """Parameters and buffers lose the wrapper's prefix: ``inner.layer.weight`` ->
    ``layer.weight``.  Returns old -> new names."""
    renamed = {}
    for old in [n for n in graph.initializers if n.startswith(f"{prefix}.")]:
        value = graph.initializers.pop(old)
        value.name = old.removeprefix(f"{prefix}.")
        graph.initializers[value.name] = value
        renamed[old] = value.name
    return renamed


def _make_inputs(graph: ir.Graph, params: list[str]) -> None:
    """Parameters become graph inputs first, their values kept as initializers (what ORT's
    builder does: overridable defaults, a self-contained model)."""
    existing = set(graph.inputs)
    for k, name in enumerate(params):
        value = graph.initializers[name]
        if value not in existing:
            graph.inputs.insert(k, value)


def _seed_of_ones(graph: ir.Graph, name: str, loss: ir.Value) -> None:
    """The loss's seed becomes ``Where(false, loss, ones)``: ones, read after the loss.  ORT
    walks the loss, a leaf no node reads, last: its input (the vocabulary-wide log-softmax
    that the loss gathers from) stayed alive through all of backward, 32 MiB on HF GPT-2 at
    seq 512.  Read by the seed, the loss runs before backward starts."""
    (seed,) = [v for v in graph.inputs if v.name == name]
    graph.inputs.remove(seed)
    dtype = seed.dtype.numpy() if seed.dtype is not None else np.float32
    ones = ir.Value(name=f"{name}_ones", type=seed.type, shape=seed.shape)
    ones.const_value = ir.tensor(np.ones([int(d) for d in seed.shape], dtype=dtype), name=ones.name)
    false = ir.Value(name=f"{name}_after_loss_condition", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    false.const_value = ir.tensor(np.array(False), name=false.name)
    graph.register_initializer(ones)
    graph.register_initializer(false)
    after_loss = ir.node("Where", [false, loss, ones], name=f"{name}_after_loss")
    first_reader = min((node for node, _ in seed.uses()), key=list(graph).index)
    graph.insert_before(first_reader, after_loss)
    ir.convenience.replace_all_uses_with(seed, after_loss.outputs[0])
    out = after_loss.outputs[0]
    out.name, out.type, out.shape = name, seed.type, seed.shape


def _dims_from_inputs(graph: ir.Graph, seeds: list[ir.Value]) -> None:
    """Read each size that torch.onnx takes from a seed (``Shape(seed, start=k,
    end=k+1)``: the seed's dims are the output's) from an input of the module with the
    same symbolic dim instead: forward must not read backward's inputs."""
    others = [v for v in graph.inputs if v not in seeds]
    for seed in seeds:
        for node, _ in list(seed.uses()):
            if node.op_type != "Shape":
                continue
            start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", len(seed.shape))
            dim = seed.shape[start] if end == start + 1 else None
            source = next(((v, a) for v in others for a, d in enumerate(v.shape or ()) if isinstance(dim, ir.SymbolicDim) and dim.value is not None and d == dim), None)
            if source is None:
                continue  # a backward reader: left as it is
            node.replace_input_with(0, source[0])
            node.attributes["start"] = ir.AttrInt64("start", source[1])
            node.attributes["end"] = ir.AttrInt64("end", source[1] + 1)


def _name_nodes(graph: ir.Graph) -> None:
    seen: set[str] = set()
    for index, node in enumerate(graph):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_ortpass_{index}"
        seen.add(node.name)


def _tag_sides(graph: ir.Graph, forward_outputs: list[ir.Value]) -> None:
    """Forward: every node a forward output needs (those read no seed: they are detached
    from the objective).  Backward: the rest, the seeds' readers and what only gradients need."""
    forward: set[ir.Node] = set()
    stack = [v.producer() for v in forward_outputs if v.producer() is not None]
    while stack:
        node = stack.pop()
        if node in forward:
            continue
        forward.add(node)
        stack.extend(v.producer() for v in node.inputs if v is not None and v.producer() is not None)
    for node in graph:
        tag(node, "forward" if node in forward else "backward")
