"""Run one training step of a training graph on ONNX Runtime.

A plain ``InferenceSession`` runs a forward+backward graph: feed the batch and the
parameters, fetch the loss and ``<param>_grad``.  Set on every session:

- ORT's CommonSubexpressionElimination is disabled.  It merges a recompute clone
  (``Gelu(h) -> a_recompute``) back into its original, silently, undoing RecomputePass
  (measured on 1.19.2; docs/design/ort-facts.md).  ORT's builder ran ORT's own
  pre-training transformers already, so little is lost.
- SkipLayerNormFusion is disabled too: after recompute, a residual ``Add`` whose only
  forward consumer is a LayerNormalization gets fused, and the fused node drops the
  LayerNorm's Mean/InvStdDev outputs that backward reads (measured on 1.19.2).
- GeluFusion is disabled too: once recompute serves backward from clones, the forward's
  Erf-based Gelu chain is read by forward only and gets fused into a Gelu kernel that
  rounds differently from the (unfused) clone chain, so gradients drift by an ulp.
- GemmTransposeFusion is disabled: it replaces weight-gradient Gemms, which produce graph
  outputs, by new nodes that ORT's default order visits first; that order then defers
  every other gradient output (bias ReduceSums) to the end of the step and keeps their
  inputs alive (``ortpass.passes.recompute``).  On the torch builder's graphs, whose weight
  gradients are ``MatMul(Transpose(x), dY)``, MatmulTransposeFusion too (779 -> 337 MiB).
- Transformers that cannot act on the graph are left out (:mod:`ortpass.runtime.idle_transformers`).
- The nodes are numbered so that ORT's priority sort stays short (:mod:`ortpass.runtime.node_numbering`).
- The log level is "error": ORT warns once per parameter kept as input and initializer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from ortpass.analysis.partition import get_training_info
from ortpass.conventions import BUILDER_KEY, REPLAY_OF_KEY
from ortpass.errors import OrtpassError
from ortpass.io import load
from ortpass.runtime.idle_transformers import idle_transformers
from ortpass.runtime.node_numbering import number_for_ort
from ortpass.runtime.ort_values import independent
from ortpass.runtime.row_adds import numpy_tensor, ortvalue_tensor, rows_added_after
from ortpass.runtime.step_errors import raise_kept_runner_error, step_error, take_runner_error
from ortpass.training.build import clamp_for_ort
from ortpass.training.split import masks_read_where_redraws_differ

__all__ = [
    "DISABLED_ORT_OPTIMIZERS",
    "REPLAY_DISABLED_ORT_OPTIMIZERS",
    "StepResult",
    "TrainingSession",
    "disabled_optimizers",
    "training_model",
]

logger = logging.getLogger(__name__)

#: ORT graph transformers that undo or break ortpass's rewrites (see the module docstring).
DISABLED_ORT_OPTIMIZERS = ("CommonSubexpressionElimination", "SkipLayerNormFusion", "GeluFusion", "GemmTransposeFusion")
#: Also disabled on graphs where replay-dropout-mask replaced a DropoutGrad.  These CUDA/ROCm
#: fusions turn a forward Dropout into BiasDropout or BiasSoftmaxDropout, another kernel that
#: need not map the seed's random numbers to elements as the replaying Dropout does, so
#: the replay could draw another mask.  No effect on CPU (they are not CPU fusions); not
#: verified on a GPU here.
REPLAY_DISABLED_ORT_OPTIMIZERS = ("BiasDropoutFusion", "BiasSoftmaxDropoutFusion")


@dataclasses.dataclass
class StepResult:
    """Loss, gradients by parameter name, and any extra values asked for."""

    loss: float
    gradients: dict[str, np.ndarray]
    extras: dict[str, np.ndarray]


class TrainingSession:
    """One ORT session over a training graph.

    Args:
        model: a training graph from ``build_training_graph`` (after any post-grad passes),
            or the path of one saved to a file (``str`` or ``os.PathLike``, read with
            :func:`ortpass.io.load`).
        providers: ``None`` or ``"cpu"`` for the CPU EP; ``"cuda"`` for the CUDA EP (with
            CPU fallback), which needs the ``onnxruntime-training`` CUDA build; or an
            explicit ORT provider list.
        extra_outputs: names of intermediate values to fetch on every step (e.g. the
            Dropout masks from :func:`with_dropout_masks`, for parity checks).
        optimized_model_path: where ORT should write the graph it actually runs, to check
            that rewrites survived its optimizers.
        threads: ORT's intra-op thread count (default: ORT's, one per core).  With 1, a
            step is bitwise reproducible: on more threads, CPU ``GatherGrad`` (every
            embedding's gradient) adds rows in whatever order the threads reach them, and
            ``use_deterministic_compute`` does not change that (measured on 1.19.2;
            docs/design/ort-facts.md).
        session_options: your own ``onnxruntime.SessionOptions`` (profiling, graph
            optimization level, thread pools, memory settings).  Used as given, except that
            ``threads`` and ``optimized_model_path`` are set on it when passed; without it
            ortpass's training defaults apply (:func:`training_options`: no memory reuse or
            pattern, errors only, no thread spinning where PythonOps run torch).
            Either way the optimizers that undo ortpass's rewrites stay disabled
            (:func:`disabled_optimizers`): they are passed to the session, not set in the
            options.
    """

    def __init__(
        self,
        model: ir.Model | str | os.PathLike,
        providers: str | Sequence[str] | None = None,
        *,
        extra_outputs: Sequence[str] = (),
        optimized_model_path: str | os.PathLike | None = None,
        threads: int | None = None,
        session_options: Any = None,
    ) -> None:
        model, self._rows = rows_added_after(training_model(model))
        self.info = get_training_info(model)
        if self.info.loss is None:
            raise OrtpassError(
                "this training graph differentiates outputs, whose gradients its caller computes; "
                "run it with ortpass.runtime.SplitTrainingSession (TrainingSession runs graphs built from a loss)"
            )
        self.extra_outputs = tuple(extra_outputs)
        proto = ir.to_proto(model)
        _expose_values(proto, self.extra_outputs)
        self._session, self.providers = open_session(
            proto, model, providers, threads=threads, session_options=session_options,
            optimized_model_path=optimized_model_path,
        )  # fmt: skip
        self.input_names = [i.name for i in self._session.get_inputs()]
        params = set(self.info.params)
        self._default_params = {
            init.name: onnx.numpy_helper.to_array(init) for init in proto.graph.initializer if init.name in params
        }
        self._fetch = [self.info.loss, *self.info.gradients.values(), *self.extra_outputs]

    @property
    def batch_input_names(self) -> list[str]:
        """Graph inputs that are not parameters: what a batch must provide."""
        params = set(self.info.params)
        return [name for name in self.input_names if name not in params]

    def run(
        self, batch: Mapping[str, Any], params: Mapping[str, Any] | None = None, *, seed: int | None = None
    ) -> StepResult:
        """Run forward and backward on ``batch``; ``params`` overrides the model's weights.

        ``seed`` reseeds ORT's global random generator first, so Dropout nodes without a
        ``seed`` attribute draw the same masks every time (golden runs need this).
        """
        feeds = {name: _to_numpy(value, name) for name, value in self._default_params.items()}
        for name, value in (params or {}).items():
            if name not in self._default_params:
                raise OrtpassError(f"{name!r} is not a parameter of this training graph")
            feeds[name] = _to_numpy(value, name)
        expected = set(self.batch_input_names)
        unknown = sorted(set(batch) - expected)
        if unknown:
            raise OrtpassError(f"batch has inputs the graph does not take: {unknown}; it takes {sorted(expected)}")
        missing = sorted(expected - set(batch))
        if missing:
            raise OrtpassError(f"batch is missing graph inputs {missing}")
        feeds.update({name: _to_numpy(value, name) for name, value in batch.items()})
        if seed is not None:
            import onnxruntime as ort

            ort.set_seed(seed)
        take_runner_error()  # forget a failure from an earlier step
        try:
            values = self._session.run(self._rows.fetch(self._fetch), feeds)
        except Exception as exc:
            raise step_error(exc) from exc
        raise_kept_runner_error()  # a Python op's kernel keeps its error (onnxruntime-extensions would abort)
        values = self._rows.finish(self._fetch, values, numpy_tensor)
        n_grads = len(self.info.gradients)
        gradients = dict(zip(self.info.gradients, values[1 : 1 + n_grads]))
        _check_gradient_shapes(gradients, feeds)
        return StepResult(
            loss=float(values[0]),
            gradients=gradients,
            extras=dict(zip(self.extra_outputs, values[1 + n_grads :])),
        )

    def run_with_ort_values(self, feeds: Mapping[str, Any], fetch: Sequence[str]) -> list[Any]:
        """Run on OrtValues, without copies: ``feeds`` maps every graph input to a C-level
        ``OrtValue`` (e.g. ``OrtValue.from_dlpack`` over torch memory); returns the C-level
        ``OrtValue`` of each name in ``fetch``, owned by ORT (hand them to torch with
        ``to_dlpack``).  Parameters have no defaults here: the caller feeds them.
        """
        values = run_with_ort_values(self._session, feeds, self._rows.fetch(fetch))
        return self._rows.finish(fetch, values, ortvalue_tensor)


def training_model(model: ir.Model | str | os.PathLike) -> ir.Model:
    """``model``, or the model saved at that path (``masks_read_where_redraws_differ``)."""
    if isinstance(model, (ir.Model, str, os.PathLike)):
        return masks_read_where_redraws_differ(model if isinstance(model, ir.Model) else load(model))
    kind = f"{type(model).__module__}.{type(model).__qualname__}"
    raise OrtpassError(f"a session runs an onnx_ir.Model or a saved model's path (str or os.PathLike), not a {kind}; "
                       "for an onnx.ModelProto, pass onnx_ir.from_proto(proto)")


def open_session(
    proto: onnx.ModelProto,
    model: ir.Model,
    providers: str | Sequence[str] | None,
    *,
    threads: int | None = None,
    session_options: Any = None,
    optimized_model_path: str | os.PathLike | None = None,
) -> tuple[Any, list[str]]:
    """An ORT session over ``proto`` (a graph of ``model``, whose rewrites decide which ORT
    optimizers stay off) with ortpass's training options, and the providers it runs on.
    Installs the torch bridge first when the graph has PythonOps.  ``proto`` is the
    session's: its IR version is clamped and its nodes renumbered for ORT."""
    import onnxruntime as ort

    clamp_for_ort(proto)
    number_for_ort(proto.graph)
    runs_torch = any(n.op_type in ("PythonOp", "PythonOpGrad") for n in proto.graph.node)
    if runs_torch:
        from ortpass.pythonop import bridge

        bridge.prepare(model)
    python_ops = any(n.domain.startswith("ortpass.python_op.") for n in proto.graph.node)  # opaque Functions (torch builder)
    options = session_options if session_options is not None else training_options(ort, runs_torch=runs_torch or python_ops)
    if python_ops:
        from ortpass.training import python_op_kernels

        python_op_kernels.prepare(proto, options)
    if threads is not None:
        options.intra_op_num_threads = threads
    if optimized_model_path is not None:
        options.optimized_model_filepath = os.fspath(optimized_model_path)
    resolved = _resolve_providers(providers, ort.get_available_providers())
    try:
        disabled = disabled_optimizers(model) + idle_transformers(proto, resolved)
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=resolved, disabled_optimizers=disabled)
    except Exception as exc:
        raise OrtpassError(f"ONNX Runtime could not load the training graph: {exc}") from exc
    return session, resolved


