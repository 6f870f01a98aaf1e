// CUDA kernels for the fusedloss:: operators, whose schemas, fake kernels and
// autograd are defined in Python (fusedloss/ops.py). This file turns tensors
// into a LossProblem, allocates outputs, and launches on the current stream of
// the tensors' own device.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <cstdint>
#include <vector>

#include "launch.h"

namespace fusedloss {
namespace {

LossKind parse_loss(c10::string_view name) {
#define FUSEDLOSS_PARSE_LOSS(Name, text, param) \
  if (name == text) return LossKind::k##Name;
  FUSEDLOSS_FOR_EACH_LOSS(FUSEDLOSS_PARSE_LOSS)
#undef FUSEDLOSS_PARSE_LOSS
  TORCH_CHECK(false, "fusedloss: unknown loss '", name, "'");
}

// The name of the loss's parameter, which must be > 0, or "" when it takes none.
const char* param_name(LossKind kind) {
#define FUSEDLOSS_PARAM_NAME(Name, text, param) \
  if (kind == LossKind::k##Name) return param;
  FUSEDLOSS_FOR_EACH_LOSS(FUSEDLOSS_PARAM_NAME)
#undef FUSEDLOSS_PARAM_NAME
  return "";
}

bool parse_mean(c10::string_view reduction) {
  TORCH_CHECK(reduction == "mean" || reduction == "sum",
              "fusedloss: reduction must be 'mean' or 'sum', got '", reduction, "'");
  return reduction == "mean";
}

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kDouble: return DType::kFloat64;
    default: TORCH_CHECK(false, "fusedloss: unsupported dtype ", t);
  }
}

// The operands as the kernels take them: broadcast to one shape, contiguous
// (the slower path copies views that are not), and both fp64 when either is.
struct Operands {
  at::Tensor input, target;
  at::ScalarType loss_dtype;  // what PyTorch returns, and what the kernels write
  LossProblem problem;
};

bool is_aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Contiguous and 16-byte aligned, as the kernels read it (launch.h): a view at
// an odd storage offset is copied, like a non-contiguous one.
at::Tensor as_kernel_layout(const at::Tensor& t) {
  if (!t.is_contiguous()) return t.contiguous();
  return is_aligned16(t) ? t : t.clone();
}

// Skips each step that has nothing to do: this runs on every call. The kernels
// take fp64 only paired with fp64, so pairs with one fp64 side meet in `common`
// here; other mixed pairs are read as they are.
at::Tensor as_kernel_operand(const at::Tensor& t, at::ScalarType common, at::IntArrayRef shape) {
  const bool fp64_pair = common == at::kDouble || t.scalar_type() == at::kDouble;
  at::Tensor out = fp64_pair && t.scalar_type() != common ? t.to(common) : t;
  if (out.sizes() != shape) out = out.expand(shape);
  return as_kernel_layout(out);
}

// The shape that input and target broadcast to, or PyTorch's error when they don't.
std::vector<int64_t> broadcast_shape(at::IntArrayRef a, at::IntArrayRef b) {
  const int64_t rank = static_cast<int64_t>(std::max(a.size(), b.size()));
  const int64_t skip_a = rank - static_cast<int64_t>(a.size());
  const int64_t skip_b = rank - static_cast<int64_t>(b.size());
  std::vector<int64_t> shape(static_cast<size_t>(rank));
  for (int64_t i = 0; i < rank; ++i) {
    const int64_t size_a = i < skip_a ? 1 : a[i - skip_a];
    const int64_t size_b = i < skip_b ? 1 : b[i - skip_b];
    TORCH_CHECK(size_a == size_b || size_a == 1 || size_b == 1, "The size of tensor a (", size_a,
                ") must match the size of tensor b (", size_b, ") at non-singleton dimension ", i);
    shape[i] = size_a == 1 ? size_b : size_a;
  }
  return shape;
}

bool is_16bit(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// The operand as CUDA autocast hands it to these losses: float32 if 16-bit.
at::Tensor as_autocast_would(const at::Tensor& t) { return is_16bit(t.scalar_type()) ? t.to(at::kFloat) : t; }

// With `autocast`, the loss is the one of the operands as autocast would cast
// them; the pairs the kernels read directly (reads_under_autocast) are not converted.
Operands prepare(const at::Tensor& input_as_given, const at::Tensor& target_as_given, c10::string_view loss,
                 double param, bool autocast = false) {
  const bool reads_directly = autocast && reads_under_autocast(to_dtype(input_as_given.scalar_type()),
                                                               to_dtype(target_as_given.scalar_type()));
  const bool converts = autocast && !reads_directly;
  const at::Tensor input = converts ? as_autocast_would(input_as_given) : input_as_given;
  const at::Tensor target = converts ? as_autocast_would(target_as_given) : target_as_given;
  TORCH_CHECK(input.is_cuda() && input.device() == target.device(),
              "fusedloss: input and target must be on the same CUDA device, got ", input.device(),
              " and ", target.device());
  const LossKind kind = parse_loss(loss);
  const char* param_needed = param_name(kind);
  TORCH_CHECK(param_needed[0] == '\0' || param > 0, "fusedloss: ", loss, " needs ", param_needed, " > 0, got ",
              param);
  (void)to_dtype(input.scalar_type());  // rejects dtypes the kernels don't take
  (void)to_dtype(target.scalar_type());
  // PyTorch computes Huber in the input's dtype (the target is converted to it),
  // the other losses in the promoted dtype.
  const at::ScalarType common = reads_directly               ? at::kFloat
                                : kind == LossKind::kHuber ? input.scalar_type()
                                                           : c10::promoteTypes(input.scalar_type(), target.scalar_type());

  Operands ops;
  ops.loss_dtype = common;
  const std::vector<int64_t> shape = broadcast_shape(input.sizes(), target.sizes());
  ops.input = as_kernel_operand(input, common, shape);
  ops.target = as_kernel_operand(target, common, shape);
  ops.problem = LossProblem{kind,
                            param,
                            ops.input.data_ptr(),
                            to_dtype(ops.input.scalar_type()),
                            ops.target.data_ptr(),
                            to_dtype(ops.target.scalar_type()),
                            ops.input.numel(),
                            reads_directly};
  return ops;
}

// A gradient buffer in the operand's broadcast shape, or an empty tensor when
// that gradient is not wanted.
at::Tensor maybe_grad_buffer(bool wanted, const at::Tensor& like) {
  return wanted ? at::empty_like(like, at::MemoryFormat::Contiguous) : at::empty({0}, like.options());
}

at::Tensor maybe_grad_buffer(bool wanted, const at::TensorOptions& options, at::IntArrayRef shape) {
  return wanted ? at::empty(shape, options) : at::empty({0}, options);
}

void* data_or_null(const at::Tensor& t) { return t.numel() > 0 ? t.data_ptr() : nullptr; }

// Skips the dispatch of a conversion to the dtype a tensor has: this runs on every call.
at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) { return t.scalar_type() == dtype ? t : t.to(dtype); }

// Two doubles per slot: the grad_output the last backward in that slot saw, and 1
// where it was not the one that backward's forward expected, else 0
// (fusedloss/grad_output_prediction.py); 1 and 0 until then. Host memory that the
// kernels write and the host reads without a sync: mapped and portable, so under
// unified addressing its address is valid on every device. Allocated on first use,
// never freed.
constexpr int64_t kHistorySlots = 64;

double* history_table() {
  static double* const table = [] {
    void* p = nullptr;
    C10_CUDA_CHECK(cudaHostAlloc(&p, kHistorySlots * 2 * sizeof(double), cudaHostAllocMapped | cudaHostAllocPortable));
    double* notes = static_cast<double*>(p);
    for (int64_t slot = 0; slot < kHistorySlots; ++slot) {
      notes[2 * slot] = 1.0;
      notes[2 * slot + 1] = 0.0;
    }
    return notes;
  }();
  return table;
}

at::Tensor grad_output_history() {
  return at::from_blob(history_table(), {kHistorySlots, 2}, at::TensorOptions().dtype(at::kDouble));
}

double* history_slot(int64_t slot) {
  TORCH_CHECK(slot < kHistorySlots, "fusedloss: history slot ", slot, " out of range");
  return slot < 0 ? nullptr : history_table() + 2 * slot;
}

int current_device_sm_count() {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return count;
}

// A backward that notes grad_output in `slot`, and with `correct_in_place` corrects
// gradients the forward wrote for another grad_output (BackwardOptions).
BackwardOptions backward_options(int64_t slot, bool correct_in_place) {
  BackwardOptions options;
  options.history = history_slot(slot);
  options.correct_in_place = correct_in_place;
  options.num_sms = correct_in_place ? current_device_sm_count() : 0;
  return options;
}

// A gradient buffer that the forward wrote, as the kernels write into it: of the
// operand's shape as they read it, in `dtype`; null when it is empty (not wanted).
void* written_gradient(const at::Tensor& grad, const at::Tensor& operand, at::ScalarType dtype) {
  if (grad.numel() == 0) return nullptr;
  TORCH_CHECK(grad.device() == operand.device() && grad.sizes() == operand.sizes() && grad.scalar_type() == dtype &&
                  grad.is_contiguous() && is_aligned16(grad),
              "fusedloss: a gradient to correct must be the forward's own buffer: contiguous, of shape ",
              operand.sizes(), " and dtype ", dtype, " on ", operand.device());
  return grad.data_ptr();
}

void* written_gradient(const at::Tensor& grad, const at::Tensor& operand) {
  return written_gradient(grad, operand, operand.scalar_type());
}

at::Tensor pointwise_loss(const at::Tensor& input, const at::Tensor& target, c10::string_view loss,
                          double param, bool autocast) {
  const c10::cuda::CUDAGuard guard(input.device());
  Operands ops = prepare(input, target, loss, param, autocast);
  at::Tensor out = at::empty(ops.input.sizes(), ops.input.options().dtype(ops.loss_dtype));
  C10_CUDA_CHECK(launch_pointwise_loss(ops.problem, out.data_ptr(), c10::cuda::getCurrentCUDAStream()));
  return out;
}

// history_slot is autograd's, for the backward; expected_grad_output multiplies the
// gradients the forward writes (LossProblem).
std::tuple<at::Tensor, at::Tensor, at::Tensor> reduced_loss(const at::Tensor& input, const at::Tensor& target,
                                                            c10::string_view loss, double param,
                                                            c10::string_view reduction,
                                                            std::array<bool, 2> output_mask, int64_t,
                                                            double expected_grad_output, bool autocast) {
  const c10::cuda::CUDAGuard guard(input.device());
  const bool mean = parse_mean(reduction);
  Operands ops = prepare(input, target, loss, param, autocast);
  ops.problem.expected_grad_output = expected_grad_output;
  at::Tensor out = at::empty({}, ops.input.options().dtype(ops.loss_dtype));
  at::Tensor grad_input = maybe_grad_buffer(output_mask[0], ops.input);
  at::Tensor grad_target = maybe_grad_buffer(output_mask[1], ops.target);
  const int64_t scratch_bytes = reduced_loss_scratch_bytes(ops.problem, output_mask[0] || output_mask[1]);
  const at::Tensor scratch =
      scratch_bytes > 0 ? at::empty({scratch_bytes}, ops.input.options().dtype(at::kByte)) : at::Tensor();
  C10_CUDA_CHECK(launch_reduced_loss(ops.problem, scratch.defined() ? scratch.data_ptr() : nullptr,
                                     data_or_null(grad_input),
                                     data_or_null(grad_target), mean, out.data_ptr(),
                                     c10::cuda::getCurrentCUDAStream()));
  return {out, as_dtype(grad_input, input.scalar_type()), as_dtype(grad_target, target.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> reduced_loss_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                         const at::Tensor& target, c10::string_view loss,
                                                         double param, c10::string_view reduction,
                                                         std::array<bool, 2> output_mask, int64_t history_slot_index,
                                                         double expected_grad_output, bool autocast) {
  const c10::cuda::CUDAGuard guard(input.device());
  const bool mean = parse_mean(reduction);
  Operands ops = prepare(input, target, loss, param, autocast);
  ops.problem.expected_grad_output = expected_grad_output;  // for the note only
  TORCH_CHECK(grad_output.device() == input.device() && grad_output.numel() == 1,
              "fusedloss: reduced_loss_backward takes a one-element grad_output on ", input.device());
  const at::Tensor go = as_dtype(grad_output, ops.loss_dtype);  // one element: its layout does not matter
  at::Tensor grad_input = maybe_grad_buffer(output_mask[0], ops.input);
  at::Tensor grad_target = maybe_grad_buffer(output_mask[1], ops.target);
  C10_CUDA_CHECK(launch_reduced_loss_backward(ops.problem, go.data_ptr(), mean, data_or_null(grad_input),
                                              data_or_null(grad_target),
                                              backward_options(history_slot_index, false),
                                              c10::cuda::getCurrentCUDAStream()));
  return {as_dtype(grad_input, input.scalar_type()), as_dtype(grad_target, target.scalar_type())};
}

// The gradients a forward wrote for expected_grad_output, recomputed in place for
// grad_output where that differs (decided on the GPU: no sync).
void reduced_loss_backward_(at::Tensor& grad_input, at::Tensor& grad_target, const at::Tensor& grad_output,
                        const at::Tensor& input, const at::Tensor& target, c10::string_view loss, double param,
                        c10::string_view reduction, double expected_grad_output, int64_t history_slot_index,
                        bool autocast) {
  const c10::cuda::CUDAGuard guard(input.device());
  const bool mean = parse_mean(reduction);
  Operands ops = prepare(input, target, loss, param, autocast);
  ops.problem.expected_grad_output = expected_grad_output;
  TORCH_CHECK(grad_output.device() == input.device() && grad_output.numel() == 1,
              "fusedloss: reduced_loss_backward_ takes a one-element grad_output on ", input.device());
  const at::Tensor go = as_dtype(grad_output, ops.loss_dtype);
  C10_CUDA_CHECK(launch_reduced_loss_backward(ops.problem, go.data_ptr(), mean,
                                              written_gradient(grad_input, ops.input),
                                              written_gradient(grad_target, ops.target),
                                              backward_options(history_slot_index, true),
                                              c10::cuda::getCurrentCUDAStream()));
}

// A build may leave the kernels of the Weighted policy out (the KernelBench
// files, which need none of them and compile every kernel in one translation
// unit): the weighted reductions, and the backward that reads an expanded
// grad_output where it lies (such a build copies it to the loss's size).
#ifdef FUSEDLOSS_NO_WEIGHTED_KERNELS
constexpr bool kWeightedPolicyKernels = false;
#else
constexpr bool kWeightedPolicyKernels = true;
#endif

// A weight as the weighted kernels read it (ElementWeight): in the loss's math
// dtype, contiguous in its own shape when the loss's dimensions fall into as
// many runs as the kernels take; other weights are expanded first.
struct KernelWeight {
  at::Tensor tensor;  // undefined: no weight
  ElementWeight layout;
};

KernelWeight as_kernel_weight(const c10::optional<at::Tensor>& weight, at::IntArrayRef shape,
                              at::ScalarType math_dtype, const at::Device& device) {
  KernelWeight out;
  if (!weight.has_value() || !weight->defined()) return out;
  const at::Tensor& w = *weight;
  TORCH_CHECK(w.device() == device, "fusedloss: the weight is on ", w.device(), ", expected ", device);
  const int64_t rank = static_cast<int64_t>(shape.size());
  const int64_t skip = rank - w.dim();
  TORCH_CHECK(skip >= 0, "fusedloss: a weight of shape ", w.sizes(), " does not broadcast to the loss's shape ", shape);
  // The weight's size along each of the loss's dimensions (1 where it broadcasts).
  std::vector<int64_t> sizes(rank, 1);
  for (int64_t i = skip; i < rank; ++i) {
    sizes[i] = w.size(i - skip);
    TORCH_CHECK(sizes[i] == shape[i] || sizes[i] == 1, "fusedloss: a weight of shape ", w.sizes(),
                " does not broadcast to the loss's shape ", shape);
  }
  // The loss's dimensions of size > 1, merged into runs the weight spans or broadcasts over.
  struct Run {
    int64_t size;
    bool spanned;
    int64_t first_dim, last_dim;  // the loss's dimensions it merges
  };
  const auto runs_of = [&] {
    std::vector<Run> runs;  // innermost first
    for (int64_t i = rank - 1; i >= 0; --i) {
      if (shape[i] == 1) continue;
      const bool spanned = sizes[i] != 1;
      if (!runs.empty() && runs.back().spanned == spanned) {
        runs.back().size *= shape[i];
        runs.back().first_dim = i;
      } else {
        runs.push_back({shape[i], spanned, i, i});
      }
    }
    if (!runs.empty() && !runs.back().spanned) runs.pop_back();
    return runs;
  };
  std::vector<Run> runs = runs_of();
  const int64_t numel = c10::multiply_integers(shape);
  if (numel == 0) runs.clear();  // nothing to read, and no run to divide by
  const bool index_32bit = numel <= static_cast<int64_t>(std::numeric_limits<uint32_t>::max());
  at::Tensor stored = as_dtype(w, math_dtype);
  const int64_t max_runs = index_32bit ? kWeightRuns : kWideWeightRuns;
  if (static_cast<int64_t>(runs.size()) > max_runs) {
    // More runs than the kernels take: the weight is first expanded over the shortest
    // broadcast runs between two spanned ones, each of which merges three runs into
    // one, until the runs fit; it grows by the product of their lengths. (A broadcast
    // innermost run merges two, and expanding it too never saves one, since then the
    // count of runs is even, as both limits are.)
    static_assert(kWeightRuns % 2 == 0 && kWideWeightRuns % 2 == 0);
    std::vector<Run> between;
    for (size_t r = 1; r < runs.size(); ++r) {
      if (!runs[r].spanned) between.push_back(runs[r]);
    }
    std::sort(between.begin(), between.end(), [](const Run& a, const Run& b) { return a.size < b.size; });
    const int64_t merges = (static_cast<int64_t>(runs.size()) - max_runs + 1) / 2;
    TORCH_INTERNAL_ASSERT(merges <= static_cast<int64_t>(between.size()));
    for (int64_t m = 0; m < merges; ++m) {
      for (int64_t i = between[m].first_dim; i <= between[m].last_dim; ++i) sizes[i] = shape[i];
    }
    runs = runs_of();
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(runs.size()) <= max_runs);
    stored = stored.expand(sizes);
  }
  out.tensor = as_kernel_layout(stored);
  ElementWeight& layout = out.layout;
  layout.weight = out.tensor.data_ptr();
  layout.runs = static_cast<int>(runs.size());
  int64_t stride = 1;  // the stored weight is contiguous
  for (size_t d = 0; d < runs.size(); ++d) {
    layout.size[d] = runs[d].size;
    layout.stride[d] = runs[d].spanned ? stride : 0;
    if (runs[d].spanned) stride *= runs[d].size;
    if (index_32bit) {
      // The smallest shift with 2^shift >= size, and magic = 2^32 (2^shift - size) / size + 1 < 2^32.
      const uint64_t size = static_cast<uint64_t>(runs[d].size);
      uint32_t shift = 0;
      while ((uint64_t{1} << shift) < size) ++shift;
      layout.shift[d] = shift;
      layout.magic[d] = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - size)) / size + 1);
    }
  }
  layout.dense = runs.size() == 1 && runs[0].spanned && runs[0].size == numel;
  // A chunk starts at a multiple of its width (at most 8): so does its weight's index
  // when the innermost run is a multiple of 8 long (a dense weight loads as the operands do).
  layout.vector_loads = !runs.empty() && runs[0].spanned && runs[0].size % 8 == 0;
  layout.index_32bit = index_32bit;
  return out;
}

