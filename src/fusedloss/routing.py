"""Where a loss call goes: fusedloss's kernels, through the operator with its autograd
(or the C++ autograd of a small step), or torch.nn.functional; and the unweighted fused
path, in torch.nn.functional's order of steps."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch.nn import _reduction
from torch.overrides import _get_current_function_mode_stack, has_torch_function_variadic
from torch.utils._device import DeviceContext

from . import build, grad_output_prediction, ops
from .losses import LOSSES, Loss

_reduced_loss_op = torch.ops.fusedloss.reduced_loss.default
_pointwise_loss_op = torch.ops.fusedloss.pointwise_loss.default
_per_sample_loss_op = torch.ops.fusedloss.per_sample_loss.default
_weighted_loss_op = torch.ops.fusedloss.weighted_loss.default


def apply(function: type[torch.autograd.Function], op, differentiable: tuple[Tensor | None, ...], *args):
    """The operator with its autograd (ops.py) where a `differentiable` operand wants a
    gradient, else straight to its kernel. `args` are the Function's: for the reduced
    losses, the operator's with their backward's history slot after output_mask, which
    the operator does not take."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable):
        return ops.call_function(function, *args)
    at = function.history_slot_at
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args) if at is None else op(*args[:at], *args[at + 1:])


def apply_weighted(input: Tensor, target: Tensor, weight: Tensor | None, scale: Tensor | None,
                   divisor: Tensor | None, host_scale: float, loss: str, param: float, output_mask: list[bool],
                   slot: int, expected: float, autocast: bool, kept_dims: int, param_per_element: bool) -> Tensor:
    """The weighted operator's loss with its autograd: where its forward writes no gradient
    and only input and target want one, the C++ autograd's node if it is loaded (a small
    step then runs no Python in its backward); else ops.py's, as ``apply`` gives it."""
    if (not any(output_mask) and torch.is_grad_enabled() and (input.requires_grad or target.requires_grad)
            and build.cxx_autograd_loaded()
            and not any(t is not None and t.requires_grad for t in (weight, scale, divisor))):
        return torch.ops.fusedloss_cxx.weighted_loss.default(input, target, weight, scale, divisor, host_scale, loss,
                                                             param, slot, expected, autocast, kept_dims,
                                                             param_per_element)
    return apply(ops.WeightedLoss, _weighted_loss_op, (input, target, weight, divisor), input, target, weight, scale,
                 divisor, host_scale, loss, param, output_mask, slot, expected, autocast, kept_dims,
                 param_per_element)[0]


KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SIXTEEN_BIT = (torch.float16, torch.bfloat16)
_REDUCTION_NAMES = {0: "none", 1: "mean", 2: "sum"}
REDUCTION_ENUMS = {name: enum for enum, name in _REDUCTION_NAMES.items()}
MODES = ("mean", "sum", "none")
# where autocast may run (torch.is_autocast_enabled raises for others, such as meta)
_AUTOCAST_DEVICES = ("cuda", "cpu", "xpu", "mps")
_NO_GRADIENTS = [False, False]
_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)
# PyTorch's loss operators, for the losses whose steps it serves (pytorch_serves_the_step)
_NATIVE_LOSSES = {row.function: getattr(torch._C._nn, row.function) for row in LOSSES.values()
                  if row.pytorch_serves_steps}
# From operands of this many bytes on (both together), a mean or sum writes its
# gradient in the forward pass, for the grad_output it expects (grad_output_prediction).
# Below, a step is bound by host time, not memory: backward computes the gradient
# from the operands, in as many launches and with no bookkeeping (docs/design.md,
# "Gradients in the forward pass").
FUSED_GRADIENT_FROM_BYTES = 1 << 28


def forward_writes_gradients(input: Tensor, target: Tensor, numel: int, weighted: bool = False) -> bool:
    # A weighted step runs the Python autograd and its weight's work: bound by host time
    # either way below the plain threshold, so from a quarter of it the pass that saves a
    # second read of the operands pays on the device (docs/design.md).
    from_bytes = FUSED_GRADIENT_FROM_BYTES >> 2 if weighted else FUSED_GRADIENT_FROM_BYTES
    # A pair with one float64 operand is computed in float64 and its gradients converted:
    # the converted buffer is not the one backward could correct in place.
    return (numel * (input.element_size() + target.element_size()) >= from_bytes
            and (input.dtype == torch.float64) == (target.dtype == torch.float64))


