// The CUDA kernels of the Gaussian and Poisson negative log-likelihoods
// (likelihood_loss.cu), one library of their own, compiled on the first call that
// needs them. Each launches on the current stream of the operands' own device.
#include "glue.h"
#include "likelihood.h"
#include "shards.h"

namespace fusedloss {

FUSEDLOSS_SHARD_DISPATCH(int64_t, likelihood_partials, (const LikelihoodProblem& problem), (problem))
FUSEDLOSS_SHARD_DISPATCH(cudaError_t, launch_likelihood_loss,
                         (const LikelihoodProblem& problem, double* partials, void* grad_input, void* grad_target,
                          void* grad_var, void* out, cudaStream_t stream),
                         (problem, partials, grad_input, grad_target, grad_var, out, stream))
FUSEDLOSS_SHARD_DISPATCH(cudaError_t, launch_likelihood_backward,
                         (const LikelihoodProblem& problem, const void* grad_output, const BackwardOptions& options,
                          void* grad_input, void* grad_target, void* grad_var, cudaStream_t stream),
                         (problem, grad_output, options, grad_input, grad_target, grad_var, stream))
FUSEDLOSS_SHARD_DISPATCH(cudaError_t, launch_likelihood_pointwise,
                         (const LikelihoodProblem& problem, void* out, cudaStream_t stream), (problem, out, stream))
FUSEDLOSS_SHARD_DISPATCH(cudaError_t, launch_likelihood_pointwise_backward,
                         (const LikelihoodProblem& problem, const void* grad_output, void* grad_input,
                          void* grad_target, void* grad_var, cudaStream_t stream),
                         (problem, grad_output, grad_input, grad_target, grad_var, stream))

namespace {

Likelihood parse_likelihood(const std::string& name) {
  if (name == "gaussian") return Likelihood::kGaussian;
  if (name == "poisson") return Likelihood::kPoissonLogRate;
  if (name == "poisson_rate") return Likelihood::kPoissonRate;
  STD_TORCH_CHECK(false, "fusedloss: unknown likelihood '", name, "'");
}

// The operands as the kernels read them: one dtype and one shape on one CUDA device (the
// callers broadcast and convert), contiguous and aligned (copied where they are not).
struct LikelihoodOperands {
  Tensor input, target, var;  // var: undefined but for the Gaussian
  LikelihoodProblem problem;
};

LikelihoodOperands prepare_likelihood(const Tensor& input, const Tensor& target, const std::optional<Tensor>& var,
                                      const std::string& kind, double eps, bool full, bool mean,
                                      double expected_grad_output, double scale) {
  const Likelihood likelihood = parse_likelihood(kind);
  STD_TORCH_CHECK(var.has_value() == (likelihood == Likelihood::kGaussian),
                  "fusedloss: the Gaussian likelihood takes a var, the Poisson ones none");
  const ScalarType dtype = input.scalar_type();
  const Shape shape = shape_of(input);
  STD_TORCH_CHECK(is_kernel_dtype(dtype) && input.is_cuda(), "fusedloss: likelihood_loss takes a CUDA input of "
                  "float16, bfloat16, float32 or float64");
  for (const Tensor* operand : {&target, var.has_value() ? &*var : &target}) {
    STD_TORCH_CHECK(operand->scalar_type() == dtype && shape_of(*operand) == shape && same_device(*operand, input),
                    "fusedloss: likelihood_loss takes operands of one dtype and one shape on one device");
  }
  LikelihoodOperands ops;
  ops.input = as_kernel_layout(input);
  ops.target = as_kernel_layout(target);
  if (var.has_value()) ops.var = as_kernel_layout(*var);
  const int64_t numel = product(shape);
  ops.problem = LikelihoodProblem{likelihood,
                                  to_dtype(dtype),
                                  ops.input.data_ptr(),
                                  ops.target.data_ptr(),
                                  var.has_value() ? ops.var.data_ptr() : nullptr,
                                  numel,
                                  eps,
                                  full && likelihood == Likelihood::kGaussian ? 0.91893853320467274178 : 0.0,
                                  full && likelihood != Likelihood::kGaussian,
                                  (mean ? 1.0 / double(numel) : 1.0) * scale,
                                  expected_grad_output};
  return ops;
}

// The loss times scale (the operands' dtype), and the gradients output_mask asks for (input,
// target, var), written for expected_grad_output: likelihood_loss_backward_ corrects them for another.
std::tuple<Tensor, Tensor, Tensor, Tensor> likelihood_loss(Tensor input, Tensor target, std::optional<Tensor> var,
                                                           std::string kind, double eps, bool full,
                                                           std::string reduction, std::vector<bool> output_mask,
                                                           double expected_grad_output, double scale) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  LikelihoodOperands ops =
      prepare_likelihood(input, target, var, kind, eps, full, parse_mean(reduction), expected_grad_output, scale);
  STD_TORCH_CHECK(output_mask.size() == 3 && (var.has_value() || !output_mask[2]),
                  "fusedloss: likelihood_loss's output_mask names input, target and var");
  const Shape shape = shape_of(input);
  const ScalarType dtype = input.scalar_type();
  Tensor out = empty({}, dtype, input);
  Tensor grad_input = maybe_grad_buffer(output_mask[0], shape, dtype, input);
  Tensor grad_target = maybe_grad_buffer(output_mask[1], shape, dtype, input);
  Tensor grad_var = maybe_grad_buffer(output_mask[2], shape, dtype, input);
  Tensor partials = empty({std::max<int64_t>(likelihood_partials(ops.problem), 1)}, ScalarType::Double, input);
  FUSEDLOSS_CUDA_CHECK(launch_likelihood_loss(ops.problem, static_cast<double*>(partials.data_ptr()),
                                              data_or_null(grad_input), data_or_null(grad_target),
                                              data_or_null(grad_var), out.data_ptr(), current_stream(input)));
  return {out, grad_input, grad_target, grad_var};
}

// The gradients likelihood_loss wrote, recomputed in place for grad_output where it is not
// expected_grad_output (decided on the GPU: no sync); grad_output noted in history_slot. An
// empty tensor stands for a gradient not written.
void likelihood_loss_backward_(Tensor grad_input, Tensor grad_target, Tensor grad_var, Tensor grad_output,
                               Tensor input, Tensor target, std::optional<Tensor> var, std::string kind, double eps,
                               bool full, std::string reduction, double expected_grad_output,
                               int64_t history_slot_index, double scale) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  LikelihoodOperands ops =
      prepare_likelihood(input, target, var, kind, eps, full, parse_mean(reduction), expected_grad_output, scale);
  check_grad_output(grad_output, input, "likelihood_loss_backward_");
  const Tensor go = as_dtype(grad_output, input.scalar_type());
  FUSEDLOSS_CUDA_CHECK(launch_likelihood_backward(
      ops.problem, go.data_ptr(), backward_options(history_slot_index, true), written_gradient(grad_input, input),
      written_gradient(grad_target, input), var.has_value() ? written_gradient(grad_var, input) : nullptr,
      current_stream(input)));
}

