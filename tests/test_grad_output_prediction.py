"""fusedloss.grad_output_prediction: which signature a note belongs to, and what a forward expects.

The GPU side (kernels writing the notes, backward correcting a misprediction with
the same bits) is in test_cuda_grad_output_prediction.py.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fusedloss import grad_output_prediction


@pytest.fixture
def history(monkeypatch):
    table = (ctypes.c_double * 128)(*([1.0, 0.0] * 64))
    monkeypatch.setattr(grad_output_prediction, "_history", {"plain": table})
    # Fake CUDA tensors stand for real ones here: the prediction logic needs no GPU.
    monkeypatch.setattr(grad_output_prediction, "_traced", lambda input, target: torch.compiler.is_compiling())
    return table


def _operands(dtypes=(torch.float32, torch.float32), device="cuda", shapes=((30, 7), (7,))):
    return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in zip(shapes, dtypes))


def test_no_slot_before_the_notes_exist():
    if not grad_output_prediction._history:
        with FakeTensorMode():
            assert grad_output_prediction.history_slot("mse", 0.0, "mean", *_operands()) == -1


def test_traced_tensors_expect_one_and_note_nothing(monkeypatch):
    """AOTAutograd and opcheck trace with fake tensors (whose shapes may be symbolic):
    a traced graph keeps what it was traced with and notes nothing."""
    monkeypatch.setattr(grad_output_prediction, "_history", {"plain": (ctypes.c_double * 128)(*([7.0, 1.0] * 64))})
    with FakeTensorMode():
        operands = _operands()
        assert grad_output_prediction.history_slot("mse", 0.0, "mean", *operands) == -1
        assert grad_output_prediction.predict("mse", 0.0, "mean", *operands) == (-1, 1.0, False)


def test_a_signature_has_one_slot(history):
    with FakeTensorMode():
        input, target = _operands()
        slot = grad_output_prediction.history_slot("huber", 2.0, "sum", input, target)
        assert 0 <= slot < len(history) // 2
        assert grad_output_prediction.history_slot("huber", 2.0, "sum", *_operands()) == slot
        assert grad_output_prediction.history_slot("huber", 2.0, "sum", *_operands(device="cpu")) == -1


@pytest.mark.parametrize("noted", [1.0, 65536.0, 0.37, -0.0, float("nan")])
@pytest.mark.parametrize("mispredicted", [False, True])
def test_forward_expects_the_last_grad_output(history, noted, mispredicted):
    with FakeTensorMode():
        input, target = _operands()
        slot = grad_output_prediction.history_slot("smooth_l1", 0.5, "mean", input, target)
        history[2 * slot], history[2 * slot + 1] = noted, float(mispredicted)
        got_slot, expected, missed = grad_output_prediction.predict("smooth_l1", 0.5, "mean", input, target)
        assert got_slot == slot and missed == mispredicted
        assert expected == noted or expected != expected and noted != noted
        # another signature reads another slot, or (sharing it) the same note: never an error
        other_slot, other, _ = grad_output_prediction.predict("smooth_l1", 0.5, "sum", input, target)
        assert other == history[2 * other_slot] or other != other
