"""What a loss-scaled step costs: the forward's gradient for an expected grad_output, against
the alternatives, at 2^30 elements and at the sizes a step is bound by host time.

2^30 rows (MSE, Smooth L1, L1, Huber; float32 and bfloat16; device time, median of 20
calls taking turns with a 2 GiB copy): the forward alone; a step with `loss.backward()`;
a step with a constant grad_output (0.5, and 65536 as GradScaler's), which the forward
expects after the first; a grad_output that changes every step (mispredicted every
time); and `--no-forward-gradient`'s step, where the forward writes no gradient and
backward computes it (FUSED_GRADIENT_FROM_BYTES above every size). Bytes: read input and
target, write the gradient; a forward reads both.

Small rows (MSE, float32 and bfloat16, N = 2^7 .. 2^24): host wall time per step of
back-to-back steps, fused and eager, for grad_output 1 and 65536, the median of three
measurements (each a median of seven).

Runs against whichever fusedloss is on the path, so an older tree can be timed the same
way on the same machine:
    PYTHONPATH=src python benchmarks/loss_scaling.py --out DIR
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import fusedloss
from fusedloss import build, routing
from fusedloss.bench import timing, training

LOSSES = {"mse": (fusedloss.mse_loss, F.mse_loss), "smooth_l1": (fusedloss.smooth_l1_loss, F.smooth_l1_loss),
          "l1": (fusedloss.l1_loss, F.l1_loss), "huber": (fusedloss.huber_loss, F.huber_loss)}
SMALL_EXPONENTS = (7, 10, 12, 14, 16, 18, 20, 22, 24)


def large_rows(n: int) -> list[dict]:
    copy, copy_bytes = timing.device_copy()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        p, t = timing.seed_inputs((n,), dtype, "cuda")
        p.requires_grad_(True)
        read, step_bytes = 2 * n * p.element_size(), 3 * n * p.element_size()
        for name, (fused, _) in LOSSES.items():
            changing = [0]

            def forward():
                with torch.no_grad():
                    fused(p, t)

            def step(grad_output):
                def run():
                    p.grad = None
                    loss = fused(p, t)
                    if grad_output == "changing":  # a new value every step (in bf16 too): never the one expected
                        changing[0] = changing[0] % 64 + 1
                        (loss * (1 + changing[0] / 64)).backward()
                    else:
                        (loss if grad_output == 1.0 else loss * grad_output).backward()
                return run

            cases = {"forward": (forward, read), "step, grad_output 1": (step(1.0), step_bytes),
                     "step, grad_output 0.5": (step(0.5), step_bytes),
                     "step, grad_output 65536": (step(65536.0), step_bytes),
                     "step, grad_output changing": (step("changing"), step_bytes)}
            for case, (fn, nbytes) in cases.items():
                ms = timing.time_side_by_side({"fused": fn, "copy": copy})
                rows.append({"loss": name, "dtype": str(dtype).removeprefix("torch."), "n": n, "case": case,
                             "ms": ms["fused"], "TB/s": nbytes / ms["fused"] / 1e9,
                             "copy TB/s": copy_bytes / ms["copy"] / 1e9})
            threshold = routing.FUSED_GRADIENT_FROM_BYTES
            routing.FUSED_GRADIENT_FROM_BYTES = 1 << 62
            try:
                ms = timing.time_side_by_side({"fused": step(0.5), "copy": copy})
            finally:
                routing.FUSED_GRADIENT_FROM_BYTES = threshold
            rows.append({"loss": name, "dtype": str(dtype).removeprefix("torch."), "n": n,
                         "case": "step, grad_output 0.5, gradient in backward only", "ms": ms["fused"],
                         "TB/s": step_bytes / ms["fused"] / 1e9, "copy TB/s": copy_bytes / ms["copy"] / 1e9})
            print(*(f"{r['loss']:9} {r['dtype']:8} {r['case']:48} {r['ms']:7.3f} ms {r['TB/s']:5.2f} TB/s "
                    f"({100 * r['TB/s'] / r['copy TB/s']:5.1f}% of copy)" for r in rows[-6:]), sep="\n", flush=True)
        del p, t
        torch.cuda.empty_cache()
    return rows


def small_rows() -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for exponent in SMALL_EXPONENTS:
            p, t = timing.seed_inputs((1 << exponent,), dtype, "cuda")
            p.requires_grad_(True)
            for grad_output in (1.0, 65536.0):
                calls = {system: training._step(fn, p, t, divide_by=1 / grad_output)
                         for system, fn in (("fused", fusedloss.mse_loss), ("eager", F.mse_loss))}
                runs = [training.wall_us(calls) for _ in range(3)]
                us = {system: statistics.median(run[system] for run in runs) for system in calls}
                rows.append({"dtype": str(dtype).removeprefix("torch."), "n": 1 << exponent,
                             "grad_output": grad_output, "fused_us": us["fused"], "eager_us": us["eager"],
                             "fused/eager": us["fused"] / us["eager"]})
                r = rows[-1]
                print(f"{r['dtype']:8} 2^{exponent:<3} grad_output {grad_output:<8g} fused {r['fused_us']:7.1f} us "
                      f"eager {r['eager_us']:7.1f} us  {r['fused/eager']:.3f}x", flush=True)
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--exponent", type=int, default=30, help="the large rows' size, 2^K")
    parser.add_argument("--skip-small", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    build.load()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"fusedloss at {Path(fusedloss.__file__).parent}")
    write_csv(args.out / "loss_scaling_large.csv", large_rows(1 << args.exponent))
    if not args.skip_small:
        write_csv(args.out / "loss_scaling_small.csv", small_rows())


if __name__ == "__main__":
    main()
