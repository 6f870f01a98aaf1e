"""A sequence-sharded training step on DTensor operands against the single-GPU fused step
at the same local size: a bf16 mean loss (MSE, or ``--loss gaussian_nll`` / ``poisson_nll``),
each rank holding 2^26 elements of a (ranks * 2^14, 4096) loss sharded along its first
dimension (the NLLs' var and counts sharded alike).

Device time of ``p.grad = None; loss.backward()`` with CUDA events behind a queued GPU
sleep (host time out), and wall time per step of steps back to back (host time in), the
medians of `--reps`. The loss is left a Partial DTensor, as DTensor leaves its own, so
neither step has a collective. Beside them, the line fusedloss replaces: torch.nn.functional's
loss on the same DTensors (for MSE, DTensor's own operator, whose gradient DTensor's rule for
the mean gives times the number of ranks), and the exact line on DTensor operations, the sum
over the element count. Each step's gradient is checked against the full tensor's (on each rank, the
single-GPU gradient of its shard over the number of ranks). Then the host syncs of one
step of each, as PyTorch's sync debug mode finds them. Run one process per GPU:

    torchrun --nproc-per-node 2 benchmarks/sharded_step.py [--loss gaussian_nll]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import fusedloss

SLEEP_CYCLES = 20_000_000  # about 10 ms of a GPU's clock: longer than the step's host time

# each loss: fusedloss's, torch.nn.functional's, of (input, target, var)
LOSSES = {
    "mse": (lambda p, t, v, **kw: fusedloss.mse_loss(p, t, **kw), lambda p, t, v, **kw: F.mse_loss(p, t, **kw)),
    "gaussian_nll": (lambda p, t, v, **kw: fusedloss.gaussian_nll_loss(p, t, v, **kw),
                     lambda p, t, v, **kw: F.gaussian_nll_loss(p, t, v, **kw)),
    "poisson_nll": (lambda p, t, v, **kw: fusedloss.poisson_nll_loss(p, t, **kw),
                    lambda p, t, v, **kw: F.poisson_nll_loss(p, t, **kw)),
}


def _device_ms(step, reps: int) -> float:
    """The step's device time: each rep waits behind a queued GPU sleep, so the host has
    enqueued the whole step before the GPU reaches it (host time stays out)."""
    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _wall_ms(step, reps: int) -> float:
    """Wall time per step of `reps` steps back to back, host time included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def _host_syncs(step) -> list[str]:
    """Where one step synchronizes with the GPU, as PyTorch's sync debug mode finds it: the
    Python stack of each of its warnings."""
    stacks = []

    def note(message, *args, **kwargs) -> None:
        if "called a synchronizing CUDA operation" in str(message):  # not the mode's own notice
            stacks.append("".join(traceback.format_stack(limit=14)[:-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return stacks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1 << 14, help="rows per rank, of 4096 columns")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--loss", choices=list(LOSSES), default="mse")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    shape = (args.rows * world, 4096)
    fused_loss, torch_loss = LOSSES[args.loss]
    p_full = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    if args.loss == "poisson_nll":  # counts
        t_full = torch.poisson(torch.rand(shape, device="cuda") * 4).to(torch.bfloat16)
    else:
        t_full = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_full = torch.rand(shape, device="cuda", dtype=torch.bfloat16) + 0.5
    p = distribute_tensor(p_full, mesh, [Shard(0)]).requires_grad_()
    t, v = (distribute_tensor(x, mesh, [Shard(0)]) for x in (t_full, v_full))
    local_p = p.to_local().detach().clone().requires_grad_()
    local_t, local_v = t.to_local(), v.to_local()
    del p_full, t_full, v_full

    def sharded() -> None:
        p.grad = None
        fused_loss(p, t, v).backward()

    def dtensor_own() -> None:
        p.grad = None
        torch_loss(p, t, v).backward()

    def dtensor_exact() -> None:
        p.grad = None
        (torch_loss(p, t, v, reduction="sum") / p.numel()).backward()

    def single() -> None:
        local_p.grad = None
        fused_loss(local_p, local_t, local_v).backward()

    steps = (("sharded", sharded), ("single", single), ("F on DTensor", dtensor_own),
             ("DTensor sum / count", dtensor_exact))
    single()
    expected_grad = local_p.grad.float() / world
    gradient_error = {}
    for name, step in steps:
        if name != "single":
            step()
            gradient_error[name] = ((p.grad.to_local().float() - expected_grad).abs().max()
                                    / expected_grad.abs().max()).item()
    device, wall = {}, {}
    for turn in range(2):  # they take turns, so drift weighs on each
        for name, step in steps[:: 1 if turn == 0 else -1]:
            device.setdefault(name, []).append(_device_ms(step, args.reps))
            wall.setdefault(name, []).append(_wall_ms(step, args.reps))
    device_ms = {name: statistics.median(times) for name, times in device.items()}
    wall_ms = {name: statistics.median(times) for name, times in wall.items()}
    syncs = {name: _host_syncs(step) for name, step in steps}
    if rank == 0:
        print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {world} ranks; {args.loss}, "
              f"{local_p.numel()} bf16 elements per rank")
        for label, ms in (("device time", device_ms), ("wall time, host included", wall_ms)):
            print(f"{label}: sharded step {ms['sharded']:.3f} ms, single-GPU step {ms['single']:.3f} ms, "
                  f"ratio {ms['sharded'] / ms['single']:.3f}; F on DTensors step {ms['F on DTensor']:.3f} ms, "
                  f"DTensor's sum / count step {ms['DTensor sum / count']:.3f} ms")
        print("gradient, largest error relative to the full tensor's largest: "
              + ", ".join(f"{name} {error:.1e}" for name, error in gradient_error.items()))
        print("host syncs in one step: " + ", ".join(f"{name} {len(stacks)}" for name, stacks in syncs.items()))
        for name, stacks in syncs.items():
            for stack in stacks:
                print(f"-- a host sync in the {name} step:\n{stack}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
