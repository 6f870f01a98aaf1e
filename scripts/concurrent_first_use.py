"""Concurrent first use on a GPU: N processes start at once on an empty build cache.

Times one process alone on an empty cache, then N together on another empty
cache. Each process counts the builds it runs (a wrapper around cpp_extension.load),
then checks every loss and its gradient against float64. Passes when exactly
one build happened and every process got correct results; prints the ratio of
the N-process wall time to the single one (target <= 1.2).

    PYTHONPATH=src python scripts/concurrent_first_use.py [--processes 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r"""
import os, torch
import torch.utils.cpp_extension as cpp_extension
real_load = cpp_extension.load

def counting_load(*args, **kwargs):
    with open(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "builds.log"), "a") as log:
        log.write(f"{os.getpid()}\n")
    return real_load(*args, **kwargs)

cpp_extension.load = counting_load
import fusedloss
from fusedloss import formulas

params = {"mse": 0.0, "l1": 0.0, "smooth_l1": 0.5, "huber": 2.0}
functions = {"mse": fusedloss.mse_loss, "l1": fusedloss.l1_loss,
             "smooth_l1": lambda p, t: fusedloss.smooth_l1_loss(p, t, beta=0.5),
             "huber": lambda p, t: fusedloss.huber_loss(p, t, delta=2.0)}
input = (torch.randn(1_000_003, device="cuda") * 3).requires_grad_()
target = torch.randn(1_000_003, device="cuda")
for name, fn in functions.items():
    input.grad = None
    out = fn(input, target)
    out.backward()
    i64 = input.detach().double().requires_grad_()
    expected = formulas.torch_loss(i64, target.double(), name, params[name], "mean")
    expected.backward()
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(input.grad.double(), i64.grad, rtol=1e-5, atol=1e-14)
print("ok")
"""


def run_together(count: int, cache: Path) -> tuple[float, list[subprocess.CompletedProcess]]:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache))
    start = time.perf_counter()
    processes = [subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(count)]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return time.perf_counter() - start, results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=8)
    args = parser.parse_args()
    verdicts = []
    walls = {}
    for count in (1, args.processes):
        with tempfile.TemporaryDirectory() as cache:
            walls[count], results = run_together(count, Path(cache))
            log = Path(cache) / "builds.log"
            builds = len(log.read_text().splitlines()) if log.exists() else 0
            correct = sum(r.returncode == 0 and r.stdout.strip() == "ok" for r in results)
            print(f"{count} process(es), empty cache: wall {walls[count]:.1f} s, builds {builds}, "
                  f"correct {correct}/{count}")
            for result in results:
                if result.returncode != 0:
                    print(result.stderr[-2000:])
            verdicts.append(builds == 1 and correct == count)
    ratio = walls[args.processes] / walls[1]
    print(f"{args.processes} processes / 1 process wall time: {ratio:.2f} (target <= 1.2)")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
