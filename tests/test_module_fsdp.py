"""ORTModule under FSDP over two gloo processes: trains as torch's FSDP, or is refused by name.

Each rank runs every case in one process group (one spawn for the file): the sharded
wrapper and torch's FSDP of the same model side by side, several SGD steps, each rank on
its own shard of the batch.  Losses and the full parameters after the last step (and a
``state_dict`` round trip) must match torch's (1e-5); a refusal must name FSDP, say what to do instead in a few lines and
quote no tensor.  What each case does and why: ortpass/runtime/module/distributed.py.

- FSDP1 at the root with ``use_orig_params=True`` (the loss inside), FSDP2 at the root
  (the loss computed in torch), and an ORTModule per layer, each a non-root FSDP1 or FSDP2
  unit that frees its gathered parameters after forward and gathers them again before
  backward: trained.  On stock onnxruntime (``builder="torch"``) FSDP1 is refused.
- FSDP1 with ``use_orig_params=False`` (at the wrapper or around it), FSDP1 units inside
  the wrapped module (per-layer auto-wrap), ``ORTModule(fully_shard(model))`` and
  ``fully_shard`` on a submodule of the wrapped module: refused.
"""

from __future__ import annotations

import copy
import gc
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ortpass.errors import OrtpassError
from ortpass.runtime.module import ORTModule
from ortpass.testing.models import GPTDecoder, TransformerBlock
from ortpass.training.backend import has_training_ops

# Two gloo processes for the whole file: end-to-end.
pytestmark = [pytest.mark.slow, pytest.mark.stock]

WORLD, STEPS = 2, 3
TRAINED = ["fsdp1-root", "fsdp2-root", "fsdp1-per-layer", "fsdp2-per-layer"]
REFUSED = ["fsdp1-flat-params", "fsdp1-flat-params-outer", "fsdp1-auto-wrap-inside", "fsdp2-inside", "fsdp2-on-a-submodule"]
STOCK_REFUSED = {"fsdp1-root", "fsdp1-per-layer"}  # builder="torch": torch.export takes no FSDP1 views


def _fsdp1(module, **options):
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(module, use_orig_params=options.pop("use_orig_params", True),
                                    device_id=torch.device("cpu"), **options)  # fmt: skip


def _per_layer(model, wrap_layer):
    for i, block in enumerate(model.blocks):
        model.blocks[i] = wrap_layer(block)
    return model


