"""Golden models: pin what a full pipeline does to a small model, in readable JSON.

A golden model is a Python file ``<dir>/<name>.py`` defining ``case() -> GoldenCase``
(the torch module with its loss, a fixed batch, and the pipeline), and its expectations
``<dir>/<name>.expected.json``.  ``check`` re-runs the whole path

    export -> pre-grad passes -> gradient build -> post-grad passes -> ORT training step

and lists, one readable line each, what no longer matches: op-type histograms after every
pass, which passes changed what (nodes added/removed, their statistics), the recompute
plan table of the training graph, and the loss and gradient summaries within tolerance.
``update`` rewrites the expectations only when asked, only those that changed beyond the
tolerance ``check`` applies (a file with nothing changed stays byte for byte as it was),
and refuses to record a step whose loss and gradients disagree with torch eager, so a
recorded number has been checked against an independent implementation, not copied from
the code under test.

The case file is user code: ``check`` and ``update`` import and run every case file of
the directory they are given (``ortpass golden`` without ``--dir``: ``./golden_models``
of the current directory, which it names before running anything).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from ortpass.conventions import op_label
from ortpass.errors import GoldenCaseError, elide

__all__ = ["GoldenCase", "GoldenResult", "GoldenUpdate", "check", "compare", "discover", "load_case", "run_case", "update"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
EXPECTED_SUFFIX = ".expected.json"


@dataclasses.dataclass
class GoldenCase:
    """One golden model: what to export, with which batch, through which pipeline.

    ``pipeline`` is a pipeline string holding the pre-grad passes, ``build-training-graph``
    and the post-grad passes.  ``rtol`` bounds the relative change of the loss and the
    gradient summaries; ``seed`` seeds ORT's Dropout and torch's generator (which random
    ops inside a PythonOp's Function draw from) right before the step, so every run
    draws the same masks.
    ``parity`` says whether ``update`` compares the step against torch eager (it cannot
    when randomness happens inside a PythonOp's torch code, for example).
    ``builder="torch"`` builds the training graph from torch's autograd
    (:func:`ortpass.training.build_training_graph_from_torch`, what stock onnxruntime
    gets) instead of exporting; ``pipeline`` then holds the post-grad passes only, and the
    bundled ``<name>.onnx`` is the built training graph they start from.
    """

    module: Any  # torch.nn.Module; typed loosely so this module imports without torch
    args: tuple
    input_names: Sequence[str]
    pipeline: str
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None
    rtol: float = 1e-4
    seed: int = 0
    parity: bool = True
    description: str = ""
    builder: str = "ort"


@dataclasses.dataclass
class GoldenResult:
    name: str
    record: dict[str, Any]
    differences: list[str]
    training_model: ir.Model

    @property
    def ok(self) -> bool:
        return not self.differences


def discover(directory: str | Path) -> dict[str, Path]:
    """Case files of a golden directory by name (``_*.py`` files are helpers, skipped)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"golden model directory {directory} does not exist")
    return {p.stem: p for p in sorted(directory.glob("*.py")) if not p.name.startswith("_")}


def load_case(path: str | Path) -> GoldenCase:
    """Import a case file by path and call its ``case()``."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"ortpass_golden_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise GoldenCaseError(f"cannot import golden case file {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: name the file and what it raised
        raise GoldenCaseError(f"golden case file {path} failed to import: {type(exc).__name__}: {elide(str(exc))}") from exc
    factory: Callable[[], GoldenCase] | None = getattr(module, "case", None)
    if not callable(factory):
        raise GoldenCaseError(f"golden case file {path} defines no case() function")
    try:
        case = factory()
    except Exception as exc:
        raise GoldenCaseError(f"{path}: case() raised {type(exc).__name__}: {elide(str(exc))}") from exc
    if not isinstance(case, GoldenCase):
        raise GoldenCaseError(f"{path}: case() returned {type(case).__name__}, not GoldenCase")
    return case


def run_case(case: GoldenCase) -> tuple[dict[str, Any], ir.Model, ir.Model]:
    """Run the full path; return (record, exported forward model (the built training graph
    for the torch builder), final training graph)."""
    import torch

    import ortpass
    from ortpass.export import export
    from ortpass.runtime import TrainingSession

    recorder = _StageRecorder()
    if case.builder == "torch":
        from ortpass.training.from_torch import build_training_graph_from_torch

        forward = build_training_graph_from_torch(
            case.module, case.args, input_names=case.input_names, dynamic_axes=case.dynamic_axes
        )
        result = ortpass.pipeline(case.pipeline, assume=["training-graph"], instruments=[recorder])(forward.clone())
    else:
        forward = export(case.module, case.args, input_names=case.input_names, dynamic_axes=case.dynamic_axes)
        result = ortpass.pipeline(case.pipeline, instruments=[recorder])(forward)
    training = result.model

    session = TrainingSession(training)
    torch.manual_seed(case.seed)
    step = session.run(dict(zip(case.input_names, case.args)), seed=case.seed)
    record = {
        "format": FORMAT_VERSION,
        "description": case.description,
        **({"builder": case.builder} if case.builder != "ort" else {}),
        "pipeline": case.pipeline,
        "ops": {"export": _histogram(forward), **recorder.histograms},
        "passes": {r.name: _pass_summary(r) for r in result.report.records},
        "recompute_plans": recorder.plans,
        "step": {
            "rtol": case.rtol,
            "seed": case.seed,
            "loss": step.loss,
            "gradients": {name: _summarize(grad) for name, grad in sorted(step.gradients.items())},
        },
    }
    return record, forward, training


def check(directory: str | Path, names: Sequence[str] | None = None) -> list[GoldenResult]:
    """Re-run golden models and compare each with its recorded expectations."""
    results = []
    for name, path in _selected(directory, names).items():
        expected_path = path.with_name(name + EXPECTED_SUFFIX)
        record, _, training = run_case(load_case(path))
        if expected_path.exists():
            try:
                expected = json.loads(expected_path.read_text(encoding="utf-8"))
            except (ValueError, OSError) as exc:
                raise GoldenCaseError(f"{expected_path}: the recorded expectations cannot be read ({elide(str(exc))})") from exc
            differences = compare(expected, record)
        else:
            differences = [f"no expectations recorded ({expected_path.name}); run `ortpass golden update {name}`"]
        results.append(GoldenResult(name, record, differences, training))
        logger.info("golden %s: %s", name, "ok" if not differences else f"{len(differences)} differences")
    return results


@dataclasses.dataclass
class GoldenUpdate:
    """What :func:`update` did to one golden model: ``differences`` are what changed beyond
    the check's tolerance (empty: nothing did), ``written`` the files it rewrote and
    ``unchanged`` those it left byte for byte as they were."""

    name: str
    differences: list[str]
    written: list[Path]
    unchanged: list[Path]

    @property
    def changed(self) -> bool:
        return bool(self.written)


def update(directory: str | Path, names: Sequence[str] | None = None, *, save_forward: bool = True) -> list[GoldenUpdate]:
    """Re-record the expectations (and the exported forward model ``<name>.onnx``) that
    changed, and only those.

    The expectations are rewritten only where :func:`check` would report a difference
    (the same comparison, the same ``rtol``), and then every number within tolerance keeps
    its recorded value, so the file changes exactly where the behaviour did, not in the
    last digits of float sums.  The forward model is written only when the export
    changed (the producer's name and version, which move with torch, are not a change).
    """
    from ortpass import io as ortpass_io

    results = []
    for name, path in _selected(directory, names).items():
        case = load_case(path)
        record, forward, training = run_case(case)
        expected_path = path.with_name(name + EXPECTED_SUFFIX)
        recorded = _recorded(expected_path)
        differences = _update_differences(recorded, record, case)
        result = GoldenUpdate(name, differences, [], [])
        if differences:
            if case.parity:
                record["step"]["torch_parity"] = _torch_parity(case, training)
            if recorded is not None:
                record = _keep_within_tolerance(recorded, record)
            ortpass_io.write_file(expected_path, json.dumps(record, indent=2, sort_keys=False) + "\n")
            result.written.append(expected_path)
        else:
            result.unchanged.append(expected_path)
        if save_forward:
            onnx_path = path.with_name(name + ".onnx")
            if _same_export(onnx_path, forward):
                result.unchanged.append(onnx_path)
            else:
                ortpass_io.save(forward, onnx_path, overwrite=True)
                result.written.append(onnx_path)
        logger.info("golden %s: %s", name, "rewritten" if result.changed else "unchanged")
        results.append(result)
    return results


def _recorded(path: Path) -> dict[str, Any] | None:
    """The recorded expectations, or None where there are none to keep (no file, or one
    that cannot be read: update replaces it)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as exc:
        logger.warning("%s cannot be read (%s); writing it anew", path, elide(str(exc)))
        return None


def _update_differences(recorded: dict[str, Any] | None, record: dict[str, Any], case: GoldenCase) -> list[str]:
    if recorded is None:
        return ["no expectations recorded"]
    differences = compare(recorded, record)
    if case.parity and "torch_parity" not in recorded.get("step", {}):
        differences.append("step.torch_parity: not recorded")  # evidence update owes the record
    return differences


def _keep_within_tolerance(recorded: Any, record: Any, *, rtol: float | None = None, path: str = "") -> Any:
    """``record``, with each value :func:`compare` finds within tolerance of ``recorded``
    replaced by the recorded one (so rewriting a file changes only what changed)."""
    if rtol is None and isinstance(recorded, dict) and "step" in recorded:
        rtol = recorded["step"].get("rtol", 1e-4)
    if isinstance(recorded, dict) and isinstance(record, dict):
        return {
            key: _keep_within_tolerance(recorded[key], value, rtol=rtol, path=f"{path}.{key}" if path else str(key))
            if key in recorded and key != "torch_parity"  # fresh evidence for the numbers written
            else value
            for key, value in record.items()
        }
    if isinstance(recorded, list) and isinstance(record, list) and len(recorded) == len(record):
        return [_keep_within_tolerance(r, a, rtol=rtol, path=f"{path}[{i}]") for i, (r, a) in enumerate(zip(recorded, record))]
    return recorded if not compare(recorded, record, rtol=rtol, path=path) else record


def _same_export(path: Path, forward: ir.Model) -> bool:
    """Whether ``path`` holds ``forward`` as it would be saved, producer aside."""
    import onnx

    if not path.is_file():
        return False
    try:
        saved = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - unreadable: write it anew
        return False
    fresh = ir.to_proto(forward)
    fresh.producer_name, fresh.producer_version = saved.producer_name, saved.producer_version
    return saved == fresh


def compare(expected: Any, actual: Any, *, rtol: float | None = None, path: str = "") -> list[str]:
    """Readable differences between two records; numbers under ``step`` use ``rtol``."""
    if rtol is None and isinstance(expected, dict) and "step" in expected:
        rtol = expected["step"].get("rtol", 1e-4)
    if isinstance(expected, dict) and isinstance(actual, dict):
        lines = []
        for key in expected:
            sub = f"{path}.{key}" if path else str(key)
            if key == "torch_parity":
                continue  # evidence recorded at update time, not re-measured by check
            if key not in actual:
                lines.append(f"{sub}: expected {_short(expected[key])}, now missing")
            else:
                lines += compare(expected[key], actual[key], rtol=rtol, path=sub)
        lines += [f"{path}.{key}: new, {_short(actual[key])}" if path else f"{key}: new" for key in actual if key not in expected]
        return lines
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{path}: expected {len(expected)} entries, got {len(actual)}: {_short(actual)}"]
        return [line for i, (e, a) in enumerate(zip(expected, actual)) for line in compare(e, a, rtol=rtol, path=f"{path}[{i}]")]
    if _is_number(expected) and _is_number(actual) and path.startswith("step.") and not isinstance(expected, bool):
        if not math.isclose(expected, actual, rel_tol=rtol or 0.0, abs_tol=1e-12):
            return [f"{path}: expected {expected:.8g}, got {actual:.8g} (rtol {rtol:g})"]
        return []
    if expected != actual:
        return [f"{path}: expected {_short(expected)}, got {_short(actual)}"]
    return []


class _StageRecorder:
    """Instrument: op histogram after every pass, recompute plans of the fresh training graph."""

    def __init__(self) -> None:
        self.histograms: dict[str, dict[str, int]] = {}
        self.plans: list[dict[str, Any]] = []

    def after_pass(self, pass_, model: ir.Model, record) -> None:
        if record.failed:
            return
        self.histograms[f"{record.position:02d} {record.name}"] = _histogram(model)
        if "training-graph" in getattr(pass_, "provides_properties", ()):
            self.plans = _plan_table(model)


def _plan_table(model: ir.Model) -> list[dict[str, Any]]:
    from ortpass.analysis.recompute import find_recompute_candidates

    report = find_recompute_candidates(model, probe_level=1, layer_boundary=True)
    return [
        {key: plan[key] for key in ("plan", "frequency", "saving_bytes", "symbolic_saving") if key in plan}
        for plan in report.to_dict()["plans"]
    ]


def _histogram(model: ir.Model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph:
        label = op_label(node.domain, node.op_type)
        counts[label] = counts.get(label, 0) + 1
    return dict(sorted(counts.items()))


def _pass_summary(record) -> dict[str, Any]:
    return {
        "modified": record.modified,
        "added": dict(sorted(record.added.items())),
        "removed": dict(sorted(record.removed.items())),
        "counts": dict(sorted(record.stats.get("counts", {}).items())),
    }


def _summarize(values: np.ndarray) -> dict[str, float]:
    # Norms, not sums: a gradient's sum can cancel to ~1e-8, where any relative tolerance
    # turns float reassociation into a spurious difference.
    values = np.asarray(values, dtype=np.float64)
    return {
        "l2": float(np.linalg.norm(values)),
        "max_abs": float(np.abs(values).max()) if values.size else 0.0,
    }


def _torch_parity(case: GoldenCase, training: ir.Model) -> dict[str, Any]:
    from ortpass.runtime.parity import check_parity

    result = check_parity(case.module, case.args, training, input_names=case.input_names)
    result.assert_ok()  # refuse to record numbers torch does not agree with
    name, error = result.worst()
    return {"max_relative_error": float(f"{error:.3g}"), "worst": name, "rtol": result.rtol}


def _selected(directory: str | Path, names: Sequence[str] | None) -> dict[str, Path]:
    cases = discover(directory)
    if not names:
        return cases
    unknown = [n for n in names if n not in cases]
    if unknown:
        raise KeyError(f"no golden model named {unknown} in {directory}; available: {sorted(cases)}")
    return {n: cases[n] for n in names}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
