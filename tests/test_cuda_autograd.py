"""Gradients on CUDA: the fused gradient, scaling, retain/create_graph, compile and CUDA graphs."""

from __future__ import annotations

import pytest
import torch

import fusedloss
from fusedloss import build, grad_output_prediction, losses, routing

from conftest import LOSSES, PARAMS, as_seen_by_gradient, broadcast_warning, heavy_tailed, loss_kwargs, requires_cuda, warm_up_for_capture

pytestmark = requires_cuda
REDUCTIONS = ("none", "mean", "sum")
GRAD_TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (2e-3, 1e-6),
                  torch.float64: (1e-12, 1e-14)}


@pytest.fixture(autouse=True)
def kernels():
    build.load()


def _loss(name, fn_index, input, target, reduction, param=None):
    param = PARAMS[name] if param is None else param
    return LOSSES[name][fn_index](input, target, reduction=reduction, **loss_kwargs(name, param))


def _gradients(name, fn_index, input, target, reduction, grad_scale=1.0, param=None):
    input = input.detach().requires_grad_()
    target = target.detach().requires_grad_(target.dtype.is_floating_point)
    out = _loss(name, fn_index, input, target, reduction, param)
    (out if grad_scale == 1.0 else out * grad_scale).backward()
    return out, input.grad, target.grad


def _float64_gradients(name, input, target, reduction, grad_scale=1.0, param=None):
    """PyTorch's autograd on float64 copies; each gradient sees the other operand as
    PyTorch's CUDA backward kernel does."""
    param = PARAMS[name] if param is None else param
    row = losses.LOSSES[name]
    loss_id = row.param_zero_is if param == 0 and row.param_zero_is else name
    from fusedloss import formulas

    def gradient(of_input):
        seen = as_seen_by_gradient(name, input, target, of_input)
        i64, t64 = (t.detach().double().requires_grad_(g) for t, g in zip(seen, (of_input, not of_input)))
        out = formulas.torch_loss(i64, t64, loss_id, param, reduction)
        return torch.autograd.grad(out, i64 if of_input else t64, torch.full_like(out, grad_scale))[0]

    return gradient(True), gradient(False)


def _assert_grad_close(actual, expected64, dtype, computed_in=None):
    rtol, atol = GRAD_TOLERANCE[computed_in or dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected64, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                    (torch.float64, torch.float64), (torch.float32, torch.float64)], ids=str)
@pytest.mark.parametrize("grad_scale", [1.0, 0.5])
def test_fused_gradients_against_float64(name, reduction, dtypes, grad_scale):
    n = 100_003
    input = (heavy_tailed((n,), torch.float64, "cuda").clamp(-8, 8)).to(dtypes[0])
    target = (heavy_tailed((n,), torch.float64, "cuda").clamp(-8, 8)).to(dtypes[1])
    input.view(-1)[:5] = target.view(-1)[:5].to(dtypes[0])  # x == y: gradient 0
    out, grad_input, grad_target = _gradients(name, 0, input, target, reduction, grad_scale)
    expected_input, expected_target = _float64_gradients(name, input, target, reduction, grad_scale)
    _assert_grad_close(grad_input, expected_input, dtypes[0])
    # a loss that keeps the input's dtype (Huber) is differentiated as computed, in that dtype
    computed_in = dtypes[0] if losses.LOSSES[name].keeps_input_dtype else None
    _assert_grad_close(grad_target, expected_target, dtypes[1], computed_in)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_backward_against_float64(name, dtype):
    input = heavy_tailed((3, 4097), torch.float32, "cuda").to(dtype)
    target = heavy_tailed((3, 4097), torch.float32, "cuda").to(dtype)
    input = input.detach().requires_grad_()
    target = target.detach().requires_grad_()
    out = _loss(name, 0, input, target, "none")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (input, target), grad_out)
    i64, t64 = input.detach().double().requires_grad_(), target.detach().double().requires_grad_()
    expected = torch.autograd.grad(_loss(name, 1, i64, t64, "none"), (i64, t64), grad_out.double())
    for actual, want in zip(grads, expected):
        _assert_grad_close(actual, want, dtype)


