"""Distributed training compiled with tilec, on two CPU processes (gloo):
DDP, FSDP2 (``fully_shard``) and a tensor-parallel layer (DTensor).

Oracle: the same training, uncompiled, in the same processes: each rank
trains the model both ways from the same initial weights on its own batches,
and the parameters after three SGD steps must agree.  Under tensor
parallelism the collectives run as library calls, not fallbacks."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed (gloo)"
)

WORLD = 2
STEPS = 3


class Net(torch.nn.Module):
    """Column-parallel then row-parallel linear layers around a GELU, and a
    norm over the (replicated) result."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(torch.nn.functional.gelu(self.a(x))))


def _wrap(kind: str, model: Net) -> torch.nn.Module:
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.a, model.b):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    return parallelize_module(model, mesh, {"a": ColwiseParallel(), "b": RowwiseParallel()})


def _train(kind: str, rank: int, compiled: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = _wrap(kind, Net())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    run = torch.compile(net, backend="tilec") if compiled else net
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        run(torch.randn(4, 8, generator=g)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    full = {}
    for name, value in net.state_dict().items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        full[name] = value.detach().clone()
    return full


def _worker(rank: int, init: str, kind: str, results) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        import tilec
        from tilec.ir import is_collective

        tilec.reset_stats()
        compiled = _train(kind, rank, compiled=True)
        stats = tilec.stats()
        collectives = [
            n.extern.role
            for program in tilec.programs().values()
            for n in program.graph.nodes.values()
            if is_collective(n)
        ]
        eager = _train(kind, rank, compiled=False)
        results[rank] = {
            "error": max((compiled[k] - eager[k]).abs().max().item() for k in eager),
            "names": sorted(eager),
            "graphs": stats["graphs"],
            "collectives": collectives,
            "fallbacks": stats["fallbacks"],
        }
    finally:
        dist.destroy_process_group()


def _run(kind: str) -> dict:
    with tempfile.TemporaryDirectory() as scratch, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(f"file://{scratch}/rendezvous", kind, results), nprocs=WORLD)
        return dict(results)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_data_parallel_training_matches_uncompiled(kind):
    results = _run(kind)
    assert sorted(results) == list(range(WORLD))
    for rank, r in results.items():
        assert r["graphs"] > 0, f"rank {rank}: nothing was compiled"
        assert r["fallbacks"] == {}, r["fallbacks"]
        assert r["error"] < 1e-5, (rank, r)
        assert "a.weight" in r["names"] or "module.a.weight" in r["names"], r["names"]


def test_tensor_parallel_collectives_are_library_calls():
    results = _run("tp")
    for rank, r in results.items():
        assert r["graphs"] > 0, f"rank {rank}: nothing was compiled"
        assert r["fallbacks"] == {}, r["fallbacks"]
        # The row-parallel layer's all-reduce and its wait, forward and
        # backward, as library calls of the compiled programs.
        assert r["collectives"] and set(r["collectives"]) == {"library"}, r["collectives"]
        assert r["error"] < 1e-5, (rank, r)
