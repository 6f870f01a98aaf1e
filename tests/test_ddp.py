"""DistributedDataParallel: 20 steps of a small model trained with fusedloss's losses on
2 ranks end with the same parameters on both, bit for bit, and match one process trained
on the whole batch. On the CPU: gloo ranks through fusedloss's operators (their CPU
kernels); with two GPUs: NCCL ranks on the CUDA kernels, one card each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import process_group

STEPS = 20
BATCH = 16  # the whole batch; each of the 2 ranks trains on half


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.SiLU(), torch.nn.Linear(32, 6)).to(device)


def _batch(step, device):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 12, generator=generator)
    y = torch.tanh(x[:, :6] * 2) + 0.1 * torch.randn(BATCH, 6, generator=generator)
    mask = torch.rand(BATCH, 1, generator=generator) < 0.75
    return x.to(device), y.to(device), mask.to(device)


def _losses(out, y, mask, world):
    """Two losses a loop writes: a plain mean, and a masked mean over every rank's rows
    with the count all-reduced (a scale of world / count: DDP averages over ranks)."""
    import fusedloss

    count = mask.sum().float() * y.shape[1]
    if world > 1:
        dist.all_reduce(count)
    masked = fusedloss.huber_loss(out, y, weight=mask, reduction="sum", scale=world / count)
    return fusedloss.mse_loss(out, y) + masked


def _train(model, device, rank, world):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for step in range(STEPS):
        x, y, mask = (t[rows] for t in _batch(step, device))
        _losses(model(x), y, mask, world).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _worker(rank, device, init_file, results_dir):
    with process_group(rank, 2, init_file, device):
        if device == "cpu":
            from conftest import cpu_through_operators

            cpu_through_operators()
        model = torch.nn.parallel.DistributedDataParallel(_model(device))
        params = _train(model, device, rank, 2)
        gathered = [torch.empty_like(params) for _ in range(2)]
        dist.all_gather(gathered, params)
        torch.save([t.cpu() for t in gathered], Path(results_dir) / f"rank{rank}.pt")


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices"))])
def test_ddp_ranks_agree_bitwise_and_match_one_process(request, tmp_path, device):
    if device == "cpu":
        request.getfixturevalue("fused_cpu")  # the one-process run through the operators too
    torch.multiprocessing.spawn(_worker, args=(device, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        first, second = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(first, second), "the ranks' parameters differ"
    single = _train(_model(device), device, 0, 1).cpu()
    start = torch.cat([p.detach().reshape(-1) for p in _model("cpu").parameters()])
    assert not torch.equal(first, start)  # it trained
    torch.testing.assert_close(first, single, rtol=1e-4, atol=1e-5)