@pytest.mark.parametrize("n", [(1 << 20) + 3, 3_000_007])
def test_bf16_mean_gradient_is_rounded_once(n):
    """The fused bf16 gradient is the float64 gradient rounded once, so it has no
    bias from rounding 1/N to bf16 first (eager's is about +3.5e-4 at N = 3e6+7)."""
    input = torch.randn(n, device="cuda").to(torch.bfloat16).requires_grad_()
    target = torch.randn(n, device="cuda").to(torch.bfloat16)
    fusedloss.mse_loss(input, target).backward()
    exact = 2 * (input.detach().double() - target.double()) / n
    rounded = exact.float().to(torch.bfloat16)  # what one rounding (via fp32) gives
    mismatches = (input.grad != rounded).float().mean().item()
    assert mismatches < 1e-4
    ulp = (exact.abs() * 2.0**-7).clamp_min(1e-30)
    assert ((input.grad.double() - exact).abs() <= ulp).all()


@pytest.mark.parametrize("name", LOSSES)
def test_broadcast_gradients_reduce_to_operand_shapes(name):
    input = heavy_tailed((64, 33), device="cuda").requires_grad_()
    target = heavy_tailed((33,), device="cuda").requires_grad_()
    for reduction in REDUCTIONS:
        with broadcast_warning(name, input, target):
            out = _loss(name, 0, input, target, reduction)
        grads = torch.autograd.grad(out.sum(), (input, target))
        with broadcast_warning(name, input, target):
            expected = torch.autograd.grad(_loss(name, 1, input, target, reduction).sum(), (input, target))
        for actual, want in zip(grads, expected):
            assert actual.shape == want.shape
            torch.testing.assert_close(actual, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", LOSSES)
def test_retain_graph_and_repeated_backward(name):
    input = heavy_tailed((999,), device="cuda").requires_grad_()
    target = heavy_tailed((999,), device="cuda")
    out = _loss(name, 0, input, target, "mean")
    (first,) = torch.autograd.grad(out * 0.5, input, retain_graph=True)
    (second,) = torch.autograd.grad(out * 3.0, input)
    expected = torch.autograd.grad(_loss(name, 1, input, target, "mean"), input)[0]
    torch.testing.assert_close(first, expected * 0.5)
    torch.testing.assert_close(second, expected * 3.0)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_second_backward_gives_the_fused_bits(name, dtype):
    """A retain_graph second backward recomputes the gradient with the fused one's
    roundings: in 16-bit dtypes with N not a power of two, a grad_output / N rounded
    first would bias it."""
    n = 300_007
    input = heavy_tailed((n,), torch.float64, "cuda").clamp(-8, 8).to(dtype).requires_grad_()
    target = heavy_tailed((n,), torch.float64, "cuda").clamp(-8, 8).to(dtype).requires_grad_()
    out = _loss(name, 0, input, target, "mean")
    fused = torch.autograd.grad(out * 0.37, (input, target), retain_graph=True)
    recomputed = torch.autograd.grad(out * 0.37, (input, target))
    for a, b in zip(fused, recomputed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)], ids=str)
@pytest.mark.parametrize("n", [1, 4099, 3_000_017])
def test_loss_bits_do_not_depend_on_grad_mode(name, dtypes, n):
    """The gradient-writing pass sums the same tiles as the read-only one."""
    input = heavy_tailed((n,), torch.float64, "cuda").to(dtypes[0])
    target = heavy_tailed((n,), torch.float64, "cuda").to(dtypes[1])
    for reduction in ("mean", "sum"):
        with torch.no_grad():
            without = _loss(name, 0, input, target, reduction)
        with_input_grad = _loss(name, 0, input.detach().requires_grad_(), target, reduction)
        with_both = _loss(name, 0, input.detach().requires_grad_(), target.detach().requires_grad_(), reduction)
        assert torch.equal(without, with_input_grad.detach())
        assert torch.equal(without, with_both.detach())


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_create_graph_matches_torch(name, reduction):
    input = heavy_tailed((257,), torch.float64, "cuda").requires_grad_()
    target = heavy_tailed((257,), torch.float64, "cuda").requires_grad_()
    results = []
    for fn_index in (0, 1):
        out = _loss(name, fn_index, input, target, reduction).sum()
        grad_input, grad_target = torch.autograd.grad(out, (input, target), create_graph=True)
        second = (grad_input ** 2).sum() + grad_target.sum() * 3
        # a gradient constant in the operands (the pinball loss's) has no graph of its own
        results.append(torch.autograd.grad(second, (input, target), allow_unused=True, materialize_grads=True)
                       if second.requires_grad else None)
    assert (results[0] is None) == (results[1] is None)
    for actual, want in zip(*results) if results[0] is not None else ():
        torch.testing.assert_close(actual, want)


