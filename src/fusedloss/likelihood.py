"""The Gaussian and Poisson negative log-likelihoods, as torch.nn.functional computes
them, with fusedloss's ``weight``, ``scale`` and ``dim`` around them.

On a GPU, the Gaussian loss takes no host sync: PyTorch checks ``var`` for negative
entries with ``torch.any``, which waits for the GPU; here a negative entry's loss is NaN
(and so is any mean or sum over it) instead. On the CPU, where that check waits for
nothing, PyTorch's ValueError is kept.

On a GPU, in eager mode, with float32, float64 and bfloat16 operands (float16 ones under
autocast too), both losses (the Poisson loss without ``full``) have their derivatives
written out. A mean or sum, times a number ``scale`` where one is given, of operands of
one dtype and one shape (a var of the input's shape) is one fused pass over the operands
that also writes their gradients, ``full`` included (``fused_likelihood``: the C++
autograd's node where it is loaded, else ``FusedLikelihood``); ``reduction='none'`` is one
pass each way (``FusedLikelihoodPointwise``; the Poisson loss's from operands of
``POISSON_WRITTEN_OUT_FROM_BYTES``). Other shapes and dtypes, a weight, a tensor scale and
``dim`` take torch operations in about half the passes of autograd through PyTorch's
formula (the Poisson loss from operands of ``POISSON_WRITTEN_OUT_FROM_BYTES``). Their
values and gradients are
PyTorch's up to rounding (a product and a sum rounded once, not twice). Elsewhere (the
CPU, float16 operands outside autocast, smaller Poisson losses that the fused pass does
not take, ``full`` Poisson losses outside it, ``torch.compile``, torch.func transforms and
forward-mode AD, tensor subclasses) the losses are PyTorch's own operations; but DTensors
of one shape and dtype take the fused pass on each rank's shards (``_sharded``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import _reduction
from torch.overrides import has_torch_function_variadic

from . import build, grad_output_prediction, ops, reductions, routing
from .losses import reduced
from .reductions import Dims

_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)
# bfloat16 has float32's range, so the written-out order of operations overflows where
# PyTorch's does (or, where PyTorch's square overflows, later); float16's does not
_WRITTEN_OUT_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# From operands of this many bytes on (both together), a Poisson NLL that the fused pass does
# not take has its written-out function. Below, its step is bound by the host, where the
# Python function costs about what the launches it saves do (docs/reliability.md); the fused
# pass, one launch each way, and the Gaussian function save more, at every size.
POISSON_WRITTEN_OUT_FROM_BYTES = routing.FUSED_GRADIENT_FROM_BYTES >> 1


def gaussian_nll(input: Tensor, target: Tensor, var: Tensor | float, full: bool, eps: float, reduction: str,
                 weight: Tensor | None, scale: float | Tensor | None, dim: Dims, keepdim: bool) -> Tensor:
    if weight is None and dim is None and (out := _sharded(input, target, var, "gaussian", eps, full, reduction,
                                                          scale)) is not None:
        return out
    plain = weight is None and scale is None and dim is None
    fused_scale = _fused_scale(scale) if weight is None and dim is None else None
    if not checks_without_sync(input, target, var):
        if plain:
            return F.gaussian_nll_loss(input, target, var, full=full, eps=eps, reduction=reduction)
        _check_reduction(reduction)
        per_element = F.gaussian_nll_loss(input, target, var, full=full, eps=eps, reduction="none")
    elif _written_out_applies(*(computed := _gaussian_operands(input, target, var))):
        input, target, var = computed
        _check_reduction(reduction)
        if fused_scale is not None and _fused_applies(input, target, var):
            return fused_likelihood(input, target, var, "gaussian", eps, full, reduction, fused_scale)
        if plain:
            return GaussianNll.apply(input, target, var, full, eps, reduction)
        per_element = GaussianNll.apply(input, target, var, full, eps, "none")
    else:
        per_element = gaussian_nll_elementwise(input, target, var, full, eps, reduction)
        if plain:
            return per_element if reduction == "none" else reductions.reduce(per_element, reduction, None, None)
    return reductions.reduce(per_element, reduction, weight, scale, dim, keepdim)


def _sharded(input: Tensor, target: Tensor, var: Tensor | float | None, kind: str, eps: float, full: bool,
             reduction: str, scale: float | Tensor | None) -> Tensor | None:
    """DTensor operands that ``sharding.likelihood_applies`` takes: the fused pass on each
    rank's shards. Placed alike, the one-GPU path on the local shards
    (``sharding.likelihood_on_local_shards``), whose forward writes the gradients where it
    can; else the fused operators through their sharding rules. A mean is a sum scaled by
    one over the global count, which uneven shards add up to. None where they do not apply."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None or not isinstance(input, dtensor) or reduction not in routing.MODES:
        return None
    from . import sharding  # imported with the first DTensor: it registers the operators' rules

    fused_scale = _fused_scale(scale)
    if fused_scale is None or not sharding.likelihood_applies(input, target, var):
        return None

    def on_operators(input: Tensor, target: Tensor, var: Tensor | None = None) -> Tensor:
        if reduction == "none":
            return FusedLikelihoodPointwise.apply(input, target, var, kind, eps, full, fused_scale)
        factor = reductions.mean_factor(fused_scale, input.numel()) if reduction == "mean" else fused_scale
        # the forward writes no gradient: the in-place correction of one has no rule
        return FusedLikelihood.apply(input, target, var, kind, eps, full, "sum", -1, 1.0, False, factor)

    def on_shards(input: Tensor, target: Tensor, *rest) -> Tensor:
        *var, local_reduction, local_scale = rest
        return fused_likelihood(input, target, var[0] if var else None, kind, eps, full, local_reduction, local_scale)

    out = sharding.likelihood_on_local_shards(input, target, var, reduction, fused_scale, on_shards, on_operators)
    return on_operators(input, target, var) if out is None else out


