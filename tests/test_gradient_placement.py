"""fusedloss.gradient_placement: which signature a note belongs to, and when a forward reads it.

The GPU side (kernels writing the notes, both placements giving the same bits)
is in test_cuda_gradient_placement.py.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fusedloss import gradient_placement


@pytest.fixture
def history(monkeypatch):
    table = (ctypes.c_int32 * 64)()
    monkeypatch.setattr(gradient_placement, "_history", table)
    # Fake CUDA tensors stand for real ones here: the placement logic needs no GPU.
    monkeypatch.setattr(gradient_placement, "_traced", lambda input, target: torch.compiler.is_compiling())
    return table


def _operands(dtypes=(torch.float32, torch.float32), device="cuda", shapes=((30, 7), (7,))):
    return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in zip(shapes, dtypes))


def test_no_slot_before_the_notes_exist():
    if gradient_placement._history is None:
        with FakeTensorMode():
            assert gradient_placement.history_slot("mse", 0.0, "mean", *_operands()) == -1


def test_traced_tensors_get_no_slot(monkeypatch):
    """AOTAutograd and opcheck trace with fake tensors (whose shapes may be symbolic):
    a traced graph keeps the placement it was traced with and notes nothing."""
    monkeypatch.setattr(gradient_placement, "_history", (ctypes.c_int32 * 64)(*([1] * 64)))
    with FakeTensorMode():
        operands = _operands()
        assert gradient_placement.history_slot("mse", 0.0, "mean", *operands) == -1
        assert not gradient_placement.gradient_in_backward("mse", 0.0, "mean", *operands)


def test_a_signature_has_one_slot(history):
    with FakeTensorMode():
        input, target = _operands()
        slot = gradient_placement.history_slot("huber", 2.0, "sum", input, target)
        assert 0 <= slot < len(history)
        assert gradient_placement.history_slot("huber", 2.0, "sum", *_operands()) == slot
        assert gradient_placement.history_slot("huber", 2.0, "sum", *_operands(device="cpu")) == -1


def test_forward_follows_the_note(history):
    with FakeTensorMode():
        input, target = _operands()
        slot = gradient_placement.history_slot("smooth_l1", 0.5, "mean", input, target)
        history[slot] = 1
        assert gradient_placement.gradient_in_backward("smooth_l1", 0.5, "mean", input, target)
        # another signature reads another slot, or (sharing it) the same note: never an error
        other = gradient_placement.gradient_in_backward("smooth_l1", 0.5, "sum", input, target)
        assert other == bool(history[gradient_placement.history_slot("smooth_l1", 0.5, "sum", input, target)])
        history[slot] = 0
        assert not gradient_placement.gradient_in_backward("smooth_l1", 0.5, "mean", input, target)


def test_forward_keeps_the_fused_gradient_where_recomputing_would_differ(history, monkeypatch):
    history[:] = [1] * len(history)  # every note says "scaled"
    with FakeTensorMode():
        assert not gradient_placement.gradient_in_backward("mse", 0.0, "mean", *_operands(device="cpu"))
        mixed = _operands((torch.float32, torch.float64))
        assert not gradient_placement.gradient_in_backward("mse", 0.0, "mean", *mixed)
        both = _operands((torch.float64, torch.float64))
        assert gradient_placement.gradient_in_backward("mse", 0.0, "mean", *both)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not gradient_placement.gradient_in_backward("mse", 0.0, "mean", *both)
        assert gradient_placement.history_slot("mse", 0.0, "mean", *both) == -1
