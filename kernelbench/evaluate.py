"""A local KernelBench evaluator for ModelNew files, stricter than KernelBench's own.

- ``evaluate(ref, new)`` follows KernelBench's method (correctness on freshly
  seeded ``get_inputs()``, CUDA-event timing with an L2 flush before each
  trial) and adds what KernelBench does not check: that ModelNew leaves its
  inputs untouched, that it reads every element (a single perturbed element must
  move its output as it moves the reference's), and, with ``inputs="heavy"``,
  inputs whose differences reach both branches of Smooth L1 / Huber.
- ``static_check(source)`` rejects what KernelBench's static checker rejects.

It needs only torch, not fusedloss.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

# KernelBench's fp32 tolerances.
ATOL = 1e-4
RTOL = 1e-4
WARMUP_CALLS = 3
BASE_SEED = 42
# Single-element perturbations per evaluation, each at its own seeded position.
PERTURBATIONS = 2
# A perturbation must move the reference output by this many tolerances, so a
# ModelNew that misses the element cannot pass by luck.
PERTURBATION_MARGIN = 100.0
# Writing 256 MB evicts the whole L2 (50 MB on an H100) before each timed call.
L2_FLUSH_INT32S = 64 * 1024 * 1024
HEAVY_TAIL_ALPHA = 3.0
INPUT_MODES = ("rand", "heavy")


# ---- static checks (KernelBench's strict set) ---------------------------------------

_FORBIDDEN: tuple[tuple[str, str], ...] = (
    (r"\btry\s*:|\bexcept\s*:|\bexcept\s+\w", "try/except block (a fallback can hide a failing kernel)"),
    (r"\bpass\b", "'pass' statement (an empty subclass runs the reference)"),
    (
        r"\bimport\s+(threading|multiprocessing)\b|\bfrom\s+(threading|multiprocessing)\s+import\b"
        r"|threading\.Thread\s*\(|multiprocessing\.(Process|Pool|Manager|Queue|Pipe)\b"
        r"|concurrent\.futures|ThreadPoolExecutor|ProcessPoolExecutor",
        "threading or multiprocessing (work can run outside the timed region)",
    ),
    (
        r"torch\.cuda\.(Event|synchronize)(\.\w+)?\s*=(?!=)|\btime\.\w+\s*=(?!=)"
        r"|\bsetattr\s*\(\s*(torch\.cuda|time)\b",
        "reassigns a timing function",
    ),
    (
        r"_make_subclass|class\s+\w+.*\((torch\.)?Tensor\)|torch\.Tensor\.__new__",
        "tensor subclass (a lazy tensor can defer the work past the timer)",
    ),
)
_REQUIRED: tuple[tuple[str, str], ...] = (
    (r"__global__", "no __global__ kernel"),
    (r"load_inline", "no load_inline compilation"),
    (
        r"\b(threadIdx|blockIdx|blockDim|gridDim)\.|__syncthreads\s*\(|__shared__\s|__device__\s|atomic(Add|Max|Min)\s*\(",
        "no CUDA thread indexing or device code",
    ),
)


def _strip_comments(source: str) -> str:
    # KernelBench's rule: drop each line from its first '#' and its first '//'.
    lines = []
    for line in source.split("\n"):
        line = line.split("#", 1)[0]
        lines.append(line.split("//", 1)[0])
    return "\n".join(lines)


def static_check(source: str) -> list[str]:
    """Violations of KernelBench's strict static checks in a ModelNew file's ``source`` (empty when it passes).

    Like KernelBench, the patterns apply to the whole file with comments
    stripped, string literals (CUDA sources, docstrings) included.
    """
    code = _strip_comments(source)
    violations = [message for pattern, message in _FORBIDDEN if re.search(pattern, code)]
    violations += [message for pattern, message in _REQUIRED if not re.search(pattern, code)]
    return violations


# ---- inputs ---------------------------------------------------------------------------


def heavy_tailed_inputs(
    shape: Sequence[int],
    *,
    alpha: float = HEAVY_TAIL_ALPHA,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> list[Tensor]:
    """Predictions and targets of ``shape`` (fp32), each a signed Lomax (Pareto II) with scale 1.

    ``P(|x| > 1) = 2**-alpha``, so about a quarter of the differences exceed 1
    and Smooth L1's linear branch is hit as often as its quadratic one. fp32
    uniforms bound the tail at ``2**(24 / alpha)``, which keeps the losses
    finite and their fp32 reference sums accurate to well within the tolerance.
    They are drawn on ``device`` (at KernelBench's size a GPU draws them in
    milliseconds, the CPU in seconds), from ``generator`` or torch's seeded one.
    """
    return [_signed_lomax(shape, alpha, generator, torch.device(device)) for _ in range(2)]


def _signed_lomax(
    shape: Sequence[int], alpha: float, generator: torch.Generator | None, device: torch.device
) -> Tensor:
    # In place throughout: at KernelBench's size each temporary is 4 GB.
    magnitude = torch.rand(shape, generator=generator, device=device).neg_().add_(1).pow_(-1.0 / alpha).sub_(1)
    signs = torch.randint(0, 2, shape, generator=generator, device=device, dtype=torch.float32).mul_(2).sub_(1)
    return magnitude.mul_(signs)


def problem_shape(module: ModuleType) -> tuple[int, ...]:
    """The operands' shape, ``(batch_size, *input_shape)``, of a loaded problem file."""
    return (module.batch_size, *module.input_shape)


