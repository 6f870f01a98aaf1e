"""The CUDA kernels against float64 references: layouts, sizes, values, determinism."""

from __future__ import annotations

import math

import pytest
import torch

from fusedloss import build, losses
from fusedloss.bench import timing

from conftest import (
    DTYPE_PAIRS,
    LOSSES,
    PARAMS,
    assert_close_to_reference,
    broadcast_warning,
    float64_reference,
    heavy_tailed,
    loss_kwargs,
    requires_cuda,
)

pytestmark = requires_cuda
REDUCTIONS = ("none", "mean", "sum")
# the losses with a number (beta, delta, c), whose value splits their two branches
WITH_PARAM = [name for name, row in losses.LOSSES.items() if row.param]
# the losses whose number 0 makes them another loss (Smooth L1 with beta = 0 is L1)
WITH_PARAM_ZERO = [name for name, row in losses.LOSSES.items() if row.param_zero_is]


@pytest.fixture(autouse=True)
def poisoned_allocator():
    """Fill the caching allocator's free memory with NaN so an unwritten output shows."""
    build.load()
    block = torch.empty(64 << 20, device="cuda")
    block.fill_(float("nan"))
    del block


def _values(shape, dtype):
    # fp16 overflows on squared heavy tails; keep its values where float64 agrees.
    values = heavy_tailed(shape, torch.float64, "cuda")
    return (values.clamp(-2, 2) if dtype == torch.float16 else values).to(dtype)


def _check(name, input, target, reduction, param=None):
    param = PARAMS[name] if param is None else param
    out = LOSSES[name][0](input, target, reduction=reduction, **loss_kwargs(name, param))
    expected = LOSSES[name][1](input, target, reduction=reduction, **loss_kwargs(name, param))
    assert out.dtype == expected.dtype and out.shape == expected.shape and out.device == input.device
    assert_close_to_reference(out, float64_reference(name, input, target, reduction, param), out.dtype)
    return out


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
def test_every_dtype_pair_against_float64(name, reduction, dtypes):
    n = 3 * 4099  # not a multiple of any vector width, several blocks
    _check(name, _values((n,), dtypes[0]), _values((n,), dtypes[1]), reduction)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("n", [1, 3, 7, 8, 9, 31, 1000, 4097, 65537, 1_000_003])
def test_odd_sizes(name, n):
    for reduction in REDUCTIONS:
        _check(name, _values((n,), torch.float32), _values((n,), torch.float32), reduction)
        _check(name, _values((n,), torch.bfloat16), _values((n,), torch.float32), reduction)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("offsets", [(1, 0), (0, 3), (2, 5), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_misaligned_storage_offsets(name, offsets, dtype):
    n = 10_007
    input = _values((n + 8,), dtype)[offsets[0] : offsets[0] + n]
    target = _values((n + 8,), dtype)[offsets[1] : offsets[1] + n]
    assert input.is_contiguous() and input.storage_offset() == offsets[0]
    for reduction in REDUCTIONS:
        _check(name, input, target, reduction)


@pytest.mark.parametrize("name", LOSSES)
def test_non_contiguous_and_broadcast_views(name):
    base = _values((96, 130), torch.float32)
    other = _values((130, 96), torch.float32)
    row = _values((130,), torch.float32)
    column = _values((96, 1), torch.bfloat16)
    cases = [
        (base, other.t()),  # transposed
        (base[:, ::2], other.t()[:, 1::2]),  # strided
        (base, row.expand(96, 130)),  # an expanded view
        (base, row),  # broadcast (warns, like PyTorch, where the loss's row says so)
        (base, column),  # broadcast, mixed dtype
        (base[5], _values((), torch.float32)),  # 0-d target
    ]
    for input, target in cases:
        for reduction in REDUCTIONS:
            with broadcast_warning(name, input, target):
                _check(name, input, target, reduction)


@pytest.mark.parametrize("name", WITH_PARAM)
@pytest.mark.parametrize("param", [1e-6, 0.3, 1.0, 7.5, 1e6])
def test_both_branches_are_taken(name, param):
    if not losses.LOSSES[name].param_valid(param):
        pytest.skip("outside the loss's domain (a quantile's is [0, 1])")
    input, target = _values((50_001,), torch.float32), _values((50_001,), torch.float32)
    d = (input - target).abs()
    assert (d < param).any() or param < 1e-3
    assert (d > param).any() or param > 1e3
    for reduction in REDUCTIONS:
        _check(name, input, target, reduction, param)


@pytest.mark.parametrize("name", WITH_PARAM_ZERO)
def test_param_zero_is_the_other_loss(name):
    """A number of 0 computes the loss the row names (Smooth L1's beta = 0 is L1), against
    that loss's float64 reference."""
    other = losses.LOSSES[name].param_zero_is
    input, target = _values((5000,), torch.float32), _values((5000,), torch.float32)
    for reduction in REDUCTIONS:
        out = _check(name, input, target, reduction, 0.0)
        assert_close_to_reference(out, float64_reference(other, input, target, reduction, PARAMS[other]), out.dtype)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_nan_and_inf(name, dtype):
    input = _values((4099,), dtype)
    target = _values((4099,), dtype)
    input[[3, 100, 4000]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype, device="cuda")
    target[[100, 7]] = torch.tensor([float("inf"), float("nan")], dtype=dtype, device="cuda")
    kwargs = loss_kwargs(name, PARAMS[name])
    for reduction in REDUCTIONS:
        out = LOSSES[name][0](input, target, reduction=reduction, **kwargs)
        expected = LOSSES[name][1](input, target, reduction=reduction, **kwargs)
        assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())
        assert torch.equal(out[out.isinf()], expected[expected.isinf()])
        assert_close_to_reference(out, float64_reference(name, input, target, reduction, PARAMS[name]), out.dtype)


@pytest.mark.parametrize("name", LOSSES)
def test_zero_dim_and_empty(name):
    for shape in [(), (0,), (3, 0, 2)]:
        for reduction in REDUCTIONS:
            _check(name, _values(shape, torch.float32), _values(shape, torch.float32), reduction)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [3_000_017, 40_000_003])  # fewer and more than 8192 tiles
