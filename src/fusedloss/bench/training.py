"""What a training loop feels: the part of ``python -m fusedloss bench`` that runs after
its 2^30 rows (``--only-latency`` runs it alone, ``--no-latency`` skips it).

- Latency table (MSE, float32 and bfloat16, N = 2^7 .. 2^30, one 1-D leaf input):
  host wall time per call of back-to-back calls with one synchronize at the end, the
  larger of host and GPU time, as a loop feels it, for a training step
  (``p.grad = None; fn(p, t).backward()``) and for a forward under ``torch.no_grad()``;
  and the GPU time of the step captured in a CUDA graph, with the host taken away.
  latency.csv's ``step_bytes`` counts read input + read target + write grad_input.
- AMP rows (bf16 input, bf16 or float32 target, bf16 autocast, N = 2^26), the
  ``loss / 4`` row (bf16, N = 2^28) and the rows of ``reduction='none'`` then a sum or a
  mean over the non-batch dimensions (float32 and bf16, 2^26): device time of a step; TB/s counts read input +
  read target + write grad_input in the operands' own dtypes, so autocast's float32
  copies are traffic each system adds as it chooses. %copy refers to a 2 GiB
  device-to-device copy timed in the same row.
- Rows for the losses beyond MSE (other_losses.py): the quantile, log-cosh, Gaussian
  and Poisson NLL losses, per-sample means over ``dim`` and tensor parameters, each
  against the formula users write or F's loss.
- Model rows: a small conv net + MSE compiled whole (fullgraph=True) with F.mse_loss
  and with fusedloss.mse_loss, and eager F: device time of forward + backward; no
  bytes counted, as the convolutions move most of them. A second compilation of the
  F model, timed in the same turns, shows how far one graph differs from itself.
Ratios are fusedloss's time over the other system's: below 1, fusedloss is faster.
"""

from __future__ import annotations

import csv
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fusedloss

from . import other_losses
from .timing import (dtype_name, fresh_compile, progress, device_copy, seed_inputs, time_side_by_side,
                    turn_order)