# ---- evaluation -----------------------------------------------------------------------


@dataclass(frozen=True)
class TimingStats:
    """CUDA-event times of one callable, in milliseconds (std as numpy's, over the population)."""

    mean_ms: float
    std_ms: float
    min_ms: float
    max_ms: float
    trials: int

    @classmethod
    def from_samples(cls, samples: Sequence[float]) -> TimingStats:
        """Summarise per-call times in milliseconds."""
        return cls(statistics.fmean(samples), statistics.pstdev(samples), min(samples), max(samples), len(samples))


@dataclass
class EvalResult:
    """The outcome of ``evaluate``: a verdict, what failed and why, and the timings.

    ``failed_check`` is one of ``static``, ``load``, ``runtime``, ``output``
    (wrong shape, dtype or device), ``correctness``, ``in_place`` and
    ``perturbation``; None when the evaluation passed. ``timings`` maps
    ``ModelNew``, ``eager`` and ``torch.compile`` to their times.
    """

    problem: str
    inputs: str
    trials: int
    passed: bool = False
    failed_check: str | None = None
    reason: str = ""
    correct_trials: int = 0
    max_abs_diff: float = 0.0
    timings: dict[str, TimingStats] = field(default_factory=dict)

    def speedup(self, baseline: str, of: str = "ModelNew") -> float:
        """How many times faster ``of`` ran than ``baseline`` (``eager`` or ``torch.compile``)."""
        return self.timings[baseline].mean_ms / self.timings[of].mean_ms

    def verdict(self) -> str:
        """One line: PASS or FAIL, and why."""
        where = f"{self.problem} [{self.inputs} inputs]"
        if not self.passed:
            return f"FAIL {where}: {self.failed_check}: {self.reason}"
        return (
            f"PASS {where}: {self.correct_trials}/{self.trials} trials match (max |diff| {self.max_abs_diff:.2e}), "
            f"inputs left unchanged, {PERTURBATIONS} single-element perturbations followed"
        )

    def table(self) -> str:
        """The timings, one row per callable, with speedups over eager and over torch.compile."""
        lines = [f"{'':14}{'mean ms':>9}{'std':>8}{'min':>8}{'max':>8}{'vs eager':>10}{'vs compile':>12}"]
        for name, t in self.timings.items():
            lines.append(
                f"{name:14}{t.mean_ms:9.3f}{t.std_ms:8.3f}{t.min_ms:8.3f}{t.max_ms:8.3f}"
                f"{self.speedup('eager', name):9.2f}x{self.speedup('torch.compile', name):11.2f}x"
            )
        return "\n".join(lines)


class _Rejected(Exception):
    """ModelNew failed a check; carries the check's name and the reason."""

    def __init__(self, check: str, reason: str) -> None:
        super().__init__(reason)
        self.check = check
        self.reason = reason


_module_ids = itertools.count()


def load_module(path: str | Path) -> ModuleType:
    """Run a problem or ModelNew file as a new module (a fresh one on every call)."""
    name = f"_kernelbench_{next(_module_ids)}_" + re.sub(r"\W", "_", Path(path).stem)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # Registered so that torch.compile can find the module of the code it traces.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _set_seed(seed: int) -> None:
    torch.manual_seed(seed)  # seeds the CPU and every CUDA generator


def _on(device: torch.device, tensors: list[Tensor]) -> list[Tensor]:
    return [t.to(device) if isinstance(t, Tensor) else t for t in tensors]


