"""Which ops a recompute subgraph may contain, and which of their inputs it does not follow.

The table is keyed, as in ORT's memory optimizer, by (domain, op type, since-version of the
op's schema): an op whose schema changed in a newer opset is not recomputable there until
someone checks that the new version is still deterministic and cheap.  Each entry has a
probe level and the input indices that the upward search does *not* follow (shape-like or
scalar inputs such as Dropout's ratio or Expand's shape: the clone reads the forward value).

Probe levels are ORT's (the first field of its probe config ``<level>:<layer boundary>``,
measured on ORT 1.19.2): 0 basic (element-wise, data movement, Dropout, Gelu variants),
1 advanced (also MatMul, Softmax, LayerNorm variants: costlier to redo).  ORTModule probed
at 1 by default, and so does :func:`ortpass.analysis.find_recompute_candidates`.

Differences from ORT 1.19.2's table, on purpose:

- opset 21 versions of Cast, Reshape, Squeeze, Unsqueeze, Transpose and ConstantOfShape are
  accepted: opset 21 only added 4-bit element types to them;
- Flatten and Identity are accepted (views; ORT's CPU kernels alias their input);
- Reshape's shape input is not followed (ORT follows it): it is a handful of int64s,
  usually computed by Shape/Gather/Unsqueeze/Concat arithmetic outside the table, so
  following it failed every candidate ending in such a Reshape; the clone reads the
  forward's shape instead, which is the same value;
- Erf is accepted: it is element-wise and cheap, and torch exports the exact Gelu through
  it (ORT's table needs no Erf because ORT fuses that pattern into a Gelu op first);
- Tanh, Pow and Sigmoid are accepted, for the same reason in the torch builder's graphs
  (GPT-2's tanh Gelu, ``0.5 * x * (1 + tanh(c * (x + 0.044715 * x ** 3)))``, SiLU);
- IsNaN is accepted: element-wise and cheap, and torch's SDPA export guards every
  attention softmax with ``Where(IsNaN(p), 0, p)``;
- And, Or, Not, Greater, GreaterOrEqual and LessOrEqual are accepted: element-wise on
  bools and cheap, and the attention masks transformers builds are made of them;
- GatherND and ReduceMax are accepted: the torch builder adds an attention mask to the
  scores as a bias backward does not read, made from transformers' ``attention_mask[batch,
  key]`` (a GatherND) with a ReduceMax over the keys; recomputing the probabilities rebuilds it;
- Concat is accepted: ORT's table has ConcatTraining, which ORT's builder makes of every
  Concat, and the torch builder keeps Concat (a rotary embedding's ``rotate_half``);
- ``com.microsoft::PythonOp`` is recomputable only when its ``func_name`` is registered with
  :func:`register_recomputable_function` (FlashAttention-like functions are registered
  here; ORT hard-codes the same list).  Its clone must replay the forward's randomness,
  which the recompute pass arranges.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Iterable, Mapping

import onnx
import onnx_ir as ir

from ortpass.conventions import (
    FUSED_ATTENTION,
    FUSED_MASKED_ATTENTION,
    MS_DOMAIN,
    is_onnx_domain,
)

__all__ = [
    "ProbeLevel",
    "RecomputableOp",
    "lookup_recomputable",
    "is_recomputable",
    "recomputable_ops",
    "register_recomputable_op",
    "register_recomputable_function",
    "unregister_recomputable_function",
    "recomputable_functions",
    "attention_functions",
    "recomputable_function_of",
    "node_opset",
    "since_version",
    "is_optional_output",
    "optional_outputs",
    "OptionalOutputs",
]

logger = logging.getLogger(__name__)


class ProbeLevel:
    """ORT's probe levels (the first field of ORT's probe config ``<level>[:<layer>]``)."""

    BASIC = 0
    ADVANCED = 1


@dataclasses.dataclass(frozen=True)
class RecomputableOp:
    """One allow-table entry: ``op_type`` in ``domain`` at the listed schema versions."""

    domain: str
    op_type: str
    since_versions: frozenset[int]
    level: int = ProbeLevel.BASIC
    ignored_inputs: frozenset[int] = frozenset()


_TABLE: dict[tuple[str, str], RecomputableOp] = {}

# func_name values of PythonOps that may be recomputed.  FlashAttention's functions are
# deterministic given the RNG state, which the recompute pass saves and replays.
_ATTENTION_FUNCTIONS: set[str] = {
    "flash_attn.flash_attn_interface.FlashAttnFunc",
    "flash_attn.flash_attn_interface.FlashAttnVarlenFunc",
}
_RECOMPUTABLE_FUNCTIONS: set[str] = {
    *_ATTENTION_FUNCTIONS,
    "flash_attn.bert_padding.IndexFirstAxis",
    "flash_attn.bert_padding.IndexPutFirstAxis",
}


def _normalize_domain(domain: str) -> str:
    return "" if is_onnx_domain(domain) else domain


def register_recomputable_op(
    op_type: str,
    since_versions: Iterable[int],
    *,
    domain: str = "",
    level: int = ProbeLevel.BASIC,
    ignored_inputs: Iterable[int] = (),
) -> RecomputableOp:
    """Add (or replace) an allow-table entry; returns it."""
    if level not in (ProbeLevel.BASIC, ProbeLevel.ADVANCED):
        raise ValueError(f"level must be {ProbeLevel.BASIC} (basic) or {ProbeLevel.ADVANCED} (advanced), not {level}")
    entry = RecomputableOp(
        _normalize_domain(domain), op_type, frozenset(since_versions), level, frozenset(ignored_inputs)
    )
    _TABLE[(entry.domain, op_type)] = entry
    return entry


def register_recomputable_function(func_name: str, *, attention: bool = False) -> None:
    """Allow PythonOps with this ``func_name`` (``module.QualName``) in recompute subgraphs.

    Register only functions whose forward is cheap relative to the memory its outputs hold
    and whose randomness (if any) comes from torch's RNG state, which the clone replays.
    ``attention=True`` also makes the function an attention op for layer detection
    (:mod:`ortpass.analysis.layers`), as ORT treats flash_attn's functions.
    """
    if not isinstance(func_name, str) or not func_name:
        raise ValueError(f"func_name must be a non-empty string, not {func_name!r}")
    _RECOMPUTABLE_FUNCTIONS.add(func_name)
    if attention:
        _ATTENTION_FUNCTIONS.add(func_name)
    else:
        _ATTENTION_FUNCTIONS.discard(func_name)


def unregister_recomputable_function(func_name: str) -> None:
    _RECOMPUTABLE_FUNCTIONS.discard(func_name)
    _ATTENTION_FUNCTIONS.discard(func_name)


def recomputable_functions() -> frozenset[str]:
    return frozenset(_RECOMPUTABLE_FUNCTIONS)


def attention_functions() -> frozenset[str]:
    """The registered recomputable functions that compute attention."""
    return frozenset(_ATTENTION_FUNCTIONS)


def recomputable_function_of(node: ir.Node) -> str | None:
    """The ``func_name`` of a PythonOp whose function is registered as recomputable, else None."""
    if _normalize_domain(node.domain) != MS_DOMAIN or node.op_type != "PythonOp":
        return None
    attr = node.attributes.get("func_name")
    name = attr.as_string() if attr is not None else None
    return name if name in _RECOMPUTABLE_FUNCTIONS else None


def recomputable_ops(probe_level: int = ProbeLevel.ADVANCED) -> list[RecomputableOp]:
    """The table entries enabled at ``probe_level``."""
    return [e for e in _TABLE.values() if e.level <= probe_level]


def node_opset(node: ir.Node, opset_imports: Mapping[str, int]) -> int | None:
    """The opset of ``node``'s domain in the model (``node.version`` wins when set)."""
    if node.version is not None:
        return node.version
    domain = _normalize_domain(node.domain)
    if domain in opset_imports:
        return opset_imports[domain]
    if domain == "" and "ai.onnx" in opset_imports:
        return opset_imports["ai.onnx"]
    return None


