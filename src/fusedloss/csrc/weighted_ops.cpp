// The CUDA kernels of the weighted operators: weighted reductions with a weight
// read where it lies and a scale read on the device, and reduction='none''s
// backward for a grad_output expanded over some dimensions, read where it lies
// as a weight is. A library of its own, which a source build compiles on the
// first call that needs it (plain_ops.cpp has the rest).
#include "glue.h"
#include "shards.h"

namespace fusedloss {

// The launchers this library calls, from the shards of its .cu files.
FUSEDLOSS_SHARD_DISPATCH(int64_t, weighted_reduced_loss_partials, (const LossProblem& problem, bool row_sums),
                         (problem, row_sums))
FUSEDLOSS_SHARD_DISPATCH(cudaError_t, launch_weighted_reduced_loss,
                         (const LossProblem& problem, double* partials, void* grad_input, void* grad_target,
                          void* grad_weight, void* out, cudaStream_t stream),
                         (problem, partials, grad_input, grad_target, grad_weight, out, stream))
FUSEDLOSS_SHARD_DISPATCH(cudaError_t, launch_weighted_reduced_loss_backward,
                         (const LossProblem& problem, const void* grad_output, void* grad_input, void* grad_target,
                          void* grad_weight, const BackwardOptions& options, cudaStream_t stream),
                         (problem, grad_output, grad_input, grad_target, grad_weight, options, stream))
FUSEDLOSS_SHARD_DISPATCH(cudaError_t, launch_pointwise_loss_backward_broadcast,
                         (const LossProblem& problem, const ElementWeight& grad_output, void* grad_input,
                          void* grad_target, cudaStream_t stream),
                         (problem, grad_output, grad_input, grad_target, stream))

namespace {

// A one-element multiplier on the device (DeviceScale), as a dtype the kernels read.
Tensor as_device_scalar(const std::optional<Tensor>& t, const Tensor& like) {
  if (!t.has_value() || !t->defined()) return Tensor();
  STD_TORCH_CHECK(same_device(*t, like) && t->numel() == 1,
                  "fusedloss: scale and divisor are one-element tensors on the operands' device");
  return is_kernel_dtype(t->scalar_type()) ? *t : as_dtype(*t, ScalarType::Double);
}

struct WeightedProblem {
  Operands ops;
  KernelWeight weight;
  Tensor scale, divisor;  // kept alive for the launch
};

WeightedProblem prepare_weighted(const Tensor& input, const Tensor& target, const std::optional<Tensor>& weight,
                                 const std::optional<Tensor>& scale, const std::optional<Tensor>& divisor,
                                 double host_scale, const std::string& loss, double param, bool autocast,
                                 bool param_per_element) {
  STD_TORCH_CHECK(!param_per_element || (weight.has_value() && weight->defined()),
                  "fusedloss: param_per_element reads each element's param from the weight");
  WeightedProblem w;
  // Beside several quantiles, a target that broadcasts (the forecasting (..., 1)) is read
  // where it lies (TakesParamPerElement::kTargetWhereItLies).
  const bool quantiles = param_per_element && parse_loss(loss) == LossKind::kQuantile;
  w.ops = prepare(input, target, loss, param, autocast, quantiles);
  if (quantiles && shape_of(w.ops.target) != w.ops.shape) {
    const KernelWeight broadcast = laid_out(w.ops.target, w.ops.shape);
    w.ops.target = broadcast.tensor;
    w.ops.problem.target = broadcast.tensor.data_ptr();
    w.ops.problem.broadcast_target = broadcast.layout;
  }
  const ScalarType math = w.ops.loss_dtype == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  w.weight = as_kernel_weight(weight, w.ops.shape, math, w.ops.input);
  w.scale = as_device_scalar(scale, w.ops.input);
  w.divisor = as_device_scalar(divisor, w.ops.input);
  LossProblem& p = w.ops.problem;
  p.weight = w.weight.layout;
  p.param_per_element = param_per_element;
  p.scale.host = host_scale;
  if (w.scale.defined()) {
    p.scale.scale = w.scale.data_ptr();
    p.scale.scale_dtype = to_dtype(w.scale.scalar_type());
  }
  if (w.divisor.defined()) {
    p.scale.divisor = w.divisor.data_ptr();
    p.scale.divisor_dtype = to_dtype(w.divisor.scalar_type());
  }
  return w;
}

// The weight's gradient (the loss's dtype and shape; autograd sums it to the
// weight's) is written only beside an operand's, as the kernels write it.
Tensor maybe_weight_grad_buffer(const std::vector<bool>& output_mask, const WeightedProblem& w) {
  STD_TORCH_CHECK(!output_mask[2] || output_mask[0] || output_mask[1],
                  "fusedloss: weighted_loss writes the weight's gradient only with input's or target's");
  return maybe_grad_buffer(output_mask[2], w.ops.shape, w.ops.loss_dtype, w.ops.input);
}

// A weight constant along the dimensions after the first `kept_dims` (>= 0), rows of whole
// tiles: sets the problem's row_length, so that the reduction's tiles lie within rows and
// each tile's sum is one row's, and returns the kept dimensions' shape (one sum per row).
Shape lay_out_weight_rows(int64_t kept_dims, const std::optional<Tensor>& weight, WeightedProblem& w) {
  const Shape& shape = w.ops.shape;
  STD_TORCH_CHECK(kept_dims <= int64_t(shape.size()), "fusedloss: weight_kept_dims exceeds the loss's dimensions");
  const Shape kept(shape.begin(), shape.begin() + kept_dims);
  const int64_t row_length = product(Shape(shape.begin() + kept_dims, shape.end()));
  STD_TORCH_CHECK(row_length % kRowTilingMultiple == 0, "fusedloss: weight_kept_dims leaves rows of ", row_length,
                  " elements; it takes rows of a multiple of ", kRowTilingMultiple);
  if (weight.has_value() && weight->defined()) {
    const Shape weight_shape = shape_of(*weight);
    const int64_t offset = int64_t(shape.size()) - int64_t(weight_shape.size());
    for (int64_t d = std::max<int64_t>(kept_dims, offset); d < int64_t(shape.size()); ++d) {
      STD_TORCH_CHECK(weight_shape[d - offset] == 1, "fusedloss: weight_kept_dims needs a weight of size 1 along "
                      "every later dimension");
    }
  }
  if (product(kept) > 0) w.ops.problem.row_length = row_length;
  return kept;
}

// expected_grad_output as in reduced_loss (no history slot either: that is the backward's).
std::tuple<Tensor, Tensor, Tensor, Tensor> weighted_loss(Tensor input, Tensor target, std::optional<Tensor> weight,
                                                         std::optional<Tensor> scale, std::optional<Tensor> divisor,
                                                         double host_scale, std::string loss, double param,
                                                         std::vector<bool> output_mask, double expected_grad_output,
                                                         bool autocast, int64_t weight_kept_dims,
                                                         bool param_per_element) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  STD_TORCH_CHECK(!param_per_element || (!output_mask[2] && weight_kept_dims < 0),
                  "fusedloss: a param per element takes no gradient and no weight_kept_dims");
  WeightedProblem w = prepare_weighted(input, target, weight, scale, divisor, host_scale, loss, param, autocast,
                                       param_per_element);
  w.ops.problem.expected_grad_output = expected_grad_output;
  const Tensor& operand = w.ops.input;
  Tensor out = empty({}, w.ops.loss_dtype, operand);
  Tensor grad_input = maybe_grad_buffer(output_mask[0], w.ops.shape, operand.scalar_type(), operand);
  Tensor grad_target = maybe_grad_buffer(output_mask[1], w.ops.shape, w.ops.target.scalar_type(), operand);
  // The weight's gradient per element, or with weight_kept_dims, where output_mask[2] asks,
  // the loss's sums per row (float64), from which autograd gives it.
  Tensor grad_weight;
  void* weight_gradient = nullptr;
  if (weight_kept_dims < 0) {
    grad_weight = maybe_weight_grad_buffer(output_mask, w);
    weight_gradient = data_or_null(grad_weight);
  } else {
    const Shape kept = lay_out_weight_rows(weight_kept_dims, weight, w);
    grad_weight = empty(output_mask[2] ? kept : Shape{0}, ScalarType::Double, operand);
    if (w.ops.problem.row_length > 0) {
      weight_gradient = data_or_null(grad_weight);
    } else if (grad_weight.numel() > 0) {
      torch::stable::zero_(grad_weight);  // empty rows: no tile adds to their sums
    }
  }
  const int64_t partials =
      std::max<int64_t>(1, weighted_reduced_loss_partials(w.ops.problem, weight_gradient != nullptr));
  Tensor partial_sums = empty({partials}, ScalarType::Double, operand);
  FUSEDLOSS_CUDA_CHECK(launch_weighted_reduced_loss(w.ops.problem, static_cast<double*>(partial_sums.data_ptr()),
                                                    data_or_null(grad_input), data_or_null(grad_target),
                                                    weight_gradient, out.data_ptr(), current_stream(operand)));
  return {out, as_dtype(grad_input, input.scalar_type()), as_dtype(grad_target, target.scalar_type()), grad_weight};
}

std::tuple<Tensor, Tensor, Tensor> weighted_loss_backward(
    Tensor grad_output, Tensor input, Tensor target, std::optional<Tensor> weight, std::optional<Tensor> scale,
    std::optional<Tensor> divisor, double host_scale, std::string loss, double param, std::vector<bool> output_mask,
    int64_t history_slot_index, double expected_grad_output, bool autocast, bool param_per_element) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  WeightedProblem w = prepare_weighted(input, target, weight, scale, divisor, host_scale, loss, param, autocast,
                                       param_per_element);
  w.ops.problem.expected_grad_output = expected_grad_output;  // for the note only
  check_grad_output(grad_output, input, "weighted_loss_backward");
  const Tensor go = as_dtype(grad_output, w.ops.loss_dtype);
  const Tensor& operand = w.ops.input;
  Tensor grad_input = maybe_grad_buffer(output_mask[0], w.ops.shape, operand.scalar_type(), operand);
  Tensor grad_target = maybe_grad_buffer(output_mask[1], w.ops.shape, w.ops.target.scalar_type(), operand);
  Tensor grad_weight = maybe_weight_grad_buffer(output_mask, w);
  FUSEDLOSS_CUDA_CHECK(launch_weighted_reduced_loss_backward(w.ops.problem, go.data_ptr(), data_or_null(grad_input),
                                                             data_or_null(grad_target), data_or_null(grad_weight),
                                                             backward_options(history_slot_index, false),
                                                             current_stream(operand)));
  return {as_dtype(grad_input, input.scalar_type()), as_dtype(grad_target, target.scalar_type()), grad_weight};
}

