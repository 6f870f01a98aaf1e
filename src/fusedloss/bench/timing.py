"""What every bench section shares: the seed cases and inputs, float64 references, and
timing that lets the systems take turns."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import fusedloss

from .. import formulas

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


# A GPU sleep queued before each timed call, longer than a call's host time: the host has
# enqueued the whole call before the GPU reaches it, so a call whose host time exceeds its
# GPU time is not timed with the GPU waiting on the host.
_SLEEP_CYCLES = 2_000_000


def time_side_by_side(fns: dict[str, Callable[[], object]], reps: int = 20,
                      warmup_s: float = 0.25) -> dict[str, float]:
    """Median device time of one call of each function, in ms, each behind a queued GPU
    sleep (host time stays out). The functions take turns call by call, so drifting
    clocks and temperature weigh on them alike, and the order of a turn rotates, so that
    no function always follows the same one (what ran before shapes the queue and the
    caches a call meets); back-to-back warm-up calls for `warmup_s` first bring the
    clocks up from idle."""
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
            torch.cuda._sleep(_SLEEP_CYCLES)
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


def device_copy(nbytes: int = 2 << 30) -> tuple[Callable[[], object], int]:
    """A device-to-device copy and the bytes it moves (read + write): the ceiling the
    bandwidth percentages refer to."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * nbytes


def fresh_compile(fn: Callable) -> Callable:
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


def progress(iterable, total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience; the numbers don't need it
        return iterable
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, leave=False)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
