"""Gradient placement on CUDA (fusedloss.gradient_placement): the kernels' notes of
grad_output, and the forward that follows them, with the same bits either way."""

from __future__ import annotations

import pytest
import torch

from fusedloss import build, functional, gradient_placement

from conftest import LOSSES, heavy_tailed, loss_kwargs, requires_cuda

pytestmark = requires_cuda
PARAMS = {"mse": 0.0, "l1": 0.0, "smooth_l1": 0.5, "huber": 2.0}


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    build.load()
    # Placement applies from FUSED_GRADIENT_FROM_BYTES of operands on; these tests use small ones.
    monkeypatch.setattr(functional, "FUSED_GRADIENT_FROM_BYTES", 0)


def _slot(name, reduction, input, target):
    return gradient_placement.history_slot(name, PARAMS[name], reduction, input, target)


def _note(name, reduction, input, target, scaled: bool):
    gradient_placement._history_table()  # allocated on a first forward; a test may come first
    torch.cuda.synchronize()  # no kernel may overwrite it
    gradient_placement._history[_slot(name, reduction, input, target)] = int(scaled)


def _loss(name, input, target, reduction):
    return LOSSES[name][0](input, target, reduction=reduction, **loss_kwargs(name, PARAMS[name]))


@pytest.fixture
def output_masks(monkeypatch):
    """The output_mask each fused forward passes to the op."""
    masks = []
    real = functional._reduced_loss
    monkeypatch.setattr(functional, "_reduced_loss", lambda *args: masks.append(args[5]) or real(*args))
    return masks


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
                                    (torch.float64, torch.float64)], ids=str)
@pytest.mark.parametrize("grad_scale", [0.37, 1.0, -3.0])
def test_both_placements_give_the_same_bits(name, reduction, dtypes, grad_scale, output_masks):
    # Heavy tails reach both branches of Smooth L1 and Huber; the target broadcasts.
    input = heavy_tailed((257, 389), torch.float64, "cuda").to(dtypes[0])
    target = heavy_tailed((389,), torch.float64, "cuda").to(dtypes[1])
    results = []
    for gradient_in_backward in (False, True):
        x, y = input.clone().requires_grad_(), target.clone().requires_grad_()
        _note(name, reduction, x, y, gradient_in_backward)
        before = torch.cuda.memory_allocated()
        loss = _loss(name, x, y, reduction)
        held = torch.cuda.memory_allocated() - before
        # The fused forward holds the broadcast-shaped gradients; the other none.
        assert (held >= x.numel() * x.element_size()) != gradient_in_backward
        (loss * grad_scale).backward()
        results.append((loss, x.grad, y.grad))
    assert output_masks == [[True, True], [False, False]]
    for fused, recomputed in zip(*results):
        assert torch.equal(fused, recomputed)


@pytest.mark.parametrize("name", LOSSES)
def test_forward_follows_the_last_backward(name, output_masks):
    input = heavy_tailed((3 * 4099,), device="cuda").requires_grad_()
    target = heavy_tailed((3 * 4099,), device="cuda")
    slot = -1
    for grad_scale in (1.0, 0.5, 0.5, 2.0, 1.0, 1.0):
        input.grad = None
        (_loss(name, input, target, "mean") * grad_scale).backward()
        torch.cuda.synchronize()
        slot = _slot(name, "mean", input, target)
        assert gradient_placement._history[slot] == int(grad_scale != 1.0)
    # The first forward writes; each later one follows the backward before it.
    assert output_masks == [[True, False], [True, False], [False, False], [False, False], [False, False],
                            [True, False]]


@pytest.mark.parametrize("grad_scale", [0.5, 1.0])
def test_recomputing_step_has_no_host_sync(grad_scale):
    input = torch.randn(1 << 22, device="cuda", requires_grad=True)
    target = torch.randn(1 << 22, device="cuda")
    _note("smooth_l1", "mean", input, target, True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        (_loss("smooth_l1", input, target, "mean") * grad_scale).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    d = input.detach() - target
    expected = torch.where(d.abs() < 0.5, d / 0.5, d.sign()) / input.numel() * grad_scale
    torch.testing.assert_close(input.grad, expected)


def test_no_grad_forward_needs_no_notes(output_masks):
    input = torch.randn(999, device="cuda", requires_grad=True)
    target = torch.randn(999, device="cuda")
    _note("mse", "mean", input, target, True)
    with torch.no_grad():
        _loss("mse", input, target, "mean")
    _loss("mse", input.detach(), target, "mean")
    assert output_masks == [[False, False], [False, False]]
