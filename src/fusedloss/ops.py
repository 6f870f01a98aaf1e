"""The ``fusedloss::`` operators: schemas, fake kernels, autograd and CPU kernels.

The CUDA kernels live in the compiled libraries of ``build.FAMILIES``
(``csrc/plain_ops.cpp``, ``csrc/weighted_ops.cpp``, ``csrc/likelihood_ops.cpp``), which register them on
PyTorch's stable ABI when ``build.load()`` loads them. The schemas are defined
here so that they, the fake kernels and the autograd exist, and can be tested,
without a GPU. Autograd is written once, here, for every device.

``loss`` names a row of ``losses.LOSSES``; ``param`` is beta for ``smooth_l1``
(> 0) and delta for ``huber``. Operands broadcast; gradients come back in the
broadcast shape and autograd sums them to each operand's own shape.

- ``reduced_loss``: mean or sum in one pass over the operands. When
  ``output_mask`` asks for them, the same pass writes d loss / d input and
  d loss / d target times the reduction's factor and ``expected_grad_output``
  (the grad_output that backward is predicted to bring, ``grad_output_prediction``),
  each rounded once; backward hands them on.
- ``reduced_loss_backward_``: backward of those, in place: where grad_output is
  not the one expected (decided on the GPU, which then recomputes them), and
  otherwise nothing to do.
- ``reduced_loss_backward``: the gradients times grad_output in one pass over
  the operands, when the forward wrote none, for a second backward, or for
  gradients the forward was not asked for. Same bits as the forward's for that
  grad_output.
- ``pointwise_loss`` / ``pointwise_loss_backward``: ``reduction='none'``, each
  one pass. ``pointwise_loss_backward_broadcast`` is the backward for a
  grad_output expanded over some dimensions (the backward of a sum over them),
  read where it lies (the weighted family's; the plain one copies it first).
- ``per_sample_loss``: the loss reduced (mean or sum) over every dimension after the
  first ``kept_dims`` in one pass, one value per element of those (``dim=`` over
  trailing dimensions, a per-sample loss); the reduced dimensions' elements must make a
  whole number of 16-byte words in each operand's dtype, and there are at most 65535
  rows. Its backward is ``reduction='none'``'s for grad_output expanded over them.
- ``grad_output_history``: the host-mapped notes in which the backward
  operators record, at ``history_slot`` (-1: nowhere), grad_output and whether
  it was not ``expected_grad_output``, for the next forward to predict from
  (CUDA only; see ``grad_output_prediction``). The forward operators take the
  expectation (their gradients are written for it), not the slot: that is
  autograd's, for the backward (``ReducedLoss`` and ``WeightedLoss`` take it
  among the operator's arguments). ``weighted_grad_output_history``: the
  weighted family's notes.
- ``weighted_loss`` / ``weighted_loss_backward``: ``host_scale * scale / divisor
  * sum_e weight_e * loss_e`` (``scale`` and ``divisor`` one-element tensors read
  on the device, or None), and its gradients, fused into the forward's pass as
  ``reduced_loss``'s are when ``output_mask`` asks (``weighted_loss_backward_``
  corrects them as ``reduced_loss_backward_`` does). ``weight`` broadcasts to the
  operands' shape and is read where it lies. The weight's gradient (the third
  of ``output_mask``) is written per element of the loss, ``host_scale * scale
  / divisor * loss_e``, and only beside input's or target's; autograd sums it to
  the weight's shape, and gives the divisor ``-out / divisor``. With
  ``weight_kept_dims`` (>= 0; the weight is 1 along every later dimension, whose
  elements make a multiple of ``ROW_TILING_MULTIPLE``), the reduction's tiles lie
  within rows, and that output is instead the loss's sum over each row (float64, the kept
  dimensions' shape, in any pass), from which backward gives the weight's
  gradient. ``scale`` takes no gradient (``weighted`` computes that case with
  torch operations). With ``param_per_element``, ``weight`` is instead each element's
  param (quantiles, pseudo-Huber's ``c``: the losses whose param may be a tensor),
  read where it lies and multiplying nothing; it takes no gradient and no
  ``weight_kept_dims``.
- ``weighted_loss_gradients``: weighted_loss's gradients as a composite of
  torch operations, for ``create_graph=True`` and for a weight's gradient
  wanted alone.
- ``loss_gradients``: the same gradients as a composite of torch operations,
  which autograd can differentiate again (``create_graph=True``).
- ``likelihood_loss``: the Gaussian (``kind='gaussian'``, with ``var``) or Poisson
  (``'poisson'`` of a log rate, ``'poisson_rate'`` of a rate) negative log-likelihood's
  mean or sum times ``scale``, of operands of one dtype and shape, ``full`` as PyTorch's
  (the Poisson loss's Stirling term included), in one pass that also writes the
  gradients ``output_mask`` asks for (input, target, var) for ``expected_grad_output``;
  ``likelihood_loss_backward_`` recomputes them in place where grad_output is another
  (decided on the GPU), ``likelihood_loss_backward`` computes them where the forward
  wrote none; both note grad_output in ``likelihood_grad_output_history``. Their
  autograd is ``likelihood.FusedLikelihood`` (or the C++ autograd's node), and their CPU
  kernels (the CUDA kernels' math, for tests and DTensor ranks on the CPU) are there too.
  ``likelihood_pointwise`` / ``likelihood_pointwise_backward``: ``reduction='none'``'s
  loss per element times ``scale``, and its gradients for a grad_output of the loss's shape,
  each one pass. ``likelihood_gradients``: their gradients as PyTorch's formula gives them,
  which autograd can differentiate again (``create_graph=True``).

With ``autocast``, the losses compute what CUDA autocast computes: 16-bit
operands as float32 (these losses are on its float32 list), a float32 loss,
and gradients in the operands' own dtypes. On CUDA the kernels read the
16-bit operands as they are.

"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd import forward_ad

from . import build, formulas
from .losses import LOSSES

_lib = torch.library.Library("fusedloss", "DEF")
_lib.define("pointwise_loss(Tensor input, Tensor target, str loss, float param, bool autocast=False) -> Tensor")
_lib.define(
    "pointwise_loss_backward(Tensor grad_output, Tensor input, Tensor target, str loss, float param, "
    "bool[2] output_mask, bool autocast=False) -> (Tensor, Tensor)"
)
_lib.define(
    "reduced_loss(Tensor input, Tensor target, str loss, float param, str reduction, bool[2] output_mask, "
    "float expected_grad_output=1.0, bool autocast=False) -> (Tensor, Tensor, Tensor)"
)
_lib.define(
    "reduced_loss_backward(Tensor grad_output, Tensor input, Tensor target, str loss, float param, str reduction, "
    "bool[2] output_mask, int history_slot=-1, float expected_grad_output=1.0, bool autocast=False) "
    "-> (Tensor, Tensor)"
)
_lib.define(
    "reduced_loss_backward_(Tensor(a!) grad_input, Tensor(b!) grad_target, Tensor grad_output, Tensor input, "
    "Tensor target, str loss, float param, str reduction, float expected_grad_output, int history_slot=-1, "
    "bool autocast=False) -> ()"
)
_lib.define(
    "loss_gradients(Tensor grad_output, Tensor input, Tensor target, str loss, float param, str reduction, "
    "bool autocast=False) -> (Tensor, Tensor)"
)
_lib.define(
    "weighted_loss(Tensor input, Tensor target, Tensor? weight, Tensor? scale, Tensor? divisor, float host_scale, "
    "str loss, float param, bool[3] output_mask, float expected_grad_output=1.0, bool autocast=False, "
    "int weight_kept_dims=-1, bool param_per_element=False) -> (Tensor, Tensor, Tensor, Tensor)"
)
_lib.define(
    "weighted_loss_backward(Tensor grad_output, Tensor input, Tensor target, Tensor? weight, Tensor? scale, "
    "Tensor? divisor, float host_scale, str loss, float param, bool[3] output_mask, int history_slot=-1, "
    "float expected_grad_output=1.0, bool autocast=False, bool param_per_element=False) -> (Tensor, Tensor, Tensor)"
)
_lib.define(
    "weighted_loss_backward_(Tensor(a!) grad_input, Tensor(b!) grad_target, Tensor(c!) grad_weight, "
    "Tensor grad_output, Tensor input, Tensor target, Tensor? weight, Tensor? scale, Tensor? divisor, "
    "float host_scale, str loss, float param, float expected_grad_output, int history_slot=-1, "
    "bool autocast=False, bool param_per_element=False) -> ()"
)
_lib.define(
    "weighted_loss_gradients(Tensor grad_output, Tensor input, Tensor target, Tensor? weight, Tensor? scale, "
    "Tensor? divisor, float host_scale, str loss, float param, bool autocast=False, "
    "bool param_per_element=False) -> (Tensor, Tensor, Tensor)"
)
_lib.define(
    "pointwise_loss_backward_broadcast(Tensor grad_output, Tensor input, Tensor target, str loss, float param, "
    "bool[2] output_mask, bool autocast=False) -> (Tensor, Tensor)"
)
_lib.define(
    "per_sample_loss(Tensor input, Tensor target, str loss, float param, int kept_dims, str reduction, "
    "bool autocast=False) -> Tensor"
)
_lib.define("grad_output_history() -> Tensor")
_lib.define("weighted_grad_output_history() -> Tensor")
_lib.define(
    "likelihood_loss(Tensor input, Tensor target, Tensor? var, str kind, float eps, bool full, str reduction, "
    "bool[3] output_mask, float expected_grad_output=1.0, float scale=1.0) -> (Tensor, Tensor, Tensor, Tensor)"
)
_lib.define(
    "likelihood_loss_backward(Tensor grad_output, Tensor input, Tensor target, Tensor? var, str kind, float eps, "
    "bool full, str reduction, bool[3] output_mask, int history_slot=-1, float expected_grad_output=1.0, "
    "float scale=1.0) -> (Tensor, Tensor, Tensor)"
)
_lib.define(
    "likelihood_loss_backward_(Tensor(a!) grad_input, Tensor(b!) grad_target, Tensor(c!) grad_var, "
    "Tensor grad_output, Tensor input, Tensor target, Tensor? var, str kind, float eps, bool full, str reduction, "
    "float expected_grad_output=1.0, int history_slot=-1, float scale=1.0) -> ()"
)
_lib.define(
    "likelihood_pointwise(Tensor input, Tensor target, Tensor? var, str kind, float eps, bool full, "
    "float scale=1.0) -> Tensor"
)
_lib.define(
    "likelihood_pointwise_backward(Tensor grad_output, Tensor input, Tensor target, Tensor? var, str kind, "
    "float eps, bool full, bool[3] output_mask, float scale=1.0) -> (Tensor, Tensor, Tensor)"
)
_lib.define("likelihood_grad_output_history() -> Tensor")
_lib.define(
    "likelihood_gradients(Tensor grad_output, Tensor input, Tensor target, Tensor? var, str kind, float eps, "
    "bool full, str reduction, bool[3] output_mask, float scale=1.0) -> (Tensor, Tensor, Tensor)"
)


def _grad_buffer(wanted: bool, like: Tensor, shape: Sequence[int]) -> Tensor:
    return like.new_empty(shape) if wanted else like.new_empty((0,))


def as_autocast_would(operand: Tensor) -> Tensor:
    """The operand as CUDA autocast hands it to these losses: float32 if 16-bit."""
    return operand.float() if operand.dtype in (torch.float16, torch.bfloat16) else operand


def as_computed(input: Tensor, target: Tensor, autocast: bool) -> tuple[Tensor, Tensor]:
    """The operands the loss is computed from: as autocast hands them over with `autocast`."""
    return (as_autocast_would(input), as_autocast_would(target)) if autocast else (input, target)


def _loss_dtype(input: Tensor, target: Tensor, loss: str, autocast: bool = False) -> torch.dtype:
    input, target = as_computed(input, target, autocast)
    return formulas.loss_dtype(input.dtype, target.dtype, loss)


def broadcast_numel(input: Tensor, target: Tensor) -> int:
    shape = torch.broadcast_shapes(input.shape, target.shape)
    numel = 1
    for size in shape:
        numel *= size
    return numel


# ---- fake kernels (shapes and dtypes for torch.compile) ----------------------


def _load_kernels_for(device: torch.device, family: str = "plain") -> None:
    # A compiled graph calls the CUDA kernels without passing through
    # fusedloss.functional, so tracing one makes sure they are loaded.
    if device.type == "cuda":
        build.load(family)


@torch.library.register_fake("fusedloss::pointwise_loss")
def _pointwise_loss_fake(input: Tensor, target: Tensor, loss: str, param: float, autocast: bool = False) -> Tensor:
    _load_kernels_for(input.device)
    shape = torch.broadcast_shapes(input.shape, target.shape)
    return input.new_empty(shape, dtype=_loss_dtype(input, target, loss, autocast))


@torch.library.register_fake("fusedloss::pointwise_loss_backward")
def _pointwise_loss_backward_fake(
    grad_output: Tensor, input: Tensor, target: Tensor, loss: str, param: float, output_mask: Sequence[bool],
    autocast: bool = False,
) -> tuple[Tensor, Tensor]:
    _load_kernels_for(input.device)
    shape = torch.broadcast_shapes(input.shape, target.shape)
    return _grad_buffer(output_mask[0], input, shape), _grad_buffer(output_mask[1], target, shape)


@torch.library.register_fake("fusedloss::pointwise_loss_backward_broadcast")
def _pointwise_loss_backward_broadcast_fake(
    grad_output: Tensor, input: Tensor, target: Tensor, loss: str, param: float, output_mask: Sequence[bool],
    autocast: bool = False,
) -> tuple[Tensor, Tensor]:
    _load_kernels_for(input.device, "weighted")
    shape = torch.broadcast_shapes(input.shape, target.shape)
    return _grad_buffer(output_mask[0], input, shape), _grad_buffer(output_mask[1], target, shape)


@torch.library.register_fake("fusedloss::reduced_loss")
def _reduced_loss_fake(
    input: Tensor, target: Tensor, loss: str, param: float, reduction: str, output_mask: Sequence[bool],
    expected_grad_output: float = 1.0, autocast: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    _load_kernels_for(input.device)
    shape = torch.broadcast_shapes(input.shape, target.shape)
    out = input.new_empty((), dtype=_loss_dtype(input, target, loss, autocast))
    return out, _grad_buffer(output_mask[0], input, shape), _grad_buffer(output_mask[1], target, shape)


@torch.library.register_fake("fusedloss::reduced_loss_backward")
def _reduced_loss_backward_fake(
    grad_output: Tensor, input: Tensor, target: Tensor, loss: str, param: float, reduction: str,
    output_mask: Sequence[bool], history_slot: int = -1, expected_grad_output: float = 1.0, autocast: bool = False,
) -> tuple[Tensor, Tensor]:
    _load_kernels_for(input.device)
    shape = torch.broadcast_shapes(input.shape, target.shape)
    return _grad_buffer(output_mask[0], input, shape), _grad_buffer(output_mask[1], target, shape)


@torch.library.register_fake("fusedloss::per_sample_loss")
def _per_sample_loss_fake(input: Tensor, target: Tensor, loss: str, param: float, kept_dims: int, reduction: str,
                          autocast: bool = False) -> Tensor:
    _load_kernels_for(input.device)
    shape = torch.broadcast_shapes(input.shape, target.shape)
    return input.new_empty(shape[:kept_dims], dtype=_loss_dtype(input, target, loss, autocast))


@torch.library.register_fake("fusedloss::reduced_loss_backward_")
def _reduced_loss_backward_in_place_fake(
    grad_input: Tensor, grad_target: Tensor, grad_output: Tensor, input: Tensor, target: Tensor, loss: str,
    param: float, reduction: str, expected_grad_output: float, history_slot: int = -1, autocast: bool = False,
) -> None:
    _load_kernels_for(input.device)


def _check_weighted_mask(output_mask: Sequence[bool]) -> None:
    if output_mask[2] and not (output_mask[0] or output_mask[1]):
        raise RuntimeError("fusedloss: weighted_loss writes the weight's gradient only with input's or target's")


def _weighted_grad_buffers(input: Tensor, target: Tensor, loss: str, output_mask: Sequence[bool],
                           autocast: bool) -> tuple[Tensor, Tensor, Tensor]:
    """weighted_loss's gradient outputs: the operands' dtypes, and the loss's for the weight's."""
    _check_weighted_mask(output_mask)
    shape = torch.broadcast_shapes(input.shape, target.shape)
    loss_like = input.new_empty((0,), dtype=_loss_dtype(input, target, loss, autocast))
    return (_grad_buffer(output_mask[0], input, shape), _grad_buffer(output_mask[1], target, shape),
            _grad_buffer(output_mask[2], loss_like, shape))


def _row_sums_buffer(wanted: bool, input: Tensor, target: Tensor, kept_dims: int) -> Tensor:
    shape = torch.broadcast_shapes(input.shape, target.shape)
    return input.new_empty(shape[:kept_dims] if wanted else (0,), dtype=torch.float64)


@torch.library.register_fake("fusedloss::weighted_loss")
def _weighted_loss_fake(
    input: Tensor, target: Tensor, weight: Tensor | None, scale: Tensor | None, divisor: Tensor | None,
    host_scale: float, loss: str, param: float, output_mask: Sequence[bool], expected_grad_output: float = 1.0,
    autocast: bool = False, weight_kept_dims: int = -1, param_per_element: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _load_kernels_for(input.device, "weighted")
    out = input.new_empty((), dtype=_loss_dtype(input, target, loss, autocast))
    if weight_kept_dims < 0:
        return out, *_weighted_grad_buffers(input, target, loss, output_mask, autocast)
    grad_input, grad_target, _ = _weighted_grad_buffers(input, target, loss, [*output_mask[:2], False], autocast)
    return out, grad_input, grad_target, _row_sums_buffer(output_mask[2], input, target, weight_kept_dims)


@torch.library.register_fake("fusedloss::weighted_loss_backward")
def _weighted_loss_backward_fake(
    grad_output: Tensor, input: Tensor, target: Tensor, weight: Tensor | None, scale: Tensor | None,
    divisor: Tensor | None, host_scale: float, loss: str, param: float, output_mask: Sequence[bool],
    history_slot: int = -1, expected_grad_output: float = 1.0, autocast: bool = False,
    param_per_element: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    _load_kernels_for(input.device, "weighted")
    return _weighted_grad_buffers(input, target, loss, output_mask, autocast)


@torch.library.register_fake("fusedloss::weighted_loss_backward_")
def _weighted_loss_backward_in_place_fake(
    grad_input: Tensor, grad_target: Tensor, grad_weight: Tensor, grad_output: Tensor, input: Tensor,
    target: Tensor, weight: Tensor | None, scale: Tensor | None, divisor: Tensor | None, host_scale: float,
    loss: str, param: float, expected_grad_output: float, history_slot: int = -1, autocast: bool = False,
    param_per_element: bool = False,
) -> None:
    _load_kernels_for(input.device, "weighted")


@torch.library.register_fake("fusedloss::likelihood_loss")
def _likelihood_loss_fake(
    input: Tensor, target: Tensor, var: Tensor | None, kind: str, eps: float, full: bool, reduction: str,
    output_mask: Sequence[bool], expected_grad_output: float = 1.0, scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _load_kernels_for(input.device, "likelihood")
    return input.new_empty(()), *(_grad_buffer(wanted, input, input.shape) for wanted in output_mask)


@torch.library.register_fake("fusedloss::likelihood_loss_backward")
def _likelihood_loss_backward_fake(
    grad_output: Tensor, input: Tensor, target: Tensor, var: Tensor | None, kind: str, eps: float, full: bool,
    reduction: str, output_mask: Sequence[bool], history_slot: int = -1, expected_grad_output: float = 1.0,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    _load_kernels_for(input.device, "likelihood")
    return tuple(_grad_buffer(wanted, input, input.shape) for wanted in output_mask)


@torch.library.register_fake("fusedloss::likelihood_pointwise")
def _likelihood_pointwise_fake(input: Tensor, target: Tensor, var: Tensor | None, kind: str, eps: float, full: bool,
                               scale: float = 1.0) -> Tensor:
    _load_kernels_for(input.device, "likelihood")
    return input.new_empty(input.shape)


@torch.library.register_fake("fusedloss::likelihood_pointwise_backward")
def _likelihood_pointwise_backward_fake(
    grad_output: Tensor, input: Tensor, target: Tensor, var: Tensor | None, kind: str, eps: float, full: bool,
    output_mask: Sequence[bool], scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    _load_kernels_for(input.device, "likelihood")
    return tuple(_grad_buffer(wanted, input, input.shape) for wanted in output_mask)


@torch.library.register_fake("fusedloss::likelihood_loss_backward_")
def _likelihood_loss_backward_in_place_fake(
    grad_input: Tensor, grad_target: Tensor, grad_var: Tensor, grad_output: Tensor, input: Tensor, target: Tensor,
    var: Tensor | None, kind: str, eps: float, full: bool, reduction: str, expected_grad_output: float = 1.0,
    history_slot: int = -1, scale: float = 1.0,
) -> None:
    _load_kernels_for(input.device, "likelihood")


# ---- CPU kernels: the torch formulas --------------------------------------------


@torch.library.impl(_lib, "pointwise_loss", "CPU")
def _pointwise_loss_cpu(input: Tensor, target: Tensor, loss: str, param: float, autocast: bool = False) -> Tensor:
    return formulas.torch_loss(*as_computed(input, target, autocast), loss, param, "none")


def _gradients_cpu(
    grad_output: Tensor | float, input: Tensor, target: Tensor, loss: str, param: float, output_mask: Sequence[bool],
    autocast: bool = False,
) -> tuple[Tensor, Tensor]:
    grad = formulas.loss_grad(*as_computed(input, target, autocast), loss, param, grad_output)
    grad_input = grad.to(input.dtype) if output_mask[0] else _grad_buffer(False, input, grad.shape)
    grad_target = (-grad).to(target.dtype) if output_mask[1] else _grad_buffer(False, target, grad.shape)
    return grad_input, grad_target


@torch.library.impl(_lib, "pointwise_loss_backward_broadcast", "CPU")
@torch.library.impl(_lib, "pointwise_loss_backward", "CPU")
def _pointwise_loss_backward_cpu(
    grad_output: Tensor, input: Tensor, target: Tensor, loss: str, param: float, output_mask: Sequence[bool],
    autocast: bool = False,
) -> tuple[Tensor, Tensor]:
    return _gradients_cpu(grad_output, input, target, loss, param, output_mask, autocast)


def _reduction_scale(reduction: str, input: Tensor, target: Tensor) -> float:
    numel = broadcast_numel(input, target)
    return 1.0 / numel if reduction == "mean" and numel > 0 else 1.0


def _reduced_factor(grad_output: Tensor | float, reduction: str, input: Tensor, target: Tensor) -> Tensor:
    """grad_output times 1/N (mean) or 1 (sum), as a 0-d float64 tensor: a factor that the
    gradient takes before its one rounding."""
    factor = torch.as_tensor(grad_output, dtype=torch.float64).reshape(())
    return factor * _reduction_scale(reduction, input, target)


@torch.library.impl(_lib, "reduced_loss", "CPU")
def _reduced_loss_cpu(
    input: Tensor, target: Tensor, loss: str, param: float, reduction: str, output_mask: Sequence[bool],
    expected_grad_output: float = 1.0, autocast: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    out = formulas.torch_loss(*as_computed(input, target, autocast), loss, param, reduction)
    factor = _reduced_factor(expected_grad_output, reduction, input, target)
    return (out, *_gradients_cpu(factor, input, target, loss, param, output_mask, autocast))


@torch.library.impl(_lib, "reduced_loss_backward", "CPU")
def _reduced_loss_backward_cpu(
    grad_output: Tensor, input: Tensor, target: Tensor, loss: str, param: float, reduction: str,
    output_mask: Sequence[bool], history_slot: int = -1, expected_grad_output: float = 1.0, autocast: bool = False,
) -> tuple[Tensor, Tensor]:
    factor = _reduced_factor(grad_output, reduction, input, target)
    return _gradients_cpu(factor, input, target, loss, param, output_mask, autocast)


@torch.library.impl(_lib, "per_sample_loss", "CPU")
def _per_sample_loss_cpu(input: Tensor, target: Tensor, loss: str, param: float, kept_dims: int, reduction: str,
                         autocast: bool = False, sum_dtype: torch.dtype | None = None) -> Tensor:
    """`sum_dtype`: the dtype the loss is summed in (default: its own)."""
    per_element = formulas.torch_loss(*as_computed(input, target, autocast), loss, param, "none")
    if sum_dtype is not None:
        per_element = per_element.to(sum_dtype)
    dims = tuple(range(kept_dims, per_element.dim()))
    if not dims:  # a sum over no dimension would be torch's sum over all of them
        return per_element
    return per_element.mean(dims) if reduction == "mean" else per_element.sum(dims)


def _overwrite(buffers: Sequence[Tensor], gradients: Sequence[Tensor]) -> None:
    for buffer, gradient in zip(buffers, gradients):
        if buffer.numel():
            buffer.copy_(gradient)


@torch.library.impl(_lib, "reduced_loss_backward_", "CPU")
def _reduced_loss_backward_in_place_cpu(
    grad_input: Tensor, grad_target: Tensor, grad_output: Tensor, input: Tensor, target: Tensor, loss: str,
    param: float, reduction: str, expected_grad_output: float, history_slot: int = -1, autocast: bool = False,
) -> None:
    # Recomputed whatever grad_output is: the host knows it here.
    mask = [grad_input.numel() > 0, grad_target.numel() > 0]
    _overwrite((grad_input, grad_target),
               _reduced_loss_backward_cpu(grad_output, input, target, loss, param, reduction, mask, -1,
                                          expected_grad_output, autocast))


def weighted_factor(scale: Tensor | None, divisor: Tensor | None, host_scale: float) -> Tensor | float:
    """host_scale * scale / divisor, in float64: the weighted reductions' multiplier."""
    factor: Tensor | float = host_scale
    if scale is not None:
        factor = scale.reshape(()).double() * factor
    if divisor is not None:
        factor = factor / divisor.reshape(()).double()
    return factor


