// The host code shared by the operator libraries (plain_ops.cpp, weighted_ops.cpp):
// tensors in, a LossProblem out, on PyTorch's stable ABI alone, so that one
// compiled library loads on every torch from TORCH_TARGET_VERSION up. The
// schemas, fake kernels and autograd are defined in Python (fusedloss/ops.py).
#pragma once

// The shim declares its CUDA functions (the current stream) only for CUDA builds.
#ifndef USE_CUDA
#define USE_CUDA
#endif
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "launch.h"

namespace fusedloss {
// Internal to each operator library, as the stable ABI's own types are.
namespace {

using torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;
using Shape = std::vector<int64_t>;

// A CUDA call's error as PyTorch's error, with where it happened.
#define FUSEDLOSS_CUDA_CHECK(call)                                                                        \
  do {                                                                                                    \
    const cudaError_t fusedloss_error = (call);                                                           \
    STD_TORCH_CHECK(fusedloss_error == cudaSuccess, "fusedloss: CUDA error: ", cudaGetErrorString(fusedloss_error), \
                    " (", #call, ")");                                                                    \
  } while (0)

// A call of PyTorch's C shim, whose errors it reports by code.
#define FUSEDLOSS_SHIM_CHECK(call) \
  STD_TORCH_CHECK((call) == AOTI_TORCH_SUCCESS, "fusedloss: ", #call, " failed")

inline Shape shape_of(const Tensor& t) {
  const auto sizes = t.sizes();
  return Shape(sizes.begin(), sizes.end());
}

inline Shape strides_of(const Tensor& t) {
  const auto strides = t.strides();
  return Shape(strides.begin(), strides.end());
}

inline int64_t product(const Shape& shape) {
  int64_t n = 1;
  for (const int64_t size : shape) n *= size;
  return n;
}

inline std::string to_string(const Shape& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

inline LossKind parse_loss(const std::string& name) {
#define FUSEDLOSS_PARSE_LOSS(Name, text, param, domain) \
  if (name == text) return LossKind::k##Name;
  FUSEDLOSS_FOR_EACH_LOSS(FUSEDLOSS_PARSE_LOSS)
#undef FUSEDLOSS_PARSE_LOSS
  STD_TORCH_CHECK(false, "fusedloss: unknown loss '", name, "'");
}

// Raises unless the loss takes no parameter or `param` lies in its domain.
inline void check_param(LossKind kind, const std::string& loss, double param) {
#define FUSEDLOSS_CHECK_PARAM(Name, text, name, domain)                                                  \
  if (kind == LossKind::k##Name && name[0] != '\0') {                                                    \
    const bool positive = ParamDomain::domain == ParamDomain::kPositive;                                  \
    STD_TORCH_CHECK(positive ? param > 0 : (param >= 0 && param <= 1), "fusedloss: ", loss, " needs ", name, \
                    positive ? " > 0" : " in [0, 1]", ", got ", param);                                  \
  }
  FUSEDLOSS_FOR_EACH_LOSS(FUSEDLOSS_CHECK_PARAM)
#undef FUSEDLOSS_CHECK_PARAM
}

inline bool parse_mean(const std::string& reduction) {
  STD_TORCH_CHECK(reduction == "mean" || reduction == "sum",
                  "fusedloss: reduction must be 'mean' or 'sum', got '", reduction, "'");
  return reduction == "mean";
}

inline bool is_kernel_dtype(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16 || t == ScalarType::Double;
}

inline DType to_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return DType::kFloat32;
    case ScalarType::Half: return DType::kFloat16;
    case ScalarType::BFloat16: return DType::kBFloat16;
    case ScalarType::Double: return DType::kFloat64;
    default: STD_TORCH_CHECK(false, "fusedloss: unsupported dtype ", static_cast<int>(t));
  }
}

// torch.promote_types over the four dtypes the kernels take.
inline ScalarType promote(ScalarType a, ScalarType b) {
  if (a == b) return a;
  if (a == ScalarType::Double || b == ScalarType::Double) return ScalarType::Double;
  return ScalarType::Float;  // float32 with anything narrower, or float16 with bfloat16
}

inline bool is_16bit(ScalarType t) { return t == ScalarType::Half || t == ScalarType::BFloat16; }

// An aten operator that the stable ops do not wrap, called through the dispatcher.
template <size_t N>
Tensor call_aten(const char* name, const char* overload, std::array<StableIValue, N> stack) {
  FUSEDLOSS_SHIM_CHECK(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION));
  return torch::stable::detail::to<Tensor>(stack[0]);
}

inline Tensor expand(const Tensor& t, const Shape& shape) {
  using torch::stable::detail::from;
  return call_aten<3>("aten::expand", "", {from(t), from(torch::headeronly::IntHeaderOnlyArrayRef(shape)),
                                            from(false)});
}

inline Tensor as_strided(const Tensor& t, const Shape& sizes, const Shape& strides) {
  using torch::stable::detail::from;
  return call_aten<4>("aten::as_strided", "", {from(t), from(torch::headeronly::IntHeaderOnlyArrayRef(sizes)),
                                                from(torch::headeronly::IntHeaderOnlyArrayRef(strides)),
                                                from(std::optional<int64_t>(t.storage_offset()))});
}

// A new contiguous tensor on `like`'s device, without the dispatcher's boxing: this runs on every call.
inline Tensor empty(const Shape& shape, ScalarType dtype, const Tensor& like) {
  Shape strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<int64_t>(shape[i], 1);
  }
  AtenTensorHandle handle = nullptr;
  const int32_t device_type = torch::stable::detail::to<int32_t>(torch::stable::detail::from(like.device().type()));
  const int32_t shim_dtype = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype));
  FUSEDLOSS_SHIM_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(shape.size()), shape.data(),
                                                         strides.data(), shim_dtype, device_type,
                                                         like.get_device_index(), &handle));
  return Tensor(handle);
}

