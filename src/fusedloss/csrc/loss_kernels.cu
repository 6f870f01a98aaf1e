// Single-pass loss kernels. One generic kernel per job (reduce, pointwise,
// pointwise backward), parameterised by the loss and the dtype pair.
#include <algorithm>

#include "launch.h"
#include "dtypes.cuh"
#include "losses.cuh"
#include "elementwise.cuh"

namespace fusedloss {

// About 128 bytes of loads in flight per thread hide HBM latency without
// spilling at 64 registers.
constexpr int unroll_for(int bytes_per_chunk) { return 128 / bytes_per_chunk > 1 ? 128 / bytes_per_chunk : 1; }

// The vector width covers 16 bytes of the narrower operand.
template <class Loss, typename In, typename Tgt>
struct PairOp {
  using T = opmath_t<In, Tgt>;
  using InT = In;
  using TgtT = Tgt;
  using Out = std::conditional_t<Loss::kOutputHasInputDtype, In, typename Promote<In, Tgt>::type>;
  static constexpr int kVec = 16 / (sizeof(In) < sizeof(Tgt) ? sizeof(In) : sizeof(Tgt));
  static constexpr int kUnroll = unroll_for(kVec * int(sizeof(In) + sizeof(Tgt)));

  template <int W>
  struct Chunk {
    alignas(16) In input[W];
    alignas(16) Tgt target[W];
    alignas(16) Out grad_output[W];  // used by the pointwise backward only
  };

  const In* __restrict__ input;
  const Tgt* __restrict__ target;
  LossParam<T> param;              // in the loss's dtype
  LossParam<T> input_grad_param;   // in the dtype d loss / d input is computed in
  LossParam<T> target_grad_param;  // in the dtype d loss / d target is computed in

  // The dtypes PyTorch computes the gradients in (see Loss::kGradInOwnDtype).
  using InputGradDtype = std::conditional_t<Loss::kGradInOwnDtype, In, Out>;
  using TargetGradDtype = std::conditional_t<Loss::kGradInOwnDtype, Tgt, Out>;

  // v as PyTorch's kernels see it when they compute in dtype D (Huber's forward
  // narrows the target to the input's dtype; an fp16 gradient sees 1e30 as inf).
  template <typename D, typename V>
  __device__ __forceinline__ static T in_dtype(const V& v) {
    if constexpr (std::is_same_v<V, D> || sizeof(V) < sizeof(D)) {
      return to_opmath(v);
    } else {
      return to_opmath(Convert<D>::from(to_opmath(v)));
    }
  }
  // input - target computed in dtype D, held as PyTorch's fp16 kernels hold it.
  template <typename D>
  __device__ __forceinline__ static T diff_in(const In& x, const Tgt& y) {
    return fp16_intermediate<D>(in_dtype<D>(x) - in_dtype<D>(y));
  }
  __device__ __forceinline__ T value(const In& x, const Tgt& y) const {
    return Loss::template value<Out>(diff_in<Out>(x, y), param);
  }
  __device__ __forceinline__ T input_grad(const In& x, const Tgt& y) const {
    return Loss::grad(diff_in<InputGradDtype>(x, y), input_grad_param);
  }
  __device__ __forceinline__ T target_grad(const In& x, const Tgt& y) const {
    if constexpr (std::is_same_v<InputGradDtype, TargetGradDtype>) {
      return -input_grad(x, y);  // the same computation: let the compiler share it
    } else {
      return -Loss::grad(diff_in<TargetGradDtype>(x, y), target_grad_param);
    }
  }
  template <int W>
  __device__ __forceinline__ void load_pair(Chunk<W>& c, int64_t first) const {
    load_chunk(c.input, input, first);
    load_chunk(c.target, target, first);
  }
};

// Loss partial sums, plus the scaled gradient(s) when their pointers are set.
template <class Loss, typename In, typename Tgt>
struct ReducedLossOp : PairOp<Loss, In, Tgt> {
  using Base = PairOp<Loss, In, Tgt>;
  using typename Base::T;
  template <int W>
  using Chunk = typename Base::template Chunk<W>;

