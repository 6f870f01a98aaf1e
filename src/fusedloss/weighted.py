"""A loss given weight= or scale=: one fused pass where the weighted kernels apply, else
torch operations around the unweighted loss (``functional``'s docstring has the rules)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import _reduction

from . import build, formulas, grad_output_prediction, ops, reductions, routing
from .losses import LOSSES, Loss

_NO_WEIGHTED_GRADIENTS = [False, False, False]


def _needs_grad(t: Tensor | float | None) -> bool:
    return isinstance(t, Tensor) and t.requires_grad and torch.is_grad_enabled()


def _fused_weighted_applies(input: Tensor, target: Tensor, weight: Tensor | None, scale: float | Tensor | None,
                            loss_dtype: torch.dtype) -> bool:
    """The weighted kernels take no gradient for a scale tensor, and read a weight of any
    real dtype but float64 with narrower operands (they hold it in float32)."""
    weight_fits = weight is None or (
        isinstance(weight, Tensor)
        and routing.no_torch_function(weight)
        and weight.device == input.device
        and not weight.is_complex()
        and (weight.dtype != torch.float64 or loss_dtype == torch.float64)
    )
    scale_fits = not isinstance(scale, Tensor) or (
        routing.no_torch_function(scale)
        and (scale.device == input.device or scale.device.type == "cpu")
        and not scale.is_complex()
        and not _needs_grad(scale)
    )
    return weight_fits and scale_fits and build.use_kernels("weighted")


def weighted_loss(
    loss: str,
    param: float,
    input: Tensor,
    target: Tensor,
    size_average: bool | None,
    reduce: bool | None,
    reduction: str,
    weight: Tensor | None,
    scale: float | Tensor | None,
    unweighted: Callable[[Tensor, Tensor, str], Tensor],
    torch_weighted: Callable[..., Tensor] | None = None,
    fusable: bool = True,
) -> Tensor:
    """A loss given weight= or scale= (see the public functions): one fused pass where the
    kernels routing.apply, else torch operations around `unweighted` (the loss with reduction='none').
    `torch_weighted` is torch.nn.functional's own weighted loss, where PyTorch has one."""
    reductions.check_scale(scale)
    # PyTorch's own weighted loss (a weight of the input's size): its values, errors and
    # mean, whose denominator sums the weight as given, also where the target broadcasts it.
    pytorch_case = (torch_weighted is not None and isinstance(weight, Tensor) and weight.size() == input.size())
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    shape = reductions.loss_shape(input, target)
    if weight is not None:
        reductions.check_weight_broadcasts(weight, shape)
    if reduction not in routing.MODES:
        raise ValueError(f"Invalid reduction mode: {reduction}. Expected one of 'none', 'mean', 'sum'.")
    wants_gradients = torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in (input, target, weight, scale))
    learned = wants_gradients and (_needs_grad(weight) or _needs_grad(scale))
    if (fusable and reduction != "none" and routing.kernels_apply(input, target) and not (
            wants_gradients and routing.pytorch_serves_the_step(LOSSES[loss], reduction, input, target,
                                                                shape.numel(), True, learned))):
        autocast = routing.under_autocast(input, target)
        loss_dtype = torch.float32 if autocast else formulas.loss_dtype(input.dtype, target.dtype, loss)
        if _fused_weighted_applies(input, target, weight, scale, loss_dtype):
            return _fused_weighted_loss(loss, param, input, target, shape, reduction, weight, scale, autocast,
                                        loss_dtype, pytorch_case)
    if weight is None:  # the loss as reduced without a scale (PyTorch's own reduction, where it serves), scaled
        return reductions.reduce(unweighted(input, target, reduction), "none", None, scale)
    if not pytorch_case:
        return reductions.reduce(unweighted(input, target, "none"), reduction, weight, scale,
                                 mean_over_count=LOSSES[loss].weighted_mean_over_count)
    out = torch_weighted(input, target, reduction, param, weight)
    if scale is None:
        return out
    return out * (scale.to(out.dtype) if isinstance(scale, Tensor) else scale)