// weighted_loss's gradients for expected_grad_output, recomputed in place for
// grad_output where that differs, as reduced_loss_backward_.
void weighted_loss_backward_(Tensor grad_input, Tensor grad_target, Tensor grad_weight, Tensor grad_output,
                             Tensor input, Tensor target, std::optional<Tensor> weight, std::optional<Tensor> scale,
                             std::optional<Tensor> divisor, double host_scale, std::string loss, double param,
                             double expected_grad_output, int64_t history_slot_index, bool autocast,
                             bool param_per_element) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  WeightedProblem w = prepare_weighted(input, target, weight, scale, divisor, host_scale, loss, param, autocast,
                                       param_per_element);
  w.ops.problem.expected_grad_output = expected_grad_output;
  check_grad_output(grad_output, input, "weighted_loss_backward_");
  const Tensor go = as_dtype(grad_output, w.ops.loss_dtype);
  FUSEDLOSS_CUDA_CHECK(launch_weighted_reduced_loss_backward(
      w.ops.problem, go.data_ptr(), written_gradient(grad_input, w.ops.input),
      written_gradient(grad_target, w.ops.input, w.ops.target.scalar_type()),
      written_gradient(grad_weight, w.ops.input, w.ops.loss_dtype),
      backward_options(history_slot_index, true), current_stream(w.ops.input)));
}