inline Tensor as_dtype(const Tensor& t, ScalarType dtype) {
  return t.scalar_type() == dtype ? t : torch::stable::to(t, dtype);
}

inline cudaStream_t current_stream(const Tensor& t) {
  void* stream = nullptr;
  FUSEDLOSS_SHIM_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream));
  return static_cast<cudaStream_t>(stream);
}

inline bool same_device(const Tensor& a, const Tensor& b) {
  return a.device().type() == b.device().type() && a.get_device_index() == b.get_device_index();
}

inline bool is_aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Contiguous and 16-byte aligned, as the kernels read it (launch.h): a view at
// an odd storage offset is copied, like a non-contiguous one.
inline Tensor as_kernel_layout(const Tensor& t) {
  if (!t.is_contiguous()) return torch::stable::contiguous(t);
  return is_aligned16(t) ? t : torch::stable::clone(t);
}

// Skips each step that has nothing to do: this runs on every call. The kernels
// take fp64 only paired with fp64, so pairs with one fp64 side meet in `common`
// here; other mixed pairs are read as they are.
// With `broadcast` false, an operand that broadcasts keeps its own shape.
inline Tensor as_kernel_operand(const Tensor& t, ScalarType common, const Shape& shape, bool broadcast = true) {
  const bool fp64_pair = common == ScalarType::Double || t.scalar_type() == ScalarType::Double;
  Tensor out = fp64_pair ? as_dtype(t, common) : t;
  if (broadcast && shape_of(out) != shape) out = expand(out, shape);
  return as_kernel_layout(out);
}

// The shape that input and target broadcast to, or PyTorch's error when they don't.
inline Shape broadcast_shape(const Shape& a, const Shape& b) {
  const int64_t rank = static_cast<int64_t>(std::max(a.size(), b.size()));
  const int64_t skip_a = rank - static_cast<int64_t>(a.size());
  const int64_t skip_b = rank - static_cast<int64_t>(b.size());
  Shape shape(static_cast<size_t>(rank));
  for (int64_t i = 0; i < rank; ++i) {
    const int64_t size_a = i < skip_a ? 1 : a[i - skip_a];
    const int64_t size_b = i < skip_b ? 1 : b[i - skip_b];
    if (size_a != size_b && size_a != 1 && size_b != 1) {
      // PyTorch's words alone: STD_TORCH_CHECK would add where it failed.
      throw std::runtime_error("The size of tensor a (" + std::to_string(size_a) +
                               ") must match the size of tensor b (" + std::to_string(size_b) +
                               ") at non-singleton dimension " + std::to_string(i));
    }
    shape[i] = size_a == 1 ? size_b : size_a;
  }
  return shape;
}

// The operand as CUDA autocast hands it to these losses: float32 if 16-bit.
inline Tensor as_autocast_would(const Tensor& t) { return is_16bit(t.scalar_type()) ? as_dtype(t, ScalarType::Float) : t; }

