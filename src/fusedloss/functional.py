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

import inspect
import math
import numbers
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import forward_ad
from torch.nn import _reduction
from torch.overrides import has_torch_function_variadic

from . import build, formulas, grad_output_prediction, ops
from .losses import pseudo_huber_elementwise, reduced


class _PseudoHuberWithTensorC(torch.autograd.Function):
    """Pseudo-Huber for a tensor c (eager, outside torch.func), with its derivatives written
    out: 2c d / root for the operands and 2 (root - c)^2 / root for c. Autograd through the
    formula would take about twice as many passes over N, as a user's own formula does.
    A mean's 1 / N rides on the factor 2c, which backward reuses: a small step is bound by
    its launches. A double backward differentiates the formula itself."""

    @staticmethod
    def forward(ctx, input: Tensor, target: Tensor, c: Tensor, reduction: str) -> Tensor:
        dtype = torch.promote_types(input.dtype, target.dtype)
        math = torch.promote_types(dtype, torch.float32)  # as the kernels (and diffusers) compute it
        x = input.to(math) - target
        c_math = c.to(torch.promote_types(c.dtype, math))
        root = torch.hypot(x, c_math)
        # root - c as d^2 / (root + c), without cancellation for |d| << c; the bound keeps
        # an infinite d's loss infinite rather than inf / inf.
        near = x.square() / _bounded(root).add_(c_math)
        # A mean as the sum of 2c / N times near (an empty mean stays 0 / 0 = NaN).
        numel = root.numel()
        ctx.per_element = 2 / numel if reduction == "mean" and numel else 2.0
        factor = c_math * ctx.per_element
        ctx.save_for_backward(input, target, c, x, root, factor, near if ctx.needs_input_grad[2] else None)
        ctx.reduction = reduction
        loss = near * factor if ctx.needs_input_grad[2] else near.mul_(factor)
        if reduction == "none":
            return loss.to(dtype)
        return (loss.mean() if reduction == "mean" and not numel else loss.sum()).to(dtype)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, target, c, x, root, factor, near = ctx.saved_tensors
        wanted = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph: the formula's derivatives, differentiable again
            with torch.enable_grad():
                loss = reduced(pseudo_huber_elementwise(input, target, c), ctx.reduction)
            grads = iter(torch.autograd.grad(loss, [t for t, w in zip((input, target, c), wanted) if w], grad_output,
                                             create_graph=True))
            return tuple(next(grads) if w else None for w in wanted) + (None,)
        # factor has the forward's math dtype (a float64 c widens it), which promotion keeps
        slope = x.div(root).mul_(factor * grad_output) if wanted[0] or wanted[1] else None
        grad_input = slope.to(input.dtype).sum_to_size(input.shape) if wanted[0] else None
        grad_target = slope.neg().to(target.dtype).sum_to_size(target.shape) if wanted[1] else None
        grad_c = None
        if wanted[2]:
            # 2 (root - c)^2 / root, written so that an infinite d gives inf, not inf / inf
            times = grad_output.to(root.dtype) * ctx.per_element
            grad_c = near.div(_bounded(root)).mul_(near).mul_(times).sum_to_size(c.shape).to(c.dtype)
        return grad_input, grad_target, grad_c, None


def _bounded(root: Tensor) -> Tensor:
    return root.clamp(max=torch.finfo(root.dtype).max)


_reduced_loss_op = torch.ops.fusedloss.reduced_loss.default
_pointwise_loss_op = torch.ops.fusedloss.pointwise_loss.default
_weighted_loss_op = torch.ops.fusedloss.weighted_loss.default