def _fused_weighted_loss(
    loss: str,
    param: float,
    input: Tensor,
    target: Tensor,
    shape: torch.Size,
    reduction: str,
    weight: Tensor | None,
    scale: float | Tensor | None,
    autocast: bool,
    loss_dtype: torch.dtype,
    pytorch_case: bool,
) -> Tensor:
    routing.warn_if_target_broadcasts(input, target, LOSSES[loss])
    numel = shape.numel()
    # A weight that widens the loss's dtype (bf16 operands, a float32 weight) makes it
    # float32: the autocast kernels' math, which reads 16-bit operands as float32.
    result_dtype = loss_dtype
    if weight is not None and weight.is_floating_point():
        result_dtype = torch.promote_types(loss_dtype, weight.dtype)
    float32_math = autocast or (result_dtype == torch.float32 and loss_dtype in routing.SIXTEEN_BIT)
    divisor = None
    device_scale, host_scale = _device_and_host_scale(scale, input.device)
    if reduction == "mean":
        if weight is None or LOSSES[loss].weighted_mean_over_count:
            host_scale = reductions.mean_factor(host_scale, numel)
        elif pytorch_case:
            # The weight as given, also where the target broadcasts the loss to nothing.
            divisor = reductions.weight_sum(weight, result_dtype)
        elif numel == 0:
            host_scale = math.nan
        else:
            # The sum of the weight expanded to the loss's shape, without expanding it.
            divisor = reductions.weight_sum(weight, result_dtype)
            host_scale /= numel // weight.numel()
    output_mask = _NO_WEIGHTED_GRADIENTS
    kept_dims = ops.weight_row_tiling(weight, input, target)
    operands, slot, expected = _forward_gradients(loss, param, reduction, input, target, weight, numel)
    if operands is not None:
        # A weight over leading dimensions gets its gradient from the loss's sums per row.
        weight_gradient = (_needs_grad(weight) and kept_dims < 0
                           and ops.weight_gradient_rows(weight, input, target) is None)
        output_mask = [*operands, weight_gradient]
    if kept_dims >= 0 and _needs_grad(weight):
        output_mask = [output_mask[0], output_mask[1], True]  # the forward's sums per row
    return routing.apply_weighted(input, target, weight, device_scale, divisor, host_scale, loss, param, output_mask,
                                  slot, expected, float32_math, kept_dims, False)


def _forward_gradients(loss: str, param: float, reduction: str, input: Tensor, target: Tensor,
                       weight: Tensor | None, numel: int) -> tuple[list[bool] | None, int, float]:
    """Which operands' gradients the forward's pass writes (None: none), for the grad_output
    expected (grad_output_prediction), and the backward's history slot."""
    if not ((input.requires_grad or target.requires_grad) and torch.is_grad_enabled()
            and routing.forward_writes_gradients(input, target, numel, weighted=True)):
        return None, -1, 1.0
    slot, expected, mispredicted = grad_output_prediction.predict(loss, param, reduction, input, target, weight,
                                                                  family="weighted")
    return None if mispredicted else [input.requires_grad, target.requires_grad], slot, expected


def _device_and_host_scale(scale: float | Tensor | None, device: torch.device) -> tuple[Tensor | None, float]:
    """The scale as the kernels take it: a tensor on the loss's device, read there, or a
    number (a CPU tensor's value: no device to wait for)."""
    if isinstance(scale, Tensor) and scale.device == device:
        return scale, 1.0
    return None, 1.0 if scale is None else float(scale)


def fused_param_tensor_loss(loss: str, input: Tensor, target: Tensor, param: Tensor, reduction: str,
                            scale: float | Tensor | None) -> Tensor | None:
    """A mean or sum of a loss whose param is a tensor (quantiles along the last dimension,
    pseudo-Huber's c per sample), in one fused pass: the weighted kernels read the param
    where a weight would lie, and multiply by nothing. None where they do not apply: a param
    that wants a gradient, widens the loss's shape or its math (float64 with narrower
    operands), or lies elsewhere; then torch operations compute it."""
    if reduction == "none" or not routing.kernels_apply(input, target):
        return None
    reductions.check_scale(scale)
    shape = reductions.loss_shape(input, target)
    if (not isinstance(param, Tensor) or _needs_grad(param) or param.dim() > len(shape)
            or any(p not in (1, s) for p, s in zip(reversed(param.shape), reversed(shape)))):
        return None
    autocast = routing.under_autocast(input, target)
    loss_dtype = torch.float32 if autocast else formulas.loss_dtype(input.dtype, target.dtype, loss)
    if not _fused_weighted_applies(input, target, param, scale, loss_dtype):
        return None
    routing.warn_if_target_broadcasts(input, target, LOSSES[loss])
    device_scale, host_scale = _device_and_host_scale(scale, input.device)
    numel = shape.numel()
    if reduction == "mean":
        host_scale = reductions.mean_factor(host_scale, numel)
    # -1: no number param of these losses, so a history slot of its own
    operands, slot, expected = _forward_gradients(loss, -1.0, reduction, input, target, param, numel)
    output_mask = _NO_WEIGHTED_GRADIENTS if operands is None else [*operands, False]
    # the number param is unused; its default passes the operator's check of it
    return routing.apply_weighted(input, target, param, device_scale, None, host_scale, loss,
                                  LOSSES[loss].param_default, output_mask, slot, expected, autocast, -1, True)


def _torch_weighted(row: Loss) -> Callable[..., Tensor] | None:
    """torch.nn.functional's own weighted loss (torch >= 2.6), as (input, target, reduction, param, weight)."""
    function = row.torch_function
    if function is None or "weight" not in inspect.signature(function).parameters:
        return None
    if row.param is None:
        return lambda i, t, reduction, _, w: function(i, t, reduction=reduction, weight=w)
    return lambda i, t, reduction, param, w: function(i, t, reduction=reduction, weight=w, **{row.param: param})


TORCH_WEIGHTED = {name: function for name, row in LOSSES.items() if (function := _torch_weighted(row)) is not None}
