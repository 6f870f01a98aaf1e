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

import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import fusedloss

from . import build, formulas

SEED_SHAPE = (32768, 32768)


@dataclass(frozen=True)
class Case:
    """A loss as fusedloss computes it, next to the eager PyTorch code it replaces."""

    name: str
    loss: str
    param: float
    fused: Callable[[Tensor, Tensor], Tensor]
    eager: Callable[[Tensor, Tensor], Tensor]


def _seed_mse(p: Tensor, t: Tensor) -> Tensor:
    return torch.mean((p - t) ** 2)


CASES = (
    Case("mse  (torch.mean((p-t)**2))", "mse", 0.0, fusedloss.mse_loss, _seed_mse),
    Case("smooth_l1 (F.smooth_l1_loss)", "smooth_l1", 1.0, fusedloss.smooth_l1_loss, F.smooth_l1_loss),
    Case("l1   (F.l1_loss)", "l1", 0.0, fusedloss.l1_loss, F.l1_loss),
    Case("huber (F.huber_loss)", "huber", 1.0, fusedloss.huber_loss, F.huber_loss),
)


def seed_inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> tuple[Tensor, Tensor]:
    """KernelBench's inputs: ``torch.rand(...) * scale`` and ``torch.rand(...)``."""
    scale = torch.rand((), device=device)
    return (torch.rand(shape, device=device) * scale).to(dtype), torch.rand(shape, device=device).to(dtype)


def float64_loss(p: Tensor, t: Tensor, loss: str, param: float, chunk: int = 1 << 26) -> float:
    """The mean loss in float64, a chunk at a time to bound the memory."""
    flat_p, flat_t = p.reshape(-1), t.reshape(-1)
    total = sum(
        formulas.torch_loss(flat_p[i : i + chunk].double(), flat_t[i : i + chunk].double(), loss, param, "sum").item()
        for i in range(0, flat_p.numel(), chunk)
    )
    return total / p.numel()


def relative_error(value: Tensor, reference: float) -> float:
    return abs(value.double().item() - reference) / abs(reference)


def time_side_by_side(fns: dict[str, Callable[[], object]], reps: int = 20,
                      warmup_s: float = 0.25) -> dict[str, float]:
    """Median device time of one call of each function, in ms. The functions take turns
    call by call, so drifting clocks and temperature weigh on them alike, and the order
    of a turn rotates, so that no function always follows the same one (what ran before
    shapes the queue and the caches a call meets); back-to-back warm-up calls for
    `warmup_s` first bring the clocks up from idle."""
    deadline = time.perf_counter() + warmup_s
    calls = 0
    while calls < 3 or time.perf_counter() < deadline:
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        calls += 1
    events = {name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(reps)] for name in fns}
    for rep in range(reps):
        for name in turn_order(fns, rep):
            fn = fns[name]
            start, end = events[name][rep]
            start.record()
            fn()
            end.record()
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


def turn_order(names: Iterable[str], turn: int) -> list[str]:
    """The names rotated by `turn`: over len(names) turns each takes every place once."""
    names = list(names)
    k = turn % len(names) if names else 0
    return names[k:] + names[:k]


def time_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median device time of one call, in ms (see time_side_by_side)."""
    return time_side_by_side({"fn": fn}, reps)["fn"]


def device_copy(nbytes: int = 2 << 30) -> tuple[Callable[[], object], int]:
    """A device-to-device copy and the bytes it moves (read + write): the ceiling the
    bandwidth percentages refer to."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * nbytes


def _fresh_compile(fn: Callable) -> Callable:
    """torch.compile with a clean cache, so no case runs into dynamo's recompile limit."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def peak_memory_gib(step: Callable[[], object]) -> float:
    """Peak memory a step allocates above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def _progress(iterable, total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience; the numbers don't need it
        return iterable
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, leave=False)


@dataclass
class Row:
    case: str
    dtype: str
    mode: str
    bytes_moved: int
    fused_ms: float
    eager_ms: float
    compile_ms: float
    copy_tbs: float
    fused_err: float = math.nan
    eager_err: float = math.nan
    fused_peak_gib: float = math.nan
    eager_peak_gib: float = math.nan
    compile_peak_gib: float = math.nan

    @property
    def fused_tbs(self) -> float:
        return self.bytes_moved / self.fused_ms / 1e9


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bench_forward(case: Case, dtype: torch.dtype, shape: tuple[int, ...]) -> Row:
    p, t = seed_inputs(shape, dtype, "cuda")
    reference = float64_loss(p, t, case.loss, case.param)
    fused_err = relative_error(case.fused(p, t), reference)
    eager_err = relative_error(case.eager(p, t), reference)
    compiled = _fresh_compile(case.eager)
    copy, copy_bytes = device_copy()
    with torch.no_grad():
        ms = time_side_by_side({"fused": lambda: case.fused(p, t), "eager": lambda: case.eager(p, t),
                                "compile": lambda: compiled(p, t), "copy": copy})
    nbytes = p.numel() * (p.element_size() + t.element_size())
    return Row(case.name, _dtype_name(dtype), "forward", nbytes, ms["fused"], ms["eager"], ms["compile"],
               copy_bytes / ms["copy"] / 1e9, fused_err, eager_err)


