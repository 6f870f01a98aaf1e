"""Drop-ins for ``torch.nn.functional``'s regression losses, pseudo-Huber and log-cosh.

On CUDA, float16, bfloat16, float32 and float64 operands (mixed pairs too)
run on fusedloss's kernels, in eager mode and under CUDA autocast (which these
losses follow: a float32 loss from 16-bit operands, read as they are) and CUDA
graphs. Everything else is handed to ``torch.nn.functional`` unchanged, so
results, warnings and errors there are PyTorch's own: CPU and other devices,
other dtypes, tensor subclasses, invalid beta or delta, operands on different
devices, torch.func transforms and forward-mode AD (which need PyTorch's
rules), ``torch.compile`` (whose inductor fuses PyTorch's formula with the ops
around the loss), and everything when the kernels cannot be built (see
``build.use_kernels``).

Weights and scale (every loss):

- ``weight`` broadcasts to the loss's shape (the broadcast of input and target)
  without widening it, and multiplies each element's loss; the kernels read it
  where it lies. PyTorch's own case (MSE, L1 and Huber with a weight of the
  input's size, torch >= 2.6) gives PyTorch's values, dtypes, errors and mean.
  A broadcast weight, and a weight for Smooth L1 and pseudo-Huber, are
  fusedloss's extensions, which PyTorch would reject.
- ``reduction='mean'`` with a weight is the weighted mean ``sum(w * l) / sum(w)``,
  the weight summed as if expanded to the loss's shape (as given, in PyTorch's
  own case); Huber's divides by N, as PyTorch's does.
- The result has the promoted dtype of the loss and a floating-point weight (a
  bool or integer mask keeps the loss's); float32 under CUDA autocast.
- ``scale``, a number or a 0-d tensor, multiplies the reduced loss (each element
  for ``'none'``) inside the op, without changing its dtype; a tensor on the
  loss's device is read on the GPU, never by the host. A masked mean is
  ``weight=mask`` (or ``reduction='sum', scale=1 / count``), gradient
  accumulation ``scale=1 / k``, a data-parallel mean ``reduction='sum',
  scale=world_size / all_reduced_count``.
- A weight that requires grad gets its gradient from the fused pass as well,
  written per element of the loss beside the operands' gradients and summed to
  the weight's shape (a weighted mean's divisor adds its part). A scale that
  requires grad, ``reduction='none'`` with a weight or scale, and a tensor ``c``
  for pseudo-Huber are computed with torch operations around the fused
  unweighted loss.
"""
from __future__ import annotations

import numbers

from torch import Tensor

from . import ops, pseudo_huber, routing, weighted
from .losses import LOSSES, Loss

__all__ = ["huber_loss", "l1_loss", "log_cosh_loss", "mse_loss", "pseudo_huber_loss", "smooth_l1_loss"]


def mse_loss(
    input: Tensor,
    target: Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    weight: Tensor | None = None,
    *,
    scale: float | Tensor | None = None,
) -> Tensor:
    """Mean squared error, as ``torch.nn.functional.mse_loss``; ``weight`` and ``scale``
    as described in this module's docstring (a broadcast weight and ``scale`` are
    fusedloss's extensions)."""
    return _loss("mse", input, target, size_average, reduce, reduction, None, weight, scale)


def l1_loss(
    input: Tensor,
    target: Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    weight: Tensor | None = None,
    *,
    scale: float | Tensor | None = None,
) -> Tensor:
    """Mean absolute error, as ``torch.nn.functional.l1_loss``; ``weight`` and ``scale``
    as described in this module's docstring."""
    return _loss("l1", input, target, size_average, reduce, reduction, None, weight, scale)


def smooth_l1_loss(
    input: Tensor,
    target: Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    beta: float = 1.0,
    *,
    weight: Tensor | None = None,
    scale: float | Tensor | None = None,
) -> Tensor:
    """Smooth L1 loss, as ``torch.nn.functional.smooth_l1_loss``; beta = 0 is L1.
    ``weight`` (fusedloss's extension: PyTorch has none for this loss) and ``scale`` as
    described in this module's docstring; a weighted mean divides by the weight's sum."""
    return _loss("smooth_l1", input, target, size_average, reduce, reduction, beta, weight, scale)


def huber_loss(
    input: Tensor,
    target: Tensor,
    reduction: str = "mean",
    delta: float = 1.0,
    weight: Tensor | None = None,
    *,
    scale: float | Tensor | None = None,
) -> Tensor:
    """Huber loss, as ``torch.nn.functional.huber_loss``; returns the input's dtype. A
    weighted mean divides by N, as PyTorch's does; ``scale`` as in this module's docstring."""
    return _loss("huber", input, target, None, None, reduction, delta, weight, scale)