@functools.lru_cache(maxsize=None)
def since_version(domain: str, op_type: str, opset: int) -> int | None:
    """The since-version of the schema ``op_type`` resolves to at ``opset``.

    For the default domain onnx's schema registry answers.  Contrib domains (com.microsoft)
    are not in it and all their ops are version 1; so are ORT's contrib ops registered in
    the default domain (LayerNormalization before opset 17, SimplifiedLayerNormalization).
    """
    domain = _normalize_domain(domain)
    if domain != "":
        return 1 if opset >= 1 else None
    try:
        return onnx.defs.get_schema(op_type, max_inclusive_version=opset, domain="").since_version
    except onnx.defs.SchemaError:
        return 1


@functools.lru_cache(maxsize=None)
def _optional_outputs(op_type: str, opset: int) -> frozenset[int]:
    try:
        schema = onnx.defs.get_schema(op_type, max_inclusive_version=opset, domain="")
    except onnx.defs.SchemaError:
        return frozenset()
    option = onnx.defs.OpSchema.FormalParameterOption
    if any(o.option == option.Variadic for o in schema.outputs):
        return frozenset()
    return frozenset(i for i, o in enumerate(schema.outputs) if o.option == option.Optional)


#: Optional outputs of ORT contrib ops, from ORT 1.19.2's schemas (onnx does not ship them):
#: the dropout variants' mask.
_MS_OPTIONAL_OUTPUTS = {
    "BitmaskDropout": frozenset({1}),
    "BiasDropout": frozenset({1}),
    "BitmaskBiasDropout": frozenset({1}),
}


