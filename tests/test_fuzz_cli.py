"""Byte-level fuzz of the golden models through the command line.

Hundreds of mutated model files (bytes flipped, cut, repeated, spliced, with a fixed seed)
go through ``ortpass report`` and ``ortpass optimize`` in process.  Whatever the bytes,
the command exits 0 or 2 (never 1: a mutated input is bad input, not a failed pass),
prints no traceback, leaves its input as it was, and writes nothing but the output it was
asked for, and only when it succeeds.
"""

from __future__ import annotations

import contextlib
import io as _io
import os
import re
from pathlib import Path

import numpy as np
import pytest

from ortpass.cli import main

REPO = Path(__file__).resolve().parents[1]
GOLDEN = sorted((REPO / "golden_models").glob("*.onnx"))
SEED = 20261123


def _mutate(data: bytes, rng: np.random.Generator) -> bytes:
    """One of a few byte-level mutations, at a random place."""
    buf = bytearray(data)
    kind = rng.integers(8)
    if kind >= 6:  # change one letter inside a run of text: the protobuf stays readable
        return _mutate_text(buf, rng)
    at = int(rng.integers(len(buf)))
    if kind == 0:  # flip bits in a few bytes
        for i in rng.integers(len(buf), size=int(rng.integers(1, 9))):
            buf[int(i)] ^= 1 << int(rng.integers(8))
    elif kind == 1:  # cut the file short
        del buf[at:]
    elif kind == 2:  # drop a chunk
        del buf[at : at + int(rng.integers(1, 64))]
    elif kind == 3:  # repeat a chunk
        buf[at:at] = buf[at : at + int(rng.integers(1, 64))]
    elif kind == 4:  # overwrite a varint-sized run with random bytes
        n = int(rng.integers(1, 11))
        buf[at : at + n] = rng.bytes(n)
    else:  # splice in bytes from elsewhere in the file
        src = int(rng.integers(len(buf)))
        buf[at:at] = buf[src : src + int(rng.integers(1, 128))]
    return bytes(buf)


_TEXT_RUN = re.compile(rb"[A-Za-z_./:]{4,}")


def _mutate_text(buf: bytearray, rng: np.random.Generator) -> bytes:
    """A letter of a name, an op type, an attribute or a metadata key changed in place
    (same length): what a protobuf parser accepts and the model's meaning does not."""
    runs = [m.span() for m in _TEXT_RUN.finditer(buf)]
    start, end = runs[int(rng.integers(len(runs)))]
    at = int(rng.integers(start, end))
    buf[at] = int(rng.choice(list(b"abcxyzQ_0.{[\"\xff")))
    return bytes(buf)


def _run(argv: list[str]) -> tuple[int, str]:
    err = _io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(_io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def _listing(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


@pytest.fixture(scope="module")
def training_bytes(tmp_path_factory) -> bytes:
    """The mlp golden model's training graph: the mutations then reach the analysis."""
    out = tmp_path_factory.mktemp("train") / "mlp.train.onnx"
    assert _run(["optimize", str(REPO / "golden_models" / "mlp.onnx"), "-o", str(out), "--pipeline", "build-training-graph"])[0] == 0
    return out.read_bytes()


def _check_one(tmp_path: Path, name: str, data: bytes, argv_for) -> int:
    directory = tmp_path / name
    directory.mkdir()
    model = directory / "in.onnx"
    model.write_bytes(data)
    os.utime(model, ns=(1_000_000_000, 1_000_000_000))
    argv, produced = argv_for(model, directory)
    before = _listing(directory)
    code, err = _run(argv)
    assert code in (0, 2), f"{name}: exit {code}\n{err}"
    assert "Traceback" not in err, f"{name}: a traceback\n{err}"
    assert all(len(line) <= 2100 for line in err.splitlines()), f"{name}: an unbounded line"
    assert model.read_bytes() == data and model.stat().st_mtime_ns == 1_000_000_000, f"{name}: the input changed"
    expected = before | ({produced} if code == 0 and produced else set())
    assert _listing(directory) == expected, f"{name}: stray files {_listing(directory) ^ expected}"
    return code


def _report(model: Path, directory: Path):
    return ["report", str(model), "--json", str(directory / "r.json"), "--min-elements", "0"], "r.json"


def _optimize(model: Path, directory: Path):
    return ["optimize", str(model), "-o", str(directory / "out.onnx"), "--pipeline", "insert-gather-before-sce-loss"], "out.onnx"


@pytest.mark.slow
def test_mutated_golden_models_exit_0_or_2_and_leave_everything_alone(tmp_path: Path, training_bytes: bytes):
    rng = np.random.default_rng(SEED)
    sources = {p.stem: p.read_bytes() for p in GOLDEN}
    sources["mlp.train"] = training_bytes
    assert len(sources) >= 5
    codes = []
    for name, data in sources.items():
        for i in range(60):
            mutated = _mutate(data, rng)
            command = _report if i % 2 == 0 or name == "mlp.train" else _optimize
            codes.append(_check_one(tmp_path, f"{name}-{i}", mutated, command))
    assert len(codes) >= 300
    # Both verdicts occur: the mutations are not all rejected at the protobuf parser.
    assert codes.count(0) >= 10 and codes.count(2) >= 50


def test_the_unmutated_models_pass_the_same_harness(tmp_path: Path, training_bytes: bytes):
    """The harness itself: a good training graph's report and a good optimize exit 0."""
    assert _check_one(tmp_path, "train", training_bytes, _report) == 0
    assert _check_one(tmp_path, "mlp", (REPO / "golden_models" / "mlp.onnx").read_bytes(), _optimize) == 0