def run_with_ort_values(session: Any, feeds: Mapping[str, Any], fetch: Sequence[str]) -> list[Any]:
    """Run an ORT ``session`` on C-level OrtValues; a failure names its root cause (a
    PythonOp's torch error, which ORT reports only as a generic one)."""
    take_runner_error()
    try:
        values = independent(session._sess.run_with_ort_values(dict(feeds), list(fetch), None))
    except Exception as exc:
        raise step_error(exc) from exc
    raise_kept_runner_error()  # a Python op's kernel keeps its error (onnxruntime-extensions would abort)
    return values


def _check_gradient_shapes(gradients: Mapping[str, np.ndarray], params: Mapping[str, np.ndarray]) -> None:
    """Refuse a step whose gradient for a parameter has another shape than the parameter
    (ORT 1.19.2's gradient builder can leave a broadcast unreduced; the build repairs the
    case it knows and refuses static mismatches, this catches what only shows at run time)."""
    for name, gradient in gradients.items():
        param = params.get(name)
        if param is not None and gradient.shape != param.shape:
            raise OrtpassError(
                f"the gradient of parameter {name!r} has shape {list(gradient.shape)}, not the parameter's "
                f"{list(param.shape)}: the training graph got a broadcast wrong"
            )


def disabled_optimizers(model: ir.Model) -> list[str]:
    """The ORT graph transformers a session over ``model`` must not run (the torch builder's
    graphs: also MatmulTransposeFusion, docs/design/torch-builder.md)."""
    names = list(DISABLED_ORT_OPTIMIZERS)
    if any(REPLAY_OF_KEY in node.metadata_props for node in model.graph):
        names += REPLAY_DISABLED_ORT_OPTIMIZERS
    if model.metadata_props.get(BUILDER_KEY) == "torch":
        names.append("MatmulTransposeFusion")
    return names