// grad_output as the kernels read it: one value (the backward of .sum() or
// .mean()), of the loss's shape, or expanded over some dimensions (the
// backward of a sum over those), which is read where it lies, as a weight is.
std::tuple<at::Tensor, at::Tensor> pointwise_loss_backward(const at::Tensor& grad_output,
                                                           const at::Tensor& input,
                                                           const at::Tensor& target,
                                                           c10::string_view loss, double param,
                                                           std::array<bool, 2> output_mask, bool autocast) {
  const c10::cuda::CUDAGuard guard(input.device());
  Operands ops = prepare(input, target, loss, param, autocast);
  TORCH_CHECK(grad_output.device() == input.device(), "fusedloss: grad_output is on ", grad_output.device(),
              ", expected ", input.device());
  at::Tensor go = grad_output.to(ops.loss_dtype).expand(ops.input.sizes());
  bool go_is_scalar = go.numel() > 0, go_is_expanded = false;
  for (int64_t i = 0; i < go.dim(); ++i) {
    go_is_scalar = go_is_scalar && go.stride(i) == 0;
    go_is_expanded = go_is_expanded || (go.stride(i) == 0 && go.size(i) > 1);
  }
  at::Tensor grad_input = maybe_grad_buffer(output_mask[0], ops.input);
  at::Tensor grad_target = maybe_grad_buffer(output_mask[1], ops.target);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if constexpr (kWeightedPolicyKernels) {
    if (go_is_expanded && !go_is_scalar) {
      std::vector<int64_t> sizes = go.sizes().vec();
      for (int64_t i = 0; i < go.dim(); ++i) {
        if (go.stride(i) == 0) sizes[i] = 1;
      }
      const at::ScalarType math = ops.loss_dtype == at::kDouble ? at::kDouble : at::kFloat;
      const KernelWeight broadcast = as_kernel_weight(go.as_strided(sizes, go.strides()), go.sizes(), math,
                                                      input.device());
      C10_CUDA_CHECK(launch_pointwise_loss_backward_broadcast(ops.problem, broadcast.layout, data_or_null(grad_input),
                                                              data_or_null(grad_target), stream));
      return {as_dtype(grad_input, input.scalar_type()), as_dtype(grad_target, target.scalar_type())};
    }
  }
  go = go_is_scalar ? go.as_strided({1}, {1}) : as_kernel_layout(go);
  C10_CUDA_CHECK(launch_pointwise_loss_backward(ops.problem, go.data_ptr(), go_is_scalar, data_or_null(grad_input),
                                                data_or_null(grad_target), stream));
  return {as_dtype(grad_input, input.scalar_type()), as_dtype(grad_target, target.scalar_type())};
}

