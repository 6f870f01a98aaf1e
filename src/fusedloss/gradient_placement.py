"""Which pass computes a mean or sum loss's gradient: the forward, or backward.

With ``loss.backward()`` (grad_output == 1) the fastest step writes the
gradient in the forward pass (read input + read target + write grad) and
backward hands that buffer on. With ``(w * loss).backward()`` or AMP's
``GradScaler`` (grad_output != 1) the buffer must then be scaled, a second
read and write. Computing the gradient in backward instead, from input and
target, after a forward that only reads, moves as many bytes with fewer
writes, and is faster (docs/design.md, "Gradient placement").
Both ways give the same bits.

Only the GPU knows grad_output, and asking it would be a host sync. So the
backward kernels note in host-mapped memory whether grad_output was 1, in a
slot chosen by the loss's signature (loss, parameter, reduction, operand shapes
and dtypes, device), and an eager forward with the same signature reads the
note: it leaves the gradient to backward when the last backward had to scale
it. A note the GPU has not written yet, or a slot that two call sites share,
costs time, never correctness. ``torch.compile`` and CUDA graph capture keep
what they traced or captured; a compiled forward always writes the gradient.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

_history: ctypes.Array | None = None


def _history_table() -> ctypes.Array | None:
    """The notes, fetched (and allocated) once, never while a CUDA graph is being
    captured (allocating pinned memory is not allowed then)."""
    global _history
    if _history is None and not torch.cuda.is_current_stream_capturing():
        table = torch.ops.fusedloss.grad_output_history()
        # A ctypes view reads the live memory on every index, without torch's overhead.
        _history = (ctypes.c_int32 * table.numel()).from_address(table.data_ptr())
    return _history


def _traced(input: Tensor, target: Tensor) -> bool:
    # torch.compile, or AOTAutograd and opcheck tracing with fake tensors: keep what is traced.
    return torch.compiler.is_compiling() or type(input) is not Tensor or type(target) is not Tensor


def history_slot(loss: str, param: float, reduction: str, input: Tensor, target: Tensor) -> int:
    """The slot where this loss's backward notes grad_output, or -1 for nowhere
    (CPU operands, tracing, or before the first eager CUDA forward with gradients)."""
    if _history is None or input.device.type != "cuda" or _traced(input, target):
        return -1
    signature = (loss, param, reduction, tuple(input.shape), tuple(target.shape), input.dtype, target.dtype,
                 input.device.index)
    return hash(signature) % len(_history)


def gradient_in_backward(loss: str, param: float, reduction: str, input: Tensor, target: Tensor) -> bool:
    """Whether an eager forward should leave the gradient to backward: the last
    backward of a loss with this signature had grad_output != 1."""
    if (
        input.device.type != "cuda"
        or _traced(input, target)
        # A pair with one float64 operand is computed in one dtype and its gradients
        # converted back: recomputing would round differently from scaling.
        or (input.dtype == torch.float64) != (target.dtype == torch.float64)
    ):
        return False
    if _history is None:
        with torch.cuda.device(input.device):  # where the pinned allocation's context lives
            if _history_table() is None:
                return False
    return bool(_history[history_slot(loss, param, reduction, input, target)])
