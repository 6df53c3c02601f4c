"""Loading and saving models with errors that name the problem, and the one place that
writes files.

Every file ortpass writes goes through :func:`write_file`: the bytes go to a private
temporary file created next to the target (exclusive create, so a symlink or a file left
at a guessed name is never followed or reused), are flushed to disk, and the temporary
file is then renamed over the target in one step.  A reader sees the old file or the new
one, never a part; concurrent writers each rename a whole file of their own, so the last
one wins whole; a failed write leaves the target as it was and removes its temporary file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import onnx
import onnx_ir as ir

from ortpass.errors import ModelLoadError, elide

__all__ = ["load", "save", "to_proto_checked", "write_file", "write_with", "real_target"]

logger = logging.getLogger(__name__)

def load(path: str | os.PathLike) -> ir.Model:
    """Read an ONNX file into an onnx_ir model.

    Raises ModelLoadError naming the file when it is missing, is not a regular file (a
    directory, a FIFO, a device), is not a protobuf, or is not a model (no graph).
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no such file") from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(mode):
        raise ModelLoadError(f"{path}: is a directory, not an ONNX model file")
    if not stat.S_ISREG(mode):
        # Reading a FIFO blocks and /dev/zero never ends: refuse before opening them.
        raise ModelLoadError(f"{path}: is a {_file_kind(mode)}, not a regular file; give an ONNX model file")
    try:
        proto = onnx.load(str(path), load_external_data=True)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise ModelLoadError(f"{path}: not a readable ONNX protobuf ({type(exc).__name__}: {elide(str(exc))})") from exc
    if not proto.HasField("graph"):
        raise ModelLoadError(f"{path}: the file parses but holds no graph (empty or not an ONNX model)")
    try:
        model = ir.from_proto(proto)
    except Exception as exc:
        raise ModelLoadError(f"{path}: malformed ONNX model ({_root_cause(exc)})") from exc
    problem = _text_that_is_not_utf8(model)
    if problem is not None:
        raise ModelLoadError(f"{path}: malformed ONNX model ({problem} is not UTF-8 text, as ONNX requires)")
    return model


def _text_that_is_not_utf8(model: ir.Model) -> str | None:
    """What holds bytes where text belongs.  onnx_ir keeps a string field that is not
    UTF-8 as bytes, and then fails to write the model back, deep inside a pass."""
    for key, value in model.metadata_props.items():
        if not isinstance(key, str) or not isinstance(value, str):
            return f"model metadata {key!r}"
    for holder in (model, model.graph):
        if not isinstance(holder.doc_string or "", str) or not isinstance(getattr(holder, "name", "") or "", str):
            return f"the name or doc string of the {type(holder).__name__.lower()}"
    graph_values = [*model.graph.inputs, *model.graph.outputs, *model.graph.initializers.values()]
    for value in graph_values:
        if not isinstance(value.name, str):
            return f"graph value name {value.name!r}"
    for node in model.graph.all_nodes():
        for field in ("name", "op_type", "domain", "doc_string"):
            if not isinstance(getattr(node, field) or "", str):
                return f"the {field} of node {getattr(node, field)!r}"
        for key, text in node.metadata_props.items():
            if not isinstance(key, str) or not isinstance(text, str):
                return f"metadata {key!r} of node {node.name!r}"
        for value in node.outputs:
            if not isinstance(value.name or "", str):
                return f"output name {value.name!r} of node {node.name!r}"
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.STRING and not isinstance(attr.value, str):
                return f"attribute {attr.name!r} of node {node.name!r}"
            if attr.type == ir.AttributeType.STRINGS and not all(isinstance(v, str) for v in attr.value):
                return f"attribute {attr.name!r} of node {node.name!r}"
    return None


def _file_kind(mode: int) -> str:
    kinds = {
        stat.S_ISFIFO: "FIFO (named pipe)",
        stat.S_ISCHR: "character device",
        stat.S_ISBLK: "block device",
        stat.S_ISSOCK: "socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "special file")


def _root_cause(exc: BaseException) -> str:
    """The innermost exception's message: onnx_ir wraps the one that names the bad value
    ("Output 'h' is redeclared ...") in "Error calling _deserialize_graph with: g"."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {elide(str(exc))}"


def real_target(path: str | os.PathLike) -> Path:
    """Where writing ``path`` lands: a symlink is written through to the file it points
    to (the link stays a link), as ``cp`` and editors do."""
    path = Path(os.path.abspath(path))
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def write_with(path: str | os.PathLike, write: Callable[[Path], None], *, overwrite: bool = True, suffix: str = "") -> Path:
    """Write ``path`` atomically: ``write(tmp)`` fills a fresh private file beside it,
    which then replaces ``path``.  Returns the path written (through a symlink, its target).

    ``suffix``: the temporary file's suffix, for writers that pick a format by it
    (matplotlib).  Raises FileExistsError if ``path`` exists and not ``overwrite`` (checked
    again at the rename, so a file created meanwhile is not replaced), IsADirectoryError
    or NotADirectoryError when the path cannot be a file.
    """
    target = real_target(path)
    if target.is_dir():
        raise IsADirectoryError(f"{path} is a directory; give a file name")
    if target.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; refusing to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _temporary_beside(target, suffix) as tmp:
        write(tmp)
        _fsync(tmp)
        mode = target.stat().st_mode & 0o7777 if target.exists() else _default_mode()
        os.chmod(tmp, mode)
        if overwrite:
            os.replace(tmp, target)
        else:
            _create_exclusively(tmp, target, path)
    _fsync_directory(target.parent)
    logger.debug("wrote %s", target)
    return target


def _create_exclusively(tmp: Path, target: Path, given: str | os.PathLike) -> None:
    """Give ``tmp`` the name ``target`` unless a file has it: a hard link fails if the
    target appeared since the check, where a rename would replace it."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise FileExistsError(f"{given} exists; refusing to overwrite it") from None
    except OSError:  # a file system without hard links: check, then rename
        if target.exists():
            raise FileExistsError(f"{given} exists; refusing to overwrite it") from None
        os.replace(tmp, target)


def write_file(path: str | os.PathLike, data: bytes | str, *, overwrite: bool = True) -> Path:
    """Write ``data`` (str as UTF-8) to ``path`` atomically; see :func:`write_with`."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    return write_with(path, lambda tmp: tmp.write_bytes(payload), overwrite=overwrite)


@contextlib.contextmanager
def _temporary_beside(target: Path, suffix: str) -> Iterator[Path]:
    # mkstemp opens with O_CREAT | O_EXCL under a random name: an existing file or symlink
    # at that name makes it pick another, so nothing outside is followed or clobbered.
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix or ".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable; some file systems refuse to sync a directory."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _default_mode() -> int:
    """0o666 less the umask, what ``open(path, "w")`` would have given (mkstemp uses 0o600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def save(
    model: ir.Model, path: str | os.PathLike, *, overwrite: bool = False, serialized: onnx.ModelProto | None = None
) -> None:
    """Write ``model`` to ``path`` atomically (:func:`write_with`); refuse to replace an
    existing file unless ``overwrite``.

    ``serialized``: ``model`` already serialized (``ManagerResult.proto``), written
    instead of serializing it again (0.65 s of a 1 s save at 17.5k nodes).
    """
    proto = serialized if serialized is not None else ir.to_proto(model)
    written = write_with(path, lambda tmp: onnx.save(proto, str(tmp)), overwrite=overwrite)
    logger.info("wrote %s", written)


def to_proto_checked(model: ir.Model) -> onnx.ModelProto:
    """Serialize and run the onnx checker; raise ValueError naming what is wrong."""
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    return proto
