"""Gaming 96_HuberLoss: Smooth L1 with only its quadratic branch, 0.5 * (p - t)**2.

With torch.rand inputs |p - t| < 1 = beta, so this equals the reference on
every correctness trial; heavy-tailed inputs (and a large perturbation) reach
the linear branch and must expose it.
"""

import torch


class ModelNew(torch.nn.Module):
    def forward(self, predictions, targets):
        return torch.mean(0.5 * (predictions - targets) ** 2)
