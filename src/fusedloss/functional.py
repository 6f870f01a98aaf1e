"""Drop-ins for ``torch.nn.functional``'s regression losses, and pseudo-Huber, log-cosh
and quantile losses.

On CUDA, float16, bfloat16, float32 and float64 operands (mixed pairs too)
run on fusedloss's kernels, in eager mode and under CUDA autocast (which these
losses follow: a float32 loss from 16-bit operands, read as they are) and CUDA
graphs. Everything else is handed to ``torch.nn.functional`` unchanged, so
results, warnings and errors there are PyTorch's own: CPU and other devices,
other dtypes, tensor subclasses, invalid beta or delta, operands on different
devices, torch.func transforms and forward-mode AD (which need PyTorch's
rules), ``torch.compile`` (whose inductor fuses PyTorch's formula with the ops
around the loss), and everything when the kernels cannot be built (see
``build.use_kernels``). A small step (wanting gradients) of a loss PyTorch has an
operator for (MSE, L1, Smooth L1, Huber) is bound by host time: without the C++
autograd it is PyTorch's own, and so is a small weighted one, PyTorch's loss with
torch operations for the weight and scale (``routing.pytorch_serves_the_step``).

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
  requires grad, and ``reduction='none'`` with a weight or scale, are computed
  with torch operations around the fused unweighted loss.
- A tensor param (pseudo-Huber's ``c``, several quantiles) is read where it lies
  by the weighted kernels, one per element, for a mean or sum without a weight
  when it takes no gradient; otherwise torch operations compute the loss.

Per-sample losses (every loss): ``dim`` (an int or a sequence of them) reduces
over those dimensions only, as ``torch.mean`` and ``torch.sum`` do, and
``keepdim`` keeps them with size 1; ``reduction`` must be ``'mean'`` or
``'sum'``. ``mse_loss(p, t, dim=(1, 2, 3))`` is the per-sample MSE of a batch of
images. With a weight, the mean over ``dim`` divides by the weight summed over
``dim`` as if expanded (Huber's by the count); ``scale`` multiplies the result.
Over the trailing dimensions of operands of one shape (``dim=(1, 2, 3)`` of a batch)
without a weight, the loss and its reduction are one fused pass, and backward another;
otherwise the loss per element is fused and the reduction over ``dim`` is torch's.
"""
from __future__ import annotations

import functools
import numbers
import sys
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import _reduction

from . import likelihood, ops, pseudo_huber, reductions, routing, weighted
from .losses import LOSSES, Loss
from .reductions import Dims

__all__ = ["gaussian_nll_loss", "huber_loss", "l1_loss", "log_cosh_loss", "mse_loss", "poisson_nll_loss",
           "pseudo_huber_loss", "quantile_loss", "smooth_l1_loss"]


def mse_loss(
    input: Tensor,
    target: Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    weight: Tensor | None = None,
    *,
    scale: float | Tensor | None = None,
    dim: Dims = None,
    keepdim: bool = False,
) -> Tensor:
    """Mean squared error, as ``torch.nn.functional.mse_loss``; ``weight`` and ``scale``
    as described in this module's docstring (a broadcast weight and ``scale`` are
    fusedloss's extensions)."""
    return _loss("mse", input, target, size_average, reduce, reduction, None, weight, scale, dim, keepdim)


def l1_loss(
    input: Tensor,
    target: Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    weight: Tensor | None = None,
    *,
    scale: float | Tensor | None = None,
    dim: Dims = None,
    keepdim: bool = False,
) -> Tensor:
    """Mean absolute error, as ``torch.nn.functional.l1_loss``; ``weight`` and ``scale``
    as described in this module's docstring."""
    return _loss("l1", input, target, size_average, reduce, reduction, None, weight, scale, dim, keepdim)


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
    dim: Dims = None,
    keepdim: bool = False,
) -> Tensor:
    """Smooth L1 loss, as ``torch.nn.functional.smooth_l1_loss``; beta = 0 is L1.
    ``weight`` (fusedloss's extension: PyTorch has none for this loss) and ``scale`` as
    described in this module's docstring; a weighted mean divides by the weight's sum."""
    return _loss("smooth_l1", input, target, size_average, reduce, reduction, beta, weight, scale, dim, keepdim)


def huber_loss(
    input: Tensor,
    target: Tensor,
    reduction: str = "mean",
    delta: float = 1.0,
    weight: Tensor | None = None,
    *,
    scale: float | Tensor | None = None,
    dim: Dims = None,
    keepdim: bool = False,
) -> Tensor:
    """Huber loss, as ``torch.nn.functional.huber_loss``; returns the input's dtype. A
    weighted mean divides by N, as PyTorch's does; ``scale`` as in this module's docstring."""
    return _loss("huber", input, target, None, None, reduction, delta, weight, scale, dim, keepdim)


