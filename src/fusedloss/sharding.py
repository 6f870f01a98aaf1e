"""DTensor: a sharding rule for each fused operator, and the routes that send DTensor
operands to the fused kernels on each rank's own shards.

The common case (input, target and any weight alike in shape and placements, no scale
tensor) skips DTensor's dispatch: ``on_local_shards`` runs the one-GPU path on the local
shards, whose forward writes the gradients, in one autograd node, and returns the ranks'
partial sums as a ``Partial`` DTensor, as DTensor's own reductions do (``full_tensor()``
adds them up; the backward needs no collective). ``likelihood_on_local_shards`` does the
same for the NLLs' input, target and var. Every other case goes through the
operators and the rules below, DTensor redistributing the operands where they are placed
unalike.

A rule offers, for each dimension of the loss's shape, the strategy that shards the loss
along it: an operand that spans that dimension is sharded along its own matching
dimension, one that broadcasts along it (a per-channel weight, a 0-d scale) is
replicated, a per-element result is sharded like the loss, and a reduced one is a
partial sum. DTensor picks the strategy that moves the least, redistributing the
operands to it; all-replicated is always among them.

A mean over shards is not a mean of the shards' means when they are uneven, so the
route computes every mean as a sum scaled by one over the global count (or divided by
the global weight sum), which ``weighted_loss`` takes as ``host_scale`` and
``divisor``: its partial results add up to the global mean. ``reduced_loss`` and its
backward, whose mean divides by the local count, offer sharded strategies for sums
only. The in-place backward operators only ever see plain tensors (the forward's own
gradients, which a DTensor's forward does not write) and have no rule; the composite
ones (``loss_gradients``, ``weighted_loss_gradients``, ``likelihood_gradients``) decompose
into operations DTensor already shards. The NLLs' operators (``likelihood_loss`` and its
backward, ``likelihood_pointwise`` and its backward) have rules of the same kind; their
route (``likelihood.py``) hands them DTensors placed unalike, a mean as a sum scaled by
one over the global count.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor.experimental import register_sharding

from . import build, formulas, ops, reductions, routing
from .losses import LOSSES, Loss

_OPS = torch.ops.fusedloss


def _rule(overloads):
    """register_sharding, with every argument in the key of DTensor's cache of decisions.
    register_sharding keys it on the DTensor arguments and those from the first int
    argument on: two calls that differ in which optional tensors are None, in the output
    mask or in the loss would otherwise share one decision, and with it the wrong
    placements for some outputs."""
    overloads = overloads if isinstance(overloads, list) else [overloads]

    def register(strategy):
        register_sharding(overloads)(strategy)
        for overload in overloads:
            DTensor._op_dispatcher.sharding_propagator.op_to_schema_info[overload] = RuntimeSchemaInfo(
                static_argnum=0, needs_pytree=True)
        return strategy

    return register


def _placement(operand, loss_ndim: int, dim: int):
    """An operand's placement when the loss is sharded along `dim`: sharded along its own
    matching dimension where it spans it, replicated where it broadcasts (None: absent)."""
    if operand is None:
        return None
    own = dim - (loss_ndim - operand.ndim)
    if own < 0 or operand.shape[own] == 1:
        return Replicate()
    return Shard(own)


def _strategies(operands: list, loss_shape: torch.Size, outputs: list[str], sharded: bool = True) -> list:
    """[(output placements, input placements)]: all replicated, and, where `sharded`, the
    loss sharded along each dimension. `operands` holds each argument's spec, None for a
    non-tensor; `outputs` each output's kind: "loss" (per element of the loss's shape),
    "sum" (a partial sum), "empty" (a gradient not asked for) or "replicate"."""
    replicated_inputs = [None if spec is None else Replicate() for spec in operands]
    strategies = [([Replicate()] * len(outputs), replicated_inputs)]
    if not sharded:
        return strategies
    for dim in range(len(loss_shape)):
        if loss_shape[dim] == 1:
            continue
        output_placements = [{"loss": Shard(dim), "sum": Partial(), "empty": Replicate(),
                              "replicate": Replicate()}[kind] for kind in outputs]
        strategies.append((output_placements, [_placement(spec, len(loss_shape), dim) for spec in operands]))
    return strategies


def _shape(*specs) -> torch.Size:
    return torch.broadcast_shapes(*(spec.shape for spec in specs if spec is not None))


def _gradients(output_mask) -> list[str]:
    return ["loss" if wanted else "empty" for wanted in output_mask]


@_rule(_OPS.pointwise_loss.default)
def _pointwise_loss(input, target, loss, param, autocast=False):
    return _strategies([input, target, None, None, None], _shape(input, target), ["loss"])


@_rule([_OPS.pointwise_loss_backward.default, _OPS.pointwise_loss_backward_broadcast.default])
def _pointwise_loss_backward(grad_output, input, target, loss, param, output_mask, autocast=False):
    return _strategies([grad_output, input, target, None, None, None, None], _shape(input, target),
                       _gradients(output_mask))


@_rule(_OPS.reduced_loss.default)
def _reduced_loss(input, target, loss, param, reduction, output_mask, expected_grad_output=1.0, autocast=False):
    return _strategies([input, target] + [None] * 6, _shape(input, target), ["sum", *_gradients(output_mask)],
                       sharded=reduction == "sum")


@_rule(_OPS.reduced_loss_backward.default)
def _reduced_loss_backward(grad_output, input, target, loss, param, reduction, output_mask, history_slot=-1,
                           expected_grad_output=1.0, autocast=False):
    return _strategies([grad_output, input, target] + [None] * 7, _shape(input, target), _gradients(output_mask),
                       sharded=reduction == "sum")


@_rule(_OPS.per_sample_loss.default)
def _per_sample_loss(input, target, loss, param, kept_dims, reduction, autocast=False):
    """Sharded along a kept dimension, the rows are; along a reduced one, each rank holds a
    partial sum of every row (of a sum: a mean's parts would not add up)."""
    shape = _shape(input, target)
    strategies = [([Replicate()], [Replicate(), Replicate()] + [None] * 5)]
    for dim in range(len(shape)):
        if shape[dim] == 1 or (dim >= kept_dims and reduction != "sum"):
            continue
        output = Shard(dim) if dim < kept_dims else Partial()
        strategies.append(([output], [_placement(input, len(shape), dim), _placement(target, len(shape), dim)]
                           + [None] * 5))
    return strategies


@_rule(_OPS.weighted_loss.default)
def _weighted_loss(input, target, weight, scale, divisor, host_scale, loss, param, output_mask,
                   expected_grad_output=1.0, autocast=False, weight_kept_dims=-1, param_per_element=False):
    # Sums per row (weight_kept_dims) are taken of replicated operands only.
    return _strategies([input, target, weight, scale, divisor] + [None] * 8, _shape(input, target),
                       ["sum", *_gradients(output_mask)], sharded=weight_kept_dims < 0)


@_rule(_OPS.weighted_loss_backward.default)
def _weighted_loss_backward(grad_output, input, target, weight, scale, divisor, host_scale, loss, param, output_mask,
                            history_slot=-1, expected_grad_output=1.0, autocast=False, param_per_element=False):
    return _strategies([grad_output, input, target, weight, scale, divisor] + [None] * 8, _shape(input, target),
                       _gradients(output_mask))


@_rule(_OPS.likelihood_loss.default)
def _likelihood_loss(input, target, var, kind, eps, full, reduction, output_mask, expected_grad_output=1.0,
                     scale=1.0):
    return _strategies([input, target, var] + [None] * 7, _shape(input, target, var),
                       ["sum", *_gradients(output_mask)], sharded=reduction == "sum")


@_rule(_OPS.likelihood_loss_backward.default)
def _likelihood_loss_backward(grad_output, input, target, var, kind, eps, full, reduction, output_mask,
                              history_slot=-1, expected_grad_output=1.0, scale=1.0):
    return _strategies([grad_output, input, target, var] + [None] * 8, _shape(input, target, var),
                       _gradients(output_mask), sharded=reduction == "sum")


@_rule(_OPS.likelihood_pointwise.default)
def _likelihood_pointwise(input, target, var, kind, eps, full, scale=1.0):
    return _strategies([input, target, var] + [None] * 4, _shape(input, target, var), ["loss"])


@_rule(_OPS.likelihood_pointwise_backward.default)
def _likelihood_pointwise_backward(grad_output, input, target, var, kind, eps, full, output_mask, scale=1.0):
    return _strategies([grad_output, input, target, var] + [None] * 5, _shape(input, target, var),
                       _gradients(output_mask))


def likelihood_applies(input: Tensor, target: Tensor, var: Tensor | None) -> bool:
    """The NLLs' operands as DTensors of one mesh, shape and dtype, sharded or replicated,
    whose local shards the likelihood kernels take (their fused pass: float32, float64 or
    bfloat16, outside autocast)."""
    operands = [t for t in (input, target, var) if t is not None]
    if not all(isinstance(t, DTensor) and t.device_mesh == input.device_mesh and t.shape == input.shape
               and t.dtype == input.dtype for t in operands):
        return False
    if any(not isinstance(p, (Shard, Replicate)) for t in operands for p in t.placements):
        return False
    return (input.dtype in (torch.float32, torch.float64, torch.bfloat16)
            and not routing.under_autocast(input._local_tensor, target._local_tensor, input.device.type)
            and routing.kernels_apply(input._local_tensor, target._local_tensor) and build.use_kernels("likelihood"))


def applies(input: Tensor, target: Tensor, weight: Tensor | None, scale: float | Tensor | None,
            reduction: str) -> bool:
    """DTensor operands on one mesh, sharded or replicated, whose local shards the fused
    kernels take; a weight and a scale that are DTensors on that mesh, plain tensors
    (taken as replicated) or absent. Anything else goes to torch.nn.functional, which
    DTensor shards itself (a mean taken of the loss per element: functional._dtensor_unfused)."""
    if not (isinstance(input, DTensor) and isinstance(target, DTensor) and input.device_mesh == target.device_mesh):
        return False
    if any(not isinstance(p, (Shard, Replicate)) for t in (input, target) for p in t.placements):
        return False
    for extra in (weight, scale):
        if isinstance(extra, DTensor) and extra.device_mesh != input.device_mesh:
            return False
        if isinstance(extra, Tensor) and extra.requires_grad and not isinstance(extra, DTensor):
            return False  # a plain tensor's gradient cannot come back from DTensor's
    # a mean or sum runs on the weighted family's operator (its global divisor); the local
    # tensors as they lie: to_local would add an autograd node to each step, for a check
    return routing.kernels_apply(input._local_tensor, target._local_tensor) and (
        reduction == "none" or build.use_kernels("weighted"))


def dtensor_serves_the_step(row: Loss, input: Tensor, target: Tensor, reduction: str) -> bool:
    """Whether DTensor's own operator serves an unweighted call of two DTensors: 'none' or a
    sum of a loss PyTorch computes with a kernel of its own, placed alike, where the shards'
    one-GPU step would be PyTorch's own (``routing.pytorch_serves_the_step``). The shards run
    the same operator either way, and DTensor's dispatch costs less host time than the local
    route's autograd Function around it; where ``applies`` refuses the operands, such a call
    goes to DTensor's operator too. Not a mean: DTensor's rules average the ranks' means,
    whose value is wrong over uneven shards and whose gradient, over even ones, comes back
    times the number of shards."""
    if reduction == "mean" or not row.pytorch_kernels or not (
            isinstance(input, DTensor) and isinstance(target, DTensor)) or input.shape != target.shape or (
            input.placements != target.placements):
        return False
    local_input, local_target = input._local_tensor, target._local_tensor
    return routing.pytorch_serves_the_step(row, reduction, local_input, local_target, local_input.numel())


@functools.lru_cache(maxsize=256)
def _spec(mesh, placements: tuple, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> DTensorSpec:
    """A result's spec, built once per layout (as DTensor's dispatch caches its own)."""
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, dtype))