def pytorch_serves_the_step(row: Loss, mode: str, input: Tensor, target: Tensor, numel: int,
                            weighted: bool = False, learned: bool = False) -> bool:
    """Whether a step (the loss of `numel` elements, wanting gradients) is PyTorch's own:
    its loss, and for a `weighted` step (weight= or scale=) torch operations for the weight
    and scale, each behind a C++ autograd node. Where the fused step's forward writes no
    gradient (below FUSED_GRADIENT_FROM_BYTES, a quarter of it weighted), the step is bound
    by host time, and those nodes cost less of it than fusedloss's Python autograd. A loss
    PyTorch computes with its own forward and backward kernels is PyTorch's there even where
    the C++ autograd is built: its operator, called directly, takes less host time than the
    C++ autograd's (whose operators pass through the stable ABI's boxed calls), and it moves
    no fewer bytes than the fused step (also for reduction='none', at every size). A loss
    it composes from several operations, or a weighted one, moves more, which only the
    steps bound by host time do not feel: the C++ autograd serves those where it is built,
    but for a weight or scale that is `learned` (wants a gradient), which only the Python
    autograd gives."""
    if not row.pytorch_serves_steps:
        return False
    if row.pytorch_kernels and not weighted:
        return mode == "none" or not forward_writes_gradients(input, target, numel)
    if build.cxx_autograd_loaded() and not learned:
        return False
    below = FUSED_GRADIENT_FROM_BYTES >> 2 if weighted else FUSED_GRADIENT_FROM_BYTES
    return numel * (input.element_size() + target.element_size()) < below


def pytorch_serves_the_call(row: Loss, input: object, target: object, reduction: object) -> bool:
    """Whether a call is a step pytorch_serves_the_step hands to PyTorch, found before any
    other routing (functional._loss): plain tensors of one shape wanting gradients,
    outside torch.compile; on a GPU, once the kernels are loaded (their first call loads
    the C++ autograd where it is built, which then serves a composed loss's steps). Such a call goes
    straight to PyTorch's operator, with less host time than torch.nn.functional's own
    (whose checks and broadcast it does not need). The caller has checked that the call
    has no weight, scale, dim or legacy arguments, and a float param in its domain."""
    return (type(input) in _PLAIN_TENSORS and type(target) in _PLAIN_TENSORS
            and (input.requires_grad or target.requires_grad) and torch.is_grad_enabled()
            and reduction in MODES and target.shape == input.shape
            and not has_torch_function_variadic(input, target) and not torch.compiler.is_compiling()
            and (not input.is_cuda or build.kernels_loaded())
            and pytorch_serves_the_step(row, reduction, input, target, input.numel()))


def pytorch_loss(row: Loss, input: Tensor, target: Tensor, reduction: str, param: float) -> Tensor:
    """PyTorch's own loss operator (what torch.nn.functional calls) on operands of one shape."""
    native = _NATIVE_LOSSES[row.function]
    return native(input, target, REDUCTION_ENUMS[reduction], param) if row.param else native(
        input, target, REDUCTION_ENUMS[reduction])


def kernels_apply(input: Tensor, target: Tensor) -> bool:
    return (
        # torch.compile traces torch.nn.functional instead, which inductor can fuse
        # with the ops around the loss (docs/design.md, "torch.compile").
        not torch.compiler.is_compiling()
        and isinstance(input, Tensor)
        and isinstance(target, Tensor)
        and no_torch_function(input, target)
        and input.is_cuda
        and input.dtype in KERNEL_DTYPES
        and target.dtype in KERNEL_DTYPES
        and target.get_device() == input.get_device()
        and not under_a_transform()
        and build.use_kernels()
    )


def no_torch_function(*operands: object) -> bool:
    """No __torch_function__ to honour: no tensor subclass among `operands`, and no torch
    function mode but torch.device's (torch.set_default_device, ``with torch.device(...)``),
    which only places the tensors that factory functions make; fusedloss places its own."""
    if not has_torch_function_variadic(*operands):
        return True
    return (all(type(t) in _PLAIN_TENSORS for t in operands if isinstance(t, Tensor))
            and all(isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack()))