@torch.library.impl(_lib, "weighted_loss_gradients", "CompositeImplicitAutograd")
def weighted_gradients(
    grad_output: Tensor | float, input: Tensor, target: Tensor, weight: Tensor | None, scale: Tensor | None,
    divisor: Tensor | None, host_scale: float, loss: str, param: float, autocast: bool = False,
    param_per_element: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """d loss / d input, d loss / d target and d loss / d weight (per element, for a fixed
    divisor) of weighted_loss times grad_output, in the broadcast shape, with torch
    operations (differentiable: create_graph=True). The weight's is empty without a weight,
    and where the weight is the param."""
    operands = as_computed(input, target, autocast)
    factor = weighted_factor(scale, divisor, host_scale) * torch.as_tensor(grad_output, dtype=torch.float64)
    if param_per_element:
        param, weight, per_element = LOSSES[loss].nan_outside_domain(weight).to(torch.float64), None, factor
    else:
        per_element = factor if weight is None else weight.to(torch.float64) * factor
    # Every factor applied before the one rounding into each gradient's dtype.
    grad = formulas.loss_grad(*operands, loss, param, per_element)
    loss_dtype = _loss_dtype(input, target, loss, autocast)
    if weight is None:
        grad_weight = input.new_empty((0,), dtype=loss_dtype)
    else:
        values = formulas.torch_loss(*operands, loss, param, "none").to(torch.float64)
        grad_weight = (values * factor).to(loss_dtype)
    return grad.to(input.dtype), (-grad).to(target.dtype), grad_weight


def _weighted_sum(input: Tensor, target: Tensor, weight: Tensor | None, scale: Tensor | None,
                  divisor: Tensor | None, host_scale: float, loss: str, param: float, autocast: bool,
                  param_per_element: bool) -> Tensor:
    operands = as_computed(input, target, autocast)
    if param_per_element:
        param, weight = LOSSES[loss].nan_outside_domain(weight), None  # as the kernels read it
    per_element = formulas.torch_loss(*operands, loss, param, "none").to(torch.float64)
    if weight is not None:
        per_element = per_element * weight.to(torch.float64)
    return (per_element.sum() * weighted_factor(scale, divisor, host_scale)).to(_loss_dtype(input, target, loss,
                                                                                             autocast))


def _check_param_per_element(param_per_element: bool, loss: str, weight: Tensor | None,
                             output_mask: Sequence[bool], weight_kept_dims: int = -1) -> None:
    """As the CUDA operator checks param_per_element: a param tensor for a loss whose param
    may be one, which takes no gradient and no weight_kept_dims."""
    if not param_per_element:
        return
    if weight is None or not LOSSES[loss].takes_param_tensor:
        raise RuntimeError(f"fusedloss: param_per_element needs a weight and a loss whose param may be a tensor, "
                           f"not {loss}")
    if output_mask[2] or weight_kept_dims >= 0:
        raise RuntimeError("fusedloss: a param per element takes no gradient and no weight_kept_dims")


def _masked(gradients: tuple[Tensor, Tensor, Tensor], output_mask: Sequence[bool]) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(g if wanted else _grad_buffer(False, g, g.shape) for g, wanted in zip(gradients, output_mask))


def _check_weight_kept_dims(input: Tensor, target: Tensor, weight: Tensor | None, kept_dims: int) -> None:
    """As the CUDA operator checks weight_kept_dims: rows of a multiple of
    ROW_TILING_MULTIPLE elements, along which the weight is 1."""
    shape = torch.broadcast_shapes(input.shape, target.shape)
    if kept_dims > len(shape):
        raise RuntimeError("fusedloss: weight_kept_dims exceeds the loss's dimensions")
    if math.prod(shape[kept_dims:]) % ROW_TILING_MULTIPLE:
        raise RuntimeError(f"fusedloss: weight_kept_dims leaves rows of {math.prod(shape[kept_dims:])} elements; "
                           f"it takes rows of a multiple of {ROW_TILING_MULTIPLE}")
    offset = len(shape) - (0 if weight is None else weight.dim())
    if weight is not None and any(weight.shape[d - offset] != 1 for d in range(max(kept_dims, offset), len(shape))):
        raise RuntimeError("fusedloss: weight_kept_dims needs a weight of size 1 along every later dimension")


def loss_row_sums(input: Tensor, target: Tensor, loss: str, param: float, kept_dims: int,
                  autocast: bool = False) -> Tensor:
    """The loss summed over every dimension after the first `kept_dims`, in float64."""
    return _per_sample_loss_cpu(input, target, loss, param, kept_dims, "sum", autocast, torch.float64)


@torch.library.impl(_lib, "weighted_loss", "CPU")
def _weighted_loss_cpu(
    input: Tensor, target: Tensor, weight: Tensor | None, scale: Tensor | None, divisor: Tensor | None,
    host_scale: float, loss: str, param: float, output_mask: Sequence[bool], expected_grad_output: float = 1.0,
    autocast: bool = False, weight_kept_dims: int = -1, param_per_element: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_param_per_element(param_per_element, loss, weight, output_mask, weight_kept_dims)
    row_sums = weight_kept_dims >= 0
    if row_sums:
        _check_weight_kept_dims(input, target, weight, weight_kept_dims)
    operand_mask = [*output_mask[:2], output_mask[2] and not row_sums]
    _check_weighted_mask(operand_mask)
    out = _weighted_sum(input, target, weight, scale, divisor, host_scale, loss, param, autocast, param_per_element)
    gradients = weighted_gradients(expected_grad_output, input, target, weight, scale, divisor, host_scale, loss,
                                   param, autocast, param_per_element)
    grad_input, grad_target, grad_weight = _masked(gradients, operand_mask)
    if row_sums:
        grad_weight = (loss_row_sums(input, target, loss, param, weight_kept_dims, autocast) if output_mask[2]
                       else _row_sums_buffer(False, input, target, weight_kept_dims))
    return out, grad_input, grad_target, grad_weight


@torch.library.impl(_lib, "weighted_loss_backward", "CPU")
def _weighted_loss_backward_cpu(
    grad_output: Tensor, input: Tensor, target: Tensor, weight: Tensor | None, scale: Tensor | None,
    divisor: Tensor | None, host_scale: float, loss: str, param: float, output_mask: Sequence[bool],
    history_slot: int = -1, expected_grad_output: float = 1.0, autocast: bool = False,
    param_per_element: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_param_per_element(param_per_element, loss, weight, output_mask)
    _check_weighted_mask(output_mask)
    gradients = weighted_gradients(grad_output, input, target, weight, scale, divisor, host_scale, loss, param,
                                   autocast, param_per_element)
    return _masked(gradients, output_mask)


@torch.library.impl(_lib, "weighted_loss_backward_", "CPU")
def _weighted_loss_backward_in_place_cpu(
    grad_input: Tensor, grad_target: Tensor, grad_weight: Tensor, grad_output: Tensor, input: Tensor,
    target: Tensor, weight: Tensor | None, scale: Tensor | None, divisor: Tensor | None, host_scale: float,
    loss: str, param: float, expected_grad_output: float, history_slot: int = -1, autocast: bool = False,
    param_per_element: bool = False,
) -> None:
    _check_param_per_element(param_per_element, loss, weight, [False, False, grad_weight.numel() > 0])
    _overwrite((grad_input, grad_target, grad_weight),
               weighted_gradients(grad_output, input, target, weight, scale, divisor, host_scale, loss, param,
                                  autocast, param_per_element))


# ---- autograd ------------------------------------------------------------------


def _sum_to(grad: Tensor | None, operand: Tensor) -> Tensor | None:
    if grad is None or grad.shape == operand.shape:
        return grad
    return grad.sum_to_size(operand.shape)


# The most rows per_sample_loss takes (its grid's second dimension).
PER_SAMPLE_MAX_ROWS = 65535


def per_sample_rows_fit(shape: Sequence[int], kept_dims: int) -> bool:
    """Whether per_sample_loss takes a loss of `shape` reduced over every dimension after the
    first `kept_dims`: at most PER_SAMPLE_MAX_ROWS rows, each a multiple of 8 elements long
    (so that every row starts on a 16-byte boundary in any dtype)."""
    return math.prod(shape[:kept_dims]) <= PER_SAMPLE_MAX_ROWS and math.prod(shape[kept_dims:]) % 8 == 0


def weight_gradient_rows(weight: Tensor | None, input: Tensor, target: Tensor) -> int | None:
    """For a weight that spans only leading dimensions of the loss (one per sample, per
    channel), the count of them that its gradient keeps: per_sample_loss then sums the loss
    over the rest in one pass, where the weighted kernels would write the weight's gradient
    per element for autograd to sum. None where that does not apply (a weight of the
    loss's own size, operands that broadcast, rows per_sample_loss does not take)."""
    if weight is None or input.shape != target.shape:
        return None
    shape = input.shape
    aligned = (1,) * (len(shape) - weight.dim()) + tuple(weight.shape)
    spanned = [d for d, size in enumerate(aligned) if size != 1]
    kept = spanned[-1] + 1 if spanned else 0
    return kept if kept < len(shape) and per_sample_rows_fit(shape, kept) else None


# weighted_loss's weight_kept_dims takes rows of a multiple of this many elements, a
# multiple of every weighted reduction's tile (csrc/launch.h's kRowTilingMultiple).
ROW_TILING_MULTIPLE = 8192


def weight_row_tiling(weight: Tensor | None, input: Tensor, target: Tensor) -> int:
    """weighted_loss's weight_kept_dims for a weight over leading dimensions
    (weight_gradient_rows) whose rows are a multiple of ROW_TILING_MULTIPLE elements long,
    else -1. It depends on the shapes alone, so a loss has the same bits whichever
    gradients are asked for."""
    kept = weight_gradient_rows(weight, input, target)
    if kept is None or math.prod(input.shape[kept:]) % ROW_TILING_MULTIPLE:
        return -1
    return kept


@torch.library.impl(_lib, "loss_gradients", "CompositeImplicitAutograd")
def _loss_gradients_composite(
    grad_output: Tensor, input: Tensor, target: Tensor, loss: str, param: float, reduction: str,
    autocast: bool = False,
) -> tuple[Tensor, Tensor]:
    """d loss / d input and d loss / d target for grad_output (one value for a mean or
    sum, one per element for 'none'), summed to each operand's shape."""
    shape = torch.broadcast_shapes(input.shape, target.shape)
    if reduction != "none":
        if reduction == "mean":  # in at least fp32: rounding 1/N into bf16 would bias the gradient
            grad_output = grad_output.to(torch.promote_types(grad_output.dtype, torch.float32))
            grad_output = grad_output / broadcast_numel(input, target)
        grad_output = grad_output.expand(shape)
    operands = as_computed(input, target, autocast)
    grad = formulas.loss_grad(*operands, loss, param, grad_output)
    return _sum_to(grad.to(input.dtype), input), _sum_to((-grad).to(target.dtype), target)


def _pointwise_setup_context(ctx, inputs, output) -> None:
    input, target, (ctx.loss, ctx.param, ctx.autocast) = inputs
    ctx.save_for_backward(input, target)


def _expanded(grad: Tensor) -> bool:
    """Whether grad is expanded over some of its dimensions, not all (the backward of a sum
    over those): the weighted family's kernel reads such a grad_output where it lies."""
    strides = grad.stride()
    expanded = [stride == 0 and size > 1 for stride, size in zip(strides, grad.shape)]
    return any(expanded) and not all(stride == 0 for stride in strides)


def _pointwise_backward(ctx, grad: Tensor):
    input, target = ctx.saved_tensors
    return (*_pointwise_gradients(ctx, grad, input, target), None)


def _pointwise_gradients(ctx, grad: Tensor, input: Tensor, target: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """reduction='none''s gradients for `grad` of the loss's shape (an expanded one read
    where it lies), each summed to its operand's shape; None where not wanted."""
    needs = ctx.needs_input_grad[:2]
    if torch.is_grad_enabled():
        grad_input, grad_target = torch.ops.fusedloss.loss_gradients.default(grad, input, target, ctx.loss, ctx.param,
                                                                             "none", ctx.autocast)
    else:
        op = torch.ops.fusedloss.pointwise_loss_backward.default
        if grad.is_cuda and type(grad) is Tensor and _expanded(grad) and build.use_kernels("weighted"):
            op = torch.ops.fusedloss.pointwise_loss_backward_broadcast.default
        with torch._C._AutoDispatchBelowAutograd():  # these operators have no autograd of their own
            grad_input, grad_target = op(grad, input, target, ctx.loss, ctx.param, [bool(needs[0]), bool(needs[1])],
                                         ctx.autocast)
    return _sum_to(grad_input, input) if needs[0] else None, _sum_to(grad_target, target) if needs[1] else None


def _per_sample_setup_context(ctx, inputs, output) -> None:
    input, target, (ctx.loss, ctx.param, ctx.kept_dims, ctx.reduction, ctx.autocast) = inputs
    ctx.save_for_backward(input, target)


def _per_sample_backward(ctx, grad: Tensor):
    """reduction='none''s backward for grad_output expanded over the reduced dimensions
    (divided by their size for a mean, as torch.mean's backward divides), read where it lies."""
    input, target = ctx.saved_tensors
    shape = torch.broadcast_shapes(input.shape, target.shape)
    reduced = shape[ctx.kept_dims:]
    if ctx.reduction == "mean":
        grad = grad / math.prod(reduced)
    grad = grad.reshape(grad.shape + (1,) * len(reduced)).expand(shape)
    return (*_pointwise_gradients(ctx, grad, input, target), None)


def _reduced_setup_context(ctx, inputs, output) -> None:
    # inputs: the Function's (_function), with the backward's history slot after output_mask.
    input, target, (ctx.loss, ctx.param, ctx.reduction, ctx.output_mask, ctx.slot, ctx.expected_grad_output,
                    ctx.autocast) = inputs
    # Nothing flows back into the fused gradients; don't build N-sized zeros for them.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(input, target)
    ctx.fused_gradients = _kept_gradients(ctx.output_mask, output)


def _kept_gradients(output_mask: Sequence[bool], output: Sequence[Tensor]) -> tuple[Tensor, ...] | None:
    """The gradients a forward wrote, for its backward to hand on; None where it wrote none.
    Kept outside save_for_backward: backward corrects them in place and drops this
    reference, so autograd can hand the buffer to .grad without a copy. Detached: the
    outputs themselves point back at the node, and a graph dropped without backward would
    then never be freed."""
    if not any(output_mask):
        return None
    return tuple(g.detach() for g in output[1:])


def _fused_gradients(ctx, needs: Sequence[bool]) -> tuple[Tensor, ...] | None:
    """The forward's gradients, when they hold every one wanted and the kernels can correct
    them in place: once per graph (the first backward); None otherwise. A traced graph
    (AOTAutograd, subclasses) recomputes them, staying functional."""
    fused = ctx.fused_gradients
    if fused is None or not all(written or not needed for written, needed in zip(ctx.output_mask, needs)):
        return None
    if any(type(g) is not Tensor for g in fused):
        return None
    ctx.fused_gradients = None
    return tuple(g if needed else g.new_empty((0,)) for g, needed in zip(fused, needs))


def _reduced_backward(ctx, grad: Tensor | None, _unused_grad_input, _unused_grad_target):
    if grad is None:
        return None, None, None
    input, target = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:2]]
    if torch.is_grad_enabled():
        grad_input, grad_target = torch.ops.fusedloss.loss_gradients.default(
            grad, input, target, ctx.loss, ctx.param, ctx.reduction, ctx.autocast
        )
    elif (fused := _fused_gradients(ctx, needs)) is not None:
        grad_input, grad_target = fused
        with torch._C._AutoDispatchBelowAutograd():
            torch.ops.fusedloss.reduced_loss_backward_.default(grad_input, grad_target, grad, input, target, ctx.loss,
                                                       ctx.param, ctx.reduction, ctx.expected_grad_output, ctx.slot,
                                                       ctx.autocast)
    else:
        with torch._C._AutoDispatchBelowAutograd():
            grad_input, grad_target = torch.ops.fusedloss.reduced_loss_backward.default(
                grad, input, target, ctx.loss, ctx.param, ctx.reduction, needs, ctx.slot, ctx.expected_grad_output,
                ctx.autocast,
            )
    return _sum_to(grad_input, input) if needs[0] else None, _sum_to(grad_target, target) if needs[1] else None, None


def _weighted_setup_context(ctx, inputs, output) -> None:
    # inputs: the Function's (_function), with the backward's history slot after output_mask.
    (input, target, weight, scale, divisor, (host_scale, loss, param, output_mask, ctx.slot, ctx.expected_grad_output,
                                             autocast, kept_dims, ctx.param_per_element)) = inputs
    ctx.arguments = (host_scale, loss, param, autocast)
    # With kept_dims, the weight's gradient output holds each row's loss sum instead (weight_kept_dims).
    row_sums = kept_dims >= 0 and output_mask[2]
    ctx.output_mask = [output_mask[0], output_mask[1], output_mask[2] and not row_sums]
    ctx.row_sums = output[3].detach() if row_sums and ctx.needs_input_grad[2] else None
    ctx.weight_rows = None
    if ctx.needs_input_grad[2]:
        ctx.weight_rows = kept_dims if row_sums else weight_gradient_rows(weight, input, target)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(input, target, weight, scale, divisor, output[0] if ctx.needs_input_grad[4] else None)
    ctx.fused_gradients = _kept_gradients(ctx.output_mask, output)


def _weighted_backward(ctx, grad: Tensor | None, *_unused_gradients):
    """The weighted reductions: the reduced losses' plan with a weight, whose gradient per
    element (scale times the element's loss) the kernels write beside the operands', and a
    divisor, d out / d divisor = -out / divisor. A scale takes no gradient here
    (``weighted`` computes that case with torch operations). A weight over leading
    dimensions (weight_gradient_rows) gets its gradient from the loss's sums over the rest,
    which the forward gave where it was asked to (weight_kept_dims), else a per-sample pass.
    create_graph=True, and another weight's gradient wanted alone, go through the formulas."""
    if ctx.needs_input_grad[3]:
        raise RuntimeError("fusedloss::weighted_loss has no gradient for scale; fusedloss's loss functions "
                           "compute it with torch operations")
    if ctx.needs_input_grad[2] and ctx.param_per_element:
        raise RuntimeError("fusedloss::weighted_loss has no gradient for a param per element; fusedloss's loss "
                           "functions compute it with torch operations")
    if grad is None:
        return (None,) * 6
    input, target, weight, scale, divisor, out = ctx.saved_tensors
    host_scale, loss, param, autocast = ctx.arguments
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    rows = ctx.weight_rows
    # The kernels' part: the weight's gradient too, unless a per-sample pass gives it summed.
    kernel_needs = [needs[0], needs[1], needs[2] and rows is None]
    if torch.is_grad_enabled() or (kernel_needs[2] and not (needs[0] or needs[1])):
        gradients = torch.ops.fusedloss.weighted_loss_gradients.default(
            grad, input, target, weight, scale, divisor, host_scale, loss, param, autocast, ctx.param_per_element)
        rows = None
    elif not (needs[0] or needs[1]):
        gradients = (None, None, None)
    elif (gradients := _fused_gradients(ctx, kernel_needs)) is not None:
        with torch._C._AutoDispatchBelowAutograd():
            torch.ops.fusedloss.weighted_loss_backward_.default(*gradients, grad, input, target, weight, scale, divisor,
                                                        host_scale, loss, param, ctx.expected_grad_output, ctx.slot,
                                                        autocast, ctx.param_per_element)
    else:
        with torch._C._AutoDispatchBelowAutograd():
            gradients = torch.ops.fusedloss.weighted_loss_backward.default(
                grad, input, target, weight, scale, divisor, host_scale, loss, param, kernel_needs, ctx.slot,
                ctx.expected_grad_output, autocast, ctx.param_per_element)
    grad_input, grad_target, grad_weight = gradients
    if needs[2]:
        grad_weight = (_sum_to(grad_weight, weight) if rows is None else
                       _weight_gradient_by_rows(grad, input, target, weight, scale, divisor, ctx.arguments, rows,
                                                ctx.row_sums))
        grad_weight = grad_weight.to(weight.dtype)
    grad_divisor = None
    if ctx.needs_input_grad[4]:
        grad_divisor = -(grad.to(divisor.dtype) * out.to(divisor.dtype)) / divisor
    return (_sum_to(grad_input, input) if needs[0] else None, _sum_to(grad_target, target) if needs[1] else None,
            grad_weight if needs[2] else None, None, grad_divisor, None)


def _weight_gradient_by_rows(grad: Tensor, input: Tensor, target: Tensor, weight: Tensor, scale: Tensor | None,
                             divisor: Tensor | None, arguments: tuple, rows: int, sums: Tensor | None) -> Tensor:
    """d out / d weight for a weight over the first `rows` dimensions: the loss summed over
    the others (`sums`, the forward's, else one per-sample pass), times the factor the
    kernels give each element's gradient (host_scale * scale / divisor * grad_output), in
    float64 until the one rounding into the weight's dtype, summed over the leading
    dimensions the weight broadcasts along."""
    host_scale, loss, param, autocast = arguments
    if sums is None:
        with torch._C._AutoDispatchBelowAutograd():
            sums = torch.ops.fusedloss.per_sample_loss.default(input, target, loss, param, rows, "sum", autocast)
    factor = grad.to(torch.float64) * host_scale
    if scale is not None:
        factor = factor * scale.to(torch.float64)
    if divisor is not None:
        factor = factor / divisor.to(torch.float64)
    per_row = (sums.to(torch.float64) * factor).reshape(sums.shape + (1,) * (input.dim() - rows))
    return _sum_to(per_row, weight)


# the type of an operator's leading (optional) tensor arguments, which a Function takes one by one
_OPTIONAL_TENSOR = torch._C.OptionalType.ofTensor()


# The autograd of each differentiable operator, written once (setup_context and backward
# above) as an autograd.Function that enters the operator below autograd. The operator's
# own autograd kernel applies it, for whoever calls the operator (CPU, tracing,
# torch.ops); fusedloss.routing applies it directly. Its forward takes ctx and calls
# setup_context itself: a Function with a separate setup_context binds its arguments to
# forward's signature on every call, which a small training step feels, and so does
# torch.library.register_autograd's bookkeeping. It takes the operator's tensors, then
# its other arguments as one tuple (call_function), which setup_context unpacks.
#
# The reduced losses' backward notes grad_output in a history slot
# (grad_output_prediction), which their forward operators do not take: their Function's
# tuple holds it after output_mask (where the backward operators take it), and the
# Function hands the operator the others. Called through the operator, the backward
# notes nowhere (-1).
_DIFFERENTIABLE = {  # name: (setup_context, backward, whether the Function takes a history slot)
    "pointwise_loss": (_pointwise_setup_context, _pointwise_backward, False),
    "reduced_loss": (_reduced_setup_context, _reduced_backward, True),
    "weighted_loss": (_weighted_setup_context, _weighted_backward, True),
    "per_sample_loss": (_per_sample_setup_context, _per_sample_backward, False),
}


def _has_tangent(args: Sequence[object]) -> bool:
    return forward_ad._current_level >= 0 and any(
        isinstance(a, Tensor) and forward_ad.unpack_dual(a).tangent is not None for a in args)


def _function(name: str) -> type[torch.autograd.Function]:
    op = getattr(torch.ops.fusedloss, name).default
    setup_context, backward, takes_slot = _DIFFERENTIABLE[name]
    arguments = op._schema.arguments
    names = [a.name for a in arguments]
    # The operator's tensor arguments come first. The Function takes them one by one and
    # the others as one tuple: every argument of a Function costs host time in each
    # backward, and a small step is bound by host time.
    tensors = next(i for i, a in enumerate(arguments) if not a.type.isSubtypeOf(_OPTIONAL_TENSOR))
    # Where the operator's arguments, and the Function's tuple, hold the history slot, or None.
    at = names.index("output_mask") + 1 if takes_slot else None
    slot_at = None if at is None else at - tensors

    if at is None:
        def forward(ctx, *args):
            with torch._C._AutoDispatchBelowAutograd():
                output = op(*args[:-1], *args[-1])
            setup_context(ctx, args, output)
            return output
    else:
        def forward(ctx, *args):
            rest = args[-1]
            with torch._C._AutoDispatchBelowAutograd():
                output = op(*args[:-1], *rest[:slot_at], *rest[slot_at + 1:])
            setup_context(ctx, args, output)
            return output

    function = type(name, (torch.autograd.Function,), {
        "__doc__": f"fusedloss::{name} with its autograd. Takes the operator's {tensors} tensor arguments, then a "
                   "tuple of the others" + ("" if at is None else ", with the backward's history slot after "
                                            "output_mask") + " (call_function takes them all in a row).",
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
        "tensor_arguments": tensors,
        "history_slot_at": at,
    })

    def autograd_kernel(*args, **kwargs):
        if len(args) < len(arguments):  # every argument of the operator, as the Function takes them
            args = (*args, *(kwargs.get(a.name, a.default_value) for a in arguments[len(args):]))
        # Reverse mode only: a tangent would be dropped, so a dual operand is refused
        # (fusedloss's functions hand dual tensors to torch.nn.functional).
        if _has_tangent(args):
            raise RuntimeError(f"fusedloss::{name} has no forward-mode AD rule; fusedloss's loss functions compute "
                               "dual tensors through torch.nn.functional")
        if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
            return call_function(function, *args) if at is None else call_function(function, *args[:at], -1,
                                                                                      *args[at:])
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    _lib.impl(name, autograd_kernel, "Autograd")
    return function


def call_function(function: type[torch.autograd.Function], *args):
    """A Function of _function's on the operator's arguments in a row (with the history slot
    after output_mask where it takes one)."""
    tensors = function.tensor_arguments
    return function.apply(*args[:tensors], args[tensors:])


PointwiseLoss = _function("pointwise_loss")
ReducedLoss = _function("reduced_loss")
WeightedLoss = _function("weighted_loss")
PerSampleLoss = _function("per_sample_loss")
