"""weight= and scale= for every loss of the table (fusedloss.losses.LOSSES, through
conftest's LOSSES and PARAMS), against a float64 reference written here.

The reference (`reference64`) uses torch operations only, in float64: the unweighted loss
is the table's reference of the loss (torch.nn.functional's, or the formula in plain torch),
the weighting, reduction and scale are written here; none of fusedloss's routing, operators
or weighting is used. With l_e the unweighted loss of element e of S = broadcast(input,
target) and w the weight broadcast to S:

    'none': scale * w_e * l_e                    (shape S)
    'sum':  scale * sum_e w_e l_e
    'mean': scale * sum_e w_e l_e / sum_e w_e    (Huber, as PyTorch's: / N)

The result's dtype is the loss's (promoted operands; a loss that keeps the input's dtype,
Huber: the input's), promoted with a floating-point weight's; a bool or integer weight (a
mask) keeps the loss's dtype. scale never changes the dtype. PyTorch's own weighted case
(PyTorch's losses whose function takes weight=, torch >= 2.6: mse, l1, huber, with
weight.size() == input.size()) gives PyTorch's values, which differ in one corner: where
the target broadcasts the input, PyTorch's mean divides by the weight's own sum
(`torch_case`; the reference follows).

Devices: "cpu" is fusedloss's own CPU path; "fused-cpu" routes CPU tensors through the
fusedloss:: operators' CPU kernels (conftest's `fused_cpu`), as CUDA tensors go to the
CUDA kernels; "cuda" runs the kernels and skips without a GPU. Every run draws new
data (conftest's `fresh_seed` prints the seed).

Sections:
  1. values, dtypes and gradients against float64: losses x reductions x weight
     shapes x scale kinds; dtype pairs; broadcast operands; layouts; sizes
  2. PyTorch's own weighted case (TORCH_WEIGHTED, with weight.size() == input.size())
  3. a broadcast weight equals its expanded copy; errors
  4. modules, torch.func transforms, torch.compile, the gradient written by the forward
  5. CUDA only: 16-bit operands, autocast, CUDA graphs, no host sync, determinism,
     large sizes, memory
  6. fuzzing
"""

from __future__ import annotations

import inspect
import math
import os
import random
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedloss.nn
from fusedloss import build, losses, ops, routing

from conftest import LOSSES, PARAMS, TOLERANCE, heavy_tailed, loss_kwargs, requires_cuda, warm_up_for_capture

REDUCTIONS = ("none", "mean", "sum")
SHAPE = (3, 5, 7, 11)  # (B, C, H, W): odd sizes, no power of two
WEIGHT_SHAPES = {
    "none": None,
    "same-size": SHAPE,
    "per-sample": (3, 1, 1, 1),
    "per-channel": (1, 5, 1, 1),
    "per-row": (1, 1, 7, 1),
    "channel-row": (1, 5, 7, 1),
    "mask": (3, 1, 7, 11),  # 0/1 floats
    "bool-mask": (3, 1, 7, 11),
    "0-d": (),
    "last-dim": (11,),
}
BROADCAST_WEIGHTS = [kind for kind in WEIGHT_SHAPES if kind not in ("none", "same-size")]
SCALES = ("none", "float", "tensor")
# PyTorch's losses whose function takes weight= (torch >= 2.6): name -> torch.nn.functional's function
TORCH_WEIGHTED = {
    name: row.torch_function
    for name, row in losses.LOSSES.items()
    if row.pytorch and "weight" in inspect.signature(row.torch_function).parameters
}
TORCH_HAS_WEIGHT = bool(TORCH_WEIGHTED)
# the losses whose param may be 0, where each is another loss (Smooth L1 with beta = 0 is L1)
PARAM_ZERO_LOSSES = [name for name, row in losses.LOSSES.items() if row.param_zero_is is not None]
requires_torch_weight = pytest.mark.skipif(not TORCH_HAS_WEIGHT, reason="torch < 2.6 has no weight argument")
_PRECISION_RANK = {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
FUZZ_CASES = int(os.environ.get("FUSEDLOSS_FUZZ_EXAMPLES", "150"))


# ---- the float64 reference ------------------------------------------------------------


def elementwise64(name, d, param):
    """The unweighted loss of d = input - target (float64): the table's reference of the loss
    (of the loss its param of 0 is, where it has one), of (d, 0), in float64."""
    row = losses.LOSSES[name]
    if row.param_zero_is is not None and not isinstance(param, torch.Tensor) and param == 0:
        row = losses.LOSSES[row.param_zero_is]
    assert d.dtype == torch.float64
    return row.reference(d, torch.zeros_like(d), "none", param)



def torch_case(name, input, weight):
    """PyTorch's own weighted loss (torch >= 2.6): one of TORCH_WEIGHTED (mse, l1, huber) with
    weight.size() == input.size(). fusedloss gives its values, which differ from the rule
    above in one corner: an input that the target broadcasts has a mean divided by the
    weight's own sum, not by that of the weight expanded to S."""
    return name in TORCH_WEIGHTED and weight is not None and weight.shape == input.shape


def reference64(name, input, target, reduction, weight=None, scale=None, param=None, magnitude=False,
                pytorch=None):
    """The weighted, scaled loss in float64 (differentiable in every tensor argument).

    magnitude=True: the same value, but a weighted mean N / D is differentiated as
    dN / D + N dD / D^2 (its two terms added, not subtracted), for `reference_gradients`.
    pytorch: whether this is PyTorch's own case (default: `torch_case`)."""
    pytorch = torch_case(name, input, weight) if pytorch is None else pytorch
    param = PARAMS[name] if param is None else param
    if isinstance(param, torch.Tensor):
        param = param.double()
    loss = elementwise64(name, input.double() - target.double(), param)
    shape = loss.shape
    if weight is not None:
        w = weight.double()
        loss = loss * w
        assert loss.shape == shape, "the reference takes only weights that broadcast to S"
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        if weight is None:
            loss = loss.mean()
        elif losses.LOSSES[name].weighted_mean_over_count:
            loss = loss.sum() / shape.numel()
        else:
            numerator, denominator = loss.sum(), (w if pytorch else w.expand(shape)).sum()
            loss = numerator / denominator
            if magnitude:
                loss = numerator / denominator.detach() + loss.detach() - numerator.detach() / denominator
    if scale is not None:
        loss = loss * (scale.double() if isinstance(scale, torch.Tensor) else scale)
    return loss


ARGUMENTS = ("input", "target", "weight", "scale", "param")


def reference_gradients(name, reduction, args, grad_output64):
    """For each tensor in `args` (a dict over ARGUMENTS) that requires grad: the float64
    reference's gradient, and a bound on what rounding it is relative to: the sum of the
    magnitudes of the terms that make it up. A gradient summed over broadcast elements
    (of a broadcast operand, weight or c; of a scale with reduction='none') or taken
    through a weighted mean's denominator may cancel; its rounding does not."""
    wrt = [k for k in ARGUMENTS if isinstance(args.get(k), torch.Tensor) and args[k].requires_grad]
    args64 = {k: _as64(args.get(k)) for k in ARGUMENTS}
    pytorch = torch_case(name, args64["input"], args64["weight"])
    out = reference64(name, reduction=reduction, **args64)
    grads = torch.autograd.grad(out, [args64[k] for k in wrt], grad_output64) if wrt else ()
    # The same with every differentiated tensor expanded to S: per-element terms, taken
    # in magnitude and summed back to each tensor's shape.
    shape = torch.broadcast_shapes(args["input"].shape, args["target"].shape)
    expanded = dict(args64)
    for k in wrt:
        if k != "scale" or reduction == "none":
            expanded[k] = args64[k].detach().expand(shape).clone().requires_grad_()
        else:
            expanded[k] = args64[k].detach().clone().requires_grad_()
    out = reference64(name, reduction=reduction, magnitude=True, pytorch=pytorch, **expanded)
    terms = torch.autograd.grad(out, [expanded[k] for k in wrt], grad_output64.abs()) if wrt else ()
    bounds = [t.abs().sum_to_size(args[k].shape) for k, t in zip(wrt, terms)]
    return {k: (g, b) for k, g, b in zip(wrt, grads, bounds)}


def expected_dtype(name, input, target, weight):
    keeps_input_dtype = losses.LOSSES[name].keeps_input_dtype
    dtype = input.dtype if keeps_input_dtype else torch.promote_types(input.dtype, target.dtype)
    if weight is not None and weight.is_floating_point():
        dtype = torch.promote_types(dtype, weight.dtype)
    return dtype


# ---- helpers -----------------------------------------------------------------------------


def weighted_loss(name, input, target, reduction="mean", weight=None, scale=None, param=None):
    kwargs = loss_kwargs(name, PARAMS[name] if param is None else param)
    return LOSSES[name][0](input, target, reduction=reduction, weight=weight, scale=scale, **kwargs)


def make_weight(kind, device, dtype=torch.float32, requires_grad=False, shape=None):
    """A weight of WEIGHT_SHAPES[kind] (or `shape`): values in [0.25, 1.25), or a 0/1 mask
    ("mask", "bool-mask") that is never all zero. kind "positive" takes `shape`."""
    shape = WEIGHT_SHAPES[kind] if shape is None else shape
    if shape is None:
        return None
    if kind in ("mask", "bool-mask"):
        mask = torch.rand(shape, device=device) < 0.6
        mask[(0,) * mask.dim()] = True  # never all zero: a mean stays finite
        return mask if kind == "bool-mask" else mask.to(dtype).requires_grad_(requires_grad)
    return (torch.rand(shape, device=device) + 0.25).to(dtype).requires_grad_(requires_grad)


def make_scale(kind, device, requires_grad=True, dtype=torch.float32):
    if kind == "none":
        return None
    value = torch.empty((), dtype=torch.float64).uniform_(0.25, 2.0)
    if kind == "float":
        return value.item()
    return value.to(device, dtype).requires_grad_(requires_grad)


def leaf(t, requires_grad=True):
    return t.detach().clone().requires_grad_(requires_grad)


def operands(shape, device, dtype=torch.float32, clamp=None):
    """Heavy-tailed input and target requiring grad (both branches of Smooth L1, Huber)."""
    pair = [heavy_tailed(shape, device=device) for _ in range(2)]
    if clamp is not None:
        pair = [t.clamp(-clamp, clamp) for t in pair]
    return tuple(leaf(t.to(dtype)) for t in pair)


def loosest(*dtypes):
    return max((d for d in dtypes if d in _PRECISION_RANK), key=_PRECISION_RANK.__getitem__)


def assert_close64(actual, expected64, *dtypes, msg=""):
    """`actual` against the float64 reference rounded to its dtype (a 16-bit sum may
    overflow), within conftest's tolerance of the loosest of `dtypes` and actual's; twice
    that for a 16-bit result, which may round at the loss, the weight and the scale (as
    PyTorch's own weighted losses do)."""
    __tracebackhide__ = True
    assert actual.shape == expected64.shape, (actual.shape, expected64.shape)
    rtol, atol = TOLERANCE[loosest(actual.dtype, *dtypes)]
    if actual.dtype in (torch.float16, torch.bfloat16):
        rtol, atol = 2 * rtol, 2 * atol
    expected = expected64.detach().to(actual.dtype).double().cpu()
    torch.testing.assert_close(actual.detach().double().cpu(), expected, rtol=rtol, atol=atol, equal_nan=True,
                               msg=lambda m: f"{msg}\n{m}" if msg else m)


def assert_gradient_close64(actual, expected64, *dtypes, bound=0.0, msg=""):
    """A gradient (or tangent) against float64: 4x conftest's tolerance, relative to
    |expected| + `bound` (the magnitude of the terms it sums, `reference_gradients`)."""
    __tracebackhide__ = True
    assert actual.shape == expected64.shape, (actual.shape, expected64.shape)
    rtol, atol = TOLERANCE[loosest(actual.dtype, *dtypes)]
    rtol, atol = 4 * rtol, 4 * atol
    got = actual.detach().double().cpu()
    expected = expected64.detach().to(actual.dtype).double().cpu()
    bound = torch.as_tensor(bound, dtype=torch.float64).detach().cpu()
    allowed = atol + rtol * (expected.abs() + bound)
    ok = ((got - expected).abs() <= allowed) | (got == expected) | (got.isnan() & expected.isnan())
    if not ok.all():
        worst = ((got - expected).abs() - allowed).nan_to_num(nan=float("inf")).argmax()
        index = tuple(int(i) for i in torch.unravel_index(worst, got.shape)) if got.dim() else ()
        raise AssertionError(f"{msg}: {int((~ok).sum())} of {ok.numel()} entries off; at {index}: got "
                             f"{got[index].item()!r}, expected {expected[index].item()!r}, allowed "
                             f"+-{allowed.expand_as(got)[index].item():.3g} (rtol {rtol}, atol {atol})")


def _as64(value):
    if isinstance(value, torch.Tensor):
        return value.detach().double().requires_grad_(value.requires_grad)
    return value


def _differentiable(**tensors):
    return {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor) and v.requires_grad}