#ifndef FUSEDLOSS_NO_WEIGHTED_KERNELS
// A one-element multiplier on the device (DeviceScale), as a dtype the kernels read.
at::Tensor as_device_scalar(const c10::optional<at::Tensor>& t, const at::Device& device) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  TORCH_CHECK(t->device() == device && t->numel() == 1, "fusedloss: scale and divisor are one-element tensors on ",
              device, ", got ", t->sizes(), " on ", t->device());
  const at::ScalarType dtype = t->scalar_type();
  const bool readable = dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
  return readable ? *t : t->to(at::kDouble);
}

struct WeightedProblem {
  Operands ops;
  KernelWeight weight;
  at::Tensor scale, divisor;  // kept alive for the launch
};

WeightedProblem prepare_weighted(const at::Tensor& input, const at::Tensor& target,
                                 const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& scale,
                                 const c10::optional<at::Tensor>& divisor, double host_scale, c10::string_view loss,
                                 double param, bool autocast) {
  WeightedProblem w;
  w.ops = prepare(input, target, loss, param, autocast);
  const at::ScalarType math = w.ops.loss_dtype == at::kDouble ? at::kDouble : at::kFloat;
  w.weight = as_kernel_weight(weight, w.ops.input.sizes(), math, input.device());
  w.scale = as_device_scalar(scale, input.device());
  w.divisor = as_device_scalar(divisor, input.device());
  LossProblem& p = w.ops.problem;
  p.weight = w.weight.layout;
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
at::Tensor maybe_weight_grad_buffer(std::array<bool, 3> output_mask, const WeightedProblem& w) {
  TORCH_CHECK(!output_mask[2] || output_mask[0] || output_mask[1],
              "fusedloss: weighted_loss writes the weight's gradient only with input's or target's");
  return maybe_grad_buffer(output_mask[2], w.ops.input.options().dtype(w.ops.loss_dtype), w.ops.input.sizes());
}

// history_slot is autograd's, for the backward; expected_grad_output as in reduced_loss.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> weighted_loss(
    const at::Tensor& input, const at::Tensor& target, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& divisor, double host_scale,
    c10::string_view loss, double param, std::array<bool, 3> output_mask, int64_t, double expected_grad_output,
    bool autocast) {
  const c10::cuda::CUDAGuard guard(input.device());
  WeightedProblem w = prepare_weighted(input, target, weight, scale, divisor, host_scale, loss, param, autocast);
  w.ops.problem.expected_grad_output = expected_grad_output;
  const at::Tensor& operand = w.ops.input;
  at::Tensor out = at::empty({}, operand.options().dtype(w.ops.loss_dtype));
  at::Tensor grad_input = maybe_grad_buffer(output_mask[0], operand);
  at::Tensor grad_target = maybe_grad_buffer(output_mask[1], w.ops.target);
  at::Tensor grad_weight = maybe_weight_grad_buffer(output_mask, w);
  const int64_t partials = std::max<int64_t>(1, weighted_reduced_loss_partials(w.ops.problem));
  at::Tensor partial_sums = at::empty({partials}, operand.options().dtype(at::kDouble));
  C10_CUDA_CHECK(launch_weighted_reduced_loss(w.ops.problem, partial_sums.data_ptr<double>(),
                                              data_or_null(grad_input), data_or_null(grad_target),
                                              data_or_null(grad_weight), out.data_ptr(),
                                              c10::cuda::getCurrentCUDAStream()));
  return {out, as_dtype(grad_input, input.scalar_type()), as_dtype(grad_target, target.scalar_type()), grad_weight};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> weighted_loss_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& target,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& scale,
    const c10::optional<at::Tensor>& divisor, double host_scale, c10::string_view loss, double param,
    std::array<bool, 3> output_mask, int64_t history_slot_index, double expected_grad_output, bool autocast) {
  const c10::cuda::CUDAGuard guard(input.device());
  WeightedProblem w = prepare_weighted(input, target, weight, scale, divisor, host_scale, loss, param, autocast);
  w.ops.problem.expected_grad_output = expected_grad_output;  // for the note only
  TORCH_CHECK(grad_output.device() == input.device() && grad_output.numel() == 1,
              "fusedloss: weighted_loss_backward takes a one-element grad_output on ", input.device());
  const at::Tensor go = as_dtype(grad_output, w.ops.loss_dtype);
  at::Tensor grad_input = maybe_grad_buffer(output_mask[0], w.ops.input);
  at::Tensor grad_target = maybe_grad_buffer(output_mask[1], w.ops.target);
  at::Tensor grad_weight = maybe_weight_grad_buffer(output_mask, w);
  C10_CUDA_CHECK(launch_weighted_reduced_loss_backward(w.ops.problem, go.data_ptr(), data_or_null(grad_input),
                                                       data_or_null(grad_target), data_or_null(grad_weight),
                                                       backward_options(history_slot_index, false),
                                                       c10::cuda::getCurrentCUDAStream()));
  return {as_dtype(grad_input, input.scalar_type()), as_dtype(grad_target, target.scalar_type()), grad_weight};
}

