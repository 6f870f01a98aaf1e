"""Weighted losses (``weight=``, ``scale=``, pseudo-Huber): the part of ``python -m fusedloss
bench`` that runs after the training-loop rows (``--only-weighted`` runs it alone,
``--no-weighted`` skips it).

Every row is a training step (``p.grad = None; loss.backward()``; the input is a leaf that
requires grad, the target, weight, mask and c do not) of fusedloss next to the plain PyTorch a
user writes today, eager and under ``torch.compile`` (that loss function compiled,
dynamic=False): median device time (CUDA events, the systems taking turns call by call after
warm-up, as timing.time_side_by_side times the step rows). Bytes count what the fused step must
move: read input + read target + write grad_input, each in its own dtype; the weight, mask and
c broadcast from a sample, a channel or a row and are not counted. TB/s is those bytes over
the fused device time; %copy refers to a 2 GiB device-to-device copy timed in the same row.
Weights and masks are float32 for bfloat16 operands too, as a loss weight or a mask made with
``.float()`` usually is, so the loss is float32 (promote(loss dtype, weight dtype)).

1. Weighted MSE, GraphCast style: pred/target (1, 227, 721, 1440) (227 variables on the 0.25°
   grid, 2^27.8 elements), float32 and bfloat16; weight = per variable (1, C, 1, 1) x cos(lat)
   per row (1, 1, H, 1) = (1, C, H, 1).
   read input + read target + write grad_input.
     user:  (F.mse_loss(p, t, reduction="none") * w).mean()
     fused: fusedloss.mse_loss(p, t, weight=w, reduction="sum", scale=1 / p.numel())
2. Masked MSE, as masked pretraining (MAE) writes it: a (B, T, D) = (32, 4096, 256) series
   (2^25 elements), float32 and bfloat16, and (32, 4096, 1024) = 2^27 elements, float32; a
   0/1 token mask (B, T) of random lengths T/2..T; the count is computed inside every step.
   read input + read target + write grad_input.
     user:  (F.mse_loss(p, t, reduction="none").mean(dim=-1) * mask).sum() / mask.sum()
     fused: fusedloss.mse_loss(p, t, weight=mask[..., None], reduction="sum",
                               scale=1 / (mask.sum() * D))
   and, float32, fusedloss's own weighted mean, which divides by the mask's sum as it lies
   (the same value): fusedloss.mse_loss(p, t, weight=mask[..., None]). Wall time too.
3. Per-sample-weighted diffusion MSE: bfloat16 latents (B, 4, 128, 128), B = 16, 32, 64, 128
   (2^20 .. 2^23 elements), a weight per sample w (B,). These sizes are bound by the host, so
   the row also gives host wall time per step of back-to-back steps (training.wall_us,
   what a training loop feels); the target is fused wall <= eager's and <= compile's.
   read input + read target + write grad_input.
     user:  (F.mse_loss(p.float(), t.float(), reduction="none").mean(dim=(1, 2, 3)) * w).mean()
     fused: fusedloss.mse_loss(p, t, weight=w.view(B, 1, 1, 1), reduction="sum", scale=1 / p.numel())
4. Pseudo-Huber, c = 0.1: (64, 4, 1024, 1024) = 2^28 elements, float32 and bfloat16; and a
   per-sample float32 c (B, 1, 1, 1) in [0.05, 0.5) at (64, 4, 128, 128) = 2^22 bfloat16, with
   wall time too.
   read input + read target + write grad_input.
     user:  (2 * c * (torch.sqrt((p.float() - t.float()) ** 2 + c * c) - c)).mean()
     fused: fusedloss.pseudo_huber_loss(p, t, c=c)

5. Spatially masked diffusion MSE: bfloat16 latents (32, 16, 256, 256) = 2^25 elements, a
   float32 0/1 mask (B, 1, H, W) shared by the channels, read where it lies.
   read input + read target + write grad_input.
     user:  (F.mse_loss(p.float(), t.float(), reduction="none") * mask).mean()
     fused: fusedloss.mse_loss(p, t, weight=mask, reduction="sum", scale=1 / p.numel())
6. A learned weight (it requires grad; the step also resets and writes its gradient), at
   (32, 16, 256, 256) = 2^25 elements: a float32 weight per channel (1, C, 1, 1) for bfloat16
   operands, and a float32 weight of the loss's own size for float32 operands (PyTorch's own
   weighted mean, torch >= 2.6).
   read input + read target + write grad_input, + write the weight's gradient per element in
   the loss's dtype (float32) for the weight of the loss's size (the per-channel weight's
   comes from the loss's sums per row, which the forward's pass takes).
     user:  (F.mse_loss(p, t, reduction="none") * w).mean(), or F.mse_loss(p, t, weight=w)
     fused: fusedloss.mse_loss(p, t, weight=w, reduction="sum", scale=1 / p.numel()), or
            fusedloss.mse_loss(p, t, weight=w)

Each row also checks fusedloss and compile against eager: the loss (relative difference) and
d loss / d input (norm of the difference over the norm of eager's), flagged MISMATCH beyond
1e-2 (16-bit operands) or 1e-4 (float32); and the peak memory a step allocates. A system that
raises records its error and NaN times, so the others are still measured. weighted.txt and
weighted.csv (one line per row, dtype, size and system) are rewritten after every row, so a run
cut off by a time limit keeps what it measured.
Ratios f/e, f/c are fusedloss's time over eager's, over torch.compile's: below 1, fusedloss is faster.
"""