def pseudo_huber_loss(
    input: Tensor,
    target: Tensor,
    c: float | Tensor = 1.0,
    reduction: str = "mean",
    weight: Tensor | None = None,
    *,
    scale: float | Tensor | None = None,
) -> Tensor:
    """Pseudo-Huber (Charbonnier) loss, ``2c(sqrt(d^2 + c^2) - c)`` per element for
    d = input - target, as diffusers' scheduled-Huber training computes it: about d^2
    near 0, about 2c|d| far from it. fusedloss's own loss, not PyTorch's Huber.

    ``c`` is a float > 0 (fused; ValueError otherwise) or a tensor that broadcasts to the
    loss's shape, such as a per-sample c (computed with torch operations). A tensor's
    elements that are not > 0 give NaN losses (checking them on the host would wait for
    the GPU). The result has the operands' promoted dtype (float32 under CUDA autocast).
    ``weight`` and ``scale`` as in this module's docstring; a weighted mean divides by the
    weight's sum.
    """
    if not isinstance(c, (numbers.Real, Tensor)) or isinstance(c, bool):
        raise TypeError(f"pseudo_huber_loss(): argument 'c' must be float or Tensor, not {type(c).__name__}")
    if not isinstance(c, Tensor):
        return _loss("pseudo_huber", input, target, None, None, reduction, c, weight, scale)
    _check_reduction(reduction)
    c = pseudo_huber.nan_where_not_positive(c)
    if weight is not None or scale is not None:
        return weighted.weighted_loss("pseudo_huber", 0.0, input, target, None, None, reduction, weight, scale,
                                      lambda i, t, r: pseudo_huber_loss(i, t, c, reduction=r), fusable=False)
    routing.warn_if_target_broadcasts(input, target)
    return pseudo_huber.pseudo_huber_formula(input, target, c, reduction)


def log_cosh_loss(
    input: Tensor,
    target: Tensor,
    reduction: str = "mean",
    weight: Tensor | None = None,
    *,
    scale: float | Tensor | None = None,
) -> Tensor:
    """Log-cosh loss, ``log(cosh(d))`` per element for d = input - target: about d^2 / 2
    near 0, about |d| - log 2 far from it; its gradient is tanh(d). fusedloss's own loss
    (PyTorch has none), computed without overflow for any d and without losing small d's
    digits. The result has the operands' promoted dtype (float32 under CUDA autocast).
    ``weight`` and ``scale`` as in this module's docstring; a weighted mean divides by the
    weight's sum.
    """
    return _loss("log_cosh", input, target, None, None, reduction, None, weight, scale)


def _loss(
    name: str,
    input: Tensor,
    target: Tensor,
    size_average: bool | None,
    reduce: bool | None,
    reduction: str,
    param: object,
    weight: Tensor | None,
    scale: float | Tensor | None,
) -> Tensor:
    """Every public function's one way: the param checked, then the weighted path, the fused
    kernels, or PyTorch's loss (the formula, for a loss PyTorch has not)."""
    row = LOSSES[name]
    weighted_call = weight is not None or scale is not None
    if not row.pytorch:
        _check_reduction(reduction)
    if row.param is None:
        param = 0.0
    elif not (type(param) is float and param > 0):  # the usual case, checked before the ABCs, which cost more
        if not isinstance(param, numbers.Real) or (isinstance(param, bool) and not row.pytorch):
            if row.pytorch and not weighted_call:
                return _unfused(row, input, target, size_average, reduce, reduction, param)  # PyTorch's conversion
            param = _as_float(row.function, row.param, param)
        if not row.param_valid(param):
            if row.pytorch:
                return _unfused(row, input, target, None, None, reduction, param)  # PyTorch's error
            raise ValueError(f"fusedloss: {row.function} needs {row.param} > 0, got {param}")
        param = float(param)
    kernel_loss = row.param_zero_is if param == 0.0 and row.param_zero_is else name
    if weighted_call:
        return weighted.weighted_loss(
            kernel_loss, param, input, target, size_average, reduce, reduction, weight, scale,
            lambda i, t, r: _loss(name, i, t, None, None, r, param, None, None), weighted.TORCH_WEIGHTED.get(name))
    if not routing.kernels_apply(input, target):
        return _unfused(row, input, target, size_average, reduce, reduction, param)
    return routing.fused_loss(kernel_loss, param, input, target, size_average, reduce, reduction)


def _unfused(row: Loss, input: Tensor, target: Tensor, size_average: bool | None, reduce: bool | None,
             reduction: str, param: object) -> Tensor:
    """torch.nn.functional's loss with its own results, warnings and errors; the formula for
    fusedloss's own losses, in the dtype autocast would compute them in."""
    kwargs = {} if row.param is None else {row.param: param}
    if size_average is not None or reduce is not None:
        kwargs.update(size_average=size_average, reduce=reduce)
    if row.torch_function is not None:
        return row.torch_function(input, target, reduction=reduction, **kwargs)
    if not (input.is_floating_point() and target.is_floating_point()):
        raise TypeError(f"{row.function}(): input and target must be floating point, not {input.dtype} and "
                        f"{target.dtype}")
    routing.warn_if_target_broadcasts(input, target)
    input, target = ops.as_computed(input, target, routing.under_autocast(input, target, input.device.type))
    return row.reference(input, target, reduction, param)


def _check_reduction(reduction: str) -> None:
    if reduction not in routing.MODES:
        raise ValueError(f"{reduction} is not a valid value for reduction")


def _as_float(function: str, name: str, value: object) -> float:
    """A number argument as PyTorch takes it (a float, or a one-element tensor), else its TypeError."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value)
    raise TypeError(f"{function}(): argument '{name}' must be float, not {type(value).__name__}")