  In* __restrict__ grad_input;
  Tgt* __restrict__ grad_target;
  T grad_scale;
  double sum;

  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& c, int64_t first) const { this->load_pair(c, first); }

  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& c, int64_t first) {
    T chunk_sum = 0;
#pragma unroll
    for (int k = 0; k < W; ++k) chunk_sum += this->value(c.input[k], c.target[k]);
    sum += double(chunk_sum);
    // One rounding from the fp32 product into each gradient's storage dtype.
    if (grad_input != nullptr) {
      alignas(16) In gi[W];
#pragma unroll
      for (int k = 0; k < W; ++k) {
        gi[k] = Convert<In>::from(this->input_grad(c.input[k], c.target[k]) * grad_scale);
      }
      store_chunk_streaming(grad_input, first, gi);
    }
    if (grad_target != nullptr) {
      alignas(16) Tgt gt[W];
#pragma unroll
      for (int k = 0; k < W; ++k) {
        gt[k] = Convert<Tgt>::from(this->target_grad(c.input[k], c.target[k]) * grad_scale);
      }
      store_chunk_streaming(grad_target, first, gt);
    }
  }
};

template <class Loss, typename In, typename Tgt>
struct PointwiseLossOp : PairOp<Loss, In, Tgt> {
  using Base = PairOp<Loss, In, Tgt>;
  using typename Base::T;
  using typename Base::Out;
  template <int W>
  using Chunk = typename Base::template Chunk<W>;

  Out* __restrict__ out;

  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& c, int64_t first) const { this->load_pair(c, first); }

  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& c, int64_t first) const {
    alignas(16) Out values[W];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      values[k] = Convert<Out>::from(this->value(c.input[k], c.target[k]));
    }
    store_chunk(out, first, values);
  }
};

template <class Loss, typename In, typename Tgt>
struct PointwiseLossBackwardOp : PairOp<Loss, In, Tgt> {
  using Base = PairOp<Loss, In, Tgt>;
  using typename Base::T;
  using typename Base::Out;
  template <int W>
  using Chunk = typename Base::template Chunk<W>;
  static constexpr int kUnroll = unroll_for(Base::kVec * int(sizeof(In) + sizeof(Tgt) + sizeof(Out)));

  const Out* __restrict__ grad_output;
  bool grad_output_is_scalar;
  In* __restrict__ grad_input;
  Tgt* __restrict__ grad_target;

  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& c, int64_t first) const {
    this->load_pair(c, first);
    if (!grad_output_is_scalar) load_chunk(c.grad_output, grad_output, first);
  }

  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& c, int64_t first) const {
    alignas(16) In gi[W];
    alignas(16) Tgt gt[W];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const T go = to_opmath(grad_output_is_scalar ? grad_output[0] : c.grad_output[k]);
      if (grad_input != nullptr) gi[k] = Convert<In>::from(this->input_grad(c.input[k], c.target[k]) * go);
      if (grad_target != nullptr) gt[k] = Convert<Tgt>::from(this->target_grad(c.input[k], c.target[k]) * go);
    }
    if (grad_input != nullptr) store_chunk(grad_input, first, gi);
    if (grad_target != nullptr) store_chunk(grad_target, first, gt);
  }
};

template <typename S>
struct ScaleOp {
  using T = opmath_t<S, S>;
  static constexpr int kVec = 16 / sizeof(S);
  static constexpr int kUnroll = unroll_for(2 * kVec * int(sizeof(S)));
  template <int W>
  struct Chunk {
    alignas(16) S data[W];
  };

  S* __restrict__ data;
  T scale;

  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& c, int64_t first) const { load_chunk(c.data, data, first); }
  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& c, int64_t first) const {
    alignas(16) S scaled[W];
#pragma unroll
    for (int k = 0; k < W; ++k) scaled[k] = Convert<S>::from(to_opmath(c.data[k]) * scale);
    store_chunk(data, first, scaled);
  }
};

template <class Op>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm) reduced_loss_kernel(Op op, int64_t n, int64_t elements_per_block,
                                                                     bool vectorized, double* block_sums) {
  op.sum = 0.0;
  visit_block_range(op, n, elements_per_block, vectorized);
  const double total = block_sum(op.sum);
  if (threadIdx.x == 0) block_sums[blockIdx.x] = total;
}