def pseudo_huber_loss(
    input: Tensor,
    target: Tensor,
    c: float | Tensor = 1.0,
    reduction: str = "mean",
    weight: Tensor | None = None,
    *,
    scale: float | Tensor | None = None,
    dim: Dims = None,
    keepdim: bool = False,
) -> Tensor:
    """Pseudo-Huber (Charbonnier) loss, ``2c(sqrt(d^2 + c^2) - c)`` per element for
    d = input - target, as diffusers' scheduled-Huber training computes it: about d^2
    near 0, about 2c|d| far from it. fusedloss's own loss, not PyTorch's Huber.

    ``c`` is a float > 0 (fused; ValueError otherwise) or a tensor that broadcasts to the
    loss's shape, such as a per-sample c (a mean or sum fused, c read where it lies, when
    c takes no gradient and no weight is given; torch operations otherwise). A tensor's
    elements that are not > 0 give NaN losses (checking them on the host would wait for
    the GPU). The result has the operands' promoted dtype (float32 under CUDA autocast).
    ``weight`` and ``scale`` as in this module's docstring; a weighted mean divides by the
    weight's sum.
    """
    if not isinstance(c, (numbers.Real, Tensor)) or isinstance(c, bool):
        raise TypeError(f"pseudo_huber_loss(): argument 'c' must be float or Tensor, not {type(c).__name__}")
    return _loss("pseudo_huber", input, target, None, None, reduction, c, weight, scale, dim, keepdim)


def log_cosh_loss(
    input: Tensor,
    target: Tensor,
    reduction: str = "mean",
    weight: Tensor | None = None,
    *,
    scale: float | Tensor | None = None,
    dim: Dims = None,
    keepdim: bool = False,
) -> Tensor:
    """Log-cosh loss, ``log(cosh(d))`` per element for d = input - target: about d^2 / 2
    near 0, about |d| - log 2 far from it; its gradient is tanh(d). fusedloss's own loss
    (PyTorch has none), computed without overflow for any d and without losing small d's
    digits. The result has the operands' promoted dtype (float32 under CUDA autocast).
    ``weight`` and ``scale`` as in this module's docstring; a weighted mean divides by the
    weight's sum.
    """
    return _loss("log_cosh", input, target, None, None, reduction, None, weight, scale, dim, keepdim)


def quantile_loss(
    input: Tensor,
    target: Tensor,
    quantiles: float | Sequence[float] | Tensor = 0.5,
    reduction: str = "mean",
    weight: Tensor | None = None,
    *,
    scale: float | Tensor | None = None,
    dim: Dims = None,
    keepdim: bool = False,
) -> Tensor:
    """Quantile (pinball) loss, ``max(q (t - p), (q - 1) (t - p))`` per element for
    prediction p = input and target t: the training loss of quantile regression and
    probabilistic forecasting. fusedloss's own loss (PyTorch has none).

    ``quantiles`` is one q in [0, 1], or a sequence or tensor of them that broadcasts
    along ``input``'s last dimension: an input of shape (..., Q) with Q quantiles, and a
    target of shape (..., 1) (``target[..., None]``), which broadcasts to it. A mean or sum
    is fused (a tensor read where it lies) unless the quantiles take a gradient or a weight
    is given; those, and ``'none'``, compute with torch operations. A sequence's values
    outside [0, 1] raise a ValueError; a tensor's give NaN losses (checking them on the
    host would wait for the GPU). The gradient is autograd's of
    ``torch.maximum`` in that formula: at p == t the mean of the two slopes, 1/2 - q. The
    mean is over every element, quantiles included. The result has the operands' promoted
    dtype (float32 under CUDA autocast). ``weight``, ``scale`` and ``dim`` as in this
    module's docstring; a weighted mean divides by the weight's sum.
    """
    q = _as_quantiles(quantiles, input, target)
    return _loss("quantile", input, target, None, None, reduction, q, weight, scale, dim, keepdim)