@pytest.mark.parametrize("name", LOSSES)
def test_gradcheck_through_the_functional_api(name):
    input = (torch.rand(3, 5, dtype=torch.float64, device="cuda") * 4 - 2).requires_grad_()
    target = torch.full((3, 5), 0.1, dtype=torch.float64, device="cuda").requires_grad_()
    for reduction in REDUCTIONS:
        assert torch.autograd.gradcheck(lambda a, b: _loss(name, 0, a, b, reduction), (input, target))


def test_loss_backward_has_no_host_sync():
    input = torch.randn(1 << 24, device="cuda", requires_grad=True)
    target = torch.randn(1 << 24, device="cuda")
    loss = fusedloss.mse_loss(input, target)
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = 2 * (input.detach() - target) / input.numel()
    torch.testing.assert_close(input.grad, expected)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [3 * 4099, 1 << 19, 1 << 22, 1 << 24])  # both sizes of the reduction's scratch
@pytest.mark.parametrize("grad_scale", [1.0, 0.5])
def test_peak_memory_of_a_training_step_is_not_above_eager(name, dtype, n, grad_scale):
    input = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    target = torch.randn(n, device="cuda", dtype=dtype)

    def peak(fn_index):
        input.grad = None
        torch.cuda.synchronize()  # and the last backward's note of grad_output is written
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = _loss(name, fn_index, input, target, "mean")
        (out if grad_scale == 1.0 else out * grad_scale).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    eager = peak(1)
    # With grad_scale != 1 (at the sizes where the forward writes the gradient) the first
    # step corrects the forward's gradient, the second computes it in backward, and the
    # third expects it.
    fused = [peak(0), peak(0), peak(0)]
    # Both hold one N-element gradient. The rest is small blocks: fusedloss's
    # reduction scratch must take no more than eager's staging for its mean.
    assert max(fused) <= eager


def test_no_grad_keeps_no_buffer():
    input = torch.randn(1 << 22, device="cuda", requires_grad=True)
    target = torch.randn(1 << 22, device="cuda")
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        loss = fusedloss.huber_loss(input, target)
    assert torch.cuda.memory_allocated() - before < 4096
    del loss


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("n", [4099, 1 << 25], ids=["small", "fused-gradient"])
def test_a_graph_dropped_before_backward_frees_its_buffers(weighted, n):
    """The backward node holds the operands and, from 128 MiB of operands on, the
    gradient the forward wrote; dropping the loss frees them, as PyTorch's own nodes do."""
    input = torch.randn(n, device="cuda", requires_grad=True)
    target = torch.randn(n, device="cuda")
    weight = torch.rand(n, device="cuda") if weighted else None
    fusedloss.mse_loss(input, target, weight=weight).backward()  # whatever a first call keeps
    input.grad = None
    before = torch.cuda.memory_allocated()
    loss = fusedloss.mse_loss(input, target, weight=weight)
    assert loss.grad_fn is not None
    del loss
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_saved_tensor_hooks_and_anomaly_mode_see_the_operands(name, reduction):
    """saved_tensors_hooks pack and unpack the operands the backward node keeps (as for
    PyTorch's nodes), and anomaly mode runs the same backward."""
    input = heavy_tailed((4099,), device="cuda").requires_grad_()
    target = heavy_tailed((4099,), device="cuda").requires_grad_()
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.shape)
        return t.clone()

    def unpack(t):
        unpacked.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), torch.autograd.detect_anomaly():
        out = _loss(name, 0, input, target, reduction)
        got = torch.autograd.grad(out.sum(), (input, target))
    assert len(packed) >= 2 and len(unpacked) >= 2
    want = torch.autograd.grad(_loss(name, 1, input, target, reduction).sum(), (input, target))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op, extra", [
    ("reduced_loss", ("mse", 0.0, "mean", [False, False])),
    ("pointwise_loss", ("mse", 0.0)),
    ("weighted_loss", (None, None, None, 1.0, "mse", 0.0, [False, False, False])),
])
def test_the_operators_refuse_dual_tensors(op, extra):
    """The operators have no forward-mode rule: called directly with a tangent they raise,
    never drop it (fusedloss's functions hand dual tensors to torch.nn.functional)."""
    import torch.autograd.forward_ad as fwAD

    input, target = torch.randn(33, device="cuda"), torch.randn(33, device="cuda")
    with fwAD.dual_level():
        dual = fwAD.make_dual(input, torch.ones_like(input))
        with pytest.raises(RuntimeError, match="forward-mode AD"):
            getattr(torch.ops.fusedloss, op)(dual, target, *extra)
        got = fwAD.unpack_dual(fusedloss.mse_loss(dual, target)).tangent
        want = fwAD.unpack_dual(torch.nn.functional.mse_loss(dual, target)).tangent
        torch.testing.assert_close(got, want)