def _expose_values(proto: onnx.ModelProto, names: Sequence[str]) -> None:
    """Make intermediate values graph outputs so a session can fetch them."""
    if not names:
        return
    outputs = {o.name for o in proto.graph.output}
    produced = {out for node in proto.graph.node for out in node.output}
    value_infos = {vi.name: vi for vi in proto.graph.value_info}
    for name in names:
        if name in outputs:
            continue
        if name not in produced:
            raise OrtpassError(f"cannot fetch {name!r}: no node of the graph produces it")
        proto.graph.output.append(value_infos.get(name) or onnx.helper.make_empty_tensor_value_info(name))


def training_options(ort: Any, *, runs_torch: bool) -> Any:
    """ortpass's session options for training graphs (``ort``: the onnxruntime module, or
    its ``capi._pybind_state``).

    - No memory reuse or pattern: reuse keeps a freed buffer held until a later value of
      the same size takes it, +100 MiB of step peak on a 4-layer decoder with recompute
      (benchmarks/recompute_memory.py).
    - ``runs_torch`` (the graph holds PythonOps): ORT's intra-op threads do not spin.  After
      each kernel they busy-wait for the next one, and while a PythonOp runs torch's kernels
      on torch's own threads (one per core) the spinning thread takes a core from them: HF
      LLaMA with fused attention, 2 cores, 1.77-2.00 s a step with spinning, 1.43-1.44 s
      without.  Graphs without PythonOps keep spinning: the same model decomposed ran
      1.40-1.52 s with it and 1.44-1.61 s without (docs/design/ort-facts.md).
    """
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.enable_mem_reuse = False
    options.enable_mem_pattern = False
    if runs_torch:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _resolve_providers(providers, available: Sequence[str]) -> list[str]:
    if providers is None or providers == "cpu":
        return ["CPUExecutionProvider"]
    if providers == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise OrtpassError(
                f"the CUDA execution provider is not available in this onnxruntime build (available: {list(available)}); "
                "on a GPU machine install ortpass[training-cuda] (the training build) or ortpass[cuda] (stock), not both"
            )
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    providers = list(providers)
    missing = [p for p in providers if p not in available]
    if missing:
        raise OrtpassError(f"execution providers {missing} are not available (available: {list(available)})")
    return providers


def _to_numpy(value: Any, name: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):  # a torch tensor; avoid importing torch for numpy users
        return value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except Exception as exc:
        raise OrtpassError(f"value for {name!r} is not an array: {type(value).__name__}") from exc
