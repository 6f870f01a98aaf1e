"""The pseudo-Huber loss: 2c(sqrt(d^2 + c^2) - c) per element, d = input - target.

Checked against that formula evaluated in float64 with torch operations (written here,
independent of fusedloss's code): values, the gradient 2c d / sqrt(d^2 + c^2), c as a
float and as a tensor (kohya's per-sample c, which gets its own gradient), NaN and inf,
the module, torch.func transforms, weight= and scale= (test_weighted.py covers those
for every loss), and the error for a float c <= 0.

Devices as in test_weighted.py: "cpu" (fusedloss's CPU path), "fused-cpu" (the fusedloss::
operators' CPU kernels, conftest's `fused_cpu`), "cuda" (the kernels; skips without a GPU).
"""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch

import fusedloss
import fusedloss.nn
from fusedloss import build, functional

from conftest import TOLERANCE, heavy_tailed, requires_cuda

REDUCTIONS = ("none", "mean", "sum")
SHAPE = (3, 5, 7, 11)
C_VALUES = (0.05, 0.5, 1.0, 3.0)
_PRECISION_RANK = {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


# ---- the float64 formula -----------------------------------------------------------------


def pseudo_huber64(input, target, c, reduction="none", weight=None, scale=None):
    """2c(sqrt(d^2 + c^2) - c) in float64; a weighted mean divides by the sum of the weight
    expanded to the loss's shape; scale multiplies the result."""
    d = input.double() - target.double()
    c = c.double() if isinstance(c, torch.Tensor) else c
    root = torch.sqrt(d * d + c * c)
    # Within |d| <= c, as 2c d^2 / (root + c): the same value, without float64's own
    # cancellation for |d| << c.
    loss = 2 * c * torch.where(d.abs() <= c, d * d / (root + c), root - c)
    shape = loss.shape
    if weight is not None:
        loss = loss * weight.double()
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.mean() if weight is None else loss.sum() / weight.double().expand(shape).sum()
    if scale is not None:
        loss = loss * (scale.double() if isinstance(scale, torch.Tensor) else scale)
    return loss


def gradient64(input, target, c):
    """d loss_e / d input_e = 2c d / sqrt(d^2 + c^2), per element, in float64."""
    d = input.double() - target.double()
    c = c.double() if isinstance(c, torch.Tensor) else c
    return 2 * c * d / torch.sqrt(d * d + c * c)


# ---- helpers -----------------------------------------------------------------------------


def leaf(t, requires_grad=True):
    return t.detach().clone().requires_grad_(requires_grad)


def _as64(t):
    return t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t


def assert_close64(actual, expected64, *dtypes, rtol_factor=1, msg=""):
    """Against float64 rounded to actual's dtype, within conftest's tolerance of the
    loosest of actual's dtype and `dtypes` (times rtol_factor)."""
    __tracebackhide__ = True
    assert actual.shape == expected64.shape, (actual.shape, expected64.shape)
    dtype = max((actual.dtype, *dtypes), key=_PRECISION_RANK.__getitem__)
    rtol, atol = TOLERANCE[dtype]
    expected = expected64.detach().to(actual.dtype).double().cpu()
    torch.testing.assert_close(actual.detach().double().cpu(), expected, rtol=rtol_factor * rtol,
                               atol=rtol_factor * atol, equal_nan=True, msg=lambda m: f"{msg}\n{m}" if msg else m)


def operands(shape, device, dtype=torch.float32, clamp=None):
    pair = [heavy_tailed(shape, device=device) for _ in range(2)]
    if clamp is not None:
        pair = [t.clamp(-clamp, clamp) for t in pair]
    return tuple(leaf(t.to(dtype)) for t in pair)


def per_sample_c(device, dtype=torch.float32, requires_grad=True, shape=(3, 1, 1, 1)):
    """kohya's per-sample c: one value per sample, between 0.05 and 2."""
    return leaf((torch.rand(shape, device=device) * 1.95 + 0.05).to(dtype), requires_grad)


# ---- API ------------------------------------------------------------------------------------


def test_exported():
    assert fusedloss.pseudo_huber_loss is functional.pseudo_huber_loss
    assert "pseudo_huber_loss" in fusedloss.__all__
    assert issubclass(fusedloss.nn.PseudoHuberLoss, torch.nn.modules.loss._Loss)


def test_signature():
    parameters = inspect.signature(fusedloss.pseudo_huber_loss).parameters
    assert list(parameters) == ["input", "target", "c", "reduction", "weight", "scale", "dim", "keepdim"]
    assert parameters["c"].default == 1.0 and parameters["reduction"].default == "mean"
    assert parameters["weight"].default is None and parameters["scale"].default is None
    assert parameters["scale"].kind is inspect.Parameter.KEYWORD_ONLY


def test_defaults_are_c_1_and_the_plain_mean(device):
    input, target = operands(SHAPE, device)
    out = fusedloss.pseudo_huber_loss(input, target)
    assert out.shape == () and out.dtype == torch.float32
    assert_close64(out, pseudo_huber64(input, target, 1.0).mean())
    assert torch.equal(out, fusedloss.pseudo_huber_loss(input, target, 1.0, "mean"))


# ---- values and gradients, c a float ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("c", C_VALUES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_values_against_float64(device, reduction, c, dtype):
    clamp = 8.0 if dtype == torch.float16 else None  # finite float16 squares
    input, target = operands(SHAPE, device, dtype, clamp)
    out = fusedloss.pseudo_huber_loss(input, target, c=c, reduction=reduction)
    assert out.dtype == dtype and out.device == input.device
    assert_close64(out, pseudo_huber64(input, target, c, reduction))


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64), (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.bfloat16), (torch.float64, torch.float16)], ids=str)
def test_mixed_dtypes_give_the_promoted_dtype(device, dtypes):
    input = heavy_tailed(SHAPE, device=device).clamp(-8, 8).to(dtypes[0])
    target = heavy_tailed(SHAPE, device=device).clamp(-8, 8).to(dtypes[1])
    for reduction in REDUCTIONS:
        out = fusedloss.pseudo_huber_loss(input, target, c=0.5, reduction=reduction)
        assert out.dtype == torch.promote_types(*dtypes)
        assert_close64(out, pseudo_huber64(input, target, 0.5, reduction), *dtypes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("c", [0.01, 1.0, 3.0, 100.0])
def test_small_differences_keep_their_digits(device, c, dtype):
    """For |d| << c the loss is about d^2, and 2c(sqrt(d^2 + c^2) - c) evaluated as written
    cancels: in float32 it loses every digit below |d| ~ c * 2^-12. The values must stay
    within the dtype's tolerance of float64's (2c d^2 / (sqrt(d^2 + c^2) + c) is exact)."""
    scales = torch.tensor([1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 1e-4], dtype=torch.float64)
    d = (scales * c).to(device)
    d = torch.cat([d, -d]).to(dtype)
    target = torch.zeros_like(d)
    out = fusedloss.pseudo_huber_loss(d, target, c=c, reduction="none")
    expected = pseudo_huber64(d, target, c)
    rtol, _ = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), expected.cpu(), rtol=rtol, atol=0)