from __future__ import annotations

import csv
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import fusedloss

from .timing import dtype_name, fresh_compile, device_copy, peak_memory_gib, seed_inputs, time_side_by_side
from .training import Report, wall_us

SYSTEMS = ("fused", "eager", "compile")
DTYPES = (torch.float32, torch.bfloat16)
GRAPHCAST_SHAPE = (1, 227, 721, 1440)
MASKED_SHAPE = (32, 4096, 256)
MASKED_LARGE_SHAPE = (32, 4096, 1024)
DIFFUSION_BATCHES = (16, 32, 64, 128)
LATENT = (4, 128, 128)
PSEUDO_HUBER_SHAPE = (64, 4, 1024, 1024)
PSEUDO_HUBER_C = 0.1
PSEUDO_HUBER_TENSOR_C_SHAPE = (64, 4, 128, 128)
SPATIAL_MASK_SHAPE = (32, 16, 256, 256)
LEARNED_WEIGHT_SHAPE = (32, 16, 256, 256)
SECTIONS = {
    "graphcast": "1. Weighted MSE, weight (1, C, H, 1) = per variable x cos(lat) per row (GraphCast): "
                 "user (F.mse_loss(p, t, reduction='none') * w).mean(); "
                 "fused mse_loss(p, t, weight=w, reduction='sum', scale=1 / p.numel())",
    "masked": "2. Masked MSE (MAE), float32 0/1 token mask (B, T), count inside the step: "
              "user (F.mse_loss(p, t, reduction='none').mean(dim=-1) * mask).sum() / mask.sum(); "
              "fused mse_loss(p, t, weight=mask[..., None], reduction='sum', scale=1 / (mask.sum() * D)); "
              "'weight=mask mean': fused mse_loss(p, t, weight=mask[..., None]), the same value",
    "diffusion": "3. Per-sample-weighted diffusion MSE, bf16 latents, float32 w (B,): "
                 "user (F.mse_loss(p.float(), t.float(), reduction='none').mean(dim=(1, 2, 3)) * w).mean(); "
                 "fused mse_loss(p, t, weight=w.view(B, 1, 1, 1), reduction='sum', scale=1 / p.numel()); "
                 "target: fused wall <= eager and <= compile",
    "pseudo_huber": "4. Pseudo-Huber: user (2 * c * (torch.sqrt((p.float() - t.float()) ** 2 + c * c) - c)).mean(); "
                    "fused pseudo_huber_loss(p, t, c=c); c = 0.1, or a float32 c (B, 1, 1, 1) per sample",
    "spatial": "5. Spatially masked diffusion MSE, bf16 latents, float32 0/1 mask (B, 1, H, W): "
               "user (F.mse_loss(p.float(), t.float(), reduction='none') * mask).mean(); "
               "fused mse_loss(p, t, weight=mask, reduction='sum', scale=1 / p.numel())",
    "learned": "6. A learned float32 weight (requires grad): per channel (1, C, 1, 1), bf16 operands, user "
               "(F.mse_loss(p, t, reduction='none') * w).mean(), fused mse_loss(p, t, weight=w, reduction='sum', "
               "scale=1 / p.numel()); of the loss's size, fp32, user F.mse_loss(p, t, weight=w), fused "
               "mse_loss(p, t, weight=w). GB adds the weight's gradient where it is per element (float32, written); "
               "per channel it comes from the loss's sums per row, which the forward takes",
}
CSV_FIELDS = ["section", "row", "dtype", "shape", "numel", "system", "device_ms", "wall_us",
              "fused_over_this_device", "fused_over_this_wall", "fused_step_bytes", "tbs", "copy_tbs", "pct_copy",
              "peak_gib", "loss_dtype", "loss_rel_diff_to_eager", "grad_rel_diff_to_eager", "error"]