LATENCY_EXPONENTS = (7, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
SYSTEMS = ("fused", "eager", "compile")
LATENCY_FIELDS = ["n", "dtype", "step_bytes"] + [
    f"{kind}_{system}" for kind in ("step_wall_us", "fwd_wall_us", "graph_us") for system in SYSTEMS]
Step = Callable[[], object]
Log = Callable[[str], None]


class Report:
    """Lines printed as they come and kept for training.txt, which is rewritten after every
    section so that a run cut off by a time limit still leaves what it measured."""

    def __init__(self, path: Path) -> None:
        self.path, self.lines = path, []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def save(self) -> None:
        self.path.write_text("\n".join(self.lines) + "\n", encoding="utf-8")


def _step(fn: Callable[[Tensor, Tensor], Tensor], p: Tensor, t: Tensor, divide_by: float = 1.0) -> Step:
    def run() -> None:
        p.grad = None  # as zero_grad(set_to_none=True)
        loss = fn(p, t)
        (loss if divide_by == 1.0 else loss / divide_by).backward()
    return run


def _autocast(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """`fn` under bf16 autocast; compiling this keeps the autocast region inside the graph."""
    def under_autocast(*args: Tensor) -> Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fn(*args)
    return under_autocast


def _wall_s(fn: Step, calls: int) -> float:
    """Seconds per call of `calls` back-to-back calls, synchronized only at the ends."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def wall_us(calls: dict[str, Step], reps: int = 7, min_s: float = 0.02, min_calls: int = 20,
            warmup_s: float = 0.1) -> dict[str, float]:
    """Median host wall time per call, in µs. Each measurement runs back-to-back calls for
    >= `min_s` and >= `min_calls` calls; the systems take turns measurement by measurement,
    so drift weighs on them alike, in rotating order."""
    for fn in calls.values():  # compiles, if it must, before the warm-up clock starts
        fn()
    deadline, rounds = time.perf_counter() + warmup_s, 0
    while rounds < 3 or time.perf_counter() < deadline:  # also brings the clocks up from idle
        for fn in calls.values():
            fn()
        torch.cuda.synchronize()
        rounds += 1
    counts = {name: max(min_calls, math.ceil(min_s / _wall_s(fn, 3))) for name, fn in calls.items()}
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(reps):
        for name in turn_order(calls, rep):
            samples[name].append(_wall_s(calls[name], counts[name]) * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def capture(step: Step, log: Log = print) -> torch.cuda.CUDAGraph | None:
    """`step` captured as PyTorch's CUDA-graph docs do it (warm-up on a side stream, grads set
    to None before capture so backward allocates them in the graph's pool), or None when
    capture fails: that system gets NaN rather than ending the run."""
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - any failure is a result to record
        log(f"    CUDA graph capture failed: {type(error).__name__}: {str(error)[:300]}")
        return None
    return graph


def graph_us(graphs: dict[str, torch.cuda.CUDAGraph | None], reps: int = 11,
             min_us: float = 20_000) -> dict[str, float]:
    """Median GPU time of one replay, in µs: a batch of replays (>= `min_us`, 3..100) between
    two events, the systems taking turns batch by batch in rotating order. A GPU sleep
    before each batch lets the host queue the whole batch, so the events time the GPU
    rather than the launches."""
    live = {name: graph for name, graph in graphs.items() if graph is not None}
    # Host-bound small graphs read slow here, which only caps them at 100.
    batch = {name: max(3, min(100, math.ceil(min_us / (_wall_s(graph.replay, 3) * 1e6))))
             for name, graph in live.items()}
    events: dict[str, list] = {name: [] for name in live}
    for rep in range(reps):
        for name in turn_order(live, rep):
            graph = live[name]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(50_000 * batch[name])  # ~25 µs per queued replay at ~2 GHz
            start.record()
            for _ in range(batch[name]):
                graph.replay()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) * 1e3 / batch[name] for s, e in events[name])
            if name in live else math.nan for name in graphs}


def _ratios(times: dict[str, float]) -> str:
    f, e, c = (times[s] for s in SYSTEMS)
    return f"{f:9.1f} {e:9.1f} {c:9.1f} {f / e:5.2f} {f / c:5.2f}"


def latency_table(out_dir: Path, exponents: Iterable[int] = LATENCY_EXPONENTS,
                  dtypes: Iterable[torch.dtype] = (torch.float32, torch.bfloat16), log: Log = print) -> list[dict]:
    """MSE at each size: step and no-grad forward wall time, and graph replay time of the
    step, for fusedloss, eager F.mse_loss and torch.compile(F.mse_loss); latency.csv."""
    torch.manual_seed(0)
    columns = f"{'fused':>9} {'eager':>9} {'compile':>9} {'f/e':>5} {'f/c':>5}"
    log(f"{'':20} | {'step (grad), wall µs':^41} | {'forward, no_grad, wall µs':^41} | {'step, CUDA graph µs':^41}")
    log(f"{'N':>11} {'dtype':8} | {columns} | {columns} | {columns}")
    rows = []
    jobs = [(dtype, exponent) for dtype in dtypes for exponent in exponents]
    for dtype, exponent in progress(jobs, len(jobs), "latency"):
        n = 2**exponent
        p, t = seed_inputs((n,), dtype, "cuda")
        p.requires_grad_(True)
        systems = {"fused": fusedloss.mse_loss, "eager": F.mse_loss, "compile": fresh_compile(F.mse_loss)}
        steps = {name: _step(fn, p, t) for name, fn in systems.items()}
        step_us = wall_us(steps)
        with torch.no_grad():
            fwd_us = wall_us({name: functools.partial(fn, p, t) for name, fn in systems.items()})
        graphs = {name: capture(step, log) for name, step in steps.items()}
        replay_us = graph_us(graphs)
        p.grad = None
        # The graphs go before the next size's dynamo reset can unload the kernels they launch.
        del graphs, steps, systems
        row = {"n": n, "dtype": dtype_name(dtype), "step_bytes": n * (2 * p.element_size() + t.element_size())}
        for kind, times in (("step_wall_us", step_us), ("fwd_wall_us", fwd_us), ("graph_us", replay_us)):
            row.update({f"{kind}_{system}": times[system] for system in SYSTEMS})
        rows.append(row)
        log(f"{n:11d} {row['dtype']:8} | {_ratios(step_us)} | {_ratios(fwd_us)} | {_ratios(replay_us)}")
        write_latency_csv(rows, out_dir / "latency.csv")
        del p, t
        torch.cuda.empty_cache()
    return rows


def write_latency_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=LATENCY_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def plot_latency(csv_path: Path, png_path: Path, title: str = "") -> None:
    """Step wall time (solid) and the step's graph replay time (dashed) against N, log-log,
    one panel per dtype, from latency.csv."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    dtypes = list(dict.fromkeys(row["dtype"] for row in rows))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.8), squeeze=False, sharey=True)
    labels = {"fused": "fusedloss", "eager": "eager F.mse_loss", "compile": "torch.compile(F.mse_loss)"}
    for ax, dtype in zip(axes[0], dtypes):
        mine = [row for row in rows if row["dtype"] == dtype]
        n = [int(row["n"]) for row in mine]
        for system, color in zip(SYSTEMS, ("C0", "C1", "C2")):
            ax.plot(n, [float(row[f"step_wall_us_{system}"]) for row in mine], marker="o", color=color,
                    label=f"{labels[system]}: step, wall")
            ax.plot(n, [float(row[f"graph_us_{system}"]) for row in mine], marker=".", linestyle="--",
                    color=color, label=f"{labels[system]}: step, CUDA graph")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel=f"N ({dtype} elements per input)", title=f"MSE training step, {dtype}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("time per step (µs, median)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def _device_row(label: str, steps: dict[str, Step | None], nbytes: int | None, note: str = "",
                reps: int = 20) -> dict:
    """Device time of each system's step (time_side_by_side), NaN for a system that failed;
    steps other than SYSTEMS' are timed in the same turns, under "others"."""
    live = {name: step for name, step in steps.items() if step is not None}
    if nbytes:
        copy, copy_bytes = device_copy()
        live["copy"] = copy
    ms = time_side_by_side(live, reps=reps)
    times = {system: ms.get(system, math.nan) for system in SYSTEMS}
    tbs = (nbytes / times["fused"] / 1e9, copy_bytes / ms["copy"] / 1e9) if nbytes else (math.nan, math.nan)
    others = {name: ms.get(name, math.nan) for name in steps if name not in SYSTEMS}
    return {"label": label, **times, "tbs": tbs[0], "copy_tbs": tbs[1], "note": note, "others": others}


def _loss_note(values: dict[str, Tensor]) -> str:
    """The losses' dtypes, and each one's relative difference from eager PyTorch's."""
    reference = values.get("eager")
    dtypes = "/".join(dtype_name(values[s].dtype) if s in values else "-" for s in SYSTEMS)
    same = reference is not None and all(value.dtype == reference.dtype for value in values.values())
    diffs = "/".join(f"{abs(values[s].double().item() / reference.double().item() - 1):.1e}"
                     if s in values and reference is not None else "-" for s in SYSTEMS)
    return f"loss dtype f/e/c {dtypes} ({'as PyTorch' if same else 'DIFFERS'}); rel diff to eager {diffs}"


def _format_device(rows: list[dict]) -> str:
    lines = [(f"{'row':48} {'fused ms':>9} {'eager ms':>9} {'compile ms':>10} {'f/e':>5} {'f/c':>5} "
              f"{'TB/s':>5} {'%copy':>6}  note")]
    for r in rows:
        bandwidth = f"{'':5} {'':6}" if math.isnan(r["tbs"]) else f"{r['tbs']:5.2f} {100 * r['tbs'] / r['copy_tbs']:5.1f}%"
        lines.append(f"{r['label']:48} {r['fused']:9.3f} {r['eager']:9.3f} {r['compile']:10.3f} "
                     f"{r['fused'] / r['eager']:5.2f} {r['fused'] / r['compile']:5.2f} {bandwidth}  {r['note']}")
    return "\n".join(lines)


def _loss_row(label: str, fused: Callable, eager: Callable, p: Tensor, t: Tensor, divide_by: float = 1.0,
              wrap: Callable[[Callable], Callable] = lambda fn: fn) -> dict:
    """Device time of a step of fusedloss, eager and compiled eager on a leaf `p` and `t`."""
    p.requires_grad_(True)
    systems = {"fused": wrap(fused), "eager": wrap(eager), "compile": fresh_compile(wrap(eager))}
    values = {name: fn(p, t).detach() for name, fn in systems.items()}
    steps = {name: _step(fn, p, t, divide_by) for name, fn in systems.items()}
    row = _device_row(label, steps, p.numel() * (2 * p.element_size() + t.element_size()), _loss_note(values))
    p.grad = None
    torch.cuda.empty_cache()
    return row


def amp_rows(n: int = 2**26) -> list[dict]:
    """A step under bf16 autocast, bf16 leaf input, bf16 or float32 target, MSE and Huber."""
    torch.manual_seed(0)
    rows = []
    for loss, fused, eager in (("mse", fusedloss.mse_loss, F.mse_loss), ("huber", fusedloss.huber_loss, F.huber_loss)):
        for target_dtype in (torch.bfloat16, torch.float32):
            p, t = seed_inputs((n,), torch.bfloat16, "cuda")
            label = f"{loss} autocast bf16, target {dtype_name(target_dtype)}, 2^{n.bit_length() - 1}"
            rows.append(_loss_row(label, fused, eager, p, t.to(target_dtype), wrap=_autocast))
    return rows


def quarter_loss_row(n: int = 2**28) -> dict:
    """``(loss / 4).backward()``: grad_output != 1, bf16 MSE."""
    torch.manual_seed(0)
    p, t = seed_inputs((n,), torch.bfloat16, "cuda")
    label = f"mse bf16 2^{n.bit_length() - 1}, (loss / 4).backward()"
    return _loss_row(label, fusedloss.mse_loss, F.mse_loss, p, t, divide_by=4.0)


def per_sample_rows(shape: tuple[int, ...] = (64, 16, 256, 256)) -> list[dict]:
    """``reduction='none'``, then a per-sample reduction over the non-batch dimensions: a sum
    (a VAE's reconstruction loss; backward hands the loss a grad_output expanded over them)
    and a mean weighed per sample (diffusion trainers; a mean's backward writes a grad_output
    of the loss's size)."""
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        p, t = seed_inputs(shape, dtype, "cuda")
        w = torch.rand(shape[0], device="cuda", dtype=dtype)

        def summed(mse: Callable[..., Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
            return lambda a, b: mse(a, b, reduction="none").sum(dim=(1, 2, 3)).mean()

        def averaged(mse: Callable[..., Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
            return lambda a, b: (mse(a, b, reduction="none").mean(dim=(1, 2, 3)) * w).mean()

        for label, written_with in (("sum(1, 2, 3).mean()", summed), ("(mean(1, 2, 3) * w).mean()", averaged)):
            rows.append(_loss_row(f"mse none, {label}, {dtype_name(dtype)}", written_with(fusedloss.mse_loss),
                                  written_with(F.mse_loss), p, t))
    return rows


def case_row(case: other_losses.Case, wall: bool = False) -> dict:
    """A step of fusedloss, eager and compiled eager: device time with TB/s and %copy, or
    wall time (ms) for a step small enough that the host sets its pace."""
    systems = {"fused": case.fused, "eager": case.eager, "compile": fresh_compile(case.eager)}
    values = {name: fn(case.p, case.t).detach() for name, fn in systems.items()}
    steps = {name: _step(fn, case.p, case.t) for name, fn in systems.items()}
    if wall:
        times = {name: us / 1e3 for name, us in wall_us(steps).items()}
        row = {"label": case.label + " (wall)", **times, "tbs": math.nan, "copy_tbs": math.nan,
               "note": _loss_note(values), "others": {}}
    else:
        row = _device_row(case.label, steps, case.nbytes, _loss_note(values))
    case.p.grad = None
    torch.cuda.empty_cache()
    return row


def other_loss_rows() -> list[dict]:
    """The quantile, log-cosh, Gaussian and Poisson NLL losses, dim= and tensor parameters."""
    torch.manual_seed(0)
    small = other_losses.quantile_cases() + other_losses.elementwise_cases(2**20, torch.float32)
    small += other_losses.tensor_param_cases()
    rows = [case_row(case, wall=True) for case in progress(small, len(small), "small steps")]
    large = [other_losses.per_sample_case()] + other_losses.quantile_cases(shapes=((8192, 720),))
    large += other_losses.elementwise_cases(2**26, torch.float32) + other_losses.elementwise_cases(2**28, torch.bfloat16)
    rows += [case_row(case) for case in progress(large, len(large), "large steps")]
    return rows


def _model_loss(model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor],
                autocast: bool) -> Callable[[Tensor, Tensor], Tensor]:
    def model_loss(images: Tensor, labels: Tensor) -> Tensor:
        return loss_fn(model(images), labels)
    return _autocast(model_loss) if autocast else model_loss


def _model_step(model: nn.Module, fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, target: Tensor) -> Step:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        fn(x, target).backward()
    return run


def model_rows(batch: int = 32, log: Log = print) -> list[dict]:
    """Conv net + MSE, forward + backward: fused = torch.compile(fullgraph=True) with
    fusedloss.mse_loss, compile = the same with F.mse_loss, eager = F uncompiled. Under
    compile fusedloss hands inductor F's formula, so fused and compile run one graph
    (tests/test_cuda_autograd.py); a second compilation of F's model, timed in the same
    turns, gives the spread of that graph against itself, which the note reports."""
    rows = []
    for variant in ("float32", "bfloat16", "bf16 autocast"):
        torch.manual_seed(0)
        dtype = torch.bfloat16 if variant == "bfloat16" else torch.float32
        model = nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.SiLU(), nn.Conv2d(64, 16, 3, padding=1))
        model = model.to("cuda", dtype)
        x = torch.randn(batch, 16, 64, 64, device="cuda", dtype=dtype)
        target = torch.randn_like(x)
        autocast = variant == "bf16 autocast"
        torch._dynamo.reset()  # once per variant: a reset would drop both compiled systems' code
        systems: dict[str, Callable | None] = {
            "fused": torch.compile(_model_loss(model, fusedloss.mse_loss, autocast), fullgraph=True, dynamic=False),
            "eager": _model_loss(model, F.mse_loss, autocast),
            "compile": torch.compile(_model_loss(model, F.mse_loss, autocast), fullgraph=True, dynamic=False),
            "compile again": torch.compile(_model_loss(model, F.mse_loss, autocast), fullgraph=True, dynamic=False)}
        values = {}
        for name, fn in systems.items():
            try:  # fullgraph=True raises on a graph break
                values[name] = fn(x, target).detach()
            except Exception as error:  # noqa: BLE001 - any failure is a result to record
                log(f"    {variant} {name}: {type(error).__name__}: {str(error)[:300]}")
                systems[name] = None
        steps = {name: None if fn is None else _model_step(model, fn, x, target) for name, fn in systems.items()}
        values.pop("compile again", None)
        row = _device_row(f"conv net {tuple(x.shape)} + mse, {variant}", steps, None, _loss_note(values), reps=200)
        row["note"] += f"; compile again / compile {row['others']['compile again'] / row['compile']:.3f} (one graph)"
        rows.append(row)
    return rows


def run_all(out_dir: Path, exponents: Iterable[int] | None = None) -> None:
    """All of the above, printed and written to out_dir: training.txt, latency.csv, latency.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir / "training.txt")
    title = f"{torch.cuda.get_device_name()}; torch {torch.__version__}, CUDA {torch.version.cuda}"
    report(f"device: {title}")
    report("ratios f/e, f/c: fusedloss time / eager's, / torch.compile's; below 1, fusedloss is faster")
    report("\nLatency, MSE: wall = host clock over back-to-back calls (what a loop feels); "
           "graph = GPU time of the step replayed as a CUDA graph")
    latency_table(out_dir, LATENCY_EXPONENTS if exponents is None else exponents, log=report)
    report.save()
    try:
        plot_latency(out_dir / "latency.csv", out_dir / "latency.png", title)
        report(f"latency written to {out_dir / 'latency.csv'} and {out_dir / 'latency.png'}")
    except ImportError:  # matplotlib is in the bench extra; the CSV holds the numbers
        report(f"latency written to {out_dir / 'latency.csv'} (no matplotlib: no plot)")
    report("\nTraining steps, device time (CUDA events); AMP rows: fused/eager/compile all under autocast")
    report(_format_device(amp_rows() + [quarter_loss_row()] + per_sample_rows()))
    report.save()
    report("\nLosses beyond MSE, steps: device time (TB/s counts each operand read and the input's gradient "
           "written), or wall time where marked; eager is the formula users write, or F's loss")
    report(_format_device(other_loss_rows()))
    report.save()
    report("\nConv net + MSE, forward + backward, device time: fused = compiled whole (fullgraph=True) with "
           "fusedloss.mse_loss, compile = the same with F.mse_loss, eager = F uncompiled")
    report(_format_device(model_rows(log=report)))
    report.save()
    print(f"training rows written to {out_dir / 'training.txt'}")
