"""A sequence-sharded training step on DTensor operands against the single-GPU fused step
at the same local size: bf16 MSE, each rank holding 2^26 elements of a (ranks * 2^14,
4096) loss sharded along its first dimension.

Device time of ``p.grad = None; loss.backward()`` with CUDA events, the median of
`--reps`; the sharded step includes the all-reduce of the loss, which the single step has
no need of. Run one process per GPU:

    torchrun --nproc-per-node 2 benchmarks/sharded_step.py
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import fusedloss


def _device_ms(step, reps: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1 << 14, help="rows per rank, of 4096 columns")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    shape = (args.rows * world, 4096)
    p_full = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    t_full = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    p = distribute_tensor(p_full, mesh, [Shard(0)]).requires_grad_()
    t = distribute_tensor(t_full, mesh, [Shard(0)])
    local_p = p.to_local().detach().clone().requires_grad_()
    local_t = t.to_local()
    del p_full, t_full

    def sharded() -> None:
        p.grad = None
        fusedloss.mse_loss(p, t).backward()

    def single() -> None:
        local_p.grad = None
        fusedloss.mse_loss(local_p, local_t).backward()

    times = {}
    for turn in range(2):  # the two take turns, so drift weighs on both
        for name, step in (("sharded", sharded), ("single", single))[:: 1 if turn == 0 else -1]:
            times.setdefault(name, []).append(_device_ms(step, args.reps))
    sharded_ms, single_ms = (statistics.median(times[name]) for name in ("sharded", "single"))
    if rank == 0:
        print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {world} ranks; "
              f"{local_p.numel()} bf16 elements per rank")
        print(f"sharded step {sharded_ms:.3f} ms, single-GPU step {single_ms:.3f} ms, "
              f"ratio {sharded_ms / single_ms:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
