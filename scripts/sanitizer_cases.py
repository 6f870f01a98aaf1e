"""Every fusedloss kernel once, at small sizes, for compute-sanitizer (scripts/sanitize.sh).

Losses x reductions x dtype pairs, forward and backward (input and target
gradients, grad_output == 1 and != 1, written by the forward and corrected in
backward where it expected another grad_output, or recomputed in backward), 16-byte aligned and misaligned operands, lengths that leave a tail
after the last full vector, reductions of one block and of many (blockwise and
tile per block), and the autocast kernels that read 16-bit operands; the
weighted reductions with each weight layout (none, one value, one to three
runs of dimensions, runs shorter than a chunk, the loss's own size), scale
on the host and on the device, and a weight that requires grad (its gradient
written beside the input's), a weight over leading dimensions of rows of whole
tiles, and a weight of five runs; reduction='none' backward
with a grad_output expanded by a sum over some dimensions; per-sample losses (dim=); the Gaussian
and Poisson NLLs' fused pass (gradients written by the forward, corrected in backward, or
computed there; reduction='none' and its backward) for each dtype and size.
"""

from __future__ import annotations

import itertools
import math

import torch

import fusedloss
from fusedloss import likelihood, losses, routing

# every row of the table of losses, with its number where it has one
LOSSES = {name: (getattr(fusedloss, row.function), {row.param: 0.5 * row.param_default} if row.param else {})
          for name, row in losses.LOSSES.items()}
WEIGHT_SHAPES = (None, (), (1, 7, 1), (1, 7, 13), (5, 1, 13), (13,), (5, 7, 13))
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
               (torch.bfloat16, torch.float16), (torch.float64, torch.float64)]
AUTOCAST_PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32), (torch.float32, torch.bfloat16),
                  (torch.bfloat16, torch.float16)]
# One tile; a few (one block); blockwise over many blocks; past the blockwise limit.
SIZES = (4099, 40_009, 2_100_001)
# Loss shapes and the dimensions a sum takes: per sample, last, middle, outer and
# inner (short runs), and six alternating runs.
EXPANDED_BY_A_SUM = [((6, 5, 7, 9), (1, 2, 3)), ((7, 33, 65), (2,)), ((6, 5, 7, 9), (1,)), ((6, 5, 7, 3), (0, 3)),
                      ((3, 5, 2, 4, 2, 3), (1, 3, 5))]


