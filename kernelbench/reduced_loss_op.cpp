// The KernelBench files' operator: fusedloss's mean or sum reduction (launch.h)
// behind PyTorch's classic C++ API, which the files' floor, PyTorch 2.2, has. The
// fusedloss package registers its operators on the stable ABI instead
// (src/fusedloss/csrc/glue.h), which PyTorch 2.2 lacks. Each file compiles it with
// one loss and float32 alone (specialize.py), the only ones it then accepts.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "launch.h"

namespace fusedloss {
namespace {

LossKind parse_loss(c10::string_view name) {
#define FUSEDLOSS_PARSE_LOSS(Name, text, param, domain) \
  if (name == text) return LossKind::k##Name;
  FUSEDLOSS_FOR_EACH_LOSS(FUSEDLOSS_PARSE_LOSS)
#undef FUSEDLOSS_PARSE_LOSS
  TORCH_CHECK(false, "unknown loss '", name, "'");
}

// Contiguous and 16-byte aligned, as the kernels read it.
at::Tensor as_kernel_layout(const at::Tensor& t) {
  const at::Tensor out = t.contiguous();
  return reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 ? out : out.clone();
}

// The loss of two float32 CUDA operands of one shape, reduced to a 0-d float32 tensor.
at::Tensor reduced_loss(const at::Tensor& input_as_given, const at::Tensor& target_as_given, c10::string_view loss,
                        double param, c10::string_view reduction) {
  TORCH_CHECK(input_as_given.is_cuda() && input_as_given.device() == target_as_given.device() &&
                  input_as_given.sizes() == target_as_given.sizes() &&
                  input_as_given.scalar_type() == at::kFloat && target_as_given.scalar_type() == at::kFloat,
              "reduced_loss takes two float32 CUDA tensors of one shape on one device");
  TORCH_CHECK(reduction == "mean" || reduction == "sum", "reduction must be 'mean' or 'sum'");
  const c10::cuda::CUDAGuard guard(input_as_given.device());
  const at::Tensor input = as_kernel_layout(input_as_given);
  const at::Tensor target = as_kernel_layout(target_as_given);
  const LossProblem problem{parse_loss(loss), param, input.data_ptr(), DType::kFloat32, target.data_ptr(),
                            DType::kFloat32, input.numel(), false};
  at::Tensor out = at::empty({}, input.options());
  const int64_t scratch_bytes = reduced_loss_scratch_bytes(problem, false);
  const at::Tensor scratch =
      scratch_bytes > 0 ? at::empty({scratch_bytes}, input.options().dtype(at::kByte)) : at::Tensor();
  C10_CUDA_CHECK(launch_reduced_loss(problem, scratch.defined() ? scratch.data_ptr() : nullptr, nullptr, nullptr,
                                     reduction == "mean", out.data_ptr(), c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(FUSEDLOSS_OPS_NAMESPACE, CUDA, m) { m.impl("reduced_loss", &reduced_loss); }

}  // namespace fusedloss