// The operands as the kernels take them: broadcast to one shape (the target may keep its
// own, where the caller lays it out), contiguous (the slower path copies views that are
// not), and both fp64 when either is.
struct Operands {
  Tensor input, target;
  ScalarType loss_dtype;  // what PyTorch returns, and what the kernels write
  Shape shape;
  LossProblem problem;
};

// With `autocast`, the loss is the one of the operands as autocast would cast
// them; the pairs the kernels read directly (reads_under_autocast) are not converted.
// With `target_keeps_its_shape`, a target that broadcasts is not expanded.
inline Operands prepare(const Tensor& input_as_given, const Tensor& target_as_given, const std::string& loss,
                        double param, bool autocast, bool target_keeps_its_shape = false) {
  STD_TORCH_CHECK(is_kernel_dtype(input_as_given.scalar_type()) && is_kernel_dtype(target_as_given.scalar_type()),
                  "fusedloss: the kernels take float16, bfloat16, float32 and float64 operands");
  const bool reads_directly = autocast && reads_under_autocast(to_dtype(input_as_given.scalar_type()),
                                                               to_dtype(target_as_given.scalar_type()));
  const bool converts = autocast && !reads_directly;
  const Tensor input = converts ? as_autocast_would(input_as_given) : input_as_given;
  const Tensor target = converts ? as_autocast_would(target_as_given) : target_as_given;
  STD_TORCH_CHECK(input.is_cuda() && same_device(input, target),
                  "fusedloss: input and target must be on the same CUDA device");
  const LossKind kind = parse_loss(loss);
  check_param(kind, loss, param);
  // PyTorch computes Huber in the input's dtype (the target is converted to it),
  // the other losses in the promoted dtype.
  const ScalarType common = reads_directly             ? ScalarType::Float
                            : kind == LossKind::kHuber ? input.scalar_type()
                                                       : promote(input.scalar_type(), target.scalar_type());
  Operands ops;
  ops.loss_dtype = common;
  const Shape input_shape = shape_of(input);
  const Shape target_shape = shape_of(target);
  ops.shape = input_shape == target_shape ? input_shape : broadcast_shape(input_shape, target_shape);
  ops.input = as_kernel_operand(input, common, ops.shape);
  ops.target = as_kernel_operand(target, common, ops.shape, !target_keeps_its_shape);
  ops.problem = LossProblem{kind,
                            param,
                            ops.input.data_ptr(),
                            to_dtype(ops.input.scalar_type()),
                            ops.target.data_ptr(),
                            to_dtype(ops.target.scalar_type()),
                            product(ops.shape),
                            reads_directly};
  return ops;
}

// A gradient buffer of `shape`, or an empty tensor when that gradient is not wanted.
inline Tensor maybe_grad_buffer(bool wanted, const Shape& shape, ScalarType dtype, const Tensor& like) {
  return empty(wanted ? shape : Shape{0}, dtype, like);
}

inline void* data_or_null(const Tensor& t) { return t.numel() > 0 ? t.data_ptr() : nullptr; }

inline void check_grad_output(const Tensor& grad_output, const Tensor& input, const char* op) {
  STD_TORCH_CHECK(same_device(grad_output, input) && grad_output.numel() == 1, "fusedloss: ", op,
                  " takes a one-element grad_output on the operands' device");
}

// Two doubles per slot: the grad_output the last backward in that slot saw, and 1
// where it was not the one that backward's forward expected, else 0
// (fusedloss/grad_output_prediction.py); 1 and 0 until then. Host memory that the
// kernels write and the host reads without a sync: mapped and portable, so under
// unified addressing its address is valid on every device. Each operator library
// has its own, allocated on first use and never freed.
constexpr int64_t kHistorySlots = 64;

inline double* history_table() {
  static double* const table = [] {
    void* p = nullptr;
    FUSEDLOSS_CUDA_CHECK(cudaHostAlloc(&p, kHistorySlots * 2 * sizeof(double), cudaHostAllocMapped | cudaHostAllocPortable));
    double* notes = static_cast<double*>(p);
    for (int64_t slot = 0; slot < kHistorySlots; ++slot) {
      notes[2 * slot] = 1.0;
      notes[2 * slot + 1] = 0.0;
    }
    return notes;
  }();
  return table;
}

inline Tensor grad_output_history() {
  const int64_t sizes[] = {kHistorySlots, 2};
  const int64_t strides[] = {2, 1};
  return torch::stable::from_blob(history_table(), sizes, strides,
                                  torch::stable::Device(torch::headeronly::DeviceType::CPU), ScalarType::Double);
}

