"""Every gradient is rounded into its dtype once, after every factor: grad_output (a loss
scale), 1/N or 1/sum(w), scale, the weight and the loss's derivative.

Each case compares the input's gradient with float64 rounded to the gradient's dtype, and
with PyTorch eager on the same inputs and grad_output:

- the largest error relative to the largest gradient (finite elements) is at most 1.5x
  eager's;
- for fp16 and bf16 gradients, no element is more than 1 ulp away. (Eager's worst
  element is 1 ulp away too, or 0 where its float32 arithmetic happens to round every
  element of a draw right; a float32 result within float32 rounding of a 16-bit tie can
  land on either side of it, in either system, so 1 ulp is the bound both share.)

Routes: "backward" (below FUSED_GRADIENT_FROM_BYTES, backward computes the gradient) and
"forward" (the forward writes it for the grad_output it expects, and backward corrects a
misprediction; forced here for small losses). A 3-step GradScaler loop checks every
step, so the forward route meets a first step, a predicted one and a changed scale.
"""

from __future__ import annotations

import pytest
import torch

from fusedloss import build, losses, routing

from conftest import LOSSES, PARAMS, loss_kwargs, requires_cuda, warm_up_for_capture

ROUTES = {"backward": 1 << 62, "forward": 0}
_INT_VIEW = {torch.float16: (torch.int16, 0x7FFF), torch.bfloat16: (torch.int16, 0x7FFF),
             torch.float32: (torch.int32, 0x7FFFFFFF)}


@pytest.fixture(params=list(ROUTES))
def route(request, monkeypatch):
    monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", ROUTES[request.param])
    return request.param


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    build.load()
    return "cuda"



# ---- measures ----------------------------------------------------------------------------


def ulps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per element, how many representable values of their dtype lie between the two (NaN
    must meet NaN; equal infinities are 0 apart)."""
    assert actual.dtype == expected.dtype
    assert torch.equal(actual.isnan(), expected.isnan()), "NaN where the reference has none, or the reverse"
    int_dtype, magnitude = _INT_VIEW[actual.dtype]

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.nan_to_num(0.0, posinf=torch.inf, neginf=-torch.inf).view(int_dtype).to(torch.int64)
        return torch.where(bits >= 0, bits, -(bits & magnitude))

    return (ordered(actual) - ordered(expected)).abs()


def relative_error(actual: torch.Tensor, reference64: torch.Tensor) -> float:
    """max |actual - reference| / max |reference| over the elements whose reference is finite."""
    finite = reference64.isfinite() & actual.isfinite()
    if not finite.any():
        return 0.0
    scale = reference64[finite].abs().max().item()
    return (actual.double()[finite] - reference64[finite]).abs().max().item() / scale if scale else 0.0


# ---- the float64 reference --------------------------------------------------------------------


def derivative64(name: str, input: torch.Tensor, target: torch.Tensor, float32_math: bool) -> torch.Tensor:
    """d loss / d input per element, in float64, of the operands as the loss sees them:
    in float32 math (under autocast, or where a weight widens a 16-bit loss to float32)
    as float32 copies; else in the dtype the loss computes the input's gradient in (a loss
    that keeps the input's dtype (Huber): the input's; one whose gradient is computed in its
    own dtype (Smooth L1): the gradient's; others: the promoted one), the difference held in
    fp16 where that dtype is fp16, as PyTorch's fp16 kernels hold it."""
    row = losses.LOSSES[name]
    param = PARAMS[name]
    if float32_math:
        d = input.double() - target.double()
    else:
        promoted = torch.promote_types(input.dtype, target.dtype)
        dtype = input.dtype if row.keeps_input_dtype or row.gradient_in_own_dtype else promoted
        d = input.to(dtype).double() - target.to(dtype).double()
        if dtype == torch.float16:
            d = d.to(torch.float16).double()
        param = torch.tensor(param, dtype=dtype).item()  # the loss's number in that dtype
    return row.gradient(d, param)