// weighted_loss's gradients for expected_grad_output, recomputed in place for
// grad_output where that differs, as reduced_loss_backward_.
void weighted_loss_backward_(at::Tensor& grad_input, at::Tensor& grad_target, at::Tensor& grad_weight,
                                 const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& target,
                                 const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& scale,
                                 const c10::optional<at::Tensor>& divisor, double host_scale, c10::string_view loss,
                                 double param, double expected_grad_output, int64_t history_slot_index,
                                 bool autocast) {
  const c10::cuda::CUDAGuard guard(input.device());
  WeightedProblem w = prepare_weighted(input, target, weight, scale, divisor, host_scale, loss, param, autocast);
  w.ops.problem.expected_grad_output = expected_grad_output;
  TORCH_CHECK(grad_output.device() == input.device() && grad_output.numel() == 1,
              "fusedloss: weighted_loss_backward_ takes a one-element grad_output on ", input.device());
  const at::Tensor go = as_dtype(grad_output, w.ops.loss_dtype);
  C10_CUDA_CHECK(launch_weighted_reduced_loss_backward(
      w.ops.problem, go.data_ptr(), written_gradient(grad_input, w.ops.input),
      written_gradient(grad_target, w.ops.target), written_gradient(grad_weight, w.ops.input, w.ops.loss_dtype),
      backward_options(history_slot_index, true), c10::cuda::getCurrentCUDAStream()));
}
#endif  // FUSEDLOSS_NO_WEIGHTED_KERNELS

}  // namespace