def gaussian_nll_loss(
    input: Tensor,
    target: Tensor,
    var: Tensor | float,
    full: bool = False,
    eps: float = 1e-6,
    reduction: str = "mean",
    *,
    weight: Tensor | None = None,
    scale: float | Tensor | None = None,
    dim: Dims = None,
    keepdim: bool = False,
) -> Tensor:
    """Gaussian negative log-likelihood, as ``torch.nn.functional.gaussian_nll_loss``: its
    values, dtypes, ``var`` shapes (the input's, one dimension fewer, or 1 in one
    dimension) and gradients, the clamp at ``eps`` passing var's gradient through.

    A ``var`` tensor on a GPU is not checked on the host: where it is negative, the loss
    (and a mean or sum over it) is NaN, and nothing waits for the GPU, where PyTorch's
    ``torch.any(var < 0)`` does. On the CPU, and for a float ``var``, PyTorch raises its
    ValueError. ``weight``, ``scale`` and ``dim`` (fusedloss's extensions) as in this
    module's docstring. On a GPU, in eager mode, with float32, float64 or bfloat16 operands
    (float16 under autocast): the loss of operands of one dtype and shape, times a number
    ``scale`` where one is given, is one fused pass (that also writes the gradients for a
    mean or sum; ``reduction='none'`` has a backward pass of its own); otherwise torch
    operations in an autograd function with its derivatives written out.
    Values and gradients are PyTorch's up to rounding.
    """
    return likelihood.gaussian_nll(input, target, var, full, eps, reduction, weight, scale, dim, keepdim)


def poisson_nll_loss(
    input: Tensor,
    target: Tensor,
    log_input: bool = True,
    full: bool = False,
    size_average: bool | None = None,
    eps: float = 1e-8,
    reduce: bool | None = None,
    reduction: str = "mean",
    *,
    weight: Tensor | None = None,
    scale: float | Tensor | None = None,
    dim: Dims = None,
    keepdim: bool = False,
) -> Tensor:
    """Poisson negative log-likelihood, as ``torch.nn.functional.poisson_nll_loss``:
    ``exp(input) - target * input`` (``log_input``) or ``input - target * log(input + eps)``,
    plus Stirling's approximation of ``log(target!)`` where ``target > 1`` if ``full``.
    ``weight``, ``scale`` and ``dim`` (fusedloss's extensions) as in this module's
    docstring. On a GPU, in eager mode, with float32, float64 or bfloat16 operands (float16
    under autocast): the loss of operands of one dtype and shape, times a number ``scale``
    where one is given, ``full`` included, is one fused pass (that also writes the gradients
    for a mean or sum; ``reduction='none'`` has a backward pass of its own); otherwise,
    without ``full``, from 128 MiB of operands
    (``likelihood.POISSON_WRITTEN_OUT_FROM_BYTES``), torch operations in an autograd
    function with its derivatives written out. Values and gradients are PyTorch's up to
    rounding. Everywhere else, PyTorch's own loss.
    """
    return likelihood.poisson_nll(input, target, log_input, full, size_average, eps, reduce, reduction, weight,
                                  scale, dim, keepdim)


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
    dim: Dims = None,
    keepdim: bool = False,
) -> Tensor:
    """Every public function's one way: the param checked, then the reduction over ``dim``,
    a tensor param's formula, the weighted path, the fused kernels, or PyTorch's loss (the
    formula, for a loss PyTorch has not)."""
    row = LOSSES[name]
    if (row.pytorch_serves_steps and weight is None and scale is None and dim is None and size_average is None
            and reduce is None and (row.param is None or (type(param) is float and 0 < param <= row.param_max))
            and routing.pytorch_serves_the_call(row, input, target, reduction)):
        return routing.pytorch_loss(row, input, target, reduction, param)
    weighted_call = weight is not None or scale is not None
    if not row.pytorch:
        _check_reduction(reduction)
    if row.param is None:
        param = 0.0
    elif isinstance(param, Tensor) and row.takes_param_tensor:
        pass  # its elements' domain is checked where they are read (_with_tensor_param)
    elif not (type(param) is float and 0 < param <= row.param_max):  # the usual case, before the costlier ABCs
        if not isinstance(param, numbers.Real) or (isinstance(param, bool) and not row.pytorch):
            if row.pytorch and not weighted_call:
                return _unfused(row, input, target, size_average, reduce, reduction, param)  # PyTorch's conversion
            param = _as_float(row.function, row.param, param)
        if not row.param_valid(param):
            if row.pytorch:
                return _unfused(row, input, target, None, None, reduction, param)  # PyTorch's error
            domain = f"in [0, {row.param_max:g}]" if row.param_zero_valid else "> 0"
            raise ValueError(f"fusedloss: {row.function} needs {row.param} {domain}, got {param}")
        param = float(param)
    # the kernels' name for the loss: a number of 0 may make it another (Smooth L1's L1)
    kernel_loss = row.param_zero_is if not isinstance(param, Tensor) and param == 0.0 and row.param_zero_is else name
    if dim is not None:
        return _reduced_over(row, name, kernel_loss, input, target, size_average, reduce, reduction, param, weight,
                             scale, dim, keepdim)
    if isinstance(param, Tensor):
        return _with_tensor_param(row, name, input, target, reduction, param, weight, scale)
    if _holds_a_dtensor(input, target):
        return _sharded(row, name, kernel_loss, input, target, size_average, reduce, reduction, param, weight, scale)
    if weighted_call:
        return weighted.weighted_loss(
            kernel_loss, param, input, target, size_average, reduce, reduction, weight, scale,
            lambda i, t, r: _loss(name, i, t, None, None, r, param, None, None), weighted.TORCH_WEIGHTED.get(name))
    if not routing.kernels_apply(input, target):
        return _unfused(row, input, target, size_average, reduce, reduction, param)
    return routing.fused_loss(kernel_loss, param, input, target, size_average, reduce, reduction)


