"""Entry point of the recompute analysis: :func:`find_recompute_candidates`."""

from __future__ import annotations

import logging
from typing import Mapping

import onnx_ir as ir

from ortpass.analysis import memory
from ortpass.analysis.partition import get_partition
from ortpass.analysis.plans import PlanType
from ortpass.analysis.recomputable_ops import (
    ProbeLevel,
)
from ortpass.analysis.recompute.dims import (
    bind_internal_dims,
    dims_notes,
    resolve_dims,
)
from ortpass.analysis.recompute.result import (
    Occurrence,
    PlanRecord,
    RecomputeReport,
    SkippedCandidate,
)
from ortpass.analysis.recompute.search import CandidateSearch

__all__ = ["DEFAULT_MAX_NODES", "DEFAULT_MIN_ELEMENTS", "find_recompute_candidates"]

logger = logging.getLogger(__name__)


DEFAULT_MAX_NODES = 50


DEFAULT_MIN_ELEMENTS = 1024 * 1024


def find_recompute_candidates(
    training_model: ir.Model,
    *,
    probe_level: int = ProbeLevel.ADVANCED,
    layer_boundary: bool = False,
    dims: Mapping[str, int] | None = None,
    max_nodes: int = DEFAULT_MAX_NODES,
    min_elements: int = DEFAULT_MIN_ELEMENTS,
) -> RecomputeReport:
    """Find recompute plans for the stashed activations of a forward+backward graph.

    Args:
        training_model: a training graph (``ortpass.training.build_training_graph``); read only.
        probe_level: ORT's levels: 0 basic ops, 1 also MatMul/Softmax/LayerNorm (advanced).
        layer_boundary: only candidates inside detected transformer layers, keeping each
            layer's input (see :mod:`ortpass.analysis.layers`).
        dims: dim-param values to evaluate sizes at; default: the dims recorded at export,
            or the concrete shapes of a static graph.  Without either, savings are symbolic.
        max_nodes: the largest subgraph to recompute (ORT: 50).
        min_elements: all-static tensors smaller than this are not recomputed (ORT: 1Mi).

    Raises:
        ortpass.errors.TrainingGraphError: the model is not a tagged training graph.
        ValueError: a bad ``probe_level`` or ``dims``.
    """
    if probe_level not in (ProbeLevel.BASIC, ProbeLevel.ADVANCED):
        raise ValueError(f"probe_level must be 0 (basic) or 1 (advanced, ORT's default), not {probe_level!r}")
    nodes = list(training_model.graph)  # one walk of onnx_ir's linked list, shared
    partition = get_partition(training_model, nodes)
    symbols = memory.graph_dim_params(partition.stashed)  # once: dims resolution and the notes need it
    resolved_dims, dims_source = resolve_dims(training_model, dims, symbols)
    resolved_dims, notes = bind_internal_dims(training_model, resolved_dims, symbols)
    analysis = CandidateSearch(
        training_model, nodes, partition, probe_level, layer_boundary, resolved_dims, max_nodes, min_elements
    )
    found: list[Occurrence] = []
    skipped: list[SkippedCandidate] = []
    for entry, outputs in analysis.entries():
        rejection = analysis.entry_rejection(entry, outputs)
        if rejection is not None:
            skipped.append(SkippedCandidate(entry, rejection))
            continue
        full, compromise = analysis.occurrences(entry, outputs)
        if isinstance(compromise, Occurrence) and isinstance(full, Occurrence) and compromise.nodes == full.nodes:
            compromise = "the same subgraph as the full recompute"
        occurrences = [occ for occ in (full, compromise) if isinstance(occ, Occurrence)]
        if not occurrences:
            skipped.append(SkippedCandidate(entry, full))  # type: ignore[arg-type]
        found += occurrences
    records: dict[tuple[str, PlanType], PlanRecord] = {}
    skipped_entries = {s.entry for s in skipped}
    for occ in analysis.charge_unread_clone_outputs(found):
        if isinstance(occ, SkippedCandidate):
            if occ.entry not in skipped_entries:  # its full and compromise plans: one reason
                skipped_entries.add(occ.entry)
                skipped.append(occ)
            continue
        key = (occ.cluster, occ.type)
        records.setdefault(key, PlanRecord(occ.cluster, occ.type, [])).occurrences.append(occ)
    plans = sorted(records.values(), key=lambda r: _sort_key(r, resolved_dims))
    stashed = analysis.stashed_activations()
    logger.info(
        "recompute analysis: %d stashed activations, %d plans, %d layer boundaries",
        len(stashed),
        len(plans),
        len(analysis.layers),
    )
    return RecomputeReport(
        plans=plans,
        stashed=stashed,
        layer_boundaries=list(analysis.layers.nodes),
        skipped=skipped,
        probe_level=probe_level,
        layer_boundary=layer_boundary,
        dims=resolved_dims,
        dims_source=dims_source,
        notes=notes + dims_notes(resolved_dims, symbols),
        positions=analysis.positions,
    )


# Where savings cannot be evaluated, plans are ordered by their size at this value of
# every unbound dim: a stand-in for "large", so the dominant power of the dims wins.
_ORDERING_DIM = 1024


def _sort_key(record: PlanRecord, dims: Mapping[str, int] | None) -> tuple:
    saving = record.saving_bytes
    if saving is None:
        expr = record.symbolic_saving
        bound = {s: (dims or {}).get(s.name, _ORDERING_DIM) for s in expr.free_symbols}
        saving = int(expr.xreplace(bound))
    return (-saving, int(record.type), record.cluster)
