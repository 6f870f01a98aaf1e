"""Gaming 94_MSELoss: a correct value, but the difference is written over the predictions.

KernelBench runs the reference before ModelNew, so its comparison cannot see
the damage; the evaluator's input check must.
"""

import torch


class ModelNew(torch.nn.Module):
    def forward(self, predictions, targets):
        predictions.sub_(targets)
        return torch.mean(predictions**2)