def operand(n: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    return (torch.randn(n + offset, device="cuda") * 3).to(dtype)[offset:].requires_grad_()


def main() -> None:
    # The gradient written in the forward for the expected grad_output, at every size, not only from 128 MiB.
    routing.FUSED_GRADIENT_FROM_BYTES = 0
    cases = 0
    for (name, (fn, kwargs)), (in_dtype, tgt_dtype), reduction, offset, n in itertools.product(
        LOSSES.items(), DTYPE_PAIRS, ("none", "mean", "sum"), (0, 1), SIZES[:1]
    ):
        input, target = operand(n, in_dtype, offset), operand(n, tgt_dtype, offset)
        # Reduced: the forward's gradient (for grad_output 1) corrected in backward, then
        # (the note of grad_output 0.5 read after the sync) predicted.
        for _ in range(1 if reduction == "none" else 2):
            loss = fn(input, target, reduction=reduction, **kwargs)
            loss.sum().backward() if reduction == "none" else (loss * 0.5).backward()
            torch.cuda.synchronize()
        with torch.no_grad():
            fn(input, target, reduction=reduction, **kwargs)
        fn(input, target.detach(), reduction=reduction, **kwargs).sum().backward()
        cases += 1
    for (name, (fn, kwargs)), n, autocast in itertools.product(LOSSES.items(), SIZES, (False, True)):
        pairs = AUTOCAST_PAIRS if autocast else DTYPE_PAIRS[:1]
        for (in_dtype, tgt_dtype), reduction in itertools.product(pairs, ("mean", "sum", "none")):
            input, target = operand(n, in_dtype, 0), operand(n, tgt_dtype, 0)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                with torch.no_grad():
                    fn(input, target, reduction=reduction, **kwargs)
                (fn(input, target, reduction=reduction, **kwargs) * 0.5).sum().backward()
            cases += 1
    # Each loss with each weight layout, the dtype pairs, scales and offsets taken in turn.
    for i, ((name, (fn, kwargs)), weight_shape) in enumerate(itertools.product(LOSSES.items(), WEIGHT_SHAPES)):
        in_dtype, tgt_dtype = DTYPE_PAIRS[i % len(DTYPE_PAIRS)]
        offset = i % 2
        input = operand(5 * 7 * 13, in_dtype, offset).view(5, 7, 13)
        target = operand(5 * 7 * 13, tgt_dtype, offset).view(5, 7, 13)
        weight = None if weight_shape is None else torch.rand(weight_shape, device="cuda").requires_grad_(i % 2 == 0)
        scale = torch.tensor(0.25, device="cuda") if i % 3 else 0.5
        for reduction, fused_from in itertools.product(("mean", "sum"), (0, 1 << 62)):
            # The gradient written by the forward's pass (corrected, then predicted), then
            # recomputed in backward.
            routing.FUSED_GRADIENT_FROM_BYTES = fused_from
            for _ in range(2 if fused_from == 0 else 1):
                (fn(input, target, reduction=reduction, weight=weight, scale=scale, **kwargs) * 0.5).backward()
                torch.cuda.synchronize()
            with torch.no_grad():
                fn(input, target, reduction=reduction, weight=weight, scale=scale, **kwargs)
        cases += 1
    # A weight over leading dimensions of rows of whole tiles, with the loss's sum per row
    # where the weight requires grad.
    for i, ((name, (fn, kwargs)), weight_shape) in enumerate(itertools.product(LOSSES.items(), ((3, 1, 1), (1, 5, 1)))):
        in_dtype, tgt_dtype = DTYPE_PAIRS[i % len(DTYPE_PAIRS)]
        input = operand(3 * 5 * 8192, in_dtype, 0).view(3, 5, 8192)
        target = operand(3 * 5 * 8192, tgt_dtype, 0).view(3, 5, 8192)
        weight = torch.rand(weight_shape, device="cuda").requires_grad_()
        for fused_from in (0, 1 << 62):
            routing.FUSED_GRADIENT_FROM_BYTES = fused_from
            (fn(input, target, weight=weight, scale=0.5, **kwargs) * 0.5).backward()
            torch.cuda.synchronize()
        with torch.no_grad():
            fn(input, target, weight=weight, **kwargs)
        cases += 1
    # A tensor param read where a weight would lie: quantiles along the last dimension
    # against a broadcast target (a strided view, and a (..., 1) tensor read where it lies),
    # a c per sample against a target of the loss's shape and one that broadcasts; every
    # dtype pair, mean and sum.
    for (in_dtype, tgt_dtype), offset in itertools.product(DTYPE_PAIRS, (0, 1)):
        input = operand(5 * 7 * 9, in_dtype, offset).view(5, 7, 9)
        target = operand(5 * 7 * 9, tgt_dtype, offset).view(5, 7, 9)
        quantiles, c = torch.rand(9, device="cuda"), torch.rand(5, 1, 1, device="cuda") + 0.1
        params = ((fusedloss.quantile_loss, input, target[..., :1].detach(), quantiles),
                  (fusedloss.quantile_loss, input, operand(5 * 7, tgt_dtype, offset).view(5, 7, 1), quantiles),
                  (fusedloss.pseudo_huber_loss, input, target, c),
                  (fusedloss.pseudo_huber_loss, input, operand(7 * 9, tgt_dtype, offset).view(7, 9), c))
        for (fn, x, y, param), reduction, fused_from in itertools.product(params, ("mean", "sum"), (0, 1 << 62)):
            routing.FUSED_GRADIENT_FROM_BYTES = fused_from
            for _ in range(2 if fused_from == 0 else 1):
                (fn(x, y, param, reduction=reduction) * 0.5).backward()
                torch.cuda.synchronize()
            with torch.no_grad():
                fn(x, y, param, reduction=reduction)
        cases += 1
    # A weight of five runs, expanded first over the shortest broadcast run between spanned ones.
    for name, (fn, kwargs) in LOSSES.items():
        input, target = (operand(3 * 4 * 5 * 6 * 7, torch.float32, 1).view(3, 4, 5, 6, 7) for _ in range(2))
        weight = torch.rand(3, 1, 5, 1, 7, device="cuda")
        fn(input, target, weight=weight, scale=0.5, **kwargs).backward()
        cases += 1
    # reduction='none' then a sum over some dimensions: backward reads the expanded
    # grad_output where it lies (one to four runs; six are expanded first over the
    # shortest broadcast run between spanned ones).
    for (name, (fn, kwargs)), (in_dtype, tgt_dtype), (shape, dims) in itertools.product(
        LOSSES.items(), DTYPE_PAIRS, EXPANDED_BY_A_SUM
    ):
        n = math.prod(shape)
        for offset in (0, 1):
            input = operand(n, in_dtype, offset).view(shape)
            target = operand(n, tgt_dtype, offset).view(shape)
            fn(input, target, reduction="none", **kwargs).sum(dim=dims).sum().backward()
        cases += 1
    # dim= over the trailing dimensions: the per-sample pass, rows of one tile, of several
    # (with a partial last tile), and of none (empty rows), every dtype pair, mean and sum.
    for (name, (fn, kwargs)), (in_dtype, tgt_dtype), shape in itertools.product(
        LOSSES.items(), DTYPE_PAIRS, [(6, 5, 8, 9), (3, 2, 4104), (4, 0, 8)]
    ):
        n = math.prod(shape)
        input, target = operand(n, in_dtype, 0).view(shape), operand(n, tgt_dtype, 0).view(shape)
        for reduction in ("mean", "sum"):
            fn(input, target, reduction=reduction, dim=(1, 2), **kwargs).sum().backward()
        cases += 1
    # The NLLs' fused pass, operands of one dtype and shape: the gradients written by the
    # forward for the expected grad_output (corrected, then predicted), and computed in
    # backward where the forward wrote none; reduction='none' at every size.
    likelihood.POISSON_WRITTEN_OUT_FROM_BYTES = 0
    for dtype, n, reduction in itertools.product((torch.float32, torch.bfloat16, torch.float16, torch.float64), SIZES,
                                                 ("none", "mean", "sum")):
        input, target = operand(n, dtype, 0), operand(n, dtype, 0)
        var = (operand(n, dtype, 0).detach().abs() + 0.1).requires_grad_()
        rate = input.detach().abs().requires_grad_()
        calls = (lambda: fusedloss.gaussian_nll_loss(input, target, var, full=True, reduction=reduction),
                 lambda: fusedloss.poisson_nll_loss(input, target, full=True, reduction=reduction),
                 lambda: fusedloss.poisson_nll_loss(rate, target, log_input=False, reduction=reduction))
        for call, fused_from in itertools.product(calls, (0, 1 << 62)):
            routing.FUSED_GRADIENT_FROM_BYTES = fused_from
            for _ in range(2 if fused_from == 0 else 1):
                out = call()
                # 'none': a grad_output per element, and one value expanded
                out.backward(torch.rand_like(out)) if reduction == "none" else (out * 0.5).backward()
                if reduction == "none":
                    call().sum().backward()
                torch.cuda.synchronize()
            with torch.no_grad():
                call()
        cases += 1
    torch.cuda.synchronize()
    print(f"sanitizer cases: {cases} configurations ran")


if __name__ == "__main__":
    main()