Loss = Callable[[], Tensor]


def _step(leaves: tuple[Tensor, ...], loss: Loss) -> Callable[[], None]:
    def run() -> None:
        for leaf in leaves:
            leaf.grad = None  # as zero_grad(set_to_none=True)
        loss().backward()
    return run


def _grad_diff(grad: Tensor, reference: Tensor) -> float:
    """|grad - reference| / |reference|, Euclidean norms in float32."""
    reference = reference.float()
    return (torch.linalg.vector_norm(grad.float() - reference) / torch.linalg.vector_norm(reference)).item()


def _check(p: Tensor, losses: dict[str, Loss], log: Callable[[str], None], label: str) -> tuple[dict, dict, dict, dict]:
    """One step of each system, eager first: its loss and gradient are the reference. This also
    compiles torch.compile's forward and backward before any clock runs. Returns the systems that
    ran, their losses, their gradients' relative differences to eager's, and the errors."""
    live, values, grad_diffs, errors = {}, {}, {}, {}
    reference = None
    for name in ("eager", "fused", "compile"):
        p.grad = None
        try:
            value = losses[name]()
            value.backward()
        except Exception as error:  # noqa: BLE001 - any failure is a result to record
            errors[name] = f"{type(error).__name__}: {str(error)[:300]}"
            log(f"    {label} {name} failed: {errors[name]}")
            continue
        live[name], values[name] = losses[name], value.detach()
        if name == "eager":
            reference = p.grad
        elif reference is not None:
            grad_diffs[name] = _grad_diff(p.grad, reference)
    p.grad = None
    return live, values, grad_diffs, errors


def measure(section: str, label: str, p: Tensor, t: Tensor, losses: dict[str, Loss], *, wall: bool = False,
            reps: int = 20, log: Callable[[str], None] = print, learned: Tensor | None = None,
            extra_bytes: int = 0) -> dict:
    """Device time (and with `wall`, host wall time) of a step of each system on the leaf `p`
    (and the `learned` weight, whose gradient each step resets too; `extra_bytes` counts
    what its gradient moves)."""
    p.requires_grad_(True)
    live, values, grad_diffs, errors = _check(p, losses, log, label)
    leaves = (p,) if learned is None else (p, learned)
    steps = {name: _step(leaves, loss) for name, loss in live.items()}
    copy, copy_bytes = device_copy()
    ms = time_side_by_side({**steps, "copy": copy}, reps)
    del copy
    # Longer than the latency table's defaults: these steps are a handful of launches each, and a
    # host clock still ramping up reads as noise of tens of µs.
    walls = wall_us(steps, reps=9, min_s=0.05, warmup_s=0.5) if wall and steps else {}
    peaks = {}
    for name, run in steps.items():
        for leaf in leaves:
            leaf.grad = None  # the step's own gradient counts towards its peak
        peaks[name] = peak_memory_gib(run)
    for leaf in leaves:
        leaf.grad = None
    reference = values.get("eager")
    loss_diffs = {name: abs(value.double().item() / reference.double().item() - 1)
                  for name, value in values.items() if reference is not None and name != "eager"}
    return {
        "section": section, "label": label, "dtype": dtype_name(p.dtype), "shape": tuple(p.shape), "numel": p.numel(),
        "bytes": p.numel() * (2 * p.element_size() + t.element_size()) + extra_bytes,
        "ms": {name: ms.get(name, math.nan) for name in SYSTEMS}, "copy_tbs": copy_bytes / ms["copy"] / 1e9,
        "wall_us": {name: walls.get(name, math.nan) for name in SYSTEMS}, "wall": wall,
        "peak_gib": {name: peaks.get(name, math.nan) for name in SYSTEMS},
        "loss_dtype": {name: dtype_name(value.dtype) for name, value in values.items()},
        "loss_diff": loss_diffs, "grad_diff": grad_diffs, "errors": errors,
        "tolerance": 1e-2 if p.element_size() < 4 else 1e-4,
    }