class _LossOfShards(torch.autograd.Function):
    """The loss of each rank's local shards of its operands (input, target and, for the
    NLLs, var) as a DTensor, in one autograd node: forward runs the one-GPU path on the
    shards (its own graph, which writes the gradients where it can), backward differentiates
    that graph with the gradient's local part. DTensor.to_local and from_local would add a
    node per operand and for the result, each with host time on every step. A double
    backward differentiates the same loss again on the operators' route (``again``), through
    DTensor's dispatch: on torch 2.10, to_local's and from_local's backward cut the graph,
    and a second derivative through them would be missing."""

    @staticmethod
    def forward(ctx, arguments: tuple, *operands: DTensor) -> DTensor:
        # the rest in one tuple: each argument of a Function costs host time in every backward
        local_loss, again, placements, shape, stride = arguments
        locals_ = tuple(operand._local_tensor.detach().requires_grad_(wanted)
                        for operand, wanted in zip(operands, ctx.needs_input_grad[1:]))
        with torch.enable_grad():
            out = local_loss(*locals_)
        # saved, not kept on ctx: autograd frees them after a backward that does not retain the graph
        ctx.save_for_backward(*operands, *locals_, out)
        ctx.again = again
        # the gradient of a partial sum is replicated, as DTensor.from_local's backward has it
        ctx.gradient_placements = tuple(Replicate() if p.is_partial() else p for p in placements)
        # built from its spec: DTensor.from_local would add an autograd node and its host time
        spec = _spec(operands[0].device_mesh, placements, shape, stride, out.dtype)
        return DTensor(out.detach(), spec, requires_grad=False)

    @staticmethod
    def backward(ctx, grad_output: DTensor) -> tuple[DTensor | None, ...]:
        saved = ctx.saved_tensors
        count = len(saved) // 2
        operands, locals_, out = saved[:count], saved[count:-1], saved[-1]
        wanted = ctx.needs_input_grad[1:]
        if torch.is_grad_enabled():  # create_graph: the loss again, on a route autograd sees whole
            with torch.enable_grad():
                loss = ctx.again(*operands)
            grads = iter(torch.autograd.grad(loss, [t for t, w in zip(operands, wanted) if w], grad_output,
                                             create_graph=True))
            return (None,) + tuple(next(grads) if w else None for w in wanted)
        placements = ctx.gradient_placements
        if tuple(grad_output.placements) != placements:
            grad_output = grad_output.redistribute(operands[0].device_mesh, placements)
        local_grad = grad_output._local_tensor
        # found again from the saved output, not kept on ctx: it holds the shards' graph
        node = _one_node_over(out, locals_)
        if node is not None:  # that node's backward, called as the engine would call it
            inputs = (local_grad,) + (None,) * (len(node._input_metadata) - 1)
            python_node = isinstance(node, BackwardCFunction)
            grads = (node.apply(*inputs) if python_node else node(*inputs))[:count]
            # a C++ node asks the running graph task which gradients to compute, and the task of a
            # torch.autograd.grad(..., inputs) has never heard of the shards' leaves: it computes
            # none, and the engine's own run below serves that call
            if python_node or all(g is not None for g, w in zip(grads, wanted) if w):
                return (None,) + tuple(_gradient(_as_operand(g, local), operand) if w and g is not None else None
                                       for g, local, operand, w in zip(grads, locals_, operands, wanted))
        # the shards' graph is kept as long as this node's saved tensors: a retained graph's
        # second backward finds it
        grads = iter(torch.autograd.grad(out, [t for t, w in zip(locals_, wanted) if w], local_grad,
                                         retain_graph=True))
        return (None,) + tuple(_gradient(next(grads), operand) if w else None for operand, w in zip(operands, wanted))


