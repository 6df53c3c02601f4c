"""torch.onnx's decomposition of the joint program, left out where it has nothing to decompose.

``torch.onnx.export`` traces every ``ExportedProgram`` it is given once more, through
``run_decompositions`` with a table of the ATen ops torchlib has no ONNX function for.  The
joint program the torch builder hands it is already a trace of core ATen ops (AOTAutograd's
joint trace decomposed it), and tracing it again with its dynamic dims costs more per layer
than any other step of the build: on HF LLaMA (hidden 256, batch 2 x 128, one thread, stock
onnxruntime 1.32, torch 2.14) 12.9 of a 48 s first call at 4 layers and 23.8 of 73 s at 8.

Rule: when no call in the program's graphs (submodules included) targets an op of that
table, and every node but the runtime checks has the value (``meta["val"]``) a trace
records, which the translation reads, torch.onnx goes on with the program as it is;
otherwise it decomposes as always.  A decomposition by a table that matches no call changes
no op, so the ONNX graph is the same (node for node on the real-models suite's 17 families).

The one table op the families' joint programs held, ``aten.squeeze.dims`` (the gradient of
an ``unsqueeze``), gets a translation of its own (:func:`translations`): the ``Squeeze`` that
torch.onnx's decomposition (``prims.squeeze``) and torchlib would have written.  The rest of
torch.onnx's preparation (type promotions, assertion nodes removed) runs either way.

This reaches into torch.onnx's private modules (``_fx_passes``, ``_decomp``); where a
torch release lacks them, torch.onnx decomposes as it always does.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

logger = logging.getLogger(__name__)

__all__ = ["decomposing_only_what_needs_it", "translations"]


def translations() -> dict[Any, Any]:
    """torch.onnx translations (``custom_translation_table``) of ATen ops torchlib leaves to
    its decomposition, so that the joint program needs none."""
    import torch

    return {torch.ops.aten.squeeze.dims: squeeze_dims}


def squeeze_dims(self: Any, dim: Any) -> Any:
    """``aten.squeeze.dims``: ``Squeeze`` over the listed dims of size 1.  A dim of another
    size, or of a symbolic size, stays: torch's decomposition (``torch._refs.squeeze``, under
    torch.onnx's size-oblivious tracing) keeps it too.  Written with torchlib's opset."""
    from onnxscript.onnx_opset import opset18 as op

    rank = len(self.shape)
    if rank == 0:
        return op.Identity(self)
    axes = sorted({d % rank for d in dim if isinstance(self.shape[d % rank], int) and self.shape[d % rank] == 1})
    return op.Squeeze(self, axes=axes) if axes else op.Identity(self)


@contextlib.contextmanager
def decomposing_only_what_needs_it() -> Iterator[None]:
    """Within: ``torch.onnx.export`` skips its decomposition of a program none of whose
    calls its table decomposes (module docstring)."""
    try:
        from torch.onnx._internal.exporter import _decomp, _fx_passes
    except ImportError:  # another torch.onnx: its own preparation, unchanged
        yield
        return
    original = getattr(_fx_passes, "decompose_with_registry", None)
    if original is None or not hasattr(_decomp, "create_onnx_friendly_decomposition_table"):
        yield
        return

    def decompose_with_registry(program: Any, registry: Any) -> Any:
        implemented = set(_decomp.get_onnx_implemented_overloads(registry))
        table = _decomp.create_onnx_friendly_decomposition_table(implemented)
        decomposed = sorted({str(target) for target in _call_targets(program.graph_module) if target in table})
        if decomposed:
            logger.debug("torch.onnx decomposes the joint program for %s", decomposed)
            return original(program, registry)
        unknown = [node.name for node in _nodes(program.graph_module)
                   if node.op != "output" and "val" not in node.meta and not _is_assertion(node)]
        if unknown:  # its trace would give them one, and the translation reads it
            logger.debug("torch.onnx decomposes the joint program: no value recorded for %s", unknown[:5])
            return original(program, registry)
        logger.debug("torch.onnx's decomposition left out: no call of the joint program is in its table")
        return program

    _fx_passes.decompose_with_registry = decompose_with_registry
    try:
        yield
    finally:
        _fx_passes.decompose_with_registry = original


def _nodes(graph_module: Any) -> Iterator[Any]:
    """Every node of ``graph_module`` and of its submodules (a higher-order op's branches
    and bodies are submodules)."""
    for module in graph_module.modules():
        graph = getattr(module, "graph", None)
        if graph is not None:
            yield from graph.nodes


def _is_assertion(node: Any) -> bool:
    """A runtime check (``aten._assert_tensor_metadata``, ``_assert_scalar``,
    ``sym_constrain_range_for_size``): no value, and torch.onnx removes it before translating."""
    name = str(node.target)
    return node.op == "call_function" and ("._assert" in name or "sym_constrain_range" in name)


def _call_targets(graph_module: Any) -> Iterator[Any]:
    return (node.target for node in _nodes(graph_module) if node.op == "call_function")