def _fused_scale(scale: float | Tensor | None) -> float | None:
    """The scale as the fused pass takes it, a number (1 for none); None for a tensor, which
    torch operations apply."""
    if scale is None:
        return 1.0
    reductions.check_scale(scale)
    return None if isinstance(scale, Tensor) else float(scale)


def _written_out_applies(*operands: Tensor) -> bool:
    """Whether the written-out autograd functions take these operands (as computed): float32,
    float64 and bfloat16 tensors on a GPU, in eager mode, outside torch.func transforms and
    forward-mode AD. float16 operands keep PyTorch's formula: in float16 a product or
    quotient in the written-out order could overflow where PyTorch's does not, and computed
    in float32 their loss would move more bytes than PyTorch's."""
    return (all(isinstance(t, Tensor) and t.is_cuda and t.dtype in _WRITTEN_OUT_DTYPES for t in operands)
            and not torch.compiler.is_compiling() and not routing.under_a_transform()
            and routing.no_torch_function(*operands))


def _fused_applies(*operands: Tensor) -> bool:
    """Whether the fused kernels (``FusedLikelihood``) take these operands as computed: one
    dtype and one shape (the written-out functions take the others), the kernels at hand."""
    first = operands[0]
    return (all(t.dtype == first.dtype and t.shape == first.shape for t in operands[1:])
            and build.use_kernels("likelihood"))


