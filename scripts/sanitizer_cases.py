"""Every fusedloss kernel once, at small sizes, for compute-sanitizer (scripts/sanitize.sh).

Losses x reductions x dtype pairs, forward and backward (input and target
gradients, grad_output == 1 and != 1, written by the forward or recomputed in
backward), 16-byte aligned and misaligned operands,
and lengths that leave a tail after the last full vector.
"""

from __future__ import annotations

import itertools

import torch

import fusedloss

LOSSES = {
    "mse": (fusedloss.mse_loss, {}),
    "l1": (fusedloss.l1_loss, {}),
    "smooth_l1": (fusedloss.smooth_l1_loss, {"beta": 0.5}),
    "huber": (fusedloss.huber_loss, {"delta": 2.0}),
}
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
               (torch.bfloat16, torch.float16), (torch.float64, torch.float64)]


def operand(n: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    return (torch.randn(n + offset, device="cuda") * 3).to(dtype)[offset:].requires_grad_()


def main() -> None:
    cases = 0
    for (name, (fn, kwargs)), (in_dtype, tgt_dtype), reduction, offset, n in itertools.product(
        LOSSES.items(), DTYPE_PAIRS, ("none", "mean", "sum"), (0, 1), (4099,)
    ):
        input, target = operand(n, in_dtype, offset), operand(n, tgt_dtype, offset)
        # Reduced: the fused gradient scaled, then (the note of grad_output != 1 read
        # after the sync) recomputed in backward.
        for _ in range(1 if reduction == "none" else 2):
            loss = fn(input, target, reduction=reduction, **kwargs)
            loss.sum().backward() if reduction == "none" else (loss * 0.5).backward()
            torch.cuda.synchronize()
        with torch.no_grad():
            fn(input, target, reduction=reduction, **kwargs)
        fn(input, target.detach(), reduction=reduction, **kwargs).sum().backward()
        cases += 1
    torch.cuda.synchronize()
    print(f"sanitizer cases: {cases} configurations ran")


if __name__ == "__main__":
    main()
