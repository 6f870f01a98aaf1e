"""Shared helpers: fresh seeds, heavy-tailed inputs, float64 references, tolerances."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import gc
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import fusedloss
from fusedloss import build, formulas, functional, losses, routing

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="session")
def cxx_autograd(tmp_path_factory):
    """The optional C++ autograd (csrc/cxx_autograd.cpp), compiled with the host compiler
    for this torch where it is not cached; its operators."""
    if shutil.which(os.environ.get("CXX") or "c++") is None:
        pytest.skip("no host C++ compiler")
    if not build.cxx_autograd_loaded():
        previous = os.environ.get("TORCH_EXTENSIONS_DIR")
        os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path_factory.mktemp("extensions"))
        try:
            assert build.load_cxx_autograd(build_if_missing=True), "the C++ autograd did not compile"
        finally:
            if previous is None:
                del os.environ["TORCH_EXTENSIONS_DIR"]
            else:
                os.environ["TORCH_EXTENSIONS_DIR"] = previous
    return torch.ops.fusedloss_cxx


@pytest.fixture
def gpu_to_itself():
    """One test of GPU-filling size at a time across pytest-xdist's workers (KernelBench's
    2^30-element problems, operands past FUSED_GRADIENT_FROM_BYTES with their float64
    references): several side by side need more memory than one GPU has. The worker hands
    its cached blocks back before the next one starts."""
    with open(Path(tempfile.gettempdir()) / "fusedloss-large-gpu-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            gc.collect()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DTYPE_PAIRS = [(a, b) for a in FLOAT_DTYPES for b in FLOAT_DTYPES]

# (rtol, atol) against a float64 reference, by the dtype the loss is returned in.
TOLERANCE = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (2e-6, 1e-6),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}



def _reference(row: losses.Loss):
    """PyTorch's function for the loss, or for fusedloss's own losses the formula as the
    unfused route computes it (the dtype autocast would give, PyTorch's reduction errors)."""
    if row.torch_function is not None:
        return row.torch_function

    def reference(input, target, reduction="mean", **kwargs):
        param = kwargs.pop(row.param, row.param_default) if row.param else 0.0
        assert not kwargs, kwargs
        return functional._unfused(row, input, target, None, None, reduction, param)

    return reference


# name -> (fusedloss function, PyTorch's function or the formula, parameter keyword), from the table of losses
LOSSES = {name: (getattr(fusedloss, row.function), _reference(row), row.param) for name, row in losses.LOSSES.items()}
# the losses PyTorch has: for PyTorch's own arguments (size_average, reduce), samples and errors
TORCH_LOSSES = [name for name, row in losses.LOSSES.items() if row.pytorch]
# a value of each loss's number that takes every branch on heavy-tailed values (0 where it has none)
PARAMS = {name: 0.75 * row.param_default if row.param else 0.0 for name, row in losses.LOSSES.items()}


# the rule that hands a step to PyTorch where its step is the faster; the suite tests
# fusedloss's own kernels and autograd on every step, and this rule in tests of its own
PYTORCH_SERVES_THE_STEP = routing.pytorch_serves_the_step


@pytest.fixture(autouse=True)
def fused_steps(monkeypatch):
    """Every step through fusedloss's kernels, unless a test takes the rule back
    (monkeypatch routing.pytorch_serves_the_step with PYTORCH_SERVES_THE_STEP)."""
    monkeypatch.setattr(routing, "pytorch_serves_the_step", lambda *args: False)


def cpu_through_operators(set_attribute=setattr) -> None:
    """Route CPU tensors through the fused path: argument handling, then the fusedloss:: ops'
    CPU reference kernels, as CUDA tensors go through them to the CUDA kernels (and, as on
    CUDA, not under torch.compile or a torch.func transform, where torch operations run).
    Also for the ranks that distributed tests spawn."""
    from fusedloss import build

    set_attribute(build, "load", lambda *families: {})
    set_attribute(
        routing,
        "kernels_apply",
        lambda input, target: input.device == target.device
        and input.dtype in routing.KERNEL_DTYPES
        and target.dtype in routing.KERNEL_DTYPES
        and not torch.compiler.is_compiling()
        and not routing.under_a_transform(),
    )


@pytest.fixture
def fused_cpu(monkeypatch):
    """cpu_through_operators for one test."""
    cpu_through_operators(monkeypatch.setattr)


@pytest.fixture(params=["cpu", "fused-cpu", pytest.param("cuda", marks=requires_cuda)])
def device(request):
    """"cpu" through fusedloss's CPU route (torch operations), "fused-cpu" through its
    operators' CPU kernels, or "cuda" through the kernels (an error if they cannot load,
    never a silent fallback to torch)."""
    if request.param == "cuda":
        from fusedloss import build

        build.load()
        return "cuda"
    if request.param == "fused-cpu":
        request.getfixturevalue("fused_cpu")
    return "cpu"


@pytest.fixture(scope="session")
def pytorch_test_db():
    """(op_db, module_db) from torch.testing._internal, or a skip that says why not."""
    pytest.importorskip("expecttest", reason="torch.testing._internal imports expecttest (pip install expecttest)")
    import hypothesis

    get_profile = getattr(hypothesis.settings, "get_current_profile_name", None)
    profile = get_profile() if get_profile else hypothesis.settings._current_profile
    # common_utils freezes torch.backends' flags and loads a hypothesis profile when
    # imported; this context puts the flags back, the finally the profile.
    allow_flags = getattr(torch.backends, "__allow_nonbracketed_mutation")
    try:
        with allow_flags():
            from torch.testing._internal.common_methods_invocations import op_db
            from torch.testing._internal.common_modules import module_db
    except Exception as error:  # the reason is what the skip reports
        pytest.skip(f"torch.testing._internal cannot be imported: {error!r}")
    finally:
        hypothesis.settings.load_profile(profile)
    return op_db, module_db


@pytest.fixture(autouse=True)
def forgotten_grad_outputs():
    """Each test starts with no note of earlier backwards (fusedloss.grad_output_prediction):
    every forward that writes the gradient expects a grad_output of 1."""
    from fusedloss import grad_output_prediction

    if grad_output_prediction._history and torch.cuda.is_available():
        torch.cuda.synchronize()  # no kernel may still be writing a note
    for history in grad_output_prediction._history.values():
        history[:] = [1.0, 0.0] * (len(history) // 2)  # grad_output 1, not mispredicted


@pytest.fixture(autouse=True)
def fresh_seed():
    """A new seed every run; printed so a failure can be replayed."""
    seed = secrets.randbits(31)
    torch.manual_seed(seed)
    print(f"torch seed = {seed}")
    return seed


def warm_up_for_capture(step, *args, steps: int = 3) -> None:
    """`step(*args)` a few times on a side stream, then joined to the current one: the
    warm-up CUDA graph capture asks for."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(steps):
            step(*args)
    torch.cuda.current_stream().wait_stream(side)


def heavy_tailed(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Symmetric Pareto-like values: about 3/4 within (-1, 1), the rest out to ~1e3,
    so both branches of Smooth L1 and Huber are taken."""
    u = torch.rand(shape, dtype=torch.float64, device=device).clamp_min(1e-6)
    sign = torch.randint(0, 2, shape, device=device) * 2 - 1
    return ((u.pow(-0.5) - 1) * sign).to(dtype)


@contextlib.contextmanager
def process_group(rank: int, world: int, init_file: str, device: str = "cpu"):
    """A spawned rank's process group: gloo on the CPU, NCCL with one card per rank. A rank
    that waits on a collective longer than two minutes fails rather than hangs, and at the
    end the ranks meet before any tears the group down.

    A rank whose body finished leaves at once, with its results written: gloo's worker
    threads can release a finished collective's tensors after the interpreter has begun to
    shut down, and taking the GIL then aborts the process (torch's teardown race, not the
    test's). A rank that raised unwinds as usual, so spawn reports its error."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
    # as fused_steps in the main process: every step through fusedloss's kernels, unless a
    # worker takes the rule back (PYTORCH_SERVES_THE_STEP)
    routing.pytorch_serves_the_step = lambda *args: False
    dist.init_process_group("gloo" if device == "cpu" else "nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        yield
    finally:
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def broadcast_warning(name: str, input, target):
    """PyTorch's warning for a target of another shape, where the loss's row gives it."""
    if input.shape != target.shape and losses.LOSSES[name].warns_on_broadcast:
        return pytest.warns(UserWarning, match="target size")
    return contextlib.nullcontext()


def loss_kwargs(name: str, param: float) -> dict:
    keyword = LOSSES[name][2]
    return {} if keyword is None else {keyword: param}


def as_computed(name: str, input, target):
    """The target as PyTorch's kernels use it: on CUDA, a loss that keeps the input's dtype
    (Huber) converts the target to it (its CPU kernel computes in the promoted dtype)."""
    return target.to(input.dtype) if losses.LOSSES[name].keeps_input_dtype and input.is_cuda else target


def as_seen_by_gradient(name: str, input, target, of_input: bool):
    """(input, target) as PyTorch's CUDA kernels see them when they compute the gradient
    of the input (`of_input`) or of the target. Smooth L1's backward converts the other
    operand to that gradient's dtype. The others are differentiated as computed: Huber in
    the input's dtype, the rest in the promoted one (PyTorch's MSE and Huber backward
    reject mixed dtypes; L1's gradient is composed by autograd). The CPU kernels use the
    promoted dtype."""
    row = losses.LOSSES[name]
    if not input.is_cuda or not (row.keeps_input_dtype or row.gradient_in_own_dtype):
        return input, target
    if row.keeps_input_dtype or of_input:
        return input, target.to(input.dtype)
    return input.to(target.dtype), target


def float64_reference(name: str, input, target, reduction: str, param: float | None = None) -> torch.Tensor:
    """PyTorch's own formula (or fusedloss's, for its own losses) evaluated in float64."""
    row = losses.LOSSES[name]
    param = row.param_default if param is None else param
    loss_id = row.param_zero_is if param == 0 and row.param_zero_is else name
    target = as_computed(name, input, target)
    return formulas.torch_loss(input.double(), target.double(), loss_id, param, reduction)


def assert_close_to_reference(actual, expected64, dtype):
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected64.cpu(), rtol=rtol, atol=atol, equal_nan=True)


def pytest_terminal_summary(terminalreporter):
    """Skips as a few lines, one per reason with its count, instead of one per test location."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("skipped, by reason")
        for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
            terminalreporter.line(f"{count:6d}  {reason}")
