"""Experiment: where a fused training step's time goes at 2^30 elements.

Per loss and dtype, each taking turns with a 2 GiB copy: the forward op alone
(read 2N), the forward op that also writes the gradient (read 2N + write N, no
autograd), the whole `loss.backward()` step, and `(loss * 0.5).backward()`
(5N bytes: read 2N + write N, then read N + write N for its first step; after
that, with the gradient placed in backward, read 2N, then read 2N + write N).
Run on the device:
    PYTHONPATH=src python benchmarks/step_breakdown.py
"""

from __future__ import annotations

import torch

import fusedloss
from fusedloss import build
from fusedloss.bench import timing

PARAMS = {"mse": 0.0, "l1": 0.0, "smooth_l1": 1.0, "huber": 1.0}
FUNCTIONS = {"mse": fusedloss.mse_loss, "l1": fusedloss.l1_loss, "smooth_l1": fusedloss.smooth_l1_loss,
             "huber": fusedloss.huber_loss}


def main() -> None:
    build.load()
    copy, copy_bytes = timing.device_copy()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; % of the copy taking turns with each")
    for dtype in (torch.float32, torch.bfloat16):
        p, t = timing.seed_inputs((1 << 30,), dtype, "cuda")
        p.requires_grad_(True)
        n_bytes = p.numel() * p.element_size()
        for loss, param in PARAMS.items():
            def op(grad: bool):
                with torch.no_grad():
                    torch.ops.fusedloss.reduced_loss.default(p, t, loss, param, "mean", [grad, False])

            def step(scale: float):
                p.grad = None
                out = FUNCTIONS[loss](p, t)
                (out if scale == 1.0 else out * scale).backward()

            cases = {"forward": (lambda: op(False), 2 * n_bytes), "op+grad": (lambda: op(True), 3 * n_bytes),
                     "step": (lambda: step(1.0), 3 * n_bytes), "step x0.5": (lambda: step(0.5), 5 * n_bytes)}
            cells = []
            for name, (fn, nbytes) in cases.items():
                ms = timing.time_side_by_side({name: fn, "copy": copy}, warmup_s=0.1)
                copy_tbs = copy_bytes / ms["copy"] / 1e9
                cells.append(f"{name} {ms[name]:6.3f} ms {nbytes / ms[name] / 1e9 / copy_tbs:6.1%}")
            print(f"{str(dtype):15} {loss:10} " + " | ".join(cells), flush=True)
        p.grad = None
        del p, t


if __name__ == "__main__":
    main()