def test_bitwise_deterministic(name, dtype, n):
    input, target = _values((n,), dtype), _values((n,), torch.float32)
    for reduction in ("mean", "sum", "none"):
        runs = [LOSSES[name][0](input, target, reduction=reduction).cpu().reshape(-1) for _ in range(10)]
        assert all(torch.equal(run.view(torch.uint8), runs[0].view(torch.uint8)) for run in runs)


# A tile holds at most this many elements, so values this far apart meet only in
# the sum over tiles.
TILE_SPACING = 8192


@pytest.mark.parametrize("dtype, exponents", [(torch.float32, (-74, 63)), (torch.float64, (-537, 500))])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("count", [300, 2100])  # fewer and more than 8192 tiles: both sizes of scratch
def test_sum_over_tiles_is_exact(dtype, exponents, reduction, count):
    """One value per tile, squares from subnormal to near overflow: the tiles' sum is
    exact, rounded once, so it equals math.fsum of the squares bit for bit (and
    then PyTorch's own rounding into the loss dtype)."""
    x = torch.zeros(count * TILE_SPACING, dtype=torch.float64)
    mantissas = 1 + torch.rand(count, dtype=torch.float64)
    x[::TILE_SPACING] = torch.ldexp(mantissas, torch.randint(*exponents, (count,)))
    x = x.to(dtype)
    squares = (x[::TILE_SPACING] * x[::TILE_SPACING]).tolist()  # the kernel's d * d, in dtype
    total = math.fsum(squares)
    expected = torch.tensor(total / x.numel() if reduction == "mean" else total, dtype=torch.float64).to(dtype)
    x = x.cuda()
    out = LOSSES["mse"][0](x, torch.zeros_like(x), reduction=reduction)
    assert out.cpu().reshape(1).view(torch.uint8).tolist() == expected.reshape(1).view(torch.uint8).tolist(), (
        out, expected)


def test_accuracy_at_2_to_30_elements():
    """Relative error against float64 at 2^30 fp32 elements is at most 1e-7."""
    p, t = timing.seed_inputs((2**15, 2**15), torch.float32, "cuda")
    for name in LOSSES:
        reference = timing.float64_loss(p, t, name, losses.LOSSES[name].param_default)  # the function's default
        assert timing.relative_error(LOSSES[name][0](p, t), reference) <= 1e-7