// The gradients output_mask asks for, for grad_output, where the forward wrote none; grad_output
// noted in history_slot, and whether it was not expected_grad_output (the forward's expectation).
std::tuple<Tensor, Tensor, Tensor> likelihood_loss_backward(Tensor grad_output, Tensor input, Tensor target,
                                                            std::optional<Tensor> var, std::string kind, double eps,
                                                            bool full, std::string reduction,
                                                            std::vector<bool> output_mask, int64_t history_slot_index,
                                                            double expected_grad_output, double scale) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  LikelihoodOperands ops =
      prepare_likelihood(input, target, var, kind, eps, full, parse_mean(reduction), expected_grad_output, scale);
  STD_TORCH_CHECK(output_mask.size() == 3 && (var.has_value() || !output_mask[2]),
                  "fusedloss: likelihood_loss_backward's output_mask names input, target and var");
  check_grad_output(grad_output, input, "likelihood_loss_backward");
  const Tensor go = as_dtype(grad_output, input.scalar_type());
  const Shape shape = shape_of(input);
  const ScalarType dtype = input.scalar_type();
  Tensor grad_input = maybe_grad_buffer(output_mask[0], shape, dtype, input);
  Tensor grad_target = maybe_grad_buffer(output_mask[1], shape, dtype, input);
  Tensor grad_var = maybe_grad_buffer(output_mask[2], shape, dtype, input);
  FUSEDLOSS_CUDA_CHECK(launch_likelihood_backward(ops.problem, go.data_ptr(), backward_options(history_slot_index, false),
                                                  data_or_null(grad_input), data_or_null(grad_target),
                                                  data_or_null(grad_var), current_stream(input)));
  return {grad_input, grad_target, grad_var};
}

