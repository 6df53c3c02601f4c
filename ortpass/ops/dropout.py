"""The dropout ops whose recomputed copy must draw the forward's mask, and the seeds that
make it so: a seeded dropout kernel owns a generator, so a clone seeded alike draws the
same mask (ORT runs every node of the graph on every run, so both stay in step)."""

from __future__ import annotations

import zlib

import onnx_ir as ir

from ortpass.conventions import MS_DOMAIN, is_onnx_domain

__all__ = ["DROPOUT_OPS", "dropout_seed", "is_dropout"]

#: (domain, op type) of the dropouts whose clone must replay the forward's mask.
DROPOUT_OPS = frozenset(
    {
        ("", "Dropout"),
        (MS_DOMAIN, "BitmaskDropout"),
        (MS_DOMAIN, "BiasDropout"),
        (MS_DOMAIN, "BitmaskBiasDropout"),
        (MS_DOMAIN, "BiasSoftmaxDropout"),
    }
)


def is_dropout(node: ir.Node) -> bool:
    domain = "" if is_onnx_domain(node.domain) else node.domain
    return (domain, node.op_type) in DROPOUT_OPS


_SEED_RANGE = 2**31 - 1


def dropout_seed(node: ir.Node, base_seed: int = 0) -> int:
    """A seed for ``node`` derived from its first output's name, stable across processes.

    Distinct dropouts get distinct seeds (their masks stay independent); the same graph
    gets the same seeds every time, so two graphs built alike draw the same masks.
    """
    key = node.outputs[0].name or node.name or ""
    return (zlib.crc32(key.encode("utf-8")) + base_seed) % _SEED_RANGE