def _holds_a_dtensor(input: Tensor, target: Tensor) -> bool:
    """Whether an operand is a DTensor (none can be before torch.distributed.tensor is imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and (isinstance(input, dtensor) or isinstance(target, dtensor))


def _sharded(row: Loss, name: str, kernel_loss: str, input: Tensor, target: Tensor, size_average: bool | None,
             reduce: bool | None, reduction: str, param: float, weight: Tensor | None,
             scale: float | Tensor | None) -> Tensor:
    """DTensor operands: each rank's fused kernels on its shards where ``sharding`` takes
    them, else PyTorch's operations, which DTensor shards itself."""
    from . import sharding  # imported with the first DTensor: it registers the operators' rules

    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    # before sharding.applies, which loads the weighted kernels a sharded sum would run on
    if weight is None and scale is None and sharding.dtensor_serves_the_step(row, input, target, reduction):
        return _unfused(row, input, target, None, None, reduction, param)
    if sharding.applies(input, target, weight, scale, reduction):
        out = sharding.on_local_shards(kernel_loss, param, input, target, weight, scale, reduction,
                                       lambda i, t, r, w, s: _loss(name, i, t, None, None, r, param, w, s))
        if out is not None:
            return out
        return sharding.sharded_loss(kernel_loss, param, input, target, reduction, weight, scale)
    weight, scale = reductions.beside(weight, input), reductions.beside(scale, input)
    if weight is not None or scale is not None:
        return weighted.weighted_loss(kernel_loss, param, input, target, None, None, reduction, weight, scale,
                                      lambda i, t, r: _dtensor_unfused(row, i, t, r, param),
                                      weighted.TORCH_WEIGHTED.get(name), fusable=False)
    return _dtensor_unfused(row, input, target, reduction, param)


def _dtensor_unfused(row: Loss, input: Tensor, target: Tensor, reduction: str, param: object) -> Tensor:
    """torch.nn.functional's loss of DTensor operands, a mean taken of the loss per element:
    DTensor's rules for PyTorch's loss operators average the ranks' own means, which over
    uneven shards is not the mean (DTensor's mean of a tensor is)."""
    if reduction == "mean":
        return _unfused(row, input, target, None, None, "none", param).mean()
    return _unfused(row, input, target, None, None, reduction, param)


def _with_tensor_param(row: Loss, name: str, input: Tensor, target: Tensor, reduction: str, param: Tensor,
                       weight: Tensor | None, scale: float | Tensor | None) -> Tensor:
    """A loss whose param is a tensor (pseudo-Huber's c, quantiles): a mean or sum in one fused
    pass where the kernels apply (``weighted.fused_param_tensor_loss``), else torch operations."""
    if weight is None and not _holds_a_dtensor(input, target) and (
            out := weighted.fused_param_tensor_loss(name, input, target, param, reduction, scale)) is not None:
        return out  # the kernels make an element outside the param's domain NaN
    return _tensor_param_formula(row, name, input, target, reduction, row.nan_outside_domain(param), weight, scale)


def _tensor_param_formula(row: Loss, name: str, input: Tensor, target: Tensor, reduction: str, param: Tensor,
                          weight: Tensor | None, scale: float | Tensor | None) -> Tensor:
    """A loss whose param is a tensor, with torch operations."""
    if weight is not None or scale is not None:
        return weighted.weighted_loss(name, 0.0, input, target, None, None, reduction, weight, scale,
                                      lambda i, t, r: _tensor_param_formula(row, name, i, t, r, param, None, None),
                                      fusable=False)
    routing.warn_if_target_broadcasts(input, target, row)
    param = reductions.beside(param, input)  # a DTensor's quantiles or c: replicated beside it
    if name == "pseudo_huber":  # its derivatives written out, in fewer passes than autograd's
        return pseudo_huber.pseudo_huber_formula(input, target, param, reduction)
    input, target = ops.as_computed(input, target, routing.under_autocast(input, target, input.device.type))
    return row.reference(input, target, reduction, param)


