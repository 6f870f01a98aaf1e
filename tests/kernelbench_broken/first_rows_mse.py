"""Gaming 94_MSELoss: reads only the first 64 rows and reports their mean as everyone's.

On i.i.d. inputs of KernelBench's size a subsample's mean can land within the
tolerance; the evaluator's single-element perturbation must catch it.
"""

import torch


class ModelNew(torch.nn.Module):
    def forward(self, predictions, targets):
        return torch.mean((predictions[:64] - targets[:64]) ** 2)
