"""Host wall time of a small training step (MSE), fusedloss against eager, and the two
autograds of fusedloss (docs/design.md, "Autograd"): what ``fusedloss.mse_loss`` takes
(the fused kernels behind the C++ autograd where it is built, ``python -m fusedloss build``;
PyTorch's own step where it is not), and ops.py's autograd.Function, applied directly.

A step is ``p.grad = None; loss(p, t).backward()``: at these sizes it is bound by host
time. Each cell is the median of `--repeats` measurements, each the median of seven
runs of back-to-back steps (``fusedloss.bench.training.wall_us``); the systems take
turns. Needs a CUDA GPU; prints a table and writes ``small_step.csv`` into ``--out``.

    python benchmarks/small_step.py --out results/small_step
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import fusedloss
from fusedloss import build, ops
from fusedloss.bench.training import _step, wall_us


def _python_autograd(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The operator with ops.py's autograd.Function."""
    return ops.ReducedLoss.apply(p, t, "mse", 0.0, "mean", [False, False], -1, 1.0, False)[0]


SYSTEMS = {"eager": F.mse_loss, "fused": fusedloss.mse_loss, "python": _python_autograd}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("small-step-out"))
    parser.add_argument("--exponents", type=int, nargs="+", default=[7, 10, 12, 14, 16, 18, 20, 22, 24])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    build.load("plain")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fusedloss {fusedloss.__version__}, "
          f"C++ autograd {'loaded' if build.cxx_autograd_loaded() else 'not built'}")
    print(f"{'N':>10} {'dtype':9} " + " ".join(f"{name:>11}" for name in SYSTEMS) + "  fused/eager  python/eager")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for exponent in args.exponents:
            p = torch.randn(2**exponent, device="cuda", dtype=dtype, requires_grad=True)
            t = torch.randn(2**exponent, device="cuda", dtype=dtype)
            steps = {name: _step(fn, p, t) for name, fn in SYSTEMS.items()}
            runs = [wall_us(steps) for _ in range(args.repeats)]
            us = {name: statistics.median(run[name] for run in runs) for name in SYSTEMS}
            ratios = {name: statistics.median(run[name] / run["eager"] for run in runs) for name in SYSTEMS}
            rows.append({"n": 2**exponent, "dtype": str(dtype).removeprefix("torch."),
                         **{f"{name}_us": round(value, 2) for name, value in us.items()},
                         "fused_over_eager": round(ratios["fused"], 4),
                         "python_over_eager": round(ratios["python"], 4)})
            print(f"{2**exponent:>10} {rows[-1]['dtype']:9} " + " ".join(f"{us[name]:11.1f}" for name in SYSTEMS)
                  + f"  {ratios['fused']:11.3f}  {ratios['python']:12.3f}", flush=True)
    with open(args.out / "small_step.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