def _reduced_over(row: Loss, name: str, kernel_loss: str, input: Tensor, target: Tensor, size_average: bool | None,
                  reduce: bool | None, reduction: str, param: float | Tensor, weight: Tensor | None,
                  scale: float | Tensor | None, dim: Dims, keepdim: bool) -> Tensor:
    """The loss reduced over ``dim`` only: in one pass where the kernels apply and ``dim``
    names the trailing dimensions (a per-sample loss), then the scale; else the loss per
    element (fused where the kernels apply), then the weight, the reduction and the scale
    with torch operations."""
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    if (weight is None and isinstance(param, float) and reduction in ("mean", "sum")
            and routing.kernels_apply(input, target)):
        dims = reductions.as_dims(dim, input.dim())
        kept = routing.per_sample_kept_dims(input, target, dims)
        if kept is not None:
            out = routing.fused_per_sample_loss(kernel_loss, param, input, target, reduction, kept)
            if keepdim:
                out = out.reshape(out.shape + (1,) * len(dims))
            return reductions.reduce(out, "none", None, scale)
    per_element = _loss(name, input, target, None, None, "none", param, None, None)
    return reductions.reduce(per_element, reduction, weight, scale, dim, keepdim, row.weighted_mean_over_count)


def _as_quantiles(quantiles: object, input: Tensor, target: Tensor) -> float | Tensor:
    """One quantile as a float (the kernels take it as a number); several as a tensor on
    the operands' device that broadcasts to the loss's shape. A sequence, or a CPU tensor
    for operands elsewhere, is checked on the host and kept on the device, so a step
    copies nothing."""
    if isinstance(quantiles, (bool, str, bytes)) or not isinstance(quantiles, (numbers.Real, Tensor, Sequence)):
        raise TypeError(f"quantile_loss(): quantiles must be a float, a sequence of floats or a tensor, not "
                        f"{type(quantiles).__name__}")
    if isinstance(quantiles, numbers.Real):
        return quantiles
    if isinstance(quantiles, Tensor):
        if quantiles.device == input.device or quantiles.requires_grad or input.device.type == "cpu":
            shape = reductions.loss_shape(input, target)
            if quantiles.dim() > len(shape) or any(q not in (1, s) for q, s in
                                                    zip(reversed(quantiles.shape), reversed(shape))):
                raise ValueError(f"quantile_loss(): quantiles of shape {tuple(quantiles.shape)} do not broadcast "
                                 f"to the loss's shape {tuple(shape)}")
            return quantiles
        quantiles = quantiles.tolist() if quantiles.dim() else [quantiles.item()]
    values = tuple(map(float, quantiles))
    if len(values) == 1:
        return _checked_quantiles(values)[0]
    last = reductions.loss_shape(input, target)[-1:] or (1,)
    if len(values) != last[0]:
        _checked_quantiles(values)  # an empty or invalid sequence's error first
        raise ValueError(f"quantile_loss(): {len(values)} quantiles for a loss whose last dimension is {last[0]}")
    dtype = torch.float64 if torch.float64 in (input.dtype, target.dtype) else torch.float32
    return _quantile_tensor(values, input.device, dtype)


@functools.lru_cache(maxsize=64)
def _checked_quantiles(values: tuple[float, ...]) -> tuple[float, ...]:
    """The quantiles, once checked: a step passes the same sequence again and again."""
    if not values:
        raise ValueError("quantile_loss(): quantiles is empty")
    if not all(LOSSES["quantile"].param_valid(q) for q in values):
        raise ValueError(f"fusedloss: quantile_loss needs quantiles in [0, 1], got {list(values)}")
    return values


@functools.lru_cache(maxsize=64)
def _quantile_tensor(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> Tensor:
    # on the host whatever torch.set_default_device says: only host memory is pinned
    host = torch.tensor(_checked_quantiles(values), dtype=dtype, device="cpu")
    if device.type == "cuda":
        host = host.pin_memory()  # copied without waiting for the GPU
    return host.to(device, non_blocking=True)


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
    routing.warn_if_target_broadcasts(input, target, row)
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