def random_grad_output(like64):
    """A grad_output that is not 1 (a scale applied in place must still be right)."""
    if like64.dim() == 0:
        return torch.empty((), dtype=torch.float64).uniform_(0.5, 1.5).to(like64.device)
    return torch.randn(like64.shape, dtype=torch.float64, device=like64.device)


def check_against_reference(name, reduction, input, target, weight=None, scale=None, param=None, msg=""):
    """Value, dtype, shape, device and the gradient of every operand that requires grad."""
    __tracebackhide__ = True
    out = weighted_loss(name, input, target, reduction, weight=weight, scale=scale, param=param)
    args = dict(input=input, target=target, weight=weight, scale=scale, param=param)
    expected = reference64(name, reduction=reduction, **{k: _as64(v) for k, v in args.items()})
    got, want = (out.dtype, out.shape, out.device), (expected_dtype(name, input, target, weight), expected.shape,
                                                     input.device)
    assert got == want, f"{msg}: (dtype, shape, device) {got}, expected {want}"
    dtypes = (input.dtype, target.dtype)
    if torch_case(name, input, weight):  # PyTorch sums its weight in the weight's dtype
        dtypes += (weight.dtype,)
    assert_close64(out, expected, *dtypes, msg=f"{msg} value")
    check_gradients(name, reduction, out, args, dtypes, msg)
    return out


def check_gradients(name, reduction, out, args, dtypes, msg=""):
    __tracebackhide__ = True
    wrt = _differentiable(**args)
    if not wrt:
        return
    grad_output = random_grad_output(out.detach().double()).to(out.dtype)
    got = torch.autograd.grad(out, list(wrt.values()), grad_output)
    expected = reference_gradients(name, reduction, args, grad_output.double())
    for key, g in zip(wrt, got):
        assert (g.dtype, g.shape) == (wrt[key].dtype, wrt[key].shape), f"{msg}: gradient of {key}"
        assert_gradient_close64(g, expected[key][0], *dtypes, bound=expected[key][1], msg=f"{msg} gradient of {key}")


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


# ---- 1. values, dtypes and gradients against float64 ---------------------------------------