template <class Op>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm) elementwise_kernel(Op op, int64_t n, int64_t elements_per_block,
                                                                    bool vectorized) {
  visit_block_range(op, n, elements_per_block, vectorized);
}

template <typename Out>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm) finish_reduction_kernel(const double* block_sums,
                                                                         int num_blocks, int64_t numel,
                                                                         bool mean, Out* out) {
  double v = 0.0;
  for (int i = threadIdx.x; i < num_blocks; i += kBlockThreads) v += block_sums[i];
  v = block_sum(v);
  // An empty mean is 0 / 0 = NaN, as in PyTorch.
  if (threadIdx.x == 0) *out = Convert<Out>::from(mean ? v / double(numel) : v);
}

__device__ __forceinline__ double load_as_double(const void* p, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return *static_cast<const float*>(p);
    case DType::kFloat16: return __half2float(*static_cast<const __half*>(p));
    case DType::kBFloat16: return __bfloat162float(*static_cast<const __nv_bfloat16*>(p));
    default: return *static_cast<const double*>(p);
  }
}

// One wave of blocks, each walking every gridDim.x-th range of the schedule:
// when scale == 1 (the common loss.backward()) the whole launch is one wave
// that exits at once, not tens of thousands of blocks.
template <typename S>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm) scale_in_place_kernel(S* data, int64_t n, int64_t elements_per_block,
                                                                       int64_t num_ranges, bool vectorized,
                                                                       const void* scale, DType scale_dtype) {
  const double s = load_as_double(scale, scale_dtype);
  if (s == 1.0) return;
  ScaleOp<S> op{data, static_cast<typename ScaleOp<S>::T>(s)};
  for (int64_t range = blockIdx.x; range < num_ranges; range += gridDim.x) {
    visit_block_range(op, n, elements_per_block, vectorized, range);
  }
}

// ---- host-side dispatch -------------------------------------------------

template <class F>
void with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat16: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
    case DType::kFloat64: f(double{}); break;
  }
}

template <class F>
void with_loss(LossKind loss, F&& f) {
  switch (loss) {
    case LossKind::kMse: f(MseLoss{}); break;
    case LossKind::kL1: f(L1Loss{}); break;
    case LossKind::kSmoothL1: f(SmoothL1Loss{}); break;
    case LossKind::kHuber: f(HuberLoss{}); break;
  }
}

// Calls f(Loss{}, In{}, Tgt{}) for the problem's loss and dtype pair. fp64 is
// taken only paired with fp64; the host code converts the other operand.
template <class F>
cudaError_t with_problem_types(const LossProblem& p, F&& f) {
  cudaError_t err = cudaErrorInvalidValue;
  with_dtype(p.input_dtype, [&](auto in) {
    with_dtype(p.target_dtype, [&](auto tgt) {
      using In = decltype(in);
      using Tgt = decltype(tgt);
      if constexpr (std::is_same_v<In, double> == std::is_same_v<Tgt, double>) {
        with_loss(p.loss, [&](auto loss) { err = f(loss, in, tgt); });
      }
    });
  });
  return err;
}

// beta or delta converted to dtype D, as PyTorch does (1e6 is inf in fp16).
template <typename D, typename T>
LossParam<T> loss_param_in(double param) {
  const T value = to_opmath(Convert<D>::from(static_cast<T>(param)));
  return LossParam<T>{value, value != T(0) ? T(1) / value : T(0)};
}

template <class Op>
Op make_op(const LossProblem& p) {
  Op op{};
  op.input = static_cast<const typename Op::InT*>(p.input);
  op.target = static_cast<const typename Op::TgtT*>(p.target);
  using T = typename Op::T;
  op.param = loss_param_in<typename Op::Out, T>(p.param);
  op.input_grad_param = loss_param_in<typename Op::InputGradDtype, T>(p.param);
  op.target_grad_param = loss_param_in<typename Op::TargetGradDtype, T>(p.param);
  return op;
}

int reduced_loss_num_blocks(const LossProblem& p) {
  int blocks = 0;
  with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    blocks = make_schedule<ReducedLossOp<decltype(loss), decltype(in), decltype(tgt)>>(p.numel, p.num_sms).blocks;
    return cudaSuccess;
  });
  return blocks;
}

