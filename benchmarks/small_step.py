"""Host wall time of a small training step (MSE, or `--loss`), fusedloss against eager, and the two
autograds of fusedloss (docs/design.md, "Autograd"): what fusedloss's function takes (the
fused kernels behind the C++ autograd where it is built, ``python -m fusedloss build``; where
it is not, PyTorch's own step for MSE and L1, the Python autograd for the others), and
ops.py's autograd.Function, applied directly.

A step is ``p.grad = None; loss(p, t).backward()``: at these sizes it is bound by host
time. Each cell is the median of `--repeats` measurements, each the median of seven
runs of back-to-back steps (``fusedloss.bench.training.wall_us``); the systems take
turns. Eager is torch.nn.functional's loss, or for a loss PyTorch does not have the formula
users write (``EAGER``). Needs a CUDA GPU; prints a table and writes ``small_step[_LOSS].csv``
into ``--out``.

    python benchmarks/small_step.py --out results/small_step
    python benchmarks/small_step.py --loss log_cosh --exponents 12 16 20 22 24
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
from fusedloss.losses import LOSSES
from fusedloss.bench.training import _step, wall_us


# pseudo-Huber's c and the quantile of the steps that take one
PARAMS = {"mse": 0.0, "l1": 0.0, "log_cosh": 0.0, "pseudo_huber": 0.5, "quantile": 0.9}
_C, _Q = PARAMS["pseudo_huber"], PARAMS["quantile"]
EAGER = {
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "log_cosh": lambda a, b: torch.log(torch.cosh(a - b)).mean(),
    "pseudo_huber": lambda a, b: (2 * _C * (torch.sqrt((a.float() - b.float()) ** 2 + _C**2) - _C)).mean(),
    "quantile": lambda a, b: torch.max((_Q - 1) * (b - a), _Q * (b - a)).mean(),
}


def systems(loss: str) -> dict:
    """Eager, fusedloss's function as installed, and the operator with ops.py's autograd.Function."""
    param = PARAMS[loss]
    function = getattr(fusedloss, LOSSES[loss].function)

    def fused(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return function(p, t, param) if LOSSES[loss].param else function(p, t)

    def python_autograd(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ops.ReducedLoss.apply(p, t, (loss, param, "mean", [False, False], -1, 1.0, False))[0]

    return {"eager": EAGER[loss], "fused": fused, "python": python_autograd}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("small-step-out"))
    parser.add_argument("--exponents", type=int, nargs="+", default=[7, 10, 12, 14, 16, 18, 20, 22, 24])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loss", choices=list(EAGER), default="mse")
    args = parser.parse_args()
    compared = systems(args.loss)
    args.out.mkdir(parents=True, exist_ok=True)
    build.load("plain")
    print(f"{args.loss}: {torch.cuda.get_device_name()}, torch {torch.__version__}, fusedloss {fusedloss.__version__}, "
          f"C++ autograd {'loaded' if build.cxx_autograd_loaded() else 'not built'}")
    print(f"{'N':>10} {'dtype':9} " + " ".join(f"{name:>11}" for name in compared) + "  fused/eager  python/eager")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for exponent in args.exponents:
            p = torch.randn(2**exponent, device="cuda", dtype=dtype, requires_grad=True)
            t = torch.randn(2**exponent, device="cuda", dtype=dtype)
            steps = {name: _step(fn, p, t) for name, fn in compared.items()}
            runs = [wall_us(steps) for _ in range(args.repeats)]
            us = {name: statistics.median(run[name] for run in runs) for name in compared}
            ratios = {name: statistics.median(run[name] / run["eager"] for run in runs) for name in compared}
            rows.append({"n": 2**exponent, "dtype": str(dtype).removeprefix("torch."),
                         **{f"{name}_us": round(value, 2) for name, value in us.items()},
                         "fused_over_eager": round(ratios["fused"], 4),
                         "python_over_eager": round(ratios["python"], 4)})
            print(f"{2**exponent:>10} {rows[-1]['dtype']:9} " + " ".join(f"{us[name]:11.1f}" for name in compared)
                  + f"  {ratios['fused']:11.3f}  {ratios['python']:12.3f}", flush=True)
    name = "small_step.csv" if args.loss == "mse" else f"small_step_{args.loss}.csv"
    with open(args.out / name, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