def _apply(function: type[torch.autograd.Function], op, differentiable: tuple[Tensor | None, ...], *args):
    """The operator with its autograd (ops.py) where a `differentiable` operand wants a
    gradient, else straight to its kernel."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable):
        return function.apply(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_16_BIT = (torch.float16, torch.bfloat16)
_REDUCTION_NAMES = {0: "none", 1: "mean", 2: "sum"}
_MODES = ("mean", "sum", "none")
_NO_GRADIENTS = [False, False]
_NO_WEIGHTED_GRADIENTS = [False, False, False]
# From operands of this many bytes on (both together), a mean or sum writes its
# gradient in the forward pass, for the grad_output it expects (grad_output_prediction).
# Below, a step is bound by host time, not memory: backward computes the gradient
# from the operands, in as many launches and with no bookkeeping (docs/design.md,
# "Gradients in the forward pass").
FUSED_GRADIENT_FROM_BYTES = 1 << 28


def _forward_writes_gradients(input: Tensor, target: Tensor, numel: int) -> bool:
    # A pair with one float64 operand is computed in float64 and its gradients converted:
    # the converted buffer is not the one backward could correct in place.
    return (numel * (input.element_size() + target.element_size()) >= FUSED_GRADIENT_FROM_BYTES
            and (input.dtype == torch.float64) == (target.dtype == torch.float64))


def _kernels_apply(input: Tensor, target: Tensor) -> bool:
    return (
        # torch.compile traces torch.nn.functional instead, which inductor can fuse
        # with the ops around the loss (docs/design.md, "torch.compile").
        not torch.compiler.is_compiling()
        and isinstance(input, Tensor)
        and isinstance(target, Tensor)
        and not has_torch_function_variadic(input, target)
        and input.is_cuda
        and input.dtype in _KERNEL_DTYPES
        and target.dtype in _KERNEL_DTYPES
        and target.get_device() == input.get_device()
        and not _under_a_transform()
        and build.use_kernels()
    )


def _under_a_transform() -> bool:
    """torch.func transforms (grad, vmap, jvp, jacrev, ...) and forward-mode AD: the fused
    operators have no rules for them, so such calls run PyTorch's formula, which has."""
    return forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()


def _warn_if_target_broadcasts(input: Tensor, target: Tensor, stacklevel: int) -> None:
    """torch.nn.functional's warning, pointed at the user's call `stacklevel` frames up."""
    if target.shape != input.shape:
        warnings.warn(
            f"Using a target size ({target.size()}) that is different to the input size ({input.size()}). "
            "This will likely lead to incorrect results due to broadcasting. "
            "Please ensure they have the same size.",
            stacklevel=stacklevel,
        )


def _under_autocast(input: Tensor, target: Tensor, device_type: str = "cuda") -> bool:
    """Autocast runs these losses in float32 (they are on its float32 list) when an operand is 16-bit."""
    return (input.dtype in _16_BIT or target.dtype in _16_BIT) and torch.is_autocast_enabled(device_type)


def _fused_loss(
    loss: str,
    param: float,
    input: Tensor,
    target: Tensor,
    size_average: bool | None,
    reduce: bool | None,
    reduction: str,
) -> Tensor:
    """The steps of torch.nn.functional's losses, in its order, then one fused op.
    Every call of a small loss pays for this function's work, so it compares shapes once."""
    same_shape = target.shape == input.shape
    if not same_shape:
        _warn_if_target_broadcasts(input, target, stacklevel=4)
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    mode = reduction if reduction in _MODES else _REDUCTION_NAMES[_reduction.get_enum(reduction)]
    if loss == "smooth_l1" and param == 0.0:
        loss = "l1"  # as torch.nn.functional.smooth_l1_loss does
    autocast = _under_autocast(input, target)
    wants_gradients = (input.requires_grad or target.requires_grad) and torch.is_grad_enabled()
    if mode == "none":
        if wants_gradients and build.cxx_autograd_loaded():
            return torch.ops.fusedloss_cxx.pointwise_loss.default(input, target, loss, param, autocast)
        return _apply(ops.PointwiseLoss, _pointwise_loss_op, (input, target), input, target, loss, param, autocast)
    output_mask, slot, expected = _NO_GRADIENTS, -1, 1.0
    if wants_gradients:
        numel = input.numel() if same_shape else ops.broadcast_numel(input, target)
        if _forward_writes_gradients(input, target, numel):
            slot, expected, mispredicted = grad_output_prediction.predict(loss, param, mode, input, target)
            if not mispredicted:
                output_mask = [input.requires_grad, target.requires_grad]
        elif build.cxx_autograd_loaded():  # a step bound by host time: no Python in its backward
            return torch.ops.fusedloss_cxx.reduced_loss.default(input, target, loss, param, mode, autocast)
    return _apply(ops.ReducedLoss, _reduced_loss_op, (input, target), input, target, loss, param, mode, output_mask,
                  slot, expected, autocast)[0]