inline double* history_slot(int64_t slot) {
  STD_TORCH_CHECK(slot < kHistorySlots, "fusedloss: history slot ", slot, " out of range");
  return slot < 0 ? nullptr : history_table() + 2 * slot;
}

// A backward that notes grad_output in `slot`, and with `correct_in_place` corrects
// gradients the forward wrote for another grad_output (BackwardOptions).
inline BackwardOptions backward_options(int64_t slot, bool correct_in_place) {
  BackwardOptions options;
  options.history = history_slot(slot);
  options.correct_in_place = correct_in_place;
  if (correct_in_place) {
    int device = 0;
    FUSEDLOSS_CUDA_CHECK(cudaGetDevice(&device));
    FUSEDLOSS_CUDA_CHECK(cudaDeviceGetAttribute(&options.num_sms, cudaDevAttrMultiProcessorCount, device));
  }
  return options;
}

// A gradient buffer that the forward wrote, as the kernels write into it: of the
// operand's shape as they read it, in `dtype`; null when it is empty (not wanted).
inline void* written_gradient(const Tensor& grad, const Tensor& operand, ScalarType dtype) {
  if (grad.numel() == 0) return nullptr;
  STD_TORCH_CHECK(same_device(grad, operand) && shape_of(grad) == shape_of(operand) && grad.scalar_type() == dtype &&
                      grad.is_contiguous() && is_aligned16(grad),
                  "fusedloss: a gradient to correct must be the forward's own buffer: contiguous, of shape ",
                  to_string(shape_of(operand)), " and the operand's dtype, on its device");
  return grad.data_ptr();
}

inline void* written_gradient(const Tensor& grad, const Tensor& operand) {
  return written_gradient(grad, operand, operand.scalar_type());
}

// A weight as the weighted kernels read it (ElementWeight): in the loss's math
// dtype, contiguous in its own shape when the loss's dimensions fall into as
// many runs as the kernels take; other weights are expanded first.
struct KernelWeight {
  Tensor tensor;  // no weight: undefined
  ElementWeight layout;
};

// `stored` (a tensor that broadcasts to `shape`, in the dtype the kernels read) laid out as
// a weight is: in its own shape when the loss's dimensions fall into as many runs as the
// kernels take, else expanded first over some of them.
inline KernelWeight laid_out(const Tensor& stored_as_given, const Shape& shape) {
  KernelWeight out;
  const int64_t rank = static_cast<int64_t>(shape.size());
  const int64_t skip = rank - stored_as_given.dim();
  // Its size along each of the loss's dimensions (1 where it broadcasts).
  Shape sizes(rank, 1);
  for (int64_t i = skip; i < rank; ++i) sizes[i] = stored_as_given.size(i - skip);
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
  const int64_t numel = product(shape);
  if (numel == 0) runs.clear();  // nothing to read, and no run to divide by
  const bool index_32bit = numel <= static_cast<int64_t>(std::numeric_limits<uint32_t>::max());
  Tensor stored = stored_as_given;
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
    STD_TORCH_CHECK(merges <= static_cast<int64_t>(between.size()), "fusedloss: internal error in laid_out");
    for (int64_t m = 0; m < merges; ++m) {
      for (int64_t i = between[m].first_dim; i <= between[m].last_dim; ++i) sizes[i] = shape[i];
    }
    runs = runs_of();
    STD_TORCH_CHECK(static_cast<int64_t>(runs.size()) <= max_runs, "fusedloss: internal error in laid_out");
    stored = expand(stored, sizes);
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

inline KernelWeight as_kernel_weight(const std::optional<Tensor>& weight, const Shape& shape, ScalarType math_dtype,
                                     const Tensor& like) {
  if (!weight.has_value() || !weight->defined()) return {};
  const Tensor& w = *weight;
  STD_TORCH_CHECK(same_device(w, like), "fusedloss: the weight must be on the operands' device");
  const int64_t skip = static_cast<int64_t>(shape.size()) - w.dim();
  bool fits = skip >= 0;
  for (int64_t i = std::max<int64_t>(skip, 0); fits && i < static_cast<int64_t>(shape.size()); ++i) {
    fits = w.size(i - skip) == shape[i] || w.size(i - skip) == 1;
  }
  STD_TORCH_CHECK(fits, "fusedloss: a weight of shape ", to_string(shape_of(w)), " does not broadcast to the loss's "
                  "shape ", to_string(shape));
  return laid_out(as_dtype(w, math_dtype), shape);
}

}  // namespace
}  // namespace fusedloss