def under_a_transform() -> bool:
    """torch.func transforms (grad, vmap, jvp, jacrev, ...) and forward-mode AD: the fused
    operators have no rules for them, so such calls run PyTorch's formula, which has."""
    return forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()


def warn_if_target_broadcasts(input: Tensor, target: Tensor, row: Loss) -> None:
    """torch.nn.functional's warning, pointed at the user's call, for the losses that give it."""
    if target.shape != input.shape and row.warns_on_broadcast:
        warnings.warn(
            f"Using a target size ({target.size()}) that is different to the input size ({input.size()}). "
            "This will likely lead to incorrect results due to broadcasting. "
            "Please ensure they have the same size.",
            stacklevel=build.user_stacklevel(),
        )


def under_autocast(input: Tensor, target: Tensor, device_type: str = "cuda") -> bool:
    """Autocast runs these losses in float32 (they are on its float32 list) when an operand is 16-bit."""
    return ((input.dtype in SIXTEEN_BIT or target.dtype in SIXTEEN_BIT) and device_type in _AUTOCAST_DEVICES
            and torch.is_autocast_enabled(device_type))


def fused_loss(
    loss: str,
    param: float,
    input: Tensor,
    target: Tensor,
    size_average: bool | None,
    reduce: bool | None,
    reduction: str,
) -> Tensor:
    """The steps of torch.nn.functional's losses, in its order, then one fused op (or
    PyTorch's own loss, where its step is the faster: pytorch_serves_the_step).
    Every call of a small loss pays for this function's work, so it compares shapes once."""
    same_shape = target.shape == input.shape
    row = LOSSES[loss]
    if not same_shape:
        warn_if_target_broadcasts(input, target, row)
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    mode = reduction if reduction in MODES else _REDUCTION_NAMES[_reduction.get_enum(reduction)]
    wants_gradients = (input.requires_grad or target.requires_grad) and torch.is_grad_enabled()
    forward_writes = False
    if wants_gradients:
        numel = input.numel() if same_shape else ops.broadcast_numel(input, target)
        if pytorch_serves_the_step(row, mode, input, target, numel):
            # torch.nn.functional's own call, whose steps (the warning, the reduction's name)
            # this function has taken
            if not same_shape:
                input, target = torch.broadcast_tensors(input, target)
            return pytorch_loss(row, input, target, mode, param)
        forward_writes = mode != "none" and forward_writes_gradients(input, target, numel)
    autocast = under_autocast(input, target)
    if mode == "none":
        if wants_gradients and build.cxx_autograd_loaded():
            return torch.ops.fusedloss_cxx.pointwise_loss.default(input, target, loss, param, autocast)
        return apply(ops.PointwiseLoss, _pointwise_loss_op, (input, target), input, target, loss, param, autocast)
    output_mask, slot, expected = _NO_GRADIENTS, -1, 1.0
    if wants_gradients:
        if forward_writes:
            slot, expected, mispredicted = grad_output_prediction.predict(loss, param, mode, input, target)
            if not mispredicted:
                output_mask = [input.requires_grad, target.requires_grad]
        elif build.cxx_autograd_loaded():  # a step bound by host time: no Python in its backward
            return torch.ops.fusedloss_cxx.reduced_loss.default(input, target, loss, param, mode, autocast)
    return apply(ops.ReducedLoss, _reduced_loss_op, (input, target), input, target, loss, param, mode, output_mask,
                  slot, expected, autocast)[0]


def per_sample_kept_dims(input: Tensor, target: Tensor, dims: tuple[int, ...]) -> int | None:
    """How many leading dimensions a loss reduced over `dims` keeps, where the per-sample
    operator takes it: operands of one shape, `dims` the trailing dimensions, and rows it
    takes (ops.per_sample_rows_fit); else None."""
    shape = input.shape
    kept = len(shape) - len(dims)
    if target.shape != shape or dims != tuple(range(kept, len(shape))) or not ops.per_sample_rows_fit(shape, kept):
        return None
    return kept


def fused_per_sample_loss(loss: str, param: float, input: Tensor, target: Tensor, reduction: str,
                          kept_dims: int) -> Tensor:
    """The loss reduced over every dimension after the first `kept_dims`, in one pass."""
    return apply(ops.PerSampleLoss, _per_sample_loss_op, (input, target), input, target, loss, param, kept_dims,
                 reduction, under_autocast(input, target))