// reduction='none': the loss per element times scale (the operands' dtype and shape).
Tensor likelihood_pointwise(Tensor input, Tensor target, std::optional<Tensor> var, std::string kind, double eps,
                            bool full, double scale) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  LikelihoodOperands ops = prepare_likelihood(input, target, var, kind, eps, full, false, 1.0, scale);
  Tensor out = empty(shape_of(input), input.scalar_type(), input);
  FUSEDLOSS_CUDA_CHECK(launch_likelihood_pointwise(ops.problem, out.data_ptr(), current_stream(input)));
  return out;
}

// Its backward: the gradients output_mask asks for, for a grad_output of the loss's shape.
// One value expanded to it (the backward of a sum) is read once, by the reduction's backward.
std::tuple<Tensor, Tensor, Tensor> likelihood_pointwise_backward(Tensor grad_output, Tensor input, Tensor target,
                                                                 std::optional<Tensor> var, std::string kind,
                                                                 double eps, bool full,
                                                                 std::vector<bool> output_mask, double scale) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  LikelihoodOperands ops = prepare_likelihood(input, target, var, kind, eps, full, false, 1.0, scale);
  STD_TORCH_CHECK(output_mask.size() == 3 && (var.has_value() || !output_mask[2]),
                  "fusedloss: likelihood_pointwise_backward's output_mask names input, target and var");
  const Shape shape = shape_of(input);
  const ScalarType dtype = input.scalar_type();
  STD_TORCH_CHECK(same_device(grad_output, input) && shape_of(grad_output) == shape,
                  "fusedloss: likelihood_pointwise_backward takes a grad_output of the loss's shape on its device");
  Tensor go = as_dtype(grad_output, dtype);
  bool one_value = go.numel() > 0;
  for (const int64_t stride : go.strides()) one_value = one_value && stride == 0;
  Tensor grad_input = maybe_grad_buffer(output_mask[0], shape, dtype, input);
  Tensor grad_target = maybe_grad_buffer(output_mask[1], shape, dtype, input);
  Tensor grad_var = maybe_grad_buffer(output_mask[2], shape, dtype, input);
  if (one_value) {
    go = as_strided(go, {1}, {1});
    FUSEDLOSS_CUDA_CHECK(launch_likelihood_backward(ops.problem, go.data_ptr(), backward_options(-1, false),
                                                    data_or_null(grad_input), data_or_null(grad_target),
                                                    data_or_null(grad_var), current_stream(input)));
  } else {
    go = as_kernel_layout(go);
    FUSEDLOSS_CUDA_CHECK(launch_likelihood_pointwise_backward(ops.problem, go.data_ptr(), data_or_null(grad_input),
                                                              data_or_null(grad_target), data_or_null(grad_var),
                                                              current_stream(input)));
  }
  return {grad_input, grad_target, grad_var};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fusedloss, CUDA, m) {
  m.impl("likelihood_loss", TORCH_BOX(&likelihood_loss));
  m.impl("likelihood_loss_backward_", TORCH_BOX(&likelihood_loss_backward_));
  m.impl("likelihood_loss_backward", TORCH_BOX(&likelihood_loss_backward));
  m.impl("likelihood_pointwise", TORCH_BOX(&likelihood_pointwise));
  m.impl("likelihood_pointwise_backward", TORCH_BOX(&likelihood_pointwise_backward));
}

// No tensor argument to dispatch on.
STABLE_TORCH_LIBRARY_IMPL(fusedloss, CompositeExplicitAutograd, m) {
  m.impl("likelihood_grad_output_history", TORCH_BOX(&grad_output_history));
}

}  // namespace fusedloss