# ---- the rows ----------------------------------------------------------------------------


def graphcast_row(dtype: torch.dtype, shape: tuple[int, ...] = GRAPHCAST_SHAPE, log: Callable = print) -> dict:
    torch.manual_seed(0)
    _, channels, rows, _ = shape
    p, t = seed_inputs(shape, dtype, "cuda")
    w_channel = (torch.rand(channels, device="cuda") + 0.5).view(1, channels, 1, 1)
    lat = torch.linspace(-math.pi / 2, math.pi / 2, rows, device="cuda", dtype=torch.float64)
    w_row = (torch.cos(lat) / torch.cos(lat).mean()).float().view(1, 1, rows, 1)
    w = w_channel * w_row  # (1, C, H, 1)

    def user(p: Tensor, t: Tensor, w: Tensor) -> Tensor:
        return (F.mse_loss(p, t, reduction="none") * w).mean()

    compiled = fresh_compile(user)
    losses = {"fused": lambda: fusedloss.mse_loss(p, t, weight=w, reduction="sum", scale=1 / p.numel()),
              "eager": lambda: user(p, t, w), "compile": lambda: compiled(p, t, w)}
    return measure("graphcast", f"mse, w (1,C,H,1), {shape}", p, t, losses, reps=10, log=log)


def masked_row(dtype: torch.dtype, shape: tuple[int, ...] = MASKED_SHAPE, log: Callable = print,
               builtin_mean: bool = False) -> dict:
    """With `builtin_mean`, fusedloss's own weighted mean (`weight=mask`, reduction='mean'),
    which divides by the mask's sum as it lies, against the same user code."""
    torch.manual_seed(0)
    batch, steps, features = shape
    p, t = seed_inputs(shape, dtype, "cuda")
    lengths = torch.randint(steps // 2, steps + 1, (batch, 1), device="cuda")
    mask = (torch.arange(steps, device="cuda") < lengths).float()  # (B, T)

    def user(p: Tensor, t: Tensor, mask: Tensor) -> Tensor:
        return (F.mse_loss(p, t, reduction="none").mean(dim=-1) * mask).sum() / mask.sum()

    compiled = fresh_compile(user)
    if builtin_mean:
        fused, label = (lambda: fusedloss.mse_loss(p, t, weight=mask[..., None])), f"mse, weight=mask mean, {shape}"
    else:
        fused, label = (lambda: fusedloss.mse_loss(p, t, weight=mask[..., None], reduction="sum",
                                                   scale=1 / (mask.sum() * features))), f"mse, mask (B,T), {shape}"
    losses = {"fused": fused, "eager": lambda: user(p, t, mask), "compile": lambda: compiled(p, t, mask)}
    return measure("masked", label, p, t, losses, wall=True, log=log)


def diffusion_row(batch: int, dtype: torch.dtype = torch.bfloat16, log: Callable = print) -> dict:
    torch.manual_seed(0)
    shape = (batch, *LATENT)
    p, t = seed_inputs(shape, dtype, "cuda")
    w = torch.rand(batch, device="cuda") + 0.1  # (B,), e.g. min-SNR weights

    def user(p: Tensor, t: Tensor, w: Tensor) -> Tensor:
        return (F.mse_loss(p.float(), t.float(), reduction="none").mean(dim=(1, 2, 3)) * w).mean()

    compiled = fresh_compile(user)
    losses = {"fused": lambda: fusedloss.mse_loss(p, t, weight=w.view(batch, 1, 1, 1), reduction="sum",
                                                  scale=1 / p.numel()),
              "eager": lambda: user(p, t, w), "compile": lambda: compiled(p, t, w)}
    return measure("diffusion", f"mse, w (B,), {shape}", p, t, losses, wall=True, log=log)


def _user_pseudo_huber(p: Tensor, t: Tensor, c: float | Tensor) -> Tensor:
    return (2 * c * (torch.sqrt((p.float() - t.float()) ** 2 + c * c) - c)).mean()


def pseudo_huber_row(dtype: torch.dtype, shape: tuple[int, ...] = PSEUDO_HUBER_SHAPE,
                     c: float = PSEUDO_HUBER_C, log: Callable = print) -> dict:
    torch.manual_seed(0)
    p, t = seed_inputs(shape, dtype, "cuda")
    def user(p: Tensor, t: Tensor) -> Tensor:
        return _user_pseudo_huber(p, t, c)

    compiled = fresh_compile(user)
    losses = {"fused": lambda: fusedloss.pseudo_huber_loss(p, t, c=c),
              "eager": lambda: _user_pseudo_huber(p, t, c), "compile": lambda: compiled(p, t)}
    return measure("pseudo_huber", f"pseudo-huber c={c:g}, {shape}", p, t, losses, reps=10, log=log)


def pseudo_huber_tensor_c_row(dtype: torch.dtype = torch.bfloat16, shape: tuple[int, ...] = PSEUDO_HUBER_TENSOR_C_SHAPE,
                              log: Callable = print) -> dict:
    torch.manual_seed(0)
    batch = shape[0]
    p, t = seed_inputs(shape, dtype, "cuda")
    c = (0.05 + 0.45 * torch.rand(batch, device="cuda")).view(batch, 1, 1, 1)  # kohya's per-sample c
    compiled = fresh_compile(_user_pseudo_huber)
    losses = {"fused": lambda: fusedloss.pseudo_huber_loss(p, t, c=c),
              "eager": lambda: _user_pseudo_huber(p, t, c), "compile": lambda: compiled(p, t, c)}
    return measure("pseudo_huber", f"pseudo-huber c (B,1,1,1), {shape}", p, t, losses, wall=True, log=log)


def spatial_mask_row(dtype: torch.dtype = torch.bfloat16, shape: tuple[int, ...] = SPATIAL_MASK_SHAPE,
                     log: Callable = print) -> dict:
    torch.manual_seed(0)
    batch, _, height, width = shape
    p, t = seed_inputs(shape, dtype, "cuda")
    mask = (torch.rand(batch, 1, height, width, device="cuda") < 0.7).float()

    def user(p: Tensor, t: Tensor, mask: Tensor) -> Tensor:
        return (F.mse_loss(p.float(), t.float(), reduction="none") * mask).mean()

    compiled = fresh_compile(user)
    losses = {"fused": lambda: fusedloss.mse_loss(p, t, weight=mask, reduction="sum", scale=1 / p.numel()),
              "eager": lambda: user(p, t, mask), "compile": lambda: compiled(p, t, mask)}
    return measure("spatial", f"mse, mask (B,1,H,W), {shape}", p, t, losses, reps=10, log=log)


def learned_weight_row(dtype: torch.dtype, shape: tuple[int, ...] = LEARNED_WEIGHT_SHAPE,
                       log: Callable = print) -> dict:
    """bfloat16: a per-channel weight; float32: a weight of the loss's own size."""
    torch.manual_seed(0)
    p, t = seed_inputs(shape, dtype, "cuda")
    per_channel = dtype != torch.float32
    w_shape = (1, shape[1], 1, 1) if per_channel else shape
    w = (torch.rand(w_shape, device="cuda") + 0.5).requires_grad_()
    if per_channel:
        def user(p: Tensor, t: Tensor, w: Tensor) -> Tensor:
            return (F.mse_loss(p, t, reduction="none") * w).mean()

        def fused() -> Tensor:
            return fusedloss.mse_loss(p, t, weight=w, reduction="sum", scale=1 / p.numel())
        extra, label = 0, f"mse, learned w (1,C,1,1), {shape}"
    else:
        def user(p: Tensor, t: Tensor, w: Tensor) -> Tensor:
            return F.mse_loss(p, t, weight=w)

        def fused() -> Tensor:
            return fusedloss.mse_loss(p, t, weight=w)
        extra, label = p.numel() * 4, f"mse, learned w of its size, {shape}"
    compiled = fresh_compile(user)
    losses = {"fused": fused, "eager": lambda: user(p, t, w), "compile": lambda: compiled(p, t, w)}
    return measure("learned", label, p, t, losses, reps=10, log=log, learned=w, extra_bytes=extra)


def jobs(log: Callable[[str], None] = print) -> list[tuple[str, Callable[[], dict]]]:
    """(section, row) in the order they run; each row allocates its tensors and frees them on return."""
    return ([("graphcast", functools.partial(graphcast_row, dtype, log=log)) for dtype in DTYPES]
            + [("masked", functools.partial(masked_row, dtype, log=log)) for dtype in DTYPES]
            + [("masked", functools.partial(masked_row, torch.float32, log=log, builtin_mean=True))]
            + [("masked", functools.partial(masked_row, torch.float32, MASKED_LARGE_SHAPE, log=log))]
            + [("diffusion", functools.partial(diffusion_row, batch, log=log)) for batch in DIFFUSION_BATCHES]
            + [("pseudo_huber", functools.partial(pseudo_huber_row, dtype, log=log)) for dtype in DTYPES]
            + [("pseudo_huber", functools.partial(pseudo_huber_tensor_c_row, log=log))]
            + [("spatial", functools.partial(spatial_mask_row, log=log))]
            + [("learned", functools.partial(learned_weight_row, dtype, log=log)) for dtype in (torch.bfloat16,
                                                                                                  torch.float32)])


# ---- output --------------------------------------------------------------------------------


HEADER = (f"{'row':44} {'dtype':8} {'GB':>5} {'fused ms':>9} {'eager ms':>9} {'compile ms':>10} {'f/e':>5} "
          f"{'f/c':>5} {'TB/s':>5} {'copy':>5} {'%copy':>6} | {'wall µs f':>9} {'e':>8} {'c':>8} {'f/e':>5} "
          f"{'f/c':>5} | {'peak GiB f/e/c':>14} | note")


def _note(row: dict) -> str:
    dtypes = "/".join(row["loss_dtype"].get(s, "-") for s in SYSTEMS)
    loss = " ".join(f"{s[0]} {row['loss_diff'][s]:.1e}" for s in ("fused", "compile") if s in row["loss_diff"])
    grad = " ".join(f"{s[0]} {row['grad_diff'][s]:.1e}" for s in ("fused", "compile") if s in row["grad_diff"])
    diffs = list(row["loss_diff"].values()) + list(row["grad_diff"].values())
    worst = max(diffs, default=math.nan)
    verdict = "no check" if math.isnan(worst) else ("ok" if worst <= row["tolerance"] else "MISMATCH")
    note = f"loss dtype f/e/c {dtypes}; vs eager: loss {loss or '-'}, grad {grad or '-'} ({verdict})"
    if row["wall"]:
        w = row["wall_us"]
        met = w["fused"] <= w["eager"] and w["fused"] <= w["compile"]
        note += f"; wall target {'met' if met else 'MISSED'}"
    if row["errors"]:
        note += "; FAILED: " + ", ".join(row["errors"])
    return note


def format_row(row: dict) -> str:
    ms, wall, peak = row["ms"], row["wall_us"], row["peak_gib"]
    tbs = row["bytes"] / ms["fused"] / 1e9
    walls = (f"{'':9} {'':8} {'':8} {'':5} {'':5}" if not row["wall"] else
             f"{wall['fused']:9.1f} {wall['eager']:8.1f} {wall['compile']:8.1f} "
             f"{wall['fused'] / wall['eager']:5.2f} {wall['fused'] / wall['compile']:5.2f}")
    peaks = f"{peak['fused']:.1f}/{peak['eager']:.1f}/{peak['compile']:.1f}"
    return (f"{row['label']:44} {row['dtype']:8} {row['bytes'] / 1e9:5.2f} {ms['fused']:9.3f} {ms['eager']:9.3f} "
            f"{ms['compile']:10.3f} {ms['fused'] / ms['eager']:5.2f} {ms['fused'] / ms['compile']:5.2f} "
            f"{tbs:5.2f} {row['copy_tbs']:5.2f} {100 * tbs / row['copy_tbs']:5.1f}% | {walls} | {peaks:>14} | "
            f"{_note(row)}")


def csv_lines(row: dict) -> list[dict]:
    """One line per system of a row."""
    lines = []
    for system in SYSTEMS:
        ms, wall = row["ms"][system], row["wall_us"][system]
        tbs = row["bytes"] / ms / 1e9
        lines.append({
            "section": row["section"], "row": row["label"], "dtype": row["dtype"],
            "shape": "x".join(map(str, row["shape"])), "numel": row["numel"], "system": system,
            "device_ms": f"{ms:.5f}", "wall_us": f"{wall:.2f}",
            "fused_over_this_device": f"{row['ms']['fused'] / ms:.4f}",
            "fused_over_this_wall": f"{row['wall_us']['fused'] / wall:.4f}",
            "fused_step_bytes": row["bytes"], "tbs": f"{tbs:.4f}", "copy_tbs": f"{row['copy_tbs']:.4f}",
            "pct_copy": f"{100 * tbs / row['copy_tbs']:.2f}", "peak_gib": f"{row['peak_gib'][system]:.3f}",
            "loss_dtype": row["loss_dtype"].get(system, ""),
            "loss_rel_diff_to_eager": "" if system not in row["loss_diff"] else f"{row['loss_diff'][system]:.3e}",
            "grad_rel_diff_to_eager": "" if system not in row["grad_diff"] else f"{row['grad_diff'][system]:.3e}",
            "error": row["errors"].get(system, ""),
        })
    return lines


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerows(csv_lines(row))


def run_all(out_dir: Path) -> None:
    """All rows, printed and written to out_dir: weighted.txt and weighted.csv, after every row."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir / "weighted.txt")
    report(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}, CUDA {torch.version.cuda}")
    report("Weighted losses, training step (forward + backward, input requires grad): device time, median of "
           "repeats after warm-up; wall = host clock per step of back-to-back steps (rows 3 and 4b)")
    report("ratios f/e, f/c: fusedloss time / eager's, / torch.compile's; below 1, fusedloss is faster")
    report("GB: the fused step's bytes, read input + read target + write grad_input (weights, masks and c not "
           "counted); TB/s: GB / fused device time; %copy: of a 2 GiB device-to-device copy timed in the same row")
    report.save()
    rows: list[dict] = []
    section = None
    start = time.perf_counter()
    for row_section, job in jobs(report):
        if row_section != section:
            section = row_section
            report(f"\n{SECTIONS[section]}")
            report(HEADER)
        try:
            row = job()
        except Exception as error:  # noqa: BLE001 - a row that cannot run (say out of memory) ends only itself
            report(f"    {job.func.__name__}{job.args} failed: {type(error).__name__}: {str(error)[:300]}")
            continue
        finally:
            torch.cuda.empty_cache()
        rows.append(row)
        report(format_row(row))
        report.save()
        write_csv(rows, out_dir / "weighted.csv")
    report(f"\nweighted rows took {time.perf_counter() - start:.0f} s")
    report.save()
    print(f"weighted rows written to {out_dir / 'weighted.txt'} and {out_dir / 'weighted.csv'}")