def bench_training_step(case: Case, dtype: torch.dtype, shape: tuple[int, ...], grad_output: float) -> Row:
    """Forward + backward for d loss / d input; `grad_output` != 1 exercises the scaling pass."""
    p, t = seed_inputs(shape, dtype, "cuda")
    p.requires_grad_(True)
    compiled = _fresh_compile(case.eager)

    def step(fn):
        def run():
            p.grad = None
            loss = fn(p, t)
            (loss if grad_output == 1.0 else loss * grad_output).backward()
        return run

    steps = {"fused": step(case.fused), "eager": step(case.eager), "compile": step(compiled)}
    copy, copy_bytes = device_copy()
    times = time_side_by_side({**steps, "copy": copy})
    peaks = {}
    for name, run in steps.items():
        p.grad = None  # the step's own gradient counts towards its peak
        peaks[name] = peak_memory_gib(run)
    p.grad = None
    nbytes = p.numel() * (2 * p.element_size() + t.element_size())
    mode = "fwd+bwd" if grad_output == 1.0 else f"fwd+bwd, grad_output={grad_output:g}"
    return Row(case.name, _dtype_name(dtype), mode, nbytes, times["fused"], times["eager"], times["compile"],
               copy_bytes / times["copy"] / 1e9, fused_peak_gib=peaks["fused"], eager_peak_gib=peaks["eager"],
               compile_peak_gib=peaks["compile"])


def _format_rows(rows: list[Row]) -> str:
    header = (f"{'case':30} {'dtype':8} {'mode':26} {'fused ms':>9} {'TB/s':>6} {'copy':>5} {'%copy':>6} "
              f"{'eager ms':>9} {'compile ms':>10} {'x eager':>8} {'x compile':>9} {'rel err':>9} "
              f"{'eager err':>9} {'peak GiB f/e/c':>16}")
    lines = [header, "-" * len(header)]
    for r in rows:
        peaks = "" if math.isnan(r.fused_peak_gib) else \
            f"{r.fused_peak_gib:.1f}/{r.eager_peak_gib:.1f}/{r.compile_peak_gib:.1f}"
        lines.append(
            f"{r.case:30} {r.dtype:8} {r.mode:26} {r.fused_ms:9.3f} {r.fused_tbs:6.2f} {r.copy_tbs:5.2f} "
            f"{100 * r.fused_tbs / r.copy_tbs:5.1f}% {r.eager_ms:9.3f} {r.compile_ms:10.3f} "
            f"{r.eager_ms / r.fused_ms:8.2f} {r.compile_ms / r.fused_ms:9.2f} {r.fused_err:9.1e} "
            f"{r.eager_err:9.1e} {peaks:>16}")
    return "\n".join(lines)


def cpu_demo() -> None:
    """Without a GPU: fusedloss's results (CPU tensors run torch.nn.functional) against float64."""
    torch.manual_seed(0)
    p = torch.randn(1000, 37) * 3
    t = torch.randn(1000, 37)
    print(f"{'loss':10} {'fusedloss':>12} {'float64':>12} {'rel err':>9}")
    for case in CASES:
        value = case.fused(p, t)
        reference = float64_loss(p, t, case.loss, case.param)
        print(f"{case.loss:10} {value.item():12.6f} {reference:12.6f} {relative_error(value, reference):9.1e}")


# What the largest row holds per element: two fp32 operands and eager's intermediates
# (its MSE step peaks at five N-sized fp32 tensors besides them), with headroom.
_BYTES_PER_ELEMENT = 32


def fitting_shape(shape: tuple[int, ...], free_bytes: int) -> tuple[int, ...]:
    """`shape` with its first dimension halved until the rows fit in `free_bytes`; says so."""
    fitted = shape
    while math.prod(fitted) * _BYTES_PER_ELEMENT > free_bytes and fitted[0] > 1:
        fitted = (fitted[0] // 2, *fitted[1:])
    if fitted != shape:
        print(f"fusedloss bench: {free_bytes / 2**30:.1f} GiB of GPU memory free; shape {shape} needs about "
              f"{math.prod(shape) * _BYTES_PER_ELEMENT / 2**30:.0f} GiB, so the rows use {fitted}")
    return fitted


def run(out_dir: Path, shape: tuple[int, ...] = SEED_SHAPE,
        with_training: bool = True, with_latency: bool = True, only_latency: bool = False,
        latency_exponents: tuple[int, ...] | None = None, with_weighted: bool = True,
        only_weighted: bool = False) -> int:
    if not torch.cuda.is_available():
        print("fusedloss bench: no CUDA device, so nothing to time. fusedloss runs CPU tensors through "
              "torch.nn.functional, so this demo checks those results against float64:")
        cpu_demo()
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    build.load()
    shape = fitting_shape(shape, torch.cuda.mem_get_info()[0])
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}, CUDA {torch.version.cuda}; shape {shape}")
    from . import bench_training, bench_weighted  # here: they import this module's helpers

    if only_latency or only_weighted:
        if only_latency:
            bench_training.run_all(out_dir, latency_exponents)
        if only_weighted:
            bench_weighted.run_all(out_dir)
        return 0

    jobs = [(bench_forward, case, dtype, ()) for dtype in (torch.float32, torch.bfloat16) for case in CASES]
    if with_training:
        jobs += [(bench_training_step, case, dtype, (grad_output,))
                 for grad_output in (1.0, 0.5) for dtype in (torch.float32, torch.bfloat16) for case in CASES]
    rows = []
    for bench, case, dtype, extra in _progress(jobs, len(jobs), "cases"):
        rows.append(bench(case, dtype, shape, *extra))
        torch.cuda.empty_cache()
    table = _format_rows(rows)
    (out_dir / "bench.txt").write_text(f"{device}; torch {torch.__version__}\n{table}\n")
    if with_latency:
        bench_training.run_all(out_dir, latency_exponents)
    if with_weighted:
        bench_weighted.run_all(out_dir)
    print(table)
    return 0