def _pair(case: str, model: torch.nn.Module):
    """(the sharded wrapper, torch's FSDP of a copy of ``model``) for ``case``; the second is
    None where only the refusal is checked."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    reference = copy.deepcopy(model)
    ort = lambda m: ORTModule(m, threads=1)  # noqa: E731
    if case == "fsdp1-root":
        return _fsdp1(ort(model)), _fsdp1(reference)
    if case == "fsdp2-root":
        return fully_shard(ort(model)), fully_shard(reference)
    if case == "fsdp1-per-layer":
        policy = lambda classes: ModuleWrapPolicy(classes)  # noqa: E731
        return (_fsdp1(_per_layer(model, ort), auto_wrap_policy=policy({ORTModule})),
                _fsdp1(reference, auto_wrap_policy=policy({TransformerBlock})))  # fmt: skip
    if case == "fsdp2-per-layer":
        return (fully_shard(_per_layer(model, lambda b: fully_shard(ort(b)))),
                fully_shard(_per_layer(reference, fully_shard)))  # fmt: skip
    if case == "fsdp1-flat-params":
        return _fsdp1(ort(model), use_orig_params=False), None
    if case == "fsdp1-flat-params-outer":  # the flat parameter on a module around the wrapper
        return _fsdp1(_Outer(ort(model)), use_orig_params=False), None
    if case == "fsdp1-auto-wrap-inside":
        return _fsdp1(ort(model), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock})), None
    if case == "fsdp2-inside":
        return ort(fully_shard(model)), None
    if case == "fsdp2-on-a-submodule":
        return fully_shard(ort(_per_layer(model, fully_shard))), None
    raise AssertionError(case)


def _full_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def _run_case(case: str, rank: int) -> dict:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPTDecoder(vocab=32, hidden=16, heads=2, layers=2, dropout=0.0)
    loss_outside = case != "fsdp1-root"  # per-layer: the blocks' hidden states go on in torch
    if loss_outside:
        model.loss = _FlatLogits()
    try:
        wrapped, reference = _pair(case, model)
    except OrtpassError as exc:
        return {"refused": str(exc), "when": "wrapping"}
    models = [m for m in (wrapped, reference) if m is not None]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 32, (2, 8), generator=generator)
        step = []
        for m, optimizer in zip(models, optimizers):
            try:
                out = m(ids, ids)
            except OrtpassError as exc:
                return {"refused": str(exc), "when": "forward"}
            loss = F.cross_entropy(out, ids.flatten()) if loss_outside else out
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step.append(loss.item())
        losses.append(step)
    wrapped.load_state_dict(wrapped.state_dict())  # a checkpoint's round trip, under FSDP's own hooks
    return {"losses": losses, "wrapped": _full_parameters(wrapped), "reference": _full_parameters(reference)}


def _outcome(case: str, rank: int) -> dict:
    """The case's result, or the error it raised (each case fails on its own; both ranks
    raise alike, so the other cases still find their peers)."""
    try:
        return _run_case(case, rank)
    except Exception as exc:  # reported by the test of that case
        return {"error": f"{type(exc).__name__}: {str(exc)[:1000]}"}


def _run_all(rank: int, rendezvous: str, results: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        outcomes = {case: _outcome(case, rank) for case in TRAINED + REFUSED}
        torch.save(outcomes, os.path.join(results, f"rank{rank}.pt"))
        # ORT's sessions (and their thread pools) go before the process group and before
        # interpreter shutdown (tests/test_module_ddp.py).
        del outcomes
        gc.collect()
    finally:
        dist.destroy_process_group()


class _Outer(torch.nn.Module):
    """A bigger model around the wrapper."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, ids, labels):
        return self.inner(ids, labels)


class _FlatLogits(torch.nn.Module):
    """In place of the decoder's loss: its forward then returns the flat logits."""

    def forward(self, logits, labels):
        return logits


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    results = tmp_path_factory.mktemp("fsdp")
    mp.start_processes(_run_all, args=(str(results / "rendezvous"), str(results)), nprocs=WORLD, start_method="spawn")
    return [torch.load(results / f"rank{r}.pt") for r in range(WORLD)]


def _refused_on_this_runtime(case: str) -> bool:
    return case in REFUSED or (case in STOCK_REFUSED and not has_training_ops())


def _check_refusal(message: str) -> None:
    assert re.search(r"FullyShardedDataParallel|fully_shard", message), message  # named
    assert len(message.splitlines()) <= 4 and len(message) < 600, message  # a few lines
    assert re.search(r"(FSDP|fully_shard)\(ORTModule\(model\)", message), message  # what to do instead
    assert "tensor(" not in message and not re.search(r"\d\.\d{4}", message), message  # no tensor values


@pytest.mark.parametrize("case", TRAINED + REFUSED)
def test_fsdp_trains_as_torch_fsdp_or_is_refused_by_name(outcomes, case):
    results = [rank[case] for rank in outcomes]
    assert all("error" not in result for result in results), [result.get("error") for result in results]
    if _refused_on_this_runtime(case):
        for result in results:
            assert "refused" in result, f"{case} ran; expected a refusal"
            _check_refusal(result["refused"])
        return
    for result in results:
        assert "refused" not in result, result.get("refused")
        for wrapped, reference in result["losses"]:
            assert abs(wrapped - reference) <= 1e-5 * max(abs(reference), 1.0)
        assert len(result["wrapped"]) == len(result["reference"])
        for wrapped, reference in zip(result["wrapped"], result["reference"]):
            assert ((wrapped - reference).abs().max() / max(reference.abs().max().item(), 1.0)).item() <= 1e-5
    for a, b in zip(results[0]["wrapped"], results[1]["wrapped"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)  # one model: the ranks hold the same parameters
