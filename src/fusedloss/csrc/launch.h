// The boundary between the host code (torch tensors, fusedloss_ops.cpp) and the
// kernels (plain pointers, loss_kernels.cu). The kernels include no torch
// header, so they compile quickly and can be shipped on their own.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace fusedloss {

enum class LossKind : int { kMse, kL1, kSmoothL1, kHuber };
enum class DType : int { kFloat32, kFloat16, kBFloat16, kFloat64 };

// One elementwise loss over `numel` contiguous elements. `param` is beta for
// Smooth L1 (> 0) and delta for Huber; unused otherwise.
struct LossProblem {
  LossKind loss;
  double param;
  const void* input;
  DType input_dtype;
  const void* target;
  DType target_dtype;
  int64_t numel;
  int num_sms;
};

// Pass 1 of a mean or sum: one block partial per launched block in
// `block_sums`, and, where the pointers are set, d loss / d input and
// d loss / d target multiplied by `grad_scale` (1/N for a mean).
// `block_sums` must hold reduced_loss_num_blocks(problem) doubles.
int reduced_loss_num_blocks(const LossProblem& problem);
cudaError_t launch_reduced_loss(const LossProblem& problem, double* block_sums,
                                void* grad_input, void* grad_target,
                                double grad_scale, cudaStream_t stream);

// Pass 2: sums the block partials in a fixed order and writes the 0-d result.
cudaError_t launch_finish_reduction(const double* block_sums, int num_blocks,
                                    int64_t numel, bool mean, void* out,
                                    DType out_dtype, cudaStream_t stream);

// reduction='none'. The output dtype is the promoted dtype of the pair, or the
// input's dtype for Huber (as in PyTorch).
cudaError_t launch_pointwise_loss(const LossProblem& problem, void* out,
                                  cudaStream_t stream);

// reduction='none' backward. `grad_output` has the loss's dtype; with
// `grad_output_is_scalar` one value is broadcast to every element.
cudaError_t launch_pointwise_loss_backward(const LossProblem& problem,
                                           const void* grad_output,
                                           bool grad_output_is_scalar,
                                           void* grad_input, void* grad_target,
                                           cudaStream_t stream);

// data *= *scale in place. Every block returns at once when *scale == 1, so
// the common `loss.backward()` moves no memory and needs no host sync.
cudaError_t launch_scale_in_place(void* data, DType dtype, int64_t numel,
                                  const void* scale, DType scale_dtype,
                                  int num_sms, cudaStream_t stream);

}  // namespace fusedloss