def optional_outputs(node: ir.Node, opset_imports: Mapping[str, int]) -> frozenset[int]:
    """The indices of the outputs the schema of ``node`` marks optional: a Dropout's mask,
    LayerNormalization's Mean and InvStdDev.  Default-domain schemas come from onnx;
    com.microsoft ones from a short table (the dropout variants).  The recompute pass drops
    an optional output nobody reads, and its analysis counts on that.  (onnx_ir's
    ``RemoveUnusedNodesPass`` applies the same schema rule, but privately and for the
    default domain only, and the analysis must ask before anything is removed.)
    """
    domain = _normalize_domain(node.domain)
    if domain == MS_DOMAIN:
        return _MS_OPTIONAL_OUTPUTS.get(node.op_type, frozenset())
    if domain != "" or node.op_type == "BatchNormalization":
        # BatchNormalization's optional outputs select its training behaviour.
        return frozenset()
    opset = node_opset(node, opset_imports)
    if opset is None:
        return frozenset()
    return _optional_outputs(node.op_type, opset)


class OptionalOutputs:
    """:func:`optional_outputs` of the nodes of one model, asked once per op: the answer
    depends on the domain, op type and version alone, and the recompute pass asks it of
    every node it cloned and of every clone."""

    def __init__(self, opset_imports: Mapping[str, int]) -> None:
        self.opset_imports = dict(opset_imports)
        self._known: dict[tuple[str, str, int | None], frozenset[int]] = {}

    def __call__(self, node: ir.Node) -> frozenset[int]:
        key = (node.domain, node.op_type, node.version)
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = optional_outputs(node, self.opset_imports)
        return known


def is_optional_output(node: ir.Node, index: int, opset_imports: Mapping[str, int]) -> bool:
    """True when the schema of ``node`` marks output ``index`` optional (see
    :func:`optional_outputs`)."""
    return index in optional_outputs(node, opset_imports)


