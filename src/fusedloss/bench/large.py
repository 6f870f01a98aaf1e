"""The 2^30 rows: forward and training step of each seed case, against eager and
compile, with bandwidth against a device copy's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .timing import (CASES, Case, device_copy, dtype_name, float64_loss, fresh_compile, peak_memory_gib,
                     relative_error, seed_inputs, time_side_by_side)


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


def bench_forward(case: Case, dtype: torch.dtype, shape: tuple[int, ...]) -> Row:
    p, t = seed_inputs(shape, dtype, "cuda")
    reference = float64_loss(p, t, case.loss, case.param)
    fused_err = relative_error(case.fused(p, t), reference)
    eager_err = relative_error(case.eager(p, t), reference)
    compiled = fresh_compile(case.eager)
    copy, copy_bytes = device_copy()
    with torch.no_grad():
        ms = time_side_by_side({"fused": lambda: case.fused(p, t), "eager": lambda: case.eager(p, t),
                                "compile": lambda: compiled(p, t), "copy": copy})
    nbytes = p.numel() * (p.element_size() + t.element_size())
    return Row(case.name, dtype_name(dtype), "forward", nbytes, ms["fused"], ms["eager"], ms["compile"],
               copy_bytes / ms["copy"] / 1e9, fused_err, eager_err)


def bench_training_step(case: Case, dtype: torch.dtype, shape: tuple[int, ...], grad_output: float) -> Row:
    """Forward + backward for d loss / d input; `grad_output` != 1 exercises the scaling pass."""
    p, t = seed_inputs(shape, dtype, "cuda")
    p.requires_grad_(True)
    compiled = fresh_compile(case.eager)

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
    return Row(case.name, dtype_name(dtype), mode, nbytes, times["fused"], times["eager"], times["compile"],
               copy_bytes / times["copy"] / 1e9, fused_peak_gib=peaks["fused"], eager_peak_gib=peaks["eager"],
               compile_peak_gib=peaks["compile"])


def format_rows(rows: list[Row]) -> str:
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
