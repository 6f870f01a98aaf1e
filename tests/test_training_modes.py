"""Training-loop modes, and how a loss that may compute its gradient in the forward can break them.

A loss that writes d loss / d input during the forward pass (and hands that
buffer to backward) has failure modes that a plain autograd formula cannot
have: a gradient computed from operands the user has since modified, a buffer
that a later step overwrites, a second backward through a retained graph, a
grad_output that is not 1, a host sync to learn it, capture into a CUDA graph,
compilation, autocast and torch.func transforms. Every test compares
fusedloss with torch.nn.functional on the same inputs (and, for values and
gradients, with a float64 evaluation of PyTorch's formula where that is the
sharper check).

Every loss of the table of losses (fusedloss.losses) runs in every mode, PyTorch's
against torch.nn.functional, fusedloss's own (pseudo-Huber) against their formula;
only section 1, PyTorch's samples, is for PyTorch's losses alone.

Sections:
  1. PyTorch's own test inputs: the OpInfo and ModuleInfo samples of PyTorch's losses
  2. per-element grad_output with reduction='none' (random, expanded, non-contiguous)
  3. in-place modification after the forward (version counter); gradients and losses
     of one step are not overwritten by later steps
  4. retain_graph and repeated / scaled backward
  5. no host synchronisation in a training step (CUDA)
  6. sizes around block and tile edges, dtype pairs, determinism (CUDA)
  7. a torch.compile'd training step
  8. a training step captured in a CUDA graph (CUDA)
  9. hypothesis fuzzing: autocast (CUDA), torch.func transforms, forward-mode AD

Devices: tests taking the `device` fixture run twice: "fused-cpu" routes CPU
tensors through fusedloss's operators and autograd formulas (conftest's
`fused_cpu`, plus the torch.func check that the real dispatcher makes), so CI
without a GPU runs them; "cuda" runs the kernels and skips without a GPU.
Sizes from 2**20 on are those where an eager CUDA mean or sum may write its
gradient in the forward.

Section 1 needs torch.testing._internal, which imports `expecttest`; without it
those tests skip and say so. FUSEDLOSS_FUZZ_EXAMPLES sets the examples per
hypothesis test (default 150), as in test_fuzz.py.
"""

from __future__ import annotations

import copy
import difflib
import os
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusedloss
import fusedloss.nn
from fusedloss import build, formulas, losses

from conftest import LOSSES, PARAMS, TOLERANCE, TORCH_LOSSES, as_seen_by_gradient, float64_reference, heavy_tailed, \
    loss_kwargs, requires_cuda, warm_up_for_capture

OURS, TORCH = 0, 1  # index into a LOSSES row: fusedloss's, PyTorch's (or the formula, for fusedloss's own)
REDUCTIONS = ("mean", "sum", "none")
# Below and from 2**20 elements: where the eager CUDA forward may write the gradient.
SIZES = (999, (1 << 20) + 3)
# (rtol, atol) of a gradient against float64 (test_cuda_autograd.py's)
GRAD_TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (2e-3, 1e-6),
                  torch.float64: (1e-12, 1e-14)}
_PRECISION_RANK = {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
INPLACE_ERROR = "one of the variables needed for gradient computation has been modified by an inplace operation"
EXAMPLES = int(os.environ.get("FUSEDLOSS_FUZZ_EXAMPLES", "150"))

fuzz_settings = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(params=["fused-cpu", pytest.param("cuda", marks=requires_cuda)])
def device(request):
    """"cpu" through fusedloss's operators (their CPU kernels), or "cuda"."""
    if request.param == "cuda":
        request.getfixturevalue("cuda_kernels")
        return "cuda"
    request.getfixturevalue("fused_cpu")  # as on CUDA, torch operations under compile and transforms
    return "cpu"


@pytest.fixture
def cuda_kernels():
    """The CUDA kernels, built or loaded; raises if they cannot be, rather than letting
    fusedloss fall back to torch.nn.functional and the tests compare PyTorch with itself."""
    build.load()


# ---- helpers ---------------------------------------------------------------------


def _loss(name, fn_index, input, target, reduction="mean", param=None):
    param = PARAMS[name] if param is None else param
    return LOSSES[name][fn_index](input, target, reduction=reduction, **loss_kwargs(name, param))


def _loss_id(name, param):
    """The loss the operators compute for this param: Smooth L1 with beta = 0 is L1."""
    zero_is = losses.LOSSES[name].param_zero_is
    return zero_is if zero_is is not None and param == 0 else name


def _computed_in(name, input, operand):
    """The dtype whose rounding a gradient of `operand` carries: the input's for a loss that
    PyTorch's CUDA kernels compute in it (Huber), else the operand's own, which it is rounded to."""
    return input.dtype if losses.LOSSES[name].keeps_input_dtype else operand.dtype


def _looser(*dtypes):
    return max(dtypes, key=_PRECISION_RANK.__getitem__)


def _tolerance(*dtypes):
    """fusedloss against PyTorch: both round in these dtypes (4x conftest's, as test_fuzz.py)."""
    rtol, atol = TOLERANCE[_looser(*dtypes)]
    return 4 * rtol, 4 * atol


def _assert_close_to_torch(actual, expected, *dtypes):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
    rtol, atol = _tolerance(expected.dtype, *dtypes)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, equal_nan=True)


def _assert_took_fused_path(out, expected):
    """The call went through fusedloss's operators, not torch.nn.functional (else the
    comparison would compare PyTorch with itself)."""
    if out.grad_fn is not None and expected.grad_fn is not None:
        assert out.grad_fn.name() != expected.grad_fn.name(), f"fusedloss ran PyTorch's {out.grad_fn.name()}"


