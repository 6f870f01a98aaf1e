"""fusedloss: single-pass CUDA kernels for PyTorch's regression losses.

A function per row of the table of losses (``fusedloss.losses.LOSSES``): drop-ins for
``torch.nn.functional``'s losses (``mse_loss``, ``l1_loss``, ``smooth_l1_loss``,
``huber_loss``) and fusedloss's own, all with broadcast weights and an in-op ``scale``.
``fusedloss.nn`` has a module per loss.
"""

from . import functional, nn, ops  # ops defines the torch.ops.fusedloss operators
from .functional import *  # noqa: F403  (the public function of each row of the table of losses)

__all__ = [*functional.__all__, "nn"]
__version__ = "0.1.0"