cudaError_t launch_reduced_loss(const LossProblem& p, double* block_sums, void* grad_input,
                                void* grad_target, double grad_scale, cudaStream_t stream) {
  return with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    using In = decltype(in);
    using Tgt = decltype(tgt);
    using Op = ReducedLossOp<decltype(loss), In, Tgt>;
    const Schedule schedule = make_schedule<Op>(p.numel, p.num_sms);
    if (schedule.blocks == 0) return cudaSuccess;
    Op op = make_op<Op>(p);
    op.grad_input = static_cast<In*>(grad_input);
    op.grad_target = static_cast<Tgt*>(grad_target);
    op.grad_scale = static_cast<typename Op::T>(grad_scale);
    const bool vectorized = is_aligned16(p.input) && is_aligned16(p.target) &&
                            is_aligned16(grad_input) && is_aligned16(grad_target);
    reduced_loss_kernel<<<schedule.blocks, kBlockThreads, 0, stream>>>(op, p.numel, schedule.elements_per_block,
                                                                      vectorized, block_sums);
    return cudaGetLastError();
  });
}

cudaError_t launch_finish_reduction(const double* block_sums, int num_blocks, int64_t numel, bool mean,
                                    void* out, DType out_dtype, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  with_dtype(out_dtype, [&](auto o) {
    using Out = decltype(o);
    finish_reduction_kernel<<<1, kBlockThreads, 0, stream>>>(block_sums, num_blocks, numel, mean,
                                                            static_cast<Out*>(out));
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t launch_pointwise_loss(const LossProblem& p, void* out, cudaStream_t stream) {
  return with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    using Op = PointwiseLossOp<decltype(loss), decltype(in), decltype(tgt)>;
    const Schedule schedule = make_schedule<Op>(p.numel, p.num_sms);
    if (schedule.blocks == 0) return cudaSuccess;
    Op op = make_op<Op>(p);
    op.out = static_cast<typename Op::Out*>(out);
    const bool vectorized = is_aligned16(p.input) && is_aligned16(p.target) && is_aligned16(out);
    elementwise_kernel<<<schedule.blocks, kBlockThreads, 0, stream>>>(op, p.numel, schedule.elements_per_block,
                                                                     vectorized);
    return cudaGetLastError();
  });
}

cudaError_t launch_pointwise_loss_backward(const LossProblem& p, const void* grad_output,
                                           bool grad_output_is_scalar, void* grad_input,
                                           void* grad_target, cudaStream_t stream) {
  return with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    using In = decltype(in);
    using Tgt = decltype(tgt);
    using Op = PointwiseLossBackwardOp<decltype(loss), In, Tgt>;
    const Schedule schedule = make_schedule<Op>(p.numel, p.num_sms);
    if (schedule.blocks == 0) return cudaSuccess;
    Op op = make_op<Op>(p);
    op.grad_output = static_cast<const typename Op::Out*>(grad_output);
    op.grad_output_is_scalar = grad_output_is_scalar;
    op.grad_input = static_cast<In*>(grad_input);
    op.grad_target = static_cast<Tgt*>(grad_target);
    const bool vectorized = is_aligned16(p.input) && is_aligned16(p.target) &&
                            (grad_output_is_scalar || is_aligned16(grad_output)) &&
                            is_aligned16(grad_input) && is_aligned16(grad_target);
    elementwise_kernel<<<schedule.blocks, kBlockThreads, 0, stream>>>(op, p.numel, schedule.elements_per_block,
                                                                     vectorized);
    return cudaGetLastError();
  });
}

cudaError_t launch_scale_in_place(void* data, DType dtype, int64_t numel, const void* scale,
                                  DType scale_dtype, int num_sms, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  with_dtype(dtype, [&](auto s) {
    using S = decltype(s);
    const Schedule schedule = make_schedule<ScaleOp<S>>(numel, num_sms);
    if (schedule.blocks == 0) return;
    const int wave = std::min(schedule.blocks, num_sms * kBlocksPerSm);
    scale_in_place_kernel<<<wave, kBlockThreads, 0, stream>>>(static_cast<S*>(data), numel,
                                                             schedule.elements_per_block, schedule.blocks,
                                                             is_aligned16(data), scale, scale_dtype);
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace fusedloss
