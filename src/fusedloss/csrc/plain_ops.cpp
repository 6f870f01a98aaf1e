// The CUDA kernels of the plain operators (reduction='none', mean and sum), one
// library of their own: a source build compiles them first, and the weighted
// family (weighted_ops.cpp) only on the first weighted call. Each launches on the
// current stream of the operands' own device.
#include "glue.h"
#include "shards.h"

namespace fusedloss {

// The launchers this library calls, from the shards of its .cu files.
FUSEDLOSS_SHARD_DISPATCH(int64_t, reduced_loss_scratch_bytes, (const LossProblem& problem, bool writes_gradients),
                         (problem, writes_gradients))
FUSEDLOSS_SHARD_DISPATCH(cudaError_t, launch_reduced_loss,
                         (const LossProblem& problem, void* scratch, void* grad_input, void* grad_target, bool mean,
                          void* out, cudaStream_t stream),
                         (problem, scratch, grad_input, grad_target, mean, out, stream))
FUSEDLOSS_SHARD_DISPATCH(cudaError_t, launch_reduced_loss_backward,
                         (const LossProblem& problem, const void* grad_output, bool mean, void* grad_input,
                          void* grad_target, const BackwardOptions& options, cudaStream_t stream),
                         (problem, grad_output, mean, grad_input, grad_target, options, stream))
FUSEDLOSS_SHARD_DISPATCH(cudaError_t, launch_pointwise_loss, (const LossProblem& problem, void* out, cudaStream_t stream),
                         (problem, out, stream))
FUSEDLOSS_SHARD_DISPATCH(cudaError_t, launch_pointwise_loss_backward,
                         (const LossProblem& problem, const void* grad_output, bool grad_output_is_scalar,
                          void* grad_input, void* grad_target, cudaStream_t stream),
                         (problem, grad_output, grad_output_is_scalar, grad_input, grad_target, stream))
FUSEDLOSS_SHARD_DISPATCH(int64_t, per_sample_loss_partials, (const LossProblem& problem, int64_t rows),
                         (problem, rows))
FUSEDLOSS_SHARD_DISPATCH(cudaError_t, launch_per_sample_loss,
                         (const LossProblem& problem, int64_t rows, double* partials, bool mean, void* out,
                          cudaStream_t stream),
                         (problem, rows, partials, mean, out, stream))

namespace {

Tensor pointwise_loss(Tensor input, Tensor target, std::string loss, double param, bool autocast) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  Operands ops = prepare(input, target, loss, param, autocast);
  Tensor out = empty(ops.shape, ops.loss_dtype, ops.input);
  FUSEDLOSS_CUDA_CHECK(launch_pointwise_loss(ops.problem, out.data_ptr(), current_stream(ops.input)));
  return out;
}

// grad_output as the kernels read it: one value (the backward of .sum() or
// .mean()), or of the loss's shape (a grad_output expanded over some dimensions is
// copied to it here; the weighted family's pointwise_loss_backward_broadcast reads
// one where it lies).
std::tuple<Tensor, Tensor> pointwise_loss_backward(Tensor grad_output, Tensor input, Tensor target, std::string loss,
                                                   double param, std::vector<bool> output_mask, bool autocast) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  Operands ops = prepare(input, target, loss, param, autocast);
  STD_TORCH_CHECK(same_device(grad_output, input), "fusedloss: grad_output must be on the operands' device");
  Tensor go = as_dtype(grad_output, ops.loss_dtype);
  if (shape_of(go) != ops.shape) go = expand(go, ops.shape);
  bool go_is_scalar = go.numel() > 0;
  for (const int64_t stride : go.strides()) go_is_scalar = go_is_scalar && stride == 0;
  go = go_is_scalar ? as_strided(go, {1}, {1}) : as_kernel_layout(go);
  Tensor grad_input = maybe_grad_buffer(output_mask[0], ops.shape, ops.input.scalar_type(), ops.input);
  Tensor grad_target = maybe_grad_buffer(output_mask[1], ops.shape, ops.target.scalar_type(), ops.target);
  FUSEDLOSS_CUDA_CHECK(launch_pointwise_loss_backward(ops.problem, go.data_ptr(), go_is_scalar,
                                                      data_or_null(grad_input), data_or_null(grad_target),
                                                      current_stream(ops.input)));
  return {as_dtype(grad_input, input.scalar_type()), as_dtype(grad_target, target.scalar_type())};
}

// expected_grad_output multiplies the gradients the forward writes (LossProblem); the
// backward's history slot is autograd's (ops.py), not the forward's.
std::tuple<Tensor, Tensor, Tensor> reduced_loss(Tensor input, Tensor target, std::string loss, double param,
                                                std::string reduction, std::vector<bool> output_mask,
                                                double expected_grad_output, bool autocast) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  const bool mean = parse_mean(reduction);
  Operands ops = prepare(input, target, loss, param, autocast);
  ops.problem.expected_grad_output = expected_grad_output;
  Tensor out = empty({}, ops.loss_dtype, ops.input);
  Tensor grad_input = maybe_grad_buffer(output_mask[0], ops.shape, ops.input.scalar_type(), ops.input);
  Tensor grad_target = maybe_grad_buffer(output_mask[1], ops.shape, ops.target.scalar_type(), ops.target);
  const int64_t scratch_bytes = reduced_loss_scratch_bytes(ops.problem, output_mask[0] || output_mask[1]);
  void* scratch = nullptr;
  Tensor scratch_tensor;
  if (scratch_bytes > 0) {
    scratch_tensor = empty({scratch_bytes}, ScalarType::Byte, ops.input);
    scratch = scratch_tensor.data_ptr();
  }
  FUSEDLOSS_CUDA_CHECK(launch_reduced_loss(ops.problem, scratch, data_or_null(grad_input), data_or_null(grad_target),
                                           mean, out.data_ptr(), current_stream(ops.input)));
  return {out, as_dtype(grad_input, input.scalar_type()), as_dtype(grad_target, target.scalar_type())};
}

