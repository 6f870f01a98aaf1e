"""Experiment: where a fused training step's time goes at 2^30 elements.

Times the forward op that also writes the gradient (no autograd), then the whole
`loss.backward()` step, per loss and dtype. Run on the device:
    PYTHONPATH=src python benchmarks/step_breakdown.py
"""

from __future__ import annotations

import torch

import fusedloss
from fusedloss import bench, build

PARAMS = {"mse": 0.0, "l1": 0.0, "smooth_l1": 1.0, "huber": 1.0}
FUNCTIONS = {"mse": fusedloss.mse_loss, "l1": fusedloss.l1_loss, "smooth_l1": fusedloss.smooth_l1_loss,
             "huber": fusedloss.huber_loss}


def main() -> None:
    build.load()
    for dtype in (torch.float32, torch.bfloat16):
        p, t = bench.seed_inputs((1 << 30,), dtype, "cuda")
        p.requires_grad_(True)
        for loss, param in PARAMS.items():
            with torch.no_grad():
                op_ms = bench.time_ms(lambda: torch.ops.fusedloss.reduced_loss.default(
                    p, t, loss, param, "mean", [True, False]))

            def step():
                p.grad = None
                FUNCTIONS[loss](p, t).backward()

            step_ms = bench.time_ms(step)
            nbytes = 3 * p.numel() * p.element_size()
            print(f"{str(dtype):15} {loss:10} op+grad {op_ms:6.3f} ms ({nbytes / op_ms / 1e9:4.2f} TB/s)  "
                  f"step {step_ms:6.3f} ms ({nbytes / step_ms / 1e9:4.2f} TB/s)")
        p.grad = None
        del p, t


if __name__ == "__main__":
    main()
