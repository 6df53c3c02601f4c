"""Output files checked before any work: writable, and none of them an input or another
output (by inode and real path), so no input is overwritten unless asked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from ortpass import io
from ortpass.cli.errors import UsageError
from ortpass.infra.base import pass_name_of
from ortpass.infra.pipeline_text import parse_pipeline


def _identity(path: Path) -> tuple:
    """What makes two paths the same file: the inode of one that exists (hard links,
    symlinks, ``./`` and ``..`` all land there), else the real path it would be created at."""
    try:
        st = os.stat(path)  # follows symlinks: writing goes through them (io.real_target)
        return ("inode", st.st_dev, st.st_ino)
    except OSError:
        return ("path", os.path.realpath(path))


def _check_writable(option: str, path: Path) -> None:
    """Refuse, before any work, an output that cannot be a file."""
    target = io.real_target(path)
    if target.is_dir():
        raise UsageError(f"{option} {path} is a directory; give a file name")
    if target.exists() and not target.is_file():
        raise UsageError(f"{option} {path} is not a regular file; refusing to replace it")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) and parent == target.parent:
        raise UsageError(f"{option} {path}: the directory {parent} is not writable")


def check_outputs(inputs: Sequence[tuple[str, Path]], outputs: Sequence[tuple[str, Path]], *, in_place: bool = False) -> None:
    """Every output must be writable, none may be an input (unless ``-o`` with
    ``--in-place``), and no two outputs may be the same file."""
    seen: dict[tuple, tuple[str, Path]] = {}
    read = {_identity(path): (option, path) for option, path in inputs}
    for option, path in outputs:
        _check_writable(option, path)
        key = _identity(path)
        if key in read and not (in_place and option == "-o"):
            given_as, given = read[key]
            what = "the input model" if given_as == "IN" else f"the {given_as} file {given}"
            hint = " without --in-place" if option == "-o" else ""
            raise UsageError(f"{option} {path} is {what}; refusing to overwrite it{hint}")
        if key in seen:
            other_option, other = seen[key]
            raise UsageError(f"{option} {path} and {other_option} {other} are the same file; give each output its own")
        seen[key] = (option, path)


def plan_files(spec: str) -> list[tuple[str, Path]]:
    """Plan files the pipeline names (``config_file=``): inputs too."""
    return [
        ("config_file", Path(s.options["config_file"]))
        for s in parse_pipeline(spec)
        if isinstance(s.options.get("config_file"), str)
    ]


def dump_files(manager: Any, directory: Path) -> list[tuple[str, Path]]:
    """Every file ``--dump-dir`` could write: one per pass, and its failed-input file."""
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--dump-dir {directory} is a file, not a directory")
    files = []
    for position, pass_ in enumerate(manager.passes, start=1):
        name = f"{position:02d}_{pass_name_of(pass_)}"
        files += [("--dump-dir", directory / f"{name}.onnx"), ("--dump-dir", directory / f"{name}.failed-input.onnx")]
    return files