class _TinyModel(torch.nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.linear = torch.nn.Linear(64, 48)
        self.loss = loss

    def forward(self, x, y):
        return self.loss(self.linear(x), y)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("mode", ["fullgraph", "reduce-overhead"])
def test_torch_compile(name, mode):
    """fusedloss.nn's module, compiled with the model around it, against the model with the
    loss's reference (PyTorch's function, or the formula) run eagerly."""
    torch._dynamo.reset()
    kwargs = loss_kwargs(name, PARAMS[name])
    model = _TinyModel(getattr(fusedloss.nn, losses.LOSSES[name].module)(**kwargs)).cuda()
    reference = _TinyModel(lambda input, target: LOSSES[name][1](input, target, **kwargs)).cuda()
    reference.load_state_dict(model.state_dict())
    compiled = (torch.compile(model, fullgraph=True) if mode == "fullgraph"
                else torch.compile(model, mode="reduce-overhead", fullgraph=True))
    for step in range(4):
        x = heavy_tailed((32, 64), device="cuda")
        y = heavy_tailed((32, 48), device="cuda")
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        loss = compiled(x, y)
        loss.backward()
        expected = reference(x, y)
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.linear.weight.grad, reference.linear.weight.grad, rtol=1e-4, atol=1e-6)


def test_compile_has_no_graph_break():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()

    def step(x, y):
        total = 0
        for index, name in enumerate(LOSSES):  # every loss, in every reduction between them
            reduction = REDUCTIONS[index % len(REDUCTIONS)]
            out = LOSSES[name][0](x, y, reduction=reduction, **loss_kwargs(name, PARAMS[name]))
            total = total + (out.mean() if reduction == "none" else out)
        return total

    x = torch.randn(100, device="cuda", requires_grad=True)
    y = torch.randn(100, device="cuda")
    explanation = torch._dynamo.explain(step)(x, y)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("captured_expectation", [0.75, 1.0], ids=["predicted", "mispredicted"])
def test_manual_cuda_graph_capture_of_a_training_step(name, captured_expectation, monkeypatch):
    monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", 0)  # the forward writes this small loss's gradient
    input = torch.randn(4099, device="cuda", requires_grad=True)
    target = torch.randn(4099, device="cuda")
    static_scale = torch.tensor(0.75, device="cuda")

    def step():
        input.grad = None
        (_loss(name, 0, input, target, "mean") * static_scale).backward()
        return input.grad

    warm_up_for_capture(step)
    # The warm-up steps noted 0.75; capture a forward that expects either (grad_output_prediction).
    torch.cuda.synchronize()
    # PARAMS is 0.0 for a loss without a number, as fusedloss.functional passes it
    slot = grad_output_prediction.history_slot(name, PARAMS[name], "mean", input, target)
    grad_output_prediction._history["plain"][2 * slot : 2 * slot + 2] = [captured_expectation, 0.0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_grad = step()
    for value in (0.75, 1.0, -2.0):
        with torch.no_grad():
            input.copy_(torch.randn_like(input))
            target.copy_(torch.randn_like(target))
            static_scale.fill_(value)
        graph.replay()
        expected = torch.autograd.grad(_loss(name, 1, input, target, "mean") * value, input)[0]
        torch.testing.assert_close(static_grad, expected, rtol=1e-5, atol=1e-7)


def test_compile_traces_the_same_graph_as_torch():
    """Under torch.compile fusedloss traces torch.nn.functional's formula, so inductor can
    fuse the loss with the model around it: the graph is F's, with no fusedloss op."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8)).cuda()
    x, y = torch.randn(4, 16, device="cuda"), torch.randn(4, 8, device="cuda")
    graphs = []
    for name in LOSSES:
        for fn in (LOSSES[name][0], LOSSES[name][1]):
            torch._dynamo.reset()
            explanation = torch._dynamo.explain(lambda a, b: fn(model(a), b))(x, y)
            assert explanation.graph_break_count == 0 and explanation.graph_count == 1
            graphs.append([str(node.target) for node in explanation.graphs[0].graph.nodes])
    for ours, theirs in zip(graphs[::2], graphs[1::2]):
        assert ours == theirs and not any("fusedloss" in target for target in ours)
