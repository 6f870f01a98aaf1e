"""Loss modules: one per row of the table of losses, and the Gaussian and Poisson NLL.

For a loss PyTorch has, the module subclasses ``torch.nn``'s class of the same name:
construction, attributes, ``state_dict`` and ``repr`` are the parent's. For
fusedloss's own losses it is a ``torch.nn.modules.loss._Loss`` that takes the loss's
number (such as ``c``) and ``reduction``. ``forward`` computes with fusedloss and also
takes ``weight``, ``scale``, ``dim`` and ``keepdim`` (see :mod:`fusedloss.functional`),
which change from batch to batch.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from . import functional, reductions
from .losses import LOSSES, Loss

__all__ = [row.module for row in LOSSES.values()] + ["GaussianNLLLoss", "PoissonNLLLoss"]


def _forward(self: torch.nn.Module, input: Tensor, target: Tensor, weight: Tensor | None = None, *,
             scale: float | Tensor | None = None, dim: reductions.Dims = None, keepdim: bool = False) -> Tensor:
    row = self._loss
    param = {} if row.param is None else {row.param: getattr(self, row.param)}
    return getattr(functional, row.function)(input, target, reduction=self.reduction, weight=weight, scale=scale,
                                             dim=dim, keepdim=keepdim, **param)


def _own_init(row: Loss):
    """``__init__(self, <param>=default, reduction='mean')``, with that signature."""
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if row.param is not None:
        annotation = inspect.signature(getattr(functional, row.function)).parameters[row.param].annotation
        parameters.append(inspect.Parameter(row.param, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                            default=row.param_default, annotation=annotation))
    parameters.append(inspect.Parameter("reduction", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="mean",
                                        annotation=str))
    signature = inspect.Signature(parameters, return_annotation=None)

    def __init__(self, *args, **kwargs) -> None:
        arguments = signature.bind(self, *args, **kwargs)
        arguments.apply_defaults()
        torch.nn.modules.loss._Loss.__init__(self, reduction=arguments.arguments["reduction"])
        if row.param is not None:
            setattr(self, row.param, arguments.arguments[row.param])

    __init__.__signature__ = signature
    return __init__


def _module(name: str, row: Loss) -> type[torch.nn.Module]:
    function = f":func:`fusedloss.{row.function}`"
    namespace = {"_loss": row, "forward": _forward, "__module__": __name__, "__qualname__": row.module}
    if row.pytorch:
        bases = (getattr(torch.nn, row.module),)
        namespace["__doc__"] = f"``torch.nn.{row.module}`` computed by {function}."
    else:
        bases = (torch.nn.modules.loss._Loss,)
        namespace["__doc__"] = f"Computes {function}" + (
            f"; ``{row.param}`` as that function takes it (a float)." if row.param else ".")
        namespace["__init__"] = _own_init(row)
        if row.param is not None:
            namespace["__constants__"] = ["reduction", row.param]
            namespace["extra_repr"] = lambda self: f"{row.param}={getattr(self, row.param)}"
    return type(row.module, bases, namespace)


globals().update({row.module: _module(name, row) for name, row in LOSSES.items()})


class GaussianNLLLoss(torch.nn.GaussianNLLLoss):
    """``torch.nn.GaussianNLLLoss`` computed by :func:`fusedloss.gaussian_nll_loss`."""

    def forward(self, input: Tensor, target: Tensor, var: Tensor | float, weight: Tensor | None = None, *,
                scale: float | Tensor | None = None, dim: reductions.Dims = None, keepdim: bool = False) -> Tensor:
        return functional.gaussian_nll_loss(input, target, var, full=self.full, eps=self.eps, reduction=self.reduction,
                                            weight=weight, scale=scale, dim=dim, keepdim=keepdim)


class PoissonNLLLoss(torch.nn.PoissonNLLLoss):
    """``torch.nn.PoissonNLLLoss`` computed by :func:`fusedloss.poisson_nll_loss`."""

    def forward(self, log_input: Tensor, target: Tensor, weight: Tensor | None = None, *,
                scale: float | Tensor | None = None, dim: reductions.Dims = None, keepdim: bool = False) -> Tensor:
        return functional.poisson_nll_loss(log_input, target, log_input=self.log_input, full=self.full, eps=self.eps,
                                           reduction=self.reduction, weight=weight, scale=scale, dim=dim,
                                           keepdim=keepdim)
