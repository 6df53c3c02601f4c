"""Symbolic tensor sizes and buffer aliasing, for memory analyses of training graphs.

Sizes are sympy expressions over the graph's dim params (``batch``, ``seq``...), so a
report can say how a saving scales, and evaluate it at concrete dims.  A dim param that
spells an expression over other dims (torch writes ``s0*s1``) becomes that expression; an
unnamed dim becomes a symbol of its own (``unk__<value>_<axis>``), which only
:func:`bind_internal_dims` binds (from shape inference at concrete dims), so sizes that
depend on it stay unevaluated rather than guessed.

Aliasing: some ops return a view of their input (ORT's CPU kernels reuse the input buffer
for Reshape, Squeeze, Unsqueeze, Flatten, Identity).  Freeing such an output frees nothing
while its input lives, so memory is counted on the *buffer*: the value at the root of a
chain of aliasing ops.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from typing import Callable, Iterable, Mapping

import onnx_ir as ir
import sympy
from sympy.parsing.sympy_parser import parse_expr

from ortpass.conventions import MS_DOMAIN, is_onnx_domain

__all__ = [
    "ALIAS_OPS",
    "BufferMap",
    "dim_symbol",
    "dim_expr",
    "element_bytes",
    "symbolic_numel",
    "symbolic_nbytes",
    "static_numel",
    "evaluate",
    "nbytes_at",
    "graph_dim_params",
    "bind_internal_dims",
    "is_alias_node",
]

logger = logging.getLogger(__name__)

# (domain, op type): ops whose output 0 is a view of input 0 on ORT.
ALIAS_OPS: frozenset[tuple[str, str]] = frozenset(
    {("", "Reshape"), ("", "Squeeze"), ("", "Unsqueeze"), ("", "Flatten"), ("", "Identity"), (MS_DOMAIN, "ExpandDims")}
)

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_EXPRESSION = re.compile(r"^[A-Za-z0-9_+\-*/() ]+$")


@functools.lru_cache(maxsize=None)
def dim_symbol(name: str) -> sympy.Symbol:
    """The sympy symbol of dim param ``name`` (positive integer: sizes simplify better)."""
    return sympy.Symbol(name, positive=True, integer=True)


@functools.lru_cache(maxsize=4096)
def _dim_param_expr(text: str) -> sympy.Expr:
    if _IDENTIFIER.match(text):
        return dim_symbol(text)
    if _EXPRESSION.match(text):
        names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
        try:
            expr = parse_expr(text, local_dict={n: dim_symbol(n) for n in names}, evaluate=True)
        except (SyntaxError, TypeError, ValueError, sympy.SympifyError):
            expr = None
        if isinstance(expr, sympy.Expr):
            return expr
    return dim_symbol(text)


def dim_expr(dim: int | ir.SymbolicDim, *, unknown_name: str) -> sympy.Expr:
    """One dimension as a sympy expression; ``unknown_name`` names an anonymous dim."""
    if isinstance(dim, int):
        return sympy.Integer(dim)
    if dim.value is None:
        return dim_symbol(unknown_name)
    return _dim_param_expr(str(dim.value))


def element_bytes(dtype: ir.DataType) -> sympy.Rational:
    """Bytes per element (a fraction for 4-bit types)."""
    return sympy.Rational(dtype.bitwidth, 8)


def symbolic_numel(value: ir.Value) -> sympy.Expr | None:
    """Element count of ``value`` as an expression, or None when its rank is unknown."""
    if value.shape is None:
        return None
    name = value.name or "value"
    return sympy.Mul(*(dim_expr(d, unknown_name=f"unk__{name}_{i}") for i, d in enumerate(value.shape)))


def symbolic_nbytes(value: ir.Value) -> sympy.Expr | None:
    """Bytes held by ``value`` as an expression, or None when its dtype or rank is unknown."""
    static = _static_nbytes(value)
    if static is not None:
        return static
    numel = symbolic_numel(value)
    dtype = value.dtype
    if numel is None or dtype is None or dtype == ir.DataType.UNDEFINED:
        return None
    if not isinstance(value.type, ir.TensorType):
        return None
    return numel * element_bytes(dtype)


def _static_bits(value: ir.Value) -> int | None:
    """Bits held by an all-static tensor, else None."""
    numel = static_numel(value)
    dtype = value.dtype
    if numel is None or dtype is None or dtype == ir.DataType.UNDEFINED or not isinstance(value.type, ir.TensorType):
        return None
    return numel * dtype.bitwidth


def _static_nbytes(value: ir.Value) -> sympy.Rational | None:
    """:func:`symbolic_nbytes` of an all-static tensor, as one number: the same value and
    type as the product of sympy Integers, at a fraction of the cost (sympy size arithmetic
    was 0.23 s of the recompute analysis at 17.5k static nodes)."""
    bits = _static_bits(value)
    return None if bits is None else sympy.Rational(bits, 8)


def static_numel(value: ir.Value) -> int | None:
    """Element count when every dim is a number, else None."""
    if value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return math.prod(value.shape)  # type: ignore[arg-type]


def evaluate(expr: sympy.Expr | None, dims: Mapping[str, int] | None) -> int | None:
    """``expr`` at ``dims`` (dim param name -> int), or None if a symbol stays unbound."""
    if expr is None:
        return None
    if isinstance(expr, sympy.Rational):  # a number (every static size): no symbols to bind
        return -(-expr.p // expr.q)
    bindings = {s: sympy.Integer(dims[s.name]) for s in expr.free_symbols if dims and s.name in dims}
    # sympy Integers, not ints: a bare symbol's xreplace returns the bound value itself.
    result = expr.xreplace(bindings) if bindings else expr
    if result.free_symbols:
        return None
    return int(sympy.ceiling(result))


def nbytes_at(value: ir.Value, dims: Mapping[str, int] | None) -> int | None:
    """``evaluate(symbolic_nbytes(value), dims)``: the bytes of ``value`` at ``dims``, or
    None.  A static size is computed in ints, without building a sympy number only to
    read it back (a third of order-backward-joins' size lookups' time)."""
    bits = _static_bits(value)
    if bits is not None:
        return -(-bits // 8)  # rounded up, as evaluate does
    return evaluate(symbolic_nbytes(value), dims)


def graph_dim_params(values: Iterable[ir.Value]) -> set[str]:
    """Names of the symbols the sizes of ``values`` depend on."""
    names: set[str] = set()
    for value in values:
        if static_numel(value) is not None:
            continue  # no symbols: skip building an expression
        expr = symbolic_nbytes(value)
        if expr is not None:
            names.update(s.name for s in expr.free_symbols)
    return names


def is_alias_node(node: ir.Node) -> bool:
    """True when ``node``'s output 0 is a view of its input 0."""
    domain = "" if is_onnx_domain(node.domain) else node.domain
    return (domain, node.op_type) in ALIAS_OPS and bool(node.inputs) and node.inputs[0] is not None