def _weight_broadcasts(weight: Tensor, shape: torch.Size) -> None:
    """Raises unless the weight broadcasts to the loss's shape without widening it."""
    fits = weight.dim() <= len(shape) and all(w in (1, s) for w, s in zip(reversed(weight.shape), reversed(shape)))
    if not fits:
        raise ValueError(f"fusedloss: a weight of shape {tuple(weight.shape)} does not broadcast to the loss's "
                         f"shape {tuple(shape)}")


def _check_scale(scale: float | Tensor | None) -> None:
    if isinstance(scale, Tensor):
        if scale.is_complex():
            raise TypeError(f"fusedloss: scale must be a real number or a real 0-d tensor, not a {scale.dtype} tensor")
        if scale.dim() != 0:
            raise ValueError(f"fusedloss: scale is a number or a 0-d tensor, got a tensor of shape "
                             f"{tuple(scale.shape)}")
    elif scale is not None and not isinstance(scale, numbers.Real):
        raise TypeError(f"fusedloss: scale must be a real number or a 0-d tensor, not {type(scale).__name__}")


def _needs_grad(t: Tensor | float | None) -> bool:
    return isinstance(t, Tensor) and t.requires_grad and torch.is_grad_enabled()


def _fused_weighted_applies(input: Tensor, target: Tensor, weight: Tensor | None, scale: float | Tensor | None,
                            loss_dtype: torch.dtype) -> bool:
    """The weighted kernels take no gradient for a scale tensor, and read a weight of any
    real dtype but float64 with narrower operands (they hold it in float32)."""
    weight_fits = weight is None or (
        isinstance(weight, Tensor)
        and not has_torch_function_variadic(weight)
        and weight.device == input.device
        and not weight.is_complex()
        and (weight.dtype != torch.float64 or loss_dtype == torch.float64)
    )
    scale_fits = not isinstance(scale, Tensor) or (
        not has_torch_function_variadic(scale)
        and (scale.device == input.device or scale.device.type == "cpu")
        and not scale.is_complex()
        and not _needs_grad(scale)
    )
    return weight_fits and scale_fits and build.use_kernels("weighted")


