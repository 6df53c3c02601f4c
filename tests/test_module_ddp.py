"""``DDP(ORTModule(model))`` over two gloo processes trains as ``DDP(model)`` in torch.

Each rank trains both side by side on its own shard of the batch (the loss computed in
torch from the logits, and the module's own loss) and reports its parameters; the ranks
must agree with each other (DDP all-reduced every step) and with torch's DDP.  The
other way round, ``ORTModule(DDP(model))``, is refused (tests/test_module_conformance.py).
"""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ortpass.runtime.module import ORTModule
from ortpass.testing.models import GPTDecoder

# Two gloo processes per case: end-to-end.
pytestmark = pytest.mark.slow

WORLD, STEPS = 2, 3


def _train(rank: int, rendezvous: str, results: str, loss_inside: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = GPTDecoder(vocab=32, hidden=16, heads=2, layers=2, dropout=0.0)
        if not loss_inside:
            model.loss = _FlatLogits()
        reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        wrapped = torch.nn.parallel.DistributedDataParallel(ORTModule(model, threads=1))
        # SGD: AdamW would scale the rounding noise of gradients that are zero (key biases) up.
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (wrapped, reference)]
        generator = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
        for _ in range(STEPS):
            ids = torch.randint(0, 32, (2, 8), generator=generator)
            for m, optimizer in zip((wrapped, reference), optimizers):
                out = m(ids, ids)
                (out if loss_inside else F.cross_entropy(out, ids.flatten())).backward()
                optimizer.step()
                optimizer.zero_grad()
        torch.save(
            {"wrapped": [p.detach() for p in wrapped.parameters()],
             "reference": [p.detach() for p in reference.parameters()]},
            os.path.join(results, f"rank{rank}.pt"),
        )  # fmt: skip
        # ORT's sessions (and their thread pools) go before the process group and before
        # interpreter shutdown: once, in a full CI run, a rank aborted at exit with
        # "terminate called without an active exception".
        del wrapped, reference, optimizers
        gc.collect()
    finally:
        dist.destroy_process_group()


class _FlatLogits(torch.nn.Module):
    """In place of the decoder's loss: its forward then returns the flat logits."""

    def forward(self, logits, labels):
        return logits


@pytest.mark.parametrize("loss_inside", [True, False], ids=["loss-inside", "loss-outside"])
def test_ddp_around_ortmodule_matches_torch_ddp(tmp_path, loss_inside):
    mp.start_processes(
        _train, args=(str(tmp_path / "rendezvous"), str(tmp_path), loss_inside), nprocs=WORLD, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for rank in ranks:
        for wrapped, reference in zip(rank["wrapped"], rank["reference"]):
            assert ((wrapped - reference).abs().max() / max(reference.abs().max().item(), 1.0)).item() <= 1e-5
    for a, b in zip(ranks[0]["wrapped"], ranks[1]["wrapped"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)  # all-reduced every step: the ranks agree