// reduction='none''s backward for a grad_output that broadcasts to the loss's shape
// with some dimensions expanded (the backward of a sum over those), read where it lies.
std::tuple<Tensor, Tensor> pointwise_loss_backward_broadcast(Tensor grad_output, Tensor input, Tensor target,
                                                             std::string loss, double param,
                                                             std::vector<bool> output_mask, bool autocast) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  Operands ops = prepare(input, target, loss, param, autocast);
  STD_TORCH_CHECK(same_device(grad_output, input), "fusedloss: grad_output must be on the operands' device");
  const Tensor go = expand(as_dtype(grad_output, ops.loss_dtype), ops.shape);
  const Shape strides = strides_of(go);
  Shape sizes = ops.shape;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (strides[i] == 0) sizes[i] = 1;
  }
  const ScalarType math = ops.loss_dtype == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  const KernelWeight broadcast = as_kernel_weight(as_strided(go, sizes, strides), ops.shape, math, ops.input);
  Tensor grad_input = maybe_grad_buffer(output_mask[0], ops.shape, ops.input.scalar_type(), ops.input);
  Tensor grad_target = maybe_grad_buffer(output_mask[1], ops.shape, ops.target.scalar_type(), ops.target);
  FUSEDLOSS_CUDA_CHECK(launch_pointwise_loss_backward_broadcast(ops.problem, broadcast.layout, data_or_null(grad_input),
                                                                data_or_null(grad_target), current_stream(ops.input)));
  return {as_dtype(grad_input, input.scalar_type()), as_dtype(grad_target, target.scalar_type())};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fusedloss, CUDA, m) {
  m.impl("weighted_loss", TORCH_BOX(&weighted_loss));
  m.impl("weighted_loss_backward", TORCH_BOX(&weighted_loss_backward));
  m.impl("weighted_loss_backward_", TORCH_BOX(&weighted_loss_backward_));
  m.impl("pointwise_loss_backward_broadcast", TORCH_BOX(&pointwise_loss_backward_broadcast));
}

// No tensor argument to dispatch on.
STABLE_TORCH_LIBRARY_IMPL(fusedloss, CompositeExplicitAutograd, m) {
  m.impl("weighted_grad_output_history", TORCH_BOX(&grad_output_history));
}

}  // namespace fusedloss