// The operators' namespace: fusedloss's own, unless a build that must not meet
// it in the same process (the KernelBench files) names another.
#ifndef FUSEDLOSS_OPS_NAMESPACE
#define FUSEDLOSS_OPS_NAMESPACE fusedloss
#endif

TORCH_LIBRARY_IMPL(FUSEDLOSS_OPS_NAMESPACE, CUDA, m) {
  m.impl("pointwise_loss", &pointwise_loss);
  m.impl("pointwise_loss_backward", &pointwise_loss_backward);
  m.impl("reduced_loss", &reduced_loss);
  m.impl("reduced_loss_backward", &reduced_loss_backward);
  m.impl("reduced_loss_backward_", &reduced_loss_backward_);
#ifndef FUSEDLOSS_NO_WEIGHTED_KERNELS
  m.impl("weighted_loss", &weighted_loss);
  m.impl("weighted_loss_backward", &weighted_loss_backward);
  m.impl("weighted_loss_backward_", &weighted_loss_backward_);
#endif
}

// No tensor argument to dispatch on.
TORCH_LIBRARY_IMPL(FUSEDLOSS_OPS_NAMESPACE, CompositeExplicitAutograd, m) {
  m.impl("grad_output_history", &grad_output_history);
}

}  // namespace fusedloss
