"""The on-disk cache of built graphs: keyed on everything that changes the graph, the
whole key kept in the entry and compared on load, written by rename."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import os
import tempfile
from pathlib import Path

import onnx_ir as ir
import torch

from ortpass.runtime.module.transitions import InputSchema

logger = logging.getLogger(__name__)

_CACHE_FORMAT = 2


def cache_key_material(
    module: torch.nn.Module, schema: InputSchema, pipeline: str, opset: int, fused_attention: bool | str = False
) -> dict:
    """Everything that changes the graph; its hash names the cache entry, and the entry
    keeps it whole to compare on load."""
    import onnx
    import onnxruntime

    import ortpass

    classes = {type(m) for m in module.modules()}
    sources = {}
    for cls in sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        try:  # the forward code decides the graph as much as the structure does
            text = inspect.getsource(cls)
        except (OSError, TypeError):
            text = ""
        sources[f"{cls.__module__}.{cls.__qualname__}"] = hashlib.sha256(text.encode()).hexdigest()
    config = getattr(module, "config", None)
    return {
        "format": _CACHE_FORMAT,
        "structure": repr(module),
        "classes": sources,
        "config": config.to_json_string() if hasattr(config, "to_json_string") else None,
        "parameters": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in module.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in module.named_buffers()],
        "schema": dataclasses.asdict(schema),
        "pipeline": pipeline,
        "opset": opset,
        "fused_attention": fused_attention,
        "versions": {
            "torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "onnx_ir": ir.__version__, "ortpass": ortpass.__version__,
        },
        # The version alone misses an editable install's edits, and the graph the old code built
        # would keep loading after a builder or pass changed.
        "ortpass_source": ortpass_source_digest(),
    }  # fmt: skip


@functools.cache
def ortpass_source_digest() -> str:
    """The digest of ortpass's own Python sources (once per process, about 10 ms)."""
    return source_digest(Path(__file__).resolve().parents[2])


def source_digest(package_root: Path) -> str:
    """A sha256 over every ``.py`` file under ``package_root``: each relative path and its bytes."""
    digest = hashlib.sha256()
    for path in sorted(package_root.rglob("*.py")):
        digest.update(path.relative_to(package_root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _entry_paths(cache_dir: Path, material: dict) -> tuple[Path, Path]:
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir / f"{digest}.onnx", cache_dir / f"{digest}.json"


def load_cached(cache_dir: Path, material: dict) -> tuple[ir.Model, dict] | None:
    model_path, meta_path = _entry_paths(cache_dir, material)
    if not (model_path.is_file() and meta_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("key") != json.loads(json.dumps(material)):
            logger.info("ORTModule cache entry %s is for another key; not used", meta_path.name)
            return None
        model = ir.load(model_path)
    except Exception as exc:  # a damaged entry is rebuilt, never trusted
        logger.warning("ORTModule cache entry %s cannot be read (%s); exporting again", model_path, exc)
        return None
    _register_own_functions(model)
    return model, meta["graph"]


def _register_own_functions(model: ir.Model) -> None:
    """A loaded graph may call ortpass's own Functions: the density flag, and the RNG-replaying
    Functions recompute derives for a recomputed PythonOp (fused attention); nothing else
    is registered."""
    from ortpass.pythonop import bridge
    from ortpass.pythonop.rng_replay import register_rng_replay_functions

    if any("FlagAndPrintDensity" in name for name in bridge.pythonop_func_names(model)):
        from ortpass.export.density import FlagAndPrintDensity

        bridge.register_function(FlagAndPrintDensity)
    register_rng_replay_functions(model)


def store_cached(cache_dir: Path, material: dict, model: ir.Model, meta: dict) -> None:
    if meta["output_spec"] is None:
        logger.warning("ORTModule: the output structure cannot be serialized; the graph is not cached")
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    model_path, meta_path = _entry_paths(cache_dir, material)
    # Write to temporary files and rename: another process never reads half an entry.
    for path, write in ((model_path, lambda p: ir.save(model, p)),
                        (meta_path, lambda p: Path(p).write_text(json.dumps({"key": material, "graph": meta})))):  # fmt: skip
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=path.suffix)
        os.close(fd)
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    logger.info("ORTModule cached the graph as %s", model_path.name)