@pytest.mark.parametrize("scale_kind", SCALES)
@pytest.mark.parametrize("weight_kind", WEIGHT_SHAPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_against_float64(device, name, reduction, weight_kind, scale_kind):
    """Gradients of input and target; then of a floating-point weight (the fused pass's
    weight gradient); then of a tensor scale too (torch operations)."""
    input, target = operands(SHAPE, device)
    for weight_grad, scale_grad in ((False, False), (True, False), (True, True)):
        weight = make_weight(weight_kind, device, requires_grad=weight_grad)
        scale = make_scale(scale_kind, device, requires_grad=scale_grad)
        check_against_reference(name, reduction, input, target, weight, scale,
                                msg=f"weight requires grad: {weight_grad}, scale: {scale_grad}")


@pytest.mark.parametrize("forward_writes", [False, True], ids=["backward-pass", "forward-pass"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weight_kind", ["per-sample", "per-channel", "0-d"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", LOSSES)
def test_weight_over_leading_dims_takes_the_forwards_row_sums(device, monkeypatch, name, reduction, weight_kind,
                                                              dtype, forward_writes):
    """A weight over leading dimensions whose rows are long (ops.weight_row_tiling): the
    forward sums the loss of each row, and backward gives the weight's gradient from those
    sums, with no per-sample pass. Values and the gradients of input, target and weight
    against float64, where the forward writes the operands' gradients and where backward
    does."""
    if device == "cpu" and not routing.kernels_apply(torch.ones(1), torch.ones(1)):
        pytest.skip("fusedloss's plain CPU path: torch operations by design")
    if dtype == torch.bfloat16 and device != "cuda":
        pytest.skip("16-bit operands: the CUDA kernels")
    if forward_writes:
        monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", 0)
    input, target = operands((2, 3, 4, 2048), device, dtype, clamp=8.0)
    weight = make_weight("positive", device, requires_grad=True,
                         shape={"per-sample": (2, 1, 1, 1), "per-channel": (1, 3, 1, 1), "0-d": ()}[weight_kind])
    assert ops.weight_row_tiling(weight, input, target) >= 0
    with _RecordOps() as recorder:
        check_against_reference(name, reduction, input, target, weight, 0.5)
    assert any(op.startswith("fusedloss.weighted_loss") for op in recorder.ops), recorder.ops
    assert not any(op.startswith("fusedloss.per_sample_loss") for op in recorder.ops), recorder.ops


PARAM_TENSOR_LOSSES = [name for name in LOSSES if losses.LOSSES[name].takes_param_tensor]


def _param_tensor(name, shape, device):
    """Quantiles along the last dimension, or a c per sample."""
    if losses.LOSSES[name].param_zero_valid:
        return torch.rand(shape[-1:], device=device) * 0.96 + 0.02
    return torch.rand((shape[0],) + (1,) * (len(shape) - 1), device=device) + 0.25


# The target's shapes against a (6, 5, 7, 9) loss: its own, the forecasting (..., 1), one
# that broadcasts over leading and middle dimensions (a lower rank), and one value.
PARAM_TENSOR_TARGETS = {"same": (6, 5, 7, 9), "last-1": (6, 5, 7, 1), "middle": (5, 1, 9), "one": (1,)}


@pytest.mark.parametrize("forward_writes", [False, True], ids=["backward-computes", "forward-writes"])
@pytest.mark.parametrize("target_shape", PARAM_TENSOR_TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", PARAM_TENSOR_LOSSES)
def test_a_param_tensor_is_read_where_a_weight_lies(device, monkeypatch, name, reduction, dtype, target_shape,
                                                    forward_writes):
    """A tensor param (several quantiles, a c per sample): a mean or sum is the weighted
    operator's one pass, with the param read where a weight would lie, a target that
    broadcasts read where it lies too, and no torch operation over the loss's elements.
    Values and the operands' gradients against float64 at grad_outputs 1, 2^16 (1000 for
    fp16) and 0.37 (the forward's expected one, and then not), a scale too, and the same
    bits on every run."""
    if device == "cpu" and not routing.kernels_apply(torch.ones(1), torch.ones(1)):
        pytest.skip("fusedloss's plain CPU path: torch operations by design")
    if dtype in (torch.float16, torch.bfloat16) and device != "cuda":
        pytest.skip("16-bit operands: the CUDA kernels")
    if forward_writes:
        monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", 0)
    shape = (6, 5, 7, 9)
    input = operands(shape, device, dtype, clamp=30.0)[0]
    target = operands(PARAM_TENSOR_TARGETS[target_shape], device, dtype, clamp=30.0)[1]
    param = _param_tensor(name, shape, device)
    for scale in (None, 0.75):
        x64, t64 = _as64(input), _as64(target)
        expected = reference64(name, x64, t64, reduction, param=param, scale=scale)
        for grad_output in (1.0, 1000.0 if dtype == torch.float16 else 2.0 ** 16, 0.37):  # fp16 ends at 65504
            runs = []
            for _ in range(3):  # the first forward expects the last grad_output; later ones this one
                with _RecordOps() as recorder:
                    out = weighted_loss(name, input, target, reduction, scale=scale, param=param)
                assert any(op.startswith("fusedloss.weighted_loss") for op in recorder.ops), recorder.ops
                assert not any(op.split(".")[1] in ("sub", "maximum", "hypot") for op in recorder.ops), recorder.ops
                go = torch.tensor(grad_output, dtype=out.dtype, device=out.device)
                runs.append((out, *torch.autograd.grad(out, (input, target), go)))
            for run in runs[1:]:
                for got, first in zip(run, runs[0]):
                    assert torch.equal(got, first), (name, reduction, dtype, scale, grad_output)
            out, grad_input, grad_target = runs[0]
            assert out.dtype == dtype
            assert_close64(out, expected, dtype, msg="value")
            want_input, want_target = torch.autograd.grad(expected, (x64, t64), go.double(), retain_graph=True)
            assert_gradient_close64(grad_input, want_input, dtype, msg="input's gradient")
            # a broadcast target's gradient sums the input's, negated: relative to their magnitude
            bound = want_input.abs().sum_to_size(target.shape)
            assert_gradient_close64(grad_target, want_target, dtype, bound=bound, msg="target's gradient")


@requires_cuda
@pytest.mark.parametrize("forward_writes", [False, True], ids=["backward-computes", "forward-writes"])
def test_cuda_quantiles_read_a_broadcast_target_where_it_lies(cuda, monkeypatch, forward_writes):
    """Nine quantiles against a (..., 1) target: a training step allocates the input's
    gradient and small buffers, no copy of the target expanded to the loss's shape."""
    if forward_writes:
        monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", 0)
    x = torch.randn(1 << 12, 256, 9, device=cuda, requires_grad=True)
    y = torch.randn(1 << 12, 256, 1, device=cuda)
    quantiles = [0.02, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.98]
    torch.autograd.grad(fusedloss.quantile_loss(x, y, quantiles), x)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grad = torch.autograd.grad(fusedloss.quantile_loss(x, y, quantiles), x)[0]
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    n_bytes = x.numel() * x.element_size()
    assert extra < n_bytes + n_bytes // 4, f"{extra} bytes for {x.numel()} elements"
    assert grad.shape == x.shape


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_weighted_call_runs_a_fusedloss_operator(device, name, reduction):
    """On the fused path (fused-cpu, cuda) a weighted loss whose scale needs no gradient
    runs a fusedloss:: operator, with a weight that requires grad too, so the other tests
    there test the kernels."""
    if device == "cpu" and not routing.kernels_apply(torch.ones(1), torch.ones(1)):
        pytest.skip("fusedloss's plain CPU path: torch operations by design")
    input, target = operands(SHAPE, device)
    for requires_grad in (False, True):
        weight = make_weight("per-channel", device, requires_grad=requires_grad)
        with _RecordOps() as recorder:
            weighted_loss(name, input, target, reduction, weight=weight, scale=0.5)
        wanted = "fusedloss.pointwise_loss" if reduction == "none" else "fusedloss.weighted_loss"
        assert any(op.startswith(wanted) for op in recorder.ops), recorder.ops


DTYPE_CASES = [  # (operands, weight): the result is their promotion (a bool/int weight: the operands')
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float64),
    (torch.float64, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.float16, torch.bfloat16),
    (torch.float32, torch.bool),
    (torch.bfloat16, torch.bool),
    (torch.float32, torch.int64),
]


@pytest.mark.parametrize("weight_shape", [(1, 5, 1, 1), ()], ids=["per-channel", "0-d"])
@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
@pytest.mark.parametrize("name", LOSSES)
def test_dtypes(device, name, dtypes, weight_shape):
    """The result's dtype is torch.promote_types(loss dtype, weight dtype) for a floating
    weight, a 0-d one too (not PyTorch's rule for 0-d operands), and the loss's for a bool
    or integer weight; the values are float64's."""
    operand_dtype, weight_dtype = dtypes
    input, target = operands(SHAPE, device, operand_dtype, clamp=8.0)  # finite 16-bit squares
    if weight_dtype == torch.bool:
        weight = torch.rand(weight_shape, device=device) < 0.6
        weight[(0,) * weight.dim()] = True
    elif weight_dtype == torch.int64:
        weight = torch.randint(1, 4, weight_shape, device=device)  # counts
    else:
        weight = make_weight("positive", device, weight_dtype, requires_grad=True, shape=weight_shape)
    scale = make_scale("tensor", device, dtype=torch.float64)  # does not widen the result
    for reduction in REDUCTIONS:
        check_against_reference(name, reduction, input, target, weight, scale, msg=f"reduction={reduction!r}")


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize(
    "shapes",
    [((3, 5, 7, 11), (1, 5, 7, 11), (3, 1, 1, 1)),  # a target shared by the batch, per-sample weight
     ((3, 1, 7, 1), (1, 5, 1, 11), (1, 5, 7, 1)),  # both operands broadcast
     ((5, 7, 11), (3, 5, 7, 11), (3, 1, 1, 1)),  # the input broadcasts (and the weight has S's rank)
     ((3, 1, 7, 1), (3, 5, 7, 11), (3, 1, 7, 1)),  # a weight of the input's size (mse, l1, huber: PyTorch's case)
     ((7, 11), (7, 11), (7, 1))],
    ids=str,
)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_broadcast_operands(device, name, reduction, shapes):
    input_shape, target_shape, weight_shape = shapes
    input, target = (leaf(heavy_tailed(s, device=device)) for s in (input_shape, target_shape))
    weight = make_weight("per-sample", device, requires_grad=True, shape=weight_shape)
    check_against_reference(name, reduction, input, target, weight, make_scale("tensor", device))
    check_against_reference(name, reduction, input, target, weight.detach(), 0.5)


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", PARAM_ZERO_LOSSES)
def test_param_0_is_not_pytorchs_weighted_loss(device, name, reduction):
    """A loss whose param of 0 is another loss (smooth_l1_loss(beta=0) is L1) keeps its own
    weight rule: a weighted mean divides by the weight expanded to S, also when the weight
    has the size of an input that the target broadcasts (where PyTorch's own weighted
    l1_loss divides by the weight's own sum)."""
    input, target = leaf(heavy_tailed((3, 1, 7, 1), device=device)), leaf(heavy_tailed(SHAPE, device=device))
    for requires_grad in (False, True):
        weight = make_weight("positive", device, requires_grad=requires_grad, shape=(3, 1, 7, 1))
        check_against_reference(name, reduction, input, target, weight, 0.5, param=0.0,
                                msg=f"weight requires grad: {requires_grad}")


@pytest.mark.parametrize("layout", ["misaligned", "non-contiguous", "expanded-weight"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_layouts(device, name, reduction, layout):
    """Operands and weight at storage offset 1 (misaligned for vector loads), transposed,
    or a weight that is an expanded (stride-0) view."""
    n = math.prod(SHAPE)
    if layout == "misaligned":
        input, target = (heavy_tailed((n + 1,), device=device)[1:].view(SHAPE) for _ in range(2))
        weight = (torch.rand(n + 1, device=device) + 0.25)[1:].view(SHAPE)
        assert input.storage_offset() == 1
    elif layout == "non-contiguous":
        input, target = (heavy_tailed(SHAPE[::-1], device=device).permute(3, 2, 1, 0) for _ in range(2))
        weight = (torch.rand(1, 5, 1, 2, device=device) + 0.25)[..., :1]
        assert not input.is_contiguous() and not weight.is_contiguous()
    else:
        input, target = (heavy_tailed(SHAPE, device=device) for _ in range(2))
        weight = (torch.rand(5, 1, 1, device=device) + 0.25).expand(5, 7, 11)
    for scale in (None, 0.75, make_scale("tensor", device, requires_grad=False)):
        check_against_reference(name, reduction, input.requires_grad_(), target.requires_grad_(), weight, scale,
                                msg=f"scale={scale}")


SIZES = [0, 1, 4099]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weight_shape", ["same", "rows", "columns", "0-d"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_sizes(device, name, reduction, weight_shape, n):
    """Including empty operands: a mean of nothing is NaN (0 / 0), a sum 0."""
    shape = (n, 3)
    weight = make_weight("positive", device, shape={"same": (n, 3), "rows": (n, 1), "columns": (1, 3), "0-d": ()}
                         [weight_shape])
    input, target = operands(shape, device)
    for scale in (None, 1.5, make_scale("tensor", device)):
        out = check_against_reference(name, reduction, input, target, weight, scale, msg=f"scale={scale}")
        if n == 0:
            assert out.isnan().all() if reduction == "mean" else (out == 0).all()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_target_broadcasts_the_loss_to_nothing(device, name, reduction):
    """A weight of the input's size where the target broadcasts the loss to no element:
    PyTorch's weighted mean divides 0 by the weight as given, so it is 0, not NaN; any
    other mean of nothing is NaN (0 / 0), a sum 0."""
    input, target = operands((1, 3), device)[0], operands((0, 3), device)[1]
    weight = make_weight("positive", device, shape=(1, 3), requires_grad=True)
    zero = reduction == "sum" or (reduction == "mean" and torch_case(name, input, weight)
                                  and not losses.LOSSES[name].weighted_mean_over_count)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a target of another shape
        if zero or reduction == "none":
            out = check_against_reference(name, reduction, input.requires_grad_(), target, weight, None)
        else:
            out = weighted_loss(name, input, target, reduction, weight=weight)
    assert out.shape == ((0, 3) if reduction == "none" else ())
    assert (out == 0).all() if zero else out.isnan().all()


@pytest.mark.parametrize("name", LOSSES)
def test_scale_forms(device, name):
    """scale: an int, a float, a 0-d tensor of any float dtype (on CPU, too), and the
    masked mean of the spec: weight=mask, reduction='sum', scale=1/mask.sum()."""
    input, target = operands(SHAPE, device)
    mask = make_weight("mask", device)
    for scale in (2, 0.3, torch.tensor(0.3, dtype=torch.float64, device=device), torch.tensor(0.3),
                  torch.tensor(0.3, dtype=torch.bfloat16, device=device)):
        check_against_reference(name, "sum", input, target, mask, scale, msg=f"scale={scale!r}")
    mask = make_weight("mask", device, shape=SHAPE)
    masked_mean = weighted_loss(name, input, target, "sum", weight=mask, scale=1 / mask.sum())
    expected = reference64(name, input, target, "sum", mask) / mask.double().sum()
    assert_close64(masked_mean, expected)
    if not losses.LOSSES[name].weighted_mean_over_count:  # Huber's weighted mean divides by N
        assert_close64(weighted_loss(name, input, target, "mean", weight=mask), expected)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_zero_weights(device, name, reduction):
    """Zero weights drop their elements (their gradient is 0); an all-zero weight's
    mean is 0 / 0 = NaN (Huber's: 0 / N = 0)."""
    input, target = operands(SHAPE, device)
    weight = make_weight("per-sample", device)
    weight[1] = 0
    check_against_reference(name, reduction, input, target, weight, 0.5)
    out = weighted_loss(name, input, target, reduction, weight=weight, scale=0.5)
    grad = torch.autograd.grad(out.sum(), input)[0]
    assert (grad[1] == 0).all()
    zero = torch.zeros(1, 5, 1, 1, device=device)
    out = weighted_loss(name, input, target, reduction, weight=zero)
    assert_close64(out, reference64(name, input, target, reduction, zero))
    if reduction == "mean":
        assert out.isnan().item() == (not losses.LOSSES[name].weighted_mean_over_count)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_nan_and_inf_propagate(device, name, reduction):
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, float("inf"), 0.0, 2.0, 3.0],
                           device=device)
    other = torch.tensor([0.5, 1.0, 2.0, float("nan"), float("inf"), -float("inf"), 0.0, 3.0], device=device)
    for weight in (None, torch.tensor([1.0, 0.5, 2.0, 1.0, 1.0, 0.25, 0.0, 1.0], device=device),
                   torch.tensor(0.5, device=device)):
        for scale in (None, 0.5, torch.tensor(2.0, device=device)):
            if weight is None and scale is None:
                continue
            out = weighted_loss(name, special, other, reduction, weight=weight, scale=scale)
            assert_close64(out, reference64(name, special, other, reduction, weight, scale),
                           msg=f"weight={weight}, scale={scale}")


# ---- 2. PyTorch's own weighted case -----------------------------------------------------

PARITY_DTYPES = [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.bfloat16, torch.float32),
                 (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                 (torch.float32, torch.float64), (torch.float32, torch.bool)]


def _torch_kwargs(name):
    return loss_kwargs(name, PARAMS[name])


@requires_torch_weight
@pytest.mark.parametrize("dtypes", PARITY_DTYPES, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", TORCH_WEIGHTED)
def test_matches_torch_weighted(device, name, reduction, dtypes):
    operand_dtype, weight_dtype = dtypes
    input, target = operands(SHAPE, device, operand_dtype, clamp=8.0)
    if weight_dtype == torch.bool:
        weight = make_weight("bool-mask", device, shape=SHAPE)
    else:
        weight = make_weight("same-size", device, weight_dtype, requires_grad=True)
    out = weighted_loss(name, input, target, reduction, weight=weight)
    expected = TORCH_WEIGHTED[name](input, target, reduction=reduction, weight=weight, **_torch_kwargs(name))
    assert out.dtype == expected.dtype and out.shape == expected.shape and out.device == expected.device
    dtypes = (operand_dtype, weight.dtype)
    assert_close64(out, expected.double(), *dtypes)
    args = dict(input=input, target=target, weight=weight)
    wrt = _differentiable(**args)
    grad_output = random_grad_output(expected.double()).to(out.dtype)
    bounds = reference_gradients(name, reduction, args, grad_output.double())
    for key, g, w in zip(wrt, torch.autograd.grad(out, list(wrt.values()), grad_output),
                         torch.autograd.grad(expected, list(wrt.values()), grad_output)):
        assert g.dtype == w.dtype == wrt[key].dtype
        assert_gradient_close64(g, w.double(), *dtypes, bound=bounds[key][1], msg=f"gradient of {key}")


@requires_torch_weight
@pytest.mark.parametrize("name", TORCH_WEIGHTED)
def test_matches_torch_weighted_edge_cases(device, name):
    """A zero weight (0 / 0 in a mean), the legacy size_average / reduce arguments, and an
    input that the target broadcasts: PyTorch's mean then divides by the weight's own sum."""
    ours = LOSSES[name][0]
    theirs = TORCH_WEIGHTED[name]
    input, target = operands((4, 6), device)
    zero = torch.zeros(4, 6, device=device)
    cases = [(input, target, dict(weight=zero)), (input, target, dict(weight=zero, reduction="sum"))]
    if "size_average" in inspect.signature(theirs).parameters:  # not Huber's
        cases += [(input, target, dict(weight=zero + 0.5, size_average=False)),
                  (input, target, dict(weight=zero + 0.5, reduce=False))]
    small = leaf(heavy_tailed((4, 1), device=device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for reduction in REDUCTIONS:
            weight = make_weight("positive", device, shape=(4, 1))
            cases.append((small, target, dict(weight=weight, reduction=reduction)))
        for a, b, kwargs in cases:
            out = ours(a, b, **kwargs, **_torch_kwargs(name))
            expected = theirs(a, b, **kwargs, **_torch_kwargs(name))
            assert out.dtype == expected.dtype and out.shape == expected.shape, kwargs
            assert_close64(out, expected.double(), msg=str(kwargs))
            if out.requires_grad and expected.isfinite().all():
                grad_output = torch.rand_like(expected) + 0.5
                (got_a, got_b), (want_a, want_b) = (torch.autograd.grad(loss, (a, b), grad_output)
                                                    for loss in (out, expected))
                assert_gradient_close64(got_b, want_b.double(), msg=f"{kwargs}: gradient of target")
                # a's gradient sums b's over the broadcast dimension
                bound = want_b.double().abs().sum_to_size(a.shape)
                assert_gradient_close64(got_a, want_a.double(), bound=bound, msg=f"{kwargs}: gradient of input")


def _error_of(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as info:
            fn(*args, **kwargs)
    return type(info.value), str(info.value)


@requires_torch_weight
@pytest.mark.parametrize("reduction", ["average", "elementwise", "batchmean", ""])
@pytest.mark.parametrize("name", TORCH_WEIGHTED)
def test_invalid_reduction_errors_like_torch(device, name, reduction):
    x, y, w = (torch.rand(4, 3, device=device) for _ in range(3))
    ours = LOSSES[name][0]
    assert _error_of(ours, x, y, reduction=reduction, weight=w) == \
        _error_of(TORCH_WEIGHTED[name], x, y, reduction=reduction, weight=w)


@pytest.mark.parametrize("reduction", ["average", "elementwise"])
@pytest.mark.parametrize("name", LOSSES)
def test_invalid_reduction_raises(device, name, reduction):
    x, y = torch.rand(4, 3, device=device), torch.rand(4, 3, device=device)
    for weight, scale in ((torch.rand(4, 1, device=device), None), (None, 0.5),
                          (torch.rand(3, device=device), torch.tensor(2.0, device=device))):
        with pytest.raises(ValueError):
            weighted_loss(name, x, y, reduction, weight=weight, scale=scale)


# ---- 3. broadcast = expanded; errors ------------------------------------------------------


@pytest.mark.parametrize("weight_kind", BROADCAST_WEIGHTS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", LOSSES)
def test_broadcast_weight_equals_expanded(device, name, reduction, weight_kind):
    """A broadcast weight gives what weight.expand(S).contiguous() gives (for mse, l1 and
    huber (TORCH_WEIGHTED) that is PyTorch's own weighted loss): values and gradients
    of input, target and the weight."""
    input, target = operands(SHAPE, device)
    weight = make_weight(weight_kind, device, requires_grad=weight_kind != "bool-mask")
    scale = make_scale("tensor", device)
    out = weighted_loss(name, input, target, reduction, weight=weight, scale=scale)
    expanded = weighted_loss(name, input, target, reduction, weight=weight.expand(SHAPE).contiguous(), scale=scale)
    assert out.dtype == expanded.dtype
    assert_close64(out, expanded.double())
    args = dict(input=input, target=target, weight=weight, scale=scale)
    wrt = _differentiable(**args)
    grad_output = random_grad_output(out.double()).to(out.dtype)
    bounds = reference_gradients(name, reduction, args, grad_output.double())
    for key, g, e in zip(wrt, torch.autograd.grad(out, list(wrt.values()), grad_output),
                         torch.autograd.grad(expanded, list(wrt.values()), grad_output)):
        # both round: twice the bound
        assert_gradient_close64(g, e.double(), bound=2 * bounds[key][1], msg=f"gradient of {key}")


BAD_WEIGHT_SHAPES = [(4,), (5, 5), (2, 3, 5), (1, 3, 5), (3, 5, 1), (3, 2)]  # S = (3, 5)


@pytest.mark.parametrize("weight_shape", BAD_WEIGHT_SHAPES, ids=str)
@pytest.mark.parametrize("name", LOSSES)
def test_weight_that_does_not_broadcast_to_s_raises_value_error(device, name, weight_shape):
    """Not broadcastable, or broadcasting to more than S: ValueError, for every reduction."""
    x, y = torch.rand(3, 5, device=device), torch.rand(3, 5, device=device)
    for reduction in REDUCTIONS:
        for requires_grad in (False, True):
            weight = torch.rand(weight_shape, device=device).requires_grad_(requires_grad)
            with pytest.raises(ValueError):
                weighted_loss(name, x.requires_grad_(requires_grad), y, reduction, weight=weight)


@pytest.mark.parametrize("scale_shape", [(1,), (2,), (3, 5)], ids=str)
@pytest.mark.parametrize("name", LOSSES)
def test_scale_that_is_not_0d_raises_value_error(device, name, scale_shape):
    x, y = torch.rand(3, 5, device=device), torch.rand(3, 5, device=device)
    for reduction in REDUCTIONS:
        for weight in (None, torch.rand(3, 1, device=device)):
            with pytest.raises(ValueError):
                weighted_loss(name, x, y, reduction, weight=weight, scale=torch.full(scale_shape, 0.5, device=device))


@pytest.mark.parametrize("name", LOSSES)
def test_signatures(name):
    row = losses.LOSSES[name]
    parameters = inspect.signature(LOSSES[name][0]).parameters
    assert parameters["weight"].default is None
    assert parameters["scale"].default is None and parameters["scale"].kind is inspect.Parameter.KEYWORD_ONLY
    if row.param is not None:
        assert parameters[row.param].default == row.param_default
    assert parameters["reduction"].default == "mean"


# ---- 4. modules, torch.func, torch.compile, the gradient written by the forward -----------


def make_module(name, reduction):
    return getattr(fusedloss.nn, losses.LOSSES[name].module)(reduction=reduction, **loss_kwargs(name, PARAMS[name]))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_module_forward_equals_functional(device, name, reduction):
    module = make_module(name, reduction)
    input, target = operands(SHAPE, device)
    weight = make_weight("per-channel", device, requires_grad=True)
    scale = make_scale("tensor", device)
    for args, kwargs in [((), {}), ((), dict(weight=weight)), ((weight,), {}), ((), dict(scale=scale)),
                         ((), dict(weight=weight, scale=scale)), ((weight,), dict(scale=0.25)),
                         ((), dict(weight=weight.detach(), scale=scale.detach()))]:
        out = module(input, target, *args, **kwargs)
        call = dict(zip(["weight"], args), **kwargs)
        expected = weighted_loss(name, input, target, reduction, weight=call.get("weight"), scale=call.get("scale"))
        assert torch.equal(out, expected), call
        wrt = list(_differentiable(input=input, target=target, **call).values())
        grad_output = torch.rand_like(out) + 0.5
        for g, e in zip(torch.autograd.grad(out, wrt, grad_output), torch.autograd.grad(expected, wrt, grad_output)):
            assert torch.equal(g, e), call


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_torch_func_transforms(device, name, reduction):
    """grad, per-sample gradients (vmap of grad), vmap, jvp and jacrev of a loss with a
    broadcast weight and a 0-d tensor scale, against the same transforms of the float64
    reference (torch operations)."""
    x, y = (heavy_tailed((4, 3, 5), device=device) for _ in range(2))
    w = torch.rand(3, 1, device=device) + 0.25  # broadcasts to a sample (3, 5) and to the batch
    s = torch.tensor(0.6, device=device)

    def ours(x, y, w, s):
        return weighted_loss(name, x, y, reduction, weight=w, scale=s)

    def plain(x, y, w, s):
        return reference64(name, x, y, reduction, w, s)

    def scalar(fn):
        return lambda *args: fn(*args).sum()

    def bounds(x, y, keys):
        """reference_gradients' bounds for d sum(loss) / d keys (grad_output 1)."""
        args = dict(input=leaf(x), target=leaf(y), weight=leaf(w), scale=leaf(s))
        ones = torch.ones(x.shape if reduction == "none" else (), dtype=torch.float64, device=device)
        found = reference_gradients(name, reduction, args, ones)
        return [found[k][1] for k in keys]

    def close(got, want, bound, what):
        assert len(got) == len(want) == len(bound)
        for g, e, b in zip(got, want, bound):
            assert g.dtype == torch.float32, what
            assert_gradient_close64(g, e, bound=b, msg=what)

    keys = ("input", "target", "weight", "scale")
    close(torch.func.grad(scalar(ours), argnums=(0, 1, 2, 3))(x, y, w, s),
          torch.func.grad(scalar(plain), argnums=(0, 1, 2, 3))(x, y, w, s), bounds(x, y, keys), "grad")

    per_sample = lambda fn: torch.func.vmap(torch.func.grad(scalar(fn), argnums=(0, 2, 3)),  # noqa: E731
                                            in_dims=(0, 0, None, None))
    per_sample_bounds = [torch.stack(b) for b in zip(*(bounds(x[i], y[i], ("input", "weight", "scale"))
                                                         for i in range(len(x))))]
    close(per_sample(ours)(x, y, w, s), per_sample(plain)(x, y, w, s), per_sample_bounds, "vmap(grad)")

    batched = lambda fn: torch.func.vmap(fn, in_dims=(0, 0, 0, None))  # noqa: E731  (a weight per sample)
    w_per_sample = torch.rand(4, 3, 1, device=device) + 0.25
    assert_close64(batched(ours)(x, y, w_per_sample, s), batched(plain)(x, y, w_per_sample, s), msg="vmap")

    primals = (x, w, s)
    tangents = tuple(torch.randn_like(t) for t in primals)
    out, tangent = torch.func.jvp(lambda a, b, c: ours(a, y, b, c), primals, tangents)
    expected, expected_tangent = torch.func.jvp(lambda a, b, c: plain(a, y, b, c), primals, tangents)
    assert_close64(out, expected, msg="jvp value")
    if reduction == "none":  # each element's tangent: a term per argument
        bound = sum(torch.func.jvp(lambda a, b, c: plain(a, y, b, c), primals,
                                   tuple(t if i == k else torch.zeros_like(t) for i, t in enumerate(tangents)))[1].abs()
                    for k in range(3))
    else:
        bound = sum((b * t.abs()).sum() for b, t in zip(bounds(x, y, ("input", "weight", "scale")), tangents))
    assert_gradient_close64(tangent, expected_tangent, bound=bound, msg="jvp tangent")
    assert tangent.abs().sum() > 0

    # 'none': each entry of the Jacobian is one term; a mean or sum's Jacobian is its gradient
    jacobian_bounds = [0.0, 0.0] if reduction == "none" else bounds(x, y, ("input", "weight"))
    close(torch.func.jacrev(ours, argnums=(0, 2))(x, y, w, s), torch.func.jacrev(plain, argnums=(0, 2))(x, y, w, s),
          jacobian_bounds, "jacrev")


def test_compiled_weighted_step(device):
    """torch.compile(fullgraph=True) of a function calling every weighted loss, with the
    scale a tensor whose value changes between calls (no recompile may freeze it)."""
    backend = "inductor" if device == "cuda" else "aot_eager"  # aot_eager: no C++ build on the CPU
    torch._dynamo.reset()
    weight = make_weight("per-channel", device)

    def step(x, y, w, s):
        total = 0
        for name in LOSSES:
            total = total + weighted_loss(name, x, y, "mean", weight=w, scale=s)
            total = total + weighted_loss(name, x, y, "none", weight=w, scale=0.5).sum() * 1e-3
        return total

    def reference(x, y, w, s):
        total = 0
        for name in LOSSES:
            total = total + reference64(name, x, y, "mean", w, s)
            total = total + reference64(name, x, y, "none", w, 0.5).sum() * 1e-3
        return total

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for value in (0.5, 2.0, 1.0):
        x, y = operands(SHAPE, device)
        scale = torch.tensor(value, device=device)
        out = compiled(x, y, weight, scale)
        x64 = _as64(x)
        expected = reference(x64, y.detach().double(), weight, scale)
        assert_close64(out, expected, msg=f"scale {value}")
        (grad,) = torch.autograd.grad(out, x)
        assert_gradient_close64(grad, torch.autograd.grad(expected, x64)[0], msg=f"scale {value}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", LOSSES)
def test_gradient_in_the_forward_gives_the_same_bits(device, name, reduction, monkeypatch):
    """FUSED_GRADIENT_FROM_BYTES = 0: the forward writes the gradient even for small
    operands; huge: backward computes it. Same bits either way, for grad_output 1 and not 1."""
    assert routing.FUSED_GRADIENT_FROM_BYTES > 0
    input, target = operands((3, 4099), device)
    weight = make_weight("per-sample", device, shape=(3, 1))
    scale = torch.tensor(0.7, device=device)
    results = {}
    for threshold in (0, 1 << 62):
        monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", threshold)
        for grad_output in (1.0, 0.37):
            out = weighted_loss(name, input, target, reduction, weight=weight, scale=scale)
            results[threshold, grad_output] = (out, *torch.autograd.grad(out * grad_output, (input, target)))
    for grad_output in (1.0, 0.37):
        for a, b in zip(results[0, grad_output], results[1 << 62, grad_output]):
            assert torch.equal(a, b), f"grad_output {grad_output}"
    expected = reference64(name, input, target, reduction, weight, scale)
    assert_close64(results[0, 1.0][0], expected)


# ---- 5. CUDA only ------------------------------------------------------------------------


@pytest.fixture
def cuda():
    build.load()  # the kernels, or an error (not a silent fallback to torch)
    return "cuda"


CUDA_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
               (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16),
               (torch.float16, torch.float16)]


@requires_cuda
@pytest.mark.parametrize("dtypes", CUDA_DTYPES, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_dtypes(cuda, name, reduction, dtypes):
    operand_dtype, weight_dtype = dtypes
    input, target = operands(SHAPE, cuda, operand_dtype, clamp=8.0)
    for weight_kind in ("none", "same-size", "per-sample", "per-channel", "mask", "bool-mask", "0-d", "last-dim"):
        for requires_grad in (False, True):
            weight = make_weight(weight_kind, cuda, weight_dtype, requires_grad=requires_grad)
            for scale in (None, 0.5, make_scale("tensor", cuda, requires_grad=requires_grad)):
                if weight is None and scale is None:
                    continue
                check_against_reference(name, reduction, input, target, weight, scale,
                                        msg=f"weight {weight_kind}, requires grad: {requires_grad}, scale: {scale!r}")


CUDA_SIZES = [0, 1, 4099, (1 << 20) + 3]


@requires_cuda
@pytest.mark.parametrize("n", CUDA_SIZES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_sizes(cuda, name, reduction, n):
    for shape, weight_shape in (((n,), (n,)), ((n,), ()), ((n, 2), (n, 1)), ((2, n), (2, 1)), ((n, 3), (1, 3))):
        input, target = operands(shape, cuda)
        for dtype in (torch.float32, torch.bfloat16):
            weight = make_weight("positive", cuda, dtype, shape=weight_shape)
            check_against_reference(name, reduction, input, target, weight, make_scale("tensor", cuda, False),
                                    msg=f"{shape}, weight {weight_shape} {dtype}")


@requires_cuda
@pytest.mark.parametrize("operand_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("weight_dtype", [None, torch.float32, torch.bfloat16, torch.bool], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_autocast(cuda, name, reduction, weight_dtype, operand_dtype):
    """Under bf16 autocast: a float32 result (promoted with a floating weight's dtype), the
    loss of the operands as float32; gradients in the operands' dtypes."""
    input, target = operands((3, 4099), cuda, operand_dtype, clamp=8.0)
    if weight_dtype is None:
        weight = None
    elif weight_dtype == torch.bool:
        weight = make_weight("bool-mask", cuda, shape=(3, 1))
    else:
        weight = make_weight("positive", cuda, weight_dtype, shape=(3, 1))
    scale = make_scale("tensor", cuda, requires_grad=False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = weighted_loss(name, input, target, reduction, weight=weight, scale=scale)
    assert out.dtype == torch.float32
    x64, y64 = _as64(input.float()), _as64(target.float())
    expected = reference64(name, x64, y64, reduction, weight, scale)
    assert_close64(out, expected, torch.float32)
    grad_output = random_grad_output(expected).float()
    grads = torch.autograd.grad(out, (input, target), grad_output)
    for g, e, t in zip(grads, torch.autograd.grad(expected, (x64, y64), grad_output.double()), (input, target)):
        assert g.dtype == t.dtype
        assert_gradient_close64(g, e, t.dtype)


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_scale_on_the_cpu(cuda, name):
    input, target = operands(SHAPE, cuda)
    for reduction in REDUCTIONS:
        check_against_reference(name, reduction, input, target, make_weight("per-channel", cuda),
                                make_scale("tensor", "cpu", requires_grad=False))


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_compiled_weighted_step_matches_eager(cuda, name):
    torch._dynamo.reset()
    input, target = operands((64, 4099), cuda)
    weight = make_weight("positive", cuda, shape=(64, 1))

    def step(x, y, w, s):
        return weighted_loss(name, x, y, "mean", weight=w, scale=s)

    compiled = torch.compile(step, fullgraph=True)
    for value in (0.5, 3.0):
        s = torch.tensor(value, device=cuda)
        out, eager = compiled(input, target, weight, s), step(input, target, weight, s)
        assert_close64(out, eager.double())
        assert_gradient_close64(torch.autograd.grad(out, input)[0], torch.autograd.grad(eager, input)[0].double())
        assert_close64(out, reference64(name, input, target, "mean", weight, s))


@requires_cuda
@pytest.mark.parametrize("weight_grad", [False, True], ids=["fixed-weight", "learned-weight"])
@pytest.mark.parametrize("threshold", [0, 1 << 62], ids=["gradient-in-forward", "gradient-in-backward"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_graph_replay_reads_the_new_scale(cuda, name, reduction, threshold, weight_grad, monkeypatch):
    """A captured step replays with the scale and operands it finds, the weight's own
    gradient too where the weight requires grad."""
    monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", threshold)
    for shape in ((3, 4099), (3, (1 << 20) + 3)):
        x, y = operands(shape, cuda)
        weight = make_weight("positive", cuda, shape=(3, 1), requires_grad=weight_grad)
        scale = torch.tensor(0.5, device=cuda)

        def step():
            x.grad = y.grad = weight.grad = None
            out = weighted_loss(name, x, y, reduction, weight=weight, scale=scale)
            out.sum().backward()
            return out, x.grad, y.grad, weight.grad

        warm_up_for_capture(step)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = step()
        for value in (0.75, 1.0, -2.0, 3.5):
            with torch.no_grad():
                x.copy_(heavy_tailed(shape, device=cuda))
                y.copy_(heavy_tailed(shape, device=cuda))
                scale.fill_(value)
            graph.replay()
            x64, y64 = _as64(x), _as64(y)
            expected = reference64(name, x64, y64, reduction, weight, value)
            msg = f"{shape}, scale {value}"
            assert_close64(static[0], expected, msg=msg)
            for g, e in zip(static[1:3], torch.autograd.grad(expected.sum(), (x64, y64))):
                assert_gradient_close64(g, e, msg=msg)
            if weight_grad:
                want = reference_gradients(name, reduction, dict(input=x, target=y, weight=weight, scale=value),
                                           torch.ones_like(expected))["weight"]
                assert_gradient_close64(static[3], want[0], bound=want[1], msg=f"{msg}, weight")


@requires_cuda
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_weighted_step_has_no_host_sync(cuda, name, reduction):
    """No step syncs: fixed weights, a mask, and a learned weight (its gradient, and a
    weighted mean's divisor's part)."""
    cases = []
    for shape in ((3, 4099), (3, (1 << 20) + 3)):
        x, y = operands(shape, cuda)
        cases.append((x, y, make_weight("positive", cuda, shape=(3, 1)), torch.tensor(0.5, device=cuda)))
    cases.append((*operands(SHAPE, cuda), make_weight("mask", cuda), torch.tensor(2.0, device=cuda)))
    for shape in ((3, 4099), (3, (1 << 20) + 3)):
        cases.append((*operands(shape, cuda), make_weight("positive", cuda, shape=(3, 1), requires_grad=True), None))

    def step(x, y, w, s):
        x.grad = y.grad = w.grad = None
        weighted_loss(name, x, y, reduction, weight=w, scale=s).sum().backward()

    for case in cases:  # warm-up: kernels loaded, notes allocated
        step(*case)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for case in cases:
            step(*case)
            step(*case)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x, y, w, s = cases[-1]
    x64, y64 = _as64(x), _as64(y)
    expected = reference64(name, x64, y64, reduction, w, s)
    for g, e in zip((x.grad, y.grad), torch.autograd.grad(expected.sum(), (x64, y64))):
        assert_gradient_close64(g, e)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_same_bits_twice(cuda, name, reduction, dtype):
    for shape, weight_kind in (((3, 4099), "per-sample"), ((3, (1 << 20) + 3), "per-sample"), (SHAPE, "mask")):
        x, y = operands(shape, cuda, dtype, clamp=8.0)
        weight = make_weight(weight_kind, cuda, shape=(3, 1) if len(shape) == 2 else None)
        scale = torch.tensor(0.3, device=cuda)
        runs = []
        for _ in range(2):
            out = weighted_loss(name, x, y, reduction, weight=weight, scale=scale)
            runs.append((out, *torch.autograd.grad(out.sum(), (x, y))))
        for a, b in zip(*runs):
            assert torch.equal(a, b), shape


@requires_cuda
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_large_gradient_written_by_the_forward(cuda, name, reduction, monkeypatch, gpu_to_itself):
    """2**25 float32 elements: operands past FUSED_GRADIENT_FROM_BYTES, so the forward
    writes the gradient; the same bits as backward computing it, and float64's values."""
    shape = (8, 4, 1 << 20)
    x, y = operands(shape, cuda)
    assert x.numel() >= 1 << 25
    assert x.numel() * (x.element_size() + y.element_size()) >= routing.FUSED_GRADIENT_FROM_BYTES
    weight = make_weight("positive", cuda, shape=(1, 4, 1))
    scale = torch.tensor(0.25, device=cuda)
    results = []
    for threshold in (routing.FUSED_GRADIENT_FROM_BYTES, 1 << 62):
        monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", threshold)
        out = weighted_loss(name, x, y, reduction, weight=weight, scale=scale)
        results.append((out, *torch.autograd.grad(out, (x, y))))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    x64, y64 = _as64(x), _as64(y)
    expected = reference64(name, x64, y64, reduction, weight, scale)
    assert_close64(results[0][0], expected)
    assert_gradient_close64(results[0][1], torch.autograd.grad(expected, x64)[0])


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weight_shape", ["full", (1, 4, 1), ()], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["mse", "pseudo_huber"])
def test_cuda_weight_gradient_written_by_the_forward(cuda, name, reduction, weight_shape, dtype, monkeypatch,
                                                    gpu_to_itself):
    """A weight that requires grad: the forward's pass writes its gradient beside the
    input's (operands past FUSED_GRADIENT_FROM_BYTES), with the same bits as backward
    computing it, for grad_output 1 and not 1, and float64's values; the weighted mean's
    divisor adds its part. Wanted alone (no operand's gradient), it is computed with torch
    operations, to the same values."""
    # just past the threshold, for either dtype
    shape = (8, 4, routing.FUSED_GRADIENT_FROM_BYTES // (32 * 2 * dtype.itemsize))
    weight_shape = shape if weight_shape == "full" else weight_shape
    x, y = operands(shape, cuda, dtype)
    y.requires_grad_(False)
    assert x.numel() * (x.element_size() + y.element_size()) >= routing.FUSED_GRADIENT_FROM_BYTES
    weight = make_weight("positive", cuda, requires_grad=True, shape=weight_shape)
    scale = torch.tensor(0.25, device=cuda)
    for times in (1.0, 0.37):
        results = []
        for threshold in (routing.FUSED_GRADIENT_FROM_BYTES, 1 << 62):
            monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", threshold)
            out = weighted_loss(name, x, y, reduction, weight=weight, scale=scale)
            results.append((out, *torch.autograd.grad(out * times, (x, weight))))
        for a, b, what in zip(*results, ("loss", "grad input", "grad weight")):
            assert torch.equal(a, b), f"{what}, grad_output {times}"
    expected = reference_gradients(name, reduction, dict(input=x, target=y, weight=weight, scale=scale),
                                   torch.tensor(times, dtype=torch.float64, device=cuda))
    assert_gradient_close64(results[0][1], expected["input"][0], dtype, bound=expected["input"][1])
    assert_gradient_close64(results[0][2], expected["weight"][0], dtype, bound=expected["weight"][1], msg="weight")
    out = weighted_loss(name, x.detach(), y, reduction, weight=weight, scale=scale)
    alone = torch.autograd.grad(out * times, weight)[0]
    assert_gradient_close64(alone, expected["weight"][0], dtype, bound=expected["weight"][1], msg="weight alone")


@requires_cuda
def test_cuda_weight_gradient_pass_writes_no_copy(cuda):
    """With the weight's gradient fused, a training step of a weighted mean allocates the
    gradients it returns and the weight's per-element gradient, nothing more of N."""
    shape = (8, 4, 1 << 20)
    x, y = operands(shape, cuda)
    y.requires_grad_(False)
    weight = make_weight("positive", cuda, requires_grad=True, shape=(1, 4, 1))
    out = weighted_loss("mse", x, y, "mean", weight=weight)  # warm-up
    torch.autograd.grad(out, (x, weight))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = weighted_loss("mse", x, y, "mean", weight=weight)
    grads = torch.autograd.grad(out, (x, weight))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    n_bytes = x.numel() * x.element_size()
    # grad input (N) + the weight's per-element gradient (N float32) + small buffers
    assert extra < 2 * n_bytes + n_bytes // 8, f"{extra} bytes for {x.numel()} elements"
    assert grads[1].shape == weight.shape


# (loss shape, weight shape): the weight's runs of dimensions (ElementWeight) one to four,
# innermost runs long and short, of a multiple of 8 weights (vector loads) or not, shorter
# than a chunk (every chunk walks), and five or six runs (expanded over their shortest
# broadcast runs first).
WEIGHT_LAYOUTS = [
    ((6, 5, 8, 16), (6, 1, 8, 16)),  # a spatial mask
    ((6, 5, 8, 16), (1, 5, 1, 16)),
    ((6, 5, 8, 16), (6, 5, 1, 16)),
    ((6, 5, 8, 16), (6, 1, 8, 1)),  # four runs
    ((3, 4, 5, 6, 7), (3, 1, 5, 1, 1)),  # a per-frame weight of a video loss, four runs
    ((3, 4, 5, 6, 7), (3, 1, 5, 1, 7)),  # five
    ((2, 3, 4, 5, 6, 7), (2, 1, 4, 1, 6, 1)),  # six
    ((4, 3, 5, 7), (4, 1, 5, 7)),
    ((2, 3, 2, 3), (2, 1, 2, 3)),
    ((5, 3, 1000, 3), (1, 3, 1, 3)),
    ((7, 9, 33), (7, 1, 33)),
    ((1001, 3), (3,)),
    ((3, 1, 4099), (3, 1, 1)),
    ((2, 4096, 1, 8), (1, 4096, 1, 8)),
]


@requires_cuda
@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float16,) * 2,
                                    (torch.float64,) * 2, (torch.float32, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("layout", WEIGHT_LAYOUTS, ids=str)
@pytest.mark.parametrize("name", ["mse", "smooth_l1"])
def test_cuda_weight_read_in_place_has_the_expanded_weights_bits(cuda, name, layout, dtypes, monkeypatch):
    """A broadcast weight read where it lies gives the bits of the same weight expanded to
    the loss's size (read as a dense weight): the sum, and both gradients, written in the
    forward's pass and in backward's."""
    shape, weight_shape = layout
    x, y = operands(shape, cuda, dtypes[0])
    y = leaf(y.to(dtypes[1]))
    weight = make_weight("positive", cuda, torch.float64 if dtypes[0] == torch.float64 else torch.float32,
                         shape=weight_shape)
    for threshold in (0, 1 << 62):
        monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", threshold)
        results = []
        for w in (weight, weight.expand(shape).contiguous()):
            out = weighted_loss(name, x, y, "sum", weight=w, scale=0.5)
            results.append((out, *torch.autograd.grad(out, (x, y))))
        for a, b, what in zip(*results, ("loss", "grad input", "grad target")):
            assert torch.equal(a, b), f"{what}, fused gradient threshold {threshold}"
    x64, y64 = _as64(x), _as64(y)
    expected = reference64(name, x64, y64, "sum", weight, 0.5)
    assert_close64(results[0][0], expected, *dtypes)
    assert_gradient_close64(results[0][1], torch.autograd.grad(expected, x64)[0])


@requires_cuda
def test_cuda_weight_read_in_place_past_32_bit_indices(cuda):
    """Past 2^32 elements the kernels index the weight in 64 bits (ElementWeight::index_32bit):
    a weight whose only run is shorter than a chunk, so that every chunk walks across runs,
    gives the bits of the same weight expanded, the sum and the input's gradient."""
    if torch.cuda.get_device_properties(cuda).total_memory < 80 * 2**30:
        pytest.skip("needs a GPU of 80 GiB")
    rows = (1 << 31) + 13
    x = leaf(torch.randn(rows, 2, device=cuda, dtype=torch.bfloat16))
    y = torch.randn(rows, 2, device=cuda, dtype=torch.bfloat16)
    weight = make_weight("positive", cuda, shape=(2,))
    results = []
    for w in (weight, weight.expand(rows, 2).contiguous()):
        out = weighted_loss("mse", x, y, "sum", weight=w)
        results.append((out, *torch.autograd.grad(out, x)))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def _no_grad_loss_and_its_memory(name, x, y, reduction, weight):
    """The weighted loss without gradients (scale 0.5), and the most memory it allocated
    beyond what was allocated before, after a warm-up call."""
    with torch.no_grad():
        weighted_loss(name, x, y, reduction, weight=weight, scale=0.5)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = weighted_loss(name, x, y, reduction, weight=weight, scale=0.5)
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - before


@requires_cuda
@pytest.mark.parametrize("weight_kind", ["per-sample", "per-channel", "channel-row", "0-d", "spatial-mask",
                                         "channel-column", "sample-row", "own-size"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_broadcast_weight_is_never_expanded(cuda, name, reduction, weight_kind):
    """A mean or sum with a weight allocates nothing of the operands' size: a broadcast
    weight is not expanded, and the weighted mean sums any weight where it lies."""
    shape = (4, 5, 7, 1 << 15)
    x, y = operands(shape, cuda)
    weight = make_weight("positive", cuda, shape={"per-sample": (4, 1, 1, 1), "per-channel": (1, 5, 1, 1),
                                           "channel-row": (1, 5, 7, 1), "0-d": (), "sample-row": (4, 1, 7, 1),
                                           "spatial-mask": (4, 1, 7, 1 << 15),
                                           "channel-column": (1, 5, 1, 1 << 15), "own-size": shape}[weight_kind])
    out, extra = _no_grad_loss_and_its_memory(name, x, y, reduction, weight)
    assert extra < x.numel() * x.element_size() // 8, f"{extra} bytes for {x.numel()} elements"
    assert_close64(out, reference64(name, x, y, reduction, weight, 0.5))


@requires_cuda
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_weight_of_more_runs_is_expanded_over_its_shortest_broadcast(cuda, name, reduction):
    """A weight of more runs than the kernels take (W, H, T, C and B alternate between
    spanned and broadcast) is expanded over its shortest broadcast run only, H, which
    merges T, H and W into one run: N / C weights, not N."""
    shape = (4, 16, 5, 8, 1 << 12)  # (B, C, T, H, W)
    x, y = operands(shape, cuda)
    weight = make_weight("positive", cuda, shape=(4, 1, 5, 1, 1 << 12))
    out, extra = _no_grad_loss_and_its_memory(name, x, y, reduction, weight)
    assert extra < x.numel() * x.element_size() // 8, f"{extra} bytes for {x.numel()} elements"
    assert_close64(out, reference64(name, x, y, reduction, weight, 0.5))


# ---- 6. fuzzing ----------------------------------------------------------------------------


def _random_case(rng, device):
    name = rng.choice(list(LOSSES))
    reduction = rng.choice(REDUCTIONS)
    dtypes = [torch.float32, torch.float64] + ([torch.bfloat16, torch.float16] if device == "cuda" else [])
    dtype = rng.choice(dtypes)
    shape = [rng.choice([1, 2, 3, 5, 7, 13]) for _ in range(rng.randint(0, 4))]
    if shape and rng.random() < 0.05:
        shape[rng.randrange(len(shape))] = 0
    input_shape, target_shape = list(shape), list(shape)
    for dims in (input_shape, target_shape):
        if rng.random() < 0.2:
            for k in range(len(dims)):
                if rng.random() < 0.4:
                    dims[k] = 1
    s = list(torch.broadcast_shapes(input_shape, target_shape))
    weight_dtype = rng.choice([None, torch.float32, torch.float32, dtype, torch.bool])
    weight_shape = [1 if rng.random() < 0.5 else n for n in s][rng.randint(0, len(s)):] if rng.random() < 0.3 \
        else [1 if rng.random() < 0.5 else n for n in s]
    row = losses.LOSSES[name]
    param = None  # the loss has none, or PARAMS'
    if row.param is not None:  # 0 where it is another loss (Smooth L1's beta = 0: L1), else around the default
        param = rng.choice([p for p in [0.0] + [f * row.param_default for f in (0.1, 0.5, 1, 3)] if row.param_valid(p)])
    return dict(name=name, reduction=reduction, dtype=dtype, input_shape=input_shape, target_shape=target_shape,
                weight_dtype=weight_dtype, weight_shape=weight_shape, param=param,
                zeros_in_weight=rng.random() < 0.3, special_values=rng.random() < 0.2,
                requires_grad=[rng.random() < 0.7 for _ in range(4)],
                scale=rng.choice(["none", "float", "tensor", "tensor64"]))


def _run_case(case, device):
    __tracebackhide__ = True
    clamp = 8.0 if case["dtype"] in (torch.float16, torch.bfloat16) else None
    values = []
    for shape in (case["input_shape"], case["target_shape"]):
        t = heavy_tailed(tuple(shape), device=device)
        t = t.clamp(-clamp, clamp) if clamp else t
        if case["special_values"] and t.numel():
            flat = t.view(-1)
            for value in (float("nan"), float("inf"), -float("inf")):
                flat[torch.randint(0, t.numel(), (1,))] = value
        values.append(t.to(case["dtype"]))
    input, target = (leaf(t, g) for t, g in zip(values, case["requires_grad"]))
    weight = None
    if case["weight_dtype"] is not None:
        shape = tuple(case["weight_shape"])
        w = torch.rand(shape, device=device) + 0.25
        if case["zeros_in_weight"]:
            w = w * (torch.rand(shape, device=device) < 0.5)
        weight = w > 0.5 if case["weight_dtype"] == torch.bool else leaf(w.to(case["weight_dtype"]),
                                                                          case["requires_grad"][2])
    scale = {"none": None, "float": 0.625, "tensor": torch.tensor(1.75, device=device),
             "tensor64": torch.tensor(0.375, dtype=torch.float64, device=device)}[case["scale"]]
    if isinstance(scale, torch.Tensor):
        scale.requires_grad_(case["requires_grad"][3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a target of another shape
        out = weighted_loss(case["name"], input, target, case["reduction"], weight=weight, scale=scale,
                            param=case["param"])
    expected = reference64(case["name"], *map(_as64, (input, target)), case["reduction"], *map(_as64, (weight, scale)),
                           param=case["param"])
    got, want = out.dtype, expected_dtype(case["name"], input, target, weight)
    assert got == want, f"result dtype {got}, expected {want}"
    dtypes = (input.dtype,)
    if torch_case(case["name"], input, weight):  # PyTorch sums its weight in the weight's dtype
        dtypes += (weight.dtype,)
    assert_close64(out, expected, *dtypes, msg="value")
    if not case["special_values"] and expected.isfinite().all():
        args = dict(input=input, target=target, weight=weight, scale=scale, param=case["param"])
        check_gradients(case["name"], case["reduction"], out, args, dtypes)


def test_fuzz(device, fresh_seed):
    rng = random.Random(fresh_seed)
    for i in range(FUZZ_CASES):
        case = _random_case(rng, device)
        try:
            _run_case(case, device)
        except Exception as error:
            raise AssertionError(f"seed {fresh_seed}, case {i}: {case}\n{type(error).__name__}: {error}") from None
