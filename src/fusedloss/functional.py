"""Drop-ins for ``torch.nn.functional``'s regression losses, and pseudo-Huber.

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

import torch.nn.functional as F
from torch import Tensor

from . import pseudo_huber, routing, weighted


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
    if weight is not None or scale is not None:
        return weighted.weighted_loss("mse", 0.0, input, target, size_average, reduce, reduction, weight, scale,
                              lambda i, t, r: mse_loss(i, t, reduction=r), weighted.TORCH_WEIGHTED.get("mse"))
    if not routing.kernels_apply(input, target):
        return F.mse_loss(input, target, size_average, reduce, reduction)
    return routing.fused_loss("mse", 0.0, input, target, size_average, reduce, reduction)


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
    if weight is not None or scale is not None:
        return weighted.weighted_loss("l1", 0.0, input, target, size_average, reduce, reduction, weight, scale,
                              lambda i, t, r: l1_loss(i, t, reduction=r), weighted.TORCH_WEIGHTED.get("l1"))
    if not routing.kernels_apply(input, target):
        return F.l1_loss(input, target, size_average, reduce, reduction)
    return routing.fused_loss("l1", 0.0, input, target, size_average, reduce, reduction)


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
    if not isinstance(beta, numbers.Real):  # PyTorch's conversion, or its error
        if weight is not None or scale is not None:
            beta = _as_float("smooth_l1_loss", "beta", beta)
        else:
            return F.smooth_l1_loss(input, target, size_average, reduce, reduction, beta=beta)
    if weight is not None or scale is not None:
        if not (beta >= 0):
            return F.smooth_l1_loss(input, target, reduction=reduction, beta=beta)  # PyTorch's error
        return weighted.weighted_loss("smooth_l1" if beta > 0 else "l1", float(beta), input, target, size_average, reduce,
                              reduction, weight, scale, lambda i, t, r: smooth_l1_loss(i, t, reduction=r, beta=beta))
    if not (beta >= 0) or not routing.kernels_apply(input, target):
        return F.smooth_l1_loss(input, target, size_average, reduce, reduction, beta=beta)
    return routing.fused_loss("smooth_l1", float(beta), input, target, size_average, reduce, reduction)


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
    if not isinstance(delta, numbers.Real):  # PyTorch's conversion, or its error
        if weight is not None or scale is not None:
            delta = _as_float("huber_loss", "delta", delta)
        else:
            return F.huber_loss(input, target, reduction=reduction, delta=delta)
    if weight is not None or scale is not None:
        if not (delta > 0):
            return F.huber_loss(input, target, reduction=reduction, delta=delta)  # PyTorch's error
        return weighted.weighted_loss("huber", float(delta), input, target, None, None, reduction, weight, scale,
                              lambda i, t, r: huber_loss(i, t, reduction=r, delta=delta),
                              weighted.TORCH_WEIGHTED.get("huber"))
    if not (delta > 0) or not routing.kernels_apply(input, target):
        return F.huber_loss(input, target, reduction=reduction, delta=delta)
    return routing.fused_loss("huber", float(delta), input, target, None, None, reduction)


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
    the GPU). The result has the operands'
    promoted dtype (float32 under CUDA autocast). ``weight`` and ``scale`` as in this
    module's docstring; a weighted mean divides by the weight's sum.
    """
    if reduction not in routing.MODES:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if isinstance(c, Tensor):
        c = pseudo_huber.nan_where_not_positive(c)
    elif not isinstance(c, numbers.Real) or isinstance(c, bool):
        raise TypeError(f"pseudo_huber_loss(): argument 'c' must be float or Tensor, not {type(c).__name__}")
    elif not c > 0:
        raise ValueError(f"fusedloss: pseudo_huber_loss needs c > 0, got {c}")
    fused_c = not isinstance(c, Tensor)
    if weight is not None or scale is not None:
        if fused_c:
            return weighted.weighted_loss("pseudo_huber", float(c), input, target, None, None, reduction, weight, scale,
                                  lambda i, t, r: pseudo_huber_loss(i, t, c, reduction=r))
        return weighted.weighted_loss("pseudo_huber", 0.0, input, target, None, None, reduction, weight, scale,
                              lambda i, t, r: pseudo_huber_loss(i, t, c, reduction=r), fusable=False)
    if not fused_c or not routing.kernels_apply(input, target):
        routing.warn_if_target_broadcasts(input, target, stacklevel=3)
        return pseudo_huber.pseudo_huber_formula(input, target, c, reduction)
    return routing.fused_loss("pseudo_huber", float(c), input, target, None, None, reduction)


def _as_float(function: str, name: str, value: object) -> float:
    """A number argument as PyTorch takes it (a float, or a one-element tensor), else its TypeError."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value)
    raise TypeError(f"{function}(): argument '{name}' must be float, not {type(value).__name__}")