def _one_node_over(out: Tensor, leaves: tuple[Tensor, ...]):
    """The shards' graph where it is one autograd node whose first inputs are the leaves
    themselves (a fused operator's Function, the C++ autograd's node, or PyTorch's own
    loss node): backward then calls that node, not a nested run of the autograd engine,
    which costs a small step more host time than the rest of its backward. None for any
    other graph."""
    node = out.grad_fn
    if node is None or out.output_nr != 0:
        return None
    edges = node.next_functions
    if len(edges) < len(leaves) or any(fn is not None for fn, _ in edges[len(leaves):]):
        return None
    for (fn, _), leaf in zip(edges, leaves):
        if leaf.requires_grad != (fn is not None) or (fn is not None and getattr(fn, "variable", None) is not leaf):
            return None
    return node


def _as_operand(grad: Tensor, operand: Tensor) -> Tensor:
    """A gradient in its operand's shape and dtype, as the autograd engine hands it on."""
    if grad.shape != operand.shape:
        grad = grad.sum_to_size(operand.shape)
    return grad if grad.dtype == operand.dtype else grad.to(operand.dtype)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of this shape, as torch lays one out (a dimension
    of size 0 counts as 1), without making one."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _gradient(local: Tensor, operand: DTensor) -> DTensor:
    """An operand's gradient from its local part, placed and laid out as the operand is, with a
    copy of its spec (as DTensor's own to_local backward makes it)."""
    if local.stride() != operand._local_tensor.stride():  # rare: into the layout the spec describes
        local = torch.empty_like(operand._local_tensor).copy_(local)
    return DTensor(local, copy.copy(operand._spec), requires_grad=False)


