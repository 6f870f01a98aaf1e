"""The grad_output that a large loss's backward will bring, predicted from the last one.

From ``routing.FUSED_GRADIENT_FROM_BYTES`` of operands on, the forward pass writes
the gradient (read input + read target + write grad), and backward hands that buffer
on. Each gradient must be rounded into its dtype once, after every factor: grad_output
included, since a gradient rounded first and multiplied after loses the digits that
loss scaling (AMP's ``GradScaler``) exists to keep. So the forward multiplies by the
grad_output it expects: the one the last backward of the same loss brought, which
``loss.backward()`` (1), ``GradScaler`` (its scale) and ``loss / k`` repeat step
after step.

Only the GPU knows grad_output, and asking it would be a host sync. So every
backward kernel writes grad_output into host-mapped memory, in a slot chosen by the
loss's signature (loss, parameter, reduction, operand and weight shapes, dtypes,
device), and an eager forward with the same signature reads it. Backward compares
the real grad_output with the expected one on the GPU, and where they differ (a
first step, a changed scale, a note not written yet, a slot two call sites share) it
recomputes the gradients in place from the operands: a misprediction costs time,
never correctness, and both ways give the same bits.

A misprediction costs a second pass, so the kernel notes it too: after one, the next
forward only reads, and backward computes the gradient (read 2N, then read 2N and
write N, instead of read 2N and write N twice). A grad_output that changes every step
(``loss / tokens_in_batch``) then costs no more than that; one that holds again is
expected from the step after. ``torch.compile`` and CUDA graph capture keep what
they traced or captured.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

# Each family of kernels (build.FAMILIES) keeps its own notes, read through its own operator.
_NOTES_OPS = {"plain": "grad_output_history", "weighted": "weighted_grad_output_history",
              "likelihood": "likelihood_grad_output_history"}
_history: dict[str, ctypes.Array] = {}


def _history_table(family: str) -> ctypes.Array | None:
    """The family's notes, fetched (and allocated) once, never while a CUDA graph is being
    captured (allocating pinned memory is not allowed then)."""
    if family not in _history and not torch.cuda.is_current_stream_capturing():
        table = getattr(torch.ops.fusedloss, _NOTES_OPS[family])()  # (slots, 2): grad_output, mispredicted
        # A ctypes view reads the live memory on every index, without torch's overhead.
        _history[family] = (ctypes.c_double * table.numel()).from_address(table.data_ptr())
    return _history.get(family)


def _traced(input: Tensor, target: Tensor) -> bool:
    # torch.compile, or AOTAutograd and opcheck tracing with fake tensors: keep what is traced.
    return torch.compiler.is_compiling() or type(input) is not Tensor or type(target) is not Tensor


def history_slot(loss: str, param: float, reduction: str, input: Tensor, target: Tensor,
                 weight: Tensor | None = None, family: str = "plain") -> int:
    """The slot where this loss's backward notes grad_output, or -1 for nowhere
    (CPU operands, tracing, or before the notes exist)."""
    history = _history.get(family)
    if history is None or input.device.type != "cuda" or _traced(input, target):
        return -1
    signature = (loss, param, reduction, tuple(input.shape), tuple(target.shape), input.dtype, target.dtype,
                 input.device.index, None if weight is None else tuple(weight.shape))
    return hash(signature) % (len(history) // 2)


def predict(loss: str, param: float, reduction: str, input: Tensor, target: Tensor,
            weight: Tensor | None = None, family: str = "plain") -> tuple[int, float, bool]:
    """(slot, expected grad_output, mispredicted) for a large loss's forward: the grad_output
    noted in the slot by the last backward there (1.0 where there is none), and whether
    that backward's forward expected another; after a misprediction the forward writes no
    gradient."""
    if family not in _history and input.device.type == "cuda" and not _traced(input, target):
        with torch.cuda.device(input.device):  # where the pinned allocation's context lives
            _history_table(family)
    slot = history_slot(loss, param, reduction, input, target, weight, family)
    if slot < 0:
        return slot, 1.0, False
    history = _history[family]
    return slot, history[2 * slot], history[2 * slot + 1] != 0.0