def lookup_recomputable(
    node: ir.Node, opset_imports: Mapping[str, int], probe_level: int = ProbeLevel.ADVANCED
) -> RecomputableOp | None:
    """The allow-table entry that makes ``node`` recomputable at ``probe_level``, or None."""
    entry = _TABLE.get((_normalize_domain(node.domain), node.op_type))
    if entry is None or entry.level > probe_level:
        return None
    opset = node_opset(node, opset_imports)
    if opset is None or since_version(entry.domain, node.op_type, opset) not in entry.since_versions:
        return None
    if entry.domain == MS_DOMAIN and node.op_type == "PythonOp" and recomputable_function_of(node) is None:
        return None
    return entry


def is_recomputable(node: ir.Node, opset_imports: Mapping[str, int], probe_level: int = ProbeLevel.ADVANCED) -> bool:
    return lookup_recomputable(node, opset_imports, probe_level) is not None


def _register_defaults() -> None:
    basic, advanced = ProbeLevel.BASIC, ProbeLevel.ADVANCED
    arithmetic = (1, 6, 7, 13, 14)
    onnx_ops: list[tuple[str, tuple[int, ...], int, tuple[int, ...]]] = [
        # (op type, since-versions, level, inputs not followed)
        ("Add", arithmetic, basic, ()),
        ("Sub", arithmetic, basic, ()),
        ("Mul", arithmetic, basic, ()),
        ("Div", arithmetic, basic, ()),
        ("Neg", (1, 6, 13), basic, ()),
        ("BatchNormalization", (1, 6, 7, 9, 14, 15), basic, ()),
        ("Cast", (1, 6, 9, 13, 19, 21), basic, ()),
        ("ConstantOfShape", (9, 20, 21), basic, (0,)),  # the shape input
        ("Cos", (7,), basic, ()),
        ("Sin", (7,), basic, ()),
        ("CumSum", (11, 14), basic, (1,)),  # the axis
        # Dropout before 12 has no seed attribute, so forward and clone could differ.
        ("Dropout", (12, 13), basic, (1, 2)),  # ratio, training_mode
        ("Einsum", (12,), basic, ()),
        ("Equal", (1, 7, 11, 13, 19), basic, ()),
        # Not in ORT's table: ORT fuses Gelu before its analysis, torch exports it as
        # Div/Erf/Add/Mul/Mul, and without Erf the chain fails and keeps Gelu's largest
        # intermediate (4 x hidden per token) alive in every layer.
        ("Erf", (9, 13), basic, ()),
        # Not in ORT's table: the torch builder writes GPT-2's tanh Gelu out, and its
        # backward reads the Tanh: without Tanh and Pow, 16 MiB per layer stayed stashed
        # (hidden 256, batch 8 x 512).  ORT fuses that pattern into FastGelu first.
        ("Tanh", (6, 13), basic, ()),
        # Not in ORT's table, for the same graphs: that Gelu's x ** 3, and RMSNorm's x ** 2.
        ("Pow", (7, 12, 13, 15), basic, ()),
        # Not in ORT's table: SiLU written out (x * sigmoid(x), LLaMA's MLP in the torch
        # builder's graphs; ORT fuses it into QuickGelu first): 16 MiB per layer stashed.
        ("Sigmoid", (6, 13), basic, ()),
        # Not in ORT's table: torch's SDPA export guards the softmax with
        # Where(IsNaN(p), 0, p); without IsNaN the bool mask and the float probabilities it
        # reads were both stashed in every attention layer.  Element-wise and cheap.
        ("IsNaN", (9, 13, 20), basic, ()),
        # Not in ORT's table: transformers builds its attention masks with And/Or/Not of
        # comparisons; without them a fused attention PythonOp reading the mask can never
        # be recomputed.  Element-wise and cheap, on bools.
        ("And", (1, 7), basic, ()),
        ("Or", (1, 7), basic, ()),
        ("Not", (1,), basic, ()),
        ("Greater", (1, 7, 9, 13), basic, ()),
        ("GreaterOrEqual", (12, 16), basic, ()),
        ("LessOrEqual", (12, 16), basic, ()),
        ("Less", (1, 7, 9, 13), basic, ()),
        ("Expand", (8, 13), basic, (1,)),  # the shape
        # Not in ORT's table: the torch builder's attention mask bias (module docstring).
        ("GatherND", (11, 12, 13), basic, (1,)),  # the indices, as Gather's
        ("ReduceMax", (1, 11, 12, 13, 18, 20), basic, (1,)),  # the axes
        ("Gather", (1, 11, 13), basic, (1,)),  # the indices
        ("Gelu", (20,), basic, ()),
        ("Range", (11,), basic, (0, 1, 2)),  # scalars
        ("Reshape", (1, 5, 13, 14, 19, 21), basic, (1,)),  # the shape (see the module docstring)
        ("Slice", (1, 10, 11, 13), basic, (1, 2, 3, 4)),  # starts, ends, axes, steps
        ("Split", (1, 2, 11, 13, 18), basic, (1,)),  # the split sizes
        ("Squeeze", (1, 11, 13, 21), basic, (1,)),  # the axes
        ("Unsqueeze", (1, 11, 13, 21), basic, (1,)),  # the axes
        ("Tile", (1, 6, 13), basic, (1, 2)),  # repeats (and opset-1 axis)
        ("Transpose", (1, 13, 21), basic, ()),
        ("Concat", (4, 11, 13), basic, ()),  # ConcatTraining's (module docstring)
        ("Trilu", (14,), basic, (1,)),  # k
        ("Where", (9, 16), basic, ()),
        ("Flatten", (1, 9, 11, 13, 21), basic, ()),
        ("Identity", (1, 13, 14, 16, 19, 21), basic, ()),
        ("MatMul", (1, 9, 13), advanced, ()),
        # A MatMul with a bias (ORT's table has it; HF GPT-2's Conv1D exports to it).
        ("Gemm", (1, 6, 7, 9, 11, 13), advanced, ()),
        ("Softmax", (1, 11, 13), advanced, ()),
        ("LayerNormalization", (1, 17), advanced, ()),
        # Advanced, as in ORT and like LayerNormalization: a reduction over the hidden dim
        # per token, costlier to redo than element-wise ops.  ORT's fusions make it of
        # every RMSNorm (LLaMA, T5); its InvStdDev gets a size from ortpass.graph.schemas.
        ("SimplifiedLayerNormalization", (1,), advanced, ()),
    ]
    for op_type, versions, level, ignored in onnx_ops:
        register_recomputable_op(op_type, versions, level=level, ignored_inputs=ignored)
    ms_ops: list[tuple[str, int, tuple[int, ...]]] = [
        ("Gelu", basic, ()),
        ("FastGelu", basic, ()),
        ("QuickGelu", basic, ()),
        ("BiasGelu", basic, ()),
        ("BitmaskDropout", basic, (1, 2)),  # ratio, training_mode
        ("BiasDropout", basic, (3, 4)),  # ratio, training_mode
        ("BitmaskBiasDropout", basic, (3, 4)),
        ("ConcatTraining", basic, ()),
        ("FlattenAndUnpad", basic, (1,)),  # the indices
        ("PadAndUnflatten", basic, (1, 2)),  # the indices and unflatten dims
        ("PythonOp", basic, ()),  # gated on func_name, see lookup_recomputable
        ("FusedMatMul", advanced, ()),
        ("BiasSoftmax", advanced, ()),
        ("BiasSoftmaxDropout", advanced, (2,)),  # ratio
        ("SkipLayerNormalization", advanced, ()),
        ("SkipSimplifiedLayerNormalization", advanced, ()),
    ]
    for op_type, level, ignored in ms_ops:
        register_recomputable_op(op_type, (1,), domain=MS_DOMAIN, level=level, ignored_inputs=ignored)


_register_defaults()


# ortpass's own attention Functions (ortpass.export.fused_attention): forward is one fused
# attention kernel, cheap next to the seq x seq probabilities it saves ORT from keeping, and
# their dropout draws from torch's generator, which the recompute clone replays.
for _name in (FUSED_ATTENTION, FUSED_MASKED_ATTENTION):
    register_recomputable_function(_name, attention=True)
