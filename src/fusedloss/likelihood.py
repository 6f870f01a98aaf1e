"""The Gaussian and Poisson negative log-likelihoods, as torch.nn.functional computes
them, with fusedloss's ``weight``, ``scale`` and ``dim`` around them.

On a GPU, the Gaussian loss takes no host sync: PyTorch checks ``var`` for negative
entries with ``torch.any``, which waits for the GPU; here a negative entry's loss is NaN
(and so is any mean or sum over it) instead. On the CPU, where that check waits for
nothing, PyTorch's ValueError is kept.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import _reduction

from . import reductions, routing
from .reductions import Dims

_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)


def gaussian_nll(input: Tensor, target: Tensor, var: Tensor | float, full: bool, eps: float, reduction: str,
                 weight: Tensor | None, scale: float | Tensor | None, dim: Dims, keepdim: bool) -> Tensor:
    plain = weight is None and scale is None and dim is None
    if not checks_without_sync(input, target, var):
        if plain:
            return F.gaussian_nll_loss(input, target, var, full=full, eps=eps, reduction=reduction)
        _check_reduction(reduction)
        per_element = F.gaussian_nll_loss(input, target, var, full=full, eps=eps, reduction="none")
    else:
        per_element = gaussian_nll_elementwise(input, target, var, full, eps, reduction)
        if plain:
            return per_element if reduction == "none" else reductions.reduce(per_element, reduction, None, None)
    return reductions.reduce(per_element, reduction, weight, scale, dim, keepdim)


def checks_without_sync(input: Tensor, target: Tensor, var: Tensor | float) -> bool:
    """Whether a negative variance is reported as NaN (a tensor on a GPU, where PyTorch's
    check would wait for it) rather than PyTorch's ValueError."""
    return (isinstance(var, Tensor) and var.device.type != "cpu"
            and routing.no_torch_function(input, target, var))


def gaussian_nll_elementwise(input: Tensor, target: Tensor, var: Tensor, full: bool, eps: float,
                             reduction: str) -> Tensor:
    """torch.nn.functional.gaussian_nll_loss's loss per element, its shape rules and its
    gradients (the clamp at eps passes var's gradient through, as PyTorch's does), with a
    negative var's entries NaN instead of a check that waits for the GPU."""
    if var.size() != input.size():
        if input.size()[:-1] == var.size():
            var = torch.unsqueeze(var, -1)  # homoscedastic: one variance per row
        elif not (input.ndim == var.ndim
                  and sum(v for i, v in zip(input.size(), var.size(), strict=True) if i != v) == 1):
            raise ValueError("var is of incorrect size")
    _check_reduction(reduction)
    negative = var < 0
    var = var.clone()
    with torch.no_grad():  # PyTorch's clamp, which autograd does not see
        var.clamp_(min=eps)
        var.masked_fill_(negative, math.nan)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + _HALF_LOG_TWO_PI
    return loss


def poisson_nll(input: Tensor, target: Tensor, log_input: bool, full: bool, size_average: bool | None, eps: float,
                reduce: bool | None, reduction: str, weight: Tensor | None, scale: float | Tensor | None, dim: Dims,
                keepdim: bool) -> Tensor:
    if weight is None and scale is None and dim is None:
        return F.poisson_nll_loss(input, target, log_input=log_input, full=full, size_average=size_average, eps=eps,
                                  reduce=reduce, reduction=reduction)
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not a valid value for reduction")  # PyTorch's words
    per_element = F.poisson_nll_loss(input, target, log_input=log_input, full=full, eps=eps, reduction="none")
    return reductions.reduce(per_element, reduction, weight, scale, dim, keepdim)


def _check_reduction(reduction: str) -> None:
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not valid")  # PyTorch's words
