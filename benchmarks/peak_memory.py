"""Experiment: the peak memory of a training step, fusedloss against eager, by size.

For each loss, dtype and N: the peak allocated above what was allocated before
`loss(input, target).backward()` (input requires grad, `.grad` reset), for
fusedloss and for torch.nn.functional, and eager's peak minus fusedloss's in
bytes. A gradient of N elements is in both; the rest is small blocks (the 0-d
loss, grad_output, fusedloss's reduction scratch, eager's reduction staging).
Run on the device:
    PYTHONPATH=src python benchmarks/peak_memory.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fusedloss
from fusedloss import build

LOSSES = {"mse": (fusedloss.mse_loss, F.mse_loss), "l1": (fusedloss.l1_loss, F.l1_loss),
          "smooth_l1": (fusedloss.smooth_l1_loss, F.smooth_l1_loss),
          "huber": (fusedloss.huber_loss, F.huber_loss)}


def step_peak(fn, input: torch.Tensor, target: torch.Tensor) -> int:
    input.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(input, target).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def main() -> None:
    build.load()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; eager peak - fusedloss peak, bytes")
    sizes = [1 << k for k in range(10, 29, 3)] + [3 * 4099]
    print(f"{'':20}" + "".join(f"{n:>11}" for n in sizes))
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for name, (ours, eager) in LOSSES.items():
            cells = []
            for n in sizes:
                input = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
                target = torch.randn(n, device="cuda", dtype=dtype)
                for fn in (ours, eager):  # warm-up: caches, workspaces
                    step_peak(fn, input, target)
                cells.append(step_peak(eager, input, target) - step_peak(ours, input, target))
            print(f"{str(dtype)[6:]:9}{name:11}" + "".join(f"{c:>11}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