def test_more_than_2_to_31_elements():
    n = 2**31 + 11
    free, _ = torch.cuda.mem_get_info()
    if free < 4 * n * 2 + (2 << 30):
        pytest.skip("not enough device memory")
    p = torch.rand(n, device="cuda", dtype=torch.bfloat16)
    t = torch.rand(n, device="cuda", dtype=torch.bfloat16)
    p[-5:] = 7.0  # the end of the tensor must be read
    for name in ("mse", "huber"):
        reference = timing.float64_loss(p, t, name, 1.0)
        assert timing.relative_error(LOSSES[name][0](p, t, reduction="mean"), reference) < 8e-3
        assert timing.relative_error(LOSSES[name][0](p, t, reduction="sum"), reference * n) < 8e-3
    tail = LOSSES["mse"][0](p, t, reduction="none")[-7:]
    assert_close_to_reference(tail, float64_reference("mse", p[-7:], t[-7:], "none"), torch.bfloat16)


def test_runs_on_the_current_stream():
    input, target = _values((1 << 22,), torch.float32), _values((1 << 22,), torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # a long kernel ahead of ours on the side stream
        target.mul_(2)
        out = LOSSES["mse"][0](input, target)
    torch.cuda.current_stream().wait_stream(stream)
    assert_close_to_reference(out, float64_reference("mse", input, target, "mean"), torch.float32)


# Where a dtype's range is exceeded, the reference's own conversions decide the result.
# For every loss an fp16 difference can overflow (PyTorch's fp16 kernels, and the formula
# of fusedloss's own losses, hold it in fp16); PyTorch's losses add their own: Huber's
# target becomes the input's dtype, beta and delta become the loss's dtype.
# (name, input dtype, target dtype, param)
CONVERSION_CASES = [(name, torch.float16, torch.float16, PARAMS[name]) for name in LOSSES] + [
    ("huber", torch.float16, torch.float32, 1e6),  # delta and target 1e30 are inf in fp16: NaN
    ("huber", torch.float16, torch.float32, 0.5),
    ("huber", torch.bfloat16, torch.float16, 2.0),
    ("huber", torch.float32, torch.float64, 1.0),  # target 1e300 is inf in fp32
    ("huber", torch.float16, torch.float16, 1e6),
    ("smooth_l1", torch.float16, torch.float16, 1e6),  # beta is inf in fp16: the quadratic part is 0
    ("smooth_l1", torch.bfloat16, torch.bfloat16, 0.3),  # beta rounds to 0.30078125 in bf16
]


@pytest.mark.parametrize("name, input_dtype, target_dtype, param", CONVERSION_CASES, ids=str)
def test_dtype_conversions_follow_the_reference(name, input_dtype, target_dtype, param):
    big = {torch.float16: 60000.0, torch.bfloat16: 1e30, torch.float32: 1e30, torch.float64: 1e300}
    input = torch.tensor([0.0021, 1.0, -3.0, big[input_dtype], -big[input_dtype], 0.3, 0.29, 7.0, 0.0],
                         dtype=torch.float64)
    target = torch.tensor([big[target_dtype], 0.5, 1.0, -big[input_dtype], big[input_dtype], 0.0, 0.0, -1.0, 0.0],
                          dtype=torch.float64)
    input = input.to(input_dtype).cuda().requires_grad_()
    target = target.to(target_dtype).cuda()
    ours_fn, theirs_fn, _ = LOSSES[name]
    kwargs = loss_kwargs(name, param)
    ours, theirs = ours_fn(input, target, reduction="none", **kwargs), theirs_fn(input, target, reduction="none",
                                                                                 **kwargs)
    assert ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=4e-3, atol=1e-6)
    (ours_grad,) = torch.autograd.grad(ours.sum(), input)
    try:
        (theirs_grad,) = torch.autograd.grad(theirs.sum(), input)
    except RuntimeError as error:
        # PyTorch's Huber (and MSE) backward rejects mixed dtypes: "Found dtype ... but expected ..."
        if losses.LOSSES[name].pytorch and input_dtype != target_dtype and "Found dtype" in str(error):
            return
        raise
    torch.testing.assert_close(ours_grad, theirs_grad, equal_nan=True, rtol=4e-3, atol=1e-6)
