"""The expected grad_output on CUDA (fusedloss.grad_output_prediction): the kernels' notes,
the forward that follows them, and backward's correction of a misprediction, with the
same bits as a gradient recomputed in backward."""

from __future__ import annotations

import pytest
import torch

import fusedloss
from fusedloss import build, grad_output_prediction, losses, routing

from conftest import LOSSES, PARAMS, heavy_tailed, loss_kwargs, requires_cuda

pytestmark = requires_cuda
NEVER = 1 << 62  # FUSED_GRADIENT_FROM_BYTES that no loss reaches: backward computes every gradient


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    build.load()
    grad_output_prediction._history_table("plain")  # so that history_slot has a slot to give from the first test on
    # The forward writes the gradient from FUSED_GRADIENT_FROM_BYTES of operands on; these tests use small ones.
    monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", 0)


def _note(slot: int, grad_output: float, mispredicted: bool = False) -> None:
    history = grad_output_prediction._history_table("plain")  # allocated on a first forward; a test may come first
    torch.cuda.synchronize()  # no kernel may overwrite it
    history[2 * slot] = grad_output
    history[2 * slot + 1] = float(mispredicted)


def _noted(slot: int) -> tuple[float, bool]:
    torch.cuda.synchronize()
    history = grad_output_prediction._history["plain"]
    return history[2 * slot], history[2 * slot + 1] != 0.0


def _loss(name, input, target, reduction, **kwargs):
    return LOSSES[name][0](input, target, reduction=reduction, **loss_kwargs(name, PARAMS[name]), **kwargs)


@pytest.fixture
def forwards(monkeypatch):
    """(output_mask, history_slot, expected_grad_output) of each fused forward."""
    calls = []
    real = routing.apply
    monkeypatch.setattr(build, "cxx_autograd_loaded", lambda: False)  # every forward through routing.apply
    monkeypatch.setattr(routing, "apply", lambda function, op, differentiable, *args: calls.append(args[5:8])
                        or real(function, op, differentiable, *args))
    return calls


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float16, torch.float16), (torch.float16, torch.float32),
                                    (torch.float64, torch.float64)], ids=str)
@pytest.mark.parametrize("grad_scale", [0.37, 1.0, -3.0, 65536.0])
def test_predicted_corrected_and_recomputed_give_the_same_bits(name, reduction, dtypes, grad_scale, monkeypatch):
    """The forward's gradient for the grad_output that comes; for another one, corrected in
    backward; after a misprediction, computed in backward; and below the size where the
    forward writes it. (An fp16 loss times 65536 is inf, and its gradients hold NaN.)"""
    # Heavy tails reach both branches of the losses with a number; the target broadcasts.
    input = heavy_tailed((257, 389), torch.float64, "cuda").to(dtypes[0])
    target = heavy_tailed((389,), torch.float64, "cuda").to(dtypes[1])
    routes = {"predicted": (0, grad_scale, False), "corrected": (0, grad_scale * 3 + 1, False),
              "after a misprediction": (0, grad_scale, True), "recomputed": (NEVER, None, False)}
    results = {}
    for route, (threshold, noted, mispredicted) in routes.items():
        monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", threshold)
        x, y = input.clone().requires_grad_(), target.clone().requires_grad_()
        if noted is not None:
            _note(grad_output_prediction.history_slot(name, PARAMS[name], reduction, x, y), noted, mispredicted)
        before = torch.cuda.memory_allocated()
        loss = _loss(name, x, y, reduction)
        held = torch.cuda.memory_allocated() - before
        # A forward that writes the gradients holds them; one that does not, nothing of that size.
        assert (held >= x.numel() * x.element_size()) == (route in ("predicted", "corrected"))
        (loss * grad_scale).backward()
        results[route] = (loss, x.grad, y.grad)
    for route in routes:
        for a, b in zip(results["predicted"], results[route]):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=route)


@pytest.mark.parametrize("name", LOSSES)
def test_forward_follows_the_notes(name, forwards):
    input = heavy_tailed((3 * 4099,), device="cuda").requires_grad_()
    target = heavy_tailed((3 * 4099,), device="cuda")
    scales = (1.0, 0.5, 0.5, 2.0**16, 2.0**16, 2.0**16, 2.0**15, 1.0)
    notes = []
    for grad_scale in scales:
        input.grad = None
        (_loss(name, input, target, "mean") * grad_scale).backward()
        notes.append(_noted(grad_output_prediction.history_slot(name, PARAMS[name], "mean", input, target)))
        d = input.detach().double() - target.double()
        expected = losses.LOSSES[name].gradient(d, PARAMS[name]) * grad_scale / input.numel()
        torch.testing.assert_close(input.grad.double(), expected, rtol=2e-6, atol=1e-30)
    # Each forward expects the grad_output the backward before it brought, and writes the
    # gradient unless that backward's was mispredicted.
    assert [call[2] for call in forwards] == [1.0, *scales[:-1]]
    assert notes == [(1.0, False), (0.5, True), (0.5, False), (2.0**16, True), (2.0**16, False), (2.0**16, False),
                     (2.0**15, True), (1.0, True)]
    assert [call[0] == [True, False] for call in forwards] == [True, True, False, True, False, True, True, False]


@pytest.mark.parametrize("predicted", [True, False], ids=["predicted", "mispredicted"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_a_large_step_has_no_host_sync(predicted, weighted):
    input = torch.randn(1 << 22, device="cuda", requires_grad=True)
    target = torch.randn(1 << 22, device="cuda")
    kwargs = {"weight": torch.rand(1 << 22, device="cuda"), "scale": torch.tensor(0.5, device="cuda")} if weighted else {}
    (_loss("smooth_l1", input, target, "mean", **kwargs) * 0.25).backward()  # notes 0.25
    input.grad = None
    grad_scale = 0.25 if predicted else 4.0
    torch.cuda.set_sync_debug_mode("error")
    try:
        (_loss("smooth_l1", input, target, "mean", **kwargs) * grad_scale).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    d = input.detach() - target
    expected = losses.LOSSES["smooth_l1"].gradient(d, PARAMS["smooth_l1"]) * grad_scale
    if weighted:
        expected = expected * kwargs["weight"] * 0.5 / kwargs["weight"].sum()
    else:
        expected = expected / input.numel()
    torch.testing.assert_close(input.grad, expected)


def test_no_grad_forward_needs_no_notes(forwards):
    input = torch.randn(999, device="cuda", requires_grad=True)
    target = torch.randn(999, device="cuda")
    with torch.no_grad():
        _loss("mse", input, target, "mean")
    _loss("mse", input.detach(), target, "mean")
    assert forwards == [([False, False], -1, 1.0)] * 2


def test_a_float64_pair_with_a_narrower_operand_recomputes_in_backward(forwards):
    """Its gradients are computed in float64 and converted: backward could not correct the
    converted buffer in place, so the forward writes none."""
    input = torch.randn(999, device="cuda", requires_grad=True)
    target = torch.randn(999, device="cuda", dtype=torch.float64)
    (fusedloss.mse_loss(input, target) * 0.37).backward()
    assert forwards[0][0] == [False, False]
    expected = 2 * (input.detach().double() - target) / input.numel() * 0.37
    torch.testing.assert_close(input.grad, expected.float(), rtol=0, atol=0)