def _summed_placements(placements: tuple) -> tuple:
    """A sum's placements: ranks along a mesh dimension the operands are sharded on hold parts of it."""
    return tuple(Partial() if placement.is_shard() else Replicate() for placement in placements)


def _of_shards(local_loss: Callable[..., Tensor], again: Callable[..., Tensor], operands: tuple[DTensor, ...],
               summed: bool = False) -> DTensor:
    """``_LossOfShards`` of ``local_loss`` over the operands (placed alike): a loss per element
    sharded like them, or a sum left as the ranks' partial sums."""
    input = operands[0]
    if summed:
        arguments = (local_loss, again, _summed_placements(input.placements), torch.Size(()), ())
    else:
        arguments = (local_loss, again, tuple(input.placements), input.shape, _contiguous_strides(input.shape))
    return _LossOfShards.apply(arguments, *operands)


def on_local_shards(loss: str, param: float, input: DTensor, target: DTensor, weight: Tensor | None,
                    scale: float | Tensor | None, reduction: str,
                    loss_of_shards: Callable[[Tensor, Tensor, str, Tensor | None, float | Tensor | None], Tensor]
                    ) -> DTensor | None:
    """The common case without DTensor's dispatch: input, target (and a weight that needs no
    gradient) of one shape and placements, and a number or no scale. Each rank computes
    ``loss_of_shards`` on its shards, the one-GPU path (whose forward writes the gradients
    where it can); a mean or sum is the ranks' partial sums (a mean's scaled by one over the
    global count or the all-reduced weight sum), left Partial. None otherwise."""
    placements = input.placements
    if target.placements != placements or target.shape != input.shape:
        return None
    if weight is not None and not (isinstance(weight, DTensor) and weight.placements == placements
                                   and weight.shape == input.shape and not weight.requires_grad):
        return None
    if not (scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool))):
        return None
    if reduction not in routing.MODES:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    local_weight = None if weight is None else weight._local_tensor  # it takes no gradient
    again = functools.partial(sharded_loss, loss, param, reduction=reduction, weight=weight, scale=scale)
    if reduction == "none":
        return _of_shards(lambda i, t: loss_of_shards(i, t, "none", local_weight, scale), again, (input, target))
    if reduction == "mean":
        factor = 1.0 if scale is None else scale
        if local_weight is None or LOSSES[loss].weighted_mean_over_count:
            scale = reductions.mean_factor(factor, input.numel())
        else:  # the weight's global sum, in the dtype the one-GPU mean sums it in
            dtype = torch.float32 if routing.under_autocast(input, target) else formulas.loss_dtype(
                input.dtype, target.dtype, loss)
            if local_weight.is_floating_point():
                dtype = torch.promote_types(dtype, local_weight.dtype)
            total = DTensor.from_local(reductions.weight_sum(local_weight, dtype), input.device_mesh,
                                       _summed_placements(placements), run_check=False, shape=torch.Size(()),
                                       stride=()).full_tensor()
            scale = factor / total
    return _of_shards(lambda i, t: loss_of_shards(i, t, "sum", local_weight, scale), again, (input, target),
                      summed=True)