def _leaf(t, requires_grad=True):
    return t.detach().clone().requires_grad_(requires_grad)


def _grads(out, tensors, grad_output=None, **kwargs):
    return torch.autograd.grad(out, tensors, grad_output, allow_unused=True, **kwargs)


def _float64_gradients(name, input, target, reduction, grad_output, param):
    """d loss / d input and d loss / d target by PyTorch's formula on float64 copies, each
    seeing the other operand as PyTorch's CUDA backward does (conftest.as_seen_by_gradient)."""
    loss_id = _loss_id(name, param)

    def gradient(of_input):
        seen = as_seen_by_gradient(name, input, target, of_input)
        i64, t64 = (t.detach().double().requires_grad_(g) for t, g in zip(seen, (of_input, not of_input)))
        out = formulas.torch_loss(i64, t64, loss_id, param, reduction)
        return torch.autograd.grad(out, i64 if of_input else t64, grad_output.double().expand_as(out))[0]

    return gradient(True), gradient(False)


def _assert_grad_close_to_float64(actual, expected64, dtype, computed_in):
    assert actual.dtype == dtype
    rtol, atol = GRAD_TOLERANCE[_looser(dtype, computed_in)]
    torch.testing.assert_close(actual.double(), expected64, rtol=rtol, atol=atol, equal_nan=True)


def _gradient_bounds(name, param, reduction, input, target, grad_output):
    """For each operand, the sum over the broadcast elements behind each of its entries of
    |d loss / d element| * |grad_output|: what the rounding of a gradient summed over
    broadcast dimensions is relative to (where the sum cancels, its own size is not)."""
    loss_id = _loss_id(name, param)
    i64, t64 = torch.broadcast_tensors(input.detach().double(), target.detach().double())
    per_element = formulas.loss_grad(i64, t64, loss_id, param).abs()
    if reduction == "mean" and i64.numel():
        per_element = per_element / i64.numel()
    per_element = per_element * grad_output.detach().double().abs()
    return per_element.sum_to_size(input.shape), per_element.sum_to_size(target.shape)


def _assert_close_within_bound(actual, expected, bound, *dtypes):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
    rtol, atol = _tolerance(expected.dtype, *dtypes)
    error = (actual.double() - expected.double()).abs()
    worst = (error - (atol + rtol * bound.to(error.device))).max() if error.numel() else 0
    assert worst <= 0, f"off by {worst:.3g} beyond {rtol} * bound + {atol}:\n{actual}\n{expected}"


def _backward(out, scale=1.0, weight=None):
    """A backward with grad_output `scale` (a mean or sum) or `weight * scale` ('none')."""
    if out.dim() == 0:
        (out if scale == 1.0 else out * scale).backward()
    else:
        out.backward(weight * scale)


# ---- 1. PyTorch's own OpInfo and ModuleInfo samples ---------------------------------------

# PyTorch's samples exist for PyTorch's losses only: their OpInfo and torch.nn module, by the table's names
OPINFO_NAMES = {name: "nn.functional." + losses.LOSSES[name].function for name in TORCH_LOSSES}
MODULE_NAMES = {name: losses.LOSSES[name].module for name in TORCH_LOSSES}


