"""Autocast, torch.func transforms and forward-mode AD give PyTorch's results.

Every row of the table of losses: PyTorch's losses against torch.nn.functional,
fusedloss's own (pseudo-Huber) against their formula. The fused operators have
no functorch or forward-AD rules: under a transform fusedloss runs PyTorch's
formula, or its own loss's (never dropping a tangent or a batch dimension).
Under CUDA autocast it computes in float32 from 16-bit operands, as autocast
does for these losses, reading them as they are.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from fusedloss import build, routing

from conftest import LOSSES, PARAMS, heavy_tailed, loss_kwargs, requires_cuda


def _fns(name):
    ours, theirs, _ = LOSSES[name]
    kwargs = loss_kwargs(name, PARAMS[name])
    return (lambda x, y, reduction="mean": ours(x, y, reduction=reduction, **kwargs),
            lambda x, y, reduction="mean": theirs(x, y, reduction=reduction, **kwargs))


def test_transforms_are_recognised():
    x = torch.randn(3)
    assert not routing.under_a_transform()
    seen = []

    def probe(a):
        seen.append(routing.under_a_transform())
        return a.sum()

    torch.func.grad(probe)(x)
    torch.func.vmap(probe)(torch.randn(2, 3))
    torch.func.jvp(probe, (x,), (torch.ones(3),))
    with fwAD.dual_level():
        seen.append(routing.under_a_transform())
    assert seen == [True, True, True, True]
    assert not routing.under_a_transform()  # and nothing is left active


# ---- on the GPU: every loss and reduction against torch.nn.functional or the formula -------


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_torch_func_transforms_match_torch(name, reduction):
    ours, theirs = _fns(name)
    x = heavy_tailed((5, 7), device="cuda")
    y = heavy_tailed((5, 7), device="cuda")
    t = torch.randn(5, 7, device="cuda")

    def scalar(fn):
        return lambda a, b: fn(a, b, reduction).sum()

    for transform in (torch.func.grad, torch.func.jacrev, torch.func.jacfwd):
        torch.testing.assert_close(transform(scalar(ours))(x, y), transform(scalar(theirs))(x, y))
    # per-sample gradients
    per_sample = lambda fn: torch.func.vmap(torch.func.grad(scalar(fn)))  # noqa: E731
    torch.testing.assert_close(per_sample(ours)(x, y), per_sample(theirs)(x, y))
    batched = lambda fn: torch.func.vmap(lambda a, b: fn(a, b, reduction))  # noqa: E731
    torch.testing.assert_close(batched(ours)(x, y), batched(theirs)(x, y))
    # jvp: the tangent, not only the value
    out, tangent = torch.func.jvp(lambda a: ours(a, y, reduction), (x,), (t,))
    expected_out, expected_tangent = torch.func.jvp(lambda a: theirs(a, y, reduction), (x,), (t,))
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(tangent, expected_tangent)
    assert tangent.abs().sum() > 0


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_forward_mode_dual_tensors_match_torch(name, reduction):
    ours, theirs = _fns(name)
    x, y = heavy_tailed((33,), device="cuda"), heavy_tailed((33,), device="cuda")
    t_x, t_y = torch.randn(33, device="cuda"), torch.randn(33, device="cuda")
    with fwAD.dual_level():
        got = fwAD.unpack_dual(ours(fwAD.make_dual(x, t_x), fwAD.make_dual(y, t_y), reduction))
        want = fwAD.unpack_dual(theirs(fwAD.make_dual(x, t_x), fwAD.make_dual(y, t_y), reduction))
    torch.testing.assert_close(got.primal, want.primal)
    assert got.tangent is not None
    torch.testing.assert_close(got.tangent, want.tangent)


AUTOCAST_PAIRS = [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16, torch.float16),
    (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32, torch.float16),
    (torch.float32, torch.float16, torch.float16),
    (torch.bfloat16, torch.float16, torch.bfloat16),
    (torch.float16, torch.bfloat16, torch.float16),
    (torch.float32, torch.float32, torch.bfloat16),
]
PAIRS_WITH_16_BIT_OPERANDS = [p for p in AUTOCAST_PAIRS if {torch.float16, torch.bfloat16} & set(p[:2])]


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("input_dtype", "target_dtype", "autocast_dtype"), AUTOCAST_PAIRS, ids=str)
def test_autocast_matches_torch(name, reduction, input_dtype, target_dtype, autocast_dtype):
    ours, theirs = _fns(name)
    x = heavy_tailed((4097,), device="cuda").to(input_dtype)
    y = heavy_tailed((4097,), device="cuda").to(target_dtype)
    results = []
    for fn in (ours, theirs):
        a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
        with torch.autocast("cuda", dtype=autocast_dtype):
            out = fn(a, b, reduction)
        (out if reduction != "none" else out.sum()).mul(0.37).backward()
        results.append((out, a.grad, b.grad))
    (out, grad_a, grad_b), (expected, expected_a, expected_b) = results
    assert out.dtype == expected.dtype and grad_a.dtype == expected_a.dtype and grad_b.dtype == expected_b.dtype
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
    tolerance = {} if grad_a.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(grad_a, expected_a, **tolerance)
    torch.testing.assert_close(grad_b, expected_b, **tolerance)


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("input_dtype", "target_dtype", "autocast_dtype"), PAIRS_WITH_16_BIT_OPERANDS, ids=str)
def test_autocast_reads_16_bit_operands_without_float32_copies(name, reduction, input_dtype, target_dtype,
                                                               autocast_dtype):
    """A step under autocast allocates its results (a float32 loss, the input's gradient)
    and no float32 copy of a 16-bit operand, which would take 4 bytes an element."""
    build.load()  # the kernels, not the fallback to torch.nn.functional, which copies
    ours, _ = _fns(name)
    n = (1 << 22) + 5
    x = heavy_tailed((n,), device="cuda").to(input_dtype).requires_grad_()
    y = heavy_tailed((n,), device="cuda").to(target_dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=autocast_dtype):
        out = ours(x, y, reduction)
    assert out.dtype == torch.float32
    (out.sum() if reduction == "none" else out).backward()
    peak = torch.cuda.max_memory_allocated() - before
    results = x.element_size() * n + (4 * n if reduction == "none" else 0)  # the gradient, the loss per element
    assert peak < results + 2 * n, f"peak {peak} bytes against {results} for the results"


@requires_cuda
def test_grad_scaler_fp16_loop_matches_torch():
    def train(loss_fn):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8)).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cuda")
        data = torch.randn(20, 64, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        losses = []
        for batch in data:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(batch), batch[:, :8])
            assert loss.dtype == torch.float32
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.detach())
        return torch.stack(losses)

    ours, theirs = _fns("huber")
    torch.testing.assert_close(train(ours), train(theirs), rtol=1e-4, atol=1e-5)
