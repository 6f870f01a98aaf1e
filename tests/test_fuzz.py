"""Property-based comparison with torch.nn.functional (hypothesis).

Random shapes (0-d, empty, up to 5-D), views (transposed, strided, offset),
broadcasting, dtype pairs, reductions, the loss's number (beta, delta, c: 0,
tiny, huge, negative) and values with NaN and +-inf. Losses, both gradients,
warnings and errors must match PyTorch, or for fusedloss's own losses (every
row of the table of losses is fuzzed) the formula as the unfused route
computes it; a number outside an own loss's domain is a ValueError. On the
CPU the fused path runs through the operators' reference kernels (fixture
`fused_cpu`); with a GPU it runs the CUDA kernels.

FUSEDLOSS_FUZZ_EXAMPLES sets the number of examples per test (default 150).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from fusedloss import losses

from conftest import LOSSES, TOLERANCE, as_computed, requires_cuda

EXAMPLES = int(os.environ.get("FUSEDLOSS_FUZZ_EXAMPLES", "150"))
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-30, 1e30, float("nan"), float("inf"), -float("inf")]

fuzz_settings = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(params=["fused-cpu", pytest.param("cuda", marks=requires_cuda)])
def device(request):
    if request.param == "fused-cpu":
        request.getfixturevalue("fused_cpu")
        return "cpu"
    return request.param


@st.composite
def operands(draw):
    """An (input, target) pair: broadcast-compatible shapes, dtypes, values and views."""
    rank = draw(st.integers(0, 5))
    shape = [draw(st.integers(0, 3)) if draw(st.booleans()) else draw(st.integers(1, 7)) for _ in range(rank)]
    # The other operand drops leading dims and turns some sizes into 1: broadcasting.
    drop = draw(st.integers(0, rank))
    other = [1 if draw(st.integers(0, 4)) == 0 else size for size in shape[drop:]]
    shapes = [shape, other] if draw(st.booleans()) else [other, shape]
    return [_operand(draw, shape) for shape in shapes]


def _operand(draw, shape):
    numel = 1
    for size in shape:
        numel *= size
    dtype = draw(st.sampled_from(DTYPES))
    # Values from a seed that hypothesis draws, so that a failing example replays and shrinks.
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**63 - 1)))
    base = torch.randn(2 * numel + 2, dtype=torch.float64, generator=generator)
    base *= draw(st.sampled_from([1e-3, 1.0, 30.0]))
    for index, value in draw(st.lists(st.tuples(st.integers(0, 2 * numel + 1), st.sampled_from(SPECIAL)),
                                      max_size=3)):
        base[index] = value
    base = base.to(dtype)  # before taking the view: .to() would make it contiguous
    view = draw(st.sampled_from(["contiguous", "offset", "strided", "transposed"]))
    if view == "offset":  # a storage offset that breaks 16-byte alignment
        return base[1 : 1 + numel].view(shape)
    if view == "strided":
        return base[: 2 * numel : 2].view(shape) if numel else base[:0].view(shape)
    if view == "transposed":
        return base[:numel].view(shape[::-1]).permute(list(reversed(range(len(shape)))))
    return base[:numel].view(shape)


def _run(fn, input, target, grad_for, **kwargs):
    """Loss, gradients (or the backward's error), warnings and error of one call."""
    input = input.detach().requires_grad_(grad_for[0])
    target = target.detach().requires_grad_(grad_for[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn(input, target, **kwargs)
        except Exception as error:  # the error itself is what is compared
            return None, None, [str(w.message) for w in caught], (type(error), str(error))
        grads = None
        if out.requires_grad:
            wanted = [t for t, g in zip((input, target), grad_for) if g]
            try:
                grads = torch.autograd.grad(out.sum(), wanted, allow_unused=True)
            except RuntimeError as error:
                grads = error
    return out, grads, [str(w.message) for w in caught], None


def _float64_gradients(name, input, target, grad_for, reduction, param, keep_float64=False):
    """The gradients of the loss as PyTorch computes it (operands and beta/delta in its
    dtype), on float64 copies, cast back to each operand's dtype unless keep_float64."""
    from fusedloss import formulas

    row = losses.LOSSES[name]
    operands = (input, as_computed(name, input, target))
    if row.keeps_input_dtype and input.is_cuda:  # PyTorch's CUDA Huber computes in the input's dtype
        param = torch.tensor(param, dtype=input.dtype).item()
    copies = [t.detach().double().requires_grad_(g) for t, g in zip(operands, grad_for)]
    loss = row.param_zero_is if param == 0 and row.param_zero_is else name
    out = formulas.torch_loss(*copies, loss, param, reduction)
    grads = torch.autograd.grad(out.sum(), [c for c in copies if c.requires_grad], allow_unused=True,
                                materialize_grads=True)
    originals = [t for t, g in zip((input, target), grad_for) if g]
    return [g if keep_float64 else g.to(t.dtype) for g, t in zip(grads, originals)]


def _close(actual, expected, computed_in=None):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    # the looser of the result's dtype and the dtype it was computed in
    dtypes = [expected.dtype] + ([computed_in] if computed_in is not None else [])
    rtol, atol = (max(TOLERANCE[d][i] for d in dtypes) for i in (0, 1))
    # Both sides round differently in 16-bit types; compare in float64 against the looser of the two.
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol * 4, atol=atol * 4, equal_nan=True)


def _ulps(reference64, dtype):
    """The spacing of `dtype` at each reference value (the normal spacing near 0, the
    largest finite one beyond the type)."""
    finfo = torch.finfo(dtype)
    return finfo.eps * torch.exp2(torch.floor(torch.log2(reference64.abs().clamp(finfo.tiny, finfo.max))))


def _close_or_as_accurate(actual, expected, reference64, computed_in=None):
    """_close, or, where a sum over broadcast dimensions cancels and so magnifies both
    sides' rounding, no further from float64 than PyTorch is (elementwise, 2x slack), or
    within 4 ulps of it in the gradient's dtype (where PyTorch's order of summing happens
    to land nearer than its own rounding).
    Where PyTorch gives NaN and float64 a value (a float64 operand rounded into the other's
    narrower dtype overflows there: README, Known limits), fusedloss must give float64's."""
    try:
        _close(actual, expected, computed_in)
    except AssertionError:
        ours = (actual.double() - reference64).abs()
        theirs = (expected.double() - reference64).abs()
        assert not torch.any(ours.isnan() & ~theirs.isnan()), "NaN where PyTorch has a value"
        they_overflowed = theirs.isnan() & ~ours.isnan()
        rtol, atol = TOLERANCE[actual.dtype]
        assert torch.all(ours[they_overflowed] <= atol + rtol * reference64[they_overflowed].abs()), \
            "where PyTorch overflowed, fusedloss is not float64's value"
        finite = ~theirs.isnan()
        slack = torch.maximum(2 * theirs[finite], 4 * _ulps(reference64[finite], actual.dtype))
        assert torch.all(ours[finite] <= slack), "fusedloss is further from float64 than PyTorch"


@pytest.mark.parametrize("name", LOSSES)
@fuzz_settings
@given(pair=operands(), reduction=st.sampled_from(["none", "mean", "sum"]),
       param=st.sampled_from([0.0, 1e-6, 0.5, 1.0, 3.0, 1e6, -1.0]), grad_for=st.tuples(st.booleans(), st.booleans()))
# a 0-d operand of the wider dtype: the loss is computed broadcast, so it promotes to float64
@example(pair=[torch.tensor(0.75, dtype=torch.float64), torch.tensor([[0.25, -2.0]])], reduction="none", param=0.5,
         grad_for=(True, True))
def test_matches_torch(device, name, pair, reduction, param, grad_for):
    ours, theirs, keyword = LOSSES[name]
    row = losses.LOSSES[name]
    input, target = (t.to(device) for t in pair)
    # A delta the input's dtype cannot hold: PyTorch's CUDA Huber backward sees it
    # rounded (inf in fp16), its CPU one does not, and fusedloss's operators follow
    # CUDA on every device, so the CPU route has nothing to match.
    assume(not (device == "cpu" and row.keeps_input_dtype and row.param and input.dtype.is_floating_point
                and torch.tensor(param, dtype=input.dtype).isinf()))
    grad_for = tuple(g and t.dtype.is_floating_point for g, t in zip(grad_for, (input, target)))
    kwargs = {"reduction": reduction, **({keyword: param} if keyword else {})}
    out, grads, our_warnings, our_error = _run(ours, input, target, grad_for, **kwargs)
    if not row.pytorch and keyword and not row.param_valid(param):
        # fusedloss's own loss refuses a number outside its domain (the formula has no check)
        assert our_error is not None and our_error[0] is ValueError and keyword in our_error[1], our_error
        return
    expected, expected_grads, their_warnings, their_error = _run(theirs, input, target, grad_for, **kwargs)
    assert our_error == their_error
    assert our_warnings == their_warnings
    if expected is None:
        return
    _close(out, expected)
    computed_in = None
    if isinstance(expected_grads, RuntimeError):
        # PyTorch's CUDA backward rejects mixed dtypes in mse_loss and huber_loss (its CPU
        # one in huber_loss); check against float64 instead.
        assert "expected" in str(expected_grads)
        expected_grads = _float64_gradients(name, input, target, grad_for, reduction, param)
        # the dtype the forward computes in: Huber the input's, MSE the promoted one
        computed_in = input.dtype if row.keeps_input_dtype else torch.promote_types(input.dtype, target.dtype)
    if expected_grads is not None:
        assert not isinstance(grads, RuntimeError), grads
        references = None
        for k, (grad, expected_grad) in enumerate(zip(grads, expected_grads)):
            if expected_grad is None:
                assert grad is None or not grad.any()
                continue
            if references is None:
                references = _float64_gradients(name, input, target, grad_for, reduction, param, keep_float64=True)
            _close_or_as_accurate(grad, expected_grad, references[k], computed_in)
