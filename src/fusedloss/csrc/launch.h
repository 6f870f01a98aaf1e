// The boundary between the host code (torch tensors, glue.h) and the
// kernels (plain pointers, the *.cu files). The kernels include no torch
// header, so they compile quickly and can be shipped on their own.
//
// Every pointer passed here is 16-byte aligned: the kernels load and store
// whole 16-byte words, and the host code copies an operand whose storage
// offset breaks that.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "losses.cuh"

// Where the .cu files define what they define: namespace fusedloss, or in a build
// that compiles each once per input dtype (FUSEDLOSS_SHARD, with
// FUSEDLOSS_SHARD_INPUT its type; build.py), a namespace of that shard's inside it,
// from which shards.h's launchers pick.
#ifdef FUSEDLOSS_SHARD
#define FUSEDLOSS_KERNELS_BEGIN \
  namespace fusedloss {         \
  namespace FUSEDLOSS_SHARD {
#define FUSEDLOSS_KERNELS_END \
  }                           \
  }
#else
#define FUSEDLOSS_KERNELS_BEGIN namespace fusedloss {
#define FUSEDLOSS_KERNELS_END }
#endif

namespace fusedloss {

#define FUSEDLOSS_LOSS_KIND(Name, name, param, domain) k##Name,
enum class LossKind : int { FUSEDLOSS_FOR_EACH_LOSS(FUSEDLOSS_LOSS_KIND) };
#undef FUSEDLOSS_LOSS_KIND

// Where a loss's parameter may lie (the last column of losses.cuh's table).
enum class ParamDomain : int { kPositive, kUnitInterval };

enum class DType : int { kFloat32, kFloat16, kBFloat16, kFloat64 };

// A multiplier that the weighted reductions read on the device, so that a
// count kept on the GPU (a mask's sum, an all-reduced token count) costs no sync:
// host * *scale / *divisor, each pointer a one-element tensor or null (1).
struct DeviceScale {
  double host = 1.0;
  const void* scale = nullptr;
  DType scale_dtype = DType::kFloat32;
  const void* divisor = nullptr;
  DType divisor_dtype = DType::kFloat32;
};

// A weight per element, read where it lies. The loss's dimensions are merged
// into runs, innermost first, that the weight either spans (stride: its stride
// over the run) or broadcasts over (stride 0); element e's weight is
// weight[sum of e's coordinate in each run times the run's stride]. An
// outermost run the weight broadcasts over is left out: it adds nothing.
// `dense`: a weight of the loss's own size, weight[e]. `vector_loads`: every
// chunk that stays within the innermost run starts at a 16-byte-aligned
// weight. `index_32bit`: all indices fit 32 bits, and q / size[d] =
// (umulhi(q, magic[d]) + q) >> shift[d] (Granlund and Montgomery's division by
// invariant integers); at most kWideWeightRuns runs where they don't. A loss
// of up to kWeightRuns dimensions has at most as many runs. In float32, or
// float64 with fp64 operands. Null: every weight is 1.
constexpr int kWeightRuns = 4;
constexpr int kWideWeightRuns = 2;
struct ElementWeight {
  const void* weight = nullptr;
  int runs = 0;  // 0: one weight for every element
  int64_t size[kWeightRuns] = {};
  int64_t stride[kWeightRuns] = {};
  uint32_t magic[kWeightRuns] = {};
  uint32_t shift[kWeightRuns] = {};
  bool dense = false;
  bool vector_loads = false;
  bool index_32bit = false;
};

// A multiple of every weighted reduction's tile: rows of a multiple of it are whole tiles.
constexpr int64_t kRowTilingMultiple = 8192;

// One elementwise loss over `numel` contiguous elements. `param` is beta for
// Smooth L1 (> 0), delta for Huber and c for pseudo-Huber (> 0); unused otherwise. With `autocast`, the
// loss is computed as CUDA autocast computes it, in float32 from 16-bit
// operands read as they are (only for the pairs that reads_under_autocast names).
struct LossProblem {
  LossKind loss;
  double param;
  const void* input;
  DType input_dtype;
  const void* target;
  DType target_dtype;
  int64_t numel;
  bool autocast = false;
  // The grad_output a forward's gradients are multiplied by: the one the last backward
  // of the same loss saw, predicted, so that each gradient is rounded once, after every
  // factor, and backward has nothing to do when the prediction holds.
  double expected_grad_output = 1.0;
  // The weighted reductions' only (launch_weighted_reduced_loss*).
  ElementWeight weight;
  DeviceScale scale;
  // `weight` holds each element's param, which replaces `param`, and multiplies nothing:
  // a loss that TakesParamPerElement (losses.cuh) only, with no weight gradient and no rows.
  bool param_per_element = false;
  // With param_per_element only: a target that broadcasts to the loss's shape, laid out as a
  // weight is and read where it lies (`target` is its storage). Null `weight`: the target
  // has the loss's shape.
  ElementWeight broadcast_target;
  // > 0: the weight is constant along rows of this many elements, a multiple of
  // kRowTilingMultiple (a weight per sample or per channel), and the forward reduction
  // may sum the loss of each row (launch_weighted_reduced_loss).
  int64_t row_length = 0;
};

// What a backward launch does besides computing the gradients. `history`: null, or a
// slot of host-mapped memory (grad_output_history in fusedloss_ops.cpp) where the kernel
// writes grad_output and whether it differed from problem.expected_grad_output, for the
// next forward to predict from without a sync.
// `correct_in_place`: the gradient buffers already hold the forward's gradients for
// problem.expected_grad_output; they are recomputed only when grad_output differs from
// it (in its bits), by one wave of `num_sms` SMs' blocks that otherwise exits at once.
struct BackwardOptions {
  double* history = nullptr;
  bool correct_in_place = false;
  int num_sms = 0;
};

// The pairs the kernels read directly under autocast: float16 or bfloat16 with
// any 16- or 32-bit float. The host converts 16-bit operands paired with float64.
constexpr bool reads_under_autocast(DType input, DType target) {
  const bool input_16 = input == DType::kFloat16 || input == DType::kBFloat16;
  const bool target_16 = target == DType::kFloat16 || target == DType::kBFloat16;
  return (input_16 || target_16) && input != DType::kFloat64 && target != DType::kFloat64;
}

// A mean or sum into the 0-d `out`, in the loss's dtype (as for reduction='none'
// below): each tile's partial sum is added exactly into `scratch`
// (reduced_loss_scratch_bytes; the launch zeroes it), so the result has the
// same bits on every run and needs no memory in proportion to N; and, where
// the pointers are set, d loss / d input and d loss / d target (times 1/N for
// a mean and times problem.expected_grad_output) in the same pass. A small
// loss with no gradient to write is one launch that needs no scratch (0 bytes;
// `scratch` may be null); a middling one two launches whose scratch need not
// be zeroed.
int64_t reduced_loss_scratch_bytes(const LossProblem& problem, bool writes_gradients);
cudaError_t launch_reduced_loss(const LossProblem& problem, void* scratch, void* grad_input,
                                void* grad_target, bool mean, void* out, cudaStream_t stream);

// A weighted sum, scale * sum_e weight(e) * loss(e), into the 0-d `out` in the
// loss's dtype, and where the pointers are set the gradients (times weight,
// scale and problem.expected_grad_output) in the same pass. `grad_weight` (the loss's dtype and size) gets
// scale * loss(e) (times the expected grad_output), d out / d weight(e) for a
// fixed scale; it is written only beside grad_input or grad_target
// (cudaErrorInvalidValue alone). With problem.row_length set, `grad_weight` (float64,
// one per row) gets instead each row's sum of loss(e), in any pass. Each tile's
// sum goes to `partials` (weighted_reduced_loss_partials doubles, given whether the
// row sums are written), which a second launch adds up in a fixed order: the same
// bits on every run, with weights of either sign.
int64_t weighted_reduced_loss_partials(const LossProblem& problem, bool row_sums);
cudaError_t launch_weighted_reduced_loss(const LossProblem& problem, double* partials, void* grad_input,
                                         void* grad_target, void* grad_weight, void* out, cudaStream_t stream);

// Its backward for a one-element `grad_output` in the loss's dtype: the
// forward's gradients for grad_output, recomputed, with the bits the forward
// gives when it expects that grad_output.
cudaError_t launch_weighted_reduced_loss_backward(const LossProblem& problem, const void* grad_output,
                                                  void* grad_input, void* grad_target, void* grad_weight,
                                                  const BackwardOptions& options, cudaStream_t stream);

// The loss reduced over its trailing dimensions, one value per row of `problem.numel /
// rows` elements, into `out` (rows values in the loss's dtype): mean or sum, each row's
// tiles summed into `partials` (per_sample_loss_partials doubles), which a second
// launch adds up in a fixed order. Every row starts on a 16-byte boundary of both
// operands; at most kPerSampleMaxRows rows.
constexpr int64_t kPerSampleMaxRows = 65535;
int64_t per_sample_loss_partials(const LossProblem& problem, int64_t rows);
cudaError_t launch_per_sample_loss(const LossProblem& problem, int64_t rows, double* partials, bool mean, void* out,
                                   cudaStream_t stream);

// reduction='none'. The output dtype is the promoted dtype of the pair, or the
// input's dtype for Huber (as in PyTorch).
cudaError_t launch_pointwise_loss(const LossProblem& problem, void* out, cudaStream_t stream);

// reduction='none' backward. `grad_output` has the loss's dtype; with
// `grad_output_is_scalar` one value is broadcast to every element.
cudaError_t launch_pointwise_loss_backward(const LossProblem& problem, const void* grad_output,
                                           bool grad_output_is_scalar, void* grad_input, void* grad_target,
                                           cudaStream_t stream);

// The same for a grad_output that broadcasts to the loss's shape (the backward
// of a sum over some dimensions expands one), read where it lies, laid out as
// a weight is (ElementWeight).
cudaError_t launch_pointwise_loss_backward_broadcast(const LossProblem& problem, const ElementWeight& grad_output,
                                                     void* grad_input, void* grad_target, cudaStream_t stream);

// A mean's or sum's backward, for a one-element `grad_output` in the loss's
// dtype: d loss / d input and d loss / d target times grad_output (times 1/N
// for a mean), each rounded once, with the bits the forward gives when it
// expects that grad_output.
cudaError_t launch_reduced_loss_backward(const LossProblem& problem, const void* grad_output, bool mean,
                                         void* grad_input, void* grad_target, const BackwardOptions& options,
                                         cudaStream_t stream);

}  // namespace fusedloss