std::tuple<Tensor, Tensor> reduced_loss_backward(Tensor grad_output, Tensor input, Tensor target, std::string loss,
                                                 double param, std::string reduction, std::vector<bool> output_mask,
                                                 int64_t history_slot_index, double expected_grad_output,
                                                 bool autocast) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  const bool mean = parse_mean(reduction);
  Operands ops = prepare(input, target, loss, param, autocast);
  ops.problem.expected_grad_output = expected_grad_output;  // for the note only
  check_grad_output(grad_output, input, "reduced_loss_backward");
  const Tensor go = as_dtype(grad_output, ops.loss_dtype);  // one element: its layout does not matter
  Tensor grad_input = maybe_grad_buffer(output_mask[0], ops.shape, ops.input.scalar_type(), ops.input);
  Tensor grad_target = maybe_grad_buffer(output_mask[1], ops.shape, ops.target.scalar_type(), ops.target);
  FUSEDLOSS_CUDA_CHECK(launch_reduced_loss_backward(ops.problem, go.data_ptr(), mean, data_or_null(grad_input),
                                                    data_or_null(grad_target),
                                                    backward_options(history_slot_index, false),
                                                    current_stream(ops.input)));
  return {as_dtype(grad_input, input.scalar_type()), as_dtype(grad_target, target.scalar_type())};
}

// The gradients a forward wrote for expected_grad_output, recomputed in place for
// grad_output where that differs (decided on the GPU: no sync).
void reduced_loss_backward_(Tensor grad_input, Tensor grad_target, Tensor grad_output, Tensor input, Tensor target,
                            std::string loss, double param, std::string reduction, double expected_grad_output,
                            int64_t history_slot_index, bool autocast) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  const bool mean = parse_mean(reduction);
  Operands ops = prepare(input, target, loss, param, autocast);
  ops.problem.expected_grad_output = expected_grad_output;
  check_grad_output(grad_output, input, "reduced_loss_backward_");
  const Tensor go = as_dtype(grad_output, ops.loss_dtype);
  FUSEDLOSS_CUDA_CHECK(launch_reduced_loss_backward(ops.problem, go.data_ptr(), mean,
                                                    written_gradient(grad_input, ops.input),
                                                    written_gradient(grad_target, ops.target),
                                                    backward_options(history_slot_index, true),
                                                    current_stream(ops.input)));
}

inline int64_t element_size(ScalarType t) {
  return t == ScalarType::Double ? 8 : t == ScalarType::Float ? 4 : 2;
}

// The loss reduced over every dimension after the first `kept_dims` (dim= over the
// trailing dimensions): one value per element of the kept ones.
Tensor per_sample_loss(Tensor input, Tensor target, std::string loss, double param, int64_t kept_dims,
                       std::string reduction, bool autocast) {
  const torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  const bool mean = parse_mean(reduction);
  Operands ops = prepare(input, target, loss, param, autocast);
  STD_TORCH_CHECK(kept_dims >= 0 && kept_dims <= static_cast<int64_t>(ops.shape.size()),
                  "fusedloss: per_sample_loss keeps 0 to ", ops.shape.size(), " dimensions, got ", kept_dims);
  const Shape kept(ops.shape.begin(), ops.shape.begin() + kept_dims);
  const int64_t rows = product(kept);
  Tensor out = empty(kept, ops.loss_dtype, ops.input);
  if (rows == 0) return out;
  const int64_t row_length = ops.problem.numel / rows;
  STD_TORCH_CHECK(rows <= kPerSampleMaxRows, "fusedloss: per_sample_loss takes at most ", kPerSampleMaxRows,
                  " rows, got ", rows);
  STD_TORCH_CHECK(row_length * element_size(ops.input.scalar_type()) % 16 == 0 &&
                      row_length * element_size(ops.target.scalar_type()) % 16 == 0,
                  "fusedloss: per_sample_loss needs rows of whole 16-byte words, got rows of ", row_length,
                  " elements");
  Tensor partials = empty({per_sample_loss_partials(ops.problem, rows)}, ScalarType::Double, ops.input);
  FUSEDLOSS_CUDA_CHECK(launch_per_sample_loss(ops.problem, rows, static_cast<double*>(data_or_null(partials)), mean,
                                              out.data_ptr(), current_stream(ops.input)));
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fusedloss, CUDA, m) {
  m.impl("pointwise_loss", TORCH_BOX(&pointwise_loss));
  m.impl("pointwise_loss_backward", TORCH_BOX(&pointwise_loss_backward));
  m.impl("reduced_loss", TORCH_BOX(&reduced_loss));
  m.impl("reduced_loss_backward", TORCH_BOX(&reduced_loss_backward));
  m.impl("reduced_loss_backward_", TORCH_BOX(&reduced_loss_backward_));
  m.impl("per_sample_loss", TORCH_BOX(&per_sample_loss));
}

// No tensor argument to dispatch on.
STABLE_TORCH_LIBRARY_IMPL(fusedloss, CompositeExplicitAutograd, m) {
  m.impl("grad_output_history", TORCH_BOX(&grad_output_history));
}

}  // namespace fusedloss