@pytest.mark.parametrize("c", C_VALUES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradient_formula(device, reduction, c):
    """d / d input = 2c d / sqrt(d^2 + c^2) (times grad_output, / N for a mean); d / d target
    is its negative."""
    input, target = operands(SHAPE, device)
    out = fusedloss.pseudo_huber_loss(input, target, c=c, reduction=reduction)
    if reduction == "none":
        grad_output = torch.randn(SHAPE, device=device)
    else:
        grad_output = torch.empty((), device=device).uniform_(0.5, 1.5)
    grad_input, grad_target = torch.autograd.grad(out, (input, target), grad_output)
    expected = gradient64(input, target, c) * grad_output.double()
    if reduction == "mean":
        expected = expected / input.numel()
    rtol, atol = TOLERANCE[torch.float32]
    torch.testing.assert_close(grad_input.double(), expected, rtol=4 * rtol, atol=4 * atol)
    torch.testing.assert_close(grad_target.double(), -expected, rtol=4 * rtol, atol=4 * atol)


@pytest.mark.parametrize("c", [0.5, 2.0])
def test_limits_mse_and_l1(device, c):
    """|d| << c: about d^2 (MSE); |d| >> c: about 2c|d| - 2c^2 (a shifted, scaled L1)."""
    sign = torch.randint(0, 2, (100,), device=device) * 2 - 1
    small = (torch.rand(100, device=device, dtype=torch.float64) + 1) * 1e-3 * c * sign  # no cancellation yet
    large = (torch.rand(100, device=device, dtype=torch.float64) + 1) * 1e6 * c
    zeros = torch.zeros(100, device=device, dtype=torch.float64)
    for d, approximation in ((small, small * small), (large, 2 * c * large - 2 * c * c)):
        out = fusedloss.pseudo_huber_loss(d, zeros, c=c, reduction="none")
        torch.testing.assert_close(out, approximation, rtol=1e-5, atol=0)


# ---- c a tensor --------------------------------------------------------------------------------


@pytest.mark.parametrize("c_shape", [(3, 1, 1, 1), (), (1, 5, 1, 1), SHAPE], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_tensor_c(device, reduction, c_shape):
    """A per-sample (or any broadcasting) c: values, the result dtype (the operands'),
    and the gradients of input, target and c. With c not requiring grad too."""
    input, target = operands(SHAPE, device)
    for requires_grad in (True, False):
        c = per_sample_c(device, requires_grad=requires_grad, shape=c_shape)
        out = fusedloss.pseudo_huber_loss(input, target, c=c, reduction=reduction)
        assert out.dtype == torch.float32 and out.shape == (SHAPE if reduction == "none" else ())
        x64, y64, c64 = _as64(input), _as64(target), _as64(c)
        expected = pseudo_huber64(x64, y64, c64, reduction)
        assert_close64(out, expected, msg=f"c requires grad: {requires_grad}")
        wrt = [t for t in (input, target, c) if t.requires_grad]
        grad_output = torch.rand(out.shape, device=device) + 0.5
        got = torch.autograd.grad(out, wrt, grad_output)
        want = torch.autograd.grad(expected, [t for t in (x64, y64, c64) if t.requires_grad], grad_output.double())
        for g, w, t in zip(got, want, wrt):
            assert g.dtype == t.dtype and g.shape == t.shape
            assert_close64(g, w, rtol_factor=4, msg=f"gradient, c requires grad: {requires_grad}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_tensor_c_dtypes_and_a_broadcast_target(device, reduction, dtype):
    """Operands of every dtype (the loss computed in at least float32, returned in their
    dtype), a target that broadcasts, and a c that widens the loss's shape."""
    input, target = operands(SHAPE, device, dtype)
    c = per_sample_c(device)
    for target_, c_ in ((target, c), (leaf(target[:1]), c), (target, per_sample_c(device, shape=(2, 1, 1, 1, 1)))):
        if target_.shape != input.shape:
            with pytest.warns(UserWarning, match="target size"):
                out = fusedloss.pseudo_huber_loss(input, target_, c=c_, reduction=reduction)
        else:
            out = fusedloss.pseudo_huber_loss(input, target_, c=c_, reduction=reduction)
        assert out.dtype == dtype
        x64, y64, c64 = _as64(input), _as64(target_), _as64(c_)
        expected = pseudo_huber64(x64, y64, c64, reduction)
        assert out.shape == expected.shape
        assert_close64(out, expected)
        grad_output = torch.rand(out.shape, device=device) + 0.5
        got = torch.autograd.grad(out, (input, target_, c_), grad_output.to(dtype))
        want = torch.autograd.grad(expected, (x64, y64, c64), grad_output.to(dtype).double())
        for g, w, t in zip(got, want, (input, target_, c_)):
            assert g.dtype == t.dtype and g.shape == t.shape
            assert_close64(g, w, dtype, rtol_factor=4, msg=f"gradient of {tuple(t.shape)}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_tensor_c_second_derivatives(device, reduction):
    """create_graph=True: gradgradcheck with respect to input, target and c (float64)."""
    input, target = (leaf(heavy_tailed((3, 4, 5), device=device).double()) for _ in range(2))
    c = leaf(torch.rand(3, 1, 1, device=device, dtype=torch.float64) + 0.1)

    def loss(a, b, k):
        return fusedloss.pseudo_huber_loss(a, b, c=k, reduction=reduction)

    assert torch.autograd.gradcheck(loss, (input, target, c))
    assert torch.autograd.gradgradcheck(loss, (input, target, c))


@pytest.mark.parametrize("scale", [None, 0.5, "tensor"])
@pytest.mark.parametrize("weight_kind", [None, "per-sample", "per-channel", "bool-mask", "same-size"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_tensor_c_with_weight_and_scale(device, reduction, weight_kind, scale):
    """A per-sample c with a weight and a scale: the c given is the c used (whether or
    not c, the weight or the scale require grad)."""
    input, target = operands(SHAPE, device)
    weight = {None: None, "per-sample": torch.rand(3, 1, 1, 1, device=device) + 0.25,
              "per-channel": torch.rand(1, 5, 1, 1, device=device) + 0.25,
              "bool-mask": torch.rand(3, 1, 7, 11, device=device) < 0.6,
              "same-size": torch.rand(SHAPE, device=device) + 0.25}[weight_kind]
    if weight is not None and weight.dtype == torch.bool:
        weight[0, 0, 0, 0] = True
    scale = torch.tensor(1.5, device=device) if scale == "tensor" else scale
    for requires_grad in (False, True):
        c = per_sample_c(device, requires_grad=requires_grad)
        out = fusedloss.pseudo_huber_loss(input, target, c=c, reduction=reduction, weight=weight, scale=scale)
        assert out.dtype == torch.float32
        c64 = _as64(c)
        expected = pseudo_huber64(input, target, c64, reduction, weight, scale)
        assert_close64(out, expected, msg=f"c requires grad: {requires_grad}")
        if requires_grad:
            grad_output = torch.rand(out.shape, device=device) + 0.5
            (got,) = torch.autograd.grad(out, c, grad_output)
            (want,) = torch.autograd.grad(expected, c64, grad_output.double())
            assert_close64(got, want, rtol_factor=4, msg="gradient of c")


@pytest.mark.parametrize("c_dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_tensor_c_dtype_does_not_change_the_result_dtype(device, c_dtype):
    """c's dtype changes neither the result's dtype nor its precision: a 16-bit c holds
    exact values, which the loss uses as they are."""
    input, target = operands(SHAPE, device)
    c = per_sample_c(device, c_dtype, requires_grad=False)
    for reduction in REDUCTIONS:
        out = fusedloss.pseudo_huber_loss(input, target, c=c, reduction=reduction)
        assert out.dtype == torch.float32
        assert_close64(out, pseudo_huber64(input, target, c, reduction), msg=reduction)


def test_tensor_c_equals_float_c(device):
    input, target = operands(SHAPE, device)
    for reduction in REDUCTIONS:
        as_float = fusedloss.pseudo_huber_loss(input, target, c=0.75, reduction=reduction)
        for c in (torch.tensor(0.75, device=device), torch.full((3, 1, 1, 1), 0.75, device=device)):
            assert_close64(fusedloss.pseudo_huber_loss(input, target, c=c, reduction=reduction), as_float.double())


# ---- NaN, inf, c <= 0 --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("c", [0.5, "tensor"])
def test_a_difference_whose_square_overflows(device, c, dtype):
    """d^2 beyond float32 while the loss is not: float64's finite loss 2c(|d| - c) and its
    gradient 2c sign(d), not inf and NaN or 0."""
    values = [1e20, -3e19, 1e30, 0.3]
    input = torch.tensor(values, dtype=dtype, device=device, requires_grad=True)
    target = torch.zeros(4, dtype=dtype, device=device)
    c = torch.full((4,), 0.5, device=device) if c == "tensor" else c
    out = fusedloss.pseudo_huber_loss(input, target, c, reduction="none")
    grad = torch.autograd.grad(out.sum(), input)[0]
    input64 = input.detach().double().requires_grad_()
    c64 = c.double() if isinstance(c, torch.Tensor) else c
    out64 = fusedloss.pseudo_huber_loss(input64, target.double(), c64, reduction="none")
    grad64 = torch.autograd.grad(out64.sum(), input64)[0]
    rtol, atol = TOLERANCE[dtype]
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(out.double(), out64, rtol=rtol, atol=atol)
    torch.testing.assert_close(grad.double(), grad64, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("c", [0.5, "tensor"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_an_element_out_of_range_leaves_the_others_bits(device, reduction, c, dtype):
    """The kernels test a chunk of elements at once and take a slower path for a chunk with a
    d^2 + c^2 beyond float32: the other elements' losses and gradients keep their bits."""
    n = 4099
    input = torch.randn(n, device=device).to(dtype)
    target = torch.randn(n, device=device).to(dtype)
    c = torch.rand(n, device=device) + 0.1 if c == "tensor" else c

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.clone().requires_grad_()
        out = fusedloss.pseudo_huber_loss(x, target, c, reduction=reduction)
        return out, torch.autograd.grad(out, x, torch.full_like(out, 0.37))[0]

    out, grad = run(input)
    far = input.clone()
    far[5] = 1e30
    far_out, far_grad = run(far)
    others = torch.arange(n, device=device) != 5
    assert torch.equal(far_grad[others], grad[others])
    if reduction == "none":
        assert torch.equal(far_out[others], out[others])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("c", [1e-30, "tensor"])
def test_a_c_whose_square_underflows(device, c, dtype):
    """c^2 below float32's smallest value: float64's loss and gradient (0 at d = 0), not the
    0 / 0 and x / 0 of a root computed as 0."""
    values = [0.0, 1e-31, -2e-30, 3e-29, 1.0]
    input = torch.tensor(values, device=device).to(dtype).requires_grad_()
    target = torch.zeros(len(values), dtype=dtype, device=device)
    c = torch.full((len(values),), 1e-30, device=device) if c == "tensor" else c
    out = fusedloss.pseudo_huber_loss(input, target, c, reduction="none")
    grad = torch.autograd.grad(out.sum() * 1e30, input)[0]
    input64 = input.detach().double().requires_grad_()
    c64 = c.double() if isinstance(c, torch.Tensor) else c
    out64 = fusedloss.pseudo_huber_loss(input64, target.double(), c64, reduction="none")
    grad64 = torch.autograd.grad(out64.sum() * 1e30, input64)[0]
    assert torch.isfinite(grad).all() and grad[0] == 0
    # the losses, about d^2, are below the dtype's range: float64's rounded into it
    torch.testing.assert_close(out, out64.to(dtype), rtol=TOLERANCE[dtype][0], atol=0)
    torch.testing.assert_close(grad.double(), grad64, rtol=TOLERANCE[dtype][0], atol=0)


@pytest.mark.parametrize("c", [0.5, "tensor"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nan_and_inf_propagate_like_the_formula(device, reduction, c):
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, float("inf"), 0.0, 2.0, 3.0],
                           device=device)
    other = torch.tensor([0.5, 1.0, 2.0, float("nan"), float("inf"), -float("inf"), 0.0, -3.0], device=device)
    c = torch.rand(8, device=device) + 0.1 if c == "tensor" else c
    for a, b in ((special, other), (special[3:4], other[3:4]), (special[1:2], other[1:2])):
        out = fusedloss.pseudo_huber_loss(a, b, c=c if not isinstance(c, torch.Tensor) else c[: a.numel()],
                                          reduction=reduction)
        expected = pseudo_huber64(a, b, c if not isinstance(c, torch.Tensor) else c[: a.numel()], reduction)
        assert_close64(out, expected, msg=f"{a} {b}")
        assert (out.isnan() == expected.isnan()).all() and (out.isinf() == expected.isinf()).all()


@pytest.mark.parametrize("c", [0.0, -0.5, -2.0, float("nan")])
@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_c_not_positive_raises(device, reduction, weight, c):
    input, target = operands(SHAPE, device)
    w = torch.rand(3, 1, 1, 1, device=device) + 0.25 if weight else None
    with pytest.raises(ValueError, match="needs c > 0"):
        fusedloss.pseudo_huber_loss(input, target, c=c, reduction=reduction, weight=w)
    with pytest.raises(ValueError, match="needs c > 0"):
        fusedloss.nn.PseudoHuberLoss(c=c, reduction=reduction)(input, target, w)


# ---- the module ---------------------------------------------------------------------------------


def test_module_construction_repr_and_state():
    module = fusedloss.nn.PseudoHuberLoss()
    assert module.c == 1.0 and module.reduction == "mean"
    module = fusedloss.nn.PseudoHuberLoss(0.25, "sum")
    assert module.c == 0.25 and module.reduction == "sum"
    assert repr(module).startswith("PseudoHuberLoss(") and "0.25" in repr(module)
    assert list(module.parameters()) == []
    fresh = fusedloss.nn.PseudoHuberLoss(0.25, "sum")
    fresh.load_state_dict(module.state_dict())
    for clone in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
        assert type(clone) is fusedloss.nn.PseudoHuberLoss and clone.c == 0.25 and clone.reduction == "sum"
    with pytest.raises(ValueError):
        fusedloss.nn.PseudoHuberLoss(reduction="average")(torch.ones(2), torch.zeros(2))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_module_forward_equals_functional(device, reduction):
    module = fusedloss.nn.PseudoHuberLoss(c=0.3, reduction=reduction)
    input, target = operands(SHAPE, device)
    weight = torch.rand(1, 5, 1, 1, device=device) + 0.25
    scale = torch.tensor(0.7, device=device)
    for args, kwargs in [((), {}), ((weight,), {}), ((), dict(weight=weight, scale=scale)),
                         ((), dict(scale=0.25)), ((weight,), dict(scale=scale))]:
        out = module(input, target, *args, **kwargs)
        call = dict(zip(["weight"], args), **kwargs)
        expected = fusedloss.pseudo_huber_loss(input, target, c=0.3, reduction=reduction, **call)
        assert torch.equal(out, expected), call
        assert_close64(out, pseudo_huber64(input, target, 0.3, reduction, call.get("weight"), call.get("scale")))
        grad_output = torch.rand_like(out) + 0.5
        for g, e in zip(torch.autograd.grad(out, (input, target), grad_output),
                        torch.autograd.grad(expected, (input, target), grad_output)):
            assert torch.equal(g, e), call


def test_module_in_a_training_step(device):
    model = torch.nn.Linear(8, 4).to(device)
    reference = copy.deepcopy(model)
    x, y = torch.randn(16, 8, device=device), heavy_tailed((16, 4), device=device)
    fusedloss.nn.PseudoHuberLoss(c=0.1)(model(x), y).backward()
    pseudo_huber64(reference(x), y, 0.1, "mean").backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


# ---- torch.func ------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_torch_func_with_a_tensor_c(device, reduction):
    """grad with respect to input and c, and vmap over samples each with its own 0-d c."""
    x, y = (heavy_tailed((4, 3, 5), device=device) for _ in range(2))
    c = torch.rand(4, 1, 1, device=device) + 0.1

    def ours(x, c):
        return fusedloss.pseudo_huber_loss(x, y, c=c, reduction=reduction).sum()

    def plain(x, c):
        return pseudo_huber64(x, y, c, reduction).sum()

    rtol, atol = TOLERANCE[torch.float32]
    for got, want in zip(torch.func.grad(ours, argnums=(0, 1))(x, c), torch.func.grad(plain, argnums=(0, 1))(x, c)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want.double(), rtol=4 * rtol, atol=4 * atol)
    per_sample = torch.func.vmap(lambda a, b, k: fusedloss.pseudo_huber_loss(a, b, c=k, reduction=reduction))
    expected = torch.stack([pseudo_huber64(x[i], y[i], c[i, 0, 0], reduction) for i in range(4)])
    assert_close64(per_sample(x, y, c[:, 0, 0]), expected)
    out, tangent = torch.func.jvp(lambda a: fusedloss.pseudo_huber_loss(a, y, c=0.5, reduction=reduction), (x,),
                                  (torch.ones_like(x),))
    x64 = x.double()
    assert_close64(tangent, (gradient64(x64, y, 0.5) / (x.numel() if reduction == "mean" else 1)).sum()
                   if reduction != "none" else gradient64(x64, y, 0.5), rtol_factor=4)


# ---- CUDA -----------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("n", [0, 1, 4099, (1 << 20) + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cuda_sizes_and_dtypes(reduction, dtype, n):
    build.load()
    input, target = operands((n,), "cuda", dtype, clamp=8.0)
    for c in (0.1, 1.0, 3.0, per_sample_c("cuda", requires_grad=False, shape=())):
        out = fusedloss.pseudo_huber_loss(input, target, c=c, reduction=reduction)
        assert out.dtype == dtype
        expected = pseudo_huber64(input, target, c, reduction)
        assert_close64(out, expected, msg=f"c={c}")
        if n:
            grad_output = torch.rand(out.shape, device="cuda") + 0.5
            grad = torch.autograd.grad(out, input, grad_output.to(out.dtype))[0]
            want = gradient64(input, target, c) * grad_output.to(out.dtype).double()
            want = want / n if reduction == "mean" else want
            assert grad.dtype == dtype
            assert_close64(grad, want, rtol_factor=4, msg=f"gradient, c={c}")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cuda_autocast(reduction, dtype):
    build.load()
    input, target = operands((3, 4099), "cuda", dtype, clamp=8.0)
    for weight in (None, torch.rand(3, 1, device="cuda") + 0.25):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fusedloss.pseudo_huber_loss(input, target, c=0.5, reduction=reduction, weight=weight)
        assert out.dtype == torch.float32
        assert_close64(out, pseudo_huber64(input.float(), target.float(), 0.5, reduction, weight))
        grad = torch.autograd.grad(out.sum(), input)[0]
        assert grad.dtype == dtype