def _gaussian_operands(input: Tensor, target: Tensor, var: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The operands as PyTorch's formula computes with them: var broadcastable, and under
    CUDA autocast 16-bit ones in float32 (where the formula's log and square run)."""
    var = _broadcastable_var(input, var)
    if torch.is_autocast_enabled("cuda"):
        return ops.as_autocast_would(input), ops.as_autocast_would(target), ops.as_autocast_would(var)
    return input, target, var


def checks_without_sync(input: Tensor, target: Tensor, var: Tensor | float) -> bool:
    """Whether a negative variance is reported as NaN (a tensor on a GPU, where PyTorch's
    check would wait for it) rather than PyTorch's ValueError."""
    return (isinstance(var, Tensor) and var.device.type != "cpu"
            and routing.no_torch_function(input, target, var))


def gaussian_nll_elementwise(input: Tensor, target: Tensor, var: Tensor, full: bool, eps: float,
                             reduction: str) -> Tensor:
    """torch.nn.functional.gaussian_nll_loss's loss per element, its shape rules and its
    gradients (the clamp at eps passes var's gradient through, as PyTorch's does), with a
    negative var's entries NaN instead of a check that waits for the GPU."""
    var = _broadcastable_var(input, var)
    _check_reduction(reduction)
    negative = var < 0
    var = var.clone()
    with torch.no_grad():  # PyTorch's clamp, which autograd does not see
        var.clamp_(min=eps)
        var.masked_fill_(negative, math.nan)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + _HALF_LOG_TWO_PI
    return loss


def _broadcastable_var(input: Tensor, var: Tensor) -> Tensor:
    """var as PyTorch's shape rules take it: the input's shape, one dimension fewer (a
    variance per row, unsqueezed), or the input's with one dimension of size 1."""
    if var.size() != input.size():
        if input.size()[:-1] == var.size():
            return torch.unsqueeze(var, -1)  # homoscedastic: one variance per row
        if not (input.ndim == var.ndim
                and sum(v for i, v in zip(input.size(), var.size(), strict=True) if i != v) == 1):
            raise ValueError("var is of incorrect size")
    return var


def _clamped_var(var: Tensor, eps: float) -> Tensor:
    """var clamped at eps, as PyTorch clamps it, with a negative entry NaN."""
    return var.clamp(min=eps).masked_fill_(var < 0, math.nan)


class GaussianNll(torch.autograd.Function):
    """The Gaussian NLL of a broadcastable var (``_broadcastable_var``) with its derivatives
    written out, for v = var clamped at eps (``_clamped_var``; the clamp passes var's
    gradient through, as PyTorch's does) and q = (input - target) / v: the loss
    (log v + (input - target) q) / 2, q for the input, -q for the target and
    (1 / v - q^2) / 2 for var. A mean's or sum's 1/2 multiplies the reduced value. A double
    backward differentiates PyTorch's formula."""

    @staticmethod
    def forward(ctx, input: Tensor, target: Tensor, var: Tensor, full: bool, eps: float,
                reduction: str) -> Tensor:
        v = _clamped_var(var, eps)
        d = input - target
        q = d / v
        twice = torch.addcmul(torch.log(v), d, q)
        if full:
            twice.add_(2 * _HALF_LOG_TWO_PI)
        ctx.save_for_backward(input, target, var, v, q)
        ctx.arguments = (full, eps, reduction, twice.numel())
        if reduction == "none":
            return twice.mul_(0.5)
        return reduced(twice, reduction) * 0.5

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, target, var, v, q = ctx.saved_tensors
        full, eps, reduction, numel = ctx.arguments
        wanted = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph: PyTorch's formula, differentiable again
            with torch.enable_grad():
                loss = reduced(gaussian_nll_elementwise(input, target, var, full, eps, "none"), reduction)
            grads = iter(torch.autograd.grad(loss, [t for t, w in zip((input, target, var), wanted) if w],
                                             grad_output, create_graph=True))
            return tuple(next(grads) if w else None for w in wanted) + (None,) * 3
        times = grad_output / numel if reduction == "mean" else grad_output
        grad_input = grad_target = grad_var = None
        if wanted[0] or wanted[1]:
            slope = q * times
            grad_input = slope.to(input.dtype).sum_to_size(input.shape) if wanted[0] else None
            grad_target = slope.neg().to(target.dtype).sum_to_size(target.shape) if wanted[1] else None
        if wanted[2]:
            grad_var = torch.addcmul(v.reciprocal(), q, q, value=-1).mul_(times * 0.5)
            grad_var = grad_var.sum_to_size(var.shape).to(var.dtype)
        return grad_input, grad_target, grad_var, None, None, None


def fused_likelihood(input: Tensor, target: Tensor, var: Tensor | None, kind: str, eps: float, full: bool,
                     reduction: str, scale: float = 1.0) -> Tensor:
    """The fused pass (the mean or sum times ``scale``) with its autograd: the C++ autograd's
    graph node where it is loaded (a small step then runs no Python in its backward), else
    ``FusedLikelihood``; the same kernels, values and gradients either way. From
    ``routing.FUSED_GRADIENT_FROM_BYTES`` of operands, the forward writes the gradients for
    the grad_output the last backward of the same loss brought (``grad_output_prediction``:
    a loss scale costs no second pass), and after a misprediction none; below, for a
    grad_output of 1. ``reduction='none'``: ``FusedLikelihoodPointwise``."""
    if reduction == "none":
        return FusedLikelihoodPointwise.apply(input, target, var, kind, eps, full, scale)
    slot, expected, writes = -1, 1.0, True
    if (torch.is_grad_enabled() and (input.requires_grad or target.requires_grad
                                     or (var is not None and var.requires_grad))
            and input.numel() * input.element_size() * (2 if var is None else 3) >= routing.FUSED_GRADIENT_FROM_BYTES):
        slot, expected, mispredicted = grad_output_prediction.predict(kind, eps, reduction, input, target, var,
                                                                      family="likelihood")
        writes = not mispredicted
    if build.cxx_autograd_loaded():
        return torch.ops.fusedloss_cxx.likelihood_loss.default(input, target, var, kind, eps, full, reduction, slot,
                                                               expected, writes, scale)
    return FusedLikelihood.apply(input, target, var, kind, eps, full, reduction, slot, expected, writes, scale)


def likelihood_gradients(grad_output: Tensor, input: Tensor, target: Tensor, var: Tensor | None, kind: str,
                         eps: float, full: bool, reduction: str, wanted: Sequence[bool],
                         scale: float = 1.0) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The fused losses' gradients of the operands ``wanted`` (None for the others) as
    PyTorch's formula gives them, through a graph of their own, so that autograd can
    differentiate them again (``create_graph=True``)."""
    with torch.enable_grad():
        if kind == "gaussian":
            loss = reduced(gaussian_nll_elementwise(input, target, var, full, eps, "none"), reduction)
        else:
            loss = F.poisson_nll_loss(input, target, log_input=kind == "poisson", full=full, eps=eps,
                                      reduction=reduction)
        if scale != 1.0:
            loss = loss * scale
    grads = iter(torch.autograd.grad(loss, [t for t, w in zip((input, target, var), wanted) if w], grad_output,
                                     create_graph=True))
    return tuple(next(grads) if w else None for w in wanted)


@torch.library.impl("fusedloss::likelihood_gradients", "CompositeImplicitAutograd")
def _likelihood_gradients_op(grad_output: Tensor, input: Tensor, target: Tensor, var: Tensor | None, kind: str,
                             eps: float, full: bool, reduction: str, output_mask: Sequence[bool],
                             scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    # the C++ autograd's double backward: an operand not wanted gets an empty tensor
    grads = likelihood_gradients(grad_output, input, target, var, kind, eps, full, reduction, output_mask, scale)
    return tuple(input.new_empty((0,)) if g is None else g for g in grads)


# ---- the fused operators' CPU kernels: the CUDA kernels' math, per element ----------------------


def _terms(input: Tensor, target: Tensor, var: Tensor | None, kind: str, eps: float,
           full: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Each element's loss and its derivatives in input, target and var, as the CUDA kernels
    compute them (``csrc/likelihood_loss.cu``), in float32 (float64 for float64 operands): a
    reference for tests and for DTensor ranks on the CPU."""
    math_dtype = torch.float64 if input.dtype == torch.float64 else torch.float32
    p, t = input.to(math_dtype), target.to(math_dtype)
    if kind == "gaussian":
        v = _clamped_var(var.to(math_dtype), eps)
        d = p - t
        q = d / v
        loss = 0.5 * (torch.log(v) + d * q) + (_HALF_LOG_TWO_PI if full else 0.0)
        return loss, q, -q, 0.5 * (1 / v - q * q)
    if kind == "poisson":
        rate = torch.exp(p)
        loss, d_input, d_target = rate - t * p, rate - t, -p
    else:
        shifted = p + eps
        log_shifted = torch.log(shifted)
        loss, d_input, d_target = p - t * log_shifted, 1 - t / shifted, -log_shifted
    if full:
        # where target > 1 (NaN kept); PyTorch's gradient is NaN at a target <= 0 and an infinite one
        counted = ~(t <= 1)
        log_t = torch.log(torch.where(counted, t, 1.0))
        loss = loss + torch.where(counted, t * log_t - t + 0.5 * log_t + _HALF_LOG_TWO_PI, 0.0)
        d_target = torch.where(counted, torch.where(t == math.inf, math.nan, d_target + log_t + 0.5 / t),
                               torch.where(t <= 0, math.nan, d_target))
    return loss, d_input, d_target, None


def _scaled_gradients(terms: tuple, times: Tensor | float, output_mask: Sequence[bool],
                      like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The derivatives output_mask asks for times `times`, in the operands' dtype (empty for the others)."""
    return tuple((d * times).to(like.dtype) if wanted and d is not None else like.new_empty((0,))
                 for d, wanted in zip(terms[1:], output_mask))


@torch.library.impl("fusedloss::likelihood_loss", "CPU")
def _likelihood_loss_cpu(input: Tensor, target: Tensor, var: Tensor | None, kind: str, eps: float, full: bool,
                         reduction: str, output_mask: Sequence[bool], expected_grad_output: float = 1.0,
                         scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    terms = _terms(input, target, var, kind, eps, full)
    factor = reductions.mean_factor(scale, input.numel()) if reduction == "mean" else scale
    out = (terms[0].sum(dtype=torch.float64) * factor).to(input.dtype)
    return (out, *_scaled_gradients(terms, factor * expected_grad_output, output_mask, input))


def _reduction_gradients(grad_output: Tensor, input: Tensor, target: Tensor, var: Tensor | None, kind: str,
                         eps: float, full: bool, reduction: str, output_mask: Sequence[bool],
                         scale: float) -> tuple[Tensor, Tensor, Tensor]:
    factor = reductions.mean_factor(scale, input.numel()) if reduction == "mean" else scale
    times = grad_output.reshape(()).to(torch.float64) * factor
    return _scaled_gradients(_terms(input, target, var, kind, eps, full), times, output_mask, input)


@torch.library.impl("fusedloss::likelihood_loss_backward", "CPU")
def _likelihood_loss_backward_cpu(grad_output: Tensor, input: Tensor, target: Tensor, var: Tensor | None, kind: str,
                                  eps: float, full: bool, reduction: str, output_mask: Sequence[bool],
                                  history_slot: int = -1, expected_grad_output: float = 1.0,
                                  scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    return _reduction_gradients(grad_output, input, target, var, kind, eps, full, reduction, output_mask, scale)


@torch.library.impl("fusedloss::likelihood_loss_backward_", "CPU")
def _likelihood_loss_backward_in_place_cpu(grad_input: Tensor, grad_target: Tensor, grad_var: Tensor,
                                           grad_output: Tensor, input: Tensor, target: Tensor, var: Tensor | None,
                                           kind: str, eps: float, full: bool, reduction: str,
                                           expected_grad_output: float = 1.0, history_slot: int = -1,
                                           scale: float = 1.0) -> None:
    # recomputed whatever grad_output is: the host knows it here (torch.library.impl's
    # decorator leaves no function to call by name)
    written = (grad_input, grad_target, grad_var)
    grads = _reduction_gradients(grad_output, input, target, var, kind, eps, full, reduction,
                                 [g.numel() > 0 for g in written], scale)
    for buffer, gradient in zip(written, grads):
        if buffer.numel():
            buffer.copy_(gradient)


@torch.library.impl("fusedloss::likelihood_pointwise", "CPU")
def _likelihood_pointwise_cpu(input: Tensor, target: Tensor, var: Tensor | None, kind: str, eps: float, full: bool,
                              scale: float = 1.0) -> Tensor:
    return (_terms(input, target, var, kind, eps, full)[0] * scale).to(input.dtype)


@torch.library.impl("fusedloss::likelihood_pointwise_backward", "CPU")
def _likelihood_pointwise_backward_cpu(grad_output: Tensor, input: Tensor, target: Tensor, var: Tensor | None,
                                       kind: str, eps: float, full: bool, output_mask: Sequence[bool],
                                       scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    terms = _terms(input, target, var, kind, eps, full)
    return _scaled_gradients(terms, grad_output.to(terms[0].dtype) * scale, output_mask, input)


class FusedLikelihood(torch.autograd.Function):
    """A mean or sum of the Gaussian (``kind='gaussian'``) or Poisson (``'poisson'`` of a log
    rate, ``'poisson_rate'`` of a rate) NLL of CUDA operands of one dtype and one shape, times
    ``scale``, in one fused pass (``fusedloss::likelihood_loss``) that also writes the gradients autograd
    will want (where ``writes``), for the grad_output ``expected``; backward hands them on,
    recomputed in place on the GPU where grad_output is another, or computes them, and notes
    grad_output in the history ``slot`` (-1: nowhere). Values and gradients are PyTorch's
    formulas computed in float32 (float64 for float64 operands), each rounded once. A double
    backward differentiates PyTorch's formula."""

    @staticmethod
    def forward(ctx, input: Tensor, target: Tensor, var: Tensor | None, kind: str, eps: float, full: bool,
                reduction: str, slot: int, expected: float, writes: bool, scale: float = 1.0) -> Tensor:
        wanted = [bool(w) for w in ctx.needs_input_grad[:3]]
        with torch._C._AutoDispatchBelowAutograd():
            out, *grads = torch.ops.fusedloss.likelihood_loss(input, target, var, kind, eps, full, reduction,
                                                              wanted if writes else [False] * 3, expected, scale)
        ctx.save_for_backward(input, target, var)
        ctx.arguments = (kind, eps, full, reduction, slot, expected, scale)
        ctx.written = grads if writes else None  # handed on by the first backward; a later one computes its own
        return out

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, target, var = ctx.saved_tensors
        kind, eps, full, reduction, slot, expected, scale = ctx.arguments
        wanted = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph: PyTorch's formula, differentiable again
            return likelihood_gradients(grad_output, input, target, var, kind, eps, full, reduction, wanted,
                                        scale) + (None,) * 8
        grads, ctx.written = ctx.written, None
        with torch._C._AutoDispatchBelowAutograd():
            if grads is None:
                grads = torch.ops.fusedloss.likelihood_loss_backward(grad_output, input, target, var, kind, eps, full,
                                                                     reduction, [bool(w) for w in wanted], slot,
                                                                     expected, scale)
            else:
                torch.ops.fusedloss.likelihood_loss_backward_(*grads, grad_output, input, target, var, kind, eps, full,
                                                              reduction, expected, slot, scale)
        return tuple(g if w else None for g, w in zip(grads, wanted)) + (None,) * 8


class FusedLikelihoodPointwise(torch.autograd.Function):
    """``FusedLikelihood``'s loss per element (``reduction='none'``) times ``scale``, in one
    pass (``fusedloss::likelihood_pointwise``); backward is another
    (``likelihood_pointwise_backward``), reading grad_output where it lies when it is one
    value expanded (the backward of a sum). A double backward differentiates PyTorch's
    formula."""

    @staticmethod
    def forward(ctx, input: Tensor, target: Tensor, var: Tensor | None, kind: str, eps: float, full: bool,
                scale: float) -> Tensor:
        with torch._C._AutoDispatchBelowAutograd():
            out = torch.ops.fusedloss.likelihood_pointwise(input, target, var, kind, eps, full, scale)
        ctx.save_for_backward(input, target, var)
        ctx.arguments = (kind, eps, full, scale)
        return out

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, target, var = ctx.saved_tensors
        kind, eps, full, scale = ctx.arguments
        wanted = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph: PyTorch's formula, differentiable again
            return likelihood_gradients(grad_output, input, target, var, kind, eps, full, "none", wanted,
                                        scale) + (None,) * 4
        with torch._C._AutoDispatchBelowAutograd():
            grads = torch.ops.fusedloss.likelihood_pointwise_backward(grad_output, input, target, var, kind, eps, full,
                                                                      [bool(w) for w in wanted], scale)
        return tuple(g if w else None for g, w in zip(grads, wanted)) + (None,) * 4


class PoissonNll(torch.autograd.Function):
    """PyTorch's Poisson NLL without ``full``, with its derivatives written out: for a log
    rate (``log_input``), exp(input) - target input per element, exp(input) - target for
    the input and -input for the target; for a rate, input - target log(input + eps),
    1 - target / (input + eps) and -log(input + eps). A double backward differentiates
    PyTorch's formula."""

    @staticmethod
    def forward(ctx, input: Tensor, target: Tensor, log_input: bool, eps: float, reduction: str) -> Tensor:
        if log_input:
            rate = torch.exp(input)
            loss = torch.addcmul(rate, target, input, value=-1)
            ctx.save_for_backward(input, target, rate, None)
        else:
            shifted = input + eps
            log_shifted = torch.log(shifted)
            loss = torch.addcmul(input, target, log_shifted, value=-1)
            ctx.save_for_backward(input, target, shifted, log_shifted)
        ctx.arguments = (log_input, eps, reduction, loss.numel())
        return reduced(loss, reduction)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, target, rate_or_shifted, log_shifted = ctx.saved_tensors
        log_input, eps, reduction, numel = ctx.arguments
        wanted = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():  # create_graph: PyTorch's formula, differentiable again
            with torch.enable_grad():
                loss = F.poisson_nll_loss(input, target, log_input=log_input, eps=eps, reduction=reduction)
            grads = iter(torch.autograd.grad(loss, [t for t, w in zip((input, target), wanted) if w],
                                             grad_output, create_graph=True))
            return tuple(next(grads) if w else None for w in wanted) + (None,) * 3
        times = grad_output / numel if reduction == "mean" else grad_output
        grad_input = grad_target = None
        if wanted[0]:
            if log_input:  # exp(input) - target
                slope = torch.sub(rate_or_shifted, target)
            else:  # 1 - target / (input + eps)
                slope = torch.addcdiv(torch.ones((), dtype=times.dtype, device=times.device), target, rate_or_shifted,
                                      value=-1)
            grad_input = slope.mul_(times).sum_to_size(input.shape).to(input.dtype)
        if wanted[1]:
            minus = (input if log_input else log_shifted).to(times.dtype)
            grad_target = minus.mul(times).neg_().sum_to_size(target.shape).to(target.dtype)
        return grad_input, grad_target, None, None, None


def poisson_nll(input: Tensor, target: Tensor, log_input: bool, full: bool, size_average: bool | None, eps: float,
                reduce: bool | None, reduction: str, weight: Tensor | None, scale: float | Tensor | None, dim: Dims,
                keepdim: bool) -> Tensor:
    kind = "poisson" if log_input else "poisson_rate"
    if (weight is None and dim is None and size_average is None and reduce is None
            and (out := _sharded(input, target, None, kind, eps, full, reduction, scale)) is not None):
        return out
    written_out = None
    # at most 8 bytes an element: a smaller step, bound by the host, skips the finer count
    large = (isinstance(input, Tensor) and isinstance(target, Tensor)
             and 8 * (input.numel() + target.numel()) >= POISSON_WRITTEN_OUT_FROM_BYTES)
    # the fused pass takes operands of one shape and dtype, times a number, a mean or sum at every size
    # and reduction='none' from the threshold on (below it the step is bound by the host, where its
    # Python function costs more than PyTorch's operations)
    if large or (reduction in ("mean", "sum") and isinstance(input, Tensor) and isinstance(target, Tensor)):
        fusable = (weight is None and dim is None and size_average is None and reduce is None
                   and reduction in routing.MODES and input.shape == target.shape and input.dtype == target.dtype
                   and (fused_scale := _fused_scale(scale)) is not None)
        if fusable or (not full and large):
            autocast = routing.under_autocast(input, target)
            # the bytes of the operands as computed (autocast's float32 copies), before making any
            computed_bytes = sum(t.numel() * (4 if autocast and t.dtype in routing.SIXTEEN_BIT else t.element_size())
                                 for t in (input, target))
            fusable = fusable and (reduction != "none" or computed_bytes >= POISSON_WRITTEN_OUT_FROM_BYTES)
            if fusable or computed_bytes >= POISSON_WRITTEN_OUT_FROM_BYTES:
                computed = ops.as_computed(input, target, autocast)
                if _written_out_applies(*computed):
                    if fusable and _fused_applies(*computed):
                        return fused_likelihood(*computed, None, kind, eps, full, reduction, fused_scale)
                    if not full and computed_bytes >= POISSON_WRITTEN_OUT_FROM_BYTES:
                        written_out = computed
    if weight is None and scale is None and dim is None and written_out is None:
        if (size_average is None and reduce is None and reduction in routing.MODES
                and not has_torch_function_variadic(input, target)):
            # what torch.nn.functional calls, without its checks, which these are
            return torch.poisson_nll_loss(input, target, log_input, full, eps, routing.REDUCTION_ENUMS[reduction])
        return F.poisson_nll_loss(input, target, log_input=log_input, full=full, size_average=size_average, eps=eps,
                                  reduce=reduce, reduction=reduction)
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not a valid value for reduction")  # PyTorch's words
    if written_out is not None:
        input, target = written_out
        if weight is None and scale is None and dim is None:
            if _fused_applies(input, target):  # legacy arguments' reduction
                return fused_likelihood(input, target, None, kind, eps, False, reduction)
            return PoissonNll.apply(input, target, log_input, eps, reduction)
        per_element = PoissonNll.apply(input, target, log_input, eps, "none")
    else:
        per_element = F.poisson_nll_loss(input, target, log_input=log_input, full=full, eps=eps, reduction="none")
    return reductions.reduce(per_element, reduction, weight, scale, dim, keepdim)


def _check_reduction(reduction: str) -> None:
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not valid")  # PyTorch's words
