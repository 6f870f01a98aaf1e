"""``python -m fusedloss bench``: check against float64, then time fusedloss,
eager PyTorch and ``torch.compile`` side by side on the same inputs.

Effective bandwidth counts the bytes a loss must move, for every system:
- forward, mean:         read input + read target
- forward + backward:    read input + read target + write grad_input
Copy bandwidth (read + write of a 2 GiB device-to-device copy) is measured in
each row, taking turns with the three systems, and is the ceiling that row's
percentage refers to.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import build
from . import large, training, weighted
from .timing import CASES, SEED_SHAPE, progress


def run(out_dir: Path, shape: tuple[int, ...] = SEED_SHAPE,
        with_training: bool = True, with_latency: bool = True, only_latency: bool = False,
        latency_exponents: tuple[int, ...] | None = None, with_weighted: bool = True,
        only_weighted: bool = False) -> int:
    if not torch.cuda.is_available():
        print("fusedloss bench: no CUDA device, so nothing to time. fusedloss runs CPU tensors through "
              "torch.nn.functional, so this demo checks those results against float64:")
        large.cpu_demo()
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    build.load()
    shape = large.fitting_shape(shape, torch.cuda.mem_get_info()[0])
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}, CUDA {torch.version.cuda}; shape {shape}")
    if only_latency or only_weighted:
        if only_latency:
            training.run_all(out_dir, latency_exponents)
        if only_weighted:
            weighted.run_all(out_dir)
        return 0

    jobs = [(large.bench_forward, case, dtype, ()) for dtype in (torch.float32, torch.bfloat16) for case in CASES]
    if with_training:
        jobs += [(large.bench_training_step, case, dtype, (grad_output,))
                 for grad_output in (1.0, 0.5) for dtype in (torch.float32, torch.bfloat16) for case in CASES]
    rows = []
    for bench_row, case, dtype, extra in progress(jobs, len(jobs), "cases"):
        rows.append(bench_row(case, dtype, shape, *extra))
        torch.cuda.empty_cache()
    table = large.format_rows(rows)
    (out_dir / "bench.txt").write_text(f"{device}; torch {torch.__version__}\n{table}\n")
    if with_latency:
        training.run_all(out_dir, latency_exponents)
    if with_weighted:
        weighted.run_all(out_dir)
    print(table)
    return 0