class BufferMap:
    """Maps values to the buffer that backs them (the root of their alias chain).

    Built lazily and memoized, so asking for every stashed value of a large graph walks
    each alias chain once.
    """

    def __init__(self, is_alias: Callable[[ir.Node], bool] = is_alias_node) -> None:
        """``is_alias``: which nodes' output 0 is a view of their input 0."""
        self._root: dict[ir.Value, ir.Value] = {}
        self._is_alias = is_alias

    def root(self, value: ir.Value) -> ir.Value:
        chain = []
        current = value
        while current not in self._root:
            producer = current.producer()
            if producer is None or not self._is_alias(producer) or current.index() != 0:
                self._root[current] = current
                break
            chain.append(current)
            current = producer.inputs[0]  # type: ignore[assignment]
        root = self._root[current]
        for v in chain:
            self._root[v] = root
        return root

    def is_view(self, value: ir.Value) -> bool:
        """True when ``value`` is a view (its buffer is another value's)."""
        return self.root(value) is not value


def bind_internal_dims(model: ir.Model, dims: Mapping[str, int], wanted: Iterable[str]) -> dict[str, int]:
    """Values for graph-internal dim params (``unk__3``...) at the given input ``dims``.

    Shape inference names dims it cannot express over the inputs' dims; the memory at
    concrete input dims still depends on them.  This runs onnx shape inference (with data
    propagation, so shape-computing subgraphs resolve) on a copy whose input dims are
    concrete, and reads each wanted symbol off the values where it appears (an unnamed dim
    by its ``unk__<value>_<axis>`` name).  The shapes the graph already knows are kept, at
    the concrete dims, and a ``Range`` over shape elements gets its length.  A symbol that
    gets two different values, or none, stays unbound.  The model is not changed.
    """
    import onnx
    import onnx.shape_inference

    from ortpass.graph.weightless import proto_without_weights

    wanted = set(wanted) - set(dims)
    if not wanted:
        return {}
    proto = proto_without_weights(model)  # the weights' bytes, copied four times, shape nothing
    for value_info in proto.graph.input:
        for dim in value_info.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in dims:
                dim.dim_value = int(dims[dim.dim_param])
    # Known inner shapes stay, at the concrete dims: inference cannot recover every one
    # (a Range's length is data to it), and a Shape of one feeds later shapes.
    lengths = _range_lengths(model, dims)
    for value_info in proto.graph.value_info:
        if value_info.name in lengths:
            value_info.type.tensor_type.shape.dim[0].dim_value = lengths[value_info.name]
            continue
        for dim in value_info.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                size = evaluate(_dim_param_expr(dim.dim_param), dims)
                if size is None:
                    dim.Clear()
                else:
                    dim.dim_value = size
    for value_info in proto.graph.output:  # declared output shapes would win over inferred ones
        value_info.type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception as exc:  # onnx raises several types; any of them means "no bindings"
        logger.info("shape inference at concrete dims failed (%s); internal dims stay symbolic", exc)
        return {}
    concrete = {
        vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
        for vi in [*inferred.graph.value_info, *inferred.graph.output]
    }
    bindings: dict[str, int] = {}
    conflicting: set[str] = set()
    for node in model.graph:
        for value in node.outputs:
            shape = concrete.get(value.name)
            if value.shape is None or shape is None or len(shape) != len(value.shape):
                continue
            for i, (dim, size) in enumerate(zip(value.shape, shape)):
                if not isinstance(dim, ir.SymbolicDim):
                    continue
                # An anonymous dim goes by the name symbolic_numel gives it.
                name = dim.value if dim.value is not None else f"unk__{value.name}_{i}"
                if name in wanted and size is not None:
                    if bindings.setdefault(name, size) != size:
                        conflicting.add(name)
    for name in conflicting:
        del bindings[name]
    return bindings


