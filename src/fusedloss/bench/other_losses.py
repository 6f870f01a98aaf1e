"""The rows of ``python -m fusedloss bench`` for the losses beyond MSE's seed rows: the
quantile, log-cosh, Gaussian and Poisson NLL losses, per-sample losses over ``dim``, and
a tensor parameter. Each case is a step (loss + backward) of fusedloss, eager PyTorch (the
formula users write, or torch.nn.functional's loss) and ``torch.compile`` of eager.

Bytes a step must move: every operand read once, and the gradient of each operand that
requires one written once, in the operands' own dtypes (a broadcast target counts its
own size). Large rows give device time and %copy; the small ones wall time, as a
training loop feels it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import fusedloss

QUANTILES = (0.02, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.98)


@dataclass
class Case:
    """A step's label, its three systems as functions of (p, t), and the operands; p is
    the leaf that gets a gradient."""

    label: str
    fused: Callable[[Tensor, Tensor], Tensor]
    eager: Callable[[Tensor, Tensor], Tensor]
    p: Tensor
    t: Tensor
    others: tuple[Tensor, ...] = ()

    @property
    def nbytes(self) -> int:
        read = sum(x.numel() * x.element_size() for x in (self.p, self.t, *self.others))
        return read + self.p.numel() * self.p.element_size()


def pytorch_forecasting_quantile(p: Tensor, t: Tensor, quantiles=QUANTILES) -> Tensor:
    """pytorch-forecasting's QuantileLoss in plain torch: a loop over the quantiles, twice
    the pinball loss, the mean over every element."""
    losses = []
    for i, q in enumerate(quantiles):
        errors = t[..., 0] - p[..., i]
        losses.append(torch.max((q - 1) * errors, q * errors).unsqueeze(-1))
    return 2 * torch.cat(losses, dim=-1).mean()


def _operands(shape: tuple[int, ...], dtype: torch.dtype, device: str, target_shape: tuple[int, ...] | None = None,
              positive: bool = False) -> tuple[Tensor, Tensor]:
    p = torch.randn(shape, device=device, dtype=dtype)
    t = torch.randn(target_shape or shape, device=device, dtype=dtype)
    if positive:  # Poisson counts, and a rate's log as the input
        t = torch.poisson(t.float().abs() * 3).to(dtype)
    return p.requires_grad_(), t


def quantile_cases(device: str = "cuda", shapes=((256, 96), (1024, 720))) -> list[Case]:
    """The forecasting shape: (batch, horizon, 9 quantiles) fp32 against a (batch, horizon, 1) target.
    pytorch-forecasting's loss is twice the mean, which fusedloss takes as ``scale=2``."""
    cases = []
    for batch, horizon in shapes:
        p, t = _operands((batch, horizon, len(QUANTILES)), torch.float32, device, (batch, horizon, 1))
        cases.append(Case(f"quantile x9 {(batch, horizon, len(QUANTILES))} fp32",
                          lambda a, b: fusedloss.quantile_loss(a, b, QUANTILES, scale=2), pytorch_forecasting_quantile,
                          p, t))
    return cases


def elementwise_cases(n: int, dtype: torch.dtype, device: str = "cuda") -> list[Case]:
    """Each new loss on N elements: its fused step against the formula or F's loss."""
    p, t = _operands((n,), dtype, device)
    _, counts = _operands((n,), dtype, device, positive=True)
    var = torch.rand(n, device=device, dtype=dtype) + 0.5
    size = f"2^{n.bit_length() - 1} {str(dtype).removeprefix('torch.')}"
    return [
        Case(f"log-cosh {size}", fusedloss.log_cosh_loss, lambda a, b: torch.log(torch.cosh(a - b)).mean(), p, t),
        Case(f"quantile q=0.9 {size}", lambda a, b: fusedloss.quantile_loss(a, b, 0.9),
             lambda a, b: torch.max(-0.1 * (b - a), 0.9 * (b - a)).mean(), p, t),
        Case(f"poisson NLL {size}", fusedloss.poisson_nll_loss, F.poisson_nll_loss, p, counts),
        Case(f"gaussian NLL {size}", lambda a, b: fusedloss.gaussian_nll_loss(a, b, var),
             lambda a, b: F.gaussian_nll_loss(a, b, var), p, t, (var,)),
    ]


def per_sample_case(shape: tuple[int, ...] = (64, 16, 256, 256), dtype: torch.dtype = torch.bfloat16,
                    device: str = "cuda") -> Case:
    """Min-SNR weighting: the per-sample mean over (1, 2, 3), times a weight, then the mean."""
    p, t = _operands(shape, dtype, device)
    w = torch.rand(shape[0], device=device, dtype=dtype)
    return Case(f"mse dim=(1, 2, 3) * w, {shape} {str(dtype).removeprefix('torch.')}",
                lambda a, b: (fusedloss.mse_loss(a, b, dim=(1, 2, 3)) * w).mean(),
                lambda a, b: (F.mse_loss(a, b, reduction="none").mean(dim=(1, 2, 3)) * w).mean(), p, t, (w,))


def tensor_param_cases(shape: tuple[int, ...] = (64, 4, 128, 128), dtype: torch.dtype = torch.bfloat16,
                       device: str = "cuda") -> list[Case]:
    """A tensor parameter: pseudo-Huber's c per sample, as diffusers' scheduled Huber has it,
    and a Gaussian variance per row (one dimension fewer, the homoscedastic form PyTorch takes)."""
    p, t = _operands(shape, dtype, device)
    c = torch.rand(shape[0], 1, 1, 1, device=device, dtype=dtype) * 0.1 + 0.01
    var = torch.rand(shape[:-1], device=device, dtype=dtype) + 0.5

    def diffusers_pseudo_huber(a: Tensor, b: Tensor) -> Tensor:
        return (2 * c * (torch.sqrt((a.float() - b.float()) ** 2 + c**2) - c)).mean()

    label = f"{shape} {str(dtype).removeprefix('torch.')}"
    return [Case(f"pseudo-huber c (B,1,1,1) {label}", lambda a, b: fusedloss.pseudo_huber_loss(a, b, c),
                 diffusers_pseudo_huber, p, t, (c,)),
            Case(f"gaussian NLL var {tuple(var.shape)} {label}", lambda a, b: fusedloss.gaussian_nll_loss(a, b, var),
                 lambda a, b: F.gaussian_nll_loss(a, b, var), p, t, (var,))]
