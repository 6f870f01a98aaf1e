"""Loss modules: subclasses of the ``torch.nn`` classes that compute with fusedloss.

Construction, attributes, ``state_dict`` and ``repr`` are the parent's; ``forward``
computes with fusedloss and also takes ``weight`` and ``scale`` (see
:mod:`fusedloss.functional`), which change from batch to batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import functional


class MSELoss(torch.nn.MSELoss):
    """``torch.nn.MSELoss`` computed by :func:`fusedloss.mse_loss`."""

    def forward(self, input: Tensor, target: Tensor, weight: Tensor | None = None, *,
                scale: float | Tensor | None = None) -> Tensor:
        return functional.mse_loss(input, target, reduction=self.reduction, weight=weight, scale=scale)


class L1Loss(torch.nn.L1Loss):
    """``torch.nn.L1Loss`` computed by :func:`fusedloss.l1_loss`."""

    def forward(self, input: Tensor, target: Tensor, weight: Tensor | None = None, *,
                scale: float | Tensor | None = None) -> Tensor:
        return functional.l1_loss(input, target, reduction=self.reduction, weight=weight, scale=scale)


class SmoothL1Loss(torch.nn.SmoothL1Loss):
    """``torch.nn.SmoothL1Loss`` computed by :func:`fusedloss.smooth_l1_loss`."""

    def forward(self, input: Tensor, target: Tensor, weight: Tensor | None = None, *,
                scale: float | Tensor | None = None) -> Tensor:
        return functional.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta, weight=weight,
                                         scale=scale)


class HuberLoss(torch.nn.HuberLoss):
    """``torch.nn.HuberLoss`` computed by :func:`fusedloss.huber_loss`."""

    def forward(self, input: Tensor, target: Tensor, weight: Tensor | None = None, *,
                scale: float | Tensor | None = None) -> Tensor:
        return functional.huber_loss(input, target, reduction=self.reduction, delta=self.delta, weight=weight,
                                     scale=scale)


class PseudoHuberLoss(torch.nn.modules.loss._Loss):
    """Computes :func:`fusedloss.pseudo_huber_loss`: ``2c(sqrt(d^2 + c^2) - c)`` per element.

    Args:
        c: the scale at which the loss turns from quadratic to linear (a float > 0).
        reduction: ``'none'``, ``'mean'`` or ``'sum'``.
    """

    __constants__ = ["reduction", "c"]

    def __init__(self, c: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        self.c = c

    def extra_repr(self) -> str:
        return f"c={self.c}"

    def forward(self, input: Tensor, target: Tensor, weight: Tensor | None = None, *,
                scale: float | Tensor | None = None) -> Tensor:
        return functional.pseudo_huber_loss(input, target, c=self.c, reduction=self.reduction, weight=weight,
                                            scale=scale)
