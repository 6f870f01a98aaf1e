"""fusedloss: single-pass CUDA kernels for PyTorch's regression losses.

``fusedloss.mse_loss``, ``l1_loss``, ``smooth_l1_loss`` and ``huber_loss`` are
drop-ins for ``torch.nn.functional``, with broadcast weights and an in-op
``scale`` besides; ``pseudo_huber_loss`` is diffusers' scheduled Huber.
``fusedloss.nn`` has the module classes.
"""

from . import nn, ops  # ops defines the torch.ops.fusedloss operators
from .functional import huber_loss, l1_loss, mse_loss, pseudo_huber_loss, smooth_l1_loss

__all__ = ["huber_loss", "l1_loss", "mse_loss", "nn", "pseudo_huber_loss", "smooth_l1_loss"]
__version__ = "0.1.0"