def eager_loss(name: str, input: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
    """The loss as a PyTorch user writes it: torch.nn.functional's, or for fusedloss's own
    losses the table's formula in plain torch (pseudo-Huber in float32, as diffusers casts
    first), returned in the operands' dtype."""
    row = losses.LOSSES[name]
    if row.keeps_input_dtype and not torch.is_autocast_enabled("cuda"):  # PyTorch's Huber: in the input's dtype
        target = target.to(input.dtype)
    elif not row.gradient_in_own_dtype:  # computed in the promoted dtype, as a user converts first
        dtype = torch.promote_types(input.dtype, target.dtype)
        input, target = input.to(dtype), target.to(dtype)
    function = LOSSES[name][1]  # torch.nn.functional's, or the formula
    return function(input, target, reduction=reduction, **loss_kwargs(name, PARAMS[name]))


def eager_weighted_mean(name: str, input, target, weight, scale: float) -> torch.Tensor:
    """A weighted mean as a PyTorch user writes it (Huber's divides by N, as PyTorch's own)."""
    weighted = eager_loss(name, input, target, "none") * weight
    if losses.LOSSES[name].weighted_mean_over_count:
        divisor = weighted.numel()
    else:
        divisor = weight.expand(weighted.shape).sum(dtype=torch.float32)
    return weighted.sum() / divisor * scale


def grad_output_as_received(grad_output: float, loss: torch.Tensor) -> float:
    """(loss * grad_output).backward() hands the loss grad_output in the loss's dtype."""
    return torch.tensor(grad_output, dtype=loss.dtype).item()


def ours(name: str, input, target, reduction: str, **kwargs) -> torch.Tensor:
    return LOSSES[name][0](input, target, reduction=reduction, **loss_kwargs(name, PARAMS[name]), **kwargs)


def check(name: str, ours_grad: torch.Tensor, eager_grad: torch.Tensor, reference64: torch.Tensor, what: str):
    """The two checks of this file's docstring; prints both systems' relative error, worst
    ulps and count of elements 1 ulp or more away."""
    expected = reference64.to(ours_grad.dtype)
    ours_error, eager_error = relative_error(ours_grad, reference64), relative_error(eager_grad, reference64)
    ours_ulps, eager_ulps = ulps(ours_grad, expected), ulps(eager_grad, expected)
    print(f"{name} {what}: relative error {ours_error:.3g} (eager {eager_error:.3g}); worst "
          f"{ours_ulps.max().item()} ulp, {(ours_ulps > 0).sum().item()} off (eager {eager_ulps.max().item()}, "
          f"{(eager_ulps > 0).sum().item()}) of {ours_ulps.numel()}")
    assert ours_error <= 1.5 * eager_error, f"{what}: {ours_error:.3g} against eager's {eager_error:.3g}"
    if ours_grad.dtype in (torch.float16, torch.bfloat16):
        assert ours_ulps.max().item() <= 1, f"{what}: an element {ours_ulps.max().item()} ulp away"


# ---- fp16 autocast and GradScaler -------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**24], ids=["2^16", "2^24"])
@pytest.mark.parametrize("numel", [1 << 16, 1 << 22], ids=["2^16", "2^22"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp16_autocast_with_grad_scaler(cuda, route, name, init_scale, numel, reduction):
    """An fp16 activation of fp32 parameters and an fp32 target under fp16 autocast;
    GradScaler's scale as grad_output, for three steps of a loop with an optimizer (the
    scale halves after a step with inf)."""
    parameter = torch.nn.Parameter(torch.empty(numel, device=cuda))
    optimizer = torch.optim.SGD([parameter], lr=0.0)
    scaler = torch.amp.GradScaler("cuda", init_scale=init_scale)
    for step in range(3):
        with torch.no_grad():
            parameter.copy_(torch.randn(numel, device=cuda) * 2)
        target = torch.randn(numel, device=cuda)
        scale = scaler.get_scale()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            input = parameter.to(torch.float16)  # the activation whose gradient is checked
            input.retain_grad()
            loss = ours(name, input, target, reduction)
        scaler.scale(loss).backward()
        ours_grad = input.grad
        eager_input = input.detach().clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.float16):
            eager = eager_loss(name, eager_input, target, reduction)
        (eager * torch.tensor(scale, device=cuda)).backward()
        factor = scale / numel if reduction == "mean" else scale
        reference = derivative64(name, input.detach(), target, float32_math=True) * factor
        check(name, ours_grad, eager_input.grad, reference, f"{route} step {step + 1} scale {scale:g}")
        scaler.step(optimizer)
        scaler.update()


# ---- fp16 without autocast, with weight= and scale= ---------------------------------------------


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**24], ids=["2^16", "2^24"])
@pytest.mark.parametrize("shape", [(4, 4, 64, 64), (16, 16, 128, 128)], ids=["2^16", "2^22"])
def test_fp16_weighted_and_scaled_with_grad_scaler(cuda, route, name, init_scale, shape):
    """fp16 input, fp32 target, a bf16 weight per row, scale=0.25, weighted mean (Huber's
    divides by N), GradScaler's scale as grad_output, three steps."""
    parameter = torch.nn.Parameter(torch.empty(shape, device=cuda))
    optimizer = torch.optim.SGD([parameter], lr=0.0)
    scaler = torch.amp.GradScaler("cuda", init_scale=init_scale)
    weight = (torch.rand(1, 1, shape[2], 1, device=cuda) + 0.25).to(torch.bfloat16)
    count = weight.double().sum() * (parameter.numel() // weight.numel())
    divisor = parameter.numel() if losses.LOSSES[name].weighted_mean_over_count else count
    # The loss of an fp16 input and an fp32 target is float32, or fp16 where it keeps the
    # input's dtype (Huber); the bf16 weight widens that to float32, which fusedloss then
    # computes in float32 from the operands as given (autocast's math).
    float32_math = losses.LOSSES[name].keeps_input_dtype
    for step in range(3):
        with torch.no_grad():
            parameter.copy_(torch.randn(shape, device=cuda) * 2)
        target = torch.randn(shape, device=cuda)
        scale = scaler.get_scale()
        optimizer.zero_grad(set_to_none=True)
        input = parameter.to(torch.float16)
        input.retain_grad()
        scaler.scale(ours(name, input, target, "mean", weight=weight, scale=0.25)).backward()
        ours_grad = input.grad
        eager_input = input.detach().clone().requires_grad_()
        eager = eager_weighted_mean(name, eager_input, target, weight, 0.25)
        (eager * torch.tensor(scale, device=cuda)).backward()
        reference = derivative64(name, input.detach(), target, float32_math=float32_math) * weight.double() * (
            0.25 * scale / divisor)
        check(name, ours_grad, eager_input.grad, reference, f"{route} step {step + 1} scale {scale:g}")
        scaler.step(optimizer)
        scaler.update()


# ---- bf16 and fp32 at grad_outputs other than a power of two ------------------------------------


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("on", ["fused-cpu", pytest.param("cuda", marks=requires_cuda)])
def test_grad_outputs(request, route, name, dtype, reduction, weighted, on):
    """(loss * grad_output).backward() for grad_output 1, 0.37 and 1000; a per-channel
    float32 weight and scale=0.3 where weighted. The CPU route runs the operators' CPU
    kernels (conftest's fused_cpu), on fewer elements."""
    if on == "cuda":
        device = request.getfixturevalue("cuda")
        shape = (8, 16, 96, 97)  # about 2^20 elements, not a power of two
    else:
        request.getfixturevalue("fused_cpu")
        device = "cpu"
        shape = (4, 8, 24, 25)
    input = (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_()
    target = torch.randn(shape, device=device).to(dtype)
    kwargs, factor = {}, 1.0 / input.numel() if reduction == "mean" else 1.0
    weight64 = torch.ones((), dtype=torch.float64, device=device)
    if weighted:
        # Multiples of 1/8, whose float32 sums are exact: the divisor is the same for every
        # side, and the comparison is of the gradients' roundings alone.
        weight = torch.randint(4, 13, (1, shape[1], 1, 1), device=device) / 8
        kwargs = {"weight": weight, "scale": 0.3}
        weight64 = weight.double()
        count = weight64.sum().item() * input.numel() / weight.numel()
        divisor = input.numel() if losses.LOSSES[name].weighted_mean_over_count else count
        factor = 0.3 / divisor if reduction == "mean" else 0.3
    for grad_output in (1.0, 0.37, 1000.0):
        input.grad = None
        loss = ours(name, input, target, reduction, **kwargs)
        (loss * grad_output).backward()
        eager_input = input.detach().clone().requires_grad_()
        if weighted and reduction == "mean":
            eager = eager_weighted_mean(name, eager_input, target, kwargs["weight"], 0.3)
        elif weighted:
            eager = (eager_loss(name, eager_input, target, "none") * kwargs["weight"]).sum() * 0.3
        else:
            eager = eager_loss(name, eager_input, target, reduction)
        (eager * grad_output).backward()
        received = grad_output_as_received(grad_output, loss)
        reference = derivative64(name, input.detach(), target, float32_math=False) * weight64 * (factor * received)
        check(name, input.grad, eager_input.grad, reference, f"{on} {route} grad_output {grad_output}")


# ---- a tensor param ---------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("name", [name for name in LOSSES if losses.LOSSES[name].takes_param_tensor])
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "bf16-autocast"])
@pytest.mark.parametrize("grad_output", [2.0**16, 1000.0, 0.37], ids=str)
def test_a_param_tensor_at_scale_under_autocast_and_in_a_cuda_graph(cuda, route, name, autocast, grad_output):
    """A tensor param read by the weighted pass (nine quantiles along the last dimension
    against a (..., 1) target, a c per sample), at 2^20 elements and more of bf16, with a
    grad_output not 1, under bf16 autocast (a float32 loss) and without: the input's
    gradient within 1 ulp of float64's rounded to bf16, the same bits in a second step (the
    grad_output then expected) and in a CUDA graph's replay."""
    if losses.LOSSES[name].param_zero_valid:  # the quantiles
        shape, target_shape = (1 << 12, 32, 9), (1 << 12, 32, 1)
        param = torch.tensor([0.02, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.98], device=cuda)
    else:
        shape, target_shape = (16, 4, 128, 128), (16, 4, 128, 128)
        param = torch.rand(16, 1, 1, 1, device=cuda) + 0.1
    input = (torch.randn(shape, device=cuda) * 3).to(torch.bfloat16).requires_grad_()
    target = (torch.randn(target_shape, device=cuda) * 3).to(torch.bfloat16)
    fn = LOSSES[name][0]

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        input.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(input, target, param)
        loss.backward(torch.full((), grad_output, dtype=loss.dtype, device=cuda))
        return loss.detach(), input.grad  # no graph kept alive: capture wants none from before

    first, second = step(), step()
    loss, grad = second
    assert loss.dtype == (torch.float32 if autocast else torch.bfloat16)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    d = input.detach().double() - target.double()
    reference = losses.LOSSES[name].gradient(d, param.double()) * grad_output_as_received(grad_output, loss)
    reference = reference / d.numel()
    worst = ulps(grad, reference.to(torch.bfloat16)).max().item()
    assert worst <= 1, f"an element {worst} ulp away"

    warm_up_for_capture(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    for a, b in zip(static, second):
        assert torch.equal(a, b)
