"""Loss modules: subclasses of the ``torch.nn`` classes that compute with fusedloss.

Construction, attributes, ``state_dict`` and ``repr`` are the parent's; only
``forward`` changes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import functional


class MSELoss(torch.nn.MSELoss):
    """``torch.nn.MSELoss`` computed by :func:`fusedloss.mse_loss`."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return functional.mse_loss(input, target, reduction=self.reduction)


class L1Loss(torch.nn.L1Loss):
    """``torch.nn.L1Loss`` computed by :func:`fusedloss.l1_loss`."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return functional.l1_loss(input, target, reduction=self.reduction)


class SmoothL1Loss(torch.nn.SmoothL1Loss):
    """``torch.nn.SmoothL1Loss`` computed by :func:`fusedloss.smooth_l1_loss`."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return functional.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)


class HuberLoss(torch.nn.HuberLoss):
    """``torch.nn.HuberLoss`` computed by :func:`fusedloss.huber_loss`."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return functional.huber_loss(input, target, reduction=self.reduction, delta=self.delta)
