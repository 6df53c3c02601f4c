"""Loading and saving models with errors that name the problem."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import onnx
import onnx_ir as ir

from ortpass.errors import ModelLoadError

__all__ = ["load", "save", "to_proto_checked"]

logger = logging.getLogger(__name__)


def load(path: str | os.PathLike) -> ir.Model:
    """Read an ONNX file into an onnx_ir model.

    Raises ModelLoadError naming the file when it is missing, is not a protobuf, or is
    not a model (no graph).
    """
    path = Path(path)
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a directory, not an ONNX model file")
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    try:
        proto = onnx.load(str(path), load_external_data=True)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise ModelLoadError(f"{path}: not a readable ONNX protobuf ({type(exc).__name__}: {exc})") from exc
    if not proto.HasField("graph"):
        raise ModelLoadError(f"{path}: the file parses but holds no graph (empty or not an ONNX model)")
    try:
        return ir.from_proto(proto)
    except Exception as exc:
        raise ModelLoadError(f"{path}: malformed ONNX model ({_root_cause(exc)})") from exc


def _root_cause(exc: BaseException) -> str:
    """The innermost exception's message: onnx_ir wraps the one that names the bad value
    ("Output 'h' is redeclared ...") in "Error calling _deserialize_graph with: g"."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"


def save(
    model: ir.Model, path: str | os.PathLike, *, overwrite: bool = False, serialized: onnx.ModelProto | None = None
) -> None:
    """Write ``model`` to ``path``; refuse to replace an existing file unless ``overwrite``.

    ``serialized``: ``model`` already serialized (``ManagerResult.proto``), written
    instead of serializing it again (0.65 s of a 1 s save at 17.5k nodes).
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; refusing to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    onnx.save(serialized if serialized is not None else ir.to_proto(model), str(tmp))
    os.replace(tmp, path)  # never leave a half-written file under the final name
    logger.info("wrote %s", path)


def to_proto_checked(model: ir.Model) -> onnx.ModelProto:
    """Serialize and run the onnx checker; raise ValueError naming what is wrong."""
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    return proto