def _call_new(model_new: torch.nn.Module, args: list[Tensor]) -> Tensor:
    """ModelNew's output, after checking that the call left every input as it found it."""
    before = [a.clone() if isinstance(a, Tensor) else a for a in args]
    try:
        out = model_new(*args)
    except Exception as error:
        raise _Rejected("runtime", f"ModelNew raised {type(error).__name__}: {error}") from error
    for index, (arg, saved) in enumerate(zip(args, before)):
        if isinstance(arg, Tensor) and not torch.equal(arg, saved):
            raise _Rejected("in_place", f"ModelNew changed input {index} in place")
    return out


def _compare(expected: Tensor, actual: object, check: str, where: str) -> float:
    """Max |difference|, after rejecting an output of the wrong kind or one outside KernelBench's tolerance."""
    if not isinstance(actual, Tensor):
        raise _Rejected("output", f"{where}: ModelNew returned {type(actual).__name__}, not a tensor")
    if actual.shape != expected.shape:
        raise _Rejected("output", f"{where}: output shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype or actual.device != expected.device:
        raise _Rejected(
            "output",
            f"{where}: output is {actual.dtype} on {actual.device}, expected {expected.dtype} on {expected.device}",
        )
    diff = float((actual - expected).abs().max()) if expected.numel() else 0.0
    if not torch.allclose(expected, actual, atol=ATOL, rtol=RTOL):
        raise _Rejected(
            check,
            f"{where}: output differs from the reference by up to {diff:.3g} "
            f"(reference {_brief(expected)}, ModelNew {_brief(actual)})",
        )
    return diff


def _brief(t: Tensor) -> str:
    return f"{t.item():.6g}" if t.numel() == 1 else f"shape {tuple(t.shape)}"


def _reference(model: torch.nn.Module, args: list[Tensor]) -> Tensor:
    out = model(*args)
    if not torch.isfinite(out).all():
        raise RuntimeError("the reference output is not finite: these inputs cannot judge ModelNew")
    return out


def _moves_enough(before: Tensor, after: Tensor) -> bool:
    return bool(((after - before).abs() >= PERTURBATION_MARGIN * (ATOL + RTOL * after.abs())).any())


def _check_perturbations(
    model: torch.nn.Module, model_new: torch.nn.Module, make_inputs: Callable[[], list[Tensor]], device: torch.device, seed: int
) -> None:
    """Perturb single elements of the predictions; ModelNew must follow the reference each time.

    Each perturbation grows (doubling) until the reference output moves by
    ``PERTURBATION_MARGIN`` tolerances, so a ModelNew that reads only part of
    its input (a subsample that passes on i.i.d. data) cannot match it.
    """
    _set_seed(seed)
    args = _on(device, make_inputs())
    flat = args[0].view(-1)  # the predictions; get_inputs returns contiguous tensors
    baseline = _reference(model, args)
    positions = torch.randint(flat.numel(), (PERTURBATIONS,), generator=torch.Generator().manual_seed(seed))
    for position in positions.tolist():
        original = float(flat[position])
        delta = 1.0 + float(flat.abs().max())
        while True:
            flat[position] = original + delta
            expected = model(*args)
            if not torch.isfinite(expected).all():
                raise RuntimeError("no finite perturbation moves the reference output measurably")
            if _moves_enough(baseline, expected):
                break
            delta *= 2
        where = f"predictions[{position}] += {delta:.3g}"
        _compare(expected, _call_new(model_new, args), "perturbation", where)
        flat[position] = original


def time_cuda(fn: Callable[..., object], args: Sequence[object], *, trials: int, device: torch.device) -> TimingStats:
    """KernelBench's timing: warm-up calls, then per call an L2 flush and CUDA events around the call alone."""
    flush = torch.empty(L2_FLUSH_INT32S, dtype=torch.int32, device=device)
    for _ in range(WARMUP_CALLS):
        fn(*args)
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(trials):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize(device)
        samples.append(start.elapsed_time(end))
    return TimingStats.from_samples(samples)


def _patch_size(modules: Sequence[ModuleType], size: Sequence[int]) -> None:
    for module in modules:
        if hasattr(module, "batch_size"):
            module.batch_size, module.input_shape = size[0], tuple(size[1:])


def _run(
    result: EvalResult,
    ref_path: Path,
    new_path: Path,
    *,
    trials: int,
    timing_trials: int,
    device: torch.device,
    check_static: bool,
    size: Sequence[int] | None,
    seed: int,
) -> None:
    """Fills ``result`` in; raises _Rejected at the first check ModelNew fails. Each stage's
    end goes to stderr with the seconds so far, so a run cut short still says how far it got
    (a build, and the full-size inputs drawn on the CPU, take minutes)."""
    start = time.perf_counter()

    def progress(stage: str) -> None:
        print(f"[{result.problem} {result.inputs}] {stage} at {time.perf_counter() - start:.0f} s", file=sys.stderr,
              flush=True)

    if check_static and (violations := static_check(new_path.read_text())):
        raise _Rejected("static", "; ".join(violations))
    reference = load_module(ref_path)
    try:
        new = load_module(new_path)
    except Exception as error:
        raise _Rejected("load", f"{type(error).__name__}: {error}") from error
    if size is not None:
        _patch_size((reference, new), size)
    if result.inputs == "rand":
        make_inputs = reference.get_inputs
    else:
        make_inputs = functools.partial(heavy_tailed_inputs, problem_shape(reference), device=device)

    init_inputs = reference.get_init_inputs()
    _set_seed(seed)
    model = reference.Model(*init_inputs).to(device)
    _set_seed(seed)
    try:
        model_new = new.ModelNew(*init_inputs).to(device)
    except Exception as error:
        raise _Rejected("load", f"ModelNew(): {type(error).__name__}: {error}") from error
    progress("ModelNew built")

    # As KernelBench: one seed per trial, drawn from the base seed; a trial's inputs come from that seed.
    _set_seed(seed)
    trial_seeds = [int(torch.randint(0, 2**32 - 1, (1,))) for _ in range(trials)]
    for number, trial_seed in enumerate(trial_seeds, 1):
        _set_seed(trial_seed)
        args = _on(device, make_inputs())
        expected = _reference(model, args)
        diff = _compare(expected, _call_new(model_new, args), "correctness", f"trial {number} (seed {trial_seed})")
        result.max_abs_diff = max(result.max_abs_diff, diff)
        result.correct_trials += 1
        progress(f"correctness trial {number}")
    _check_perturbations(model, model_new, make_inputs, device, seed)
    progress("perturbation check")

    if timing_trials:
        _set_seed(seed)
        args = _on(device, make_inputs())
        for name, callable_ in (("ModelNew", model_new), ("eager", model), ("torch.compile", torch.compile(model))):
            result.timings[name] = time_cuda(callable_, args, trials=timing_trials, device=device)
            progress(f"{name} timed")


def evaluate(
    ref_path: str | Path,
    new_path: str | Path,
    *,
    inputs: str = "rand",
    trials: int = 5,
    timing_trials: int = 100,
    device: str | torch.device | None = None,
    check_static: bool = True,
    size: Sequence[int] | None = None,
    seed: int = BASE_SEED,
) -> EvalResult:
    """Judge the ModelNew file ``new_path`` against the reference problem ``ref_path``, as KernelBench does, and more.

    In order: ``static_check`` of the file (unless ``check_static`` is False);
    ``trials`` correctness trials, each on inputs from a fresh seed (the
    reference's ``get_inputs()``, or ``heavy_tailed_inputs`` when ``inputs`` is
    ``"heavy"``), compared with ``torch.allclose(atol=1e-4, rtol=1e-4)``; on
    every ModelNew call, a check that its inputs are unchanged; then the
    single-element perturbation check; then, if ``timing_trials`` > 0, the
    timing of ModelNew, the eager Model and ``torch.compile(Model)`` on the same
    inputs. ``size``, ``(batch_size, *input_shape)``, replaces the problem's
    size (for small runs, on the CPU too when ``timing_trials`` is 0).
    Prints the verdict and, when timed, the table.
    """
    ref_path, new_path = Path(ref_path), Path(new_path)
    device = torch.device(device if device is not None else "cuda")
    if inputs not in INPUT_MODES:
        raise ValueError(f"inputs must be one of {INPUT_MODES}, got {inputs!r}")
    if timing_trials and device.type != "cuda":
        raise ValueError("timing needs a CUDA device; pass timing_trials=0 to check correctness alone")
    result = EvalResult(problem=new_path.name, inputs=inputs, trials=trials)
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    try:
        with on_device, torch.no_grad():
            _run(
                result,
                ref_path,
                new_path,
                trials=trials,
                timing_trials=timing_trials,
                device=device,
                check_static=check_static,
                size=size,
                seed=seed,
            )
        result.passed = True
    except _Rejected as rejection:
        result.failed_check, result.reason = rejection.check, rejection.reason
    print(result.verdict())
    if result.timings:
        print(result.table())
    return result