def _range_lengths(model: ir.Model, dims: Mapping[str, int]) -> dict[str, int]:
    """The length at ``dims`` of each ``Range`` whose length its shape leaves unnamed and
    whose start, limit and delta are constants or elements of shapes (torch writes
    ``Range(0, Gather(Shape(x), k), 1)``): onnx's inference treats a Range's length as
    data, so every shape downstream of one would stay unknown."""
    lengths: dict[str, int] = {}
    for node in model.graph:
        out = node.outputs[0] if node.op_type == "Range" and is_onnx_domain(node.domain) else None
        if out is None or out.shape is None or len(out.shape) != 1 or isinstance(out.shape[0], int):
            continue
        start, limit, delta = (_scalar_at(v, dims) for v in node.inputs[:3])
        if start is not None and limit is not None and delta:
            lengths[out.name] = max(math.ceil((limit - start) / delta), 0)
    return lengths


def _scalar_at(value: ir.Value | None, dims: Mapping[str, int]) -> float | None:
    """A scalar's value at ``dims``: a constant, or one element of a shape, through
    Cast, Squeeze and Identity.  None for anything else."""
    if value is None:
        return None
    constant = ir.convenience.get_const_tensor(value)  # an initializer or a Constant node
    if constant is not None:
        return float(constant.numpy().reshape(-1)[0]) if constant.size == 1 else None
    node = value.producer()
    if node is None or not is_onnx_domain(node.domain):
        return None
    if node.op_type in ("Cast", "Squeeze", "Identity"):
        return _scalar_at(node.inputs[0], dims)
    gathered = node.op_type == "Gather" and node.inputs[1] is not None
    index_tensor = ir.convenience.get_const_tensor(node.inputs[1]) if gathered else None
    if index_tensor is not None:
        shape = _shape_read(node.inputs[0])
        index = index_tensor.numpy().reshape(-1)
        if shape is None or index.size != 1 or not -len(shape) <= int(index[0]) < len(shape):
            return None
        return _dim_at(shape[int(index[0])], dims)
    shape = _shape_read(value)
    return _dim_at(shape[0], dims) if shape is not None and len(shape) == 1 else None


def _shape_read(value: ir.Value) -> list | None:
    """The dims a ``Shape`` node's output lists (its start/end applied), or None."""
    node = value.producer()
    if node is None or node.op_type != "Shape" or node.inputs[0] is None or node.inputs[0].shape is None:
        return None
    full = list(node.inputs[0].shape)
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", len(full))
    return full[start:end]


def _dim_at(dim: int | ir.SymbolicDim, dims: Mapping[str, int]) -> int | None:
    return dim if isinstance(dim, int) else evaluate(dim_expr(dim, unknown_name="unk__"), dims)