def _db_dtypes(device):
    if device == "cuda":
        return (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    return (torch.float32, torch.float64)


def _call_recording_warnings(fn, args, kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    return out, [str(w.message) for w in caught]


def _compare_with_torch(ours, theirs, args, kwargs):
    """Values, dtype, warnings and the gradients of every operand that requires grad, for
    a random grad_output."""
    out, our_warnings = _call_recording_warnings(ours, args, kwargs)
    expected, their_warnings = _call_recording_warnings(theirs, args, kwargs)
    assert our_warnings == their_warnings
    _assert_took_fused_path(out, expected)
    _assert_close_to_torch(out, expected)
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    assert tensors
    grad_output = torch.randn_like(expected)
    got, want = _grads(out, tensors, grad_output), _grads(expected, tensors, grad_output)
    for g, w, t in zip(got, want, tensors):
        assert (g is None) == (w is None)
        if w is not None:
            _assert_close_to_torch(g, w, t.dtype)


@pytest.mark.parametrize("name", TORCH_LOSSES)
def test_pytorch_opinfo_samples(pytorch_test_db, device, name):
    op_db, _ = pytorch_test_db
    (opinfo,) = [op for op in op_db if op.name == OPINFO_NAMES[name] and op.variant_test_name == ""]
    count = 0
    for dtype in _db_dtypes(device):
        for sample in opinfo.sample_inputs(device, dtype, requires_grad=True):
            _compare_with_torch(LOSSES[name][OURS], LOSSES[name][TORCH], (sample.input, *sample.args), sample.kwargs)
            count += 1
    assert count >= 6 * len(_db_dtypes(device))


@pytest.mark.parametrize("name", TORCH_LOSSES)
def test_pytorch_moduleinfo_samples(pytorch_test_db, device, name):
    _, module_db = pytorch_test_db
    (info,) = [m for m in module_db if m.module_cls is getattr(torch.nn, MODULE_NAMES[name])]
    count = 0
    for dtype in _db_dtypes(device):
        for module_input in info.module_inputs_func(info, device=device, dtype=dtype, requires_grad=True,
                                                    training=True):
            c, f = module_input.constructor_input, module_input.forward_input
            ours = getattr(fusedloss.nn, MODULE_NAMES[name])(*c.args, **c.kwargs)
            theirs = info.module_cls(*c.args, **c.kwargs)
            assert repr(ours) == repr(theirs)
            _compare_with_torch(ours, theirs, f.args, f.kwargs)
            count += 1
    assert count >= 4 * len(_db_dtypes(device))


# ---- 2. per-element grad_output with reduction='none' -------------------------------------


def _grad_output(kind, shape, dtype, device):
    if kind == "random":
        return torch.randn(shape, dtype=dtype, device=device)
    if kind == "expanded_row":  # stride 0 along the first dimension
        return torch.randn(shape[-1], dtype=dtype, device=device).expand(shape)
    if kind == "expanded_scalar":  # every stride 0
        return torch.randn((), dtype=dtype, device=device).expand(shape)
    if kind == "transposed":
        return torch.randn(shape[::-1], dtype=dtype, device=device).t()
    assert kind == "strided"
    return torch.randn(shape[0], 2 * shape[1] + 1, dtype=dtype, device=device)[:, 1::2]


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("kind", ["random", "expanded_row", "expanded_scalar", "transposed", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_pointwise_grad_output_matches_torch(device, name, kind, dtype):
    shape = (37, 65)
    for target_shape in (shape, (65,)):  # the same shape, and a broadcast target
        input = _leaf(heavy_tailed(shape, device=device).to(dtype))
        target = _leaf(heavy_tailed(target_shape, device=device).to(dtype))
        grad_output = _grad_output(kind, shape, dtype, device)
        assert kind == "random" or not grad_output.is_contiguous()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the broadcast target's size warning (test_fuzz compares it)
            out = _loss(name, OURS, input, target, "none")
            expected = _loss(name, TORCH, input, target, "none")
        _assert_took_fused_path(out, expected)
        _assert_close_to_torch(out, expected)
        got = _grads(out, (input, target), grad_output, retain_graph=True)
        want = _grads(expected, (input, target), grad_output)
        # the broadcast target's gradient is a sum over rows, which may cancel
        bounds = _gradient_bounds(name, PARAMS[name], "none", input, target, grad_output)
        for g, w, bound in zip(got, want, bounds):
            _assert_close_within_bound(g, w, bound)
        # .backward() with the same grad_output gives the same as autograd.grad
        out.backward(grad_output)
        assert torch.equal(input.grad, got[0]) and torch.equal(target.grad, got[1])
        if target_shape == shape:
            expected64 = _float64_gradients(name, input, target, "none", grad_output, PARAMS[name])
            for g, e in zip(got, expected64):
                _assert_grad_close_to_float64(g, e, dtype, dtype)


# A sum over some dimensions hands backward a grad_output expanded over them, which the
# kernels read where it lies (as a weight); six alternating runs are more than they take.
SUMMED_DIMS = {"per sample": ((6, 5, 7, 9), (1, 2, 3)), "last": ((6, 5, 7, 9), (3,)), "middle": ((6, 5, 7, 9), (1,)),
             "outer and inner": ((6, 5, 7, 9), (0, 3)), "six runs": ((3, 5, 2, 4, 2, 3), (1, 3, 5))}


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("case", SUMMED_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_pointwise_grad_output_expanded_by_a_reduction(device, name, case, dtype):
    shape, dims = SUMMED_DIMS[case]
    input = _leaf(heavy_tailed(shape, device=device).to(dtype))
    target = _leaf(heavy_tailed(shape, device=device).to(dtype))
    kept = [1 if d in dims else size for d, size in enumerate(shape)]
    out = _loss(name, OURS, input, target, "none")
    expected = _loss(name, TORCH, input, target, "none")
    _assert_took_fused_path(out, expected)
    grad_output = torch.randn(kept, dtype=dtype, device=device).expand(shape)
    got = _grads(out, (input, target), grad_output, retain_graph=True)
    want = _grads(expected, (input, target), grad_output, retain_graph=True)
    bounds = _gradient_bounds(name, PARAMS[name], "none", input, target, grad_output)
    for g, w, bound in zip(got, want, bounds):
        _assert_close_within_bound(g, w, bound)
    expected64 = _float64_gradients(name, input, target, "none", grad_output, PARAMS[name])
    for g, e in zip(got, expected64):
        _assert_grad_close_to_float64(g, e, dtype, dtype)
    # As a trainer writes it: the loss's sum over those dimensions, weighed per sample.
    weights = torch.randn(out.sum(dim=dims).shape, dtype=dtype, device=device)
    got = _grads((out.sum(dim=dims) * weights).sum(), (input, target))
    want = _grads((expected.sum(dim=dims) * weights).sum(), (input, target))
    bounds = _gradient_bounds(name, PARAMS[name], "none", input, target, weights.reshape(kept).expand(shape))
    for g, w, bound in zip(got, want, bounds):
        _assert_close_within_bound(g, w, bound)


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dims", [(1,), (0,)], ids=str)
def test_grad_output_expanded_by_a_sum_is_not_copied(name, dims):
    """The backward of `loss(reduction='none').sum(dim)` (whose grad_output is expanded; a
    mean's backward divides it into a tensor of the loss's size) allocates the gradient and
    no copy of the grad_output, which would take 4 bytes an element."""
    build.load()  # the kernels, not the fallback to torch.nn.functional
    x = heavy_tailed((4099, 1027), device="cuda").requires_grad_()
    y = heavy_tailed((4099, 1027), device="cuda")
    loss = _loss(name, OURS, x, y, "none").sum(dim=dims).mean()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - before
    gradient = 4 * x.numel()
    assert peak < gradient + 2 * x.numel(), f"peak {peak} bytes against {gradient} for the gradient"


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("case", ["per sample", "middle"])
def test_grad_output_expanded_by_a_sum_without_sync_and_in_a_graph(cuda_kernels, name, case):
    """The expanded grad_output's backward syncs nothing with the host and replays from a
    CUDA graph with eager's bits."""
    shape, dims = SUMMED_DIMS[case]
    static_x = _leaf(heavy_tailed(shape, device="cuda"))
    static_t = heavy_tailed(shape, device="cuda")
    weights = torch.randn(static_x.sum(dim=dims).shape, device="cuda")

    def step(x, t):
        x.grad = None
        (_loss(name, OURS, x, t, "none").sum(dim=dims) * weights).sum().backward()
        return x.grad

    warm_up_for_capture(step, static_x, static_t)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(static_x, static_t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_grad = step(static_x, static_t)
    for _ in range(2):
        with torch.no_grad():
            static_x.copy_(heavy_tailed(shape, device="cuda"))
            static_t.copy_(heavy_tailed(shape, device="cuda"))
        graph.replay()
        eager = step(_leaf(static_x), static_t)
        assert torch.equal(static_grad, eager)


# ---- 3. in-place modification after the forward; gradients kept across steps ---------------

MUTATIONS = ["input_nonleaf", "view_base", "detached_alias", "leaf_step", "target", "target_detached_from_leaf"]


def _mutated_backward(name, fn_index, reduction, mutation, input_values, target_values):
    """The loss, an in-place change to something it saved, then backward: the gradient of
    the leaf behind the input, or the RuntimeError."""
    leaf = _leaf(input_values)
    target = target_values.clone()
    if mutation == "view_base":
        base = torch.cat([leaf[:1], leaf]) * 1.0
        input = base[1:]
    else:
        input = leaf if mutation == "leaf_step" else leaf * 1.0
    if mutation == "target_detached_from_leaf":  # a target taken from parameters, e.g. a teacher's
        target_leaf = _leaf(target_values)
        target = target_leaf.detach()
    out = _loss(name, fn_index, input, target, reduction)
    if mutation == "input_nonleaf":
        input.add_(1)
    elif mutation == "view_base":
        base.add_(1)
    elif mutation == "detached_alias":
        input.detach().add_(1)  # shares the version counter
    elif mutation == "leaf_step":  # an optimizer step before backward
        with torch.no_grad():
            leaf.add_(1)
    elif mutation == "target":
        target.add_(1)
    else:
        with torch.no_grad():
            target_leaf.mul_(2)
    try:
        return torch.autograd.grad(out.sum(), leaf)[0]
    except RuntimeError as error:
        return error


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_inplace_change_after_forward_raises_like_torch(device, name, reduction, n, mutation):
    input_values = heavy_tailed((n,), device=device)
    target_values = heavy_tailed((n,), device=device)
    expected = _mutated_backward(name, TORCH, reduction, mutation, input_values, target_values)
    got = _mutated_backward(name, OURS, reduction, mutation, input_values, target_values)
    if losses.LOSSES[name].pytorch and name != "l1":
        # PyTorch's loss saves both operands; the scenario is one it refuses.
        assert isinstance(expected, RuntimeError) and INPLACE_ERROR in str(expected), expected
    if isinstance(expected, RuntimeError):
        assert isinstance(got, RuntimeError), "fusedloss gave a gradient where PyTorch refuses"
        assert INPLACE_ERROR in str(got), got
    elif isinstance(got, RuntimeError):
        # PyTorch's L1 saves input - target, not the operands, so it can still answer (as the
        # formula of fusedloss's own loss may); an error about the operands is stricter, not wrong.
        assert INPLACE_ERROR in str(got), got
    else:
        _assert_close_to_torch(got, expected)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("n", SIZES)
def test_a_step_keeps_its_gradients_and_loss_through_later_steps(device, name, reduction, n):
    x = _leaf(heavy_tailed((n,), device=device))
    t = _leaf(heavy_tailed((n,), device=device))
    weight = torch.randn(n, device=device)

    def step(x, t, scale, fn_index=OURS):
        out = _loss(name, fn_index, x, t, reduction)
        _backward(out, scale, weight)
        return out

    # step 1, and PyTorch's gradients for it
    x_ref, t_ref = _leaf(x), _leaf(t)
    step(x_ref, t_ref, 1.0, TORCH)
    out1 = step(x, t, 1.0)
    kept = [out1, x.grad, t.grad]
    copies = [k.detach().clone() for k in kept]
    _assert_close_to_torch(x.grad, x_ref.grad)
    _assert_close_to_torch(t.grad, t_ref.grad)
    # later steps, same signature: new values in the same leaves, scaled and unscaled
    # (a scaled backward sends the next forward's gradient to backward), then new leaves
    x.grad = t.grad = None
    with torch.no_grad():
        x.copy_(heavy_tailed((n,), device=device))
        t.copy_(heavy_tailed((n,), device=device))
    step(x, t, 0.5)
    x.grad = t.grad = None
    step(x, t, 1.0)
    x2, t2 = _leaf(heavy_tailed((n,), device=device)), _leaf(heavy_tailed((n,), device=device))
    step(x2, t2, 1.0)
    step(x2, t2, -2.0)  # accumulates into x2.grad
    for k, c in zip(kept, copies):
        assert torch.equal(k, c), "a later step overwrote an earlier step's loss or gradient"
    # gradients returned by torch.autograd.grad, likewise
    a = _grads(_loss(name, OURS, x, t, reduction).sum(), (x, t))
    a_copies = [g.clone() for g in a]
    _grads(_loss(name, OURS, x2, t2, reduction).sum() * 0.25, (x2, t2))
    _grads(_loss(name, OURS, x, t, reduction).sum(), (x, t))
    for g, c in zip(a, a_copies):
        assert torch.equal(g, c)
    # accumulation without zero_grad, as PyTorch
    x2_ref, t2_ref = _leaf(x2), _leaf(t2)
    step(x2_ref, t2_ref, 1.0, TORCH)
    step(x2_ref, t2_ref, -2.0, TORCH)
    _assert_close_to_torch(x2.grad, x2_ref.grad)
    _assert_close_to_torch(t2.grad, t2_ref.grad)


# ---- 4. retain_graph and repeated backward ------------------------------------------------

# (grad_output scales of successive backwards through one graph; "grad" = torch.autograd.grad)
BACKWARD_PATTERNS = {
    "twice": [("backward", 1.0), ("backward", 1.0)],
    "scaled_then_plain": [("backward", 2.0), ("backward", 1.0)],
    "plain_then_scaled": [("backward", 1.0), ("backward", -0.5)],
    "three_times": [("backward", 1.0), ("backward", 0.25), ("backward", 1.0)],
    "grad_then_backward": [("grad", 1.0), ("backward", 3.0)],
    "backward_then_grad": [("backward", 0.5), ("grad", 1.0)],
}


def _run_pattern(name, fn_index, reduction, pattern, x, t, weight):
    x, t = _leaf(x), _leaf(t)
    out = _loss(name, fn_index, x, t, reduction)
    returned = []
    for k, (how, scale) in enumerate(pattern):
        retain = k < len(pattern) - 1
        scaled = out * scale if out.dim() == 0 else (out * weight).sum() * scale
        if how == "grad":
            returned.append(_grads(scaled, (x, t), retain_graph=retain))
        else:
            scaled.backward(retain_graph=retain)
    # the returned gradients, checked after the later backwards ran
    return [x.grad, t.grad] + [g for r in returned for g in r]


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("pattern", BACKWARD_PATTERNS)
@pytest.mark.parametrize("n", SIZES)
def test_retained_graph_backwards_accumulate_like_torch(device, name, reduction, pattern, n):
    x, t = heavy_tailed((n,), device=device), heavy_tailed((n,), device=device)
    weight = torch.randn(n, device=device)
    got = _run_pattern(name, OURS, reduction, BACKWARD_PATTERNS[pattern], x, t, weight)
    want = _run_pattern(name, TORCH, reduction, BACKWARD_PATTERNS[pattern], x, t, weight)
    for g, w in zip(got, want, strict=True):
        _assert_close_to_torch(g, w)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_loss_used_twice_in_one_graph(device, name, reduction):
    """Autograd adds the grad_outputs of both uses before the loss's backward runs."""
    n = SIZES[-1]
    x, t = heavy_tailed((n,), device=device), heavy_tailed((n,), device=device)
    results = []
    for fn_index in (OURS, TORCH):
        a, b = _leaf(x), _leaf(t)
        out = _loss(name, fn_index, a, b, reduction)
        (out + 3 * out + out.detach()).backward()
        results.append((a.grad, b.grad))
    for g, w in zip(*results):
        _assert_close_to_torch(g, w)


# ---- 5. no host synchronisation -------------------------------------------------------------

SYNC_SIZES = (1 << 7, 1 << 12, 1 << 21, (1 << 22) + 3)
SYNC_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.bfloat16, torch.float32), (torch.float64, torch.float64)]


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_training_steps_have_no_host_sync(cuda_kernels, name, reduction):
    cases = []
    for n in SYNC_SIZES:
        for input_dtype, target_dtype in SYNC_DTYPES:
            x = _leaf(heavy_tailed((n,), device="cuda").clamp(-8, 8).to(input_dtype))
            t = _leaf(heavy_tailed((n,), device="cuda").clamp(-8, 8).to(target_dtype))
            weight = torch.randn(n, device="cuda").to(_loss(name, OURS, x[:1], t[:1], "none").dtype)
            cases.append((x, t, weight))

    def step(x, t, weight, scale):
        x.grad = t.grad = None
        _backward(_loss(name, OURS, x, t, reduction), scale, weight)

    # the expected grad_output right and wrong, a step after a misprediction, and the switches between them
    scales = (1.0, 0.5, 1.0, 0.5, 0.5, 0.5, 1.0)
    for case in cases:  # warm-up: builds or loads the kernels, allocates the notes
        for scale in scales[:2]:
            step(*case, scale)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for case in cases:
            for scale in scales:
                step(*case, scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # and the last steps computed something: PyTorch's gradient for one of them
    x, t, weight = cases[-5]  # the largest float32 pair
    a, b = _leaf(x), _leaf(t)
    _backward(_loss(name, TORCH, a, b, reduction), scales[-1], weight)
    _assert_close_to_torch(x.grad, a.grad)
    _assert_close_to_torch(t.grad, b.grad)


# ---- 6. sizes, dtype pairs, determinism ------------------------------------------------------

EDGE_SIZES = (1, 2, 3, 127, 128, 129, 1000, 1 << 12, (1 << 12) + 1, (1 << 14) - 3, 1 << 16, (1 << 20) + 7)
EDGE_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.float64, torch.float64), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
               (torch.float32, torch.bfloat16), (torch.float32, torch.float64)]


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtypes", EDGE_DTYPES, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_edge_sizes_values_gradients_and_determinism(cuda_kernels, name, dtypes, reduction):
    param = PARAMS[name]
    for n in EDGE_SIZES:
        # clamped: 16-bit squares stay finite; |d| still reaches past beta and delta
        x = heavy_tailed((n,), torch.float64, "cuda").clamp(-8, 8).to(dtypes[0])
        y = heavy_tailed((n,), torch.float64, "cuda").clamp(-8, 8).to(dtypes[1])
        x[:1] = y[:1].to(x.dtype)
        y[:1] = x[:1].to(y.dtype)  # x == y: a zero gradient, and L1's sign(0)
        scalar = torch.empty((), device="cuda").uniform_(0.25, 2.0)
        out_dtype = _loss(name, OURS, x[:1], y[:1], "none").dtype
        grad_output = (torch.randn(n, device="cuda") if reduction == "none" else scalar).to(out_dtype)

        def run(fn_index):
            a, b = _leaf(x), _leaf(y)
            out = _loss(name, fn_index, a, b, reduction)
            try:
                grads = _grads(out, (a, b), grad_output)
            except RuntimeError:  # PyTorch's CUDA MSE and Huber backward reject mixed dtypes
                assert fn_index == TORCH and dtypes[0] != dtypes[1]
                grads = None
            return out, grads

        out, grads = run(OURS)
        again, grads_again = run(OURS)
        assert torch.equal(out, again), f"n={n}: loss not deterministic"
        for g, h in zip(grads, grads_again):
            assert torch.equal(g, h), f"n={n}: gradient not deterministic"
        # values: against float64 (rounded to the result's dtype: a 16-bit sum may overflow) and PyTorch
        assert out.dtype == out_dtype
        reference = float64_reference(name, x, y, reduction, param).to(out_dtype).double()
        rtol, atol = TOLERANCE[out_dtype]
        torch.testing.assert_close(out.double(), reference, rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"n={n}: {m}")
        expected, expected_grads = run(TORCH)
        _assert_close_to_torch(out, expected)
        # gradients: against float64 and, where PyTorch computes them, PyTorch
        references = _float64_gradients(name, x, y, reduction, grad_output, param)
        for k, (g, operand) in enumerate(zip(grads, (x, y))):
            computed_in = _computed_in(name, x, operand)
            try:
                _assert_grad_close_to_float64(g, references[k], operand.dtype, computed_in)
            except AssertionError as error:
                raise AssertionError(f"n={n}, gradient {k}: {error}") from None
            if expected_grads is not None:
                _assert_close_to_torch(g, expected_grads[k], computed_in)


# ---- 7. a compiled training step ----------------------------------------------------------


def _model(device, dtype):
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.SiLU(), torch.nn.Linear(48, 16)).to(device, dtype)


def _step_fn(model, fn_index, names):
    """A step whose loss is the sum of the losses `names` (weighed 1, 1/2, 1/3, ...) of one prediction."""

    def step(x, y):
        prediction = model(x)
        return sum(_loss(name, fn_index, prediction, y) / (k + 1) for k, name in enumerate(names))

    return step


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_training_step_matches_compiled_torch(device, name, dtype):
    # inductor on CUDA; on the CPU, aot_eager (AOTAutograd without a C++ build), to stay cheap
    backend = "inductor" if device == "cuda" else "aot_eager"
    torch._dynamo.reset()
    ours_model = _model(device, dtype)
    torch_model = copy.deepcopy(ours_model)
    ours = torch.compile(_step_fn(ours_model, OURS, [name]), fullgraph=True, backend=backend)
    theirs = torch.compile(_step_fn(torch_model, TORCH, [name]), fullgraph=True, backend=backend)
    optimizer = torch.optim.SGD(ours_model.parameters(), lr=1e-3)
    rtol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for _ in range(3):
        x = torch.randn(64, 24, device=device, dtype=dtype)
        y = (heavy_tailed((64, 16), device=device) * 0.5).to(dtype)  # both branches of a param's loss
        for model in (ours_model, torch_model):
            model.zero_grad(set_to_none=True)
        loss, expected = ours(x, y), theirs(x, y)
        loss.backward()
        expected.backward()
        assert loss.dtype == expected.dtype == dtype
        torch.testing.assert_close(loss, expected, rtol=rtol, atol=1e-6)
        for p, q in zip(ours_model.parameters(), torch_model.parameters()):
            # relative to the largest entry: the sums over the batch may cancel
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=rtol * q.grad.abs().max().item())
        optimizer.step()
        torch_model.load_state_dict(ours_model.state_dict())


@pytest.mark.parametrize("variant", ["float32", "bfloat16", "bf16 autocast"])
def test_compiled_model_runs_inductors_code_for_torch(device, variant):
    """A model compiled whole with fusedloss runs the very code that inductor writes for
    it with torch.nn.functional (or, for fusedloss's own losses, their formula): the same
    generated source, forward and backward, for a step whose loss sums every loss of the
    table. So the bench's compiled-model rows time one program twice, and their ratio is noise."""
    if device == "cpu" and variant != "float32":
        pytest.skip("one variant on the CPU: inductor's C++ build is slow")
    from torch._inductor.utils import run_and_get_code

    dtype = torch.bfloat16 if variant == "bfloat16" else torch.float32
    model = _model(device, dtype)
    x = torch.randn(64, 24, device=device, dtype=dtype)
    y = (heavy_tailed((64, 16), device=device) * 0.5).to(dtype)
    sources = []
    for fn_index in (OURS, TORCH):
        torch._dynamo.reset()  # the same numbering of graphs and kernels for both
        step = torch.compile(_step_fn(model, fn_index, list(LOSSES)), fullgraph=True, backend="inductor")

        def train_step():
            model.zero_grad(set_to_none=True)
            with torch.autocast(device, torch.bfloat16, enabled=variant == "bf16 autocast"):
                loss = step(x, y)
            loss.backward()

        # without comment lines: they name the graph's compile id and the kernels' cache paths
        sources.append([[line for line in module.splitlines() if not line.lstrip().startswith("#")]
                        for module in run_and_get_code(train_step)[1]])
    ours, theirs = sources
    assert len(ours) == 2, "a forward and a backward module"
    for mine, torchs in zip(ours, theirs):
        assert mine == torchs, "\n".join(difflib.unified_diff(torchs, mine, lineterm=""))


# ---- 8. a training step in a CUDA graph ----------------------------------------------------

GRAPH_CASES = [(4099, torch.float32), ((1 << 20) + 3, torch.float32), ((1 << 20) + 3, torch.bfloat16)]


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("grad_scale", [1.0, 0.5])
@pytest.mark.parametrize("api", ["backward", "autograd.grad"])
def test_cuda_graph_training_step_replays_eager_bits(cuda_kernels, name, reduction, grad_scale, api):
    for n, dtype in GRAPH_CASES:
        static_x = _leaf(heavy_tailed((n,), device="cuda").to(dtype))
        static_t = _leaf(heavy_tailed((n,), device="cuda").to(dtype))
        static_w = torch.randn(n, device="cuda", dtype=dtype)

        def step(x, t, fn_index=OURS):
            out = _loss(name, fn_index, x, t, reduction)
            if out.dim() == 0:
                scaled = out if grad_scale == 1.0 else out * grad_scale
            else:
                scaled = (out * static_w).sum() * grad_scale
            if api == "backward":
                x.grad = t.grad = None
                scaled.backward()
                return out, x.grad, t.grad
            return (out, *torch.autograd.grad(scaled, (x, t)))

        warm_up_for_capture(step, static_x, static_t)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out, static_gx, static_gt = step(static_x, static_t)
        for _ in range(3):
            with torch.no_grad():
                static_x.copy_(heavy_tailed((n,), device="cuda").to(dtype))
                static_t.copy_(heavy_tailed((n,), device="cuda").to(dtype))
            graph.replay()
            eager = step(_leaf(static_x), _leaf(static_t))
            for replayed, e in zip((static_out, static_gx, static_gt), eager):
                assert torch.equal(replayed, e), f"n={n}, {dtype}: the replay differs from eager fusedloss"
            for replayed, e in zip((static_out, static_gx, static_gt), step(_leaf(static_x), _leaf(static_t), TORCH)):
                _assert_close_to_torch(replayed, e)


# ---- 9. fuzzing: autocast, torch.func transforms, forward-mode AD -----------------------------


@dataclass
class Case:
    name: str
    reduction: str
    param: float
    input: torch.Tensor
    target: torch.Tensor

    def kwargs(self):
        return {"reduction": self.reduction, **loss_kwargs(self.name, self.param)}

    def fns(self):
        ours, theirs, _ = LOSSES[self.name]
        return (lambda a, b: ours(a, b, **self.kwargs())), (lambda a, b: theirs(a, b, **self.kwargs()))


def _heavy_tailed_from(generator, shape, dtype):
    u = torch.rand(shape, dtype=torch.float64, generator=generator).clamp_min(1e-6)
    sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1
    return ((u.pow(-0.5) - 1) * sign).to(dtype)


@st.composite
def cases(draw, dtypes, batch=0):
    """A loss, reduction, beta or delta, and broadcast-compatible heavy-tailed operands
    (0-d, empty and broadcast shapes among them), with `batch` leading rows for vmap."""
    name = draw(st.sampled_from(list(LOSSES)))
    param = draw(st.sampled_from([p for p in (0.25, 1.0, 3.0, 0.0) if losses.LOSSES[name].param_valid(p)]))
    rank = draw(st.integers(0, 3))
    shape = [draw(st.integers(0, 2)) if draw(st.booleans()) else draw(st.integers(1, 9)) for _ in range(rank)]
    other = [1 if draw(st.integers(0, 3)) == 0 else size for size in shape[draw(st.integers(0, rank)):]]
    shapes = [shape, other] if draw(st.booleans()) else [other, shape]
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**63 - 1)))
    operands = [_heavy_tailed_from(generator, ([batch] if batch else []) + s, draw(st.sampled_from(dtypes)))
                for s in shapes]
    return Case(name, draw(st.sampled_from(REDUCTIONS)), param, *operands)