def _weighted_loss(
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
    kernels apply, else torch operations around `unweighted` (the loss with reduction='none').
    `torch_weighted` is torch.nn.functional's own weighted loss, where PyTorch has one."""
    _check_scale(scale)
    # PyTorch's own weighted loss (a weight of the input's size): its values, errors and
    # mean, whose denominator sums the weight as given, also where the target broadcasts it.
    pytorch_case = (torch_weighted is not None and isinstance(weight, Tensor) and weight.size() == input.size())
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    shape = input.shape if target.shape == input.shape else torch.broadcast_shapes(input.shape, target.shape)
    if weight is not None:
        _weight_broadcasts(weight, shape)
    if reduction not in _MODES:
        raise ValueError(f"Invalid reduction mode: {reduction}. Expected one of 'none', 'mean', 'sum'.")
    if fusable and reduction != "none" and _kernels_apply(input, target):
        autocast = _under_autocast(input, target)
        loss_dtype = torch.float32 if autocast else formulas.loss_dtype(input.dtype, target.dtype, loss)
        if _fused_weighted_applies(input, target, weight, scale, loss_dtype):
            return _fused_weighted_loss(loss, param, input, target, shape, reduction, weight, scale, autocast,
                                        loss_dtype, pytorch_case)
    if pytorch_case:
        out = torch_weighted(input, target, reduction, param, weight)
    else:
        out = unweighted(input, target, "none")
        if weight is not None:
            if weight.is_floating_point():
                out = out.to(torch.promote_types(out.dtype, weight.dtype))  # a 0-d weight too
            out = out * weight
        if reduction == "sum":
            out = out.sum()
        elif reduction == "mean":
            out = out.mean() if weight is None or loss == "huber" else out.sum() / _expanded_sum(weight, shape, out)
    if scale is None:
        return out
    return out * (scale.to(out.dtype) if isinstance(scale, Tensor) else scale)


def _expanded_sum(weight: Tensor, shape: torch.Size, like: Tensor) -> Tensor:
    """The sum of the weight expanded to `shape`, without expanding it, in `like`'s dtype."""
    multiplicity = shape.numel() // weight.numel() if weight.numel() else 0
    return (_weight_sum(weight, like.dtype) * multiplicity).to(like.dtype)


def _weight_sum(weight: Tensor, loss_dtype: torch.dtype) -> Tensor:
    """A weighted mean's divisor, the weight's sum as it lies: below a float64 loss, in
    float32 as PyTorch sums it, which reads a 16- or 32-bit weight where it lies (a float64
    sum would copy it first); a mask of integers is counted exactly."""
    in_float32 = weight.is_floating_point() and loss_dtype != torch.float64
    return weight.sum(dtype=torch.float32 if in_float32 else torch.float64)


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
    _warn_if_target_broadcasts(input, target, stacklevel=5)
    numel = shape.numel()
    # A weight that widens the loss's dtype (bf16 operands, a float32 weight) makes it
    # float32: the autocast kernels' math, which reads 16-bit operands as float32.
    result_dtype = loss_dtype
    if weight is not None and weight.is_floating_point():
        result_dtype = torch.promote_types(loss_dtype, weight.dtype)
    float32_math = autocast or (result_dtype == torch.float32 and loss_dtype in _16_BIT)
    device_scale, divisor, host_scale = None, None, 1.0
    if isinstance(scale, Tensor) and scale.device == input.device:
        device_scale = scale
    elif scale is not None:
        host_scale = float(scale)  # a number, or a CPU tensor: no device to wait for
    if reduction == "mean":
        if numel == 0:
            host_scale = math.nan  # 0 / 0, as PyTorch's mean of nothing
        elif weight is None or loss == "huber":
            host_scale /= numel
        else:
            # The sum of the weight expanded to the loss's shape, without expanding it
            # (as given, in PyTorch's own case).
            divisor = _weight_sum(weight, result_dtype)
            if not pytorch_case:
                host_scale /= numel // weight.numel()
    output_mask, slot, expected = _NO_WEIGHTED_GRADIENTS, -1, 1.0
    if (input.requires_grad or target.requires_grad) and torch.is_grad_enabled():
        if _forward_writes_gradients(input, target, numel):
            slot, expected, mispredicted = grad_output_prediction.predict(loss, param, reduction, input, target,
                                                                          weight, family="weighted")
            if not mispredicted:
                output_mask = [input.requires_grad, target.requires_grad, _needs_grad(weight)]
    return _apply(ops.WeightedLoss, _weighted_loss_op, (input, target, weight, divisor), input, target, weight, device_scale, divisor, host_scale, loss,
                  param, output_mask,
                             slot, expected, float32_math)[0]


def _torch_weighted(name: str) -> Callable[..., Tensor] | None:
    """torch.nn.functional's own weighted loss (torch >= 2.6), as (input, target, reduction, param, weight)."""
    function = getattr(F, name)
    if "weight" not in inspect.signature(function).parameters:
        return None
    if name == "huber_loss":
        return lambda i, t, reduction, delta, w: F.huber_loss(i, t, reduction=reduction, delta=delta, weight=w)
    return lambda i, t, reduction, _, w: function(i, t, reduction=reduction, weight=w)


TORCH_WEIGHTED = {
    loss: function
    for loss, function in (("mse", _torch_weighted("mse_loss")), ("l1", _torch_weighted("l1_loss")),
                           ("huber", _torch_weighted("huber_loss")))
    if function is not None
}


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
        return _weighted_loss("mse", 0.0, input, target, size_average, reduce, reduction, weight, scale,
                              lambda i, t, r: mse_loss(i, t, reduction=r), TORCH_WEIGHTED.get("mse"))
    if not _kernels_apply(input, target):
        return F.mse_loss(input, target, size_average, reduce, reduction)
    return _fused_loss("mse", 0.0, input, target, size_average, reduce, reduction)


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
        return _weighted_loss("l1", 0.0, input, target, size_average, reduce, reduction, weight, scale,
                              lambda i, t, r: l1_loss(i, t, reduction=r), TORCH_WEIGHTED.get("l1"))
    if not _kernels_apply(input, target):
        return F.l1_loss(input, target, size_average, reduce, reduction)
    return _fused_loss("l1", 0.0, input, target, size_average, reduce, reduction)


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
        return _weighted_loss("smooth_l1" if beta > 0 else "l1", float(beta), input, target, size_average, reduce,
                              reduction, weight, scale, lambda i, t, r: smooth_l1_loss(i, t, reduction=r, beta=beta))
    if not (beta >= 0) or not _kernels_apply(input, target):
        return F.smooth_l1_loss(input, target, size_average, reduce, reduction, beta=beta)
    return _fused_loss("smooth_l1", float(beta), input, target, size_average, reduce, reduction)


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
        return _weighted_loss("huber", float(delta), input, target, None, None, reduction, weight, scale,
                              lambda i, t, r: huber_loss(i, t, reduction=r, delta=delta),
                              TORCH_WEIGHTED.get("huber"))
    if not (delta > 0) or not _kernels_apply(input, target):
        return F.huber_loss(input, target, reduction=reduction, delta=delta)
    return _fused_loss("huber", float(delta), input, target, None, None, reduction)


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
    if reduction not in _MODES:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if isinstance(c, Tensor):
        c = _nan_where_not_positive(c)
    elif not isinstance(c, numbers.Real) or isinstance(c, bool):
        raise TypeError(f"pseudo_huber_loss(): argument 'c' must be float or Tensor, not {type(c).__name__}")
    elif not c > 0:
        raise ValueError(f"fusedloss: pseudo_huber_loss needs c > 0, got {c}")
    fused_c = not isinstance(c, Tensor)
    if weight is not None or scale is not None:
        if fused_c:
            return _weighted_loss("pseudo_huber", float(c), input, target, None, None, reduction, weight, scale,
                                  lambda i, t, r: pseudo_huber_loss(i, t, c, reduction=r))
        return _weighted_loss("pseudo_huber", 0.0, input, target, None, None, reduction, weight, scale,
                              lambda i, t, r: pseudo_huber_loss(i, t, c, reduction=r), fusable=False)
    if not fused_c or not _kernels_apply(input, target):
        _warn_if_target_broadcasts(input, target, stacklevel=3)
        return _pseudo_huber_formula(input, target, c, reduction)
    return _fused_loss("pseudo_huber", float(c), input, target, None, None, reduction)


def _nan_where_not_positive(c: Tensor) -> Tensor:
    """A tensor c's elements that are not > 0 as NaN: their losses are NaN, never a
    plausible number, and nothing waits for the GPU to check them."""
    if not c.is_floating_point():
        c = c.to(torch.get_default_dtype())
    return c.masked_fill(~(c > 0), math.nan)


def _as_float(function: str, name: str, value: object) -> float:
    """A number argument as PyTorch takes it (a float, or a one-element tensor), else its TypeError."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value)
    raise TypeError(f"{function}(): argument '{name}' must be float, not {type(value).__name__}")


def _pseudo_huber_formula(input: Tensor, target: Tensor, c: float | Tensor, reduction: str = "none") -> Tensor:
    input, target = ops.as_computed(input, target, _under_autocast(input, target, input.device.type))
    if (isinstance(c, Tensor) and not torch.compiler.is_compiling() and not _under_a_transform()
            and not has_torch_function_variadic(input, target, c)):
        return _PseudoHuberWithTensorC.apply(input, target, c, reduction)
    return reduced(pseudo_huber_elementwise(input, target, c), reduction)
