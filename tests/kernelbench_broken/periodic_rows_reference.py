"""A 94_MSELoss reference whose rows repeat with period 8: any 64 leading rows have the full mean.

It lets a CPU-sized test show that first_rows_mse.py passes every ordinary
correctness trial and is caught by the perturbation check alone.
"""

import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, predictions, targets):
        return torch.mean((predictions - targets) ** 2)


batch_size = 256
input_shape = (512,)
period = 8


def get_inputs():
    scale = torch.rand(())
    predictions = torch.rand(period, *input_shape) * scale
    targets = torch.rand(period, *input_shape)
    repeats = (batch_size // period,) + (1,) * len(input_shape)
    return [predictions.repeat(repeats), targets.repeat(repeats)]


def get_init_inputs():
    return []
