"""A run's outputs as OrtValues that each own their buffer.

ONNX Runtime's ``run_with_ort_values`` returns an ``OrtValueVector``, and every element
Python takes from it keeps the whole vector alive: an output's buffer is freed only once
no output of the same run is referenced any more.  ortpass keeps some outputs of a run
for long and drops others at once: the split step's forward returns the logits, which the
loop drops after its loss, and the stash, which lives until backward ends; so the logits
(32 MiB on HF LLaMA at batch 8 x 512, vocabulary 2048) stayed alive through the whole
backward, and a one-graph step's returned logits lived as long as its gradients
(measured on ORT 1.19.2: freeing the logits alone freed nothing until the stash went).

Rule: every tensor a run returns is taken out of the vector through DLPack (no copy: the
new OrtValue shares the buffer), so each output lives as long as it is referenced.  It
costs about 2 us a value over taking them as they are (0.5 ms for 200 outputs).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["from_dlpack_takes_is_bool", "independent"]


def independent(values: Any) -> list[Any]:
    """``values`` (an ``OrtValueVector``, or any sequence of OrtValues) as a list of
    OrtValues that do not hold one another's buffers."""
    return [_owning(value) for value in values]


def _owning(value: Any) -> Any:
    if not value.is_tensor() or value.data_type() == "tensor(string)":
        return value  # DLPack carries neither: kept as the run gave it
    from onnxruntime.capi import _pybind_state as C

    capsule = value.to_dlpack()
    if from_dlpack_takes_is_bool():
        return C.OrtValue.from_dlpack(capsule, value.data_type() == "tensor(bool)")
    return C.OrtValue.from_dlpack(capsule)


@functools.cache
def from_dlpack_takes_is_bool() -> bool:
    """onnxruntime up to 1.31 takes ``from_dlpack(capsule, is_bool)`` and reads bools as
    bytes; 1.32 takes the capsule alone and reads DLPack's bool type (both measured)."""
    from onnxruntime.capi import _pybind_state as C

    return "is_bool" in (C.OrtValue.from_dlpack.__doc__ or "")
