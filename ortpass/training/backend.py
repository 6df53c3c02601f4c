"""Which ONNX Runtime is installed, and what it can do.

The rule: exactly one ONNX Runtime distribution is installed.  The stock packages
(``onnxruntime``, ``onnxruntime-gpu``) and the training builds (``onnxruntime-training-cpu``,
``onnxruntime-training``) all install the import name ``onnxruntime``; two of them unpack
over each other, file by file, and what imports is a mix of both.  ortpass's extras name one
each (``cpu``, ``cuda``, ``training-cpu``, ``training-cuda``): pick one.

Only the training build (1.19.2, CPython <= 3.12) has ORT's gradient builder and the
pre-gradient transformers that ``ortpass.training.build_training_graph`` runs; on stock
onnxruntime the training graph is built from torch instead.  :func:`require_training_build`
refuses, saying so, where the ORT builder is needed and missing.

It lives in the training stage, the first that needs it (the gradient build);
``ortpass.runtime`` re-exports its functions.
"""

from __future__ import annotations

import functools
import logging
from importlib import metadata

from ortpass.errors import OrtpassError

__all__ = [
    "RUNTIME_DISTRIBUTIONS",
    "check_single_runtime",
    "has_training_ops",
    "installed_runtimes",
    "require_training_build",
]

logger = logging.getLogger(__name__)

#: The distributions that install the import name ``onnxruntime`` (PyPI's names).
RUNTIME_DISTRIBUTIONS = (
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-training",
    "onnxruntime-training-cpu",
    "ort-nightly",
    "ort-nightly-gpu",
)

_EXTRAS = '"ortpass[training-cpu]" (the training build, CPython <= 3.12) or "ortpass[cpu]" (stock)'


def installed_runtimes() -> dict[str, str]:
    """The ONNX Runtime distributions installed, each with its version, read from their
    metadata (nothing is imported; about 3 ms, so not cached)."""
    found = {}
    for name in RUNTIME_DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def check_single_runtime() -> None:
    """Raise :class:`~ortpass.errors.OrtpassError` where more than one ONNX Runtime
    distribution is installed, naming them and the fix."""
    runtimes = installed_runtimes()
    if len(runtimes) < 2:
        return
    listed = " and ".join(f"{name} {version}" for name, version in runtimes.items())
    raise OrtpassError(
        f"{listed} are installed together; they share the import name `onnxruntime`, so they "
        "unpacked over one another and what imports is a mix of both: run `pip uninstall -y "
        f"{' '.join(runtimes)}`, then install one runtime extra, {_EXTRAS}"
    )


@functools.cache
def has_training_ops() -> bool:
    """Whether the ``onnxruntime`` that imports is the training build (its
    ``capi._pybind_state`` has ``GradientGraphBuilder``).  Imports onnxruntime; cached."""
    try:
        from onnxruntime.capi import _pybind_state as C
    except ImportError as exc:
        logger.debug("onnxruntime does not import: %s", exc)
        return False
    return hasattr(C, "GradientGraphBuilder")


def require_training_build(what: str) -> None:
    """Raise :class:`~ortpass.errors.OrtpassError` unless the installed onnxruntime is
    the training build: ``what`` needs it (e.g. "ortpass.training.build_training_graph
    (ORT's gradient builder)").
    Checks first that only one runtime is installed (:func:`check_single_runtime`)."""
    check_single_runtime()
    if has_training_ops():
        return
    needs = f"{what} needs ONNX Runtime's training build (onnxruntime-training-cpu 1.19.2, CPython <= 3.12)"
    from_torch = (
        "build the training graph from torch: ortpass.training.build_training_graph_from_torch(...) or "
        "ORTModule(model) (which picks that builder itself)"
    )
    runtimes = installed_runtimes()
    if not runtimes:
        raise OrtpassError(f"{needs}, but no onnxruntime is installed: install one runtime extra, {_EXTRAS}; "
                           f"on stock onnxruntime {from_torch}")
    ((name, version),) = runtimes.items()
    if "training" in name:  # installed, yet no builder: it does not import, or is damaged
        raise OrtpassError(f"{needs}, but the installed {name} {version} has no GradientGraphBuilder: "
                           "`python3 -c 'import onnxruntime'` says why, or reinstall it")
    package = "" if name == "onnxruntime" else f" ({name})"
    raise OrtpassError(f"{needs}, but the installed onnxruntime {version}{package} is the stock package; "
                       f"on stock onnxruntime {from_torch}")