def likelihood_on_local_shards(input: DTensor, target: DTensor, var: DTensor | None, reduction: str, scale: float,
                               local_loss: Callable[..., Tensor], again: Callable[..., Tensor]) -> DTensor | None:
    """The NLLs' common case (``likelihood_applies``, every operand placed alike) as
    ``on_local_shards`` runs it: ``local_loss(input, target[, var], reduction, scale)`` is the
    one-GPU fused pass on the shards, whose forward writes the gradients where it can; a mean
    is the ranks' partial sums scaled by one over the global count. ``again`` is the same
    loss on the operators' route (a double backward's). None where the placements differ."""
    operands = (input, target) if var is None else (input, target, var)
    placements = input.placements
    if any(operand.placements != placements for operand in operands[1:]):
        return None
    if reduction == "none":
        return _of_shards(lambda *shards: local_loss(*shards, "none", scale), again, operands)
    if reduction == "mean":
        scale = reductions.mean_factor(scale, input.numel())
    return _of_shards(lambda *shards: local_loss(*shards, "sum", scale), again, operands, summed=True)


def sharded_loss(loss: str, param: float, input: DTensor, target: DTensor, reduction: str, weight: Tensor | None,
                 scale: float | Tensor | None) -> DTensor:
    """The loss on DTensor operands (``applies``): each rank's fused kernels on its shards.
    A mean or sum is a partial sum of the global result (every mean scaled by the global
    count or weight sum), left Partial where DTensor ran it sharded; ``'none'`` is
    sharded like the loss."""
    if reduction not in routing.MODES:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    reductions.check_scale(scale)
    shape = torch.broadcast_shapes(input.shape, target.shape)
    routing.warn_if_target_broadcasts(input, target, LOSSES[loss])
    mesh = input.device_mesh
    replicated = [Replicate()] * mesh.ndim
    weight, scale = reductions.beside(weight, input), reductions.beside(scale, input)
    autocast = routing.under_autocast(input, target)
    if reduction == "none":
        out = ops.call_function(ops.PointwiseLoss, input, target, loss, param, autocast)
        return reductions.reduce(out, "none", weight, scale)
    if weight is not None:
        reductions.check_weight_broadcasts(weight, shape)
    host_scale, divisor = 1.0, None
    numel = math.prod(shape)
    if reduction == "mean":
        if weight is None or LOSSES[loss].weighted_mean_over_count:
            host_scale = reductions.mean_factor(1.0, numel)
        else:
            loss_dtype = torch.float32 if autocast else formulas.loss_dtype(input.dtype, target.dtype, loss)
            divisor = reductions.expanded_weight_sum(weight, shape, tuple(range(len(shape))), loss_dtype)
            divisor = divisor.reshape(()).redistribute(mesh, replicated)
    scale_needs_grad = isinstance(scale, Tensor) and scale.requires_grad and torch.is_grad_enabled()
    if isinstance(scale, (int, float)):
        host_scale *= scale
    device_scale = None if scale_needs_grad or not isinstance(scale, Tensor) else scale
    out = ops.call_function(ops.WeightedLoss, input, target, weight, device_scale, divisor, host_scale, loss, param,
                            [False, False, False], -1, 1.0, autocast, -1, False)[0]
    return out * scale if scale_needs_grad else out
