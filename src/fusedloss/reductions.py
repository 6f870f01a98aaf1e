"""A loss per element reduced as the public functions' ``reduction``, ``weight``,
``scale`` and ``dim`` ask, with torch operations (``functional``'s docstring has the rules)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

# the dimensions a loss is reduced over: one, several, or None for all of them
Dims = int | Sequence[int] | None


def loss_shape(input: Tensor, target: Tensor) -> torch.Size:
    """The shape input and target broadcast to. Equal ranks are worked out here: a small
    step feels torch.broadcast_shapes, which reasons about symbolic sizes; everything else
    (and every error) is its."""
    a, b = input.shape, target.shape
    if a == b:
        return a
    if (len(a) == len(b) and not torch.compiler.is_compiling()
            and all(x == y or x == 1 or y == 1 for x, y in zip(a, b))):
        return torch.Size([y if x == 1 else x for x, y in zip(a, b)])
    return torch.broadcast_shapes(a, b)


def mean_factor(scale: float, count: int) -> float:
    """A mean's factor on a sum of `count` terms: scale / count, NaN for none (0 / 0, as
    PyTorch's mean of nothing)."""
    return scale / count if count else math.nan


def check_weight_broadcasts(weight: Tensor, shape: torch.Size) -> None:
    """Raises unless the weight broadcasts to the loss's shape without widening it."""
    fits = weight.shape == shape or (
        weight.dim() <= len(shape) and all(w in (1, s) for w, s in zip(reversed(weight.shape), reversed(shape))))
    if not fits:
        raise ValueError(f"fusedloss: a weight of shape {tuple(weight.shape)} does not broadcast to the loss's "
                         f"shape {tuple(shape)}")


def check_scale(scale: float | Tensor | None) -> None:
    if isinstance(scale, Tensor):
        if scale.is_complex():
            raise TypeError(f"fusedloss: scale must be a real number or a real 0-d tensor, not a {scale.dtype} tensor")
        if scale.dim() != 0:
            raise ValueError(f"fusedloss: scale is a number or a 0-d tensor, got a tensor of shape "
                             f"{tuple(scale.shape)}")
    elif scale is not None and not isinstance(scale, numbers.Real):
        raise TypeError(f"fusedloss: scale must be a real number or a 0-d tensor, not {type(scale).__name__}")


def as_dims(dim: Dims, ndim: int) -> tuple[int, ...]:
    """``dim`` as sorted non-negative dimensions, with torch's errors for one out of range
    or named twice (a 0-d loss has the one dimension 0, as torch.sum gives it)."""
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims:
        raise ValueError("fusedloss: dim= names no dimension; leave it out to reduce over all of them")
    rank = max(ndim, 1)
    wrapped = []
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool):
            raise TypeError(f"fusedloss: dim must be an int or a sequence of ints, got {type(d).__name__}")
        if not -rank <= d < rank:
            raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, {rank - 1}], but got {d})")
        wrapped.append(d % rank)
    if len(set(wrapped)) != len(wrapped):
        raise RuntimeError(f"dim {wrapped[0]} appears multiple times in the list of dims")
    return tuple(sorted(wrapped)) if ndim else ()


def reduce(per_element: Tensor, reduction: str, weight: Tensor | None, scale: float | Tensor | None,
           dim: Dims = None, keepdim: bool = False, mean_over_count: bool = False) -> Tensor:
    """The loss per element times the weight, summed or averaged over ``dim`` (every
    dimension for None), times the scale. A weighted mean divides by the weight summed as
    if expanded to the loss's shape, or by the count where ``mean_over_count`` (Huber's)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if dim is not None and reduction == "none":
        raise ValueError(f"fusedloss: dim= reduces the loss, so reduction must be 'mean' or 'sum', got {reduction!r}")
    check_scale(scale)
    weight, scale = beside(weight, per_element), beside(scale, per_element)
    shape = per_element.shape
    out = per_element
    if weight is not None:
        check_weight_broadcasts(weight, shape)
        if weight.is_floating_point() and weight.dtype != out.dtype:
            out = out.to(torch.promote_types(out.dtype, weight.dtype))
        out = out * weight
    if reduction != "none":
        dims = tuple(range(len(shape))) if dim is None else as_dims(dim, len(shape))
        # over every dimension, torch's own full reduction: no view around it in a small step
        kept = dim is not None
        if reduction == "mean" and (weight is None or mean_over_count):
            out = out.mean(dims, keepdim=True) if kept else out.mean()  # one rounding, as torch.mean's
        else:
            out = out.sum(dims, keepdim=True) if kept else out.sum()
            if reduction == "mean":
                divisor = expanded_weight_sum(weight, shape, dims, out.dtype).to(out.dtype)
                out = out / (divisor if kept else divisor.reshape(()))
        if kept and not keepdim:  # a reshape, which DTensor shards on every torch (squeeze.dims not)
            out = out.reshape([size for axis, size in enumerate(out.shape) if axis not in dims])
    if scale is None:
        return out
    return out * (scale.to(out.dtype) if isinstance(scale, Tensor) and scale.dtype != out.dtype else scale)


def beside(operand: object, loss: Tensor) -> object:
    """A plain tensor beside a DTensor loss, as a DTensor replicated on its mesh (DTensor
    takes no plain tensor beside its own); anything else as it is."""
    mesh = getattr(loss, "device_mesh", None)
    if mesh is None or not isinstance(operand, Tensor) or hasattr(operand, "device_mesh"):
        return operand
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(operand, mesh, [Replicate()] * mesh.ndim, run_check=False)


def expanded_weight_sum(weight: Tensor, shape: torch.Size, dims: tuple[int, ...], loss_dtype: torch.dtype) -> Tensor:
    """A weighted mean's divisor: the weight as if expanded to `shape`, summed over `dims`
    (kept) without expanding it, its own sum where it spans a dimension times the size
    where it broadcasts along one. Summed as ``weight_sum`` sums it."""
    aligned = weight.reshape((1,) * (len(shape) - weight.dim()) + tuple(weight.shape))
    spanned = tuple([d for d in dims if aligned.shape[d] != 1])  # lists, which torch.compile traces
    dtype = _sum_dtype(weight, loss_dtype)
    # (a sum over no dimension would be torch's sum over all of them)
    summed = aligned.sum(spanned, keepdim=True, dtype=dtype) if spanned else aligned.to(dtype)
    return summed * math.prod([shape[d] for d in dims if aligned.shape[d] == 1])


def weight_sum(weight: Tensor, loss_dtype: torch.dtype) -> Tensor:
    """A weighted mean's divisor, the weight's sum as it lies: below a float64 loss, in
    float32 as PyTorch sums it, which reads a 16- or 32-bit weight where it lies (a float64
    sum would copy it first); a mask of integers is counted exactly."""
    return weight.sum(dtype=_sum_dtype(weight, loss_dtype))


def _sum_dtype(weight: Tensor, loss_dtype: torch.dtype) -> torch.dtype:
    in_float32 = weight.is_floating_point() and loss_dtype != torch.float64
    return torch.float32 if in_float32 else torch.float64
