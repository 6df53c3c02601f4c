"""The base class every ortpass pass derives from.

An ortpass pass is an ordinary ``onnx_ir.passes.InPlacePass``: it can run alone
(``SomePass()(model)``) or inside any onnx_ir ``PassManager``.  What it adds are
class-level *declarations* that :class:`ortpass.PassManager` reads to order a set of
passes without relying on list position:

``phase``
    ``"pre-grad"`` (runs on the forward+loss graph), ``"post-grad"`` (runs on the
    forward+backward graph) or ``"any"``.
``requires_properties`` / ``provides_properties``
    Names of model properties, e.g. ``"shapes"``, ``"training-graph"``,
    ``"dropout-seeds-fixed"``.  A pass runs after every pass that provides what it
    requires.  (Not ``requires``: that name is onnx_ir's precondition hook,
    ``requires(model)``, which passes may still override to check a model.)
``runs_before`` / ``runs_after``
    Names of other passes this one must precede or follow when both are in a set.
``preserves_analyses``
    Names of cached analyses (:mod:`ortpass.infra.analysis_cache`) that stay valid after this
    pass changed the model; the manager drops the others.  Inside a manager run a pass
    finds the run's cache in :attr:`OrtPass.analysis_cache` (None when run alone).
``shapes_step_memory``
    True for a post-grad pass that changes what backward keeps alive or the order it
    runs in, cheaply (the ordering passes, the dropout-mask replay).  A pass that plans
    for the step's memory (the memory budget) runs the passes after it in the pipeline
    that declare it, on each graph it tries, so that it judges the peak the pipeline
    ends with; inside a manager run :attr:`OrtPass.following` lists those passes.

Most passes rewrite in place (:class:`OrtPass`); a pass that builds a new model, like the
gradient build, derives from :class:`OrtFunctionalPass`.

During ``call`` a pass records what it did with :meth:`OrtPass.count` and
:meth:`OrtPass.note`; the manager copies those statistics into its report.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, ClassVar, Iterator, Literal, Sequence

import onnx_ir as ir

from ortpass.infra.analysis_cache import AnalysisCache

__all__ = ["OrtPass", "OrtFunctionalPass", "PassDeclarations", "Phase", "PHASES",]

Phase = Literal["pre-grad", "post-grad", "any"]
PHASES: tuple[str, ...] = ("pre-grad", "post-grad", "any")


DECLARATIONS = ("requires_properties", "provides_properties", "runs_before", "runs_after")


def pass_name_of(pass_: ir.passes.PassBase) -> str:
    """The name a pass goes by in pipelines, reports and logs: an ortpass pass's ``name``,
    else the class name of a plain onnx_ir pass."""
    return getattr(pass_, "name", None) or type(pass_).__name__


class PassDeclarations:
    """Ordering declarations and statistics shared by in-place and functional passes."""

    #: Name used in pipeline strings and reports; set by subclasses.
    name: ClassVar[str] = ""
    phase: ClassVar[Phase] = "any"
    requires_properties: ClassVar[frozenset[str]] = frozenset()
    provides_properties: ClassVar[frozenset[str]] = frozenset()
    runs_before: ClassVar[frozenset[str]] = frozenset()
    runs_after: ClassVar[frozenset[str]] = frozenset()
    preserves_analyses: ClassVar[frozenset[str]] = frozenset()
    shapes_step_memory: ClassVar[bool] = False
    #: The running manager's analysis cache, set by the manager for the duration of a call.
    analysis_cache: AnalysisCache | None = None
    #: The passes the running manager runs after this one (empty when run alone), set by
    #: the manager for the duration of a call.
    following: tuple[ir.passes.PassBase, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.phase not in PHASES:
            raise TypeError(f"{cls.__name__}.phase must be one of {PHASES}, not {cls.phase!r}")
        for hook in ("requires", "provides"):
            if hook in cls.__dict__ and not callable(cls.__dict__[hook]):
                raise TypeError(
                    f"{cls.__name__}.{hook} is a collection; declare properties as {hook}_properties "
                    f"({hook!r} is onnx_ir's precondition hook or would shadow one)"
                )
        # Accept any iterable in subclass declarations; store frozensets.
        for attr in (*DECLARATIONS, "preserves_analyses"):
            value = getattr(cls, attr)
            if isinstance(value, str):
                raise TypeError(f"{cls.__name__}.{attr} must be a collection of names, not a str")
            setattr(cls, attr, frozenset(value))

    @contextlib.contextmanager
    def lent(self, cache: AnalysisCache, following: Sequence[ir.passes.PassBase]) -> Iterator[None]:
        """Lend the pass a manager run's analysis cache and the passes after it, for one call."""
        self.analysis_cache, self.following = cache, tuple(following)
        try:
            yield
        finally:
            self.analysis_cache, self.following = None, ()

    def step_memory_finish(self) -> Callable[[ir.Model], ir.Model] | None:
        """The passes of :attr:`following` that declare ``shapes_step_memory``, as one
        function of a model the caller owns (they run in pipeline order, in place where
        they are in-place passes); None where there are none."""
        shaping = [p for p in self.following if getattr(p, "shapes_step_memory", False)]
        if not shaping:
            return None

        def finish(model: ir.Model) -> ir.Model:
            for later in shaping:
                model = later(model).model
            return model

        return finish

    @property
    def pass_name(self) -> str:
        return pass_name_of(self)

    # -- statistics -------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        """Statistics of the latest run (counters and notes)."""
        return self.__dict__.setdefault("_stats", {})

    def reset_stats(self) -> None:
        self.__dict__["_stats"] = {}

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``key`` (e.g. ``count("gathers inserted", 2)``)."""
        counters = self.stats.setdefault("counts", collections.Counter())
        counters[key] += n

    def note(self, key: str, value: Any) -> None:
        """Record a structured statistic, e.g. which losses were skipped and why."""
        self.stats.setdefault("notes", {}).setdefault(key, []).append(value)

    def __call__(self, model: ir.Model) -> ir.passes.PassResult:
        self.reset_stats()
        return super().__call__(model)

    def check_input(self, model: ir.Model) -> None:
        """Refuse, before any pass of the run starts, a pipeline input this pass could not
        take (raise an :class:`~ortpass.errors.OrtpassError`, such as ModelLoadError, naming
        the problem): bad input is then reported as such, not as this pass failing.  The
        default accepts any."""
        del model

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class OrtPass(PassDeclarations, ir.passes.InPlacePass):
    """An in-place onnx_ir pass (returns the model it was given) with declarations."""


class OrtFunctionalPass(PassDeclarations, ir.passes.FunctionalPass):
    """A functional onnx_ir pass (returns a new model) with declarations."""