def _outcome(fn):
    """fn's result, or its exception's type and message (compared, not raised)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # broadcasting's size warning (test_fuzz.py compares them)
            return fn()
    except Exception as error:
        return (type(error), str(error))


def _assert_same_outcome(got, want):
    if isinstance(want, tuple) and len(want) == 2 and isinstance(want[0], type):
        assert got == want
        return
    assert not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], type)), got
    got, want = (got, want) if isinstance(want, (tuple, list)) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        _assert_close_to_torch(g, w)


AUTOCAST_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@requires_cuda
@fuzz_settings
@given(data=st.data(), autocast_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       grad_for=st.sampled_from([(True, False), (False, True), (True, True)]))
def test_fuzz_autocast_matches_torch(cuda_kernels, data, autocast_dtype, grad_for):
    # float64 pairs stay float64 under autocast; 16-bit and float32 operands compute in float32
    case = data.draw(cases(AUTOCAST_DTYPES) | cases([torch.float64]))
    x, t = case.input.cuda(), case.target.cuda()
    results = []
    for fn in case.fns():
        a, b = x.clone().requires_grad_(grad_for[0]), t.clone().requires_grad_(grad_for[1])
        with torch.autocast("cuda", dtype=autocast_dtype):
            out = _outcome(lambda: fn(a, b))
        if isinstance(out, tuple):
            results.append((out, None, None))
            continue
        grad_output = torch.full_like(out, 0.37) if out.dim() == 0 else \
            torch.linspace(-1, 2, out.numel(), device="cuda", dtype=out.dtype).view(out.shape)
        wanted = [v for v, g in zip((a, b), grad_for) if g]
        results.append((out, _grads(out, wanted, grad_output), grad_output))
    (out, grads, grad_output), (expected, expected_grads, _) = results
    if isinstance(expected, tuple) or isinstance(out, tuple):
        assert out == expected
        return
    assert out.dtype == expected.dtype
    _assert_close_to_torch(out, expected)
    bounds = _gradient_bounds(case.name, case.param, case.reduction, x, t, grad_output)
    for g, w, bound in zip(grads, expected_grads, [b for b, wanted in zip(bounds, grad_for) if wanted]):
        _assert_close_within_bound(g, w, bound, torch.float32)


TRANSFORMS = ["grad", "vmap_grad", "vmap", "jvp", "jacrev"]


def _apply_transform(transform, fn, x, t, argnums):
    def scalar(a, b):
        return fn(a, b).sum()

    if transform == "grad":
        return torch.func.grad(scalar, argnums=argnums)(x, t)
    if transform == "jacrev":
        return torch.func.jacrev(scalar, argnums=argnums)(x, t)
    in_dims = tuple(0 if k in argnums else None for k in (0, 1))
    if transform == "vmap_grad":  # per-sample gradients
        return torch.func.vmap(torch.func.grad(scalar, argnums=argnums), in_dims=in_dims)(x, t)
    if transform == "vmap":
        return torch.func.vmap(fn, in_dims=in_dims)(x, t)
    # jvp in the operands of argnums, with tangents from their values
    primals = tuple((x, t)[k] for k in argnums)
    tangents = tuple(p.flip(-1) if p.dim() else -p for p in primals)

    def of_primals(*p):
        operands = [x, t]
        for k, v in zip(argnums, p):
            operands[k] = v
        return fn(*operands)

    return torch.func.jvp(of_primals, primals, tangents)


@fuzz_settings
@given(data=st.data(), transform=st.sampled_from(TRANSFORMS),
       argnums=st.sampled_from([(0,), (1,), (0, 1)]))
def test_fuzz_torch_func_transforms_match_torch(device, data, transform, argnums):
    batched = transform in ("vmap", "vmap_grad")
    dtypes = [torch.float32, torch.float64] + ([torch.bfloat16, torch.float16] if device == "cuda" else [])
    case = data.draw(cases(dtypes, batch=data.draw(st.integers(1, 3)) if batched else 0))
    x, t = case.input.to(device), case.target.to(device)
    if batched:  # vmap maps dimension 0 of the operands in argnums; the others are shared
        x, t = (v if k in argnums else v[0] for k, v in enumerate((x, t)))
    ours, theirs = case.fns()
    got = _outcome(lambda: _apply_transform(transform, ours, x, t, argnums))
    want = _outcome(lambda: _apply_transform(transform, theirs, x, t, argnums))
    _assert_same_outcome(got, want)


@fuzz_settings
@given(data=st.data(), dual_for=st.sampled_from([(True, False), (False, True), (True, True)]),
       requires_grad=st.booleans())
def test_fuzz_forward_mode_dual_tensors_match_torch(device, data, dual_for, requires_grad):
    dtypes = [torch.float32, torch.float64] + ([torch.bfloat16, torch.float16] if device == "cuda" else [])
    case = data.draw(cases(dtypes))
    x, t = case.input.to(device), case.target.to(device)
    tangents = [torch.randn_like(v) for v in (x, t)]

    def run(fn):
        with fwAD.dual_level():
            operands = [fwAD.make_dual(v.requires_grad_(requires_grad), tangent) if dual else v
                        for v, tangent, dual in zip((x.clone(), t.clone()), tangents, dual_for)]
            primal, tangent = fwAD.unpack_dual(fn(*operands))
            return primal.detach().clone(), tangent

    ours, theirs = case.fns()
    got, want = _outcome(lambda: run(ours)), _outcome(lambda: run(theirs))
    _assert_same_outcome(got, want)
    if not isinstance(want[0], type):
        assert (got[1] is None) == (want[1] is None)


@pytest.mark.parametrize("name", LOSSES)
def test_per_sample_gradients_of_a_model(device, name):
    """functional_call + vmap(grad) over a model's parameters: the loss sees tensors derived
    from the transformed parameters, not the transformed arguments themselves."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(5, 6, device=device), heavy_tailed((5, 3), device=device)

    def per_sample(fn_index):
        def loss(p, xi, yi):
            prediction = torch.func.functional_call(model, p, (xi.unsqueeze(0),))
            return _loss(name, fn_index, prediction, yi.unsqueeze(0))

        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)

    got, want = per_sample(OURS), per_sample(TORCH)
    assert got.keys() == want.keys()
    for k in want:
        _assert_close_to_torch(got[k], want[k])
    # and per sample, they are what a plain backward on that sample gives
    model.zero_grad(set_to_none=True)
    _loss(name, OURS, model(x[:1]), y[:1]).backward()
    for k, p in model.named_parameters():
        _assert_close_to_torch(got[k][0], p.grad)
